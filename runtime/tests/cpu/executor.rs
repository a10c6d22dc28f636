//! The executor loop: bindings are borrowed, values freed after their last use, buffers
//! reused in place, and outputs returned in order even when repeated or bound.

use crate::common::*;
use castor_ir::{DType, GraphBuilder, Op, Tensor, UnaryOp};

#[test]
fn outputs_in_order_including_repeats_sources_and_reused_values() {
    let mut b = GraphBuilder::new("g");
    let x = b.input("x", ty(DType::F32, &[3])).expect("name");
    let w = b.param("w", ty(DType::F32, &[3])).expect("name");
    // `e` is both an output and read later; `n` is consumed in place by `s`.
    let e = b.op("e", Op::Unary(UnaryOp::Neg), &[x]).expect("typed");
    let n = b.op("n", Op::Scale { factor: 2.0 }, &[e]).expect("typed");
    let s = b
        .op("s", Op::Binary(castor_ir::BinaryOp::Add), &[n, w])
        .expect("typed");
    // `m` reads `s` twice, so it cannot take its buffer.
    let m = b
        .op("m", Op::Binary(castor_ir::BinaryOp::Mul), &[s, s])
        .expect("typed");
    // An unused result is dropped at once.
    b.op("unused", Op::Unary(UnaryOp::Exp), &[x])
        .expect("typed");
    b.set_outputs(vec![m, e, w, m, x]);
    let xv = Tensor::from_f32(DType::F32, [3], vec![1.0, 2.0, 3.0]);
    let wv = Tensor::from_f32(DType::F32, [3], vec![10.0, 20.0, 30.0]);
    let out = run(&b.finish(), &[("x", &xv), ("w", &wv)]).expect("runs");
    let s: Vec<f32> = vec![8.0, 16.0, 24.0];
    let m = Tensor::from_f32(DType::F32, [3], s.iter().map(|v| v * v).collect());
    let e = Tensor::from_f32(DType::F32, [3], vec![-1.0, -2.0, -3.0]);
    assert_eq!(out, vec![m.clone(), e, wv, m, xv]);
}

#[test]
fn ir_text_attention_block_runs() {
    let text = "graph attention {
  %x: f32[2,5,8] = input
  %mask: i64[2,5] = input
  %qkv.weight: f32[8,24] = param
  %qkv: f32[2,5,24] = matmul(%x, %qkv.weight) {transpose_a=false, transpose_b=false}
  %q: f32[2,5,8], %k: f32[2,5,8], %v: f32[2,5,8] = split(%qkv) {axis=2, sizes=[8,8,8]}
  %q.heads: f32[2,5,2,4] = reshape(%q) {shape=[2,5,2,4]}
  %q.t: f32[2,2,5,4] = transpose(%q.heads) {perm=[0,2,1,3]}
  %k.heads: f32[2,5,2,4] = reshape(%k) {shape=[2,5,2,4]}
  %k.t: f32[2,2,5,4] = transpose(%k.heads) {perm=[0,2,1,3]}
  %v.heads: f32[2,5,2,4] = reshape(%v) {shape=[2,5,2,4]}
  %v.t: f32[2,2,5,4] = transpose(%v.heads) {perm=[0,2,1,3]}
  %scores: f32[2,2,5,5] = matmul(%q.t, %k.t) {transpose_a=false, transpose_b=true}
  %scores.scaled: f32[2,2,5,5] = scale(%scores) {factor=0.5}
  %keep: bool[2,5] = cast(%mask) {to=bool}
  %keep.b: bool[2,1,1,5] = reshape(%keep) {shape=[2,1,1,5]}
  %probs: f32[2,2,5,5] = softmax(%scores.scaled, %keep.b) {causal=true}
  %ctx: f32[2,2,5,4] = matmul(%probs, %v.t) {transpose_a=false, transpose_b=false}
  %ctx.t: f32[2,5,2,4] = transpose(%ctx) {perm=[0,2,1,3]}
  %ctx.merged: f32[2,5,8] = reshape(%ctx.t) {shape=[2,5,8]}
  return %ctx.merged, %probs
}";
    let g = castor_ir::text::parse(text).expect("parses");
    let mut rng = Rng::new(90);
    let x = rng.tensor(DType::F32, &[2, 5, 8]);
    let w = rng.tensor(DType::F32, &[8, 24]);
    let mask = Tensor::from_i64(DType::I64, [2, 5], vec![1, 1, 1, 1, 1, 0, 0, 1, 1, 1]);
    let out = run(&g, &[("x", &x), ("mask", &mask), ("qkv.weight", &w)]).expect("runs");
    let probs = f32s(&out[1]);
    for (r, row) in probs.chunks(5).enumerate() {
        let (batch, query) = (r / 10, r % 5);
        let sum: f32 = row.iter().sum();
        assert!((sum - 1.0).abs() < 1e-6, "row {r} sums to {sum}");
        for (j, &p) in row.iter().enumerate() {
            let masked = j > query || (batch == 1 && j < 2);
            // Batch 1 queries 0 and 1 see no key: uniform.
            if batch == 1 && query < 2 {
                assert_eq!(p, 0.2);
            } else if masked {
                assert_eq!(p, 0.0, "row {r} key {j}");
            }
        }
    }
    // Head 0 of batch 0, query 0 attends only to key 0: its context is v[0, 0, head 0].
    let v0: Vec<f64> = (0..4)
        .map(|c| {
            (0..8)
                .map(|i| f32s(&x)[i] as f64 * f32s(&w)[i * 24 + 16 + c] as f64)
                .sum()
        })
        .collect();
    assert_close(&f32s(&out[0])[..4], &v0, 1e-5);
}

/// Runs `op` on `inputs` twice: alone, and after a node whose dead operand leaves a recycled
/// buffer of the output's length full of other values. Both results must agree: kernels that
/// draw output buffers from the executor's pool overwrite every element.
fn check_overwrites(op: Op, inputs: &[&Tensor], out_len: usize) {
    let alone = run_op(op.clone(), inputs).expect("runs");
    let mut b = GraphBuilder::new("garbage");
    let vs: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| b.input(&format!("x{i}"), t.ty().clone()).expect("name"))
        .collect();
    let g = b.input("g", ty(DType::F32, &[out_len])).expect("name");
    // `s` is read twice by `m`, so it is not reused in place; it dies after `m`.
    let s = b
        .op("s", Op::Scale { factor: 1000.0 }, &[g])
        .expect("typed");
    let m = b
        .op("m", Op::Binary(castor_ir::BinaryOp::Mul), &[s, s])
        .expect("typed");
    let y = b.op("y", op, &vs).expect("typed");
    b.set_outputs(vec![y, m]);
    let garbage = Tensor::from_f32(DType::F32, [out_len], vec![7.0; out_len]);
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("x{i}")).collect();
    let mut bindings: Vec<(&str, &Tensor)> = names
        .iter()
        .map(|n| n.as_str())
        .zip(inputs.iter().copied())
        .collect();
    bindings.push(("g", &garbage));
    let out = run(&b.finish(), &bindings).expect("runs");
    assert_eq!(out[0], alone);
}

#[test]
fn recycled_buffers_are_fully_overwritten() {
    let mut rng = Rng::new(91);
    let n = 256 * 512;
    let x = rng.tensor(DType::F32, &[256, 512]);
    let w = rng.tensor(DType::F32, &[512, 512]);
    let row = rng.tensor(DType::F32, &[512]);
    check_overwrites(Op::Transpose { perm: vec![1, 0] }, &[&x], n);
    check_overwrites(
        Op::MatMul {
            transpose_a: false,
            transpose_b: false,
        },
        &[&x, &w],
        n,
    );
    check_overwrites(Op::Binary(castor_ir::BinaryOp::Sub), &[&row, &x], n);
    check_overwrites(Op::Concat { axis: 0 }, &[&x, &x], 2 * n);
    check_overwrites(
        Op::Slice {
            axis: 1,
            start: 0,
            end: 256,
        },
        &[&w],
        n / 2,
    );
    let tall = rng.tensor(DType::F32, &[n, 2]);
    let mean = castor_ir::ReduceOp::Mean;
    let reduce = Op::Reduce {
        op: mean,
        axes: vec![1],
        keepdim: false,
    };
    check_overwrites(reduce, &[&tall], n);
    let wide = rng.tensor(DType::F32, &[4, n]);
    check_overwrites(
        Op::Reduce {
            op: castor_ir::ReduceOp::Max,
            axes: vec![0],
            keepdim: false,
        },
        &[&wide],
        n,
    );
    let ids = Tensor::from_i64(DType::I64, [256], (0..256).map(|i| (i * 7) % 512).collect());
    check_overwrites(Op::Embedding { padding: None }, &[&w, &ids], n);
}
