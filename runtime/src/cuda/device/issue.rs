//! Issuing a run: captured once as a CUDA graph and replayed, or issued command by command;
//! kernel launches, cuBLAS products, copies and fills on the one stream.

use super::args::{arg_bytes, to_words};
use super::check::gemm_params;
use super::load::Loaded;
use super::{blas, blas_check, blas_sys, drv, CudaError};
use crate::cuda::program::{Command, Epilogue, Gemm, Launch, Place, PRODUCT_WORKSPACE};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cu_sys;
use std::ffi::c_void;

impl Loaded {
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

    /// Points cuBLAS at this program's workspace (before products are issued or captured).
    pub(super) fn set_workspace(&self) -> Result<(), CudaError> {
        if self.workspace == 0 {
            return Ok(());
        }
        // SAFETY: the handle is live; the workspace is a live 256-byte aligned allocation of
        // `workspace_bytes` (no fewer than given here) that outlives every product issued
        // with it.
        let r = unsafe {
            blas_sys::cublasSetWorkspace_v2(
                self.dev.blas.0,
                std::ptr::without_provenance_mut(self.workspace as usize),
                self.workspace_bytes.min(PRODUCT_WORKSPACE) as usize,
            )
        }
        .result();
        blas_check(r, "", "cublasSetWorkspace")
    }

    /// Issues `commands` on the stream, in order.
    pub(super) fn issue(&self, commands: &[Command]) -> Result<(), CudaError> {
        for c in commands {
            match c {
                Command::Sdpa(call) => {
                    let plan = self.cudnn.as_ref().filter(|c| c.built(call).is_some());
                    if let Some((dst, bytes)) = plan.and_then(|c| c.zeroed_first(call)) {
                        self.issue(&[Command::Memset {
                            dst,
                            bytes,
                            byte: 0,
                        }])?;
                    }
                    match plan {
                        Some(cudnn) => {
                            self.issue(&call.prelude)?;
                            // SAFETY: every place of the call was checked at load to lie in
                            // its live buffer; the workspace is the program's, as large as
                            // the plan asked for.
                            unsafe {
                                cudnn.execute(
                                    call,
                                    &|p| self.address(p),
                                    self.workspace,
                                    self.dev.stream(),
                                )
                            }
                            .map_err(|message| CudaError::Cudnn {
                                node: call.node.clone(),
                                message,
                            })?
                        }
                        None if call.fallback.is_empty() => {
                            return Err(CudaError::Unsupported(format!(
                                "%{}: no cuDNN plan and no fallback",
                                call.node
                            )))
                        }
                        None => self.issue(&call.fallback)?,
                    }
                }
                Command::Launch(l) => self.launch(l)?,
                Command::Gemm(g) => self.gemm(g)?,
                Command::Copy { dst, src, bytes } => {
                    self.memcpy(*dst, *src, *bytes, "a copy command")?
                }
                Command::Collective {
                    node,
                    op,
                    dtype,
                    src,
                    dst,
                    src_bytes,
                    dst_bytes,
                    side,
                } => {
                    let comm = self.comm.as_ref().ok_or_else(|| {
                        CudaError::Unsupported(format!(
                            "`{}` for %{node}: a data-parallel program runs as one rank of a \
                             launched group (`torchrun --nproc-per-node N --no-python castor \
                             train ...`), whose NCCL communicator it needs",
                            op.mnemonic()
                        ))
                    })?;
                    // A side collective first waits for the compute stream's work so far.
                    let stream = match side {
                        Some(_) => {
                            let s = self.side_stream(node)?;
                            // SAFETY: the event and both streams are live (this program's).
                            drv(
                                unsafe {
                                    cu::event::record(s.fork, self.dev.stream()).and_then(|()| {
                                        cu::stream::wait_event(
                                            s.stream,
                                            s.fork,
                                            cu_sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                                        )
                                    })
                                },
                                || format!("forking the side stream for %{node}"),
                            )?;
                            s.stream
                        }
                        None => self.dev.stream(),
                    };
                    // SAFETY: both places span their byte counts of live allocations
                    // (checked at load) on the communicator's device; the stream is this
                    // context's.
                    unsafe {
                        comm.issue(
                            op,
                            *dtype,
                            self.address(*src),
                            *src_bytes,
                            self.address(*dst),
                            *dst_bytes,
                            stream,
                        )
                    }
                    .map_err(|e| match e {
                        CudaError::Nccl(m) => CudaError::Nccl(format!("{m} (for %{node})")),
                        e => e,
                    })?;
                    if let Some(k) = side {
                        let s = self.side_stream(node)?;
                        let event = *s.events.get(*k).ok_or_else(|| {
                            CudaError::Data(format!("side event {k} of %{node} does not exist"))
                        })?;
                        // SAFETY: the event and the side stream are live.
                        drv(unsafe { cu::event::record(event, s.stream) }, || {
                            format!("recording side event {k} for %{node}")
                        })?;
                    }
                }
                Command::Join { events } => {
                    let s = self.side_stream("a join")?;
                    for k in events {
                        let event = *s.events.get(*k).ok_or_else(|| {
                            CudaError::Data(format!("side event {k} does not exist"))
                        })?;
                        // SAFETY: the event and the compute stream are live.
                        drv(
                            unsafe {
                                cu::stream::wait_event(
                                    self.dev.stream(),
                                    event,
                                    cu_sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                                )
                            },
                            || format!("joining side event {k}"),
                        )?;
                    }
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

    /// The side stream, made when the program joined its group.
    fn side_stream(&self, what: &str) -> Result<&super::load::SideStream, CudaError> {
        self.side.as_ref().ok_or_else(|| {
            CudaError::Data(format!(
                "{what} runs on the side stream, which only a rank of a group has"
            ))
        })
    }

    pub(super) fn memcpy(
        &self,
        dst: Place,
        src: Place,
        bytes: u64,
        what: &str,
    ) -> Result<(), CudaError> {
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
        if g.epilogue != Epilogue::None || g.fp8.is_some() {
            return self.gemm_lt(g, &p);
        }
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let alpha = g.alpha;
        let beta = if g.accumulate { 1.0f32 } else { 0.0f32 };
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
