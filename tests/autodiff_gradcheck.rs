//! Every VJP rule of the autodiff pass checked by finite differences, as
//! torch.autograd.gradcheck does: for a small graph per op, the gradient the backward graph
//! computes against central differences of the loss computed by the forward graph, both on the
//! CPU executor. Losses are `sum(y * r)` for a fixed random `r`, so every output element
//! matters. F32 arithmetic: the tolerance is a relative error of 1e-2 over the whole gradient
//! with steps of 1e-2, which a wrong rule (a missing transpose, a dropped term) misses by far.

use castor_ir::{relative_error, text, DType, Graph, Tensor};
use castor_passes::{Autodiff, Pass};
use castor_runtime::cpu::CpuExecutor;
use std::collections::HashMap;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

/// Binds every input and param of `g` to deterministic data (ints from `ints`).
fn bindings(g: &Graph, ints: &HashMap<&str, Vec<i64>>) -> HashMap<String, Tensor> {
    let mut b = HashMap::new();
    for (i, v) in g.inputs().chain(g.params()).enumerate() {
        let ty = g.ty(v);
        let name = g.name(v);
        let n = ty.shape.numel().unwrap();
        let t = match ty.dtype {
            DType::I64 | DType::I32 => {
                Tensor::from_i64(ty.dtype, ty.shape.clone(), ints[name].clone())
            }
            DType::Bool => Tensor::from_bool(
                ty.shape.clone(),
                (0..n).map(|k| ints[name][k] != 0).collect(),
            ),
            d => Tensor::from_f32(d, ty.shape.clone(), values(n, 17 + i as u64)),
        };
        b.insert(name.to_string(), t);
    }
    b
}

fn run(g: &Graph, b: &HashMap<String, Tensor>) -> Vec<Tensor> {
    CpuExecutor::new().run(g, &|n| b.get(n)).unwrap()
}

/// Checks the gradient of every param of the graph written as IR text.
fn gradcheck(name: &str, src: &str, ints: &[(&str, Vec<i64>)]) {
    let ints: HashMap<&str, Vec<i64>> = ints.iter().cloned().collect();
    let forward = text::parse(src).unwrap_or_else(|e| panic!("{name}: {e}"));
    castor_ir::verify(&forward).unwrap_or_else(|e| panic!("{name}: {e}"));
    let (backward, _) = Autodiff::default()
        .run(&forward)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    castor_ir::verify(&backward).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut b = bindings(&forward, &ints);
    let grads = run(&backward, &b);
    for (k, p) in forward.params().enumerate() {
        let pname = forward.name(p).to_string();
        let analytic = grads[k + 1].as_f32().unwrap().to_vec();
        let base = b[&pname].as_f32().unwrap().to_vec();
        let mut numeric = Vec::with_capacity(base.len());
        for i in 0..base.len() {
            let h = 1e-2f32;
            let mut loss_at = |delta: f32| {
                let mut p2 = base.clone();
                p2[i] += delta;
                b.insert(
                    pname.clone(),
                    Tensor::from_f32(DType::F32, b[&pname].shape().clone(), p2),
                );
                run(&forward, &b)[0].as_f32().unwrap()[0] as f64
            };
            numeric.push(((loss_at(h) - loss_at(-h)) / (2.0 * h as f64)) as f32);
        }
        b.insert(
            pname.clone(),
            Tensor::from_f32(DType::F32, b[&pname].shape().clone(), base),
        );
        let err = relative_error(&analytic, &numeric);
        assert!(err < 1e-2, "{name}: gradient of %{pname}: relative error {err:.3e}\nanalytic {analytic:?}\nnumeric  {numeric:?}");
    }
}

/// A graph computing `%y` from params, closed by `loss = sum(y * r)`.
fn graph(decls: &str, body: &str, y_ty: &str) -> String {
    format!(
        "graph t {{\n{decls}\n{body}\n  %r: {y_ty} = input\n  %yr: {y_ty} = mul(%y, %r)\n  %loss: f32[] = sum(%yr) {{axes={axes}, keepdim=false}}\n  return %loss\n}}\n",
        axes = {
            let rank = y_ty.matches(',').count() + 1;
            format!("[{}]", (0..rank).map(|i| i.to_string()).collect::<Vec<_>>().join(","))
        }
    )
}

#[test]
fn matmul_in_every_transpose_and_broadcast() {
    for (ta, tb, a, b, y) in [
        (false, false, "f32[3,4]", "f32[4,5]", "f32[3,5]"),
        (false, true, "f32[3,4]", "f32[5,4]", "f32[3,5]"),
        (true, false, "f32[4,3]", "f32[4,5]", "f32[3,5]"),
        (true, true, "f32[4,3]", "f32[5,4]", "f32[3,5]"),
        (false, true, "f32[2,3,4]", "f32[5,4]", "f32[2,3,5]"),
        (false, false, "f32[2,1,3,4]", "f32[1,2,4,5]", "f32[2,2,3,5]"),
        (true, false, "f32[2,4,3]", "f32[4,5]", "f32[2,3,5]"),
    ] {
        let src = graph(
            &format!("  %a: {a} = param\n  %b: {b} = param"),
            &format!("  %y: {y} = matmul(%a, %b) {{transpose_a={ta}, transpose_b={tb}}}"),
            y,
        );
        gradcheck(&format!("matmul ta={ta} tb={tb} {a} x {b}"), &src, &[]);
    }
}

#[test]
fn binary_ops_with_broadcasting() {
    for op in ["add", "sub", "mul", "div"] {
        let src = graph(
            "  %a: f32[2,3,4] = param\n  %b: f32[3,1] = param\n  %b2: f32[3,1] = mul(%b, %b)\n  %b3: f32[3,1] = exp(%b2)",
            &format!("  %y: f32[2,3,4] = {op}(%a, %b3)"),
            "f32[2,3,4]",
        );
        gradcheck(op, &src, &[]);
    }
}

#[test]
fn unary_ops_and_scale() {
    for op in ["gelu_tanh", "gelu_erf", "silu", "tanh", "exp", "neg"] {
        let src = graph(
            "  %a: f32[3,5] = param",
            &format!("  %y: f32[3,5] = {op}(%a)"),
            "f32[3,5]",
        );
        gradcheck(op, &src, &[]);
    }
    let src = graph(
        "  %a: f32[3,5] = param\n  %p: f32[3,5] = exp(%a)",
        "  %y: f32[3,5] = rsqrt(%p)",
        "f32[3,5]",
    );
    gradcheck("rsqrt", &src, &[]);
    let src = graph(
        "  %a: f32[3,5] = param",
        "  %y: f32[3,5] = scale(%a) {factor=-2.5}",
        "f32[3,5]",
    );
    gradcheck("scale", &src, &[]);
}

#[test]
fn norms() {
    let src = graph(
        "  %x: f32[2,3,6] = param\n  %w: f32[6] = param\n  %b: f32[6] = param",
        "  %y: f32[2,3,6] = layer_norm(%x, %w, %b) {eps=1e-5}",
        "f32[2,3,6]",
    );
    gradcheck("layer_norm", &src, &[]);
    let src = graph(
        "  %x: f32[2,3,6] = param\n  %w: f32[6] = param",
        "  %y: f32[2,3,6] = rms_norm(%x, %w) {eps=1e-6}",
        "f32[2,3,6]",
    );
    gradcheck("rms_norm", &src, &[]);
}

#[test]
fn softmax_with_causal_and_padding_masks() {
    let src = graph(
        "  %x: f32[2,2,3,4] = param\n  %m: bool[2,1,1,4] = input",
        "  %y: f32[2,2,3,4] = softmax(%x, %m) {causal=true}",
        "f32[2,2,3,4]",
    );
    gradcheck("softmax", &src, &[("m", vec![1, 1, 1, 1, 1, 1, 0, 1])]);
}

#[test]
fn attention_with_groups_causal_and_padding_masks() {
    // Grouped-query layout [B, Hkv, G, T, D] against k/v [B, Hkv, 1, S, D], causal, with
    // padding. (A row with no visible key is uniform whatever the scores: its forward is
    // constant, while PyTorch's gradient is the uniform softmax's; `tests/attention.rs`
    // checks that case against the unfused graph.)
    let src = graph(
        "  %q: f32[2,2,2,3,4] = param\n  %k: f32[2,2,1,5,4] = param\n  %v: f32[2,2,1,5,3] = param\n  %m: bool[2,1,1,1,5] = input\n  %y: f32[2,2,2,3,3], %lse: f32[2,2,2,3] = attention(%q, %k, %v, %m) {causal=true, scale=0.5}",
        "",
        "f32[2,2,2,3,3]",
    );
    gradcheck(
        "attention",
        &src,
        &[("m", vec![1, 1, 0, 1, 1, 1, 0, 0, 1, 1])],
    );
    let src = graph(
        "  %q: f32[2,3,4] = param\n  %k: f32[2,4,4] = param\n  %v: f32[2,4,2] = param\n  %y: f32[2,3,2], %lse: f32[2,3] = attention(%q, %k, %v) {causal=false, scale=0.35}",
        "",
        "f32[2,3,2]",
    );
    gradcheck("attention without mask", &src, &[]);
}

#[test]
fn dropout_regenerates_its_mask_in_the_backward() {
    // Some elements dropped, the rest scaled: the gradient is the same mask applied to dy.
    for p in [0.0, 0.3, 0.9] {
        let src = graph(
            "  %a: f32[3,7] = param\n  %key: i64[2] = input",
            &format!("  %y: f32[3,7] = dropout(%a, %key) {{p={p}, stream=2}}"),
            "f32[3,7]",
        );
        gradcheck(&format!("dropout p={p}"), &src, &[("key", vec![11, 5])]);
    }
}

#[test]
fn rope_and_layout_ops() {
    let src = graph(
        "  %x: f32[2,3,8] = param",
        "  %y: f32[2,3,8] = rope(%x) {theta=10000.0}",
        "f32[2,3,8]",
    );
    gradcheck("rope", &src, &[]);
    let src = graph(
        "  %x: f32[2,6] = param\n  %t: f32[6,2] = transpose(%x) {perm=[1,0]}\n  %s: f32[3,4] = reshape(%t) {shape=[3,4]}\n  %a: f32[3,1] = slice(%s) {axis=1, start=1, end=2}\n  %p: f32[3,2], %q: f32[3,2] = split(%s) {axis=1, sizes=[2,2]}",
        "  %y: f32[3,5] = concat(%q, %a, %p) {axis=1}",
        "f32[3,5]",
    );
    gradcheck("layout", &src, &[]);
    let src = graph(
        "  %x: f32[3,4] = param\n  %p: f32[3,1], %q: f32[3,3] = split(%x) {axis=1, sizes=[1,3]}",
        "  %y: f32[3,3] = exp(%q)",
        "f32[3,3]",
    );
    gradcheck("split with an unused piece", &src, &[]);
}

#[test]
fn reductions_embedding_loss_and_casts() {
    let src = graph(
        "  %x: f32[2,3,4] = param\n  %s: f32[2,4] = sum(%x) {axes=[1], keepdim=false}",
        "  %y: f32[2,1] = mean(%s) {axes=[1], keepdim=true}",
        "f32[2,1]",
    );
    gradcheck("sum and mean", &src, &[]);
    let src = graph(
        "  %table: f32[5,3] = param\n  %ids: i64[2,3] = input",
        "  %y: f32[2,3,3] = embedding(%table, %ids)",
        "f32[2,3,3]",
    );
    gradcheck(
        "embedding with repeated ids",
        &src,
        &[("ids", vec![0, 4, 4, 2, 0, 4])],
    );
    let src = "graph ce {\n  %logits: f32[4,6] = param\n  %labels: i64[4] = input\n  %loss: f32[] = cross_entropy(%logits, %labels) {ignore_index=-100}\n  return %loss\n}\n";
    gradcheck(
        "cross_entropy with an ignored label",
        src,
        &[("labels", vec![1, -100, 5, 0])],
    );
    // Casts pass gradients through (converted to the operand's dtype); finite differences
    // through a BF16 rounding are too coarse to check here, so the cast is to F32 and back.
    let src = graph(
        "  %x: f32[3,4] = param\n  %h: f32[3,4] = cast(%x) {to=f32}\n  %g: f32[3,4] = gelu_tanh(%h)",
        "  %y: f32[3,4] = cast(%g) {to=f32}",
        "f32[3,4]",
    );
    gradcheck("casts", &src, &[]);
}

#[test]
fn tied_parameter_gradients_sum_both_uses() {
    let src = graph(
        "  %w: f32[5,4] = param\n  %ids: i64[3] = input\n  %e: f32[3,4] = embedding(%w, %ids)",
        "  %y: f32[3,5] = matmul(%e, %w) {transpose_a=false, transpose_b=true}",
        "f32[3,5]",
    );
    gradcheck("tied embedding and head", &src, &[("ids", vec![1, 3, 1])]);
}
