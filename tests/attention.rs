//! The fused `attention` op against the graph it replaces (`matmul`, `scale`, masked
//! `softmax`, `matmul`), on the CPU executor, forward and backward (the autodiff pass's
//! `attention_grad` against the unfused ops' VJPs), with grouped-query broadcasting, causal
//! and padding masks, and a row with no visible key (uniform, with PyTorch's gradient).
//!
//! In F32 the two agree to 1e-5 (they differ only in where scores are rounded: the fused op
//! sums `q·k` in F64 and scales once, the unfused graph rounds the product and then the
//! scaled value). In BF16 the fused op is more accurate than the unfused graph, which rounds
//! the scores and probabilities to BF16: its error against the F32 result is no larger.

use crate::common;

use castor_ir::{relative_error, text, DType, Graph, Tensor};
use castor_passes::{Autodiff, Pass};
use castor_runtime::cpu::CpuExecutor;
use std::collections::HashMap;

const Q: &str = "2,2,2,5,8";
const K: &str = "2,2,1,7,8";
const V: &str = "2,2,1,7,6";
const Y: &str = "2,2,2,5,6";
const SCORES: &str = "2,2,2,5,7";

/// Batch 0 sees every key; in batch 1 key 0..2 are padding, so query row 0 (which sees keys
/// 0..=2 under the causal mask with S - T = 2) sees none.
const MASK: [bool; 14] = [
    true, true, true, true, true, true, true, //
    false, false, false, true, true, true, true,
];

fn fused(t: &str, scale: f64) -> String {
    format!(
        "graph fused {{\n  %q: {t}[{Q}] = param\n  %k: {t}[{K}] = param\n  %v: {t}[{V}] = param\n  %m: bool[2,1,1,1,7] = input\n  %y: {t}[{Y}], %lse: f32[2,2,2,5] = attention(%q, %k, %v, %m) {{causal=true, scale={scale}}}\n{}}}\n",
        loss(t)
    )
}

fn unfused(t: &str, scale: f64) -> String {
    format!(
        "graph unfused {{\n  %q: {t}[{Q}] = param\n  %k: {t}[{K}] = param\n  %v: {t}[{V}] = param\n  %m: bool[2,1,1,1,7] = input\n  %s: {t}[{SCORES}] = matmul(%q, %k) {{transpose_a=false, transpose_b=true}}\n  %ss: {t}[{SCORES}] = scale(%s) {{factor={scale}}}\n  %p: {t}[{SCORES}] = softmax(%ss, %m) {{causal=true}}\n  %y: {t}[{Y}] = matmul(%p, %v) {{transpose_a=false, transpose_b=false}}\n{}}}\n",
        loss(t)
    )
}

/// `loss = sum(f32(y) * r)`, so every output element has its own gradient.
fn loss(t: &str) -> String {
    let cast = if t == "f32" {
        "  %yf: f32[2,2,2,5,6] = scale(%y) {factor=1.0}\n".to_string()
    } else {
        format!("  %yf: f32[{Y}] = cast(%y) {{to=f32}}\n")
    };
    format!(
        "{cast}  %r: f32[{Y}] = input\n  %yr: f32[{Y}] = mul(%yf, %r)\n  %loss: f32[] = sum(%yr) {{axes=[0,1,2,3,4], keepdim=false}}\n  return %loss, %y\n"
    )
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// The loss's output `y` and the gradients of q, k and v, in F32.
fn run(src: &str, dtype: DType) -> Vec<Vec<f32>> {
    run_keyed(src, dtype, [0, -1])
}

/// [`run`] with the graph input `key` (a dropout key, where the graph reads one).
fn run_keyed(src: &str, dtype: DType, key: [i64; 2]) -> Vec<Vec<f32>> {
    let g: Graph = text::parse(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    castor_ir::verify(&g).unwrap();
    let (back, _) = Autodiff::default().run(&g).unwrap();
    let mut b: HashMap<String, Tensor> = HashMap::new();
    for (i, name) in ["q", "k", "v"].iter().enumerate() {
        let v = g.lookup(name).unwrap();
        let shape = g.ty(v).shape.clone();
        let n = shape.numel().unwrap();
        b.insert(
            name.to_string(),
            Tensor::from_f32(dtype, shape, values(n, 11 + i as u64)),
        );
    }
    b.insert(
        "m".into(),
        Tensor::from_bool([2, 1, 1, 1, 7], MASK.to_vec()),
    );
    let n: usize = 2 * 2 * 2 * 5 * 6;
    b.insert(
        "r".into(),
        Tensor::from_f32(DType::F32, [2, 2, 2, 5, 6], values(n, 99)),
    );
    b.insert(
        "key".into(),
        Tensor::from_i64(DType::I64, [2], key.to_vec()),
    );
    let cpu = CpuExecutor::new();
    let y = cpu.run(&g, &|n| b.get(n)).unwrap()[1].clone();
    let grads = cpu.run(&back, &|n| b.get(n)).unwrap();
    let f32s = |t: &Tensor| t.as_f32().unwrap().to_vec();
    // Backward outputs: the loss, then grad.q, grad.k, grad.v in parameter order.
    vec![f32s(&y), f32s(&grads[1]), f32s(&grads[2]), f32s(&grads[3])]
}

const WHAT: [&str; 4] = ["y", "dq", "dk", "dv"];

/// The fused op with dropout on its probabilities (`dropout=P, stream=3`, the key last).
fn fused_dropout(t: &str, scale: f64, p: f64) -> String {
    format!(
        "graph fused {{\n  %q: {t}[{Q}] = param\n  %k: {t}[{K}] = param\n  %v: {t}[{V}] = param\n  %m: bool[2,1,1,1,7] = input\n  %key: i64[2] = input\n  %y: {t}[{Y}], %lse: f32[2,2,2,5] = attention(%q, %k, %v, %m, %key) {{causal=true, scale={scale}, dropout={p}, stream=3}}\n{}}}\n",
        loss(t)
    )
}

/// The eager attention with a `dropout` node (the same p and stream) on its probabilities.
fn unfused_dropout(t: &str, scale: f64, p: f64) -> String {
    format!(
        "graph unfused {{\n  %q: {t}[{Q}] = param\n  %k: {t}[{K}] = param\n  %v: {t}[{V}] = param\n  %m: bool[2,1,1,1,7] = input\n  %key: i64[2] = input\n  %s: {t}[{SCORES}] = matmul(%q, %k) {{transpose_a=false, transpose_b=true}}\n  %ss: {t}[{SCORES}] = scale(%s) {{factor={scale}}}\n  %p: {t}[{SCORES}] = softmax(%ss, %m) {{causal=true}}\n  %pd: {t}[{SCORES}] = dropout(%p, %key) {{p={p}, stream=3}}\n  %y: {t}[{Y}] = matmul(%pd, %v) {{transpose_a=false, transpose_b=false}}\n{}}}\n",
        loss(t)
    )
}

/// Dropout inside the fused op against the eager softmax, dropout node, product (same p, key
/// and stream), forward and backward, in F32: within 1e-5, the unfused comparison's bound (the
/// two differ only in where scores are rounded, and the fused op scales `Σ p v / l` by
/// 1 / (1 - p) in F64 where the eager graph scales each probability in F32). A mask that
/// differed in one entry would move its row by that probability's share, far past 1e-5 (the
/// next test checks the entries themselves). Two keys and two probabilities.
#[test]
fn fused_attention_dropout_matches_the_eager_dropout_graph_in_f32() {
    let scale = 1.0 / 8f64.sqrt();
    for (p, key) in [(0.1, [5, 0]), (0.1, [5, 1]), (0.5, [123, 7])] {
        let a = run_keyed(&fused_dropout("f32", scale, p), DType::F32, key);
        let b = run_keyed(&unfused_dropout("f32", scale, p), DType::F32, key);
        let plain = run(&fused("f32", scale), DType::F32);
        for (i, what) in WHAT.iter().enumerate() {
            let err = relative_error(&a[i], &b[i]);
            let moved = relative_error(&a[i], &plain[i]);
            println!(
                "p={p} key={key:?} {what}: fused vs eager {err:.2e} (vs no dropout {moved:.2e})"
            );
            assert!(err < 1e-5, "p={p} {what}: relative error {err:.3e}");
            assert!(
                moved > 1e-2,
                "p={p} {what}: dropout changed nothing ({moved:.1e})"
            );
        }
    }
}

/// Which probabilities the fused op drops, read off its output: with `v` the identity over the
/// keys, `o` is the dropped and scaled probabilities themselves, so its zeros are the dropped
/// entries (and the masked ones); they are exactly the zeros of the eager graph's dropout
/// output, and exactly the entries `castor_ir::philox::dropout_mask` drops for a
/// `[2, 2, 2, 5, 7]` tensor under that key and stream, row-major.
#[test]
fn fused_attention_drops_the_entries_a_dropout_node_drops() {
    use castor_ir::philox::dropout_mask;
    let (p, key, stream) = (0.3, [77i64, 4i64], 3u32);
    let ident: Vec<f32> = (0..2 * 2 * 7 * 7)
        .map(|i| if (i % 49) / 7 == i % 7 { 1.0 } else { 0.0 })
        .collect();
    let graph = |fused: bool| {
        let core = if fused {
            "  %o: f32[2,2,2,5,7], %lse: f32[2,2,2,5] = attention(%q, %k, %v, %key) {causal=true, scale=0.25, dropout=0.3, stream=3}
  return %o
".to_string()
        } else {
            "  %s: f32[2,2,2,5,7] = matmul(%q, %k) {transpose_a=false, transpose_b=true}
  %ss: f32[2,2,2,5,7] = scale(%s) {factor=0.25}
  %p: f32[2,2,2,5,7] = softmax(%ss) {causal=true}
  %pd: f32[2,2,2,5,7] = dropout(%p, %key) {p=0.3, stream=3}
  return %pd
"
            .to_string()
        };
        format!(
            "graph g {{
  %q: f32[{Q}] = input
  %k: f32[{K}] = input
  %v: f32[2,2,1,7,7] = input
  %key: i64[2] = input
{core}}}
"
        )
    };
    let mut b: HashMap<String, Tensor> = HashMap::new();
    b.insert(
        "q".into(),
        Tensor::from_f32(DType::F32, [2, 2, 2, 5, 8], values(320, 11)),
    );
    b.insert(
        "k".into(),
        Tensor::from_f32(DType::F32, [2, 2, 1, 7, 8], values(224, 12)),
    );
    b.insert(
        "v".into(),
        Tensor::from_f32(DType::F32, [2, 2, 1, 7, 7], ident),
    );
    b.insert(
        "key".into(),
        Tensor::from_i64(DType::I64, [2], key.to_vec()),
    );
    let zeros = |fused: bool| -> Vec<bool> {
        let g = text::parse(&graph(fused)).unwrap();
        let out = CpuExecutor::new().run(&g, &|n| b.get(n)).unwrap();
        out[0].as_f32().unwrap().iter().map(|&x| x == 0.0).collect()
    };
    let (fused, eager) = (zeros(true), zeros(false));
    assert_eq!(fused, eager);
    // Causal with 5 queries over 7 keys: query i sees keys 0..=i + 2; the others are masked.
    let dropped = dropout_mask(key, stream, p, fused.len());
    let mut count = 0;
    for (i, &z) in fused.iter().enumerate() {
        let (row, j) = (i / 7 % 5, i % 7);
        let visible = j <= row + 2;
        assert_eq!(z, !visible || !dropped[i], "element {i}");
        count += usize::from(visible && !dropped[i]);
    }
    println!("{count} of {} probabilities dropped", fused.len());
    assert!(count > 0);
}

/// Evaluation mode (a negative key offset): the fused op with dropout is the op without it, bit
/// for bit, forward and backward.
#[test]
fn fused_attention_dropout_in_evaluation_mode_is_no_dropout() {
    let scale = 1.0 / 8f64.sqrt();
    for (t, dtype) in [("f32", DType::F32), ("bf16", DType::BF16)] {
        let a = run_keyed(&fused_dropout(t, scale, 0.1), dtype, [5, -1]);
        let b = run(&fused(t, scale), dtype);
        for (i, what) in WHAT.iter().enumerate() {
            let same = a[i]
                .iter()
                .zip(&b[i])
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{t} {what} differs");
        }
    }
}

#[test]
fn fused_attention_matches_the_unfused_graph_in_f32() {
    let scale = 1.0 / 8f64.sqrt();
    let (a, b) = (
        run(&fused("f32", scale), DType::F32),
        run(&unfused("f32", scale), DType::F32),
    );
    for (i, what) in WHAT.iter().enumerate() {
        let err = relative_error(&a[i], &b[i]);
        println!("{what}: fused vs unfused {err:.2e}");
        assert!(err < 1e-5, "{what}: relative error {err:.3e}");
    }
}

#[test]
fn fused_attention_in_bf16_is_no_less_accurate_than_the_unfused_graph() {
    let scale = 1.0 / 8f64.sqrt();
    let reference = run(&fused("f32", scale), DType::F32);
    let a = run(&fused("bf16", scale), DType::BF16);
    let b = run(&unfused("bf16", scale), DType::BF16);
    for (i, what) in WHAT.iter().enumerate() {
        let (ea, eb) = (
            relative_error(&a[i], &reference[i]),
            relative_error(&b[i], &reference[i]),
        );
        println!("{what}: bf16 error fused {ea:.2e}, unfused {eb:.2e}");
        assert!(ea <= eb, "{what}: fused {ea:.3e} vs unfused {eb:.3e}");
    }
}

/// The fused op's CUDA program (the attention kernels, `castor_runtime::cuda::families::attention::geometry`'s launch
/// shapes) on the emulator beside the CPU executor, forward and backward, in F32, BF16 and F16:
/// the loss and the gradients of q, k and v. The kernels sum in other orders than the CPU twin
/// (see `attention.cu`), so the bound is their documented one: the kernel tests' measured worst
/// without a window (1.6e-7 F32, 7.9e-5 F16, 2.3e-4 BF16 relative) with a margin, here 3e-7,
/// 2e-4 and 6e-4.
#[test]
fn fused_attention_runs_as_the_cuda_program_on_the_emulator() {
    use castor_runtime::cuda::emulate::Emulator;
    use castor_runtime::cuda::lower::lower_graph;
    use castor_runtime::cuda::program::SlotKind;
    use castor_runtime::cuda::runner::{from_bytes, input_bytes, to_bytes};
    const V8: &str = "2,2,1,7,8";
    const Y8: &str = "2,2,2,5,8";
    let scale = 1.0 / 8f64.sqrt();
    for (t, dtype, bound) in [
        ("f32", DType::F32, 3e-7),
        ("f16", DType::F16, 2e-4),
        ("bf16", DType::BF16, 6e-4),
    ] {
        let cast = if t == "f32" {
            format!("  %yf: f32[{Y8}] = scale(%y) {{factor=1.0}}\n")
        } else {
            format!("  %yf: f32[{Y8}] = cast(%y) {{to=f32}}\n")
        };
        let src = format!(
            "graph fused {{\n  %q: {t}[{Q}] = param\n  %k: {t}[{K}] = param\n  %v: {t}[{V8}] = param\n  %m: bool[2,1,1,1,7] = input\n  %y: {t}[{Y8}], %lse: f32[2,2,2,5] = attention(%q, %k, %v, %m) {{causal=true, scale={scale}}}\n{cast}  %r: f32[{Y8}] = input\n  %yr: f32[{Y8}] = mul(%yf, %r)\n  %loss: f32[] = sum(%yr) {{axes=[0,1,2,3,4], keepdim=false}}\n  return %loss\n}}\n"
        );
        let g: Graph = text::parse(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
        let (back, _) = Autodiff::default().run(&g).unwrap();
        let mut b: HashMap<String, Tensor> = HashMap::new();
        for (i, name) in ["q", "k", "v"].iter().enumerate() {
            let shape = g.ty(g.lookup(name).unwrap()).shape.clone();
            let n = shape.numel().unwrap();
            b.insert(
                name.to_string(),
                Tensor::from_f32(dtype, shape, values(n, 11 + i as u64)),
            );
        }
        b.insert(
            "m".into(),
            Tensor::from_bool([2, 1, 1, 1, 7], MASK.to_vec()),
        );
        b.insert(
            "r".into(),
            Tensor::from_f32(DType::F32, [2, 2, 2, 5, 8], values(2 * 2 * 2 * 5 * 8, 99)),
        );
        let want = CpuExecutor::new().run(&back, &|n| b.get(n)).unwrap();

        let program = lower_graph(&back).unwrap_or_else(|e| panic!("{t}: {e}"));
        let mut emu = Emulator::new(&program);
        emu.set_poison(true);
        for (slot, s) in program.slots.iter().enumerate() {
            if matches!(s.kind, SlotKind::Bound(_)) {
                emu.write_slot(slot, &to_bytes(&b[&s.name])).unwrap();
            }
        }
        emu.run_prologue().unwrap();
        for (slot, bytes) in input_bytes(&program, 0, &b).unwrap() {
            emu.write_slot(slot, &bytes).unwrap();
        }
        emu.run(0).unwrap_or_else(|e| panic!("{t}: {e}"));
        emu.check_flags(0).unwrap();
        for (o, w) in program.runs[0].outputs.iter().zip(&want) {
            let bytes = emu
                .read(o.place, o.ty.size_bytes().unwrap_or(0) as u64)
                .unwrap();
            let got = from_bytes(&o.ty, &bytes).unwrap();
            let err = relative_error(got.as_f32().unwrap(), w.as_f32().unwrap());
            println!("{t} %{}: emulated vs CPU {err:.2e}", o.name);
            assert!(err <= bound, "{t} %{}: relative error {err:.3e}", o.name);
        }
    }
}

/// Every family's training plan with `--attention fused`, three steps on the emulator (the
/// CUDA program: the attention kernels, cuBLAS products as the CPU's) beside the CPU executor.
/// Everything but the attention kernels is bit-identical (tests/cuda_emulated.rs); these
/// differ as the kernel tests bound (a few F32 ulps before a rounding: the kernels' softmax
/// folds the scale into one fused multiply-add before exp2, the twin rounds the scaled score,
/// then exp's argument), and three AdamW steps carry that into the weights, more where a
/// 16-bit rounding downstream lands one unit apart: in BF16 one flipped rounding of an
/// attention output (2 of GPT-2's 1024 in the second layer of the first step) moves the tiny
/// fixtures' gradients by about 5e-3. Measured worst (loss, state entry): fp32 9.2e-8, 3.3e-5;
/// tf32 3.2e-5, 3.0e-3; bf16 4.7e-4, 2.7e-2; fp16 1.7e-4, 9.6e-3. Bounds, about 2x those:
/// see `bounds`. Slices that are zero in exact arithmetic (the key biases' gradients:
/// rounding noise on both sides, ~1e-4 in BF16) are left out.
/// Key biases (Qwen2's `k_proj.bias`) get a gradient only through the rotary rotation: the
/// softmax's gradient sums to zero over each row's keys, and the rotation's angles are small
/// at the low frequencies, so most of the gradient cancels and AdamW's `g / sqrt(v)` carries
/// the kernels' summation noise at its own size. Measured 3.3e-5 in fp32; bounded at 1e-4.
const CANCELLING_STATE_BOUND: f64 = 1e-4;

fn bounds(precision: &str) -> (f64, f64) {
    match precision {
        "fp32" => (1e-6, 1e-5),
        "tf32" => (1e-4, 6e-3),
        "bf16" => (1e-3, 6e-2),
        _ => (5e-4, 2e-2),
    }
}

#[test]
fn fused_attention_training_plans_on_the_emulator_stay_within_bounds() {
    let mut failures = Vec::new();
    let variants = ["gpt2_lm", "bert_mlm", "llama_gqa", "llama_tied"];
    for variant in variants.into_iter().chain(common::NEW_DECODERS) {
        for precision in ["fp32", "tf32", "bf16", "fp16"] {
            let bounds = bounds(precision);
            fused_plan_within_bounds(variant, precision, &[], bounds, &mut failures);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Packed plans (`--pack`: each row holds several sequences, `position_ids` restarting at
/// each) with `--attention fused`: castor's attention kernels take the positions, each query
/// seeing only its own sequence, beside the CPU executor. GPT-2 and the LLaMA family (grouped
/// heads, Mistral's sliding window, LLaMA 3.1's rope scaling), in F32 and BF16, within the
/// bounds above but for F32's state: an element whose gradient lies within AdamW's epsilon
/// (1e-8) of zero takes a first update of lr g / (|g| + eps), which the kernels' F32 noise
/// moves by a fraction of lr (LLaMA-GQA's first `up_proj`: one gradient of 1.5e-9 on the CPU
/// and 5.2e-9 here, where the tensor's are about 1e-2, moves its weight by 0.2 lr), and the
/// next steps carry that into every entry. Measured worst (loss, state entry): fp32 6.1e-7,
/// 2.8e-5 (that run); bf16 0, 1.8e-5. F32's state bound is 6e-5.
#[test]
fn packed_fused_attention_training_plans_on_the_emulator_stay_within_bounds() {
    let mut failures = Vec::new();
    for variant in ["gpt2_lm", "llama_gqa", "mistral_window", "llama31_rope"] {
        for precision in ["fp32", "bf16"] {
            let (loss, state) = bounds(precision);
            let state = if precision == "fp32" { 6e-5 } else { state };
            let flags = ["--pack"];
            fused_plan_within_bounds(variant, precision, &flags, (loss, state), &mut failures);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Plans with attention dropout in the fused op (`--attention fused`, castor's `_dropout`
/// kernels): GPT-2 with `--dropout config` (its `attn_pdrop` in the op, and its other dropout
/// nodes) and LLaMA-GQA with `--dropout 0.1` (grouped heads), F32 and BF16, with and without
/// recomputation (a recomputed attention regenerates the same mask from the same key and
/// stream), on the emulator beside the CPU executor, within the fused plans' bounds above:
/// the kernels drop exactly the CPU executor's entries (a different mask would move the loss
/// by percents), and differ from it only as the kernels without dropout do.
#[test]
fn fused_attention_dropout_plans_on_the_emulator_stay_within_bounds() {
    let mut failures = Vec::new();
    for (variant, dropout) in [("gpt2_lm", "config"), ("llama_gqa", "0.1")] {
        for precision in ["fp32", "bf16"] {
            for remat in ["none", "full"] {
                let flags = ["--dropout", dropout, "--remat", remat];
                let bounds = bounds(precision);
                fused_plan_within_bounds(variant, precision, &flags, bounds, &mut failures);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Three steps of `variant`'s plan with `--attention fused` and `extra` flags, on the emulator
/// beside the CPU executor: the loss and every state entry within `(loss_bound, state_bound)`;
/// disagreements are pushed to `failures`.
fn fused_plan_within_bounds(
    variant: &str,
    precision: &str,
    extra: &[&str],
    (loss_bound, state_bound): (f64, f64),
    failures: &mut Vec<String>,
) {
    use castor_runtime::cuda::EmulatedPlanRunner;
    use castor_runtime::PlanRunner;
    use common::cuda_cases::{
        as_f32, batch, exact_zero_slices, load_params, mask_exact_zero, plan, state_error,
    };
    let params = load_params(variant);
    let noise = exact_zero_slices(variant);
    let mut flags = vec!["--precision", precision, "--attention", "fused"];
    flags.extend_from_slice(extra);
    let p = plan(variant, &flags);
    let case = format!("{variant} {}", flags[1..].join(" "));
    let mut cpu = PlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
    let mut emu = EmulatedPlanRunner::new(p.clone(), &|n| params.get(n).cloned())
        .unwrap_or_else(|e| panic!("{case}: {e}"));
    let mut worst_loss = 0f64;
    for step in 0..3u64 {
        let batches = [batch(&p.micro_step, 77 + 10 * step)];
        let a = cpu.step(&batches, 1e-3).unwrap();
        let b = emu
            .step(&batches, 1e-3)
            .unwrap_or_else(|e| panic!("{case} step {step}: {e}"));
        let err = f64::from(((a.loss - b.loss) / a.loss).abs());
        worst_loss = worst_loss.max(err);
        if err.is_nan() || err > loss_bound {
            failures.push(format!("{case} step {step}: loss error {err:.3e}"));
        }
    }
    let emulated: HashMap<String, Tensor> = emu.state_entries().unwrap().into_iter().collect();
    let mut worst_state = 0f64;
    for (name, t) in cpu.state_entries() {
        let (mut x, mut y) = (as_f32(&emulated[name]), as_f32(t));
        mask_exact_zero(&noise, name, t.shape().dims(), &mut x, &mut y);
        let err = state_error(&x, &y);
        let bound = if name.contains("self_attn.k_proj.bias") {
            state_bound.max(CANCELLING_STATE_BOUND)
        } else {
            state_bound
        };
        if err.is_nan() || err > bound {
            failures.push(format!("{case}: state {name} error {err:.3e}"));
        }
        worst_state = worst_state.max(err);
    }
    println!("{case:<45} loss {worst_loss:.2e}, state {worst_state:.2e}");
}

/// GPT-2 124M (B=8, T=1024, bf16): with `--attention fused` no value of the training plan has
/// the `[.., T, T]` shape of a score or probability tensor (the eager plan has them in every
/// layer), the planned peak is lower (measured 9.08 GB eager, 6.82 GB fused), and the `cuda`
/// line's program roofline gives a higher MFU (measured 26.3% eager, 45.9% fused).
#[test]
fn fused_attention_plans_hold_no_score_tensor() {
    let peak_and_tt = |attention: &str| -> (u64, usize, f64) {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("plan.json");
        let report = common::compile_gpt2_124m(&[
            "--attention",
            attention,
            "--emit",
            "plan",
            "-o",
            common::path_str(&out),
        ]);
        let total = report
            .lines()
            .find(|l| l.trim_start().starts_with("total "))
            .and_then(|l| l.split_whitespace().nth(1))
            .map(|n| n.replace(',', "").parse::<u64>().unwrap())
            .unwrap_or_else(|| panic!("no total in:\n{report}"));
        let mfu = common::program_mfu(&report);
        let plan =
            castor_ir::TrainingPlan::from_json(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let g = &plan.micro_step;
        let tt = g
            .values()
            .filter(|&(v, _)| g.ty(v).shape.dims().ends_with(&[1024, 1024]))
            .count();
        (total, tt, mfu)
    };
    let (eager, eager_tt, eager_mfu) = peak_and_tt("eager");
    let (fused, fused_tt, fused_mfu) = peak_and_tt("fused");
    println!(
        "planned peak: eager {eager} ({eager_tt} [T, T] values, MFU {eager_mfu}%), fused \
         {fused} ({fused_tt}, MFU {fused_mfu}%)"
    );
    assert!(eager_tt > 0);
    assert_eq!(fused_tt, 0);
    assert!(fused < eager, "fused {fused} vs eager {eager}");
    assert!(
        fused_mfu > eager_mfu,
        "MFU fused {fused_mfu} vs eager {eager_mfu}"
    );
}

/// The cost line says which attention pairs a plan's FLOPs count, and the count holds it:
/// GPT-2 124M (B=8, T=1024, bf16) eager runs every `T x T` pair (12·L·C·T of products per
/// token, forward and backward), fused only the causal half (about 7·L·C·T: the backward
/// recomputes the scores), so the fused plan's contractions are at least 4·L·C·T per token
/// fewer. Were the fused count not halved it would be 14·L·C·T, more than eager's.
#[test]
fn the_flops_line_says_which_attention_pairs_it_counts() {
    let flops_line = |attention: &str| -> (String, String, f64) {
        let report = common::compile_gpt2_124m(&["--attention", attention]);
        let lines: Vec<&str> = report.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.trim_start().starts_with("FLOPs/token"))
            .unwrap_or_else(|| panic!("no FLOPs/token line in:\n{report}"));
        let contractions = lines[at]
            .split("(contractions ")
            .nth(1)
            .and_then(|r| r.split(',').next())
            .and_then(|n| n.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no contractions figure in {:?}", lines[at]));
        (
            lines[at].to_string(),
            lines[at + 1].to_string(),
            contractions,
        )
    };
    let (eager_line, eager_why, eager) = flops_line("eager");
    let (fused_line, fused_why, fused) = flops_line("fused");
    println!("{eager_line}\n{eager_why}\n{fused_line}\n{fused_why}");
    assert!(
        eager_why.contains("eager attention runs the full T x T products"),
        "{eager_why}"
    );
    assert!(
        fused_why.contains("fused attention computes only the (query, key) pairs its mask keeps"),
        "{fused_why}"
    );
    let lct = (12 * 768 * 1024) as f64 / 1e6; // L·C·T, MFLOP per token
    assert!(
        eager - fused >= 4.0 * lct,
        "contractions per token: eager {eager} MFLOP, fused {fused} MFLOP, L·C·T {lct}"
    );
}

/// The GPU test's attention cases (`ATTENTION_CASES`: head dim 64, grouped-query heads, a
/// padding mask or packed sequences' positions, 33 queries and 40 keys) on the emulator,
/// within the kernels' bounds, so the cases a GPU runs are known to lower and run.
#[test]
fn the_gpu_attention_case_runs_on_the_emulator() {
    use castor_runtime::cuda::emulate::Emulator;
    use castor_runtime::cuda::lower::lower_graph;
    use castor_runtime::cuda::runner::{from_bytes, input_bytes};
    use common::cuda_cases::{as_f32, case_graph, inputs, ATTENTION_CASES};
    for (name, body) in ATTENTION_CASES {
        for (t, bound) in [("f32", 3e-7), ("f16", 2e-4), ("bf16", 6e-4)] {
            let g = case_graph(name, body, t);
            let data = inputs(&g, 37, 0x5eed);
            let want = CpuExecutor::new().run(&g, &|n| data.get(n)).unwrap();
            let program = lower_graph(&g).unwrap();
            let mut emu = Emulator::new(&program);
            emu.set_poison(true);
            for (slot, bytes) in input_bytes(&program, 0, &data).unwrap() {
                emu.write_slot(slot, &bytes).unwrap();
            }
            emu.run_prologue().unwrap();
            emu.run(0).unwrap_or_else(|e| panic!("{name} {t}: {e}"));
            for (o, w) in program.runs[0].outputs.iter().zip(&want) {
                let bytes = emu
                    .read(o.place, o.ty.size_bytes().unwrap_or(0) as u64)
                    .unwrap();
                let got = from_bytes(&o.ty, &bytes).unwrap();
                let err = relative_error(&as_f32(&got), &as_f32(w));
                println!("{name} {t} %{}: {err:.2e}", o.name);
                assert!(err <= bound, "{name} {t} %{}: {err:.3e}", o.name);
            }
        }
    }
}

/// `--attention cudnn` on GPT-2 124M (B=8, T=1024, bf16): every layer's attention forward and
/// backward is one cuDNN command (24), each padding mask is cast to cuDNN's keep flags just
/// before its command, castor's attention kernels are gone, and no value of the plan has the
/// `[.., T, T]` shape of a score tensor.
#[test]
fn cudnn_attention_runs_every_layer_with_no_score_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("plan.json");
    let listing_path = dir.path().join("listing.txt");
    for (emit, path) in [("cuda", &listing_path), ("plan", &plan_path)] {
        let out = common::path_str(path);
        common::compile_gpt2_124m(&["--attention", "cudnn", "--emit", emit, "-o", out]);
    }
    let listing = std::fs::read_to_string(&listing_path).unwrap();
    let count = |needle: &str| listing.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(
        count("cudnn attention forward bf16 heads 12/12 rows 1024x1024 dim 64 causal"),
        12
    );
    assert_eq!(
        count("cudnn attention backward bf16 heads 12/12 rows 1024x1024 dim 64 causal"),
        12
    );
    // Each pass first computes cuDNN's sequence lengths from the padding mask.
    assert_eq!(count("first: launch attention_key_lengths"), 24);
    assert_eq!(count("(cuDNN required: no fallback)"), 24);
    // Each backward has its F32 dQ accumulator ([B, H, T, d]) in the arena, for the graph of
    // cuDNN's flash backward (CASTOR_CUDNN_NONDETERMINISTIC=1).
    let arena: u64 = listing
        .lines()
        .next()
        .and_then(|l| l.split("arena ").nth(1))
        .and_then(|l| l.split(' ').next())
        .unwrap()
        .parse()
        .unwrap();
    let accumulators: Vec<u64> = listing
        .lines()
        .filter(|l| l.contains("cudnn attention backward"))
        .map(|l| {
            let at = l.split("dq accum=a+").nth(1).unwrap();
            at.split([' ', ')']).next().unwrap().parse().unwrap()
        })
        .collect();
    assert_eq!(accumulators.len(), 12);
    let accum_bytes = 4 * 8 * 12 * 1024 * 64;
    assert!(accumulators.iter().all(|&at| at + accum_bytes <= arena));
    assert_eq!(
        count("launch attention_") - count("launch attention_key_lengths"),
        0,
        "castor's attention kernels are not run"
    );
    let plan =
        castor_ir::TrainingPlan::from_json(&std::fs::read_to_string(&plan_path).unwrap()).unwrap();
    let g = &plan.micro_step;
    assert!(g
        .values()
        .all(|(v, _)| !g.ty(v).shape.dims().ends_with(&[1024, 1024])));
    let ops = castor_ir::text::print(g);
    assert_eq!(
        ops.matches("library=cudnn").count(),
        24,
        "the IR says what runs each"
    );
}

/// Emulated `--attention cudnn` programs: the emulator has no cuDNN, so each cuDNN pass runs the
/// attention op's CPU twin on the command's tensors (through its strides, the mask as the
/// sequence lengths the program computes from it for cuDNN's graph): every family's program
/// then matches the CPU executor bit for bit, causal or not, right-padded, grouped-query and
/// windowed, in BF16 and F16. (This checks the lowering around cuDNN, not cuDNN's arithmetic,
/// which only a GPU runs.)
#[test]
fn cudnn_attention_plans_on_the_emulator_match_the_cpu_executor() {
    use castor_runtime::cuda::EmulatedPlanRunner;
    use castor_runtime::PlanRunner;
    use common::cuda_cases::{as_f32, batch, load_params, plan, right_padded};
    for variant in ["gpt2_lm", "bert_mlm", "llama_gqa", "qwen2_bias"] {
        let params = load_params(variant);
        for precision in ["bf16", "fp16"] {
            let p = plan(variant, &["--precision", precision, "--attention", "cudnn"]);
            let case = format!("{variant} {precision}");
            let mut cpu = PlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
            let mut emu = EmulatedPlanRunner::new(p.clone(), &|n| params.get(n).cloned())
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            for step in 0..2u64 {
                let batches = [right_padded(batch(&p.micro_step, 41 + 10 * step))];
                let a = cpu.step(&batches, 1e-3).unwrap();
                let b = emu
                    .step(&batches, 1e-3)
                    .unwrap_or_else(|e| panic!("{case} step {step}: {e}"));
                assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{case} step {step}");
            }
            let emulated: HashMap<String, Tensor> =
                emu.state_entries().unwrap().into_iter().collect();
            for (name, t) in cpu.state_entries() {
                let (x, y) = (as_f32(&emulated[name]), as_f32(t));
                assert!(
                    x.iter()
                        .zip(&y)
                        .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())),
                    "{case}: state {name} differs"
                );
            }
        }
    }
}

/// cuDNN's graphs take the padding mask as sequence lengths, so a mask with a hole, left
/// padding or a row that keeps no key is an error naming the row and the way out
/// (`--attention fused`) when cuDNN runs the pass; where castor's kernels run it (`auto` on
/// a machine without cuDNN, as the emulator is), the same batch trains.
#[test]
fn a_mask_cudnn_lengths_cannot_express_is_an_error_naming_the_row() {
    use castor_runtime::cuda::EmulatedPlanRunner;
    use common::cuda_cases::{batch, load_params, plan, right_padded};
    let params = load_params("gpt2_lm");
    let p = plan("gpt2_lm", &["--precision", "bf16", "--attention", "cudnn"]);
    let mut emu = EmulatedPlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
    let good = right_padded(batch(&p.micro_step, 41));
    let keys = *good["attention_mask"].shape().dims().last().unwrap();
    for (row, keep, problem) in [
        (0, vec![0; keys], "keeps no key".to_string()),
        (
            0,
            (0..keys).map(|j| i64::from(j != 2)).collect(),
            format!("keeps key {} after dropping an earlier one", keys - 1),
        ),
    ] {
        let mut b = good.clone();
        let t = &b["attention_mask"];
        let mut v = t.as_i64().unwrap().to_vec();
        v[row * keys..(row + 1) * keys].copy_from_slice(&keep);
        let t = Tensor::from_i64(t.dtype(), t.shape().clone(), v);
        b.insert("attention_mask".into(), t);
        let e = emu.step(&[b.clone()], 1e-3).unwrap_err().to_string();
        for want in [
            format!("row {row} {problem}"),
            "right padding".into(),
            "--attention fused".into(),
        ] {
            assert!(e.contains(&want), "{want}: {e}");
        }
        let auto = plan("gpt2_lm", &["--precision", "bf16", "--attention", "auto"]);
        let mut kernels = EmulatedPlanRunner::new(auto, &|n| params.get(n).cloned()).unwrap();
        kernels.step(&[b], 1e-3).unwrap();
    }
}

/// `castor compile <fixture> --train --emit cuda <flags>`: the training plan's CUDA listing.
fn emit_cuda(fixture: &str, flags: &[&str]) -> std::process::Output {
    let model = common::fixture(fixture);
    let mut args = vec![
        "compile",
        common::path_str(&model),
        "--train",
        "--emit",
        "cuda",
    ];
    args.extend_from_slice(flags);
    common::castor(&args)
}

/// What cuDNN cannot run: an F32 plan's attention (cuDNN takes F16 and BF16). Under
/// `--attention auto` castor's kernels run it and the listing says why; `--attention cudnn`
/// refuses the plan, naming the node and the reason.
#[test]
fn what_cudnn_cannot_run_falls_back_or_is_refused_by_name() {
    let compile = |attention: &str| {
        emit_cuda(
            "gpt2_lm",
            &["--precision", "fp32", "--attention", attention],
        )
    };
    let o = compile("auto");
    assert!(o.status.success(), "{}", common::stderr(&o));
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(
        listing.contains(
            "cuDNN cannot run it (f32 operands (cuDNN's fused attention takes f16 and bf16)); \
             castor's kernels:"
        ),
        "{listing}"
    );
    assert!(listing.contains("launch attention_fwd_f32"));
    let o = compile("cudnn");
    assert!(!o.status.success());
    let err = common::stderr(&o);
    assert!(
        err.contains("%h.0.attn.context")
            && err.contains(
                "--attention cudnn: cuDNN's fused attention cannot run this op: f32 operands"
            ),
        "{err}"
    );
}

/// A sliding window (Mistral's): cuDNN's windowed graphs gave an H200 gradients the CPU
/// executor does not, so `--attention auto` runs castor's kernels, the listing saying why,
/// and `--attention cudnn` refuses the plan naming the node and the window.
#[test]
fn a_sliding_window_runs_castors_kernels_and_cudnn_refuses_it() {
    let compile = |attention: &str| {
        emit_cuda(
            "mistral_window",
            &["--precision", "bf16", "--attention", attention],
        )
    };
    let o = compile("auto");
    assert!(o.status.success(), "{}", common::stderr(&o));
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(
        listing.contains("cuDNN cannot run it (a sliding window of 3 keys"),
        "{listing}"
    );
    assert!(listing.contains("launch attention_fwd_bf16"), "{listing}");
    let o = compile("cudnn");
    assert!(!o.status.success());
    let err = common::stderr(&o);
    assert!(
        err.contains("self_attn.context")
            && err.contains(
                "--attention cudnn: cuDNN's fused attention cannot run this op: a sliding window \
                 of 3 keys"
            ),
        "{err}"
    );
}

/// `CASTOR_CUDNN_WINDOWS=1` lets cuDNN run Mistral's sliding window, for the GPU check's test
/// of the windowed graphs (their backward now masks the band after the log-sum-exp): the
/// `--attention cudnn` listing then runs every attention pass on cuDNN with the window, and
/// the emulated program (the twin in place of cuDNN) trains as the CPU executor does, losses
/// and saved weights equal; any other value than 0 or 1 is an error naming the variable.
#[test]
fn the_windows_switch_lets_cudnn_run_a_sliding_window() {
    use std::process::Command;
    let model = common::fixture("mistral_window");
    let castor = |switch: &str, args: &[&str]| {
        Command::new(common::castor_bin())
            .args(args)
            .env(castor_runtime::cuda::sdpa::WINDOWS_ENV, switch)
            .output()
            .expect("the castor binary runs")
    };
    let emit = [
        "compile",
        common::path_str(&model),
        "--train",
        "--emit",
        "cuda",
        "--precision",
        "bf16",
        "--attention",
        "cudnn",
    ];
    let o = castor("1", &emit);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let listing = String::from_utf8_lossy(&o.stdout);
    let layers = 2;
    for pass in ["forward", "backward"] {
        let runs = listing
            .lines()
            .filter(|l| l.contains(&format!("cudnn attention {pass}")) && l.contains("window 3"))
            .count();
        assert_eq!(runs, layers, "{pass}: {listing}");
    }
    for kernel in ["launch attention_fwd", "launch attention_bwd"] {
        assert!(!listing.contains(kernel), "{kernel}: {listing}");
    }
    let o = castor("yes", &emit);
    assert!(!o.status.success());
    let err = common::stderr(&o);
    assert!(
        err.contains("CASTOR_CUDNN_WINDOWS=yes: expected 0 or 1"),
        "{err}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for device in ["cpu", "emulate"] {
        let (log, save) = (
            tmp.path().join(format!("{device}.jsonl")),
            tmp.path().join(device),
        );
        let o = castor(
            "1",
            &[
                "train",
                common::path_str(&model),
                "--data",
                common::path_str(&model.join("input.safetensors")),
                "--steps",
                "2",
                "--precision",
                "bf16",
                "--attention",
                "cudnn",
                "--device",
                device,
                "--log",
                common::path_str(&log),
                "--save",
                common::path_str(&save),
            ],
        );
        assert!(o.status.success(), "{device}: {}", common::stderr(&o));
        runs.push((
            common::log_losses(&log),
            std::fs::read(save.join("model.safetensors")).unwrap(),
        ));
    }
    assert_eq!(runs[0].0, runs[1].0);
    assert!(runs[0].1 == runs[1].1, "the saved weights differ");
}

/// Where padded positions reach no loss (their labels the ignore index, as data collators and
/// castor's own data label them), what padded rows hold cannot reach the loss or a gradient:
/// on Mistral's windowed plan, input ids changed at every padded position leave the loss, the
/// gradients and the updated state bit-identical. Some of those rows see no key under the
/// window (rows more than the window past their sequence's end), the one place cuDNN's
/// windowed graphs (which compute only the kept keys) and castor's twin (which attends
/// uniformly to every key, as PyTorch's finite-minimum masks do) can differ, so the GPU check
/// compares cuDNN's windows on such batches. Where padded positions are scored, as in the
/// training comparison's batches, the same change moves the loss.
#[test]
fn padded_rows_reach_no_gradient_where_padding_is_unscored() {
    use castor_runtime::PlanRunner;
    use common::cuda_cases::{batch, load_params, padding_unscored, plan, right_padded};
    let params = load_params("mistral_window");
    let p = plan(
        "mistral_window",
        &["--precision", "fp32", "--attention", "fused"],
    );
    let window = 3;
    let unscored = padding_unscored(right_padded(batch(&p.micro_step, 77)));
    let mask = unscored["attention_mask"].as_i64().unwrap().to_vec();
    let keys = *unscored["attention_mask"].shape().dims().last().unwrap();
    let kept = mask
        .chunks(keys)
        .map(|r| r.iter().filter(|&&m| m != 0).count());
    let unseeing: usize = kept.map(|k| keys.saturating_sub(k + window - 1)).sum();
    assert!(unseeing > 0, "the batch has no row that sees no key");
    // `b` with other input ids at every padded position.
    let changed = |b: &HashMap<String, Tensor>| {
        let mut b = b.clone();
        let ids = &b["input_ids"];
        let v: Vec<i64> = ids
            .as_i64()
            .unwrap()
            .iter()
            .zip(&mask)
            .map(|(&id, &m)| if m == 0 { (id + 7) % 90 } else { id })
            .collect();
        let t = Tensor::from_i64(ids.dtype(), ids.shape().clone(), v);
        b.insert("input_ids".into(), t);
        b
    };
    let run = |b: &HashMap<String, Tensor>| {
        let mut cpu = PlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
        let loss = cpu.step(std::slice::from_ref(b), 1e-3).unwrap().loss;
        let state: Vec<(String, Vec<u32>)> = cpu
            .state_entries()
            .into_iter()
            .map(|(n, t)| {
                let bits = common::cuda_cases::as_f32(t)
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                (n.to_string(), bits)
            })
            .collect();
        (loss.to_bits(), state)
    };
    let (a, b) = (run(&unscored), run(&changed(&unscored)));
    assert_eq!(a.0, b.0, "the loss differs");
    for ((name, x), (_, y)) in a.1.iter().zip(&b.1) {
        assert!(x == y, "{name} differs");
    }
    // Where padded positions are scored (the training comparison's batches), they do reach
    // the loss.
    let scored = right_padded(batch(&p.micro_step, 77));
    assert_ne!(run(&scored).0, run(&changed(&scored)).0);
    println!(
        "{unseeing} rows see no key; loss and {} state entries bit-identical",
        a.1.len()
    );
}

/// Packed rows (`--pack`): `--attention auto`, the default, builds the fused attention op,
/// which castor's kernels run with the rows' positions (no eager softmax), the listing saying
/// why cuDNN does not; `--attention cudnn` refuses the plan, naming the reason.
#[test]
fn packed_rows_run_castors_fused_kernels_under_auto_and_cudnn_refuses_them() {
    let compile = |attention: &[&str]| {
        emit_cuda(
            "gpt2_lm",
            &[&["--pack", "--precision", "bf16"], attention].concat(),
        )
    };
    let o = compile(&[]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(
        listing.contains(
            "cuDNN cannot run it (packed sequences' positions (cuDNN takes packed rows as ragged \
             THD layouts, which castor does not build)); castor's kernels:"
        ),
        "{listing}"
    );
    // The positions (an input slot) follow the null mask in every attention launch, each of a
    // `_packed` entry point (the others compile the positions out).
    let launches: Vec<&str> = listing
        .lines()
        .filter(|l| {
            l.contains("launch attention_fwd_bf16") || l.contains("launch attention_bwd_bf16")
        })
        .collect();
    assert!(!launches.is_empty(), "{listing}");
    for l in &launches {
        let args: Vec<&str> = l.split(">>>(").nth(1).unwrap_or("").split(", ").collect();
        assert!(args[3] == "null" && args[4] != "null", "{l}");
        assert!(l.contains("_d16_packed<<<"), "{l}");
    }
    assert!(!listing.contains("softmax_fwd"), "{listing}");
    let o = compile(&["--attention", "cudnn"]);
    assert!(!o.status.success());
    let err = common::stderr(&o);
    assert!(
        err.contains("%h.0.attn.context")
            && err.contains(
                "--attention cudnn: cuDNN's fused attention cannot run this op: packed \
                 sequences' positions"
            ),
        "{err}"
    );
}

/// Attention dropout (`--dropout config`: GPT-2's `attn_pdrop`): cuDNN's dropout draws its own
/// mask, not castor's Philox mask, so `--attention auto` (the default) runs castor's
/// `_dropout` kernels, the listing saying why, and `--attention cudnn` refuses the plan by
/// name.
#[test]
fn attention_dropout_runs_castors_kernels_under_auto_and_cudnn_refuses_it() {
    let compile = |attention: &[&str]| {
        emit_cuda(
            "gpt2_lm",
            &[&["--dropout", "config", "--precision", "bf16"], attention].concat(),
        )
    };
    let o = compile(&[]);
    assert!(o.status.success(), "{}", common::stderr(&o));
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(
        listing.contains(
            "cuDNN cannot run it (dropout on the probabilities (cuDNN's dropout draws its own \
             mask, not castor's Philox mask, which the CPU executor and the emulator draw)); \
             castor's kernels:"
        ),
        "{listing}"
    );
    for entry in [
        "launch attention_fwd_bf16_d16_dropout",
        "launch attention_bwd_bf16_d16_dropout",
    ] {
        assert_eq!(listing.matches(entry).count(), 2, "{entry}\n{listing}");
    }
    assert!(!listing.contains("softmax_fwd"), "{listing}");
    let o = compile(&["--attention", "cudnn"]);
    assert!(!o.status.success());
    let err = common::stderr(&o);
    assert!(
        err.contains("%h.0.attn.context")
            && err.contains(
                "--attention cudnn: cuDNN's fused attention cannot run this op: dropout on the \
                 probabilities"
            ),
        "{err}"
    );
}
