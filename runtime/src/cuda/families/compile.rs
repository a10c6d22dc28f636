//! Compiles every family's kernel files to PTX for sm_90 with NVRTC 13, with no GPU.
//!
//! NVRTC is found through `CASTOR_NVRTC_DIR` (a `pip install --target` folder holding
//! `nvidia-cuda-nvrtc==13.0.*` and `nvidia-cuda-runtime==13.0.*`). Without it the test skips
//! with a message, except under `CI=true`, where it fails: CI must compile the kernels.
//! With `ptxas` there too (`nvidia-cuda-nvcc==13.0.*`), it prints each kernel's registers,
//! shared memory and spills.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use super::{file, files, signature};
use castor_kernels::ptx::entry_params;
use castor_kernels::{ptxas, sass, KernelFile, Nvrtc, ParamKind, DEFAULT_ARCH};

fn nvrtc() -> Option<Nvrtc> {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    match Nvrtc::from_env() {
        Ok(Some(n)) => Some(n),
        Ok(None) if ci => panic!("CI=true but CASTOR_NVRTC_DIR is not set: cannot compile kernels"),
        Ok(None) => {
            eprintln!(
                "skipped: CASTOR_NVRTC_DIR is not set (see runtime/src/cuda/families/README.md)"
            );
            None
        }
        Err(e) if ci => panic!("CI=true but NVRTC cannot be opened: {e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// Values made once per file name, each behind its own cell ([`once`]).
type PerFile<T> = OnceLock<Mutex<HashMap<&'static str, Arc<OnceLock<T>>>>>;

/// What `make` gives for `key`, made once for this test process: several tests read each
/// file's PTX and machine code, and NVRTC alone takes attention.cu over a minute. Tests run on
/// several threads; one that asks while another makes the value waits for it.
fn once<T: Clone + Send + Sync + 'static>(
    cache: &'static PerFile<T>,
    key: &'static str,
    make: impl FnOnce() -> T,
) -> T {
    let cell = cache
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .entry(key)
        .or_default()
        .clone();
    cell.get_or_init(make).clone()
}

/// File `f`'s PTX for sm_90, or NVRTC's error, made once for this test process, through the
/// PTX cache the integration tests' launch check fills with the same files
/// ([`shared_test_cache`]): a test run compiles each file once.
fn ptx(nvrtc: &Nvrtc, f: &'static KernelFile) -> Result<Arc<str>, String> {
    static PTX: PerFile<Result<Arc<str>, String>> = OnceLock::new();
    once(&PTX, f.name, || {
        shared_test_cache()
            .ptx(nvrtc, f.name, f.source, DEFAULT_ARCH)
            .map(|(ptx, _)| Arc::from(ptx))
            .map_err(|e| e.to_string())
    })
}

/// The PTX cache of the test runs: `tmp/kernel-cache` in Cargo's target folder (this binary
/// lives in its `<profile>/deps/`), where `tests/cuda_lowering.rs` keeps its PTX too (through
/// Cargo's `CARGO_TARGET_TMPDIR`). An entry's name holds the hash of everything that decides
/// its PTX (source, header, architecture, NVRTC version, options), so a hit is the compile
/// that would have run.
fn shared_test_cache() -> castor_kernels::KernelCache {
    let target = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.to_path_buf()));
    let dir = target.unwrap_or_else(std::env::temp_dir);
    castor_kernels::KernelCache::new(dir.join("tmp").join("kernel-cache"))
}

/// Each kernel's resources and the cubin, as `ptxas -v` assembles a file's PTX.
type Assembled = Result<(Vec<ptxas::KernelResources>, Arc<[u8]>), String>;

/// File `f`'s [`Assembled`] machine code, once for this test process.
fn assembled(nvrtc: &Nvrtc, ptxas_bin: &std::path::Path, f: &'static KernelFile) -> Assembled {
    static CUBIN: PerFile<Assembled> = OnceLock::new();
    once(&CUBIN, f.name, || {
        let ptx = ptx(nvrtc, f)?;
        ptxas::assemble(ptxas_bin, f.name, &ptx, DEFAULT_ARCH)
            .map(|(resources, cubin)| (resources, Arc::from(cubin)))
            .map_err(|e| e.to_string())
    })
}

/// The PTX type and size a parameter of `kind` compiles to (a struct's size is its own).
fn ptx_form(kind: ParamKind) -> (&'static str, Option<usize>) {
    match kind {
        ParamKind::Ptr | ParamKind::U64 => (".u64", Some(8)),
        ParamKind::I64 => (".u64", Some(8)),
        ParamKind::I32 => (".u32", Some(4)),
        ParamKind::U32 => (".u32", Some(4)),
        ParamKind::U16 => (".u16", Some(2)),
        ParamKind::F64 => (".f64", Some(8)),
        ParamKind::Layout => ("struct", None),
    }
}

/// The `.entry` names a PTX module defines.
fn ptx_entries(ptx: &str) -> BTreeSet<String> {
    entry_params(ptx)
        .into_iter()
        .map(|(name, _)| name)
        .collect()
}

#[test]
fn every_kernel_compiles_to_ptx_for_sm_90() {
    let Some(nvrtc) = nvrtc() else { return };
    let (major, minor) = nvrtc.version().expect("nvrtcVersion");
    assert_eq!(major, 13, "NVRTC 13 is required (found {major}.{minor})");
    let mut failures = Vec::new();
    for f in files() {
        match ptx(&nvrtc, f) {
            Ok(ptx) => {
                let got = ptx_entries(&ptx);
                let want: BTreeSet<String> = f.entry_points.iter().map(|s| s.to_string()).collect();
                if got != want {
                    failures.push(format!(
                        "{}: entry points differ from the list in its family's mod.rs\n  only in PTX: {:?}\n  only listed: {:?}",
                        f.name,
                        got.difference(&want).collect::<Vec<_>>(),
                        want.difference(&got).collect::<Vec<_>>()
                    ));
                }
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The signature table (read from the declarations) is what NVRTC compiled: every entry
/// point's parameters in count, PTX type and size.
#[test]
fn every_signature_matches_its_ptx_parameters() {
    let Some(nvrtc) = nvrtc() else { return };
    let mut failures = Vec::new();
    let mut checked = 0;
    for f in files() {
        let ptx = ptx(&nvrtc, f).unwrap_or_else(|e| panic!("{e}"));
        for (entry, params) in entry_params(&ptx) {
            let sig = signature(&entry).unwrap_or_else(|e| panic!("{e}"));
            let want: Vec<_> = sig.params.iter().map(|p| ptx_form(p.kind)).collect();
            let fits = want.len() == params.len()
                && want.iter().zip(&params).all(|((ty, bytes), got)| {
                    *ty == got.ty && bytes.is_none_or(|b| b == got.bytes)
                });
            if !fits {
                failures.push(format!(
                    "{entry}: the table says {:?}, PTX has {params:?}",
                    sig.names()
                ));
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("{checked} entry points match their signatures");
}

#[test]
fn compile_errors_name_the_file_and_carry_the_log() {
    let Some(nvrtc) = nvrtc() else { return };
    let bad = castor_kernels::KernelFile {
        name: "broken.cu",
        source: "#include \"castor_common.cuh\"\nextern \"C\" __global__ void k() { undefined_thing(); }\n",
        entry_points: &["k"],
    };
    let err = nvrtc
        .compile(&bad, DEFAULT_ARCH)
        .expect_err("must not compile")
        .to_string();
    assert!(
        err.contains("broken.cu") && err.contains("undefined_thing"),
        "{err}"
    );
}

/// `ptxas -v` on every kernel: registers, shared memory and spills. Prints the table; fails
/// on a spill (a regression to look at, not a crash).
#[test]
fn ptxas_resource_report() {
    let Some(nvrtc) = nvrtc() else { return };
    let Some(dir) = std::env::var_os("CASTOR_NVRTC_DIR") else {
        return;
    };
    let Some(ptxas_bin) = ptxas::find_ptxas(std::path::Path::new(&dir)) else {
        eprintln!("skipped: no ptxas in CASTOR_NVRTC_DIR (pip install nvidia-cuda-nvcc==13.0.*)");
        return;
    };
    let mut rows = Vec::new();
    for f in files() {
        let (report, _) = assembled(&nvrtc, &ptxas_bin, f).unwrap_or_else(|e| panic!("{e}"));
        rows.extend(report.into_iter().map(|r| (f.name.to_string(), r)));
    }
    println!("{}", ptxas::table(&rows));
    let spills: Vec<_> = rows
        .iter()
        .filter(|(_, r)| r.spill_stores > 0 || r.spill_loads > 0)
        .map(|(f, r)| format!("{f}: {}", r.kernel))
        .collect();
    assert!(spills.is_empty(), "kernels spill registers: {spills:?}");
}

/// The sm_90 machine code of kernel file `name`, as ptxas reports its resources and nvdisasm
/// counts each kernel's instructions; `None` (skipped) without NVRTC, ptxas or nvdisasm,
/// which CI must have.
fn machine_code(
    name: &str,
) -> Option<(
    Vec<ptxas::KernelResources>,
    std::collections::BTreeMap<String, sass::InstructionMix>,
)> {
    let nvrtc = nvrtc()?;
    let dir = std::env::var_os("CASTOR_NVRTC_DIR")?;
    let dir = std::path::Path::new(&dir);
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let (Some(ptxas_bin), Some(nvdisasm)) = (ptxas::find_ptxas(dir), sass::find_nvdisasm(dir))
    else {
        let why = "no ptxas or nvdisasm in CASTOR_NVRTC_DIR (pip install \
                   nvidia-cuda-nvcc==13.0.* nvidia-cuda-nvdisasm)";
        assert!(!ci, "CI=true but {why}");
        eprintln!("skipped: {why}");
        return None;
    };
    let file = file(name).unwrap();
    let (resources, cubin) = assembled(&nvrtc, &ptxas_bin, file).unwrap_or_else(|e| panic!("{e}"));
    let listing = sass::disassemble(&nvdisasm, &cubin).unwrap_or_else(|e| panic!("{e}"));
    Some((resources, sass::count(&listing)))
}

/// The RoPE kernels compute a row's start once per (batch, position) in 32-bit arithmetic:
/// their machine code calls no out-of-line routine (the per-element 64-bit divisions of the
/// earlier form were calls, and ran the kernels at 3.2x their memory roofline on an H100).
/// Prints each kernel's static instruction count.
#[test]
fn rope_machine_code_has_no_out_of_line_division() {
    let Some((_, mixes)) = machine_code("rope.cu") else {
        return;
    };
    let mut failures = Vec::new();
    for (kernel, mix) in mixes
        .iter()
        .filter(|(k, _)| k.starts_with("rope_fwd") || k.starts_with("rope_bwd"))
    {
        println!(
            "{kernel:<16} {:>5} instructions, {} calls",
            mix.total, mix.calls
        );
        if mix.calls > 0 {
            failures.push(format!("{kernel}: {} calls", mix.calls));
        }
    }
    assert_eq!(mixes.keys().filter(|k| k.starts_with("rope_")).count(), 7);
    assert!(failures.is_empty(), "{failures:?}");
}

/// The attention kernels' machine code has the FlashAttention-2 shape: fragments by ldmatrix,
/// tiles by 16-byte asynchronous copies, almost no 2-byte loads, no spills, and at most 16
/// other instructions per tensor-core instruction (static counts from `nvdisasm`, padding
/// `NOP`s left out; 58 to 92 per tensor-core instruction before the rebuild). Prints every
/// attention kernel's mix.
///
/// The bound holds the entry points without packed sequences' positions and without dropout,
/// at d64 and d128. Positions need code the other masks do not (the backward's scan of a key
/// block's query rows, each tile's least and greatest first key, a ballot per key on tiles a
/// sequence's start straddles), which only the `_packed` entry points compile in. Measured,
/// bf16 and f16 alike: the backward 13.30 at d64 and 13.46 at d128, the forward 13.91 and
/// 13.18; their `_packed` forms 14.22, 14.32, 14.56 and 13.83. (The backward's key blocks sum
/// dK and dV over several blocks: a loop through shared memory keeps that to about 100
/// instructions, where adding in registers took 200 to 320. Fragments are loaded from each
/// lane's shared-memory address taken once plus a constant, which ldmatrix's offset holds:
/// a pointer per fragment cost an add and a shift each, 16.00 at d128 before. The backward's
/// query tiles are 128 rows at d64 and 64 at d128, their scores taken in two halves, and the
/// dQ sum it adds to comes through shared memory by cp.async: 15.26 and 15.36 with 64- and
/// 32-row tiles and that sum in registers.)
#[test]
fn attention_machine_code_has_the_flash_attention_shape() {
    let Some((resources, mixes)) = machine_code("attention.cu") else {
        return;
    };
    println!(
        "{:<36} {:>6} {:>6} {:>9} {:>5} {:>6} {:>6} {:>6}",
        "kernel", "total", "tensor", "per tensor", "LDSM", "async", "2-byte", "spills"
    );
    let mut failures = Vec::new();
    for (kernel, mix) in &mixes {
        let spills = resources
            .iter()
            .find(|r| &r.kernel == kernel)
            .map_or(0, |r| r.spill_stores + r.spill_loads);
        println!(
            "{kernel:<36} {:>6} {:>6} {:>9.2} {:>5} {:>6} {:>6} {:>6}",
            mix.total,
            mix.tensor,
            mix.others_per_tensor(),
            mix.ldsm,
            mix.async_copies,
            mix.two_byte_loads,
            spills
        );
        let held = ["bf16_d64", "bf16_d128", "f16_d64", "f16_d128"]
            .iter()
            .any(|v| kernel.ends_with(v));
        if !held {
            continue;
        }
        let mut why = Vec::new();
        if mix.ldsm == 0 {
            why.push("no LDSM".to_string());
        }
        if mix.async_copies == 0 {
            why.push("no asynchronous copy".to_string());
        }
        if mix.two_byte_loads > 32 {
            why.push(format!("{} 2-byte loads (at most 32)", mix.two_byte_loads));
        }
        if spills > 0 {
            why.push(format!("{spills} bytes spilled"));
        }
        if mix.others_per_tensor() > 16.0 {
            why.push(format!(
                "{:.2} other instructions per tensor-core instruction (at most 16)",
                mix.others_per_tensor()
            ));
        }
        if !why.is_empty() {
            failures.push(format!("{kernel}: {}", why.join(", ")));
        }
    }
    let held = mixes
        .keys()
        .filter(|k| k.ends_with("_d64") || k.ends_with("_d128"));
    assert_eq!(
        held.count(),
        8,
        "the forward and backward at d64 and d128, f16 and bf16"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_ptx_cache_compiles_once_and_then_hits() {
    let Some(nvrtc) = nvrtc() else { return };
    let dir = tempfile::tempdir().unwrap();
    let cache = castor_kernels::KernelCache::new(dir.path());
    let file = file("cast.cu").unwrap();
    let (first, o1) = cache
        .ptx(&nvrtc, file.name, file.source, DEFAULT_ARCH)
        .unwrap();
    let (second, o2) = cache
        .ptx(&nvrtc, file.name, file.source, DEFAULT_ARCH)
        .unwrap();
    assert_eq!(o1, castor_kernels::Outcome::Compiled);
    assert_eq!(o2, castor_kernels::Outcome::Hit);
    assert_eq!(first, second);
    // Another architecture is another entry.
    let (_, o3) = cache.ptx(&nvrtc, file.name, file.source, "sm_80").unwrap();
    assert_eq!(o3, castor_kernels::Outcome::Compiled);
    let entries = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(
        entries, 2,
        "one file per (source, arch), no temporaries left"
    );
    // A damaged entry is compiled again.
    for e in std::fs::read_dir(dir.path()).unwrap() {
        std::fs::write(e.unwrap().path(), "garbage").unwrap();
    }
    let (again, o4) = cache
        .ptx(&nvrtc, file.name, file.source, DEFAULT_ARCH)
        .unwrap();
    assert_eq!((o4, again), (castor_kernels::Outcome::Compiled, first));
}

/// NVRTC is opened once per process: every caller of `Nvrtc::shared` gets the same library.
#[test]
fn the_shared_nvrtc_is_opened_once() {
    if nvrtc().is_none() {
        return;
    }
    let first = Nvrtc::shared().expect("NVRTC opens");
    let second = Nvrtc::shared().expect("NVRTC opens");
    assert!(std::ptr::eq(first, second));
    assert_eq!(first.version().unwrap().0, 13);
}
