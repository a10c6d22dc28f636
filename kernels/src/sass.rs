//! What the device would execute: a cubin's machine code (SASS) from `nvdisasm`, counted per
//! kernel. The instruction mix of a kernel's machine code is how its speed is checked without
//! a GPU: tensor-core instructions against everything else, `ldmatrix` (`LDSM`) and
//! asynchronous copies (`LDGSTS`) present, no 2-byte loads where 16-byte ones should be.
//!
//! `nvdisasm` comes with the `nvidia-cuda-nvdisasm` package (`DIR/nvidia/cu13/bin/nvdisasm`);
//! like ptxas it needs no GPU.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What went wrong running `nvdisasm`.
#[derive(Debug, thiserror::Error)]
pub enum NvdisasmError {
    #[error("cannot run {path}: {source}")]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write a cubin to {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("nvdisasm rejected the cubin:\n{log}")]
    Rejected { log: String },
}

/// `nvdisasm` in an NVRTC folder (the pip layout) or a toolkit folder, if present.
pub fn find_nvdisasm(dir: &Path) -> Option<PathBuf> {
    [
        dir.join("nvidia/cu13/bin/nvdisasm"),
        dir.join("bin/nvdisasm"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// The SASS listing of `cubin` (`nvdisasm -c`: code sections only).
pub fn disassemble(nvdisasm: &Path, cubin: &[u8]) -> Result<String, NvdisasmError> {
    let dir = tempfile::Builder::new()
        .prefix("castor-nvdisasm-")
        .tempdir()
        .map_err(|source| NvdisasmError::Write {
            path: std::env::temp_dir(),
            source,
        })?;
    let path = dir.path().join("module.cubin");
    std::fs::write(&path, cubin).map_err(|source| NvdisasmError::Write {
        path: path.clone(),
        source,
    })?;
    let out = Command::new(nvdisasm)
        .arg("-c")
        .arg(&path)
        .output()
        .map_err(|source| NvdisasmError::Spawn {
            path: nvdisasm.to_path_buf(),
            source,
        })?;
    if !out.status.success() {
        return Err(NvdisasmError::Rejected {
            log: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One kernel's machine code, counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstructionMix {
    /// Static instructions (each instruction of the listing once, whether or not it runs),
    /// but `NOP`s: the padding that aligns a kernel's end and some branch targets does no
    /// work.
    pub total: u32,
    /// Tensor-core instructions: `HMMA` (mma.sync), `HGMMA` (wgmma).
    pub tensor: u32,
    /// `LDSM`: ldmatrix.
    pub ldsm: u32,
    /// Asynchronous global-to-shared copies: `LDGSTS` (cp.async), `UTMALDG` (TMA).
    pub async_copies: u32,
    /// 2-byte global and shared loads (`LDG.E.U16`, `LDS.U16`, and their signed forms).
    pub two_byte_loads: u32,
    /// Subroutine calls (`CALL`): the slow paths the compiler calls out of line, such as
    /// 64-bit integer division.
    pub calls: u32,
}

impl InstructionMix {
    /// Static instructions that are not tensor-core instructions, per tensor-core
    /// instruction (infinite without any).
    pub fn others_per_tensor(&self) -> f64 {
        if self.tensor == 0 {
            return f64::INFINITY;
        }
        f64::from(self.total - self.tensor) / f64::from(self.tensor)
    }
}

/// The opcode of one listing line (`/*0040*/  @!P0 LDG.E.U16 R4, desc[UR4][R2.64] ;` gives
/// `LDG.E.U16`), or `None` for labels, directives and blank lines.
fn opcode(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("/*")?;
    let (address, rest) = rest.split_once("*/")?;
    if address.is_empty() || !address.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut words = rest.split_whitespace();
    let mut word = words.next()?;
    if word.starts_with('@') {
        word = words.next()?;
    }
    word.starts_with(|c: char| c.is_ascii_uppercase())
        .then(|| word.trim_end_matches(';'))
}

/// Each kernel's instruction mix in a listing, by kernel name (the listing's
/// `.text.<kernel>:` sections).
pub fn count(listing: &str) -> BTreeMap<String, InstructionMix> {
    let mut out: BTreeMap<String, InstructionMix> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in listing.lines() {
        let trimmed = line.trim();
        if let Some(name) = trimmed
            .strip_prefix(".text.")
            .and_then(|r| r.strip_suffix(':'))
        {
            current = Some(name.to_string());
            continue;
        }
        let (Some(kernel), Some(op)) = (&current, opcode(line)) else {
            continue;
        };
        let mix = out.entry(kernel.clone()).or_default();
        let base = op.split('.').next().unwrap_or(op);
        if base == "NOP" {
            continue;
        }
        mix.total += 1;
        match base {
            "HMMA" | "HGMMA" => mix.tensor += 1,
            "LDSM" => mix.ldsm += 1,
            "LDGSTS" | "UTMALDG" => mix.async_copies += 1,
            "LDG" | "LDS" if op.contains(".U16") || op.contains(".S16") => mix.two_byte_loads += 1,
            "CALL" => mix.calls += 1,
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_a_listing_by_kernel() {
        let listing = "\t.text.k1:\n\
.L_x_0:\n\
        /*0000*/                   LDC R1, c[0x0][0x28] ;\n\
        /*0010*/              @!P0 LDG.E.U16 R4, desc[UR4][R2.64] ;\n\
        /*0020*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;\n\
        /*0030*/                   LDSM.16.M88.4 R20, [R3] ;\n\
        /*0040*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR6][R6.64] ;\n\
        /*0050*/                   LDS.U16 R7, [R9] ;\n\
        /*0060*/                   HMMA.16816.F32.BF16 R8, R12, R18, R8 ;\n\
        /*0070*/                   CALL.REL.NOINC 0x200 ;\n\
        /*0080*/                   NOP;\n\
\t.text.k2:\n\
        /*0000*/                   EXIT ;\n\
        /*0010*/                   NOP;\n";
        let mix = count(listing);
        assert_eq!(
            mix["k1"],
            InstructionMix {
                total: 8,
                tensor: 2,
                ldsm: 1,
                async_copies: 1,
                two_byte_loads: 2,
                calls: 1,
            }
        );
        assert_eq!(mix["k1"].others_per_tensor(), 3.0);
        assert_eq!(mix["k2"].total, 1);
        assert!(mix["k2"].others_per_tensor().is_infinite());
    }
}
