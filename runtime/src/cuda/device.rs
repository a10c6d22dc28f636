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

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::rc::Rc;
use std::sync::Arc;

use castor_ir::DType;
use castor_kernels::{CacheError, KernelCache, Nvrtc, NvrtcError};
use cudarc::cublas::result as blas;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::result as cu;
use cudarc::driver::sys as cu_sys;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use super::program::SlotKind;
use super::program::{Arg, Command, CopyLayout, Field, Gemm, GemmCompute, Launch, Place, Program};
use crate::cuda_probe::NoCuda;

/// Memory left free beyond the program's own buffers: loaded modules, graphs, cuBLAS's
/// handle and the driver's own allocations.
pub const MEMORY_MARGIN: u64 = 64 << 20;

/// The least cuBLAS workspace given to a program with products (cuBLAS may fail with
/// `CUBLAS_STATUS_ALLOC_FAILED` below 16 KiB).
pub const MIN_WORKSPACE: u64 = 1 << 20;

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
        "cuBLAS not found: no libcublas.so.13 (nor libcublas.so) could be loaded; install the \
         CUDA 13 toolkit or `pip install \"nvidia-cublas==13.*\"` and put its lib folder on \
         LD_LIBRARY_PATH"
    )]
    NoCublas,
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

/// `bytes` for people: GiB or MiB with one decimal (plain bytes below 1 MiB).
pub fn human_bytes(bytes: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    const GIB: f64 = (1u64 << 30) as f64;
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / GIB)
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / MIB)
    } else {
        format!("{bytes} bytes")
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

/// The bytes of one kernel argument, exactly as many as the kernel's parameter has:
/// pointers, tables and 64-bit values take 8, `I32`/`U32` 4, `U16` 2, a [`CopyLayout`] its
/// C struct's 216. Little-endian, as CUDA hosts are.
pub fn arg_bytes(
    arg: &Arg,
    address: &dyn Fn(Place) -> u64,
    table_address: &dyn Fn(usize) -> u64,
) -> Vec<u8> {
    match arg {
        Arg::Ptr(p) => address(*p).to_le_bytes().to_vec(),
        Arg::Null => 0u64.to_le_bytes().to_vec(),
        Arg::I32(x) => x.to_le_bytes().to_vec(),
        Arg::I64(x) => x.to_le_bytes().to_vec(),
        Arg::U16(x) => x.to_le_bytes().to_vec(),
        Arg::U32(x) => x.to_le_bytes().to_vec(),
        Arg::U64(x) => x.to_le_bytes().to_vec(),
        Arg::F64(x) => x.to_le_bytes().to_vec(),
        Arg::Table(i) => table_address(*i).to_le_bytes().to_vec(),
        Arg::Layout(l) => layout_bytes(l),
    }
}

/// The bytes of a [`CopyLayout`] as its `repr(C)` struct (no padding: 24 i64s then 2 i32s).
fn layout_bytes(l: &CopyLayout) -> Vec<u8> {
    let mut out = Vec::with_capacity(std::mem::size_of::<CopyLayout>());
    for dims in [&l.shape, &l.src_stride, &l.dst_stride] {
        for x in dims.iter() {
            out.extend(x.to_le_bytes());
        }
    }
    out.extend(l.src_offset.to_le_bytes());
    out.extend(l.dst_offset.to_le_bytes());
    out.extend(l.rank.to_le_bytes());
    out.extend(l.pad.to_le_bytes());
    out
}

/// Bytes copied into 8-byte words, so the driver reads each parameter from aligned storage;
/// the words' memory holds exactly `bytes` (then zero padding).
fn to_words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            u64::from_ne_bytes(w)
        })
        .collect()
}

/// cuBLAS's type for `d`, if it has one castor uses.
fn blas_type(d: DType) -> Option<blas_sys::cudaDataType> {
    match d {
        DType::F32 => Some(blas_sys::cudaDataType::CUDA_R_32F),
        DType::F16 => Some(blas_sys::cudaDataType::CUDA_R_16F),
        DType::BF16 => Some(blas_sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

/// The checked cuBLAS parameters of a product.
struct GemmParams {
    a_type: blas_sys::cudaDataType,
    b_type: blas_sys::cudaDataType,
    c_type: blas_sys::cudaDataType,
    compute: blas_sys::cublasComputeType_t,
    lda: i32,
    ldb: i32,
    ldc: i32,
}

/// The cuBLAS types and 32-bit leading dimensions of `g`, or why cuBLAS cannot run it.
fn gemm_params(g: &Gemm) -> Result<GemmParams, CudaError> {
    let unsupported = |why: String| CudaError::Unsupported(format!("node `%{}`: {why}", g.node));
    let ty = |d: DType| {
        blas_type(d).ok_or_else(|| unsupported(format!("a matrix product of {d} operands")))
    };
    let (a_type, b_type, c_type) = (ty(g.a_dtype)?, ty(g.b_dtype)?, ty(g.c_dtype)?);
    // cublasGemmEx's table for CUBLAS_COMPUTE_32F: A and B of one type, C of that type or F32;
    // the TF32 compute type takes F32 only.
    let types_ok = g.a_dtype == g.b_dtype
        && (g.c_dtype == g.a_dtype || g.c_dtype == DType::F32)
        && (g.a_dtype != DType::F32 || g.c_dtype == DType::F32)
        && (g.compute != GemmCompute::Tf32 || g.a_dtype == DType::F32);
    if !types_ok {
        return Err(unsupported(format!(
            "cuBLAS has no product of {} x {} into {} with {:?} compute",
            g.a_dtype, g.b_dtype, g.c_dtype, g.compute
        )));
    }
    let compute = match g.compute {
        GemmCompute::F32 => blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        GemmCompute::Tf32 => blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
    };
    let int = |what: &str, v: i64| {
        i32::try_from(v).map_err(|_| unsupported(format!("{what} = {v} exceeds cuBLAS's 32 bits")))
    };
    Ok(GemmParams {
        a_type,
        b_type,
        c_type,
        compute,
        lda: int("lda", g.lda)?,
        ldb: int("ldb", g.ldb)?,
        ldc: int("ldc", g.ldc)?,
    })
}

/// The bytes each operand of `g` spans from its place: `(a, b, c)`, in column-major terms.
fn gemm_extents(g: &Gemm) -> Result<(u64, u64, u64), String> {
    let (m, n, k, batch) = (
        i128::from(g.m),
        i128::from(g.n),
        i128::from(g.k),
        i128::from(g.batch),
    );
    if m < 0 || n < 0 || k < 0 || batch < 0 {
        return Err(format!("negative size m={m} n={n} k={k} batch={batch}"));
    }
    // (rows, cols) as stored, leading dimension, batch stride, element size.
    let operand = |name: &str, rows: i128, cols: i128, ld: i64, stride: i64, d: DType| {
        let (ld, stride) = (i128::from(ld), i128::from(stride));
        if ld < rows.max(1) {
            return Err(format!(
                "ld{name} = {ld} is less than the {rows} rows {name} stores"
            ));
        }
        if stride < 0 {
            return Err(format!("stride_{name} = {stride} is negative"));
        }
        let one = if rows == 0 || cols == 0 {
            0
        } else {
            (cols - 1) * ld + rows
        };
        let elems = if one == 0 || batch == 0 {
            0
        } else {
            (batch - 1) * stride + one
        };
        u64::try_from(elems * d.size_bytes() as i128)
            .map_err(|_| format!("operand {name} spans more than 2^64 bytes"))
    };
    let (ar, ac) = if g.transa { (k, m) } else { (m, k) };
    let (br, bc) = if g.transb { (n, k) } else { (k, n) };
    Ok((
        operand("a", ar, ac, g.lda, g.stride_a, g.a_dtype)?,
        operand("b", br, bc, g.ldb, g.stride_b, g.b_dtype)?,
        operand("c", m, n, g.ldc, g.stride_c, g.c_dtype)?,
    ))
}

/// Buffer sizes of a program: the arena, then each slot.
struct Extents<'p> {
    program: &'p Program,
}

impl Extents<'_> {
    /// `Ok` when `bytes` from `p` lie inside its buffer.
    fn check(&self, p: Place, bytes: u64) -> Result<(), String> {
        let (size, offset, what) = match p {
            Place::Arena { offset } => (self.program.arena_bytes, offset, "the arena".to_string()),
            Place::Slot { slot, offset } => match self.program.slots.get(slot) {
                Some(s) => (s.bytes, offset, format!("slot {slot} (`{}`)", s.name)),
                None => {
                    return Err(format!(
                        "slot {slot} does not exist (the program has {})",
                        self.program.slots.len()
                    ))
                }
            },
        };
        match offset.checked_add(bytes) {
            Some(end) if end <= size => Ok(()),
            _ => Err(format!(
                "{bytes} bytes at offset {offset} overrun {what} ({size} bytes)"
            )),
        }
    }
}

/// Every place, module and table a program names, checked against its buffers, so that
/// nothing issued later can address memory outside them (kernel pointers are checked to
/// start inside their buffer; copies, fills and products to end inside it).
fn check_program(program: &Program) -> Result<(), CudaError> {
    let ext = Extents { program };
    let bad = |at: &str, why: String| CudaError::Data(format!("{at}: {why}"));
    for (i, slot) in program.slots.iter().enumerate() {
        if let SlotKind::Constant(bytes) = &slot.kind {
            if bytes.len() as u64 > slot.bytes {
                return Err(bad(
                    &format!("slot {i} (`{}`)", slot.name),
                    format!(
                        "{} constant bytes do not fit its {} bytes",
                        bytes.len(),
                        slot.bytes
                    ),
                ));
            }
        }
    }
    for (t, table) in program.tables.iter().enumerate() {
        for (r, row) in table.rows.iter().enumerate() {
            for f in row {
                if let Field::Ptr(p) = f {
                    ext.check(*p, 0)
                        .map_err(|why| bad(&format!("table {t} row {r}"), why))?;
                }
            }
        }
    }
    let runs = std::iter::once(("the prologue", &program.prologue))
        .chain(program.runs.iter().map(|r| (r.name.as_str(), &r.commands)));
    for (run, commands) in runs {
        for (i, c) in commands.iter().enumerate() {
            let at = |node: &str| format!("run `{run}` command {i} (node `%{node}`)");
            match c {
                Command::Launch(l) => {
                    let at = at(&l.node);
                    if l.module >= program.modules.len() {
                        return Err(bad(
                            &at,
                            format!(
                                "module {} does not exist (the program has {})",
                                l.module,
                                program.modules.len()
                            ),
                        ));
                    }
                    let (g, b) = (l.grid, l.block);
                    if [g.0, g.1, g.2, b.0, b.1, b.2].contains(&0) {
                        return Err(bad(
                            &at,
                            format!("kernel `{}` launched with grid {g:?} block {b:?}", l.entry),
                        ));
                    }
                    for arg in &l.args {
                        match arg {
                            Arg::Ptr(p) => ext.check(*p, 0).map_err(|why| bad(&at, why))?,
                            Arg::Table(t) if *t >= program.tables.len() => {
                                return Err(bad(
                                    &at,
                                    format!(
                                        "table {t} does not exist (the program has {})",
                                        program.tables.len()
                                    ),
                                ))
                            }
                            _ => {}
                        }
                    }
                }
                Command::Gemm(g) => {
                    let at = at(&g.node);
                    gemm_params(g)?;
                    let (a, b, c) = gemm_extents(g).map_err(|why| bad(&at, why))?;
                    for (p, bytes) in [(g.a, a), (g.b, b), (g.c, c)] {
                        ext.check(p, bytes).map_err(|why| bad(&at, why))?;
                    }
                }
                Command::Copy { dst, src, bytes } => {
                    let at = at("copy");
                    ext.check(*dst, *bytes).map_err(|why| bad(&at, why))?;
                    ext.check(*src, *bytes).map_err(|why| bad(&at, why))?;
                }
                Command::Memset { dst, bytes, .. } => {
                    ext.check(*dst, *bytes)
                        .map_err(|why| bad(&at("memset"), why))?;
                }
            }
        }
    }
    Ok(())
}

/// A cuBLAS handle, destroyed on drop.
struct BlasHandle(blas_sys::cublasHandle_t);

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by cublasCreate and is destroyed once, here.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// What a [`Device`] and the programs loaded on it share.
struct Inner {
    // Fields drop in order: the cuBLAS handle, then the stream, then the context.
    blas: BlasHandle,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    nvrtc: Nvrtc,
    cache: KernelCache,
    name: String,
    capability: (i32, i32),
    arch: String,
}

impl Inner {
    /// Makes the context current on this thread.
    fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is alive (we hold it) and belongs to this process.
        drv(unsafe { cu::ctx::set_current(self.ctx.cu_ctx()) }, || {
            "cuCtxSetCurrent (making the context current on this thread)".into()
        })
    }

    fn stream(&self) -> cu_sys::CUstream {
        self.stream.cu_stream()
    }

    fn synchronize(&self, what: &str) -> Result<(), CudaError> {
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

/// An opened GPU: device 0's context, one stream, a cuBLAS handle and NVRTC.
pub struct Device {
    inner: Rc<Inner>,
}

impl Device {
    /// Opens device 0, or says why there is none usable.
    pub fn open() -> Result<Device, CudaError> {
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
        if probe.driver_version < 13000 {
            return Err(CudaError::Unsupported(format!(
                "the CUDA driver supports CUDA {}.{}; castor's kernels are built with NVRTC 13 \
                 and need a CUDA 13 driver (580 or newer)",
                probe.driver_version / 1000,
                (probe.driver_version % 1000) / 10
            )));
        }
        let nvrtc = Nvrtc::discover().map_err(|e| CudaError::Nvrtc(e.to_string()))?;

        let ctx = drv(CudaContext::new(0), || {
            "creating the context on CUDA device 0".into()
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
        &self.inner.nvrtc
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        self.inner.bind()?;
        let (free, total) = drv(cu::mem_get_info(), || "cuMemGetInfo".into())?;
        Ok((free as u64, total as u64))
    }

    /// Makes `program` resident: compiles and loads its modules, allocates and initializes
    /// its buffers. Fails with [`CudaError::OutOfMemory`], allocating nothing, when it does
    /// not fit in free memory with [`MEMORY_MARGIN`] to spare.
    pub fn load(&self, program: &Program) -> Result<Loaded, CudaError> {
        let dev = &self.inner;
        dev.bind()?;
        check_program(program)?;

        let has_gemm = program
            .all_commands()
            .any(|c| matches!(c, Command::Gemm(_)));
        let workspace_bytes = if has_gemm {
            super::align(program.workspace_bytes).max(MIN_WORKSPACE)
        } else {
            0
        };
        let (free, total) = self.mem_info()?;
        let needed = program.device_bytes()
            + workspace_bytes.saturating_sub(program.workspace_bytes)
            + MEMORY_MARGIN;
        if needed > free {
            return Err(CudaError::OutOfMemory {
                needed,
                free,
                total,
            });
        }
        let budget = (needed, free, total);

        // From here on, whatever was made is freed by `Loaded`'s drop if a step fails.
        let mut loaded = Loaded {
            dev: Rc::clone(dev),
            program: program.clone(),
            modules: Vec::new(),
            functions: Vec::new(),
            arena: 0,
            slots: Vec::new(),
            tables: Vec::new(),
            workspace: 0,
            workspace_bytes,
            graphs: vec![None; program.runs.len()],
            use_graphs: std::env::var(GRAPHS_VAR).map_or(true, |v| v.trim() != "0"),
        };

        for m in &program.modules {
            let (ptx, _) = dev
                .cache
                .ptx(&dev.nvrtc, &m.name, &m.source, &dev.arch)
                .map_err(|e| match e {
                    CacheError::Nvrtc(NvrtcError::Compile { log, .. }) => CudaError::Compile {
                        module: m.name.clone(),
                        message: log,
                    },
                    e => CudaError::Nvrtc(format!("building module `{}`: {e}", m.name)),
                })?;
            let module = load_module(&m.name, &ptx)?;
            loaded.modules.push(module);
            loaded.functions.push(HashMap::new());
        }
        loaded.resolve_functions()?;

        let alloc = |bytes: u64, what: &dyn Fn() -> String| -> Result<u64, CudaError> {
            let bytes = usize::try_from(super::align(bytes).max(256))
                .map_err(|_| CudaError::Data(format!("{} is too large", what())))?;
            // SAFETY: a plain allocation; the memory is initialized below before any read.
            match unsafe { cu::malloc_sync(bytes) } {
                Ok(p) => Ok(p),
                Err(DriverError(cu_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                    Err(CudaError::OutOfMemory {
                        needed: budget.0,
                        free: budget.1,
                        total: budget.2,
                    })
                }
                Err(source) => Err(CudaError::Driver {
                    what: format!("cuMemAlloc of {bytes} bytes for {}", what()),
                    source,
                }),
            }
        };
        loaded.arena = alloc(program.arena_bytes, &|| "the arena".into())?;
        for (i, s) in program.slots.iter().enumerate() {
            let p = alloc(s.bytes, &|| format!("slot {i} (`{}`)", s.name))?;
            loaded.slots.push(p);
        }
        if workspace_bytes > 0 {
            loaded.workspace = alloc(workspace_bytes, &|| "the cuBLAS workspace".into())?;
        }
        let encoded: Vec<Vec<u8>> = program
            .tables
            .iter()
            .map(|t| t.encode(&|p| loaded.address(p)))
            .collect();
        for (i, bytes) in encoded.iter().enumerate() {
            let p = alloc(bytes.len() as u64, &|| format!("table {i}"))?;
            loaded.tables.push(p);
        }

        // Initialize on our stream (the legacy default stream does not order with it).
        let stream = dev.stream();
        let memset = |dst: u64, bytes: u64, what: &dyn Fn() -> String| {
            let n = super::align(bytes).max(256) as usize;
            // SAFETY: `dst` is a live allocation of at least `n` bytes (see `alloc`).
            drv(unsafe { cu::memset_d8_async(dst, 0, n, stream) }, || {
                format!("cuMemsetD8Async zeroing {}", what())
            })
        };
        memset(loaded.arena, program.arena_bytes, &|| "the arena".into())?;
        for (i, s) in program.slots.iter().enumerate() {
            memset(loaded.slots[i], s.bytes, &|| format!("slot `{}`", s.name))?;
            if let SlotKind::Constant(bytes) = &s.kind {
                // SAFETY: the slot holds at least `bytes.len()` bytes (checked above); the host
                // buffer lives until the synchronize below.
                drv(
                    unsafe { cu::memcpy_htod_async(loaded.slots[i], bytes, stream) },
                    || format!("cuMemcpyHtoDAsync uploading constant slot `{}`", s.name),
                )?;
            }
        }
        for (i, bytes) in encoded.iter().enumerate() {
            // SAFETY: the table's allocation holds `bytes.len()` bytes; `encoded` lives until
            // the synchronize below.
            drv(
                unsafe { cu::memcpy_htod_async(loaded.tables[i], bytes, stream) },
                || format!("cuMemcpyHtoDAsync uploading table {i}"),
            )?;
        }
        dev.synchronize("initializing the program's buffers")?;
        Ok(loaded)
    }
}

/// Loads PTX into the current context, with the JIT's log in the error when it fails.
fn load_module(name: &str, ptx: &str) -> Result<cu_sys::CUmodule, CudaError> {
    let image = CString::new(ptx).map_err(|_| CudaError::Compile {
        module: name.into(),
        message: "the PTX contains a NUL byte".into(),
    })?;
    let mut log = vec![0u8; 16 << 10];
    let mut options = [
        cu_sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        cu_sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    // The size option's value is the number itself, in the pointer's place.
    let mut values: [*mut c_void; 2] = [
        log.as_mut_ptr().cast(),
        std::ptr::without_provenance_mut(log.len()),
    ];
    let mut module: cu_sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `image` is NUL-terminated PTX; the options and their values (a buffer of the
    // stated size that outlives the call) match in number.
    let r = unsafe {
        cu_sys::cuModuleLoadDataEx(
            &mut module,
            image.as_ptr().cast(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    }
    .result();
    match r {
        Ok(()) => Ok(module),
        Err(source) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let log = String::from_utf8_lossy(&log[..end]).trim().to_string();
            let hint = if source.0 == cu_sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION {
                " (NVRTC is newer than the driver: use an NVRTC no newer than the driver's \
                 CUDA version, or update the driver)"
            } else {
                ""
            };
            if log.is_empty() {
                Err(CudaError::Driver {
                    what: format!("cuModuleLoadDataEx for module `{name}`{hint}"),
                    source,
                })
            } else {
                Err(CudaError::Compile {
                    module: name.into(),
                    message: format!("the driver could not load its PTX ({source}){hint}:\n{log}"),
                })
            }
        }
    }
}

/// The size of each parameter of `f`, or `None` when the driver cannot tell.
fn param_sizes(f: cu_sys::CUfunction) -> Option<Vec<usize>> {
    let mut sizes = Vec::new();
    for i in 0..4096 {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: `f` is a loaded function; two valid out-pointers.
        let r = unsafe { cu_sys::cuFuncGetParamInfo(f, i, &mut offset, &mut size) };
        match r {
            cu_sys::CUresult::CUDA_SUCCESS => sizes.push(size),
            // Past the last parameter.
            cu_sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Some(sizes),
            _ => return None,
        }
    }
    None
}

/// A program resident on the device: its modules loaded, its buffers allocated at fixed
/// addresses, its runs captured as CUDA graphs on first use.
pub struct Loaded {
    dev: Rc<Inner>,
    program: Program,
    modules: Vec<cu_sys::CUmodule>,
    /// Per module: entry name → function.
    functions: Vec<HashMap<String, cu_sys::CUfunction>>,
    arena: u64,
    slots: Vec<u64>,
    tables: Vec<u64>,
    workspace: u64,
    workspace_bytes: u64,
    /// Per run: its instantiated graph, once captured.
    graphs: Vec<Option<cu_sys::CUgraphExec>>,
    use_graphs: bool,
}

impl Loaded {
    /// The program this was loaded from.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The device address of `p`. Every place the program names was checked at load; a slot
    /// that does not exist gives 0.
    pub fn address(&self, p: Place) -> u64 {
        match p {
            Place::Arena { offset } => self.arena + offset,
            Place::Slot { slot, offset } => self.slots.get(slot).map_or(0, |base| base + offset),
        }
    }

    /// The device address of table `i` (0 if there is none).
    fn table_address(&self, i: usize) -> u64 {
        self.tables.get(i).copied().unwrap_or(0)
    }

    fn check_place(&self, p: Place, bytes: u64, what: &str) -> Result<(), CudaError> {
        Extents {
            program: &self.program,
        }
        .check(p, bytes)
        .map_err(|why| CudaError::Data(format!("{what}: {why}")))
    }

    /// Resolves every launch's kernel, loads it, opts it into the dynamic shared memory it
    /// is launched with, and checks the launch's arguments against its parameters.
    fn resolve_functions(&mut self) -> Result<(), CudaError> {
        let mut shared: HashMap<(usize, String), u32> = HashMap::new();
        let mut params: HashMap<(usize, String), Option<Vec<usize>>> = HashMap::new();
        let launches: Vec<&Launch> = self
            .program
            .all_commands()
            .filter_map(|c| match c {
                Command::Launch(l) => Some(l),
                _ => None,
            })
            .collect();
        for l in &launches {
            let module_name = &self.program.modules[l.module].name;
            let key = (l.module, l.entry.clone());
            let f = match self.functions[l.module].get(&l.entry) {
                Some(&f) => f,
                None => {
                    let cname = CString::new(l.entry.as_str()).map_err(|_| {
                        CudaError::Data(format!("kernel name {:?} contains a NUL byte", l.entry))
                    })?;
                    // SAFETY: the module is loaded and stays loaded while `self` lives.
                    let f = drv(
                        unsafe { cu::module::get_function(self.modules[l.module], cname) },
                        || {
                            format!(
                                "cuModuleGetFunction: kernel `{}` in module `{module_name}` \
                                 (node `%{}`)",
                                l.entry, l.node
                            )
                        },
                    )?;
                    // Load it now rather than lazily at its first launch, which may be
                    // inside a graph capture.
                    // SAFETY: `f` is a function of a loaded module.
                    drv(unsafe { cu_sys::cuFuncLoad(f) }.result(), || {
                        format!("cuFuncLoad: kernel `{}` in module `{module_name}`", l.entry)
                    })?;
                    self.functions[l.module].insert(l.entry.clone(), f);
                    params.insert(key.clone(), param_sizes(f));
                    f
                }
            };
            let most = shared.entry(key.clone()).or_insert(0);
            if l.shared_bytes > *most {
                *most = l.shared_bytes;
                if l.shared_bytes > DEFAULT_MAX_SHARED {
                    // SAFETY: `f` is a loaded function.
                    drv(
                        unsafe {
                            cu::function::set_function_attribute(
                                f,
                                cu_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                l.shared_bytes as i32,
                            )
                        },
                        || {
                            format!(
                                "cuFuncSetAttribute: {} bytes of shared memory for kernel `{}` \
                                 (node `%{}`)",
                                l.shared_bytes, l.entry, l.node
                            )
                        },
                    )?;
                }
            }
            if let Some(Some(sizes)) = params.get(&key) {
                check_args(l, module_name, sizes)?;
            }
        }
        Ok(())
    }

    /// Copies `bytes` to `place` (synchronously: after every earlier run, before returning).
    pub fn write(&self, place: Place, bytes: &[u8]) -> Result<(), CudaError> {
        self.check_place(place, bytes.len() as u64, "write")?;
        self.dev.bind()?;
        if bytes.is_empty() {
            return self.dev.synchronize("writing from the host");
        }
        let dst = self.address(place);
        // SAFETY: `dst` spans `bytes.len()` bytes of a live allocation (checked above); the
        // host buffer outlives the copy, which the synchronize below waits for.
        drv(
            unsafe { cu::memcpy_htod_async(dst, bytes, self.dev.stream()) },
            || format!("cuMemcpyHtoDAsync of {} bytes to {place:?}", bytes.len()),
        )?;
        self.dev.synchronize("writing from the host")
    }

    /// Replaces slot `slot`'s bytes (all of them) with `bytes`.
    pub fn write_slot(&self, slot: usize, bytes: &[u8]) -> Result<(), CudaError> {
        let s = self
            .program
            .slots
            .get(slot)
            .ok_or_else(|| CudaError::Data(format!("slot {slot} does not exist")))?;
        if bytes.len() as u64 != s.bytes {
            return Err(CudaError::Data(format!(
                "slot `{}` holds {} bytes, {} were given",
                s.name,
                s.bytes,
                bytes.len()
            )));
        }
        self.write(Place::Slot { slot, offset: 0 }, bytes)
    }

    /// `bytes` bytes from `place`, once every earlier run has finished.
    pub fn read(&self, place: Place, bytes: u64) -> Result<Vec<u8>, CudaError> {
        self.check_place(place, bytes, "read")?;
        self.dev.bind()?;
        if bytes == 0 {
            self.dev.synchronize("reading back to the host")?;
            return Ok(Vec::new());
        }
        let mut out = vec![0u8; bytes as usize];
        // SAFETY: `place` spans `bytes` bytes of a live allocation (checked above), and `out`
        // holds as many; the synchronize below waits for the copy before `out` is used.
        drv(
            unsafe { cu::memcpy_dtoh_async(&mut out, self.address(place), self.dev.stream()) },
            || format!("cuMemcpyDtoHAsync of {bytes} bytes from {place:?}"),
        )?;
        self.dev.synchronize("reading back to the host")?;
        Ok(out)
    }

    /// All of slot `slot`'s bytes, once every earlier run has finished.
    pub fn read_slot(&self, slot: usize) -> Result<Vec<u8>, CudaError> {
        let s = self
            .program
            .slots
            .get(slot)
            .ok_or_else(|| CudaError::Data(format!("slot {slot} does not exist")))?;
        self.read(Place::Slot { slot, offset: 0 }, s.bytes)
    }

    /// Device-to-device copy on the stream, after every earlier run (asynchronous).
    pub fn copy(&self, dst: Place, src: Place, bytes: u64) -> Result<(), CudaError> {
        self.check_place(dst, bytes, "copy destination")?;
        self.check_place(src, bytes, "copy source")?;
        self.dev.bind()?;
        self.memcpy(dst, src, bytes, "a copy between runs")
    }

    /// Waits for every run and copy issued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.dev.bind()?;
        self.dev.synchronize("waiting for the runs")
    }

    /// Issues the prologue's commands directly and waits for them.
    pub fn run_prologue(&mut self) -> Result<(), CudaError> {
        self.dev.bind()?;
        self.set_workspace()?;
        self.issue(&self.program.prologue)?;
        self.dev.synchronize("running the prologue")
    }

    /// Launches run `run` (asynchronous). The first launch captures its commands as a CUDA
    /// graph (unless `CASTOR_CUDA_GRAPHS=0`), which every later launch replays.
    pub fn run(&mut self, run: usize) -> Result<(), CudaError> {
        self.dev.bind()?;
        let Some(r) = self.program.runs.get(run) else {
            return Err(CudaError::Data(format!(
                "run {run} does not exist (the program has {})",
                self.program.runs.len()
            )));
        };
        if r.commands.is_empty() {
            return Ok(());
        }
        if !self.use_graphs {
            self.set_workspace()?;
            return self.issue(&r.commands);
        }
        let captured = self.graphs[run];
        let exec = match captured {
            Some(exec) => exec,
            None => {
                let exec = self.capture(&r.name, &r.commands)?;
                self.graphs[run] = Some(exec);
                exec
            }
        };
        // SAFETY: `exec` is a live instantiated graph of this context; the stream is ours.
        drv(
            unsafe { cu::graph::launch(exec, self.dev.stream()) },
            || format!("cuGraphLaunch of run `{}`", self.program.runs[run].name),
        )
    }

    /// Captures `commands` on the stream and instantiates the graph.
    fn capture(&self, name: &str, commands: &[Command]) -> Result<cu_sys::CUgraphExec, CudaError> {
        // Host-side cuBLAS state is read when each product is captured.
        self.set_workspace()?;
        let stream = self.dev.stream();
        // SAFETY: the stream is ours, not capturing, and belongs to the current context.
        drv(
            unsafe {
                cu::stream::begin_capture(
                    stream,
                    cu_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            },
            || format!("cuStreamBeginCapture for run `{name}`"),
        )?;
        let issued = self.issue(commands);
        // Capture always ends, so that the stream is usable again after a failure.
        // SAFETY: the stream is capturing, begun on this thread above.
        let ended = unsafe { cu::stream::end_capture(stream) };
        let graph = match (issued, ended) {
            (Ok(()), Ok(graph)) => graph,
            (Ok(()), Err(source)) => {
                return Err(CudaError::Driver {
                    what: format!("cuStreamEndCapture for run `{name}`"),
                    source,
                })
            }
            (Err(e), ended) => {
                if let Ok(graph) = ended {
                    if !graph.is_null() {
                        // SAFETY: the graph was just created by the capture and is unused.
                        let _ = unsafe { cu::graph::destroy(graph) };
                    }
                }
                return Err(e);
            }
        };
        // SAFETY: `graph` is the valid graph just captured.
        let exec = unsafe { cu::graph::instantiate(graph, cu_sys::CUgraphInstantiate_flags(0)) };
        // The executable graph is independent of the graph it was made from.
        // SAFETY: `graph` is live and destroyed once.
        let _ = unsafe { cu::graph::destroy(graph) };
        drv(exec, || format!("cuGraphInstantiate for run `{name}`"))
    }

    /// Points cuBLAS at this program's workspace (before products are issued or captured).
    fn set_workspace(&self) -> Result<(), CudaError> {
        if self.workspace == 0 {
            return Ok(());
        }
        // SAFETY: the handle is live; the workspace is a live 256-byte aligned allocation of
        // `workspace_bytes` that outlives every product issued with it.
        let r = unsafe {
            blas_sys::cublasSetWorkspace_v2(
                self.dev.blas.0,
                std::ptr::without_provenance_mut(self.workspace as usize),
                self.workspace_bytes as usize,
            )
        }
        .result();
        blas_check(r, "", "cublasSetWorkspace")
    }

    /// Issues `commands` on the stream, in order.
    fn issue(&self, commands: &[Command]) -> Result<(), CudaError> {
        for c in commands {
            match c {
                Command::Launch(l) => self.launch(l)?,
                Command::Gemm(g) => self.gemm(g)?,
                Command::Copy { dst, src, bytes } => {
                    self.memcpy(*dst, *src, *bytes, "a copy command")?
                }
                Command::Memset { dst, bytes, byte } => {
                    if *bytes > 0 {
                        // SAFETY: `dst` spans `bytes` bytes of a live allocation (checked
                        // at load).
                        drv(
                            unsafe {
                                cu::memset_d8_async(
                                    self.address(*dst),
                                    *byte,
                                    *bytes as usize,
                                    self.dev.stream(),
                                )
                            },
                            || format!("cuMemsetD8Async of {bytes} bytes at {dst:?}"),
                        )?;
                    }
                }
            }
        }
        Ok(())
    }

    fn memcpy(&self, dst: Place, src: Place, bytes: u64, what: &str) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both places span `bytes` bytes of live allocations (checked by the caller
        // or at load).
        drv(
            unsafe {
                cu::memcpy_dtod_async(
                    self.address(dst),
                    self.address(src),
                    bytes as usize,
                    self.dev.stream(),
                )
            },
            || format!("cuMemcpyDtoDAsync of {bytes} bytes from {src:?} to {dst:?} ({what})"),
        )
    }

    fn launch(&self, l: &Launch) -> Result<(), CudaError> {
        let f = self
            .functions
            .get(l.module)
            .and_then(|m| m.get(&l.entry))
            .copied()
            .ok_or_else(|| {
                CudaError::Data(format!(
                    "node `%{}`: kernel `{}` was not resolved at load",
                    l.node, l.entry
                ))
            })?;
        let address = |p: Place| self.address(p);
        let table = |i: usize| self.table_address(i);
        // Each argument in its own aligned storage, alive until the launch returns (the
        // driver copies the values when the launch is issued or captured).
        let mut storage: Vec<Vec<u64>> = l
            .args
            .iter()
            .map(|a| to_words(&arg_bytes(a, &address, &table)))
            .collect();
        let mut params: Vec<*mut c_void> = storage
            .iter_mut()
            .map(|w| w.as_mut_ptr().cast::<c_void>())
            .collect();
        // SAFETY: `f` is a loaded function; `params` holds one pointer per kernel parameter
        // (checked against the kernel at load where the driver reports its parameters), each
        // to at least as many bytes as the parameter; every pointer argument is a device
        // address inside a live allocation.
        let r = unsafe {
            cu::launch_kernel(
                f,
                l.grid,
                l.block,
                l.shared_bytes,
                self.dev.stream(),
                &mut params,
            )
        };
        drv(r, || {
            format!(
                "cuLaunchKernel of `{}` (grid {:?}, block {:?}, {} bytes shared) for node `%{}`",
                l.entry, l.grid, l.block, l.shared_bytes, l.node
            )
        })
    }

    fn gemm(&self, g: &Gemm) -> Result<(), CudaError> {
        let p = gemm_params(g)?;
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let alpha = 1.0f32;
        let beta = 0.0f32;
        let ptr =
            |place: Place| std::ptr::without_provenance_mut::<c_void>(self.address(place) as usize);
        // SAFETY: the handle is live and bound to our stream, with this program's workspace;
        // alpha and beta are host f32s (pointer mode host, F32 scale type for both compute
        // types) read during the call; each operand spans the bytes its sizes, leading
        // dimensions and strides imply inside a live allocation (checked at load).
        let r = unsafe {
            blas::gemm_strided_batched_ex(
                self.dev.blas.0,
                op(g.transa),
                op(g.transb),
                g.m,
                g.n,
                g.k,
                (&alpha as *const f32).cast(),
                ptr(g.a),
                p.a_type,
                p.lda,
                g.stride_a,
                ptr(g.b),
                p.b_type,
                p.ldb,
                g.stride_b,
                (&beta as *const f32).cast(),
                ptr(g.c),
                p.c_type,
                p.ldc,
                g.stride_c,
                g.batch,
                p.compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        blas_check(r, &g.node, "cublasGemmStridedBatchedEx")
    }
}

/// Checks a launch's arguments against its kernel's parameter sizes.
fn check_args(l: &Launch, module: &str, sizes: &[usize]) -> Result<(), CudaError> {
    // The driver reporting no parameters for a kernel launched with some is more likely a
    // query it does not support than a kernel without parameters: let the launch decide.
    if sizes.is_empty() && !l.args.is_empty() {
        return Ok(());
    }
    let at = || {
        format!(
            "node `%{}`: kernel `{}` of module `{module}`",
            l.node, l.entry
        )
    };
    if sizes.len() != l.args.len() {
        return Err(CudaError::Data(format!(
            "{} takes {} parameters, the launch passes {}",
            at(),
            sizes.len(),
            l.args.len()
        )));
    }
    for (i, (arg, &size)) in l.args.iter().zip(sizes).enumerate() {
        let n = arg_bytes(arg, &|_| 0, &|_| 0).len();
        if n != size {
            return Err(CudaError::Data(format!(
                "{}: parameter {i} is {size} bytes, the launch passes {arg:?} ({n} bytes)",
                at()
            )));
        }
    }
    Ok(())
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // Nothing may still use the buffers when they are freed.
        let _ = self.dev.synchronize("freeing a program");
        // SAFETY: every handle below was created by this `Loaded`, is no longer used (the
        // stream is idle), and is destroyed or freed exactly once (the lists are drained).
        unsafe {
            for exec in self.graphs.drain(..).flatten() {
                let _ = cu::graph::exec_destroy(exec);
            }
            let buffers = [self.arena, self.workspace]
                .into_iter()
                .chain(self.slots.drain(..))
                .chain(self.tables.drain(..));
            for p in buffers {
                if p != 0 {
                    let _ = cu::free_sync(p);
                }
            }
            for m in self.modules.drain(..) {
                let _ = cu::module::unload(m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::program::{Module, Run, Slot, Table, MAX_RANK};

    #[test]
    fn out_of_memory_message() {
        let e = CudaError::OutOfMemory {
            needed: 90 << 30,
            free: (79 << 30) + (1 << 29),
            total: 80 << 30,
        };
        assert_eq!(
            e.to_string(),
            "the plan needs 90.0 GiB of device memory but only 79.5 GiB of 80.0 GiB is free; \
             try --remat selective (or full), or a smaller --batch"
        );
        assert_eq!(human_bytes(64 << 20), "64.0 MiB");
        assert_eq!(human_bytes(1536 << 20), "1.5 GiB");
        assert_eq!(human_bytes(1000), "1000 bytes");
    }

    #[test]
    fn cublas_message_names_the_node() {
        let e = CudaError::Cublas {
            node: "h1".into(),
            message: "x".into(),
        };
        assert_eq!(e.to_string(), "cuBLAS failed on node `%h1`: x");
        let e = CudaError::Cublas {
            node: String::new(),
            message: "cublasCreate returned 1".into(),
        };
        assert_eq!(e.to_string(), "cuBLAS failed: cublasCreate returned 1");
    }

    #[test]
    fn argument_bytes_have_the_parameters_sizes() {
        let address = |p: Place| match p {
            Place::Arena { offset } => 0x1000 + offset,
            Place::Slot { slot, offset } => 0x10_0000 * (slot as u64 + 1) + offset,
        };
        let table = |i: usize| 0xdead_0000 + i as u64;
        let bytes = |a: &Arg| arg_bytes(a, &address, &table);
        assert_eq!(bytes(&Arg::U16(0xbeef)), vec![0xef, 0xbe]);
        assert_eq!(bytes(&Arg::I32(-2)), (-2i32).to_le_bytes().to_vec());
        assert_eq!(bytes(&Arg::U32(7)).len(), 4);
        assert_eq!(bytes(&Arg::I64(-3)), (-3i64).to_le_bytes().to_vec());
        assert_eq!(bytes(&Arg::U64(9)).len(), 8);
        assert_eq!(bytes(&Arg::F64(0.5)), 0.5f64.to_le_bytes().to_vec());
        assert_eq!(bytes(&Arg::Null), vec![0; 8]);
        assert_eq!(
            bytes(&Arg::Ptr(Place::Arena { offset: 256 })),
            0x1100u64.to_le_bytes().to_vec()
        );
        assert_eq!(
            bytes(&Arg::Ptr(Place::Slot { slot: 1, offset: 8 })),
            0x20_0008u64.to_le_bytes().to_vec()
        );
        assert_eq!(bytes(&Arg::Table(3)), 0xdead_0003u64.to_le_bytes().to_vec());

        let mut l = CopyLayout {
            rank: 3,
            src_offset: 5,
            dst_offset: -6,
            ..CopyLayout::default()
        };
        for d in 0..MAX_RANK {
            l.shape[d] = d as i64 + 1;
            l.src_stride[d] = 10 * d as i64;
            l.dst_stride[d] = -(d as i64);
        }
        let b = bytes(&Arg::Layout(l));
        assert_eq!(b.len(), 216);
        assert_eq!(b.len(), std::mem::size_of::<CopyLayout>());
        // The same bytes as the struct in memory (as the kernel reads it).
        // SAFETY: `CopyLayout` is `repr(C)` plain integers with no padding.
        let raw = unsafe {
            std::slice::from_raw_parts(
                (&l as *const CopyLayout).cast::<u8>(),
                std::mem::size_of::<CopyLayout>(),
            )
        };
        assert_eq!(b, raw);
        assert_eq!(&b[208..212], &3i32.to_le_bytes());
    }

    #[test]
    fn words_keep_the_bytes() {
        let b = [1u8, 2, 3];
        let w = to_words(&b);
        assert_eq!(w.len(), 1);
        // SAFETY: reading the first 3 bytes of an 8-byte word.
        let back = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), 3) };
        assert_eq!(back, &b);
        assert_eq!(to_words(&[0u8; 216]).len(), 27);
    }

    fn gemm(m: i32, n: i32, k: i32) -> Gemm {
        Gemm {
            node: "mm".into(),
            a: Place::Arena { offset: 0 },
            b: Place::Slot { slot: 0, offset: 0 },
            c: Place::Slot { slot: 1, offset: 0 },
            a_dtype: DType::F16,
            b_dtype: DType::F16,
            c_dtype: DType::F32,
            transa: false,
            transb: false,
            m,
            n,
            k,
            lda: m.max(1) as i64,
            ldb: k.max(1) as i64,
            ldc: m.max(1) as i64,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            batch: 1,
            compute: GemmCompute::F32,
        }
    }

    #[test]
    fn gemm_extents_in_column_major_terms() {
        let g = gemm(4, 3, 2);
        // A 4x2 F16, B 2x3 F16, C 4x3 F32.
        assert_eq!(gemm_extents(&g), Ok((16, 12, 48)));
        let t = Gemm {
            transa: true,
            lda: 2,
            ..g.clone()
        };
        // A stored 2x4 with lda 2: 8 elements.
        assert_eq!(gemm_extents(&t), Ok((16, 12, 48)));
        let batched = Gemm {
            batch: 5,
            stride_a: 8,
            stride_b: 0,
            stride_c: 12,
            ..g.clone()
        };
        assert_eq!(
            gemm_extents(&batched),
            Ok(((4 * 8 + 8) * 2, 12, (4 * 12 + 12) * 4))
        );
        let bad_ld = Gemm {
            lda: 3,
            ..g.clone()
        };
        assert!(gemm_extents(&bad_ld).is_err());
        assert_eq!(gemm_extents(&gemm(0, 3, 2)), Ok((0, 12, 0)));
    }

    #[test]
    fn gemm_types_follow_cublas() {
        assert!(gemm_params(&gemm(2, 2, 2)).is_ok());
        let mixed = Gemm {
            b_dtype: DType::BF16,
            ..gemm(2, 2, 2)
        };
        assert!(matches!(
            gemm_params(&mixed),
            Err(CudaError::Unsupported(_))
        ));
        let tf32_half = Gemm {
            compute: GemmCompute::Tf32,
            ..gemm(2, 2, 2)
        };
        assert!(gemm_params(&tf32_half).is_err());
        let f32_into_half = Gemm {
            a_dtype: DType::F32,
            b_dtype: DType::F32,
            c_dtype: DType::F16,
            ..gemm(2, 2, 2)
        };
        assert!(gemm_params(&f32_into_half).is_err());
        let ints = Gemm {
            a_dtype: DType::I32,
            ..gemm(2, 2, 2)
        };
        assert!(gemm_params(&ints).is_err());
    }

    fn slot(name: &str, bytes: u64) -> Slot {
        Slot {
            name: name.into(),
            bytes,
            kind: SlotKind::Internal,
        }
    }

    #[test]
    fn programs_are_checked_against_their_buffers() {
        let program = Program {
            slots: vec![slot("x", 8), slot("y", 48)],
            arena_bytes: 256,
            runs: vec![Run {
                name: "step".into(),
                commands: vec![
                    Command::Gemm(gemm(4, 3, 2)),
                    Command::Copy {
                        dst: Place::Slot {
                            slot: 1,
                            offset: 40,
                        },
                        src: Place::Arena { offset: 0 },
                        bytes: 8,
                    },
                ],
                ..Run::default()
            }],
            ..Program::default()
        };
        // B (12 bytes) overruns slot 0 (8 bytes).
        let e = check_program(&program).unwrap_err().to_string();
        assert!(e.contains("run `step` command 0 (node `%mm`)"), "{e}");
        assert!(e.contains("overrun slot 0 (`x`)"), "{e}");

        let mut ok = program.clone();
        ok.slots[0].bytes = 12;
        check_program(&ok).unwrap();

        let mut bad = ok.clone();
        bad.runs[0].commands[1] = Command::Memset {
            dst: Place::Slot { slot: 2, offset: 0 },
            bytes: 1,
            byte: 0,
        };
        let e = check_program(&bad).unwrap_err().to_string();
        assert!(e.contains("slot 2 does not exist"), "{e}");

        let mut bad = ok.clone();
        bad.runs[0].commands.push(Command::Launch(Launch {
            node: "k".into(),
            module: 0,
            entry: "f".into(),
            grid: (1, 1, 1),
            block: (32, 1, 1),
            shared_bytes: 0,
            args: vec![],
        }));
        let e = check_program(&bad).unwrap_err().to_string();
        assert!(e.contains("module 0 does not exist"), "{e}");
        bad.modules.push(Module {
            name: "m".into(),
            ..Module::default()
        });
        check_program(&bad).unwrap();
        bad.tables.push(Table::default());
        if let Command::Launch(l) = &mut bad.runs[0].commands[2] {
            l.args = vec![Arg::Table(1)];
        }
        let e = check_program(&bad).unwrap_err().to_string();
        assert!(e.contains("table 1 does not exist"), "{e}");
    }

    #[test]
    fn argument_lists_are_checked_against_parameters() {
        let l = Launch {
            node: "n".into(),
            module: 0,
            entry: "k".into(),
            grid: (1, 1, 1),
            block: (1, 1, 1),
            shared_bytes: 0,
            args: vec![Arg::Null, Arg::U16(1), Arg::Layout(CopyLayout::default())],
        };
        check_args(&l, "m", &[8, 2, 216]).unwrap();
        let e = check_args(&l, "m", &[8, 4, 216]).unwrap_err().to_string();
        assert!(e.contains("parameter 1 is 4 bytes"), "{e}");
        let e = check_args(&l, "m", &[8, 2]).unwrap_err().to_string();
        assert!(e.contains("takes 2 parameters, the launch passes 3"), "{e}");
    }

    /// Opening the device never panics: without a GPU (or a driver, cuBLAS or NVRTC) it is an
    /// error naming what is missing.
    #[test]
    fn device_open_does_not_panic() {
        match Device::open() {
            Ok(d) => println!(
                "device: {} ({}), memory {:?}",
                d.name(),
                d.arch(),
                d.mem_info()
            ),
            Err(e) => println!("no device: {e}"),
        }
    }

    /// On a GPU: a small program with a kernel of every argument kind, a product, copies
    /// and fills, run through a graph twice with new inputs. Skips without a device.
    #[test]
    fn device_runs_a_program_on_gpu() {
        let device = match Device::open() {
            Ok(d) => d,
            Err(e) => {
                // A GPU run must not skip silently.
                assert!(
                    std::env::var("CASTOR_REQUIRE_GPU").as_deref() != Ok("1"),
                    "CASTOR_REQUIRE_GPU=1 but {e}"
                );
                println!("skipped: {e}");
                return;
            }
        };
        let source = r#"
struct CopyLayout {
    long long shape[8];
    long long src_stride[8];
    long long dst_stride[8];
    long long src_offset;
    long long dst_offset;
    int rank;
    int pad;
};
struct Row { const float* p; long long n; };
extern "C" __global__ void probe(double* out, const Row* table, CopyLayout l,
                                 unsigned short h, int i, long long j, double d,
                                 const float* null_ptr) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    out[0] = (double)h;
    out[1] = (double)i;
    out[2] = (double)j;
    out[3] = d;
    out[4] = (double)(l.shape[7] + l.src_stride[1] + l.dst_offset + l.rank);
    out[5] = (double)table[1].n + (double)table[1].p[0];
    out[6] = null_ptr == 0 ? 1.0 : 0.0;
}
extern "C" __global__ void scale(float* x, int n, float by) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) x[k] *= by;
}
"#;
        // Slots: 0 = probe output (8 doubles), 1 = a (2x3 row-major), 2 = b (3x2 row-major),
        // 3 = c (2x2 row-major), 4 = a constant read through the table.
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let mut layout = CopyLayout {
            rank: 4,
            dst_offset: 100,
            ..CopyLayout::default()
        };
        layout.shape[7] = 1000;
        layout.src_stride[1] = 20;
        let table = Table {
            rows: vec![
                vec![Field::Null, Field::I64(0)],
                vec![
                    Field::Ptr(Place::Slot { slot: 4, offset: 0 }),
                    Field::I64(7),
                ],
            ],
        };
        let f32_gemm = |a: Place, b: Place, c: Place| Gemm {
            node: "c".into(),
            // Row-major c[2x2] = a[2x3] @ b[3x2] as column-major cᵀ = bᵀ aᵀ.
            a: b,
            b: a,
            c,
            a_dtype: DType::F32,
            b_dtype: DType::F32,
            c_dtype: DType::F32,
            transa: false,
            transb: false,
            m: 2,
            n: 2,
            k: 3,
            lda: 2,
            ldb: 3,
            ldc: 2,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            batch: 1,
            compute: GemmCompute::F32,
        };
        let program = Program {
            modules: vec![Module {
                name: "device_test".into(),
                source: source.into(),
                ..Module::default()
            }],
            slots: vec![
                slot("out", 64),
                slot("a", 24),
                slot("b", 24),
                slot("c", 16),
                Slot {
                    name: "k".into(),
                    bytes: 4,
                    kind: SlotKind::Constant(f32s(&[0.5])),
                },
            ],
            tables: vec![table],
            arena_bytes: 512,
            workspace_bytes: 1 << 20,
            prologue: vec![Command::Memset {
                dst: Place::Slot {
                    slot: 0,
                    offset: 56,
                },
                bytes: 8,
                byte: 0xff,
            }],
            runs: vec![Run {
                name: "step".into(),
                commands: vec![
                    Command::Launch(Launch {
                        node: "probe".into(),
                        module: 0,
                        entry: "probe".into(),
                        grid: (1, 1, 1),
                        block: (32, 1, 1),
                        shared_bytes: 0,
                        args: vec![
                            Arg::Ptr(Place::Slot { slot: 0, offset: 0 }),
                            Arg::Table(0),
                            Arg::Layout(layout),
                            Arg::U16(65000),
                            Arg::I32(-5),
                            Arg::I64(1 << 40),
                            Arg::F64(0.25),
                            Arg::Null,
                        ],
                    }),
                    // a and b through the arena, then doubled in place there.
                    Command::Copy {
                        dst: Place::Arena { offset: 0 },
                        src: Place::Slot { slot: 1, offset: 0 },
                        bytes: 24,
                    },
                    Command::Copy {
                        dst: Place::Arena { offset: 256 },
                        src: Place::Slot { slot: 2, offset: 0 },
                        bytes: 24,
                    },
                    Command::Launch(Launch {
                        node: "a2".into(),
                        module: 0,
                        entry: "scale".into(),
                        grid: (1, 1, 1),
                        block: (64, 1, 1),
                        shared_bytes: 0,
                        args: vec![
                            Arg::Ptr(Place::Arena { offset: 0 }),
                            Arg::I32(6),
                            Arg::U32(2.0f32.to_bits()),
                        ],
                    }),
                    Command::Gemm(f32_gemm(
                        Place::Arena { offset: 0 },
                        Place::Arena { offset: 256 },
                        Place::Slot { slot: 3, offset: 0 },
                    )),
                ],
                ..Run::default()
            }],
        };
        let mut loaded = device.load(&program).unwrap();
        loaded.run_prologue().unwrap();
        let f64s = |b: Vec<u8>| -> Vec<f64> {
            b.chunks(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let read_f32 = |l: &Loaded, slot: usize| -> Vec<f32> {
            l.read_slot(slot)
                .unwrap()
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        for step in 0..3 {
            let s = step as f32;
            let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0].map(|x| x + s);
            let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
            loaded.write_slot(1, &f32s(&a)).unwrap();
            loaded.write_slot(2, &f32s(&b)).unwrap();
            loaded.run(0).unwrap();
            let out = f64s(loaded.read_slot(0).unwrap());
            assert_eq!(
                &out[..7],
                &[65000.0, -5.0, (1u64 << 40) as f64, 0.25, 1124.0, 7.5, 1.0]
            );
            assert!(out[7].is_nan(), "the prologue's fill: {}", out[7]);
            // c = (2a) @ b, row-major.
            let a2 = a.map(|x| 2.0 * x);
            let want = [
                a2[0] * b[0] + a2[1] * b[2] + a2[2] * b[4],
                a2[0] * b[1] + a2[1] * b[3] + a2[2] * b[5],
                a2[3] * b[0] + a2[4] * b[2] + a2[5] * b[4],
                a2[3] * b[1] + a2[4] * b[3] + a2[5] * b[5],
            ];
            assert_eq!(read_f32(&loaded, 3), want, "step {step}");
        }
        loaded
            .copy(
                Place::Slot { slot: 3, offset: 0 },
                Place::Slot { slot: 4, offset: 0 },
                4,
            )
            .unwrap();
        assert_eq!(read_f32(&loaded, 3)[0], 0.5);
        assert!(loaded.read(Place::Slot { slot: 3, offset: 8 }, 16).is_err());
        assert!(loaded.write_slot(3, &[0; 4]).is_err());
        drop(loaded);

        let huge = Program {
            arena_bytes: 1 << 50,
            ..Program::default()
        };
        match device.load(&huge) {
            Err(e @ CudaError::OutOfMemory { .. }) => println!("{e}"),
            Err(e) => panic!("expected OutOfMemory, got {e}"),
            Ok(_) => panic!("a petabyte arena loaded"),
        }
    }
}
