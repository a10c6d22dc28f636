//! The kernels the fusion pass generates: `entry(const T* in0, .., T* out0, .., i64 n)`, each
//! output `n` elements, each input as many as the module's record of the kernel says (a
//! broadcast operand holds fewer), the element sizes from the kernel's own parameter types.
//!
//! The family: no source file (the C is generated per unit); `lower.rs` (its launches in a CUDA
//! program); `contract.rs` (what the emulator lets each launch read and write); `tests.rs` (the
//! kernels against the CPU twin, in the host build).
//! CPU twin: the unfused graph: every member op on the CPU executor.

pub(crate) mod contract;
pub(crate) mod lower;

use castor_kernels::KernelFile;

/// No kernel files: the fusion pass's kernels are written per unit.
pub const FILES: &[KernelFile] = &[];
