//! Output paths, checked before any work: a run must not compute for an hour and then find
//! that it cannot write its checkpoint, log, picture or report.
//!
//! A check writes and removes a small probe file where the output will go (the folder that
//! will hold a file; the folder itself, or the existing folder it will be created in, for a
//! folder output),
//! so permissions, read-only mounts and missing folders are all found the way the real write
//! would find them. Errors name the flag, the path and the OS error once, and exit with code 1
//! (README, "Exit codes").

use crate::CliError;
use std::path::{Path, PathBuf};

/// Checks that `path` can be written as a file (created or replaced) for `flag`.
pub fn check_file(flag: &str, path: &Path) -> Result<(), CliError> {
    if path.is_dir() {
        return Err(CliError::Output(format!(
            "{flag} `{}` is a folder; give a file name",
            path.display()
        )));
    }
    let parent = parent_of(path);
    if !parent.is_dir() {
        let what = if parent.exists() {
            "is not a folder"
        } else {
            "does not exist"
        };
        return Err(CliError::Output(format!(
            "{flag} `{}`: the folder `{}` {what}",
            path.display(),
            parent.display()
        )));
    }
    probe(flag, path, &parent)
}

/// Checks that `path` can be a folder of outputs for `flag`: an existing folder that can be
/// written into, or a new folder in one (created when the first output is written). As for a
/// file output, the folder it goes in must exist: a missing chain of parents is more often a
/// typo than a wish, so castor creates the output folder itself and never its parents.
pub fn check_folder(flag: &str, path: &Path) -> Result<(), CliError> {
    if path.is_dir() {
        return probe(flag, path, path);
    }
    if path.exists() {
        return Err(CliError::Output(format!(
            "{flag} `{}` is a file, not a folder",
            path.display()
        )));
    }
    let parent = parent_of(path);
    if !parent.is_dir() {
        let what = if parent.exists() {
            format!("`{}` is a file, not a folder", parent.display())
        } else {
            format!(
                "the folder `{}` does not exist (castor creates the output folder, not its \
                 parents)",
                parent.display()
            )
        };
        return Err(CliError::Output(format!(
            "{flag} `{}`: {what}",
            path.display()
        )));
    }
    probe(flag, path, &parent)
}

/// The folder a relative or absolute path lives in (`.` for a bare name).
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Creates and removes a probe file in `folder`.
fn probe(flag: &str, path: &Path, folder: &Path) -> Result<(), CliError> {
    let probe = folder.join(format!(".castor-write-check-{}", std::process::id()));
    let result = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe);
    match result {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        // A stale probe of a killed run with our pid: the folder is writable.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(CliError::Output(format!(
            "{flag} `{}`: cannot write into `{}`: {e}",
            path.display(),
            folder.display()
        ))),
    }
}
