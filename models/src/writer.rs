//! Writing safetensors files: outputs of `castor eval`, and checkpoints.
//!
//! Files are written atomically: to a temporary file beside the target, flushed to disk, then
//! renamed over it, so a crash or an error leaves either the old file or the new one, never a
//! half-written file.

use crate::ModelError;
use castor_ir::{DType, Tensor, TensorData};
use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;

/// Writes named tensors, each in its own dtype, with the `{"format": "pt"}` metadata that
/// transformers expects.
pub fn write_safetensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<(), ModelError> {
    let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| {
            let (dtype, data) = encode(t);
            (name.to_string(), dtype, t.shape().dims().to_vec(), data)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, dtype, shape, data)| {
            TensorView::new(*dtype, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| ModelError::Write {
                    path: path.to_path_buf(),
                    message: format!("tensor `{name}`: {e}"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let serialized =
        safetensors::serialize(views, Some(metadata)).map_err(|e| ModelError::Write {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    write_atomically(path, &serialized)
}

/// Writes `data` to `path` through a temporary file, fsync and rename.
pub fn write_atomically(path: &Path, data: &[u8]) -> Result<(), ModelError> {
    let io = |source: std::io::Error| ModelError::Write {
        path: path.to_path_buf(),
        message: source.to_string(),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)
}

fn encode(t: &Tensor) -> (Dtype, Vec<u8>) {
    match (t.dtype(), t.data()) {
        (DType::F32, TensorData::F32(v)) => {
            (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
        (DType::F16, TensorData::F32(v)) => (
            Dtype::F16,
            v.iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
        ),
        (DType::BF16, TensorData::F32(v)) => (
            Dtype::BF16,
            v.iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
        ),
        (DType::I32, TensorData::I64(v)) => (
            Dtype::I32,
            v.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
        ),
        (_, TensorData::I64(v)) => (Dtype::I64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        (_, TensorData::Bool(v)) => (Dtype::BOOL, v.iter().map(|&b| b as u8).collect()),
        (_, TensorData::F32(v)) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_says_write_and_names_the_path_and_the_os_error_once() {
        let path = Path::new("/nonexistent-castor-folder/out.safetensors");
        let e = write_atomically(path, b"x").unwrap_err();
        assert!(matches!(e, ModelError::Write { .. }));
        let text = e.to_string();
        assert!(
            text.starts_with("cannot write `/nonexistent-castor-folder/out.safetensors`: "),
            "{text}"
        );
        assert_eq!(text.matches("os error").count(), 1, "{text}");
        // The message carries the OS error; nothing is left as a source to print it again.
        assert!(std::error::Error::source(&e).is_none());
    }
}
