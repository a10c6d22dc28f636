//! The host build of the kernel sources: every family's `.cu` file, and every kernel castor
//! generates, compiled as C++ for the CPU and run there, so that their arithmetic and control
//! flow are tested on machines without a GPU.
//!
//! The sources compile unmodified against `host/castor_host.h`, which supplies what CUDA code
//! uses (thread and block indices, `__syncthreads`, warp shuffles and votes, atomics, the
//! half and bfloat16 types, math functions); `host/runtime.cpp` runs a launch's blocks one
//! after another and a block's threads as fibers that switch at barriers and warp operations.
//!
//! Why the host compiler at run time (not `cc` at build time): the fused kernels exist only
//! once a plan is lowered, so they must be compiled while castor runs, and one mechanism then
//! serves the hand-written files too. The compiler is `$CXX`, else `g++` (on every Linux CI
//! machine); builds are cached on disk like the PTX ([`build`]), so each distinct source is
//! compiled once per machine. A module is a shared library loaded for the life of the process;
//! the runtime is one more, loaded first with its symbols global.
//!
//! Sanitizers: with `CASTOR_HOST_SANITIZE=address` the kernels are built with
//! AddressSanitizer and UndefinedBehaviorSanitizer, with `thread` with ThreadSanitizer and
//! UndefinedBehaviorSanitizer (the runtime annotates its fiber switches and barriers). The
//! process must have the sanitizer's runtime loaded first (`LD_PRELOAD`, see
//! [`sanitizer_runtime`]); an error says so otherwise.

mod build;

pub use build::{sanitizer_env, sanitizer_runtime, Sanitize, SANITIZE_VAR};

use libloading::Library;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

/// What went wrong building or loading a host module.
#[derive(Clone, Debug, thiserror::Error)]
pub enum HostError {
    #[error("the host C++ compiler `{compiler}` cannot be run: {reason}")]
    NoCompiler { compiler: String, reason: String },
    #[error("the host compiler could not build {name}:\n{log}")]
    Compile { name: String, log: String },
    #[error("host build cache `{path}`: {reason}")]
    Io { path: PathBuf, reason: String },
    #[error("cannot load the host build {path}: {reason}")]
    Load { path: PathBuf, reason: String },
    #[error(
        "{var}={value}: not one of `address` (AddressSanitizer + UndefinedBehaviorSanitizer) or \
         `thread` (ThreadSanitizer + UndefinedBehaviorSanitizer)"
    )]
    BadSanitize { var: &'static str, value: String },
    #[error(
        "{var}={sanitize} needs the sanitizer's runtime loaded before anything else: run with \
         LD_PRELOAD={library}"
    )]
    SanitizerNotLoaded {
        var: &'static str,
        sanitize: &'static str,
        library: String,
    },
}

/// F32 functions the kernels call that the host process supplies: the CPU executor's own
/// (castor_host.h says which and why), so that a kernel run on the host computes exactly
/// what its CPU twin computes.
#[derive(Clone, Copy, Debug)]
pub struct HostMath {
    pub expf: extern "C" fn(f32) -> f32,
    pub erff: extern "C" fn(f32) -> f32,
}

/// The kind of a kernel parameter, from its C type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    Ptr,
    I8,
    U8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
    F32,
    F64,
    /// A struct passed by value.
    Struct,
}

/// One parameter of an entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    pub kind: ParamKind,
    /// Bytes of the argument value.
    pub size: usize,
    /// Bytes of the pointed-to type (0 for `void*` and non-pointers).
    pub pointee: usize,
}

/// A launch's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

/// The order blocks and threads are started (and barriers release threads) in. Running a
/// kernel both ways and comparing exposes most missing barriers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Order {
    #[default]
    Forward,
    Reverse,
    /// Blocks in index order, as the device dispatches them, and each block's threads in
    /// reverse: the reverse run of a kernel whose blocks wait for earlier blocks (the
    /// attention backward's ordered dQ sums), which could never finish with its blocks
    /// reversed.
    ReverseThreads,
}

#[repr(C)]
struct RawLaunch {
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    order: u32,
}

type LaunchFn =
    unsafe extern "C" fn(*const RawLaunch, *const *mut c_void, *mut c_char, usize) -> c_int;

#[repr(C)]
struct RawParam {
    kind: c_int,
    size: c_int,
    pointee: c_int,
}

#[repr(C)]
struct RawEntry {
    name: *const c_char,
    launch: LaunchFn,
    n_params: c_int,
    params: *const RawParam,
}

/// An entry point of a loaded module.
#[derive(Debug)]
pub struct HostEntry {
    pub name: String,
    /// The parameters, from the function's C type.
    pub params: Vec<Param>,
    launch: LaunchFn,
}

impl HostEntry {
    /// Runs the kernel on the calling thread.
    ///
    /// # Safety
    /// `args` has one pointer per parameter, each to a value of the parameter's type; every
    /// pointer argument points to memory the kernel may read and write as the launch does
    /// (the host build dereferences it for real).
    pub unsafe fn launch(
        &self,
        shape: &LaunchShape,
        order: Order,
        args: &[*mut c_void],
    ) -> Result<(), String> {
        if args.len() != self.params.len() {
            return Err(format!(
                "{} arguments for {}'s {} parameters",
                args.len(),
                self.name,
                self.params.len()
            ));
        }
        let raw = RawLaunch {
            grid: [shape.grid.0, shape.grid.1, shape.grid.2],
            block: [shape.block.0, shape.block.1, shape.block.2],
            shared_bytes: shape.shared_bytes,
            order: match order {
                Order::Forward => 0,
                Order::Reverse => 1,
                Order::ReverseThreads => 2,
            },
        };
        let mut err = vec![0u8; 1024];
        // SAFETY: `raw` and `err` outlive the call; the caller vouches for `args`.
        let rc = unsafe {
            (self.launch)(
                &raw,
                args.as_ptr(),
                err.as_mut_ptr().cast::<c_char>(),
                err.len(),
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
        Err(String::from_utf8_lossy(&err[..end]).into_owned())
    }
}

/// A module's host build, loaded for the life of the process.
pub struct HostModule {
    pub name: String,
    entries: Vec<HostEntry>,
    _lib: Library,
}

impl HostModule {
    pub fn entry(&self, name: &str) -> Option<&HostEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    pub fn entries(&self) -> &[HostEntry] {
        &self.entries
    }
}

impl std::fmt::Debug for HostModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostModule")
            .field("name", &self.name)
            .field("entries", &self.entries.len())
            .finish()
    }
}

type Cell = Arc<OnceLock<Result<Arc<HostModule>, HostError>>>;

/// The process's host builds: the runtime, and the modules by build key.
struct Host {
    build: build::Builder,
    runtime: OnceLock<Result<Library, HostError>>,
    modules: Mutex<HashMap<String, Cell>>,
}

fn host() -> Result<&'static Host, HostError> {
    static HOST: OnceLock<Result<Host, HostError>> = OnceLock::new();
    HOST.get_or_init(|| {
        Ok(Host {
            build: build::Builder::from_env()?,
            runtime: OnceLock::new(),
            modules: Mutex::new(HashMap::new()),
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The sanitizers this process's host builds use (`CASTOR_HOST_SANITIZE`).
pub fn sanitize() -> Result<Sanitize, HostError> {
    Ok(host()?.build.sanitize)
}

/// The host build of `source` (named `name` in messages, defining the `extern "C"` entry
/// points `entries`), built or found in the cache, loaded, with `math` installed.
pub fn module(
    name: &str,
    source: &str,
    entries: &[&str],
    math: HostMath,
) -> Result<Arc<HostModule>, HostError> {
    let host = host()?;
    let runtime = host
        .runtime
        .get_or_init(|| host.build.runtime())
        .as_ref()
        .map_err(Clone::clone)?;
    // SAFETY: the runtime's `castor_host_set_math` has this C type (runtime.cpp).
    unsafe {
        let set = runtime
            .get::<unsafe extern "C" fn(extern "C" fn(f32) -> f32, extern "C" fn(f32) -> f32)>(
                b"castor_host_set_math\0",
            )
            .map_err(|e| HostError::Load {
                path: "the host runtime".into(),
                reason: e.to_string(),
            })?;
        set(math.expf, math.erff);
    }
    let key = host.build.module_key(name, source, entries);
    let cell = {
        let mut map = host
            .modules
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.entry(key.clone()).or_default().clone()
    };
    cell.get_or_init(|| {
        let path = host.build.module(name, source, entries, &key)?;
        load(name, path).map(Arc::new)
    })
    .clone()
}

/// Loads a built module and reads its entry table.
fn load(name: &str, path: PathBuf) -> Result<HostModule, HostError> {
    let err = |reason: String| HostError::Load {
        path: path.clone(),
        reason,
    };
    // SAFETY: a library castor built from its own sources; its initializers only set up
    // thread-local storage.
    let lib = unsafe { Library::new(&path) }.map_err(|e| err(e.to_string()))?;
    // SAFETY: the symbols have these types (castor_host_entries.h); the table lives as long
    // as the library, which this module keeps loaded.
    let entries = unsafe {
        let table = lib
            .get::<*const RawEntry>(b"castor_host_entry_table\0")
            .map_err(|e| err(e.to_string()))?;
        let count = lib
            .get::<*const c_int>(b"castor_host_entry_count\0")
            .map_err(|e| err(e.to_string()))?;
        let table: *const RawEntry = *table;
        let n = usize::try_from(**count).unwrap_or(0);
        (0..n)
            .map(|i| {
                let e = &*table.add(i);
                let params = (0..usize::try_from(e.n_params).unwrap_or(0))
                    .map(|p| {
                        let p = &*e.params.add(p);
                        Param {
                            kind: param_kind(p.kind),
                            size: usize::try_from(p.size).unwrap_or(0),
                            pointee: usize::try_from(p.pointee).unwrap_or(0),
                        }
                    })
                    .collect();
                HostEntry {
                    name: CStr::from_ptr(e.name).to_string_lossy().into_owned(),
                    params,
                    launch: e.launch,
                }
            })
            .collect()
    };
    Ok(HostModule {
        name: name.to_string(),
        entries,
        _lib: lib,
    })
}

fn param_kind(k: c_int) -> ParamKind {
    match k {
        1 => ParamKind::Ptr,
        2 => ParamKind::I8,
        3 => ParamKind::U8,
        4 => ParamKind::I16,
        5 => ParamKind::U16,
        6 => ParamKind::I32,
        7 => ParamKind::U32,
        8 => ParamKind::I64,
        9 => ParamKind::U64,
        10 => ParamKind::F32,
        11 => ParamKind::F64,
        _ => ParamKind::Struct,
    }
}

/// The host build's own sources, as `(include name, text)`: written next to each module's
/// source when it is compiled.
pub const HOST_HEADERS: [(&str, &str); 4] = [
    ("castor_host.h", include_str!("../../host/castor_host.h")),
    (
        "castor_host_entries.h",
        include_str!("../../host/castor_host_entries.h"),
    ),
    (
        "include/cuda_fp16.h",
        include_str!("../../host/include/cuda_fp16.h"),
    ),
    (
        "include/cuda_bf16.h",
        include_str!("../../host/include/cuda_bf16.h"),
    ),
];

/// The runtime's source.
pub const RUNTIME_SOURCE: (&str, &str) = ("runtime.cpp", include_str!("../../host/runtime.cpp"));
