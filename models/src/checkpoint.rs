//! A Hugging Face checkpoint folder: config.json plus one safetensors file or a sharded set
//! described by `model.safetensors.index.json`.
//!
//! Like transformers, a single `model.safetensors` wins over an index. The index is a
//! contract: each shard it names must be a plain file name in the folder (never a path that
//! could leave it), every tensor it lists must be in the shard it names, every tensor in a
//! shard must be listed, and no tensor may be stored twice. Shard names are checked as names,
//! not by resolving links, because the Hugging Face cache stores files as links into a blob
//! folder.

use crate::error::ModelError;
use crate::safetensors::{Entries, SafetensorsFile, TensorInfo};
use castor_ir::Tensor;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

pub const CONFIG_FILE: &str = "config.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// An opened checkpoint: every file mapped and validated, tensor names resolved to files.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    index: Option<PathBuf>,
    files: Vec<SafetensorsFile>,
    /// Tensor name -> position in `files`.
    location: BTreeMap<String, usize>,
}

impl Checkpoint {
    /// Opens a checkpoint folder (config.json is not read here; see [`crate::Model::load`]).
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint, ModelError> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.is_dir() {
            return Err(ModelError::NotACheckpoint {
                path: dir,
                message: "not a folder".into(),
            });
        }
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        if single.is_file() {
            let file = SafetensorsFile::open(&single)?;
            let location = file.names().map(|n| (n.to_string(), 0)).collect();
            return Ok(Checkpoint {
                dir,
                index: None,
                files: vec![file],
                location,
            });
        }
        if index.is_file() {
            return Self::open_sharded(dir, index);
        }
        let mut message = format!("it has neither `{SINGLE_FILE}` nor `{INDEX_FILE}`");
        if dir.join("pytorch_model.bin").exists()
            || dir.join("pytorch_model.bin.index.json").exists()
        {
            message.push_str(" (PyTorch pickle checkpoints are not read; convert to safetensors)");
        }
        Err(ModelError::NotACheckpoint { path: dir, message })
    }

    fn open_sharded(dir: PathBuf, index: PathBuf) -> Result<Checkpoint, ModelError> {
        let text = std::fs::read(&index).map_err(|source| ModelError::Io {
            path: index.clone(),
            source,
        })?;
        let err = |message: String| ModelError::Index {
            file: index.clone(),
            message,
        };
        let top: Entries =
            serde_json::from_slice(&text).map_err(|e| err(format!("not a JSON object: {e}")))?;
        let weight_map = top
            .0
            .into_iter()
            .find(|(k, _)| k == "weight_map")
            .map(|(_, v)| v)
            .ok_or_else(|| err("has no `weight_map`".into()))?;
        let weight_map: Entries = serde_json::from_value(weight_map)
            .map_err(|e| err(format!("`weight_map` is not an object: {e}")))?;

        // name -> shard file name, in listing order; duplicates and bad names rejected.
        let mut listed: BTreeMap<String, String> = BTreeMap::new();
        for (tensor, shard) in weight_map.0 {
            let shard = match shard {
                serde_json::Value::String(s) => s,
                other => {
                    return Err(err(format!(
                        "`weight_map` entry `{tensor}` must be a file name, found {other}"
                    )))
                }
            };
            if !is_plain_file_name(&shard) {
                return Err(ModelError::UnsafeShardPath {
                    index: index.clone(),
                    shard,
                    tensor,
                });
            }
            if listed.contains_key(&tensor) {
                return Err(err(format!("`weight_map` lists tensor `{tensor}` twice")));
            }
            listed.insert(tensor, shard);
        }
        if listed.is_empty() {
            return Err(err("`weight_map` is empty".into()));
        }

        let shard_names: BTreeSet<&String> = listed.values().collect();
        let mut files = Vec::with_capacity(shard_names.len());
        let mut file_of_shard = BTreeMap::new();
        for name in shard_names {
            let path = dir.join(name);
            if !path.is_file() {
                return Err(err(format!(
                    "shard `{name}` is listed but `{}` does not exist",
                    path.display()
                )));
            }
            file_of_shard.insert(name.clone(), files.len());
            files.push(SafetensorsFile::open(&path)?);
        }

        let mut location: BTreeMap<String, usize> = BTreeMap::new();
        for (i, file) in files.iter().enumerate() {
            for tensor in file.names() {
                if let Some(&j) = location.get(tensor) {
                    return Err(ModelError::DuplicateTensor {
                        tensor: tensor.to_string(),
                        first: files[j].path().to_path_buf(),
                        second: file.path().to_path_buf(),
                    });
                }
                location.insert(tensor.to_string(), i);
            }
        }
        for (tensor, shard) in &listed {
            let want = file_of_shard[shard];
            match location.get(tensor) {
                Some(&i) if i == want => {}
                Some(&i) => {
                    return Err(err(format!(
                        "`weight_map` puts tensor `{tensor}` in `{shard}`, but it is in `{}`",
                        files[i].path().display()
                    )))
                }
                None => {
                    return Err(err(format!(
                        "`weight_map` puts tensor `{tensor}` in `{shard}`, which does not \
                         contain it"
                    )))
                }
            }
        }
        if let Some((tensor, &i)) = location.iter().find(|(t, _)| !listed.contains_key(*t)) {
            return Err(err(format!(
                "shard `{}` holds tensor `{tensor}`, which `weight_map` does not list",
                files[i].path().display()
            )));
        }
        Ok(Checkpoint {
            dir,
            index: Some(index),
            files,
            location,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    /// The index file, for a sharded checkpoint.
    pub fn index_path(&self) -> Option<&Path> {
        self.index.as_deref()
    }

    pub fn is_sharded(&self) -> bool {
        self.index.is_some()
    }

    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.location.len()
    }

    pub fn is_empty(&self) -> bool {
        self.location.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// The file holding a tensor.
    pub fn file_of(&self, name: &str) -> Option<&SafetensorsFile> {
        self.location.get(name).and_then(|&i| self.files.get(i))
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.file_of(name).and_then(|f| f.info(name))
    }

    /// A float tensor as F32 (F16/BF16 widened exactly); reads only that tensor's bytes.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        self.file_or_err(name)?.read_f32(name)
    }

    /// The tensor as an IR tensor of its stored dtype.
    pub fn tensor(&self, name: &str) -> Result<Tensor, ModelError> {
        self.file_or_err(name)?.tensor(name)
    }

    /// A float tensor as an F32 IR tensor.
    pub fn tensor_f32(&self, name: &str) -> Result<Tensor, ModelError> {
        self.file_or_err(name)?.tensor_f32(name)
    }

    fn file_or_err(&self, name: &str) -> Result<&SafetensorsFile, ModelError> {
        self.file_of(name)
            .ok_or_else(|| ModelError::TensorNotFound {
                path: self.dir.clone(),
                tensor: name.to_string(),
            })
    }
}

/// True for a bare file name: one normal path component, no separators of any platform, no
/// `..`, not absolute, no drive prefix, no NUL.
fn is_plain_file_name(s: &str) -> bool {
    !s.is_empty()
        && !s.contains(['/', '\\', '\0', ':'])
        && s != "."
        && !s.contains("..")
        && matches!(
            Path::new(s).components().collect::<Vec<_>>().as_slice(),
            [Component::Normal(_)]
        )
}

#[cfg(test)]
mod tests {
    use super::is_plain_file_name;

    #[test]
    fn shard_names() {
        assert!(is_plain_file_name("model-00001-of-00002.safetensors"));
        for bad in [
            "",
            ".",
            "..",
            "../x.safetensors",
            "a/b.safetensors",
            "a\\b.safetensors",
            "/etc/passwd",
            "C:x.safetensors",
            "x..safetensors",
        ] {
            assert!(!is_plain_file_name(bad), "{bad:?}");
        }
    }
}
