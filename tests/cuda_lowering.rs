//! The CUDA executor's programs, checked without a GPU.
//!
//! Every family fixture's training plan, under every precision policy and the optimizer,
//! accumulation and rematerialization variants, is lowered to device commands. Each kernel
//! launch must name an entry point its module defines; every place must lie inside its
//! buffer; and, with NVRTC (`CASTOR_NVRTC_DIR`, required under `CI=true`), every module is
//! compiled for sm_90 and each launch's arguments are checked against the kernel's parameter
//! list in the PTX (count, size and kind of every parameter), so a launch that would pass the
//! wrong arguments fails here rather than on the GPU.

use crate::common;

use castor_kernels::ptx;
use castor_kernels::{KernelCache, Nvrtc, DEFAULT_ARCH};
use castor_runtime::cuda::lower::lower_plan;
use castor_runtime::cuda::program::{Arg, Command, Place, Program};
use common::cuda_cases::plan;
use common::{castor, fixture, path_str, stderr};
use std::collections::HashMap;
use std::path::Path;

/// Plans covering every op the families use, every dtype pair and every optimizer kernel.
const VARIANTS: &[(&str, &[&str])] = &[
    ("gpt2_lm", &["--precision", "fp32"]),
    ("gpt2_lm", &["--precision", "bf16"]),
    ("gpt2_lm", &["--precision", "fp16"]),
    ("gpt2_lm", &["--precision", "tf32", "--grad-accum", "2"]),
    ("gpt2_lm", &["--precision", "bf16", "--remat", "full"]),
    ("gpt2_lm", &["--precision", "bf16", "--remat", "selective"]),
    ("gpt2_lm", &["--precision", "fp16", "--optimizer", "sgd"]),
    ("bert_mlm", &["--precision", "bf16"]),
    ("bert_mlm", &["--precision", "fp16"]),
    ("llama_gqa", &["--precision", "bf16"]),
    (
        "llama_gqa",
        &["--precision", "fp16", "--param-grads", "compute"],
    ),
    (
        "llama_tied",
        &["--precision", "fp32", "--remat", "selective"],
    ),
    ("gpt2_lm", &["--precision", "fp8"]),
    ("llama_gqa", &["--precision", "fp8", "--remat", "full"]),
];

fn programs() -> Vec<(String, Program)> {
    VARIANTS
        .iter()
        .map(|(v, flags)| {
            let p = plan(v, flags);
            let program = lower_plan(&p).unwrap_or_else(|e| panic!("{v} {flags:?}: {e}"));
            (format!("{v} {}", flags.join(" ")), program)
        })
        .collect()
}

fn places(c: &Command) -> Vec<Place> {
    match c {
        Command::Launch(l) => l
            .args
            .iter()
            .filter_map(|a| match a {
                Arg::Ptr(p) => Some(*p),
                _ => None,
            })
            .collect(),
        Command::Gemm(g) => [g.a, g.b, g.c]
            .into_iter()
            .chain(g.fp8.iter().flat_map(|s| s.buffers().map(|(_, p)| p)))
            .collect(),
        Command::Copy { dst, src, .. } => vec![*dst, *src],
        Command::Memset { dst, .. } => vec![*dst],
        Command::Collective { dst, src, .. } => vec![*dst, *src],
        Command::Join { .. } => vec![],
        Command::Sdpa(call) => call
            .places()
            .into_iter()
            .map(|(_, p)| p)
            .chain(call.fallback.iter().flat_map(places))
            .collect(),
    }
}

/// The parameter list of `entry` in `source` (its `extern "C"` definition), split by comma.
fn entry_params(source: &str, entry: &str) -> Option<Vec<String>> {
    let head = format!("void {entry}(");
    let at = source.find(&head)? + head.len();
    let end = at + source[at..].find(')')?;
    Some(
        source[at..end]
            .split(',')
            .map(|p| p.trim().to_string())
            .collect(),
    )
}

/// A kernel that reads and writes the same buffer must not declare either pointer
/// `__restrict__` (restrict-qualified pointers that alias are undefined behaviour, and the
/// compiler may then read through the non-coherent cache after the write). The lowering
/// updates accumulated gradients in place, so the generated kernels it launches that way are
/// checked here, launch by launch, against their source.
#[test]
fn no_kernel_launched_in_place_declares_restrict_pointers() {
    let mut in_place = 0;
    for (name, program) in programs() {
        for c in program.all_commands() {
            let Command::Launch(l) = c else { continue };
            let Some(params) = entry_params(&program.modules[l.module].source, &l.entry) else {
                continue;
            };
            let ptrs: Vec<(usize, Place)> = l
                .args
                .iter()
                .enumerate()
                .filter_map(|(i, a)| match a {
                    Arg::Ptr(p) => Some((i, *p)),
                    _ => None,
                })
                .collect();
            for (i, p) in &ptrs {
                for (j, q) in &ptrs {
                    if i >= j || p != q {
                        continue;
                    }
                    in_place += 1;
                    for k in [i, j] {
                        let param = params.get(*k).map_or("", String::as_str);
                        assert!(
                            !param.contains("__restrict__"),
                            "{name}: `{}` for %{} passes {p:?} as parameters {i} and {j}, but \
                             parameter {k} is declared `{param}`",
                            l.entry,
                            l.node
                        );
                    }
                }
            }
        }
    }
    // Accumulated gradients are updated in place: the check above is not vacuous.
    assert!(in_place > 0, "no launch passes one buffer twice");
    println!("{in_place} launches pass a buffer as two parameters; none is __restrict__");
}

#[test]
fn every_launch_names_a_kernel_and_every_place_is_in_bounds() {
    println!(
        "{:<44} {:>8} {:>6} {:>6} {:>8} {:>10}",
        "plan", "launches", "gemms", "copies", "modules", "arena KiB"
    );
    for (name, p) in programs() {
        let mut counts = [0usize; 3];
        for c in p.all_commands() {
            match c {
                Command::Launch(l) => {
                    counts[0] += 1;
                    let m = &p.modules[l.module];
                    let defined = match castor_runtime::cuda::families::file(&m.name) {
                        Some(f) => f.entry_points.contains(&l.entry.as_str()),
                        None => m.source.contains(&format!("void {}(", l.entry)),
                    };
                    assert!(defined, "{name}: `{}` is not in module {}", l.entry, m.name);
                    assert!(l.block.0 * l.block.1 * l.block.2 <= 1024, "{name}: {l:?}");
                    assert!(l.grid.0 >= 1 && l.grid.1 >= 1, "{name}: {l:?}");
                }
                Command::Gemm(_) => counts[1] += 1,
                _ => counts[2] += 1,
            }
            for place in places(c) {
                match place {
                    Place::Arena { offset } => {
                        assert!(
                            offset < p.arena_bytes,
                            "{name}: arena offset {offset} in {c:?}"
                        )
                    }
                    Place::Slot { slot, offset } => {
                        let s = &p.slots[slot];
                        assert!(
                            offset < s.bytes.max(1),
                            "{name}: {} offset {offset}",
                            s.name
                        );
                    }
                    Place::Buffer { .. } => panic!("{name}: an unplaced buffer in {c:?}"),
                }
            }
        }
        println!(
            "{name:<44} {:>8} {:>6} {:>6} {:>8} {:>10.1}",
            counts[0],
            counts[1],
            counts[2],
            p.modules.len(),
            p.arena_bytes as f64 / 1024.0
        );
    }
}

/// The `.entry` parameter lists of a PTX module: entry name -> (kind, bytes) per parameter,
/// the kind as [`arg_signature`] names it.
fn ptx_params(ptx: &str) -> HashMap<String, Vec<(String, usize)>> {
    ptx::entry_params(ptx)
        .into_iter()
        .map(|(name, params)| {
            let sig = params
                .into_iter()
                .map(|p| {
                    let kind = match p.ty.as_str() {
                        ".f64" => "f64",
                        "struct" => "struct",
                        _ => "int",
                    };
                    (kind.to_string(), p.bytes)
                })
                .collect();
            (name, sig)
        })
        .collect()
}

fn arg_signature(a: &Arg) -> (&'static str, usize) {
    match a {
        Arg::Ptr(_) | Arg::Null | Arg::Table(_) | Arg::I64(_) | Arg::U64(_) => ("int", 8),
        Arg::I32(_) | Arg::U32(_) => ("int", 4),
        Arg::U16(_) => ("int", 2),
        Arg::F64(_) => ("f64", 8),
        Arg::Layout(_) => (
            "struct",
            std::mem::size_of::<castor_runtime::cuda::program::CopyLayout>(),
        ),
    }
}

#[test]
fn every_launch_matches_its_kernels_parameters_in_ptx() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let nvrtc = match Nvrtc::from_env() {
        Ok(Some(n)) => n,
        Ok(None) if ci => panic!(
            "CI=true but NVRTC is unavailable: CASTOR_NVRTC_DIR is not set (.ci/run installs \
             NVRTC 13.0 and sets it)"
        ),
        Err(e) if ci => panic!("CI=true but NVRTC is unavailable: {e}"),
        _ => {
            eprintln!("skipped: CASTOR_NVRTC_DIR is not set");
            return;
        }
    };
    // Shared with the kernel families' compile tests (castor-runtime's `families::compile`,
    // which find it from their binary's place in the target folder): a test run compiles each
    // kernel file once.
    let cache = KernelCache::new(Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-cache"));
    let mut compiled: HashMap<String, HashMap<String, Vec<(String, usize)>>> = HashMap::new();
    let mut checked = 0;
    for (name, p) in programs() {
        for c in p.all_commands() {
            let Command::Launch(l) = c else { continue };
            let m = &p.modules[l.module];
            // By the whole source: two plans' generated modules share a name and may share
            // a length.
            let key = format!("{}\u{0}{}", m.name, m.source);
            if !compiled.contains_key(&key) {
                let (ptx, _) = cache
                    .ptx(&nvrtc, &m.name, &m.source, DEFAULT_ARCH)
                    .unwrap_or_else(|e| panic!("{name}: module {} does not compile: {e}", m.name));
                compiled.insert(key.clone(), ptx_params(&ptx));
            }
            let params = compiled[&key]
                .get(&l.entry)
                .unwrap_or_else(|| panic!("{name}: no .entry {} in {}", l.entry, m.name));
            let want: Vec<(String, usize)> = l
                .args
                .iter()
                .map(|a| {
                    let (k, b) = arg_signature(a);
                    (k.to_string(), b)
                })
                .collect();
            assert_eq!(
                &want, params,
                "{name}: launch of {} for %{} passes {:?}",
                l.entry, l.node, l.args
            );
            checked += 1;
        }
    }
    println!("{checked} launches match their kernels' PTX parameter lists");
}

/// What the CUDA executor runs for one bf16 training step of the tiny GPT-2, command by
/// command: review changes here as changes to the executor.
#[test]
fn gpt2_bf16_program_listing() {
    let p = lower_plan(&plan("gpt2_lm", &["--precision", "bf16"])).unwrap();
    insta::assert_snapshot!("gpt2_lm_bf16_program", p.listing());
}

/// `compile --emit cuda` prints the same listing, with no GPU.
#[test]
fn compile_emits_the_cuda_program() {
    let model = fixture("gpt2_lm");
    let o = castor(&[
        "compile",
        path_str(&model),
        "--precision",
        "bf16",
        "--emit",
        "cuda",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = common::stdout(&o);
    assert!(out.contains("run micro_step:"), "{out}");
    assert!(out.contains("launch adamw_bf16<<<"), "{out}");
    assert!(out.contains("gemm bf16"), "{out}");
}

/// Real model sizes lower too (shapes the fixtures do not have: batch > 1 with grouped-query
/// attention, large vocabularies), under every low-precision policy and recomputation.
#[test]
fn real_model_configs_lower_for_cuda() {
    for config in ["gpt2-124m", "gpt2-xl", "llama-2-7b", "llama-3-70b"] {
        for flags in [
            ["--precision", "bf16"],
            ["--precision", "fp16"],
            ["--remat", "selective"],
        ] {
            let path = common::root()
                .join("assets")
                .join("configs")
                .join(format!("{config}.json"));
            let mut args = vec![
                "compile",
                path_str(&path),
                "--train",
                "--batch",
                "4",
                "--seq",
                "512",
            ];
            args.extend_from_slice(&flags);
            let o = castor(&args);
            assert!(o.status.success(), "{config}: {}", stderr(&o));
            let out = common::stdout(&o);
            let line = out.lines().find(|l| l.starts_with("cuda ")).unwrap_or("");
            assert!(
                line.contains("kernel launches"),
                "{config} {flags:?}: {line}"
            );
        }
    }
}

/// On CUDA, FP8 values are made by `quantize` and read by `fp8_matmul`: a plain cast to FP8
/// (which only the CPU executor runs) is a typed error that names the value, the op and the
/// dtype, not a panic.
#[test]
fn fp8_casts_are_refused_by_name() {
    let src = std::fs::read_to_string(common::root().join("tests/ir/fp8_casts.ir")).unwrap();
    let g = castor_ir::text::parse(&src).unwrap();
    let e = castor_runtime::cuda::lower::lower_graph(&g).unwrap_err();
    assert_eq!(e.node, "x.f8");
    assert!(
        e.message.contains(
            "`cast` with a f8e4m3[4,8] value has no CUDA kernel: on CUDA, FP8 values are made by \
             `quantize` and read by `fp8_matmul`"
        ),
        "{e}"
    );
}

/// The place after `p` (`a+128`, `s3`, `s3+8`) `bytes` further on, as the listing prints it.
fn listed_plus(p: &str, bytes: u64) -> String {
    let (base, offset) = match p.split_once('+') {
        Some((b, o)) => (b, o.parse::<u64>().unwrap()),
        None => (p, 0),
    };
    format!("{base}+{}", offset + bytes)
}

/// An FP8 training plan's CUDA listing (`compile --emit cuda`): each FP8 product of the step
/// (the forward's, the input gradient's, the weight gradient's: three per product by a weight)
/// is one cuBLASLt call in the "TN" form (A transposed, B not) with E4M3 forward operands and
/// E5M2 output gradients, its two scale pointers at the factors an `fp8_dequantization`
/// launch before it writes (one launch for the products whose scales exist by then; cuBLAS's A
/// is the IR's rhs, so A's factor is the second), fast accumulation off; the operands the IR
/// stores the other way are transposed by strided byte copies just before it, three per
/// product (GPT-2: the `x W` weight and both weight-gradient operands; LLaMA: `dX = dY W`'s
/// weight and both weight-gradient operands) less those shared (LLaMA's q, k and v weight
/// gradients read one copy of their input, as gate and up do). The scales and casts are the
/// fp8 family's kernels.
#[test]
fn fp8_plans_lower_to_cublaslt_fp8_products() {
    for variant in ["gpt2_lm", "llama_gqa"] {
        let model = fixture(variant);
        let ir = castor(&[
            "compile",
            path_str(&model),
            "--precision",
            "fp8",
            "--emit",
            "ir",
        ]);
        assert!(ir.status.success(), "{variant}: {}", stderr(&ir));
        let products = common::stdout(&ir).matches("= fp8_matmul").count();
        assert!(products >= 8, "{variant}: {products} FP8 products");
        let o = castor(&[
            "compile",
            path_str(&model),
            "--precision",
            "fp8",
            "--train",
            "--emit",
            "cuda",
        ]);
        assert!(o.status.success(), "{variant}: {}", stderr(&o));
        let listing = common::stdout(&o);
        let lines: Vec<&str> = listing.lines().map(str::trim_start).collect();
        let node = |l: &str| l.rsplit_once("  # %").map(|(_, n)| n.to_string());
        let mut gemms = 0;
        let mut copies = 0;
        let mut kinds: HashMap<String, usize> = HashMap::new();
        for (i, l) in lines.iter().enumerate() {
            if !l.starts_with("gemm f8e") {
                continue;
            }
            gemms += 1;
            let head: String = l.split(" m=").next().unwrap().into();
            *kinds.entry(head.clone()).or_default() += 1;
            assert!(
                l.contains(" fp8(a_scale=") && l.ends_with(&format!("  # %{}", node(l).unwrap()))
            );
            assert!(l.contains("fast_accum=off)"), "{l}");
            let name = node(l).unwrap();
            let field = |key: &str| {
                l.split(key)
                    .nth(1)
                    .and_then(|r| r.split([' ', ')']).next())
                    .unwrap()
                    .to_string()
            };
            // The factors: a pair the dequantization launch wrote before it (one launch for
            // every product whose scales exist by then), cuBLAS's A factor the second.
            assert!(
                lines[..i]
                    .iter()
                    .any(|p| p.starts_with("launch fp8_dequantization<<<")),
                "{variant}: no dequantization before {l}"
            );
            assert_eq!(field("a_scale="), listed_plus(&field("b_scale="), 4), "{l}");
            copies += lines[..i]
                .iter()
                .rev()
                .take_while(|p| node(p).as_deref() == Some(name.as_str()))
                .filter(|p| p.starts_with("launch strided_copy_b1<<<"))
                .count();
        }
        let dequantizations = lines
            .iter()
            .filter(|l| l.starts_with("launch fp8_dequantization<<<"))
            .count();
        println!(
            "{variant}: {products} products, {gemms} FP8 gemms, {copies} copies, \
             {dequantizations} dequantization launches: {kinds:?}"
        );
        assert_eq!(gemms, 3 * products, "{variant}");
        // LLaMA's q, k and v weight gradients share their input's copy, as gate and up do
        // (three fewer a layer of seven products); GPT-2's products copy nothing twice.
        let shared = if variant == "llama_gqa" {
            3 * products / 7
        } else {
            0
        };
        assert_eq!(
            copies,
            3 * products - shared,
            "{variant}: transposed copies"
        );
        assert!(
            dequantizations < gemms,
            "{variant}: {dequantizations} dequantization launches for {gemms} products"
        );
        // The forward's E4M3 x E4M3 (into BF16, or F32 where its reader needs it); the input
        // gradient's, E4M3 weight by E5M2 output gradient into BF16; the weight gradient's,
        // activation by output gradient into the F32 gradient.
        let count = |f: &dyn Fn(&str) -> bool| -> usize {
            kinds.iter().filter(|(h, _)| f(h)).map(|(_, n)| n).sum()
        };
        assert_eq!(
            count(&|h| h.starts_with("gemm f8e4m3ᵀ x f8e4m3 ->")),
            products
        );
        assert_eq!(
            count(&|h| h.contains("f8e5m2") && h.ends_with("-> bf16")),
            products
        );
        assert_eq!(
            count(&|h| h.contains("f8e5m2") && h.ends_with("-> f32")),
            products
        );
        // The weights' maxima come from their update's launch, the norms' outputs' from the
        // norm kernels; the attention's output has an amax kernel of its own.
        for kernel in [
            "fp8_amax_bf16",
            "fp8_scale_finalize",
            "fp8_quantize_bf16_e4m3",
            "fp8_quantize_f32_e4m3",
            "fp8_quantize_bf16_e5m2",
        ] {
            assert!(
                listing.contains(&format!("launch {kernel}<<<")),
                "{variant}: {kernel}"
            );
        }
    }
}

/// The kernel profile sets each kind beside the program roofline's time for its commands
/// (`castor train --profile-kernels`): summed over every command of a step, that is the
/// program roofline itself, each unit counted once however many commands and node names it
/// lowers to (a fused classifier's products and row kernels, a norm's backward and its
/// weight gradient, an attention's passes). Until 2026-11-30 each node name of a unit took
/// the unit's whole time: GPT-2 124M B8xT1024's commands added up to 15.28 ms of roofline
/// against the program's 9.96 ms, the classifier counted three times.
#[test]
fn the_profiles_roofline_adds_up_to_the_program_roofline() {
    use castor_runtime::cuda::profile::{CommandTime, KernelProfile};
    use castor_runtime::cuda::roofline::{program_roofline, unit_times};
    let gpu = castor_passes::cost::GpuSpec::default();
    for (variant, flags) in [
        ("gpt2_lm", &["--precision", "bf16"][..]),
        ("gpt2_lm", &["--precision", "bf16", "--attention", "eager"]),
        ("llama_gqa", &["--precision", "bf16", "--grad-accum", "2"]),
        ("gpt2_lm", &["--precision", "fp16", "--remat", "selective"]),
        ("llama_gqa", &["--precision", "bf16", "--lora-rank", "4"]),
        (
            "gpt2-124m.json",
            &["--precision", "bf16", "--batch", "8", "--seq", "1024"],
        ),
        (
            "llama-3.2-1b.json",
            &["--precision", "bf16", "--batch", "4", "--seq", "2048"],
        ),
    ] {
        let p = if variant.ends_with(".json") {
            let config = common::root().join("assets").join("configs").join(variant);
            common::cuda_cases::plan_of(&config, flags)
        } else {
            plan(variant, flags)
        };
        let program = lower_plan(&p).unwrap();
        let roofline = program_roofline(&p, &gpu).unwrap();
        let mut commands = Vec::new();
        for run in &program.runs {
            let repeats = match run.name.as_str() {
                "micro_step" => p.settings.grad_accum.max(1),
                "optimizer_step" => 1,
                _ => 0,
            };
            for _ in 0..repeats {
                // As the runner profiles a run: its commands, a cuDNN pass's prelude timed
                // with the pass.
                for (i, c) in run.commands.iter().enumerate() {
                    commands.push(CommandTime::of(&run.name, i, c, false, 1.0));
                }
            }
        }
        let profile = KernelProfile { commands };
        let units = unit_times(&p, &gpu).unwrap();
        let summed: f64 = profile.roofline_ms(&units).iter().sum();
        let want = 1e3 * roofline.seconds();
        assert!(
            (summed - want).abs() <= 1e-9 * want,
            "{variant} {flags:?}: the profile's commands add up to {summed} ms of roofline, \
             the program roofline is {want} ms"
        );
    }
}
