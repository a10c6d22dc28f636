//! The on-disk PTX cache: each kernel source is compiled once per (source, header, arch,
//! NVRTC version) and reused by every later run.
//!
//! Entries are files named `<kernel>-<key>.ptx`, where the key is the SHA-256 of everything
//! that decides the PTX. They are written to a temporary name and renamed, so a reader never
//! sees a partial entry; an unreadable entry is compiled again.

use crate::{Nvrtc, NvrtcError, COMMON_HEADER};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Environment variable naming the cache folder.
pub const CACHE_DIR_VAR: &str = "CASTOR_CACHE_DIR";

/// Bumped when the compile options change (they are part of what decides the PTX).
const OPTIONS_VERSION: &str = "fmad=false,prec-div,prec-sqrt,ftz=false,c++17";

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(transparent)]
    Nvrtc(#[from] NvrtcError),
    #[error("kernel cache `{path}`: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Whether a lookup found the PTX or compiled it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Hit,
    Compiled,
}

pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        KernelCache { dir: dir.into() }
    }

    /// `$CASTOR_CACHE_DIR`, else `$XDG_CACHE_HOME/castor/kernels`, else
    /// `$HOME/.cache/castor/kernels`, else a folder under the system's temporary folder.
    pub fn default_dir() -> PathBuf {
        let var = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        if let Some(dir) = var(CACHE_DIR_VAR) {
            return dir;
        }
        let base = var("XDG_CACHE_HOME")
            .or_else(|| var("HOME").map(|h| h.join(".cache")))
            .unwrap_or_else(std::env::temp_dir);
        base.join("castor").join("kernels")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The PTX of `source` (entry `name`) for `arch`, from the cache or compiled and stored.
    pub fn ptx(
        &self,
        nvrtc: &Nvrtc,
        name: &str,
        source: &str,
        arch: &str,
    ) -> Result<(String, Outcome), CacheError> {
        let (major, minor) = nvrtc.version()?;
        let mut h = Sha256::new();
        for part in [
            source,
            COMMON_HEADER.1,
            arch,
            &format!("nvrtc {major}.{minor}"),
            OPTIONS_VERSION,
        ] {
            h.update(part.as_bytes());
            h.update([0u8]);
        }
        let key: String = h
            .finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect();
        let safe: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = self.dir.join(format!("{safe}-{key}.ptx"));
        if let Ok(ptx) = std::fs::read_to_string(&path) {
            if ptx.contains(".entry") {
                return Ok((ptx, Outcome::Hit));
            }
        }
        let ptx = nvrtc.compile_kernel(name, source, arch)?;
        let io = |source| CacheError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        let tmp = self
            .dir
            .join(format!(".{safe}-{key}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, &ptx).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        Ok((ptx, Outcome::Compiled))
    }
}
