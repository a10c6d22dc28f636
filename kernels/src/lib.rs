//! The toolchain of castor's CUDA kernels: NVRTC at run time ([`nvrtc::Nvrtc`], which needs no
//! GPU and no CUDA toolkit, only the NVRTC library and the CUDA headers), the on-disk PTX
//! cache, the signature parser that reads each entry point's parameters from its declaration,
//! `ptxas` and `nvdisasm` reports (registers, spills, instruction mix) where those tools are
//! installed, and the host build that runs kernel sources on the CPU. The header every kernel
//! includes (`common.cuh`) is here too.
//!
//! The kernels themselves live with the rest of their family in the runtime
//! (`runtime/src/cuda/families/<family>/`: the `.cu` files, their lowering, their emulator
//! contract and their tests), which hands them to this crate as [`KernelFile`]s.
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod cache;
pub mod host;
pub mod nvrtc;
pub mod ptx;
pub mod ptxas;
pub mod sass;
pub mod signature;

pub use cache::{CacheError, KernelCache, Outcome};
pub use nvrtc::{Nvrtc, NvrtcError};
pub use signature::{Param, ParamKind, Signature, SignatureError};

/// The GPU architecture kernels are built for (H100, H200).
pub const DEFAULT_ARCH: &str = "sm_90";

/// The header every kernel file includes, as `(include name, source)`.
pub const COMMON_HEADER: (&str, &str) = ("castor_common.cuh", include_str!("../common.cuh"));

/// One kernel source file and the entry points it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelFile {
    /// The file name, e.g. `"norm.cu"` (unique among all families).
    pub name: &'static str,
    pub source: &'static str,
    /// Its `extern "C" __global__` functions, sorted by name.
    pub entry_points: &'static [&'static str],
}
