//! The cuDNN entry points castor calls, resolved from the one library [`load`] opened.
//!
//! castor does not call through cudarc's cuDNN bindings: they load the library by name on
//! first use and try `libcudnn.so` before `libcudnn.so.9`, so on a machine with a cuDNN in
//! the system folders beside the one `CASTOR_CUDNN_DIR` names, the calls went to the system's
//! (an H200 machine with PyTorch's cuDNN 9.19 named ran every pass against a system 9.14, whose
//! engines refused them). Here the folder named, or else the loader's `libcudnn.so.9` (the ABI
//! these calls are written for, as PyTorch loads it), is the library every call goes to.
//! cudarc's `sys` module still provides the types.
//!
//! Invariant: [`api`] is only called after [`load`] succeeded (the probe loads first).

use cudarc::cudnn::sys::{
    cudaStream_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t,
    cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t, cudnnHandle_t, cudnnStatus_t,
};
use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Declares [`Api`], one function pointer per entry point, and how each is resolved.
macro_rules! entry_points {
    ($($field:ident = $symbol:literal: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// cuDNN's entry points, from the library that stays loaded for the process.
        pub(super) struct Api {
            /// Where the library was found (a path, or the name the loader resolved).
            pub source: String,
            $(pub $field: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl Api {
            fn resolve(lib: &'static libloading::Library, source: String) -> Result<Api, String> {
                Ok(Api {
                    source,
                    $($field: {
                        // SAFETY: the symbol has this C signature in every cuDNN 9 (cudnn.h);
                        // the library is never unloaded, so the pointer stays valid.
                        let symbol = unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                                concat!($symbol, "\0").as_bytes(),
                            )
                        }
                        .map_err(|e| format!("{}: {e}", $symbol))?;
                        *symbol
                    },)*
                })
            }
        }
    };
}

entry_points! {
    get_version = "cudnnGetVersion": fn() -> usize;
    get_last_error_string = "cudnnGetLastErrorString": fn(*mut c_char, usize);
    create = "cudnnCreate": fn(*mut cudnnHandle_t) -> cudnnStatus_t;
    destroy = "cudnnDestroy": fn(cudnnHandle_t) -> cudnnStatus_t;
    set_stream = "cudnnSetStream": fn(cudnnHandle_t, cudaStream_t) -> cudnnStatus_t;
    create_descriptor = "cudnnBackendCreateDescriptor":
        fn(cudnnBackendDescriptorType_t, *mut cudnnBackendDescriptor_t) -> cudnnStatus_t;
    destroy_descriptor = "cudnnBackendDestroyDescriptor":
        fn(cudnnBackendDescriptor_t) -> cudnnStatus_t;
    set_attribute = "cudnnBackendSetAttribute": fn(
        cudnnBackendDescriptor_t,
        cudnnBackendAttributeName_t,
        cudnnBackendAttributeType_t,
        i64,
        *const c_void
    ) -> cudnnStatus_t;
    get_attribute = "cudnnBackendGetAttribute": fn(
        cudnnBackendDescriptor_t,
        cudnnBackendAttributeName_t,
        cudnnBackendAttributeType_t,
        i64,
        *mut i64,
        *mut c_void
    ) -> cudnnStatus_t;
    finalize = "cudnnBackendFinalize": fn(cudnnBackendDescriptor_t) -> cudnnStatus_t;
    execute = "cudnnBackendExecute":
        fn(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t) -> cudnnStatus_t;
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// The library file in `dir` (a folder holding it, a toolkit's root, or a Python
/// environment's site-packages), if any.
pub(super) fn in_folder(dir: &Path) -> Option<PathBuf> {
    [
        dir.join("libcudnn.so.9"),
        dir.join("lib/libcudnn.so.9"),
        dir.join("nvidia/cudnn/lib/libcudnn.so.9"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// Opens cuDNN once for the process ([`open`]); later calls return the first outcome.
pub(super) fn load(dir: Option<&Path>) -> Result<&'static Api, String> {
    API.get_or_init(|| open(dir)).as_ref().map_err(Clone::clone)
}

/// Opens the library in `dir` when a folder is named, else `libcudnn.so.9` on the loader's
/// path, and resolves every entry point. The library stays loaded for the process.
fn open(dir: Option<&Path>) -> Result<Api, String> {
    let (name, source) = match dir {
        Some(dir) => {
            let path = in_folder(dir).ok_or_else(|| {
                format!(
                    "{}={} holds no libcudnn.so.9",
                    super::cudnn::CUDNN_DIR_VAR,
                    dir.display()
                )
            })?;
            (path.clone().into_os_string(), path.display().to_string())
        }
        None => (
            "libcudnn.so.9".into(),
            "libcudnn.so.9 on the loader path".into(),
        ),
    };
    // SAFETY: loading a shared library runs its initializers; libcudnn's are benign.
    let lib = unsafe { libloading::Library::new(&name) }.map_err(|e| {
        if dir.is_some() {
            format!("cannot load {source}: {e}")
        } else {
            format!(
                "libcudnn.so.9 not found ({e}): `pip install \"nvidia-cudnn-cu13==9.*\"` (or a \
                 CUDA toolkit's cuDNN) and set {} to the folder holding it, or put it on \
                 LD_LIBRARY_PATH",
                super::cudnn::CUDNN_DIR_VAR
            )
        }
    })?;
    // Kept for the process: every resolved pointer points into it.
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    Api::resolve(lib, source)
}

/// The loaded entry points.
///
/// # Panics
/// When called before [`load`] succeeded, which the module invariant rules out.
pub(super) fn api() -> &'static Api {
    match API.get() {
        Some(Ok(api)) => api,
        _ => panic!("cuDNN called before it was loaded"),
    }
}

#[cfg(test)]
mod tests {
    use super::open;

    /// The file mapped at `address` in this process (from /proc/self/maps).
    fn mapped_file(address: usize) -> Option<std::path::PathBuf> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        maps.lines().find_map(|line| {
            let mut fields = line.split_whitespace();
            let (lo, hi) = fields.next()?.split_once('-')?;
            let (lo, hi) = (
                usize::from_str_radix(lo, 16).ok()?,
                usize::from_str_radix(hi, 16).ok()?,
            );
            let path = fields.nth(4)?;
            (lo <= address && address < hi).then(|| path.into())
        })
    }

    /// Where cuDNN is installed (`CASTOR_CUDNN_DIR` set, as on the GPU machine), every entry
    /// point is the named library's, whatever other cuDNN the loader could find.
    #[test]
    fn every_entry_point_comes_from_the_named_library() {
        let Some(dir) = std::env::var_os(super::super::cudnn::CUDNN_DIR_VAR) else {
            eprintln!("CASTOR_CUDNN_DIR is not set: no cuDNN to check");
            return;
        };
        let dir = std::path::PathBuf::from(dir);
        let api = open(Some(&dir)).expect("the named cuDNN loads");
        let named = std::fs::canonicalize(super::in_folder(&dir).unwrap()).unwrap();
        for address in [
            api.get_version as usize,
            api.create as usize,
            api.finalize as usize,
            api.execute as usize,
        ] {
            let file = mapped_file(address).map(|f| std::fs::canonicalize(f).unwrap());
            assert_eq!(file.as_deref(), Some(named.as_path()));
        }
        // SAFETY: cudnnGetVersion takes nothing.
        assert!(unsafe { (api.get_version)() } >= 90000);
    }

    #[test]
    fn a_folder_without_the_library_is_named_in_the_error() {
        let dir = std::env::temp_dir().join(format!("castor-no-cudnn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = open(Some(&dir)).err().expect("no library there");
        assert!(err.contains("CASTOR_CUDNN_DIR=") && err.contains("holds no libcudnn.so.9"));
        // A file of that name that is no library: the loader's reason, with the path.
        std::fs::write(dir.join("libcudnn.so.9"), b"not a library").unwrap();
        let err = open(Some(&dir)).err().expect("not a library");
        assert!(
            err.starts_with("cannot load ") && err.contains("libcudnn.so.9"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
