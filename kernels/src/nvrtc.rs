//! NVRTC, opened at run time from a folder, and the compile of a kernel file to PTX.
//!
//! The folder is the one `pip install --target DIR nvidia-cuda-nvrtc nvidia-cuda-runtime`
//! fills: the libraries are in `DIR/nvidia/cu13/lib` and the CUDA headers (`cuda_fp16.h`,
//! `cuda_bf16.h`) in `DIR/nvidia/cu13/include`. A CUDA toolkit folder (`lib64`, `include`)
//! works too. Nothing here needs a GPU or a driver.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use libloading::Library;

use crate::{KernelFile, COMMON_HEADER};

/// The environment variable naming the NVRTC folder.
pub const NVRTC_DIR_VAR: &str = "CASTOR_NVRTC_DIR";

/// The environment variables [`Nvrtc::discover`] reads, in order, before [`DEFAULT_CUDA_DIR`].
pub const DISCOVER_VARS: [&str; 3] = [NVRTC_DIR_VAR, "CUDA_HOME", "CUDA_PATH"];

/// The CUDA toolkit folder [`Nvrtc::discover`] tries last.
pub const DEFAULT_CUDA_DIR: &str = "/usr/local/cuda";

/// What went wrong opening NVRTC or compiling with it.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    #[error("no NVRTC in {dir}: {reason}")]
    NotFound { dir: PathBuf, reason: String },
    #[error("cannot open {path}: {source}")]
    Load {
        path: PathBuf,
        source: libloading::Error,
    },
    #[error("{path} has no symbol {symbol}: {source}")]
    Symbol {
        path: PathBuf,
        symbol: &'static str,
        source: libloading::Error,
    },
    #[error("{call} failed: {message} (nvrtcResult {code})")]
    Api {
        call: &'static str,
        code: i32,
        message: String,
    },
    #[error(
        "no NVRTC 13 found; tried {}. Set {NVRTC_DIR_VAR} to a folder filled by `pip install \
         --target DIR \"nvidia-cuda-nvrtc==13.0.*\" \"nvidia-cuda-runtime==13.0.*\"`, or to a \
         CUDA 13 toolkit",
        .tried.join("; ")
    )]
    NotDiscovered {
        /// Each place looked in, with why it was not used.
        tried: Vec<String>,
    },
    #[error("{what} contains a NUL byte")]
    Nul { what: String },
    #[error("NVRTC could not compile {file} for {arch}:\n{log}")]
    Compile {
        file: String,
        arch: String,
        log: String,
    },
}

type Program = *mut std::ffi::c_void;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// The NVRTC functions this crate calls, resolved once.
struct Api {
    version: VersionFn,
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    ptx_size: SizeFn,
    ptx: GetFn,
    destroy: DestroyFn,
    error_string: ErrorStringFn,
}

/// An opened NVRTC and the CUDA include folder to compile against.
pub struct Nvrtc {
    api: Api,
    include_dir: PathBuf,
    lib_path: PathBuf,
    // Kept open for the lifetime of the function pointers in `api`; `_builtins` is opened first
    // so that NVRTC finds it without LD_LIBRARY_PATH.
    _lib: Library,
    _builtins: Option<Library>,
}

/// The library and include folders of an NVRTC install: the pip layout or a toolkit's.
fn layout(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    [
        (dir.join("nvidia/cu13/lib"), dir.join("nvidia/cu13/include")),
        (dir.join("lib64"), dir.join("include")),
        (dir.join("lib"), dir.join("include")),
    ]
    .into_iter()
    .find(|(lib, inc)| lib.join("libnvrtc.so.13").is_file() && inc.join("cuda_fp16.h").is_file())
}

impl Nvrtc {
    /// Opens NVRTC 13 from `dir` (a `pip install --target` folder or a CUDA toolkit folder).
    pub fn open(dir: &Path) -> Result<Self, NvrtcError> {
        let (lib_dir, include_dir) = layout(dir).ok_or_else(|| NvrtcError::NotFound {
            dir: dir.to_path_buf(),
            reason: "expected nvidia/cu13/lib/libnvrtc.so.13 and nvidia/cu13/include/cuda_fp16.h \
                     (pip install --target DIR \"nvidia-cuda-nvrtc==13.0.*\" \
                     \"nvidia-cuda-runtime==13.0.*\")"
                .into(),
        })?;
        let open = |path: PathBuf| {
            // SAFETY: NVRTC's initializers have no preconditions.
            unsafe { Library::new(&path) }.map_err(|source| NvrtcError::Load { path, source })
        };
        let builtins_path = lib_dir.join("libnvrtc-builtins.so.13.0");
        let builtins = if builtins_path.is_file() {
            Some(open(builtins_path)?)
        } else {
            None
        };
        let lib_path = lib_dir.join("libnvrtc.so.13");
        let lib = open(lib_path.clone())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the signature is NVRTC's, from nvrtc.h.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|source| {
                    NvrtcError::Symbol {
                        path: lib_path.clone(),
                        symbol: $name,
                        source,
                    }
                })?
            };
        }
        let api = Api {
            version: sym!("nvrtcVersion"),
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            ptx_size: sym!("nvrtcGetPTXSize"),
            ptx: sym!("nvrtcGetPTX"),
            destroy: sym!("nvrtcDestroyProgram"),
            error_string: sym!("nvrtcGetErrorString"),
        };
        Ok(Self {
            api,
            include_dir,
            lib_path,
            _lib: lib,
            _builtins: builtins,
        })
    }

    /// Opens NVRTC from the folder `CASTOR_NVRTC_DIR` names; `Ok(None)` when it is unset.
    pub fn from_env() -> Result<Option<Self>, NvrtcError> {
        match std::env::var_os(NVRTC_DIR_VAR) {
            Some(dir) if !dir.is_empty() => Self::open(Path::new(&dir)).map(Some),
            _ => Ok(None),
        }
    }

    /// Opens NVRTC 13 from the first place that has it: `$CASTOR_NVRTC_DIR`, `$CUDA_HOME`,
    /// `$CUDA_PATH`, then `/usr/local/cuda` (each a `pip install --target` folder or a CUDA
    /// toolkit). The error lists every place tried and why it was not used.
    pub fn discover() -> Result<Self, NvrtcError> {
        let mut candidates: Vec<(String, Option<PathBuf>)> = DISCOVER_VARS
            .iter()
            .map(|var| {
                let dir = std::env::var_os(var)
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from);
                (format!("${var}"), dir)
            })
            .collect();
        candidates.push((
            DEFAULT_CUDA_DIR.to_string(),
            Some(PathBuf::from(DEFAULT_CUDA_DIR)),
        ));
        Self::discover_in(&candidates)
    }

    /// The process's NVRTC: [`Self::discover`] on the first call, the same library on every
    /// later one (opening it again per device or per compile would reload it), or the first
    /// call's error.
    pub fn shared() -> Result<&'static Nvrtc, String> {
        static SHARED: std::sync::OnceLock<Result<Nvrtc, String>> = std::sync::OnceLock::new();
        SHARED
            .get_or_init(|| Self::discover().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Opens NVRTC from the first of `candidates` (a label, and the folder or `None` when the
    /// variable is unset) that has it.
    fn discover_in(candidates: &[(String, Option<PathBuf>)]) -> Result<Self, NvrtcError> {
        let mut tried = Vec::new();
        for (label, dir) in candidates {
            let Some(dir) = dir else {
                tried.push(format!("{label} (not set)"));
                continue;
            };
            let shown = if label.starts_with('$') {
                format!("{label}={}", dir.display())
            } else {
                label.clone()
            };
            if !dir.is_dir() {
                tried.push(format!("{shown} (no such folder)"));
                continue;
            }
            match Self::open(dir) {
                Ok(nvrtc) => return Ok(nvrtc),
                Err(NvrtcError::NotFound { .. }) => tried.push(format!(
                    "{shown} (no libnvrtc.so.13 with cuda_fp16.h in nvidia/cu13/{{lib,include}}, \
                     lib64/include or lib/include)"
                )),
                Err(e) => tried.push(format!("{shown} ({e})")),
            }
        }
        Err(NvrtcError::NotDiscovered { tried })
    }

    /// The library that was opened.
    pub fn library_path(&self) -> &Path {
        &self.lib_path
    }

    /// The CUDA include folder kernels are compiled against.
    pub fn include_dir(&self) -> &Path {
        &self.include_dir
    }

    /// NVRTC's `(major, minor)` version.
    pub fn version(&self) -> Result<(i32, i32), NvrtcError> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        let code = unsafe { (self.api.version)(&mut major, &mut minor) };
        self.check("nvrtcVersion", code)?;
        Ok((major, minor))
    }

    fn check(&self, call: &'static str, code: c_int) -> Result<(), NvrtcError> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static string for any code.
        let message = unsafe {
            let s = (self.api.error_string)(code);
            if s.is_null() {
                String::from("unknown error")
            } else {
                CStr::from_ptr(s).to_string_lossy().into_owned()
            }
        };
        Err(NvrtcError::Api {
            call,
            code,
            message,
        })
    }

    /// Compiles one kernel file to PTX for `arch` (`"sm_90"`), with the shared header.
    pub fn compile(&self, file: &KernelFile, arch: &str) -> Result<String, NvrtcError> {
        self.compile_kernel(file.name, file.source, arch)
    }

    /// Compiles a kernel source (a file, or one castor generated) named `name` to PTX for
    /// `arch`, with the shared header and the options every kernel is built with.
    pub fn compile_kernel(
        &self,
        name: &str,
        source: &str,
        arch: &str,
    ) -> Result<String, NvrtcError> {
        let compute = arch.replace("sm_", "compute_");
        let options = [
            format!("--gpu-architecture={compute}"),
            "--std=c++17".into(),
            format!("--include-path={}", self.include_dir.display()),
            // IEEE arithmetic as in the CPU twins: correctly rounded division and square
            // root, no flush to zero, and no contraction of a * b + c into an FMA.
            "--fmad=false".into(),
            "--prec-div=true".into(),
            "--prec-sqrt=true".into(),
            "--ftz=false".into(),
            "--device-as-default-execution-space".into(),
        ];
        self.compile_source(name, source, &options)
            .map_err(|e| match e {
                NvrtcError::Compile { log, .. } => NvrtcError::Compile {
                    file: name.into(),
                    arch: arch.into(),
                    log,
                },
                e => e,
            })
    }

    /// Compiles `source` (named `name` in messages) with NVRTC `options` to PTX.
    pub fn compile_source(
        &self,
        name: &str,
        source: &str,
        options: &[String],
    ) -> Result<String, NvrtcError> {
        let cstr = |what: &str, s: &str| {
            CString::new(s).map_err(|_| NvrtcError::Nul { what: what.into() })
        };
        let src = cstr(name, source)?;
        let cname = cstr("the file name", name)?;
        let (header_name, header_src) = COMMON_HEADER;
        let hname = cstr(header_name, header_name)?;
        let hsrc = cstr(header_name, header_src)?;
        let header_names = [hname.as_ptr()];
        let header_srcs = [hsrc.as_ptr()];
        let opts = options
            .iter()
            .map(|o| cstr("an option", o))
            .collect::<Result<Vec<_>, _>>()?;
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated string for the duration of the call.
        let code = unsafe {
            (self.api.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                1,
                header_srcs.as_ptr(),
                header_names.as_ptr(),
            )
        };
        self.check("nvrtcCreateProgram", code)?;
        let guard = ProgramGuard {
            api: &self.api,
            prog,
        };
        let n = c_int::try_from(opt_ptrs.len()).unwrap_or(c_int::MAX);
        // SAFETY: `prog` is live; the options outlive the call.
        let code = unsafe { (self.api.compile)(guard.prog, n, opt_ptrs.as_ptr()) };
        let log = self.read(guard.prog, self.api.log_size, self.api.log, "log")?;
        if code != 0 {
            // NVRTC_ERROR_COMPILATION is 6; anything else is an API failure.
            if code == 6 {
                let arch = options
                    .iter()
                    .find_map(|o| o.strip_prefix("--gpu-architecture="))
                    .unwrap_or("the default architecture")
                    .to_string();
                return Err(NvrtcError::Compile {
                    file: name.into(),
                    arch,
                    log,
                });
            }
            self.check("nvrtcCompileProgram", code)?;
        }
        self.read(guard.prog, self.api.ptx_size, self.api.ptx, "PTX")
    }

    /// Reads the log or the PTX of a compiled program, without its trailing NUL.
    fn read(
        &self,
        prog: Program,
        size: SizeFn,
        get: GetFn,
        what: &'static str,
    ) -> Result<String, NvrtcError> {
        let mut n = 0usize;
        // SAFETY: `prog` is live and `n` a valid out-pointer.
        let code = unsafe { size(prog, &mut n) };
        self.check(
            if what == "log" {
                "nvrtcGetProgramLogSize"
            } else {
                "nvrtcGetPTXSize"
            },
            code,
        )?;
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` holds the `n` bytes NVRTC reported.
        let code = unsafe { get(prog, buf.as_mut_ptr().cast()) };
        self.check(
            if what == "log" {
                "nvrtcGetProgramLog"
            } else {
                "nvrtcGetPTX"
            },
            code,
        )?;
        while buf.last() == Some(&0) {
            buf.pop();
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

/// Destroys an NVRTC program when dropped.
struct ProgramGuard<'a> {
    api: &'a Api,
    prog: Program,
}

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: `prog` was created by nvrtcCreateProgram and is destroyed once.
        unsafe {
            (self.api.destroy)(&mut self.prog);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discover_lists_every_place_tried() {
        let empty = tempfile::tempdir().unwrap();
        let candidates = vec![
            ("$CASTOR_NVRTC_DIR".to_string(), None),
            ("$CUDA_HOME".to_string(), Some(empty.path().to_path_buf())),
            (
                "/nonexistent/cuda".to_string(),
                Some(PathBuf::from("/nonexistent/cuda")),
            ),
        ];
        let err = match Nvrtc::discover_in(&candidates) {
            Ok(_) => panic!("an empty folder has no NVRTC"),
            Err(e) => e,
        };
        let NvrtcError::NotDiscovered { tried } = &err else {
            panic!("unexpected error {err}");
        };
        assert_eq!(tried.len(), 3);
        assert_eq!(tried[0], "$CASTOR_NVRTC_DIR (not set)");
        assert!(tried[1].starts_with("$CUDA_HOME="), "{}", tried[1]);
        assert!(tried[1].contains("no libnvrtc.so.13"), "{}", tried[1]);
        assert_eq!(tried[2], "/nonexistent/cuda (no such folder)");
        let message = err.to_string();
        assert!(message.starts_with("no NVRTC 13 found; tried $CASTOR_NVRTC_DIR (not set); "));
        assert!(
            message.contains("Set CASTOR_NVRTC_DIR to a folder"),
            "{message}"
        );
    }
}
