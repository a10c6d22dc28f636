//! Opening the GPU: the driver, cuBLAS and NVRTC libraries, a context, one stream and one
//! cuBLAS handle.

use super::lt::LtHandle;
use super::{blas, blas_check, blas_sys, drv, CudaError, NoCuda};
use castor_kernels::{KernelCache, Nvrtc};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cu_sys;
use cudarc::driver::{CudaContext, CudaStream};
use std::rc::Rc;
use std::sync::Arc;

/// A cuBLAS handle, destroyed on drop.
pub(super) struct BlasHandle(pub(super) blas_sys::cublasHandle_t);

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by cublasCreate and is destroyed once, here.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// What a [`Device`] and the programs loaded on it share.
pub(super) struct Inner {
    // Fields drop in order: the cuBLAS handles, then the stream, then the context.
    pub(super) blas: BlasHandle,
    pub(super) lt: LtHandle,
    pub(super) stream: Arc<CudaStream>,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) nvrtc: &'static Nvrtc,
    pub(super) cache: KernelCache,
    pub(super) name: String,
    pub(super) capability: (i32, i32),
    pub(super) arch: String,
}

impl Inner {
    /// Makes the context current on this thread.
    pub(super) fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is alive (we hold it) and belongs to this process.
        drv(unsafe { cu::ctx::set_current(self.ctx.cu_ctx()) }, || {
            "cuCtxSetCurrent (making the context current on this thread)".into()
        })
    }

    pub(super) fn stream(&self) -> cu_sys::CUstream {
        self.stream.cu_stream()
    }

    pub(super) fn synchronize(&self, what: &str) -> Result<(), CudaError> {
        // SAFETY: the stream is alive and belongs to the current context.
        drv(unsafe { cu::stream::synchronize(self.stream()) }, || {
            format!("cuStreamSynchronize ({what}; an error here may come from any earlier run)")
        })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // cuBLAS and the stream are destroyed with the context current.
        let _ = self.bind();
    }
}

/// An opened GPU: its context (device 0's, or a launched rank's `LOCAL_RANK`), one stream, a
/// cuBLAS handle and NVRTC.
pub struct Device {
    pub(super) inner: Rc<Inner>,
}

impl Device {
    /// Opens device 0, or says why there is none usable.
    pub fn open() -> Result<Device, CudaError> {
        Device::open_ordinal(0)
    }

    /// Opens device `ordinal` (a launched rank's `LOCAL_RANK`), or says why it is not usable.
    pub fn open_ordinal(ordinal: usize) -> Result<Device, CudaError> {
        let probe = crate::cuda_probe::probe()?;
        // SAFETY: only tries to open the driver library; no symbol is called.
        if !unsafe { cu_sys::is_culib_present() } {
            return Err(
                NoCuda::NoDriver("libcuda.so (as the CUDA bindings name it)".into()).into(),
            );
        }
        // SAFETY: as above, for cuBLAS.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        // SAFETY: as above, for cuBLASLt (products with epilogues).
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        if probe.driver_version < 13000 {
            return Err(CudaError::Unsupported(format!(
                "the CUDA driver supports CUDA {}.{}; castor's kernels are built with NVRTC 13 \
                 and need a CUDA 13 driver (580 or newer)",
                probe.driver_version / 1000,
                (probe.driver_version % 1000) / 10
            )));
        }
        let nvrtc = Nvrtc::shared().map_err(CudaError::Nvrtc)?;
        let version = nvrtc
            .version()
            .map_err(|e| CudaError::Nvrtc(e.to_string()))?;
        nvrtc_fits_driver(
            version,
            probe.driver_version,
            &nvrtc.library_path().display(),
        )
        .map_err(CudaError::Nvrtc)?;

        let count = drv(CudaContext::device_count(), || "cuDeviceGetCount".into())?;
        if ordinal >= count as usize {
            return Err(CudaError::Unsupported(format!(
                "CUDA device {ordinal} was asked for (LOCAL_RANK={ordinal}), but this machine \
                 shows {count}: start at most {count} ranks on it (--nproc-per-node), or check \
                 CUDA_VISIBLE_DEVICES"
            )));
        }
        let ctx = drv(CudaContext::new(ordinal), || {
            format!("creating the context on CUDA device {ordinal}")
        })?;
        // SAFETY: this layer manages its buffers as raw addresses and orders all work on one
        // stream; cudarc's per-buffer events would only add work.
        unsafe { ctx.disable_event_tracking() };
        let name = drv(ctx.name(), || "cuDeviceGetName".into())?;
        let capability = drv(ctx.compute_capability(), || {
            "cuDeviceGetAttribute (compute capability)".into()
        })?;
        if capability < (7, 5) {
            return Err(CudaError::Unsupported(format!(
                "{name} is sm_{}{}; NVRTC 13 builds for sm_75 and newer",
                capability.0, capability.1
            )));
        }
        let stream = drv(ctx.new_stream(), || "cuStreamCreate".into())?;

        let handle = blas::create_handle().map_err(|e| CudaError::Cublas {
            node: String::new(),
            message: format!("cublasCreate returned {:?}", e.0),
        })?;
        let handle = BlasHandle(handle);
        // SAFETY: the handle is live and the stream belongs to the current context.
        let r = unsafe { blas::set_stream(handle.0, stream.cu_stream().cast()) };
        blas_check(r, "", "cublasSetStream")?;
        // SAFETY: the handle is live. Scalars (alpha, beta) are read from host memory.
        let r = unsafe {
            blas_sys::cublasSetPointerMode_v2(
                handle.0,
                blas_sys::cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST,
            )
        }
        .result();
        blas_check(r, "", "cublasSetPointerMode")?;
        // Default math (tensor cores for 16-bit inputs; TF32 only where the compute type asks
        // for it), but with every reduction in F32 even when C is 16-bit, as the CPU
        // reference rounds each product once.
        // SAFETY: the handle is live.
        let r = unsafe {
            blas_sys::cublasSetMathMode(
                handle.0,
                blas_sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
            )
        }
        .result();
        blas_check(r, "", "cublasSetMathMode")?;

        let arch = format!("sm_{}{}", capability.0, capability.1);
        Ok(Device {
            inner: Rc::new(Inner {
                blas: handle,
                lt: LtHandle::create()?,
                stream,
                ctx,
                nvrtc,
                cache: KernelCache::new(KernelCache::default_dir()),
                name,
                capability,
                arch,
            }),
        })
    }

    /// The device's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The compute capability, e.g. `(9, 0)`.
    pub fn capability(&self) -> (i32, i32) {
        self.inner.capability
    }

    /// The architecture kernels are compiled for, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.inner.arch
    }

    /// The NVRTC library in use.
    pub fn nvrtc(&self) -> &Nvrtc {
        self.inner.nvrtc
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        self.inner.bind()?;
        let (free, total) = drv(cu::mem_get_info(), || "cuMemGetInfo".into())?;
        Ok((free as u64, total as u64))
    }
}

/// NVRTC writes PTX of its own CUDA version, which a driver of an older CUDA version refuses
/// to load (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, only at the first module load): an NVRTC
/// newer than the driver is refused before anything is compiled.
pub(super) fn nvrtc_fits_driver(
    nvrtc: (i32, i32),
    driver_version: i32,
    nvrtc_path: &dyn std::fmt::Display,
) -> Result<(), String> {
    let driver = (driver_version / 1000, (driver_version % 1000) / 10);
    if nvrtc <= driver {
        return Ok(());
    }
    Err(format!(
        "NVRTC {}.{} ({nvrtc_path}) is newer than the CUDA driver ({}.{}), which cannot load \
         the PTX it writes; use NVRTC {}.{} (pip install --target DIR \
         \"nvidia-cuda-nvrtc=={}.{}.*\" \"nvidia-cuda-runtime=={}.{}.*\" and set \
         CASTOR_NVRTC_DIR=DIR) or update the driver",
        nvrtc.0,
        nvrtc.1,
        driver.0,
        driver.1,
        driver.0,
        driver.1,
        driver.0,
        driver.1,
        driver.0,
        driver.1
    ))
}
