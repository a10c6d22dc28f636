//! Test data and plans shared by the CUDA tests (lowering, emulator, GPU): random inputs in
//! range for what they index, training batches with ignored labels and padding, the single-op
//! graphs of every kernel family, and fixture plans compiled by the CLI.

use super::{anatomy_total, castor, fixture, path_str, stderr};
use castor_ir::{relative_error, DType, Graph, Tensor, TensorData, TrainingPlan};
use std::collections::HashMap;

/// A deterministic generator for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// The range an int input must be in: the rows of the embedding tables it indexes, the
/// classes of the cross-entropies it labels, and `limit`.
pub fn int_limit(g: &Graph, v: castor_ir::Value, limit: i64) -> i64 {
    let users = g.users();
    let mut bound = limit;
    for &u in &users[v.index()] {
        let node = g.node(u);
        let dim = match node.op {
            castor_ir::Op::Embedding { .. } if node.inputs[1] == v => (node.inputs[0], 0),
            castor_ir::Op::CrossEntropy { .. } | castor_ir::Op::CrossEntropyGrad { .. }
                if node.inputs[1] == v =>
            {
                (node.inputs[0], 1)
            }
            castor_ir::Op::EmbeddingGrad { vocab, .. } if node.inputs[0] == v => {
                bound = bound.min(vocab as i64);
                continue;
            }
            _ => continue,
        };
        bound = bound.min(g.ty(dim.0).shape.dims()[dim.1] as i64);
    }
    bound
}

/// Random data for every `input` of `g` (ids and labels below `limit` and in range for what
/// they index).
pub fn inputs(g: &Graph, limit: i64, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = Rng(seed | 1);
    let mut out = HashMap::new();
    for (_, node) in g.nodes() {
        if !matches!(node.op, castor_ir::Op::Input) {
            continue;
        }
        let v = node.outputs[0];
        let ty = g.ty(v);
        let n = ty.shape.numel().unwrap_or(0);
        let limit = int_limit(g, v, limit);
        let t = match ty.dtype {
            DType::I64 | DType::I32 => Tensor::from_i64(
                ty.dtype,
                ty.shape.clone(),
                (0..n).map(|_| (rng.next() % limit as u64) as i64).collect(),
            ),
            DType::Bool => Tensor::from_bool(
                ty.shape.clone(),
                (0..n)
                    .map(|i| i % 5 != 3 || rng.next().is_multiple_of(2))
                    .collect(),
            ),
            d => Tensor::from_f32(d, ty.shape.clone(), (0..n).map(|_| rng.uniform()).collect()),
        };
        out.insert(g.name(v).to_string(), t);
    }
    out
}

/// `b` with its attention mask right-padded: each row keeps as many first keys as it kept
/// keys, and at least one, as castor's SFT and classification data pad rows. cuDNN's
/// attention takes padding as sequence lengths, so the batches of a plan cuDNN may run
/// (`--attention auto`, the default, and `cudnn`) are these; masks with holes and left padding
/// are castor's kernels' (the kernel tests, and `tests/attention.rs`).
pub fn right_padded(mut b: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    if let Some(t) = b.get_mut("attention_mask") {
        let keys = t.shape().dims().last().copied().unwrap_or(1).max(1);
        let v: Vec<i64> = t
            .as_i64()
            .unwrap_or(&[])
            .chunks(keys)
            .flat_map(|row| {
                let kept = row.iter().filter(|&&x| x != 0).count().max(1);
                (0..keys).map(move |j| i64::from(j < kept))
            })
            .collect();
        *t = Tensor::from_i64(t.dtype(), t.shape().clone(), v);
    }
    b
}

/// Batch `b` with the ignore index (-100) as the label of every position its attention mask
/// drops, as data collators and castor's own data label padding: no padded row reaches the
/// loss. A batch without labels or a mask is returned as it is.
pub fn padding_unscored(mut b: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let Some(mask) = b
        .get("attention_mask")
        .and_then(|m| m.as_i64())
        .map(<[i64]>::to_vec)
    else {
        return b;
    };
    if let Some(t) = b.get_mut("labels") {
        if let Some(v) = t.as_i64() {
            if v.len() == mask.len() {
                let v: Vec<i64> = v
                    .iter()
                    .zip(&mask)
                    .map(|(&l, &m)| if m == 0 { -100 } else { l })
                    .collect();
                *t = Tensor::from_i64(t.dtype(), t.shape().clone(), v);
            }
        }
    }
    b
}

/// A training batch: [`inputs`], with about a quarter of the labels PyTorch's ignore index
/// (-100) and about a fifth of the attention mask padding (0), so the ignored-row and masked
/// paths of cross-entropy and softmax run too.
pub fn batch(g: &Graph, seed: u64) -> HashMap<String, Tensor> {
    let mut out = inputs(g, 90, seed);
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9) | 1);
    // In a fixed order (a map's is not), so every run draws the same batch.
    for name in ["attention_mask", "labels"] {
        let Some(t) = out.get_mut(name) else {
            continue;
        };
        let Some(v) = t.as_i64() else {
            continue;
        };
        let v: Vec<i64> = v
            .iter()
            .map(|&x| match (name, rng.next() % 20) {
                ("labels", 0..=4) => -100,
                ("attention_mask", 0..=3) => 0,
                ("attention_mask", _) => 1,
                _ => x,
            })
            .collect();
        *t = Tensor::from_i64(t.dtype(), t.shape().clone(), v);
    }
    // Packed rows: sequences of random lengths (about 5), positions restarting at each.
    if let Some(t) = out.get_mut("position_ids") {
        let (b, n) = match t.shape().dims() {
            &[b, n] => (b, n),
            _ => (1, t.shape().numel().unwrap_or(0)),
        };
        let mut v = Vec::with_capacity(b * n);
        for _ in 0..b {
            let mut p = 0;
            for i in 0..n {
                if i > 0 && rng.next().is_multiple_of(5) {
                    p = 0;
                }
                v.push(p);
                p += 1;
            }
        }
        *t = Tensor::from_i64(t.dtype(), t.shape().clone(), v);
    }
    out
}

pub fn as_f32(t: &Tensor) -> Vec<f32> {
    match t.data() {
        TensorData::F32(v) => v.to_vec(),
        TensorData::I64(v) => v.iter().map(|&x| x as f32).collect(),
        TensorData::Bool(v) => v.iter().map(|&b| f32::from(u8::from(b))).collect(),
        TensorData::U8(v) => v.iter().map(|&b| f32::from(b)).collect(),
    }
}

/// Single-op graphs over `{t}` = f32, bf16, f16, at awkward sizes (as in `tests/cuda_gpu.rs`).
/// The fused attention op, forward and backward, at a head dim of 64 with grouped-query heads
/// (2 query heads per kv head), a padding mask or packed sequences' positions (any values: the
/// kernels clamp them), 33 queries and 40 keys (neither a multiple of the 64-row tiles),
/// causal; and the padded case with dropout on its probabilities. Apart from [`CASES`] because its kernels agree with the CPU executor to a bound
/// (tests/attention.rs), not bit for bit.
pub const ATTENTION_CASES: &[(&str, &str)] = &[
    (
        "attention",
        "%q: {t}[2,2,2,33,64] = input\n%k: {t}[2,2,1,40,64] = input\n%v: {t}[2,2,1,40,64] = input\n%m: bool[2,1,1,1,40] = input\n%o: {t}[2,2,2,33,64], %lse: f32[2,2,2,33] = attention(%q, %k, %v, %m) {causal=true, scale=0.125}\n%do: {t}[2,2,2,33,64] = input\n%dq: {t}[2,2,2,33,64], %dk: {t}[2,2,1,40,64], %dv: {t}[2,2,1,40,64] = attention_grad(%q, %k, %v, %o, %lse, %do, %m) {causal=true, scale=0.125}",
    ),
    (
        "attention_packed",
        "%q: {t}[2,2,2,33,64] = input\n%k: {t}[2,2,1,40,64] = input\n%v: {t}[2,2,1,40,64] = input\n%position_ids: i64[2,1,1,1,40] = input\n%o: {t}[2,2,2,33,64], %lse: f32[2,2,2,33] = attention(%q, %k, %v, %position_ids) {causal=true, scale=0.125}\n%do: {t}[2,2,2,33,64] = input\n%dq: {t}[2,2,2,33,64], %dk: {t}[2,2,1,40,64], %dv: {t}[2,2,1,40,64] = attention_grad(%q, %k, %v, %o, %lse, %do, %position_ids) {causal=true, scale=0.125}",
    ),
    // Dropout on the probabilities (the `_dropout` entry points; the key's random offset is
    // non-negative: training mode).
    (
        "attention_dropout",
        "%q: {t}[2,2,2,33,64] = input\n%k: {t}[2,2,1,40,64] = input\n%v: {t}[2,2,1,40,64] = input\n%m: bool[2,1,1,1,40] = input\n%dropout_key: i64[2] = input\n%o: {t}[2,2,2,33,64], %lse: f32[2,2,2,33] = attention(%q, %k, %v, %m, %dropout_key) {causal=true, scale=0.125, dropout=0.1, stream=1}\n%do: {t}[2,2,2,33,64] = input\n%dq: {t}[2,2,2,33,64], %dk: {t}[2,2,1,40,64], %dv: {t}[2,2,1,40,64] = attention_grad(%q, %k, %v, %o, %lse, %do, %m, %dropout_key) {causal=true, scale=0.125, dropout=0.1, stream=1}",
    ),
];

pub const CASES: &[(&str, &str)] = &[
    ("matmul", "%a: {t}[3,7,13] = input\n%b: {t}[13,9] = input\n%y: {t}[3,7,9] = matmul(%a, %b) {transpose_a=false, transpose_b=false}"),
    ("matmul_bt", "%a: {t}[2,3,5,13] = input\n%b: {t}[2,3,7,13] = input\n%y: {t}[2,3,5,7] = matmul(%a, %b) {transpose_a=false, transpose_b=true}"),
    ("matmul_at_f32_out", "%a: {t}[33,7] = input\n%b: {t}[33,9] = input\n%y: f32[7,9] = matmul(%a, %b) {transpose_a=true, transpose_b=false}"),
    ("matmul_gqa", "%a: {t}[1,2,2,5,8] = input\n%b: {t}[1,2,1,8,5] = input\n%y: {t}[1,2,2,5,5] = matmul(%a, %b) {transpose_a=false, transpose_b=false}"),
    ("layer_norm", "%x: f32[5,7,33] = input\n%w: f32[33] = input\n%b: f32[33] = input\n%y: {t}[5,7,33] = layer_norm(%x, %w, %b) {eps=1e-5}\n%dy: {t}[5,7,33] = input\n%dx: f32[5,7,33], %dw: f32[33], %db: f32[33] = layer_norm_grad(%x, %w, %dy) {eps=1e-5}"),
    ("rms_norm", "%x: {t}[3,37] = input\n%w: f32[37] = input\n%y: {t}[3,37] = rms_norm(%x, %w) {eps=1e-6}\n%dy: {t}[3,37] = input\n%dx: {t}[3,37], %dw: f32[37] = rms_norm_grad(%x, %w, %dy) {eps=1e-6}"),
    ("softmax", "%x: {t}[2,3,5,9] = input\n%m: bool[2,1,1,9] = input\n%y: {t}[2,3,5,9] = softmax(%x, %m) {causal=true}\n%dy: {t}[2,3,5,9] = input\n%dx: {t}[2,3,5,9] = softmax_grad(%y, %dy)"),
    ("softmax_gqa", "%x: {t}[2,2,2,3,5] = input\n%m: bool[2,1,1,1,5] = input\n%y: {t}[2,2,2,3,5] = softmax(%x, %m) {causal=false}"),
    ("cross_entropy", "%x: {t}[11,37] = input\n%l: i64[11] = input\n%loss: f32[] = cross_entropy(%x, %l) {ignore_index=-100}\n%s: f32[] = input\n%dx: {t}[11,37] = cross_entropy_grad(%x, %l, %s) {ignore_index=-100}"),
    ("embedding", "%w: {t}[37,13] = input\n%ids: i64[3,11] = input\n%y: {t}[3,11,13] = embedding(%w, %ids)\n%dy: {t}[3,11,13] = input\n%dw: f32[37,13] = embedding_grad(%ids, %dy) {vocab=37}"),
    ("dropout", "%x: {t}[5,37] = input\n%key: i64[2] = input\n%y: {t}[5,37] = dropout(%x, %key) {p=0.25, stream=5}\n%dy: {t}[5,37] = input\n%dx: {t}[5,37] = dropout(%dy, %key) {p=0.25, stream=5}"),
    ("rope", "%x: {t}[2,3,7,10] = input\n%y: {t}[2,3,7,10] = rope(%x) {theta=10000}\n%dx: {t}[2,3,7,10] = rope_grad(%y) {theta=10000}"),
    ("rope_positions", "%x: {t}[2,3,7,10] = input\n%position_ids: i64[2,1,7] = input\n%y: {t}[2,3,7,10] = rope(%x, %position_ids) {theta=10000}\n%dx: {t}[2,3,7,10] = rope_grad(%y, %position_ids) {theta=10000}"),
    ("softmax_packed", "%x: {t}[2,3,9,9] = input\n%position_ids: i64[2,1,1,9] = input\n%y: {t}[2,3,9,9] = softmax(%x, %position_ids) {causal=true}\n%dy: {t}[2,3,9,9] = input\n%dx: {t}[2,3,9,9] = softmax_grad(%y, %dy)"),
    ("layout", "%x: {t}[3,5,7] = input\n%t: {t}[7,3,5] = transpose(%x) {perm=[2,0,1]}\n%s: {t}[3,2,7] = slice(%x) {axis=1, start=1, end=3}\n%p1: {t}[3,1,7], %p2: {t}[3,4,7] = split(%x) {axis=1, sizes=[1,4]}\n%c: {t}[3,10,7] = concat(%x, %x) {axis=1}\n%pd: {t}[3,9,7] = pad(%x) {axis=1, before=1, after=3}\n%bc: {t}[2,3,5,7] = broadcast_to(%x) {shape=[2,3,5,7]}"),
    ("reduce", "%x: {t}[3,5,7] = input\n%a: f32[3,5] = sum(%x) {axes=[2], keepdim=false}\n%b: {t}[5,7] = mean(%x) {axes=[0], keepdim=false}\n%c: f32[5] = sum(%x) {axes=[0,2], keepdim=false}\n%d: {t}[3,1,7] = max(%x) {axes=[1], keepdim=true}"),
    ("pointwise", "%x: {t}[5,37] = input\n%b: {t}[37] = input\n%y: {t}[5,37] = add(%x, %b)\n%g: {t}[5,37] = gelu_tanh(%y)\n%s: {t}[5,37] = silu(%x)\n%e: {t}[5,37] = scale(%g) {factor=0.5}\n%f: f32[5,37] = cast(%e) {to=f32}\n%dg: {t}[5,37] = gelu_tanh_grad(%y, %x)"),
    ("casts_and_fill", "%m: i64[3,7] = input\n%k: bool[3,7] = cast(%m) {to=bool}\n%f: {t}[3,7] = cast(%k) {to={t}}\n%z: {t}[5,3] = full() {value=0.25, dtype={t}, shape=[5,3]}"),
];

pub fn case_graph(name: &str, body: &str, t: &str) -> Graph {
    let mut text = format!("graph {name}_{t} {{\n");
    let body = body.replace("{t}", t);
    let mut outs = Vec::new();
    for line in body.lines() {
        text.push_str("  ");
        text.push_str(line);
        text.push('\n');
        if !line.ends_with("= input") {
            let lhs = line.split(" = ").next().unwrap_or("");
            outs.extend(
                lhs.split(", ")
                    .filter_map(|d| d.split(':').next())
                    .map(str::to_string),
            );
        }
    }
    text.push_str(&format!("  return {}\n}}\n", outs.join(", ")));
    castor_ir::text::parse(&text).unwrap_or_else(|e| panic!("{name} {t}: {e}\n{text}"))
}

/// A fixture's training plan compiled by the CLI with `flags`.
pub fn plan(variant: &str, flags: &[&str]) -> TrainingPlan {
    plan_of(&fixture(variant), flags)
}

/// The training plan of `model` (a checkpoint folder or a config) compiled by the CLI with
/// `flags`.
pub fn plan_of(model: &std::path::Path, flags: &[&str]) -> TrainingPlan {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let mut args = vec![
        "compile",
        path_str(model),
        "--emit",
        "plan",
        "-o",
        path_str(&out),
    ];
    args.extend_from_slice(flags);
    let o = castor(&args);
    assert!(
        o.status.success(),
        "{} {flags:?}: {}",
        model.display(),
        stderr(&o)
    );
    TrainingPlan::from_json(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

/// A fixture's checkpoint weights.
pub fn load_params(variant: &str) -> HashMap<String, Tensor> {
    let model = castor_models::Model::load(fixture(variant)).unwrap();
    model.load_params().unwrap()
}

/// The training-plan families the CUDA tests run: one per model family, plus LLaMA with a tied
/// head and LLaMA 3.1's rope scaling.
pub const PLAN_FAMILIES: [&str; 8] = [
    "gpt2_lm",
    "bert_mlm",
    "llama_gqa",
    "llama_tied",
    "qwen2_bias",
    "mistral_window",
    "gemma_tiny",
    "llama31_rope",
];
/// The attention of plans compared bit for bit with the CPU executor: the eager ops (the
/// default builds the fused op, whose kernel agrees with the CPU to a bound, not bit for bit).
pub const EAGER: &str = "--attention eager";
pub const PLAN_PRECISIONS: [&str; 4] = ["fp32", "tf32", "bf16", "fp16"];
/// The rematerialization modes; `budget` is resolved per plan by [`midway_budget`].
pub const PLAN_REMATS: [&str; 4] = ["none", "full", "selective", "budget"];
/// The training options that change what the step launches.
pub const PLAN_OPTIONS: [&str; 6] = [
    "",
    "--grad-accum 2",
    "--optimizer sgd --momentum 0.9",
    "--param-grads compute",
    "--optimizer adafactor",
    "--optimizer-state bf16",
];

/// Every (family, flags) of the plan matrix for `family`: each precision x remat mode x
/// option, so a launch that only one combination makes cannot hide. The matrix builds the
/// attention eagerly ([`EAGER`]): its plans are compared bit for bit, and the fused attention
/// kernel (contraction allowed) has its own cases and bounds (tests/attention.rs).
pub fn plan_matrix(family: &str) -> Vec<String> {
    let mut out = Vec::new();
    for precision in PLAN_PRECISIONS {
        for remat in PLAN_REMATS {
            for option in PLAN_OPTIONS {
                let base = format!("--precision {precision} {option} {EAGER}");
                let base = base.split_whitespace().collect::<Vec<_>>().join(" ");
                let remat = if remat == "budget" {
                    format!("budget:{}", midway_budget(family, &base))
                } else {
                    remat.to_string()
                };
                let flags = format!("--precision {precision} {option}");
                out.push(format!("{} --remat {remat} {EAGER}", flags.trim()));
            }
        }
    }
    out
}

/// The planned peak (the anatomy's `total`) of a fixture's training plan under `flags`.
pub fn planned_peak(variant: &str, flags: &str) -> u64 {
    let model = fixture(variant);
    let mut args = vec!["compile", path_str(&model), "--train"];
    args.extend(flags.split_whitespace());
    let o = castor(&args);
    assert!(o.status.success(), "{variant} {flags}: {}", stderr(&o));
    anatomy_total(&String::from_utf8_lossy(&o.stdout))
}

/// A byte budget halfway between the `none` and `full` planned peaks, so `budget` recomputes
/// some of the forward but not all of it.
pub fn midway_budget(variant: &str, flags: &str) -> u64 {
    let none = planned_peak(variant, &format!("{flags} --remat none"));
    let full = planned_peak(variant, &format!("{flags} --remat full"));
    (none + full) / 2
}

/// The relative error of state `x` against `y`: infinite if their non-finite values (an
/// overflowing step's gradients) differ, or if `y` is all zeros and `x` is not.
pub fn state_error(x: &[f32], y: &[f32]) -> f64 {
    let same = |a: f32, b: f32| a == b || (a.is_nan() && b.is_nan());
    if x.len() != y.len()
        || x.iter()
            .zip(y)
            .any(|(&a, &b)| (!a.is_finite() || !b.is_finite()) && !same(a, b))
    {
        return f64::INFINITY;
    }
    let (x, y): (Vec<f32>, Vec<f32>) = x
        .iter()
        .zip(y)
        .filter(|(a, _)| a.is_finite())
        .map(|(&a, &b)| (a, b))
        .unzip();
    if y.iter().all(|&v| v == 0.0) {
        return if x == y { 0.0 } else { f64::INFINITY };
    }
    relative_error(&x, &y)
}

/// The slices along dim 0 of each parameter whose gradient is zero in exact arithmetic (the
/// attention key biases: softmax cancels the constant `q·b_k`), from the fixture's
/// `training.json`. Their computed gradients are rounding noise that another summation order
/// (cuBLAS's) rounds differently, and AdamW turns that noise into full-size updates, so
/// comparisons between executors leave them out, as the PyTorch comparisons do.
pub fn exact_zero_slices(variant: &str) -> HashMap<String, (usize, usize)> {
    let path = fixture(variant).join("training.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return HashMap::new();
    };
    let info: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = HashMap::new();
    if let Some(map) = info["zero_in_exact_arithmetic"].as_object() {
        for (name, r) in map {
            let at = |i: usize| r[i].as_u64().unwrap() as usize;
            out.insert(name.clone(), (at(0), at(1)));
        }
    }
    out
}

/// Zeroes, in both `x` and `y`, the noise slice of the parameter state entry `name` belongs
/// to (its master, gradient or moments: any entry whose name ends with the parameter's), and
/// returns the largest magnitude the slice held in `x` (for a gradient it must be tiny).
pub fn mask_exact_zero(
    slices: &HashMap<String, (usize, usize)>,
    name: &str,
    shape: &[usize],
    x: &mut [f32],
    y: &mut [f32],
) -> f32 {
    let Some(&(lo, hi)) = slices
        .iter()
        .find(|(p, _)| name == p.as_str() || name.ends_with(&format!(".{p}")))
        .map(|(_, r)| r)
    else {
        return 0.0;
    };
    let row: usize = shape.iter().skip(1).product();
    let mut most = 0f32;
    for i in lo * row..(hi * row).min(x.len()).min(y.len()) {
        most = most.max(x[i].abs());
        x[i] = 0.0;
        y[i] = 0.0;
    }
    most
}

/// How closely another executor's state must match the CPU executor's.
pub struct Bounds {
    /// The largest relative error of an entry, the noise slices left out.
    pub tol: f64,
    /// The largest magnitude a gradient may hold where it is zero in exact arithmetic.
    pub noise: f64,
    /// Entries allowed more than `tol`, with their own bound (a BF16 plan's noise floor).
    pub raised: HashMap<String, f64>,
}

impl Bounds {
    /// The bound of entry `name`.
    pub fn tol_for(&self, name: &str) -> f64 {
        self.raised
            .get(name)
            .copied()
            .unwrap_or(self.tol)
            .max(self.tol)
    }
}

/// Compares one state entry of another executor (`got`) with the CPU executor's (`want`):
/// the exact-zero noise slices are left out (a gradient there must stay below `bounds.noise`),
/// the rest must agree within `bounds.tol`. Disagreements are pushed to `failures`; returns
/// the error.
pub fn compare_state(
    case: &str,
    name: &str,
    got: &Tensor,
    want: &Tensor,
    noise: &HashMap<String, (usize, usize)>,
    bounds: &Bounds,
    failures: &mut Vec<String>,
) -> f64 {
    let (mut x, mut y) = (as_f32(got), as_f32(want));
    let noise_peak = mask_exact_zero(noise, name, want.shape().dims(), &mut x, &mut y);
    if name.starts_with("grad.") && f64::from(noise_peak) > bounds.noise {
        failures.push(format!(
            "{case}: {name} holds {noise_peak:.2e} where it is zero in exact arithmetic"
        ));
    }
    let err = state_error(&x, &y);
    let tol = bounds.tol_for(name);
    if err.is_nan() || err >= tol {
        failures.push(format!(
            "{case}: state {name} error {err:.3e} (bound {tol:.2e})"
        ));
    }
    err
}
