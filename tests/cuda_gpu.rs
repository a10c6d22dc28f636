//! The CUDA executor against the CPU executor, its oracle.
//!
//! Kernels: one small graph per op family and dtype, at sizes that are not multiples of the
//! block or vector width, run on both executors; every output must agree (relative error
//! below 1e-5 in F32, 2e-2 in F16/BF16). Training: three steps of every family fixture's plan
//! under fp32 (TF32 off), tf32, bf16 and fp16 (dynamic loss scaling), and each remat mode and
//! training option once, on both executors; the losses, the updated masters and moments must
//! agree (F32 < 1e-4, TF32 < 2e-2, BF16/F16 < 5e-2, or for BF16 1.1 times the largest
//! distance between the CPU executor's own BF16 and F32 runs where that is larger, and for F32
//! 1.1 times the largest distance a one-ulp change of the parameters makes on the CPU where
//! that is larger) and the loss-scale sequences must be equal. Slices whose gradient is zero in exact arithmetic (the
//! fixtures list them) hold rounding noise that cuBLAS rounds differently: it must stay below
//! the tolerance times the largest gradient, and is otherwise left out, as in the comparisons
//! with PyTorch. Every failure is collected and reported at the end.
//!
//! Without a GPU the graphs are still parsed, run on the CPU and lowered (so the cases stay
//! valid), and the GPU comparison is skipped with the probe's reason; with
//! `CASTOR_REQUIRE_GPU=1` a missing GPU fails the test instead.

mod common;

use castor_ir::{relative_error, Tensor};
use castor_runtime::cpu::CpuExecutor;
use castor_runtime::cuda::lower::{lower_graph, lower_plan};
use castor_runtime::cuda::{CudaGraphRunner, CudaPlanRunner};
use castor_runtime::{cuda_probe, PlanRunner};
use common::cuda_cases::{
    as_f32, batch, case_graph, compare_state, exact_zero_slices, inputs, load_params,
    mask_exact_zero, padding_unscored, plan, plan_matrix, right_padded, state_error, Bounds,
    ATTENTION_CASES, CASES, PLAN_FAMILIES, PLAN_OPTIONS, PLAN_PRECISIONS, PLAN_REMATS,
};
use std::collections::HashMap;

/// True when a GPU is present; prints why not and fails under `CASTOR_REQUIRE_GPU=1`.
fn gpu() -> bool {
    match cuda_probe::probe() {
        Ok(d) => {
            println!("GPU: {d}");
            true
        }
        Err(e) => {
            assert!(
                std::env::var("CASTOR_REQUIRE_GPU").as_deref() != Ok("1"),
                "CASTOR_REQUIRE_GPU=1 but {e}"
            );
            println!("skipped on the GPU: {e}");
            false
        }
    }
}

#[test]
fn every_kernel_family_matches_the_cpu_executor() {
    let on_gpu = gpu();
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (name, body) in CASES.iter().chain(ATTENTION_CASES) {
        for t in ["f32", "bf16", "f16"] {
            let g = case_graph(name, body, t);
            let data = inputs(&g, 37, 0x5eed + rows.len() as u64);
            let bind = |n: &str| data.get(n);
            let want = CpuExecutor::new()
                .run(&g, &bind)
                .unwrap_or_else(|e| panic!("{name} {t} on the CPU: {e}"));
            lower_graph(&g).unwrap_or_else(|e| panic!("{name} {t} does not lower: {e}"));
            checked += 1;
            if !on_gpu {
                continue;
            }
            let got = CudaGraphRunner::new(&g, &|n| data.get(n).cloned())
                .and_then(|mut runner| runner.run(&data));
            let got = match got {
                Ok(got) => got,
                Err(e) => {
                    failures.push(format!("{name} {t} on CUDA: {e}"));
                    continue;
                }
            };
            let tol = if t == "f32" { 1e-5 } else { 2e-2 };
            for ((v, w), gt) in g.outputs().iter().zip(&want).zip(&got) {
                let err = relative_error(&as_f32(gt), &as_f32(w));
                rows.push(format!("{name:<18} {t:<5} %{:<6} {err:.2e}", g.name(*v)));
                if err.is_nan() || err >= tol {
                    failures.push(format!(
                        "{name} {t} %{}: relative error {err:.3e}",
                        g.name(*v)
                    ));
                }
            }
        }
    }
    println!("{checked} graphs run on the CPU and lowered for CUDA");
    for r in rows {
        println!("{r}");
    }
    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The plans run on the GPU, per family: every precision with the defaults, then each
/// remat mode and each option once, spread over the precisions (the emulator runs the whole
/// matrix; GPU time is scarce), the fused attention (castor's kernels, cuDNN's where it loads,
/// and the automatic choice), BF16 moments, 8-bit AdamW, Lion and the fused classifier in
/// BF16.
fn gpu_plans(family: &str) -> Vec<String> {
    let mut out: Vec<String> = PLAN_PRECISIONS
        .iter()
        .map(|p| format!("--precision {p}"))
        .collect();
    let matrix = plan_matrix(family);
    for (i, remat) in PLAN_REMATS.iter().enumerate() {
        let precision = PLAN_PRECISIONS[i % PLAN_PRECISIONS.len()];
        let option = PLAN_OPTIONS[(i + 1) % PLAN_OPTIONS.len()];
        let want = format!("--precision {precision} {option}");
        let want = want.split_whitespace().collect::<Vec<_>>().join(" ");
        let flags = matrix
            .iter()
            .find(|f| f.starts_with(&want) && f.contains(&format!("--remat {remat}")))
            .cloned()
            .unwrap_or_else(|| panic!("{family}: no plan {want} --remat {remat}"));
        out.push(flags);
    }
    out.push("--precision bf16 --attention fused".into());
    // cuDNN's fused attention where it loads (a missing cuDNN is a named error for `cudnn`,
    // so that case runs only where the probe finds one; `auto` runs everywhere), and where
    // cuDNN can run the family's attention (not a sliding window: tests/attention.rs holds
    // that refusal); any other lowering error stays a case, and fails.
    let cudnn = "--precision bf16 --attention cudnn";
    match castor_runtime::cuda::device::probe_cudnn() {
        Ok(_) => match lower_plan(&plan(family, &cudnn.split(' ').collect::<Vec<_>>())) {
            Err(e)
                if e.to_string()
                    .contains("cuDNN's fused attention cannot run this op") =>
            {
                eprintln!("{family}: no --attention cudnn case: {e}")
            }
            _ => out.push(cudnn.into()),
        },
        Err(why) => eprintln!("{family}: no --attention cudnn case: {why}"),
    }
    out.push("--precision fp16 --attention auto".into());
    // The choices the remat rows leave out, once each: BF16 moments, 8-bit AdamW, Lion, the
    // fused classifier in chunks small enough that a fixture's head takes several, and
    // epilogues.
    out.push("--precision bf16 --optimizer-state bf16".into());
    out.push("--precision bf16 --optimizer adamw8bit".into());
    out.push("--precision bf16 --optimizer lion".into());
    out.push("--precision bf16 --classifier fused:5".into());
    // cuBLASLt's epilogues (bias, bias + GELU, GELU gradient, bias gradients).
    out.push("--precision bf16 --epilogues fused".into());
    // cuBLASLt's FP8 products with scale pointers, and the fp8 family's kernels: a GPT-2
    // (`x W` weights, transposed copies in the forward) and a LLaMA (`x Wᵀ`, copies in the
    // backward).
    if FP8_FAMILIES.contains(&family) {
        out.push("--precision fp8".into());
        out.push("--precision fp8 --remat selective --grad-accum 2".into());
    }
    // Delayed scaling: the scales read from state, the fp8 family's amax_history kernel
    // writing the histories back in place.
    if family == "llama_gqa" {
        out.push("--precision fp8:delayed --amax-history 4".into());
    }
    out
}

/// `k/n` (0 <= k < n): the training-steps test runs only the plans whose place in the whole
/// list is k modulo n, so that the GPU check runs the list as n processes at once (a tiny
/// fixture's plan spends its time on the host: loading kernels and cuDNN's graphs, capturing,
/// and the CPU executor's steps). Unset: every plan.
const PLAN_SHARE_ENV: &str = "CASTOR_GPU_PLAN_SHARE";

/// The share [`PLAN_SHARE_ENV`] names, as (k, n); (0, 1) when unset.
fn plan_share(value: Option<&str>) -> Result<(usize, usize), String> {
    let Some(v) = value else { return Ok((0, 1)) };
    let parsed = v
        .split_once('/')
        .and_then(|(k, n)| Some((k.trim().parse().ok()?, n.trim().parse().ok()?)));
    match parsed {
        Some((k, n)) if k < n => Ok((k, n)),
        _ => Err(format!(
            "{PLAN_SHARE_ENV}={v}: expected k/n with 0 <= k < n, such as 0/4"
        )),
    }
}

#[test]
fn a_plan_share_is_k_of_n() {
    assert_eq!(plan_share(None), Ok((0, 1)));
    assert_eq!(plan_share(Some("2/5")), Ok((2, 5)));
    for bad in ["5/5", "1", "a/2", "1/0"] {
        let e = plan_share(Some(bad)).unwrap_err();
        assert!(e.contains(PLAN_SHARE_ENV) && e.contains(bad), "{e}");
    }
}

/// The families whose FP8 plans run on the GPU.
const FP8_FAMILIES: [&str; 2] = ["gpt2_lm", "llama_gqa"];

/// The largest relative error allowed on the GPU: F32 1e-4 (cuBLAS sums in another order;
/// TF32 off), TF32 (operands rounded to 11 significant bits) 2e-2, BF16/F16 5e-2, the bound
/// the comparisons with PyTorch hold: where cuBLAS rounds a 16-bit product differently, the
/// difference travels through three steps, and AdamW's first steps move a weight by about
/// `lr * sign(gradient)`, so a gradient at rounding-noise level flips its update.
///
/// FP8 plans get BF16's 5e-2 and, per state entry, their own noise floor (`noise_floors`): the
/// products' operands are quantized to 3 (E4M3) or 2 (E5M2) mantissa bits from BF16 values
/// that cuBLAS rounds differently from the CPU, so a value on a rounding boundary lands one FP8
/// step (12.5% or 25% of it) apart, and each differing step moves the scales, the casts and
/// the products after it; cuBLASLt's FP8 sums (fast accumulation off) add their own order.
/// Two FP8 executors can then lie as far apart as FP8 lies from F32, which the floor measures.
fn gpu_tolerance(flags: &str) -> f64 {
    if flags.contains("fp32") {
        1e-4
    } else if flags.contains("tf32") {
        2e-2
    } else {
        5e-2
    }
}

/// For a BF16 plan, its noise floor per state entry: the distance between the CPU executor's
/// own BF16 run and its F32 run of the same plan (`--precision fp32`, same batches), the
/// exact-zero noise slices left out as in the comparison. Two BF16 executors that round
/// differently can lie that far apart (times 1.1) without a fault, as the comparisons with
/// PyTorch take their noise floor from PyTorch's BF16 and F32 runs. Per entry, because one
/// entry driven by rounding noise (the moments of BERT's key bias, zero in exact arithmetic,
/// lie 1e9 apart relative to the F32 run's) must not loosen the bound of every other; the
/// first GPU run of per-plan floors found exactly that. The 8-bit optimizer's entries (codes
/// and block maxima, `adamw8bit.*`) share one floor, their largest: a one-ulp change of a
/// gradient moves a value to another code, a discrete jump whose size the F32 run samples
/// only here and there (the next GPU run measured 0.126 on LLaMA-GQA's `v_absmax` of one
/// layer, past that entry's own bound of 0.119 and inside the 8-bit entries' shared 0.39).
/// F16 plans get none: their gradients are loss-scaled, which the F32 run has no counterpart
/// of. FP8 plans get theirs the same way, from the CPU executor's FP8 and F32 runs (see
/// [`gpu_tolerance`]). F32 plans get [`rounding_floors`].
fn noise_floors(
    family: &str,
    flags: &str,
    params: &HashMap<String, Tensor>,
    low: &HashMap<String, Tensor>,
    noise: &HashMap<String, (usize, usize)>,
    padded: Padded,
) -> HashMap<String, f64> {
    if flags.contains("--precision fp32") {
        return rounding_floors(family, flags, params, low, noise, padded);
    }
    // fp8:delayed before fp8, which it contains.
    let Some(low_precision) = [
        "--precision bf16",
        "--precision fp8:delayed",
        "--precision fp8",
    ]
    .into_iter()
    .find(|p| flags.contains(p)) else {
        return HashMap::new();
    };
    let twin = flags.replace(low_precision, "--precision fp32");
    // The F32 twin keeps no amax histories: their length is no flag of it.
    let mut split: Vec<&str> = twin.split_whitespace().collect();
    if let Some(i) = split.iter().position(|w| *w == "--amax-history") {
        split.drain(i..(i + 2).min(split.len()));
    }
    let f32_state = cpu_state_after_steps(&plan(family, &split), params, padded);
    let mut floors: HashMap<String, f64> = distances(low, &f32_state, noise)
        .into_iter()
        .map(|(name, e)| (name, 1.1 * e))
        .collect();
    let quantized = |n: &str| n.starts_with("adamw8bit.");
    let shared = floors
        .iter()
        .filter(|(n, _)| quantized(n))
        .fold(0f64, |a, (_, &f)| a.max(f));
    for (n, f) in floors.iter_mut() {
        if quantized(n) {
            *f = shared;
        }
    }
    floors
}

/// How many times [`rounding_floors`] nudges the parameters.
const ROUNDING_DRAWS: u64 = 8;

/// For an F32 plan, its rounding floor per state entry: the largest distance, over
/// [`ROUNDING_DRAWS`] draws, between the CPU executor's three steps and the same steps from
/// parameters each moved one unit in the last place, up or down at random (zeros left as
/// they are), times 1.1. cuBLAS and the CPU executor round each sum differently by about
/// that much, so an entry that a one-ulp change of the inputs moves past the tolerance is
/// one whose two executors may lie as far apart without a fault. On the F32 plans of every
/// family fixture the draws move no entry outside Qwen2's key biases by more than 7.7e-6
/// (Gemma), and those biases' other entries by at most 7.3e-5, all under the 1e-4 tolerance,
/// which then stands. The entry they raise is Qwen2's layer-1 key bias: the
/// fixture's slowest RoPE pairs (rope_theta 1e6, head dim 8) barely rotate over its 7
/// positions, so those elements' gradients nearly cancel (without rotation a key bias's
/// gradient is zero, since each row's score gradients sum to zero), and AdamW moves every
/// element by about the learning rate whatever its size, so the order of a sum alone moves
/// their updates. The eight draws move it by 1.5e-4 to 1.1e-3 (floor 1.23e-3); the
/// 2026-11-30 H200 run measured 1.98e-4 there, against the 1e-4 it was held to.
/// `rounding_floors_raise_only_the_near_cancelled_key_bias` holds both halves of that.
fn rounding_floors(
    family: &str,
    flags: &str,
    params: &HashMap<String, Tensor>,
    base: &HashMap<String, Tensor>,
    noise: &HashMap<String, (usize, usize)>,
    padded: Padded,
) -> HashMap<String, f64> {
    let p = plan(family, &flags.split_whitespace().collect::<Vec<_>>());
    let mut floors: HashMap<String, f64> = HashMap::new();
    for draw in 1..=ROUNDING_DRAWS {
        let nudged = nudged_one_ulp(params, draw);
        let state = cpu_state_after_steps(&p, &nudged, padded);
        for (name, e) in distances(&state, base, noise) {
            let f = floors.entry(name).or_default();
            *f = f.max(1.1 * e);
        }
    }
    floors
}

/// `params` with every nonzero finite F32 element moved one unit in the last place, toward
/// or away from zero by a coin of the `draw`th random sequence; other dtypes as they are.
fn nudged_one_ulp(params: &HashMap<String, Tensor>, draw: u64) -> HashMap<String, Tensor> {
    let mut rng = common::cuda_cases::Rng(draw.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut names: Vec<&String> = params.keys().collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let t = &params[name];
            let nudged = match t.as_f32() {
                Some(values) if t.dtype() == castor_ir::DType::F32 => {
                    let values = values
                        .iter()
                        .map(|&v| {
                            let coin = rng.next() & 1 == 1;
                            if v == 0.0 || !v.is_finite() {
                                v
                            } else if coin {
                                f32::from_bits(v.to_bits() + 1)
                            } else {
                                f32::from_bits(v.to_bits() - 1)
                            }
                        })
                        .collect();
                    Tensor::from_f32(t.dtype(), t.shape().clone(), values)
                }
                _ => t.clone(),
            };
            (name.clone(), nudged)
        })
        .collect()
}

/// The comparison's batches for step `step` of `p`: right-padded, and with the padded
/// positions' labels drawn like any other (`Padded::Scored`, so that every path runs) or the
/// ignore index, as data collators and castor's own data label them (`Padded::Unscored`).
fn step_batches(
    p: &castor_ir::TrainingPlan,
    step: u64,
    padded: Padded,
) -> Vec<HashMap<String, Tensor>> {
    (0..p.settings.grad_accum as u64)
        .map(|i| {
            let b = right_padded(batch(&p.micro_step, 77 + 10 * step + i));
            match padded {
                Padded::Scored => b,
                Padded::Unscored => padding_unscored(b),
            }
        })
        .collect()
}

/// Whether the comparison's batches score padded positions ([`step_batches`]).
#[derive(Clone, Copy, PartialEq)]
enum Padded {
    Scored,
    Unscored,
}

/// The CPU executor's state after the comparison's three steps of `p` (the same batches).
fn cpu_state_after_steps(
    p: &castor_ir::TrainingPlan,
    params: &HashMap<String, Tensor>,
    padded: Padded,
) -> HashMap<String, Tensor> {
    let mut cpu = PlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
    for step in 0..3u64 {
        cpu.step(&step_batches(p, step, padded), 1e-3).unwrap();
    }
    cpu.state_entries()
        .into_iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect()
}

/// Per state entry of `a` with a same-shaped entry in `b`, their relative distance, the
/// exact-zero noise slices left out as in the comparison; entries whose distance is not
/// finite are left out.
fn distances(
    a: &HashMap<String, Tensor>,
    b: &HashMap<String, Tensor>,
    noise: &HashMap<String, (usize, usize)>,
) -> Vec<(String, f64)> {
    a.iter()
        .filter_map(|(name, t)| {
            let other = b.get(name).filter(|o| o.shape() == t.shape())?;
            let (mut x, mut y) = (as_f32(t), as_f32(other));
            mask_exact_zero(noise, name, t.shape().dims(), &mut x, &mut y);
            let e = state_error(&x, &y);
            e.is_finite().then(|| (name.clone(), e))
        })
        .collect()
}

/// What [`rounding_floors`] says of it: on every family's F32 plans, the one-ulp draws move
/// Qwen2's layer-1 key bias past the 1.98e-4 that the 2026-11-30 H200 run measured there,
/// and move no entry of any other family past the 1e-4 tolerance, so no other bound is raised.
/// The figures its doc gives hold too, as printed (two digits): at most 7.7e-6 outside Qwen2's
/// key biases, at most 7.3e-5 for those biases but the raised one, at most 1.1e-3 for that.
#[test]
fn rounding_floors_raise_only_the_near_cancelled_key_bias() {
    let near_cancelled = "model.layers.1.self_attn.k_proj.bias";
    // Whether the largest distance a draw made (a floor over 1.1) prints, to two digits, as
    // at most the figure whose rounding boundary is `boundary` (7.75e-6 for 7.7e-6).
    let prints_within = |floor: f64, boundary: f64| floor / 1.1 < boundary;
    for &family in PLAN_FAMILIES.iter() {
        let noise = exact_zero_slices(family);
        let params = load_params(family);
        for flags in gpu_plans(family)
            .into_iter()
            .filter(|f| f.contains("--precision fp32"))
        {
            let p = plan(family, &flags.split_whitespace().collect::<Vec<_>>());
            let base = cpu_state_after_steps(&p, &params, Padded::Scored);
            let floors = rounding_floors(family, &flags, &params, &base, &noise, Padded::Scored);
            assert!(!floors.is_empty(), "{family} {flags}: no floors");
            let tol = gpu_tolerance(&flags);
            let mut raised: Vec<(&String, &f64)> =
                floors.iter().filter(|(_, &f)| f > tol).collect();
            raised.sort_by(|a, b| a.0.cmp(b.0));
            let mut largest: Vec<(&String, &f64)> = floors.iter().collect();
            largest.sort_by(|a, b| b.1.total_cmp(a.1));
            let largest: Vec<String> = largest
                .iter()
                .take(3)
                .map(|(n, f)| format!("{n} {f:.2e}"))
                .collect();
            println!("{family} {flags}: raised {raised:?}; largest floors {largest:?}");
            if family == "qwen2_bias" && flags == "--precision fp32" {
                let f = floors[near_cancelled];
                assert!(
                    f >= 1.98e-4 && prints_within(f, 1.15e-3),
                    "{family} {flags}: {near_cancelled} floor {f:.3e}"
                );
            }
            for (name, &f) in &floors {
                let key_bias = family == "qwen2_bias" && name.ends_with("k_proj.bias");
                let raised = key_bias && flags == "--precision fp32" && name == near_cancelled;
                let boundary = if key_bias { 7.35e-5 } else { 7.75e-6 };
                assert!(
                    raised || prints_within(f, boundary),
                    "{family} {flags}: {name} floor {f:.3e}: a draw moved it {:.2e}",
                    f / 1.1
                );
            }
            assert!(
                raised
                    .iter()
                    .all(|(n, _)| family == "qwen2_bias" && n.ends_with("k_proj.bias")),
                "{family} {flags}: raised {raised:?}"
            );
        }
    }
}

/// The bounds of one plan's state comparison: `tol`, or an entry's noise or rounding floor
/// ([`noise_floors`]) where larger; in the slices whose gradient is zero in exact arithmetic, noise up to `tol` times
/// the largest gradient anywhere in the state (the noise of a sum scales with what it sums,
/// and F16 gradients are loss-scaled), and never under 1e-5.
fn state_bounds(
    tol: f64,
    floors: HashMap<String, f64>,
    cpu_state: &HashMap<String, Tensor>,
) -> Bounds {
    let grad_peak = cpu_state
        .iter()
        .filter(|(n, _)| n.starts_with("grad."))
        .flat_map(|(_, t)| as_f32(t))
        .fold(0f32, |m, v| m.max(v.abs()));
    Bounds {
        tol,
        noise: f64::max(1e-5, tol * f64::from(grad_peak)),
        raised: floors.into_iter().filter(|(_, f)| *f > tol).collect(),
    }
}

/// Runs `family`'s plan of `flags` on the CPU executor and, `on_gpu`, on the device, three
/// steps each, and adds every disagreement past its bound to `failures` (a plan that does not
/// lower fails with or without a GPU); prints the plan's line as it ends.
fn check_plan(
    family: &str,
    flags: &str,
    on_gpu: bool,
    params: &HashMap<String, Tensor>,
    noise: &HashMap<String, (usize, usize)>,
    padded: Padded,
    failures: &mut Vec<String>,
) {
    let case = format!("{family} {flags}");
    let started = std::time::Instant::now();
    let split: Vec<&str> = flags.split_whitespace().collect();
    let p = plan(family, &split);
    if let Err(e) = lower_plan(&p) {
        failures.push(format!("{case}: does not lower: {e}"));
        return;
    }
    if !on_gpu {
        return;
    }
    let mut cpu = PlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
    // Where a GPU run's time goes, per plan (printed with its line): in all, loading
    // (kernels, cuDNN's graphs) and the three device steps (the first captures each
    // run as a CUDA graph).
    let loading = std::time::Instant::now();
    let mut gpu = match CudaPlanRunner::new(p.clone(), &|n| params.get(n).cloned()) {
        Ok(r) => r,
        Err(e) => {
            failures.push(format!("{case}: loading on the GPU: {e}"));
            return;
        }
    };
    let loaded = loading.elapsed().as_secs_f64();
    let mut on_device = 0f64;
    let tol = gpu_tolerance(flags);
    let mut worst = 0f64;
    let mut ok = true;
    for step in 0..3u64 {
        let batches = step_batches(&p, step, padded);
        let a = cpu.step(&batches, 1e-3).unwrap();
        let stepping = std::time::Instant::now();
        let stepped = gpu.step(&batches, 1e-3);
        on_device += stepping.elapsed().as_secs_f64();
        let b = match stepped {
            Ok(b) => b,
            Err(e) => {
                failures.push(format!("{case} step {step}: {e}"));
                ok = false;
                break;
            }
        };
        let loss_err = f64::from(((a.loss - b.loss) / a.loss).abs());
        worst = worst.max(loss_err);
        if loss_err.is_nan() || loss_err >= tol {
            failures.push(format!(
                "{case} step {step}: loss cpu {} cuda {} (error {loss_err:.2e})",
                a.loss, b.loss
            ));
        }
        if (a.loss_scale, a.next_loss_scale) != (b.loss_scale, b.next_loss_scale) {
            failures.push(format!(
                "{case} step {step}: loss scale {} -> {} on the CPU, {} -> {} on CUDA",
                a.loss_scale, a.next_loss_scale, b.loss_scale, b.next_loss_scale
            ));
        }
        if a.skipped != b.skipped {
            failures.push(format!("{case} step {step}: skipped differs"));
        }
    }
    if !ok {
        return;
    }
    let cpu_state: HashMap<String, Tensor> = cpu
        .state_entries()
        .into_iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    let floors = noise_floors(family, flags, params, &cpu_state, noise, padded);
    let bounds = state_bounds(tol, floors, &cpu_state);
    let device_state: HashMap<String, Tensor> = match gpu.state_entries() {
        Ok(s) => s.into_iter().collect(),
        Err(e) => {
            failures.push(format!("{case}: reading the state back: {e}"));
            return;
        }
    };
    for (name, t) in cpu.state_entries() {
        let Some(d) = device_state.get(name) else {
            failures.push(format!("{case}: no device state `{name}`"));
            return;
        };
        let err = compare_state(&case, name, d, t, noise, &bounds, failures);
        worst = worst.max(err);
    }
    let raised = bounds.raised.values().fold(0f64, |a, &b| a.max(b));
    let seconds = format!(
        "{:.1} s: load {loaded:.1}, 3 steps {on_device:.1}",
        started.elapsed().as_secs_f64()
    );
    // Each plan's line as it ends (the GPU check kills a step that runs out of time:
    // the lines before show where the time went).
    println!(
        "{}",
        if bounds.raised.is_empty() {
            format!(
                "{case:<70} worst {worst:.2e} (bound {:.2e}); {seconds}",
                bounds.tol
            )
        } else {
            format!(
                "{case:<70} worst {worst:.2e} (bound {:.2e}; {} entries up to {raised:.2e} \
                 by the BF16, FP8 or F32 rounding floor); {seconds}",
                bounds.tol,
                bounds.raised.len()
            )
        }
    );
}

#[test]
fn training_steps_match_the_cpu_executor() {
    let on_gpu = gpu();
    let (share, shares) =
        plan_share(std::env::var(PLAN_SHARE_ENV).ok().as_deref()).unwrap_or_else(|e| panic!("{e}"));
    let cases: Vec<(&str, String)> = PLAN_FAMILIES
        .iter()
        .flat_map(|&family| gpu_plans(family).into_iter().map(move |f| (family, f)))
        .collect();
    let total = cases.len();
    let mut mine: Vec<(&str, Vec<String>)> = Vec::new();
    for (i, (family, flags)) in cases.into_iter().enumerate() {
        if i % shares != share {
            continue;
        }
        match mine.last_mut() {
            Some((f, plans)) if *f == family => plans.push(flags),
            _ => mine.push((family, vec![flags])),
        }
    }
    if shares > 1 {
        println!(
            "plans {share}/{shares}: {} of {total}",
            mine.iter().map(|(_, p)| p.len()).sum::<usize>()
        );
    }
    let mut failures = Vec::new();
    for (family, plans) in mine {
        let noise = exact_zero_slices(family);
        let params = load_params(family);
        for flags in plans {
            check_plan(
                family,
                &flags,
                on_gpu,
                &params,
                &noise,
                Padded::Scored,
                &mut failures,
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// cuDNN's sliding-window graphs on a GPU, tried only where `CASTOR_CUDNN_WINDOWS=1` (the GPU
/// check sets it for this test alone; without it a window never reaches cuDNN): Mistral's
/// windowed plans with `--attention cudnn`, BF16 and F16, against the CPU executor with the
/// training comparison's bounds, on batches whose padded positions reach no loss, as castor's
/// data and data collators label them. The training comparison's batches score padded rows
/// too, and under a window a row far enough past its sequence's end sees no key: cuDNN's
/// graphs compute only the kept keys, castor's twin attends to every key (as PyTorch's
/// finite-minimum masks do), and such a row's output and its backward differ. That is the
/// likely cause of the gradients 0.75 away on the 2026-11-30 H200;
/// `padded_rows_reach_no_gradient_where_padding_is_unscored` (tests/attention.rs) holds that
/// those rows then reach no gradient. When this passes on a GPU, windows can leave castor's
/// kernels under `auto`.
#[test]
fn cudnn_sliding_windows_match_the_cpu_executor() {
    let switch = castor_runtime::cuda::sdpa::WINDOWS_ENV;
    if !castor_runtime::cuda::sdpa::env_switch(switch).unwrap_or_else(|e| panic!("{e}")) {
        println!("skipped: {switch} is not 1");
        return;
    }
    let on_gpu = gpu();
    let family = "mistral_window";
    let (params, noise) = (load_params(family), exact_zero_slices(family));
    let mut failures = Vec::new();
    for flags in [
        "--precision bf16 --attention cudnn",
        "--precision fp16 --attention cudnn",
    ] {
        check_plan(
            family,
            flags,
            on_gpu,
            &params,
            &noise,
            Padded::Unscored,
            &mut failures,
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What the device allocates for a plan is the planned peak: loading each family's bf16 plan
/// (no recomputation, and selective) allocates exactly `Program::allocation` (castor's count),
/// and takes from the device's free memory at most that plus the driver's rounding of each
/// allocation to its 2 MiB pages and the loaded modules' code (64 MiB), and at least that less
/// the allocations under 2 MiB: the driver serves those from pages it already holds (the first
/// GPU run measured 32 MiB taken for a 32.64 MiB plan whose only large buffer is the 32 MiB
/// cuBLAS workspace). The anatomy, the fit verdict and `--remat budget:` state
/// `Program::allocation` (`tests/memory_model.rs`).
#[test]
fn the_device_allocates_the_planned_peak() {
    if !gpu() {
        return;
    }
    let device = castor_runtime::cuda::device::Device::open().unwrap();
    let mut failures = Vec::new();
    for family in PLAN_FAMILIES {
        for remat in ["none", "selective"] {
            let p = plan(
                family,
                &["--train", "--precision", "bf16", "--remat", remat],
            );
            let program = lower_plan(&p).unwrap();
            let planned = program.allocation().total();
            let allocations = (program.slots.len() + program.tables.len() + 2) as u64;
            let (before, _) = device.mem_info().unwrap();
            let loaded = device.load(&program).unwrap();
            let (after, _) = device.mem_info().unwrap();
            let taken = before - after;
            let slack = allocations * (2 << 20) + (64 << 20);
            let small: u64 = std::iter::once(program.arena_bytes)
                .chain(program.slots.iter().map(|s| s.bytes))
                .chain(program.tables.iter().map(|t| t.byte_len() as u64))
                .filter(|&b| b < (2 << 20))
                .map(castor_runtime::cuda::program::allocated)
                .sum();
            println!(
                "{family} {remat}: planned {planned} bytes ({small} in allocations under 2 MiB), \
                 the device gave {taken}"
            );
            if taken + small < planned || taken > planned + slack {
                failures.push(format!(
                    "{family} {remat}: planned {planned} bytes, loading took {taken}"
                ));
            }
            assert_eq!(loaded.allocated_bytes(), planned);
            drop(loaded);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `--profile-kernels`: a profiled step times every command of its runs and changes nothing:
/// the state after it is bit-identical to a twin runner's that replayed its graphs. From the
/// command line the profile prints its table and writes one CSV row per command.
#[test]
fn a_profiled_step_times_every_command_and_gives_the_same_state() {
    if !gpu() {
        return;
    }
    let family = "gpt2_lm";
    let params = load_params(family);
    let p = plan(family, &["--precision", "bf16"]);
    let program = lower_plan(&p).unwrap();
    let commands: usize = program.runs.iter().map(|r| r.commands.len()).sum();
    let mut plain = CudaPlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
    let mut profiled = CudaPlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
    for step in 0..2u64 {
        let batches = vec![right_padded(batch(&p.micro_step, 77 + step))];
        plain.step(&batches, 1e-3).unwrap();
        if step == 1 {
            profiled.profile_next_step();
        }
        profiled.step(&batches, 1e-3).unwrap();
    }
    let profile = profiled
        .take_kernel_profile()
        .expect("a profile on the GPU");
    assert!(profiled.take_kernel_profile().is_none(), "taken once");
    // Every command of the step's runs (the validation run is not part of a step).
    let validation: usize = program
        .runs
        .iter()
        .filter(|r| !["zero_grads", "micro_step", "optimizer_step"].contains(&r.name.as_str()))
        .map(|r| r.commands.len())
        .sum();
    assert_eq!(profile.commands.len(), commands - validation);
    assert!(profile
        .commands
        .iter()
        .all(|c| c.ms.is_finite() && c.ms >= 0.0));
    assert!(profile.total_ms() > 0.0);
    let a: HashMap<String, Tensor> = plain.state_entries().unwrap().into_iter().collect();
    for (name, t) in profiled.state_entries().unwrap() {
        assert_eq!(
            as_f32(&t),
            as_f32(&a[&name]),
            "{name} differs after the profiled step"
        );
    }

    // From the command line, the same plan: windows of 32 tokens from a raw u16 token file,
    // one per step, no attention mask (the fixture's batch file carries one, which adds
    // commands).
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("kernels.csv");
    let tokens = tmp.path().join("tokens.bin");
    let ids: Vec<u8> = (0..4 * 33u16)
        .flat_map(|i| ((i * 37) % 99).to_le_bytes())
        .collect();
    std::fs::write(&tokens, ids).unwrap();
    let model = common::fixture(family);
    let o = common::castor(&[
        "train",
        common::path_str(&model),
        "--data",
        common::path_str(&tokens),
        "--batch",
        "1",
        "--seq",
        "32",
        "--steps",
        "2",
        "--precision",
        "bf16",
        "--device",
        "cuda",
        "--profile-kernels",
        common::path_str(&csv),
    ]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let out = common::stdout(&o);
    assert!(out.contains("kernels     step 2,"), "{out}");
    let rows = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(rows.lines().count(), 1 + commands - validation, "{rows}");
}

/// A LoRA plan on the GPU against the CPU executor, from the command line: three steps of
/// each family's PEFT fixture adapter, on a base in its dtype and in NF4 (`--base nf4`), the losses
/// and the saved adapters within the plan bounds (F32 1e-4; BF16 5e-2).
#[test]
fn lora_trains_on_the_gpu_as_on_the_cpu() {
    if !gpu() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for family in ["gpt2_lm", "llama_gqa", "qwen2_bias"] {
        let model = common::fixture(family);
        for (precision, base) in [("fp32", "compute"), ("bf16", "compute"), ("bf16", "nf4")] {
            let mut runs = Vec::new();
            for device in ["cpu", "cuda"] {
                let tag = format!("{family}-{precision}-{base}-{device}");
                let (log, save) = (
                    tmp.path().join(format!("{tag}.jsonl")),
                    tmp.path().join(&tag),
                );
                let o = common::castor(&[
                    "train",
                    common::path_str(&model),
                    "--data",
                    common::path_str(&model.join("input.safetensors")),
                    "--adapter",
                    common::path_str(&model.join("lora")),
                    "--steps",
                    "3",
                    "--precision",
                    precision,
                    "--base",
                    base,
                    "--device",
                    device,
                    "--log",
                    common::path_str(&log),
                    "--save",
                    common::path_str(&save),
                ]);
                assert!(o.status.success(), "{tag}: {}", common::stderr(&o));
                let f =
                    castor_models::SafetensorsFile::open(save.join("adapter_model.safetensors"))
                        .unwrap();
                let mut names: Vec<String> = f.names().map(str::to_string).collect();
                names.sort();
                let adapters: Vec<f32> =
                    names.iter().flat_map(|n| f.read_f32(n).unwrap()).collect();
                let losses: Vec<f32> = common::log_losses(&log).iter().map(|&l| l as f32).collect();
                runs.push((losses, adapters));
            }
            let tol = if precision == "fp32" { 1e-4 } else { 5e-2 };
            for (what, a, b) in [
                ("losses", &runs[0].0, &runs[1].0),
                ("adapters", &runs[0].1, &runs[1].1),
            ] {
                let err = relative_error(b, a);
                println!("{family:10} {precision} {base:7} LoRA {what} {err:.2e}");
                if err.is_nan() || err >= tol {
                    failures.push(format!(
                        "{family} {precision} {base}: LoRA {what} {err:.2e}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
