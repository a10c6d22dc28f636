//! Per-kernel resource usage from `ptxas -v`: registers, shared memory, spills.
//!
//! `ptxas` comes with the `nvidia-cuda-nvcc` package (`DIR/nvidia/cu13/bin/ptxas`); like
//! NVRTC it needs no GPU.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What went wrong running `ptxas`.
#[derive(Debug, thiserror::Error)]
pub enum PtxasError {
    #[error("cannot run {path}: {source}")]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write the PTX of {file} to {path}: {source}")]
    Write {
        file: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("ptxas rejected the PTX of {file}:\n{log}")]
    Rejected { file: String, log: String },
}

/// One kernel's resources as ptxas reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub kernel: String,
    pub registers: u32,
    /// Static shared memory, bytes.
    pub shared_bytes: u32,
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// `ptxas` in an NVRTC folder (the pip layout) or a toolkit folder, if present.
pub fn find_ptxas(dir: &Path) -> Option<PathBuf> {
    [dir.join("nvidia/cu13/bin/ptxas"), dir.join("bin/ptxas")]
        .into_iter()
        .find(|p| p.is_file())
}

/// Assembles `ptx` (from `file`) for `arch` with `ptxas -v`: each kernel's resources, and the
/// cubin (the machine code, for `nvdisasm`).
pub fn assemble(
    ptxas: &Path,
    file: &str,
    ptx: &str,
    arch: &str,
) -> Result<(Vec<KernelResources>, Vec<u8>), PtxasError> {
    let write_err = |path: &Path, source| PtxasError::Write {
        file: file.into(),
        path: path.to_path_buf(),
        source,
    };
    // Removed, with what ptxas wrote into it, when it goes out of scope.
    let dir = tempfile::Builder::new()
        .prefix("castor-ptxas-")
        .tempdir()
        .map_err(|e| write_err(&std::env::temp_dir(), e))?;
    let stem = file.trim_end_matches(".cu");
    let input = dir.path().join(format!("{stem}.ptx"));
    let output = dir.path().join(format!("{stem}.cubin"));
    std::fs::write(&input, ptx).map_err(|e| write_err(&input, e))?;
    let out = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .output()
        .map_err(|source| PtxasError::Spawn {
            path: ptxas.to_path_buf(),
            source,
        })?;
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(PtxasError::Rejected {
            file: file.into(),
            log,
        });
    }
    let cubin = std::fs::read(&output).map_err(|e| write_err(&output, e))?;
    Ok((parse(&log), cubin))
}

/// Parses `ptxas -v` output:
/// `Compiling entry function 'k' for 'sm_90'`, `N bytes stack frame, N bytes spill stores,
/// N bytes spill loads`, `Used N registers, used N barriers, N bytes smem, ...`.
pub fn parse(log: &str) -> Vec<KernelResources> {
    let mut rows: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            rows.push(KernelResources {
                kernel: name.into(),
                ..KernelResources::default()
            });
            continue;
        }
        let Some(row) = rows.last_mut() else {
            continue;
        };
        for part in line.split(',') {
            let words: Vec<&str> = part.split_whitespace().collect();
            // "N bytes spill stores", "Used N registers", "N bytes smem", "N bytes stack frame"
            let number = |i: usize| words.get(i).and_then(|w| w.parse::<u32>().ok());
            let ends = |suffix: &[&str]| words.ends_with(suffix);
            if ends(&["bytes", "stack", "frame"]) {
                row.stack_bytes = number(words.len() - 4).unwrap_or(0);
            } else if ends(&["bytes", "spill", "stores"]) {
                row.spill_stores = number(words.len() - 4).unwrap_or(0);
            } else if ends(&["bytes", "spill", "loads"]) {
                row.spill_loads = number(words.len() - 4).unwrap_or(0);
            } else if ends(&["registers"]) && words.len() >= 2 {
                row.registers = number(words.len() - 2).unwrap_or(0);
            } else if ends(&["bytes", "smem"]) && words.len() >= 3 {
                row.shared_bytes = number(words.len() - 3).unwrap_or(0);
            }
        }
    }
    rows
}

/// A fixed-width table of `(file, resources)` rows.
pub fn table(rows: &[(String, KernelResources)]) -> String {
    let width = rows
        .iter()
        .map(|(_, r)| r.kernel.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut s = format!(
        "{:<18} {:<width$} {:>5} {:>7} {:>6} {:>7} {:>7}\n",
        "file", "kernel", "regs", "smem B", "stack", "spill-s", "spill-l"
    );
    for (file, r) in rows {
        let _ = writeln!(
            s,
            "{:<18} {:<width$} {:>5} {:>7} {:>6} {:>7} {:>7}",
            file,
            r.kernel,
            r.registers,
            r.shared_bytes,
            r.stack_bytes,
            r.spill_stores,
            r.spill_loads
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_verbose_output() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'softmax_fwd_f16' for 'sm_90'\n\
ptxas info    : Function properties for softmax_fwd_f16\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 264 bytes smem, 400 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'cast_f32_f16' for 'sm_90'\n\
ptxas info    : Function properties for cast_f32_f16\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 16 registers, used 0 barriers, 376 bytes cmem[0]\n";
        let rows = parse(log);
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[0],
            KernelResources {
                kernel: "softmax_fwd_f16".into(),
                registers: 40,
                shared_bytes: 264,
                stack_bytes: 8,
                spill_stores: 4,
                spill_loads: 12,
            }
        );
        assert_eq!(rows[1].registers, 16);
        assert_eq!(rows[1].shared_bytes, 0);
        assert!(table(&[("softmax.cu".into(), rows[0].clone())]).contains("softmax_fwd_f16"));
    }
}
