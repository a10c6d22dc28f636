//! `attention.cu`: the fused attention forward, its `delta` row sums, and its backward (one
//! tensor-core kernel, or the F32 dq and dk/dv kernels). Launch shapes, dynamic shared memory
//! and scratch are `geometry.rs`'s. `key_lengths.cu`: the sequence lengths castor's cuDNN
//! attention graphs read (`crate::cuda::sdpa`).
//!
//! The family: `attention.cu`, `key_lengths.cu` (sources, entry points below); `lower.rs`
//! (its launches in a CUDA program); `contract.rs` (what the emulator lets each launch read and
//! write); `tests.rs` (the kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::attention`].

pub(crate) mod lower;
pub mod geometry;
pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;
use castor_ir::DType;
use crate::cuda::kernel_id::FLOATS;

/// Entry points whose blocks wait for blocks with a lower index (the backward's ordered dQ
/// sums; see [`super::waits_for_earlier_blocks`]).
pub const BLOCK_ORDERED: &[&str] = &[
    "attention_bwd_bf16_d128",
    "attention_bwd_bf16_d128_dropout",
    "attention_bwd_bf16_d128_packed",
    "attention_bwd_bf16_d128_packed_dropout",
    "attention_bwd_bf16_d16",
    "attention_bwd_bf16_d16_dropout",
    "attention_bwd_bf16_d16_packed",
    "attention_bwd_bf16_d16_packed_dropout",
    "attention_bwd_bf16_d32",
    "attention_bwd_bf16_d32_dropout",
    "attention_bwd_bf16_d32_packed",
    "attention_bwd_bf16_d32_packed_dropout",
    "attention_bwd_bf16_d64",
    "attention_bwd_bf16_d64_dropout",
    "attention_bwd_bf16_d64_packed",
    "attention_bwd_bf16_d64_packed_dropout",
    "attention_bwd_f16_d128",
    "attention_bwd_f16_d128_dropout",
    "attention_bwd_f16_d128_packed",
    "attention_bwd_f16_d128_packed_dropout",
    "attention_bwd_f16_d16",
    "attention_bwd_f16_d16_dropout",
    "attention_bwd_f16_d16_packed",
    "attention_bwd_f16_d16_packed_dropout",
    "attention_bwd_f16_d32",
    "attention_bwd_f16_d32_dropout",
    "attention_bwd_f16_d32_packed",
    "attention_bwd_f16_d32_packed_dropout",
    "attention_bwd_f16_d64",
    "attention_bwd_f16_d64_dropout",
    "attention_bwd_f16_d64_packed",
    "attention_bwd_f16_d64_packed_dropout",
];

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "attention.cu",
        source: include_str!("attention.cu"),
        entry_points: &[
            "attention_bwd_bf16_d128",
            "attention_bwd_bf16_d128_dropout",
            "attention_bwd_bf16_d128_packed",
            "attention_bwd_bf16_d128_packed_dropout",
            "attention_bwd_bf16_d16",
            "attention_bwd_bf16_d16_dropout",
            "attention_bwd_bf16_d16_packed",
            "attention_bwd_bf16_d16_packed_dropout",
            "attention_bwd_bf16_d32",
            "attention_bwd_bf16_d32_dropout",
            "attention_bwd_bf16_d32_packed",
            "attention_bwd_bf16_d32_packed_dropout",
            "attention_bwd_bf16_d64",
            "attention_bwd_bf16_d64_dropout",
            "attention_bwd_bf16_d64_packed",
            "attention_bwd_bf16_d64_packed_dropout",
            "attention_bwd_delta_bf16",
            "attention_bwd_delta_f16",
            "attention_bwd_delta_f32",
            "attention_bwd_dkdv_f32",
            "attention_bwd_dkdv_f32_dropout",
            "attention_bwd_dq_f32",
            "attention_bwd_dq_f32_dropout",
            "attention_bwd_f16_d128",
            "attention_bwd_f16_d128_dropout",
            "attention_bwd_f16_d128_packed",
            "attention_bwd_f16_d128_packed_dropout",
            "attention_bwd_f16_d16",
            "attention_bwd_f16_d16_dropout",
            "attention_bwd_f16_d16_packed",
            "attention_bwd_f16_d16_packed_dropout",
            "attention_bwd_f16_d32",
            "attention_bwd_f16_d32_dropout",
            "attention_bwd_f16_d32_packed",
            "attention_bwd_f16_d32_packed_dropout",
            "attention_bwd_f16_d64",
            "attention_bwd_f16_d64_dropout",
            "attention_bwd_f16_d64_packed",
            "attention_bwd_f16_d64_packed_dropout",
            "attention_fwd_bf16_d128",
            "attention_fwd_bf16_d128_dropout",
            "attention_fwd_bf16_d128_packed",
            "attention_fwd_bf16_d128_packed_dropout",
            "attention_fwd_bf16_d16",
            "attention_fwd_bf16_d16_dropout",
            "attention_fwd_bf16_d16_packed",
            "attention_fwd_bf16_d16_packed_dropout",
            "attention_fwd_bf16_d32",
            "attention_fwd_bf16_d32_dropout",
            "attention_fwd_bf16_d32_packed",
            "attention_fwd_bf16_d32_packed_dropout",
            "attention_fwd_bf16_d64",
            "attention_fwd_bf16_d64_dropout",
            "attention_fwd_bf16_d64_packed",
            "attention_fwd_bf16_d64_packed_dropout",
            "attention_fwd_f16_d128",
            "attention_fwd_f16_d128_dropout",
            "attention_fwd_f16_d128_packed",
            "attention_fwd_f16_d128_packed_dropout",
            "attention_fwd_f16_d16",
            "attention_fwd_f16_d16_dropout",
            "attention_fwd_f16_d16_packed",
            "attention_fwd_f16_d16_packed_dropout",
            "attention_fwd_f16_d32",
            "attention_fwd_f16_d32_dropout",
            "attention_fwd_f16_d32_packed",
            "attention_fwd_f16_d32_packed_dropout",
            "attention_fwd_f16_d64",
            "attention_fwd_f16_d64_dropout",
            "attention_fwd_f16_d64_packed",
            "attention_fwd_f16_d64_packed_dropout",
            "attention_fwd_f32",
            "attention_fwd_f32_dropout",
        ],
    },
    KernelFile {
        name: "key_lengths.cu",
        source: include_str!("key_lengths.cu"),
        entry_points: &["attention_key_lengths"],
    },
];

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// castor's fused attention: tensor-core kernels for a head-dim `tile` (16-bit), the F32
    /// reference kernels without one; with `packed` (tensor-core kernels only), the
    /// `_packed` entry points, which read packed sequences' positions (the others compile
    /// that code out and take a null `positions`); with `dropout`, the `_dropout` entry
    /// points (the probabilities dropped by the Philox mask of a key, a stream and a
    /// threshold).
    Attention {
        kernel: geometry::Kernel,
        dtype: DType,
        tile: Option<u32>,
        packed: bool,
        dropout: bool,
    },
    /// The backward's `rowsum(dO · O)`.
    Delta { dtype: DType },
    /// cuDNN's sequence lengths from a key-padding mask (`key_lengths.cu`).
    KeyLengths,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Attention {
                kernel,
                dtype,
                tile,
                packed,
                dropout,
            } => {
                let kernel = match kernel {
                    geometry::Kernel::Forward => "fwd",
                    geometry::Kernel::Backward => "bwd",
                    geometry::Kernel::Dq => "bwd_dq",
                    geometry::Kernel::DkDv => "bwd_dkdv",
                };
                let suffix = if dropout { "_dropout" } else { "" };
                let packed = if packed { "_packed" } else { "" };
                match tile {
                    Some(tile) => format!(
                        "attention_{kernel}_{}_d{tile}{packed}{suffix}",
                        dtype.name()
                    ),
                    None => format!("attention_{kernel}_{}{suffix}", dtype.name()),
                }
            }
            Kernel::Delta { dtype } => format!("attention_bwd_delta_{}", dtype.name()),
            Kernel::KeyLengths => "attention_key_lengths".into(),
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut ids = vec![Kernel::KeyLengths];
        for dtype in FLOATS {
            ids.push(Kernel::Delta { dtype });
            for kernel in [
                geometry::Kernel::Forward,
                geometry::Kernel::Backward,
                geometry::Kernel::Dq,
                geometry::Kernel::DkDv,
            ] {
                for tile in [None, Some(16), Some(32), Some(64), Some(128)] {
                    for packed in [false, true].into_iter().filter(|&p| !p || tile.is_some()) {
                        for dropout in [false, true] {
                            ids.push(Kernel::Attention {
                                kernel,
                                dtype,
                                tile,
                                packed,
                                dropout,
                            });
                        }
                    }
                }
            }
        }
        ids
    }
}
