//! Writing safetensors files: outputs of `castor eval`, and checkpoints.
//!
//! Files are written atomically: to a temporary file beside the target, flushed to disk, then
//! renamed over it, so a crash or an error leaves either the old file or the new one, never a
//! half-written file.

use crate::ModelError;
use castor_ir::fp8::{Fp8Format, Overflow};
use castor_ir::{DType, Tensor, TensorData};
use half::{bf16, f16};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// Writes named tensors, each in its own dtype, with the `{"format": "pt"}` metadata that
/// transformers expects.
///
/// The file is streamed: the header is computed from the tensors' shapes, then each tensor is
/// encoded and written a chunk at a time, so saving needs no buffer of the whole file (a 27 GB
/// master checkpoint does not need another 27 GB of memory).
pub fn write_safetensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<(), ModelError> {
    let bad = |message: String| ModelError::Write {
        path: path.to_path_buf(),
        message,
    };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0u64;
    for (name, t) in tensors {
        if name.is_empty() || *name == "__metadata__" {
            return Err(bad(format!("`{name}` is not a tensor name")));
        }
        let (dtype, elem) = storage(t);
        let bytes = t.shape().numel().unwrap_or(0) as u64 * elem as u64;
        let entry = serde_json::json!({
            "dtype": dtype,
            "shape": t.shape().dims(),
            "data_offsets": [offset, offset + bytes],
        });
        if header.insert(name.to_string(), entry).is_some() {
            return Err(bad(format!("tensor `{name}` is given twice")));
        }
        offset += bytes;
    }
    let mut json = serde_json::to_vec(&header).map_err(|e| bad(e.to_string()))?;
    // The data starts 8-byte aligned, as the safetensors writer pads it.
    while (8 + json.len()) % 8 != 0 {
        json.push(b' ');
    }
    write_atomically_with(path, |w| {
        w.write_all(&(json.len() as u64).to_le_bytes())?;
        w.write_all(&json)?;
        let mut chunk = Vec::with_capacity(CHUNK_ELEMENTS * 8);
        for (_, t) in tensors {
            write_data(t, w, &mut chunk)?;
        }
        Ok(())
    })
}

/// Elements encoded per write while streaming a tensor.
const CHUNK_ELEMENTS: usize = 1 << 16;

/// Writes `data` to `path` through a temporary file, fsync and rename.
pub fn write_atomically(path: &Path, data: &[u8]) -> Result<(), ModelError> {
    write_atomically_with(path, |w| w.write_all(data))
}

/// Writes a file through `write`, into a temporary file beside `path` that is flushed, synced
/// and renamed over it (and the rename synced), so a crash or an error leaves the old file or
/// the new one, never a half-written file.
pub fn write_atomically_with(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), ModelError> {
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
        let mut w = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        write(&mut w)?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
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

/// The safetensors dtype a tensor is stored as, and its element size.
fn storage(t: &Tensor) -> (&'static str, usize) {
    match (t.dtype(), t.data()) {
        (DType::F32, TensorData::F32(_)) => ("F32", 4),
        (DType::F16, TensorData::F32(_)) => ("F16", 2),
        (DType::BF16, TensorData::F32(_)) => ("BF16", 2),
        (DType::F8E4M3, TensorData::F32(_)) => ("F8_E4M3", 1),
        (DType::F8E5M2, TensorData::F32(_)) => ("F8_E5M2", 1),
        (DType::I32, TensorData::I64(_)) => ("I32", 4),
        (_, TensorData::I64(_)) => ("I64", 8),
        (_, TensorData::Bool(_)) => ("BOOL", 1),
        (_, TensorData::U8(_)) => ("U8", 1),
        (_, TensorData::F32(_)) => ("F32", 4),
    }
}

/// Writes a tensor's bytes (little-endian, in the dtype [`storage`] names), a chunk of
/// elements at a time through `chunk`.
fn write_data(t: &Tensor, w: &mut impl Write, chunk: &mut Vec<u8>) -> std::io::Result<()> {
    fn each<T: Copy>(
        v: &[T],
        w: &mut impl Write,
        chunk: &mut Vec<u8>,
        put: impl Fn(T, &mut Vec<u8>),
    ) -> std::io::Result<()> {
        for part in v.chunks(CHUNK_ELEMENTS) {
            chunk.clear();
            for &x in part {
                put(x, chunk);
            }
            w.write_all(chunk)?;
        }
        Ok(())
    }
    match (t.dtype(), t.data()) {
        (DType::F16, TensorData::F32(v)) => {
            each(v, w, chunk, |x, c| c.extend(f16::from_f32(x).to_le_bytes()))
        }
        (DType::BF16, TensorData::F32(v)) => each(v, w, chunk, |x, c| {
            c.extend(bf16::from_f32(x).to_le_bytes())
        }),
        // An FP8 tensor's values are values of its format: each encodes exactly (E5M2's
        // infinities too, so not saturating); NaN as 0x7F | sign.
        (DType::F8E4M3, TensorData::F32(v)) => each(v, w, chunk, |x, c| {
            c.push(Fp8Format::E4M3.encode(x, Overflow::NonFinite))
        }),
        (DType::F8E5M2, TensorData::F32(v)) => each(v, w, chunk, |x, c| {
            c.push(Fp8Format::E5M2.encode(x, Overflow::NonFinite))
        }),
        (_, TensorData::F32(v)) => each(v, w, chunk, |x, c| c.extend(x.to_le_bytes())),
        (DType::I32, TensorData::I64(v)) => {
            each(v, w, chunk, |x, c| c.extend((x as i32).to_le_bytes()))
        }
        (_, TensorData::I64(v)) => each(v, w, chunk, |x, c| c.extend(x.to_le_bytes())),
        (_, TensorData::Bool(v)) => each(v, w, chunk, |x, c| c.push(u8::from(x))),
        (_, TensorData::U8(v)) => w.write_all(v),
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
