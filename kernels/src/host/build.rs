//! Compiling host modules: the compiler, its flags, the sanitizers, and the on-disk cache.
//!
//! A build is keyed by the SHA-256 of everything that decides it (the source, its entry
//! points, the shared and host headers, the compiler's version, the flags and the sanitizers;
//! for the runtime, its source) and stored as `<name>-<key>.so` under the kernel cache's `host` folder, written
//! to a temporary name and renamed, so concurrent builders and readers never see half a file.

use super::{HostError, HOST_HEADERS, RUNTIME_SOURCE};
use crate::{KernelCache, COMMON_HEADER};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The environment variable choosing the sanitizers: `address` or `thread`.
pub const SANITIZE_VAR: &str = "CASTOR_HOST_SANITIZE";

/// The sanitizers a host build is instrumented with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sanitize {
    None,
    /// AddressSanitizer and UndefinedBehaviorSanitizer.
    Address,
    /// ThreadSanitizer and UndefinedBehaviorSanitizer.
    Thread,
}

impl Sanitize {
    pub fn from_env() -> Result<Sanitize, HostError> {
        match std::env::var(SANITIZE_VAR).unwrap_or_default().as_str() {
            "" => Ok(Sanitize::None),
            "address" => Ok(Sanitize::Address),
            "thread" => Ok(Sanitize::Thread),
            other => Err(HostError::BadSanitize {
                var: SANITIZE_VAR,
                value: other.to_string(),
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Sanitize::None => "none",
            Sanitize::Address => "address",
            Sanitize::Thread => "thread",
        }
    }

    /// Flags for the kernels' compile (the runtime is not instrumented: it only announces its
    /// fiber switches and barriers to the sanitizer, see runtime.cpp). Instrumented builds are
    /// not optimized (`-O0` after [`FLAGS`]' `-O2`): g++ 12 took over 9 minutes to build the
    /// attention kernels with AddressSanitizer and UBSan at -O2, 5.7 at -O1, 48 s at -O0, and
    /// nothing optimized away hides an access from the sanitizers.
    fn module_flags(self) -> &'static [&'static str] {
        match self {
            Sanitize::None => &[],
            Sanitize::Address => &[
                "-O0",
                "-fsanitize=address,undefined",
                "-fno-sanitize-recover=all",
                "-fno-omit-frame-pointer",
                "-g",
            ],
            Sanitize::Thread => &[
                "-O0",
                "-fsanitize=thread,undefined",
                "-fno-sanitize-recover=all",
                "-g",
            ],
        }
    }

    fn runtime_flags(self) -> &'static [&'static str] {
        match self {
            Sanitize::None => &[],
            Sanitize::Address => &["-DCASTOR_HOST_ASAN"],
            Sanitize::Thread => &["-DCASTOR_HOST_TSAN"],
        }
    }

    /// The sanitizer runtime's library name and a symbol it defines.
    fn runtime_library(self) -> Option<(&'static str, &'static [u8])> {
        match self {
            Sanitize::None => None,
            Sanitize::Address => Some(("libasan.so", b"__asan_init\0")),
            Sanitize::Thread => Some(("libtsan.so", b"__tsan_init\0")),
        }
    }
}

/// Flags every host build uses. IEEE arithmetic as the device build's (--fmad=false
/// --prec-div=true --prec-sqrt=true --ftz=false): no contraction into fused multiply-adds;
/// `-fno-math-errno` only lets sqrt be the instruction. `-fno-strict-aliasing`: the kernels
/// read vectors through casts, as CUDA code does.
const FLAGS: &[&str] = &[
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-strict-aliasing",
    "-Wall",
    "-Wno-unknown-pragmas",
];

/// The compiler, its version, the sanitizers and the cache folder.
pub(super) struct Builder {
    compiler: String,
    version: String,
    pub(super) sanitize: Sanitize,
    dir: PathBuf,
}

impl Builder {
    pub(super) fn from_env() -> Result<Builder, HostError> {
        let sanitize = Sanitize::from_env()?;
        let compiler = compiler();
        let out = Command::new(&compiler)
            .arg("--version")
            .output()
            .map_err(|e| HostError::NoCompiler {
                compiler: compiler.clone(),
                reason: e.to_string(),
            })?;
        if !out.status.success() {
            return Err(HostError::NoCompiler {
                compiler,
                reason: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        let version = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .to_string();
        if let Some((library, symbol)) = sanitize.runtime_library() {
            // SAFETY: looks a symbol up in the running process; nothing is called.
            let loaded = unsafe {
                libloading::os::unix::Library::this()
                    .get::<*const u8>(symbol)
                    .is_ok()
            };
            if !loaded {
                return Err(HostError::SanitizerNotLoaded {
                    var: SANITIZE_VAR,
                    sanitize: sanitize.name(),
                    library: sanitizer_runtime(sanitize)
                        .map_or_else(|| library.to_string(), |p| p.display().to_string()),
                });
            }
        }
        Ok(Builder {
            compiler,
            version,
            sanitize,
            dir: KernelCache::default_dir().join("host"),
        })
    }

    /// The key of a build from `parts` and what every build depends on (the runtime is a
    /// library of its own: modules depend on its interface, the headers).
    fn key(&self, parts: &[&str]) -> String {
        let mut h = Sha256::new();
        let fixed = [
            self.version.as_str(),
            &FLAGS.join(" "),
            self.sanitize.name(),
            &self.sanitize.module_flags().join(" "),
            COMMON_HEADER.1,
        ];
        for part in fixed
            .iter()
            .chain(HOST_HEADERS.iter().map(|h| &h.1))
            .chain(parts)
        {
            h.update(part.as_bytes());
            h.update([0u8]);
        }
        h.finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The build key of a module.
    pub(super) fn module_key(&self, name: &str, source: &str, entries: &[&str]) -> String {
        let entries = entries.join(",");
        format!("{}-{}", safe(name), self.key(&[source, &entries]))
    }

    /// The runtime library, built or from the cache, loaded with its symbols global.
    pub(super) fn runtime(&self) -> Result<libloading::Library, HostError> {
        let key = format!("runtime-{}", self.key(&[RUNTIME_SOURCE.1]));
        let mut flags: Vec<&str> = FLAGS.to_vec();
        flags.extend(self.sanitize.runtime_flags());
        let path = self.cached(&key, RUNTIME_SOURCE.0, RUNTIME_SOURCE.1, &flags)?;
        // SAFETY: castor's own runtime; its initializers set up thread-local storage only.
        let lib = unsafe {
            libloading::os::unix::Library::open(
                Some(&path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
        .map_err(|e| HostError::Load {
            path,
            reason: e.to_string(),
        })?;
        Ok(lib.into())
    }

    /// A module's library, built or from the cache.
    pub(super) fn module(
        &self,
        name: &str,
        source: &str,
        entries: &[&str],
        key: &str,
    ) -> Result<PathBuf, HostError> {
        let table: Vec<String> = entries
            .iter()
            .map(|e| format!("    CASTOR_HOST_ENTRY({e})"))
            .collect();
        // Appended after the source, so compile errors keep the source's line numbers.
        let text = format!(
            "{source}\n#include \"castor_host_entries.h\"\nCASTOR_HOST_ENTRIES(\n{})\n",
            table.join(",\n")
        );
        let mut flags: Vec<&str> = FLAGS.to_vec();
        flags.extend(["-include", "castor_host.h"]);
        flags.extend(self.sanitize.module_flags());
        self.cached(key, name, &text, &flags)
    }

    /// `<dir>/<key>.so`, compiled from `text` (file `name`) with `flags` unless it exists.
    fn cached(
        &self,
        key: &str,
        name: &str,
        text: &str,
        flags: &[&str],
    ) -> Result<PathBuf, HostError> {
        let path = self.dir.join(format!("{key}.so"));
        if path.is_file() {
            return Ok(path);
        }
        let io = |path: &Path, e: std::io::Error| HostError::Io {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        static BUILD: AtomicUsize = AtomicUsize::new(0);
        let work = self.dir.join(format!(
            ".build-{}-{}",
            std::process::id(),
            BUILD.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(work.join("include")).map_err(|e| io(&work, e))?;
        let result = (|| {
            for (file, contents) in HOST_HEADERS.iter().chain([&COMMON_HEADER, &(name, text)]) {
                std::fs::write(work.join(file), contents).map_err(|e| io(&work.join(file), e))?;
            }
            let out = Command::new(&self.compiler)
                .current_dir(&work)
                .args(flags)
                .args(["-I.", "-Iinclude", "-x", "c++", name, "-o", "out.so"])
                .output()
                .map_err(|e| HostError::NoCompiler {
                    compiler: self.compiler.clone(),
                    reason: e.to_string(),
                })?;
            if !out.status.success() {
                return Err(HostError::Compile {
                    name: name.to_string(),
                    log: String::from_utf8_lossy(&out.stderr).into_owned(),
                });
            }
            std::fs::rename(work.join("out.so"), &path).map_err(|e| io(&path, e))
        })();
        let _ = std::fs::remove_dir_all(&work);
        result.map(|()| path)
    }
}

/// A file-name-safe version of `name`.
fn safe(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The host C++ compiler: `$CXX`, else `g++`.
fn compiler() -> String {
    std::env::var("CXX")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "g++".into())
}

/// The path of `sanitize`'s runtime library as the host compiler knows it (its
/// `libasan.so` or `libtsan.so`), for `LD_PRELOAD`; `None` without sanitizers or when the
/// compiler does not have it.
pub fn sanitizer_runtime(sanitize: Sanitize) -> Option<PathBuf> {
    let (library, _) = sanitize.runtime_library()?;
    let out = Command::new(compiler())
        .arg(format!("-print-file-name={library}"))
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    // An unknown name is printed back bare.
    path.is_absolute().then_some(path)
}

/// The environment that runs a process under `sanitize` (for a test that runs itself again
/// under a sanitizer): the sanitizer's runtime preloaded, the host builds instrumented, and the
/// sanitizer's options. Leak checking is off (the process keeps its modules loaded on
/// purpose); ThreadSanitizer looks at the instrumented kernels only (the Rust side's own
/// synchronization is invisible to it, so its interceptors would report false races there).
/// `None` without sanitizers or when the compiler has no runtime for `sanitize`.
pub fn sanitizer_env(sanitize: Sanitize) -> Option<Vec<(&'static str, String)>> {
    let library = sanitizer_runtime(sanitize)?;
    let options = match sanitize {
        Sanitize::None => return None,
        Sanitize::Address => ("ASAN_OPTIONS", "detect_leaks=0"),
        Sanitize::Thread => (
            "TSAN_OPTIONS",
            "halt_on_error=1:ignore_noninstrumented_modules=1",
        ),
    };
    Some(vec![
        ("LD_PRELOAD", library.display().to_string()),
        (SANITIZE_VAR, sanitize.name().to_string()),
        (options.0, options.1.to_string()),
        ("UBSAN_OPTIONS", "print_stacktrace=1".to_string()),
    ])
}
