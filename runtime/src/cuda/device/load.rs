//! Making a program resident: modules compiled (PTX cache) and loaded, kernels resolved and
//! their parameters checked, buffers allocated and initialized, and freed again on drop.

use super::check::{check_args, check_program, Extents};
use super::open::{Device, Inner};
use super::staging::Staging;
use super::{drv, CudaError, DEFAULT_MAX_SHARED, GRAPHS_VAR, MEMORY_MARGIN};
use crate::cuda::program::allocated as allocation_bytes;
use crate::cuda::program::{Command, Launch, Place, Program, SlotKind};
use castor_kernels::ptx::entry_params;
use castor_kernels::{CacheError, NvrtcError};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cu_sys;
use cudarc::driver::DriverError;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::rc::Rc;

impl Device {
    /// Makes `program` resident: compiles and loads its modules, allocates and initializes
    /// its buffers. Fails with [`CudaError::OutOfMemory`], allocating nothing, when it does
    /// not fit in free memory with [`MEMORY_MARGIN`] to spare.
    pub fn load(&self, program: &Program) -> Result<Loaded, CudaError> {
        let dev = &self.inner;
        dev.bind()?;
        check_program(program)?;

        let allocation = program.allocation();
        let workspace_bytes = allocation.workspace;
        let (free, total) = self.mem_info()?;
        let needed = allocation.total() + MEMORY_MARGIN;
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
            staging: Staging::default(),
            marks: Vec::new(),
            command_marks: Vec::new(),
            comm: None,
            side: None,
            cudnn: None,
            attention: None,
        };

        // Per module: entry name -> the size of each parameter, as its PTX declares them.
        let mut params: Vec<HashMap<String, Vec<usize>>> = Vec::new();
        for m in &program.modules {
            let (ptx, _) = dev
                .cache
                .ptx(dev.nvrtc, &m.name, &m.source, &dev.arch)
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
            params.push(
                entry_params(&ptx)
                    .into_iter()
                    .map(|(entry, ps)| (entry, ps.into_iter().map(|p| p.bytes).collect()))
                    .collect(),
            );
        }
        loaded.resolve_functions(&params)?;
        loaded.prepare_attention()?;

        let alloc = |bytes: u64, what: &dyn Fn() -> String| -> Result<u64, CudaError> {
            let bytes = usize::try_from(allocation_bytes(bytes))
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
            let n = allocation_bytes(bytes) as usize;
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
        loaded.staging = Staging::for_inputs(&loaded)?;
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

/// A program resident on the device: its modules loaded, its buffers allocated at fixed
/// addresses, its runs captured as CUDA graphs on first use.
pub struct Loaded {
    pub(super) dev: Rc<Inner>,
    pub(super) program: Program,
    pub(super) modules: Vec<cu_sys::CUmodule>,
    /// Per module: entry name → function.
    pub(super) functions: Vec<HashMap<String, cu_sys::CUfunction>>,
    pub(super) arena: u64,
    pub(super) slots: Vec<u64>,
    pub(super) tables: Vec<u64>,
    pub(super) workspace: u64,
    pub(super) workspace_bytes: u64,
    /// Per run: its instantiated graph, once captured.
    pub(super) graphs: Vec<Option<cu_sys::CUgraphExec>>,
    pub(super) use_graphs: bool,
    /// Pinned buffers for asynchronous input uploads.
    pub(super) staging: Staging,
    /// Timing events (`mark`), made on first use.
    pub(super) marks: Vec<cu_sys::CUevent>,
    /// Events around each command of a timed run (`run_timed`), made on first use.
    pub(super) command_marks: Vec<cu_sys::CUevent>,
    /// This rank's NCCL communicator, for a data-parallel program's collectives.
    pub(super) comm: Option<crate::cuda::nccl::Communicator>,
    /// The side stream its gradient reductions run on, with their events.
    pub(super) side: Option<SideStream>,
    /// cuDNN with the plans of the program's fused attention, where it runs them.
    pub(super) cudnn: Option<super::cudnn::Cudnn>,
    /// What runs the program's fused attention, for the device line.
    pub(super) attention: Option<String>,
}

/// A second stream for collectives that overlap compute (`Command::Collective::side`): each
/// waits for the compute stream's work so far (`fork`), then records its own event, which a
/// `Command::Join` makes the compute stream wait for.
pub(super) struct SideStream {
    pub(super) stream: cu_sys::CUstream,
    pub(super) fork: cu_sys::CUevent,
    pub(super) events: Vec<cu_sys::CUevent>,
}

impl Loaded {
    /// Finds cuDNN and builds a plan for each of the program's cuDNN attention passes that it
    /// can express. A pass that must run on cuDNN (`--attention cudnn`) and cannot is an
    /// error naming why; one that may fall back runs castor's kernels, and
    /// [`Loaded::attention`] says so.
    fn prepare_attention(&mut self) -> Result<(), CudaError> {
        use crate::cuda::sdpa::Sdpa;
        let calls: Vec<Sdpa> = self
            .program
            .all_commands()
            .filter_map(|c| match c {
                Command::Sdpa(call) if call.unsupported.is_none() => Some((**call).clone()),
                _ => None,
            })
            .collect();
        let passes = self
            .program
            .all_commands()
            .filter(|c| matches!(c, Command::Sdpa(_)))
            .count();
        if passes == 0 {
            return Ok(());
        }
        let required = |call: &Sdpa| call.fallback.is_empty();
        let refuse = |call: &Sdpa, why: &str| {
            CudaError::NoCudnn(format!(
                "--attention cudnn: cuDNN cannot run %{}: {why} (--attention auto runs \
                 castor's kernels instead)",
                call.node
            ))
        };
        // A bad value is an error whichever backend would run: it names the variable.
        let any_engine = super::cudnn::any_engine_requested().map_err(CudaError::NoCudnn)?;
        let cudnn = super::cudnn::probe().and_then(|v| super::cudnn::Cudnn::new(v, any_engine));
        let mut cudnn = match cudnn {
            Ok(c) => c,
            Err(why) => {
                if let Some(call) = calls.iter().find(|c| required(c)) {
                    return Err(refuse(call, &why));
                }
                self.attention = Some(format!("castor's kernels ({why})"));
                return Ok(());
            }
        };
        let (mut on_cudnn, mut nondeterministic, mut failed) = (0, 0, None);
        // Each pass direction's engines, in order of first use.
        let mut engines: Vec<(&str, String)> = Vec::new();
        for call in &calls {
            match cudnn.plan(call, self.workspace_bytes) {
                Ok(plan) => {
                    on_cudnn += 1;
                    if !plan.deterministic {
                        nondeterministic += 1;
                    }
                    let pass = match call.pass {
                        crate::cuda::sdpa::SdpaPass::Forward => "forward",
                        crate::cuda::sdpa::SdpaPass::Backward => "backward",
                    };
                    let used = (pass, plan.engine.clone());
                    if !engines.contains(&used) {
                        engines.push(used);
                    }
                }
                Err(why) if required(call) => return Err(refuse(call, &why)),
                Err(why) => {
                    failed.get_or_insert(format!("%{}: {why}", call.node));
                }
            }
        }
        let mut line = format!(
            "cuDNN {} ({}) runs {on_cudnn} of {passes} passes",
            super::cudnn::version_name(cudnn.version),
            super::cudnn_api::api().source
        );
        if on_cudnn < passes {
            line.push_str(", castor's kernels the rest");
            if let Some(why) = failed {
                line.push_str(&format!(" (first refused: {why})"));
            }
        }
        if nondeterministic > 0 && cudnn.any_engine {
            line.push_str(&format!(
                "; {nondeterministic} on nondeterministic engines ({}=1)",
                super::cudnn::ANY_ENGINE_ENV
            ));
        } else if nondeterministic > 0 {
            line.push_str(&format!(
                "; {nondeterministic} with no deterministic engine for their shape"
            ));
        }
        for (pass, engine) in &engines {
            line.push_str(&format!("; {pass}: {engine}"));
        }
        self.attention = Some(line);
        self.cudnn = Some(cudnn);
        Ok(())
    }

    /// What runs the program's fused attention passes (cuDNN, castor's kernels, and why),
    /// when it has any that cuDNN may run: `cuDNN 9.19.0 (/usr/lib/libcudnn.so.9) runs 32 of 32
    /// passes`.
    pub fn attention(&self) -> Option<&str> {
        self.attention.as_deref()
    }

    /// Whether cuDNN runs `call`: a plan was built for it at load.
    pub fn runs_on_cudnn(&self, call: &crate::cuda::sdpa::Sdpa) -> bool {
        self.cudnn.as_ref().is_some_and(|c| c.built(call).is_some())
    }

    /// Device memory this program holds: [`Program::allocation`], which is what `load`
    /// allocated.
    pub fn allocated_bytes(&self) -> u64 {
        self.program.allocation().total()
    }

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
            Place::Buffer { .. } => 0,
        }
    }

    /// The device address of table `i` (0 if there is none).
    pub(super) fn table_address(&self, i: usize) -> u64 {
        self.tables.get(i).copied().unwrap_or(0)
    }

    pub(super) fn check_place(&self, p: Place, bytes: u64, what: &str) -> Result<(), CudaError> {
        Extents {
            program: &self.program,
        }
        .check(p, bytes)
        .map_err(|why| CudaError::Data(format!("{what}: {why}")))
    }

    /// Resolves every launch's kernel, loads it, opts it into the dynamic shared memory it
    /// is launched with, and checks the launch's arguments against its parameters (`params`:
    /// per module, each entry's parameter sizes from its PTX).
    fn resolve_functions(
        &mut self,
        params: &[HashMap<String, Vec<usize>>],
    ) -> Result<(), CudaError> {
        let mut shared: HashMap<(usize, String), u32> = HashMap::new();
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
            let sizes = params[l.module].get(&l.entry).ok_or_else(|| {
                CudaError::Data(format!(
                    "kernel `{}` (node `%{}`) is not an entry point of module `{module_name}`'s PTX",
                    l.entry, l.node
                ))
            })?;
            check_args(l, module_name, sizes)?;
        }
        Ok(())
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // Nothing may still use the buffers when they are freed.
        let _ = self.dev.synchronize("freeing a program");
        // The communicator goes first, with the context current.
        self.comm = None;
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
            for e in self.marks.drain(..).chain(self.command_marks.drain(..)) {
                let _ = cu::event::destroy(e);
            }
            if let Some(side) = self.side.take() {
                for e in side.events.into_iter().chain([side.fork]) {
                    let _ = cu::event::destroy(e);
                }
                let _ = cu::stream::destroy(side.stream);
            }
        }
        // The stream is idle (above): the pinned buffers may go.
        drop(std::mem::take(&mut self.staging));
    }
}
