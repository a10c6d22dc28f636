//! The device layer: a [`Program`] made resident on the GPU, and its commands issued.
//!
//! [`Device::open`] probes for a driver (the CUDA bindings panic when a library is missing,
//! so every library is looked for first and its absence is a [`CudaError`]), opens NVRTC,
//! and creates a context on device 0, one stream and one cuBLAS handle bound to it.
//! [`Device::load`] checks that the program fits in free memory, compiles its modules
//! through the on-disk PTX cache, resolves every launch's kernel (checking its argument list
//! against the kernel's parameters where the driver can tell), and makes one allocation for
//! the arena, one per slot and one per table. The result is a [`Loaded`] program.
//!
//! Invariants:
//! - Every address is fixed for the lifetime of a [`Loaded`]: nothing is reallocated after
//!   load, and every place the program names was checked at load to lie inside its buffer.
//!   That is what makes capturing a run once as a CUDA graph and replaying it valid.
//! - A captured graph bakes in every kernel argument, every copy's and product's addresses
//!   and cuBLAS's workspace. Anything that changes from step to step (the batch, the
//!   learning rate, flags) must therefore live in a slot the host writes before launching,
//!   never in an argument.
//! - All work goes to the one stream, in order. Host reads and writes ([`Loaded::read`],
//!   [`Loaded::write_slot`]) are issued on that stream and wait for it, so they see every
//!   earlier run complete and never race a running graph. Runs and [`Loaded::copy`] are
//!   asynchronous; errors from kernels that already ran surface at the next synchronizing
//!   call.
//! - The context is made current on the calling thread at the start of every call that talks
//!   to the driver. [`Device`] and [`Loaded`] are neither `Send` nor `Sync`.

mod args;
mod capture;
mod check;
mod cudnn;
mod cudnn_api;
mod host;
mod issue;
mod load;
mod lt;
mod open;
mod staging;
#[cfg(test)]
mod tests;
mod timing;

pub use args::arg_bytes;
pub use cudnn::{probe as probe_cudnn, CUDNN_DIR_VAR};
pub use load::Loaded;
pub use open::Device;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::DriverError;

use crate::cuda_probe::NoCuda;
use castor_ir::human_bytes;

/// Memory left free beyond the program's own buffers: loaded modules, graphs, cuBLAS's
/// handle and the driver's own allocations.
pub const MEMORY_MARGIN: u64 = 64 << 20;

/// Set to `0` to issue every run's commands directly instead of capturing a CUDA graph.
pub const GRAPHS_VAR: &str = "CASTOR_CUDA_GRAPHS";

/// Dynamic shared memory a kernel may use without opting in.
const DEFAULT_MAX_SHARED: u32 = 48 << 10;

/// Why the CUDA executor cannot run, or what failed while it ran.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no usable CUDA device: {0}")]
    NoCuda(#[from] NoCuda),
    #[error(
        "cuBLAS not found: libcublas.so.13 and libcublasLt.so.13 (or their unversioned \
         names) must both load; install the CUDA 13 toolkit or `pip install \"nvidia-cublas==13.*\"` and put its lib folder on \
         LD_LIBRARY_PATH"
    )]
    NoCublas,
    #[error("NCCL not usable: {0}")]
    NoNccl(String),
    #[error("NCCL failed: {0}")]
    Nccl(String),
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    #[error("kernel module `{module}` failed to compile:\n{message}")]
    Compile { module: String, message: String },
    #[error("CUDA driver call failed: {what}: {source}")]
    Driver {
        /// The call, and the node, command or buffer it was for.
        what: String,
        #[source]
        source: DriverError,
    },
    #[error("cuBLAS failed{}: {message}", on_node(.node))]
    Cublas {
        /// The node the product belongs to; empty for the handle's setup.
        node: String,
        message: String,
    },
    #[error(
        "the plan needs {} of device memory but only {} of {} is free; try --remat selective \
         (or full), or a smaller --batch",
        human_bytes(*.needed),
        human_bytes(*.free),
        human_bytes(*.total)
    )]
    OutOfMemory { needed: u64, free: u64, total: u64 },
    #[error("cuDNN failed{}: {message}", on_node(.node))]
    Cudnn { node: String, message: String },
    /// `--attention cudnn` where cuDNN is missing, too old, or builds no plan for a pass.
    #[error("{0}")]
    NoCudnn(String),
    #[error("not supported by the CUDA executor: {0}")]
    Unsupported(String),
    #[error("bad program or data for the CUDA executor: {0}")]
    Data(String),
}

fn on_node(node: &str) -> String {
    if node.is_empty() {
        String::new()
    } else {
        format!(" on node `%{node}`")
    }
}

/// A driver result, with what the call was for.
fn drv<T>(r: Result<T, DriverError>, what: impl FnOnce() -> String) -> Result<T, CudaError> {
    r.map_err(|source| CudaError::Driver {
        what: what(),
        source,
    })
}

/// A cuBLAS result, with the call and the node it was for.
fn blas_check(r: Result<(), blas::CublasError>, node: &str, call: &str) -> Result<(), CudaError> {
    r.map_err(|e| {
        let hint = match e.0 {
            blas_sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => {
                " (cuBLAS has no kernel for these types, compute type and transposes)"
            }
            blas_sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE => {
                " (a size, leading dimension or stride is invalid)"
            }
            blas_sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED => {
                " (out of memory, or the workspace is too small)"
            }
            _ => "",
        };
        CudaError::Cublas {
            node: node.to_string(),
            message: format!("{call} returned {:?}{hint}", e.0),
        }
    })
}
