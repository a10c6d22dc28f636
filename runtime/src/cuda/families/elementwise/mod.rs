//! `elementwise.cu`: the activation functions forward and backward, add and mul.
//!
//! The family: `elementwise.cu` (sources, entry points below); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: [`crate::cpu::elementwise`].

pub(crate) mod contract;
#[cfg(test)]
pub(crate) mod tests;

use castor_kernels::KernelFile;
use castor_ir::DType;
use crate::cuda::kernel_id::{direction, FLOATS};

/// The family's kernel files, with their `extern "C"` entry points (sorted).
pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "elementwise.cu",
        source: include_str!("elementwise.cu"),
        entry_points: &[
            "add_bf16",
            "add_f16",
            "add_f32",
            "gelu_erf_bwd_bf16",
            "gelu_erf_bwd_f16",
            "gelu_erf_bwd_f32",
            "gelu_erf_fwd_bf16",
            "gelu_erf_fwd_f16",
            "gelu_erf_fwd_f32",
            "gelu_tanh_bwd_bf16",
            "gelu_tanh_bwd_f16",
            "gelu_tanh_bwd_f32",
            "gelu_tanh_fwd_bf16",
            "gelu_tanh_fwd_f16",
            "gelu_tanh_fwd_f32",
            "mul_bf16",
            "mul_f16",
            "mul_f32",
            "silu_bwd_bf16",
            "silu_bwd_f16",
            "silu_bwd_f32",
            "silu_fwd_bf16",
            "silu_fwd_f16",
            "silu_fwd_f32",
        ],
    },
];

/// A kernel of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Unary {
        op: UnaryOp,
        backward: bool,
        dtype: DType,
    },
    Binary {
        op: BinaryOp,
        dtype: DType,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    GeluTanh,
    GeluErf,
    Silu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Mul,
}

impl Kernel {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        match *self {
            Kernel::Unary {
                op,
                backward,
                dtype,
            } => {
                let op = match op {
                    UnaryOp::GeluTanh => "gelu_tanh",
                    UnaryOp::GeluErf => "gelu_erf",
                    UnaryOp::Silu => "silu",
                };
                format!("{op}_{}_{}", direction(backward), dtype.name())
            }
            Kernel::Binary { op, dtype } => {
                let op = match op {
                    BinaryOp::Add => "add",
                    BinaryOp::Mul => "mul",
                };
                format!("{op}_{}", dtype.name())
            }
        }
    }

    /// Every kernel the family could name (a superset of its files' entry points).
    pub fn candidates() -> Vec<Kernel> {
        let mut ids = Vec::new();
        for dtype in FLOATS {
            for op in [UnaryOp::GeluTanh, UnaryOp::GeluErf, UnaryOp::Silu] {
                for backward in [false, true] {
                    ids.push(Kernel::Unary {
                        op,
                        backward,
                        dtype,
                    });
                }
            }
            for op in [BinaryOp::Add, BinaryOp::Mul] {
                ids.push(Kernel::Binary { op, dtype });
            }
        }
        ids
    }
}
