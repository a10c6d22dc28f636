//! The CUDA executor's programs run on the host emulator (`castor_runtime::cuda::emulate`),
//! against the CPU executor, with no GPU.
//!
//! The emulator runs the real kernels (their host build) and computes cuBLAS's products with
//! the CPU executor's matrix product, so where the lowering is right an emulated run is the
//! CPU executor's bit for bit: every comparison here asserts equality (NaN equal to NaN). The
//! one arithmetic the two do differently is the order of F64 sums inside block reductions
//! (documented in the kernel headers, ~1e-16 relative before the rounding to F32); no
//! comparison here shows it.
//!
//! Kernels: the single-op graphs of `tests/cuda_gpu.rs` (every kernel family, f32/bf16/f16,
//! awkward sizes) are lowered and run on the emulator in poison mode (the arena is filled with
//! NaN bytes before each run), and every output must equal the CPU executor's. Training:
//! every family's plan under every precision (fp32, tf32, bf16, fp16 with dynamic loss
//! scaling) x remat mode (none, full, selective, a budget between the two) x option (none,
//! accumulation, SGD, compute-dtype weight gradients), so that a launch only one combination
//! makes cannot hide, is lowered and run by the runner `CudaPlanRunner` is
//! (`EmulatedPlanRunner`: state upload, prologue, then per step: inputs, micro step, loss log,
//! learning rate, optimizer step), in poison mode, for three steps beside the CPU executor's
//! `PlanRunner`; losses, loss scales, grad norms and every state entry must be equal. An
//! out-of-bounds access, a wrong argument, a buffer reused while live or an unsafe in-place
//! update shows up as an error naming the command, or as a difference.

use crate::common;

use castor_ir::Tensor;
use castor_runtime::cpu::CpuExecutor;
use castor_runtime::cuda::emulate::Emulator;
use castor_runtime::cuda::lower::{lower_graph, lower_plan, MICRO_STEP};
use castor_runtime::cuda::program::{Place, Program, SlotKind};
use castor_runtime::cuda::runner::{from_bytes, input_bytes};
use castor_runtime::cuda::EmulatedPlanRunner;
use castor_runtime::{PlanRunner, StepReport};
use common::cuda_cases::{
    as_f32, batch, case_graph, compare_state, exact_zero_slices, inputs, load_params, plan,
    plan_matrix, Bounds, CASES, EAGER,
};
use common::{castor, fixture, path_str, stderr, NEW_DECODERS};
use std::collections::HashMap;

/// Writes the tensors a run's input slots name, as the device runner does.
fn write_inputs(
    emu: &mut Emulator,
    program: &Program,
    run: usize,
    batch: &HashMap<String, Tensor>,
) {
    for (slot, bytes) in input_bytes(program, run, batch).unwrap() {
        emu.write_slot(slot, &bytes).unwrap();
    }
}

/// The first element where `got` and `want` differ (NaN equals NaN), with both values.
fn first_difference(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
    if got.len() != want.len() {
        return Some((got.len().min(want.len()), f32::NAN, f32::NAN));
    }
    got.iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()))
        .map(|i| (i, got[i], want[i]))
}

#[test]
fn every_kernel_family_matches_the_cpu_executor() {
    let mut rows = Vec::new();
    let mut seed = 0u64;
    for (name, body) in CASES {
        for t in ["f32", "bf16", "f16"] {
            let g = case_graph(name, body, t);
            let data = inputs(&g, 37, 0x5eed + seed);
            seed += 1;
            let bind = |n: &str| data.get(n);
            let want = CpuExecutor::new()
                .run(&g, &bind)
                .unwrap_or_else(|e| panic!("{name} {t} on the CPU: {e}"));
            let program = lower_graph(&g).unwrap_or_else(|e| panic!("{name} {t}: {e}"));
            let mut emu = Emulator::new(&program);
            emu.set_poison(true);
            write_inputs(&mut emu, &program, 0, &data);
            emu.run_prologue()
                .unwrap_or_else(|e| panic!("{name} {t}: {e}"));
            emu.run(0).unwrap_or_else(|e| panic!("{name} {t}: {e}"));
            emu.check_flags(0)
                .unwrap_or_else(|e| panic!("{name} {t}: {e}"));
            for (o, w) in program.runs[0].outputs.iter().zip(&want) {
                let bytes = emu
                    .read(o.place, o.ty.size_bytes().unwrap_or(0) as u64)
                    .unwrap();
                let got = from_bytes(&o.ty, &bytes).unwrap();
                rows.push(format!("{name:<18} {t:<5} %{:<6} equal", o.name));
                if let Some((i, a, b)) = first_difference(&as_f32(&got), &as_f32(w)) {
                    panic!(
                        "{name} {t} %{}: element {i} is {a:e}, the CPU's {b:e}",
                        o.name
                    );
                }
            }
        }
    }
    for r in rows {
        println!("{r}");
    }
}

/// Beyond the matrix of [`plan_matrix`]: the loss scaler's other paths, moments stored in
/// BF16, Adafactor (relative step; a given rate with a first moment, weight decay, clipping
/// and fp16 overflows), Lion (decay, clipping, BF16 moments, fp16 overflows, accumulation),
/// and updates applied inside the backward pass.
const EXTRA_PLANS: &[(&str, &str)] = &[
    // Overflowing steps: tolerated (hysteresis 2), then backing off; clipping.
    (
        "gpt2_lm",
        "--precision fp16 --init-scale 1099511627776 --hysteresis 2 --growth-interval 1 \
         --grad-clip 0.5",
    ),
    // The scale growing.
    (
        "bert_mlm",
        "--precision fp16 --growth-interval 2 --grad-clip 1",
    ),
    (
        "llama_gqa",
        "--precision bf16 --optimizer sgd --momentum 0.9 --grad-accum 3",
    ),
    ("gpt2_lm", "--precision bf16 --optimizer-state bf16"),
    (
        "llama_tied",
        "--precision fp16 --optimizer sgd --optimizer-state bf16 --grad-clip 1",
    ),
    ("llama_tied", "--precision bf16 --optimizer adafactor"),
    (
        "gpt2_lm",
        "--precision bf16 --optimizer lion --weight-decay 0.1 --grad-clip 1",
    ),
    (
        "llama_gqa",
        "--precision fp16 --init-scale 1099511627776 --optimizer lion --optimizer-state bf16 \
         --grad-accum 2",
    ),
    (
        "gpt2_lm",
        "--precision fp16 --init-scale 1099511627776 --optimizer adafactor --lr 1e-3 \
         --beta1 0.9 --weight-decay 0.01 --grad-clip 1",
    ),
    (
        "qwen2_bias",
        "--precision fp32 --optimizer adafactor --remat selective",
    ),
    // 8-bit AdamW: 8-bit moments for the matrices of 4096 values and more, F32 below.
    ("gpt2_lm", "--precision bf16 --optimizer adamw8bit"),
    (
        "bert_mlm",
        "--precision fp16 --optimizer adamw8bit --grad-clip 1 --remat selective",
    ),
    // The fused classifier: chunks of rows (several, and one), tied and untied heads.
    ("gpt2_lm", "--precision bf16 --classifier fused:7"),
    (
        "llama_tied",
        "--precision fp16 --classifier fused:5 --remat selective --grad-clip 1",
    ),
    ("qwen2_bias", "--precision fp32 --classifier fused"),
    // Epilogues: bias, bias + GELU, GELU gradient and bias gradient products (GPT-2), bias
    // products beside an erf GELU (BERT), transposed weights with q/k/v biases (Qwen2).
    (
        "gpt2_lm",
        "--precision bf16 --epilogues fused --classifier fused",
    ),
    (
        "gpt2_lm",
        "--precision fp16 --epilogues fused --remat selective --grad-accum 2",
    ),
    (
        "bert_mlm",
        "--precision bf16 --epilogues fused --remat full",
    ),
    ("qwen2_bias", "--precision tf32 --epilogues fused"),
    // Updates inside the backward pass: per-tensor clipping, remat, tied weights.
    (
        "llama_tied",
        "--precision bf16 --update-in-backward --optimizer adafactor",
    ),
    (
        "gpt2_lm",
        "--precision fp32 --update-in-backward --grad-clip 0.05",
    ),
    // fp16: the first backward pass's global norm skips whole steps and clips.
    (
        "gpt2_lm",
        "--precision fp16 --init-scale 1099511627776 --update-in-backward --grad-clip 1",
    ),
    (
        "qwen2_bias",
        "--precision bf16 --update-in-backward --remat full --optimizer-state bf16",
    ),
    (
        "gpt2_lm",
        "--precision bf16 --update-in-backward --optimizer adamw8bit",
    ),
];

/// Three steps of `variant`'s plan under `flags` on the emulator beside the CPU executor;
/// every disagreement is pushed to `failures`, and the summary row returned.
fn compare_training(variant: &str, flags: &str, failures: &mut Vec<String>) -> String {
    let params = load_params(variant);
    let mut flags: Vec<&str> = flags.split_whitespace().collect();
    // Compared bit for bit: the eager attention unless the case names one.
    if !flags.contains(&"--attention") {
        flags.extend(EAGER.split_whitespace());
    }
    let p = plan(variant, &flags);
    let case = format!("{variant} {}", flags.join(" "));
    let mut cpu = PlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
    let mut emu = match EmulatedPlanRunner::new(p.clone(), &|n| params.get(n).cloned()) {
        Ok(emu) => emu,
        Err(e) => {
            failures.push(format!("{case}: loading the program: {e}"));
            return format!("{case:<70} does not load");
        }
    };
    let mut differences = 0usize;
    for step in 0..3u64 {
        let batches: Vec<_> = (0..p.settings.grad_accum as u64)
            .map(|i| batch(&p.micro_step, 77 + 10 * step + i))
            .collect();
        let a = cpu.step(&batches, 1e-3).unwrap();
        let b = match emu.step(&batches, 1e-3) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{case} step {step}: {e}"));
                return format!("{case:<70} failed at step {step}");
            }
        };
        let rows = [
            ("loss", b.loss, a.loss),
            ("loss scale", b.loss_scale, a.loss_scale),
            ("next loss scale", b.next_loss_scale, a.next_loss_scale),
            ("grad norm", b.grad_norm, a.grad_norm),
        ];
        for (name, got, want) in rows {
            if first_difference(&[got], &[want]).is_some() {
                differences += 1;
                failures.push(format!(
                    "{case} step {step}: {name} {got:e}, the CPU's {want:e}"
                ));
            }
        }
        if a.skipped != b.skipped {
            differences += 1;
            failures.push(format!("{case} step {step}: skipped differs"));
        }
    }
    let emulated: HashMap<String, Tensor> = emu.state_entries().unwrap().into_iter().collect();
    for (name, t) in cpu.state_entries() {
        let Some(d) = emulated.get(name) else {
            differences += 1;
            failures.push(format!("{case}: no emulated state `{name}`"));
            continue;
        };
        if let Some((i, a, b)) = first_difference(&as_f32(d), &as_f32(t)) {
            differences += 1;
            failures.push(format!(
                "{case}: state {name} element {i} is {a:e}, the CPU's {b:e}"
            ));
        }
    }
    let states = cpu.state_entries().len();
    format!("{case:<70} 3 steps, {states} state entries: {differences} differences")
}

/// Every plan of `family`'s matrix (precision x remat mode x option) on the emulator; all
/// failures are collected and reported together.
fn family_matrix(family: &str) {
    let mut failures = Vec::new();
    let rows: Vec<String> = plan_matrix(family)
        .iter()
        .map(|flags| compare_training(family, flags, &mut failures))
        .collect();
    for r in &rows {
        println!("{r}");
    }
    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `--precision fp8` plans (tensorwise current scaling: the fp8 family's amax, scale and cast
/// kernels, transposed FP8 copies, cuBLASLt FP8 products reading their dequantization factors
/// through scale pointers) of GPT-2 (`x W` weights) and LLaMA (`x Wᵀ`, grouped-query and tied
/// heads), under each remat mode, with accumulation, SGD and the first and last layers kept in
/// BF16, and with delayed scaling (`amax_history` written back in place), bit for bit: the
/// emulator computes an FP8 product as the CPU executor does, so this checks the lowering
/// (layouts, copies, scale pointers, the kernels that fill them), not cuBLASLt's summation
/// order.
#[test]
fn fp8_training_plans_match_the_cpu_executor() {
    let mut failures = Vec::new();
    let mut rows = Vec::new();
    for (family, flags) in [
        ("gpt2_lm", "--precision fp8"),
        ("gpt2_lm", "--precision fp8 --remat full --grad-accum 2"),
        (
            "gpt2_lm",
            "--precision fp8 --remat selective --optimizer-state bf16",
        ),
        ("llama_gqa", "--precision fp8"),
        (
            "llama_gqa",
            "--precision fp8 --remat full --optimizer sgd --momentum 0.9",
        ),
        (
            "llama_tied",
            "--precision fp8 --remat selective --grad-accum 2",
        ),
        // Delayed scaling: the scales and histories written back after every micro-batch.
        (
            "gpt2_lm",
            "--precision fp8:delayed --amax-history 2 --grad-accum 2",
        ),
        (
            "llama_gqa",
            "--precision fp8:delayed --amax-history 4 --remat full",
        ),
    ] {
        rows.push(compare_training(family, flags, &mut failures));
    }
    for r in &rows {
        println!("{r}");
    }
    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn gpt2_training_plans_match_the_cpu_executor() {
    family_matrix("gpt2_lm");
}

#[test]
fn bert_training_plans_match_the_cpu_executor() {
    family_matrix("bert_mlm");
}

#[test]
fn llama_training_plans_match_the_cpu_executor() {
    family_matrix("llama_gqa");
}

#[test]
fn tied_llama_training_plans_match_the_cpu_executor() {
    family_matrix("llama_tied");
}

#[test]
fn qwen2_training_plans_match_the_cpu_executor() {
    family_matrix("qwen2_bias");
}

#[test]
fn mistral_sliding_window_training_plans_match_the_cpu_executor() {
    family_matrix("mistral_window");
}

#[test]
fn gemma_training_plans_match_the_cpu_executor() {
    family_matrix("gemma_tiny");
}

#[test]
fn llama31_rope_scaling_training_plans_match_the_cpu_executor() {
    family_matrix("llama31_rope");
}

/// The sequence classifiers (BERT's pooler + classifier, with class ids and regression
/// targets; a decoder's score on each row's last token, LLaMA and Qwen2) under every precision,
/// with and without recomputation: bit-identical to the CPU executor.
#[test]
fn classifier_training_plans_match_the_cpu_executor() {
    let mut failures = Vec::new();
    for variant in ["bert_cls", "bert_reg", "llama_cls", "qwen2_cls"] {
        for precision in ["fp32", "tf32", "bf16", "fp16"] {
            for remat in ["none", "full"] {
                let flags = format!("--precision {precision} --remat {remat}");
                println!("{}", compare_training(variant, &flags, &mut failures));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `--residual low` (the residual stream in the low dtype) in every family, bf16 and fp16,
/// with and without recomputation: bit-identical to the CPU executor.
#[test]
fn low_residual_plans_match_the_cpu_executor() {
    let mut failures = Vec::new();
    for variant in ["gpt2_lm", "bert_mlm", "llama_gqa", "gemma_tiny"] {
        for precision in ["bf16", "fp16"] {
            for remat in ["none", "selective"] {
                let flags = format!("--precision {precision} --residual low --remat {remat}");
                println!("{}", compare_training(variant, &flags, &mut failures));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Packed plans (`--pack`: `position_ids`, rope at positions, attention within each
/// sequence) of GPT-2 and the LLaMA family, with the sliding window and LLaMA 3.1's rope
/// scaling, in F32 and BF16, with and without recomputation: bit-identical to the CPU executor.
#[test]
fn packed_training_plans_match_the_cpu_executor() {
    let mut failures = Vec::new();
    for variant in ["gpt2_lm", "llama_gqa", "mistral_window", "llama31_rope"] {
        for precision in ["fp32", "bf16"] {
            for remat in ["none", "full"] {
                let flags = format!("--pack --precision {precision} --remat {remat}");
                println!("{}", compare_training(variant, &flags, &mut failures));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Dropout plans (`--dropout config`: GPT-2's and BERT's embedding, attention-probability and
/// residual dropout, masks regenerated in the backward and by recomputation), in F32 and BF16,
/// with and without recomputation: bit-identical to the CPU executor.
#[test]
fn dropout_training_plans_match_the_cpu_executor() {
    let mut failures = Vec::new();
    for variant in ["gpt2_lm", "bert_mlm"] {
        for precision in ["fp32", "bf16"] {
            for remat in ["none", "full"] {
                let flags = format!("--dropout config --precision {precision} --remat {remat}");
                println!("{}", compare_training(variant, &flags, &mut failures));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn loss_scaler_and_optimizer_paths_match_the_cpu_executor() {
    let mut failures = Vec::new();
    for &(variant, flags) in EXTRA_PLANS {
        println!("{}", compare_training(variant, flags, &mut failures));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The slots the prologue writes (working copies derived from their masters): bound by the
/// program itself, as `CudaGraphRunner` skips them.
fn prologue_targets(program: &Program) -> Vec<usize> {
    use castor_runtime::cuda::program::{Arg, Command};
    program
        .prologue
        .iter()
        .filter_map(|c| match c {
            Command::Launch(l) => match l.args.get(1) {
                Some(Arg::Ptr(Place::Slot { slot, .. })) => Some(*slot),
                _ => None,
            },
            Command::Copy {
                dst: Place::Slot { slot, .. },
                ..
            } => Some(*slot),
            _ => None,
        })
        .collect()
}

/// Each family's compiled forward pass (`compile --emit ir`) under every precision, run as
/// `CudaGraphRunner` runs a graph (parameters bound, working copies made by the prologue).
#[test]
fn forward_passes_match_the_cpu_executor() {
    let mut rows = Vec::new();
    let variants = ["gpt2_lm", "bert_mlm", "llama_gqa", "llama_tied"];
    for variant in variants.into_iter().chain(NEW_DECODERS) {
        let params = load_params(variant);
        for precision in ["fp32", "bf16", "fp16"] {
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("forward.ir");
            let model = fixture(variant);
            let o = castor(&[
                "compile",
                path_str(&model),
                "--emit",
                "ir",
                "--precision",
                precision,
                "--attention",
                "eager",
                "-o",
                path_str(&out),
            ]);
            assert!(o.status.success(), "{}", stderr(&o));
            let g = castor_ir::text::parse(&std::fs::read_to_string(&out).unwrap()).unwrap();
            let data = batch(&g, 5);
            let bind = |n: &str| data.get(n).or_else(|| params.get(n));
            let want = CpuExecutor::new().run(&g, &bind).unwrap();
            let program = lower_graph(&g).unwrap();
            let mut emu = Emulator::new(&program);
            emu.set_poison(true);
            let derived = prologue_targets(&program);
            for (slot, s) in program.slots.iter().enumerate() {
                if matches!(s.kind, SlotKind::Bound(_)) && !derived.contains(&slot) {
                    let t = &params[&s.name];
                    let bytes = castor_runtime::cuda::runner::to_bytes(t);
                    emu.write_slot(slot, &bytes).unwrap();
                }
            }
            emu.run_prologue().unwrap();
            write_inputs(&mut emu, &program, 0, &data);
            emu.run(0)
                .unwrap_or_else(|e| panic!("{variant} {precision}: {e}"));
            emu.check_flags(0).unwrap();
            for (o, w) in program.runs[0].outputs.iter().zip(&want) {
                let bytes = emu
                    .read(o.place, o.ty.size_bytes().unwrap_or(0) as u64)
                    .unwrap();
                let got = from_bytes(&o.ty, &bytes).unwrap();
                rows.push(format!(
                    "{variant:<10} {precision:<5} %{:<12} equal",
                    o.name
                ));
                if let Some((i, a, b)) = first_difference(&as_f32(&got), &as_f32(w)) {
                    panic!(
                        "{variant} {precision} %{}: element {i} is {a:e}, the CPU's {b:e}",
                        o.name
                    );
                }
            }
        }
    }
    for r in rows {
        println!("{r}");
    }
}

/// The emulator catches lowering bugs: a kernel whose result is never made (a read of
/// poisoned arena bytes), a buffer placed past the arena, and an output placed over an
/// operand the kernel may not update in place.
#[test]
fn seeded_lowering_bugs_are_caught() {
    use castor_runtime::cuda::program::{Arg, Command};
    let p = plan("gpt2_lm", &["--precision", "bf16"]);
    let params = load_params("gpt2_lm");
    let good = lower_plan(&p).unwrap();
    let step = |program: Program| -> Result<StepReport, String> {
        let mut r =
            EmulatedPlanRunner::with_program(p.clone(), program, &|n| params.get(n).cloned())
                .map_err(|e| e.to_string())?;
        r.step(&[batch(&p.micro_step, 1)], 1e-3)
            .map_err(|e| e.to_string())
    };
    step(good.clone()).unwrap();
    let micro = good.run(MICRO_STEP).unwrap();
    let is_norm =
        |c: &Command| matches!(c, Command::Launch(l) if l.entry.starts_with("layer_norm_fwd"));
    let i = good.runs[micro].commands.iter().position(is_norm).unwrap();
    // 1. The token embedding's launch dropped: its output is read unwritten. (An early one:
    // a later launch's output may land on arena bytes a dead value wrote earlier this run.)
    let first = good.runs[micro]
        .commands
        .iter()
        .position(|c| matches!(c, Command::Launch(l) if l.entry.starts_with("embedding_fwd")))
        .unwrap();
    let mut bad = good.clone();
    bad.runs[micro].commands.remove(first);
    let e = step(bad).unwrap_err();
    assert!(e.contains("no earlier command of this run wrote"), "{e}");
    // 2. Its output placed past the end of the arena.
    let mut bad = good.clone();
    let arena = bad.arena_bytes;
    // (The forward's arguments: x, x_low, res, sum_out, w, b, y, ...)
    if let Command::Launch(l) = &mut bad.runs[micro].commands[i] {
        l.args[6] = Arg::Ptr(Place::Arena {
            offset: arena - 256,
        });
    }
    let e = step(bad).unwrap_err();
    assert!(e.contains("`y`") && e.contains("out of bounds"), "{e}");
    // 3. Its bf16 output placed over its f32 input (in place only with equal dtypes).
    let mut bad = good.clone();
    if let Command::Launch(l) = &mut bad.runs[micro].commands[i] {
        assert_eq!(l.entry, "layer_norm_fwd_f32_bf16");
        l.args[6] = l.args[0].clone();
    }
    let e = step(bad).unwrap_err();
    assert!(e.contains("overlaps"), "{e}");
    println!("caught: {e}");
}

/// The state comparison the GPU test uses leaves out what is zero in exact arithmetic: the
/// attention key biases' gradients are rounding noise (and AdamW turns noise into full-size
/// updates of those slices), which another summation order rounds differently. Checked here
/// on the CPU executor's own state with such noise injected, and with a real error elsewhere.
#[test]
fn state_comparison_leaves_out_exact_zero_noise_only() {
    let variant = "gpt2_lm";
    let noise = exact_zero_slices(variant);
    let bias = "transformer.h.0.attn.c_attn.bias";
    let &(lo, hi) = noise.get(bias).expect("the fixture lists the key bias");
    let params = load_params(variant);
    let p = plan(variant, &["--precision", "fp32"]);
    let mut cpu = PlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
    cpu.step(&[batch(&p.micro_step, 3)], 1e-3).unwrap();
    let state: HashMap<String, Tensor> = cpu
        .state_entries()
        .into_iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    let perturb = |name: &str, at: usize, by: f32| {
        let t = &state[name];
        let mut v = as_f32(t);
        v[at] += by;
        Tensor::from_f32(t.dtype(), t.shape().clone(), v)
    };
    let check = |name: &str, got: &Tensor| {
        let mut failures = Vec::new();
        let bounds = Bounds {
            tol: 1e-4,
            noise: 1e-5,
            raised: HashMap::new(),
        };
        compare_state(
            "case",
            name,
            got,
            &state[name],
            &noise,
            &bounds,
            &mut failures,
        );
        failures
    };
    // Noise in the key bias's gradient slice, and a full-size moment there: left out.
    let grad = format!("grad.{bias}");
    assert!(check(&grad, &perturb(&grad, lo, 3e-8)).is_empty());
    let moment = format!("adamw.m.{bias}");
    assert!(check(&moment, &perturb(&moment, hi - 1, 0.5)).is_empty());
    // A gradient there that is not noise, and an error outside the slice: reported.
    assert!(!check(&grad, &perturb(&grad, lo, 1e-3)).is_empty());
    assert!(!check(&moment, &perturb(&moment, hi, 0.5)).is_empty());
}
