//! Gradient ops. Each is checked against central differences of the forward op it is the
//! vector-Jacobian product of, run by the same executor: for a fixed random `r`, the gradient
//! op applied to `dy = r` must match `∂/∂x Σ forward(x) · r`, computed on the host in F64 by
//! perturbing each element of `x` by `±h`. Then the round trips, data errors, ignored rows,
//! and bitwise determinism across thread counts.

use crate::common::*;
use castor_ir::{DType, GraphBuilder, Op, ReduceOp, Tensor, UnaryOp, Value};
use castor_runtime::RuntimeError;

/// Runs `op` on inputs named `x0, x1, ...` and returns all of its results.
fn run_multi(op: Op, inputs: &[&Tensor]) -> Result<Vec<Tensor>, RuntimeError> {
    let mut b = GraphBuilder::new("op");
    let vs: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| b.input(&format!("x{i}"), t.ty().clone()).expect("name"))
        .collect();
    let ys = b.op_multi("y", op, &vs).expect("well-typed op");
    b.set_outputs(ys);
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("x{i}")).collect();
    let bindings: Vec<(&str, &Tensor)> = names
        .iter()
        .map(|n| n.as_str())
        .zip(inputs.iter().copied())
        .collect();
    run(&b.finish(), &bindings)
}

/// `Σ forward(inputs) · r` in F64, with input `which` holding `values`.
fn objective(op: &Op, inputs: &[&Tensor], which: usize, values: Vec<f32>, r: &[f32]) -> f64 {
    let t = Tensor::from_f32(DType::F32, inputs[which].shape().clone(), values);
    let mut args = inputs.to_vec();
    args[which] = &t;
    let y = run_op(op.clone(), &args).expect("forward runs");
    assert_eq!(y.numel(), r.len(), "r must have the forward's shape");
    f32s(&y)
        .iter()
        .zip(r)
        .map(|(&y, &r)| y as f64 * r as f64)
        .sum()
}

/// Central differences of `Σ forward · r` with respect to the F32 input `which`.
fn numeric_grad(forward: &Op, inputs: &[&Tensor], which: usize, r: &[f32], h: f32) -> Vec<f64> {
    let x = f32s(inputs[which]).to_vec();
    (0..x.len())
        .map(|i| {
            let (mut plus, mut minus) = (x.clone(), x.clone());
            plus[i] += h;
            minus[i] -= h;
            // The step actually taken, after rounding to F32.
            let step = plus[i] as f64 - minus[i] as f64;
            (objective(forward, inputs, which, plus, r)
                - objective(forward, inputs, which, minus, r))
                / step
        })
        .collect()
}

/// Asserts `max |got - want| <= tol * max |want|`: a relative error over the whole gradient,
/// since F32 finite differences of tiny entries are mostly noise.
fn assert_grad(what: &str, got: &Tensor, want: &[f64], tol: f64) {
    let got = f32s(got);
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = want.iter().fold(0f64, |m, w| m.max(w.abs()));
    assert!(scale > 1e-3, "{what}: the gradient is degenerate ({scale})");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / scale;
        assert!(
            err <= tol,
            "{what}: element {i}: got {g}, want {w} (relative error {err:e})"
        );
    }
}

const TOL: f64 = 1e-3;
const H: f32 = 1e-2;

fn scaled(rng: &mut Rng, shape: &[usize], scale: f32, offset: f32) -> Tensor {
    let n = shape.iter().product();
    let v = rng.vec(n).iter().map(|x| x * scale + offset).collect();
    Tensor::from_f32(DType::F32, shape.to_vec(), v)
}

#[test]
fn unary_grads_match_finite_differences() {
    let mut rng = Rng::new(900);
    for shape in [&[3, 5][..], &[2, 3, 7]] {
        for u in UnaryOp::ALL {
            // (r)sqrt needs positive inputs away from 0; the others see [-3, 3).
            let x = match u {
                UnaryOp::Rsqrt | UnaryOp::Sqrt => scaled(&mut rng, shape, 0.5, 1.0),
                _ => scaled(&mut rng, shape, 3.0, 0.0),
            };
            let r = rng.tensor(DType::F32, shape);
            let dx = run_op(Op::UnaryGrad(u), &[&x, &r]).expect("grad runs");
            let want = numeric_grad(&Op::Unary(u), &[&x], 0, f32s(&r), H);
            assert_grad(u.grad_name(), &dx, &want, TOL);
        }
    }
}

#[test]
fn unary_grads_match_closed_forms() {
    // Tighter than finite differences: each derivative against its F64 formula.
    let mut rng = Rng::new(901);
    let x = scaled(&mut rng, &[4, 33], 4.0, 0.0);
    let dy = rng.tensor(DType::F32, &[4, 33]);
    let pi = std::f64::consts::PI;
    for u in UnaryOp::ALL {
        let x = match u {
            UnaryOp::Rsqrt | UnaryOp::Sqrt => scaled(&mut rng, &[4, 33], 0.5, 1.0),
            _ => x.clone(),
        };
        let f = |x: f64| -> f64 {
            match u {
                UnaryOp::GeluTanh => {
                    let k = (2.0 / pi).sqrt();
                    let t = (k * (x + 0.044715 * x.powi(3))).tanh();
                    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
                }
                UnaryOp::GeluErf => {
                    let cdf = 0.5 * (1.0 + libm::erf(x / 2f64.sqrt()));
                    cdf + x * (-0.5 * x * x).exp() / (2.0 * pi).sqrt()
                }
                UnaryOp::Silu => {
                    let s = 1.0 / (1.0 + (-x).exp());
                    s * (1.0 + x * (1.0 - s))
                }
                UnaryOp::Tanh => 1.0 - x.tanh().powi(2),
                UnaryOp::Exp => x.exp(),
                UnaryOp::Rsqrt => -0.5 * x.powf(-1.5),
                UnaryOp::Sqrt => 0.5 / x.sqrt(),
                UnaryOp::Neg => -1.0,
            }
        };
        let dx = run_op(Op::UnaryGrad(u), &[&x, &dy]).expect("runs");
        let want: Vec<f64> = f32s(&x)
            .iter()
            .zip(f32s(&dy))
            .map(|(&x, &d)| f(x as f64) * d as f64)
            .collect();
        assert_close(f32s(&dx), &want, 1e-5);
    }
}

#[test]
fn layer_norm_grad_matches_finite_differences() {
    let mut rng = Rng::new(902);
    for shape in [&[3, 5][..], &[2, 3, 7]] {
        let hd = shape[shape.len() - 1];
        let x = scaled(&mut rng, shape, 2.0, 0.5);
        let w = scaled(&mut rng, &[hd], 1.0, 1.0);
        let b = rng.tensor(DType::F32, &[hd]);
        let r = rng.tensor(DType::F32, shape);
        let eps = 1e-5;
        let grads = run_multi(Op::LayerNormGrad { eps }, &[&x, &w, &r]).expect("runs");
        assert_eq!(grads.len(), 3);
        let forward = Op::LayerNorm { eps };
        let inputs = [&x, &w, &b];
        for (i, what) in ["dx", "dweight", "dbias"].into_iter().enumerate() {
            let want = numeric_grad(&forward, &inputs, i, f32s(&r), 5e-3);
            assert_grad(what, &grads[i], &want, TOL);
        }
    }
}

#[test]
fn rms_norm_grad_matches_finite_differences() {
    let mut rng = Rng::new(903);
    for shape in [&[3, 5][..], &[2, 3, 7]] {
        let hd = shape[shape.len() - 1];
        let x = scaled(&mut rng, shape, 2.0, 0.3);
        let w = scaled(&mut rng, &[hd], 1.0, 1.0);
        let r = rng.tensor(DType::F32, shape);
        let eps = 1e-6;
        let grads = run_multi(Op::RmsNormGrad { eps }, &[&x, &w, &r]).expect("runs");
        assert_eq!(grads.len(), 2);
        let forward = Op::RmsNorm { eps };
        for (i, what) in ["dx", "dweight"].into_iter().enumerate() {
            let want = numeric_grad(&forward, &[&x, &w], i, f32s(&r), 5e-3);
            assert_grad(what, &grads[i], &want, TOL);
        }
    }
}

/// A norm's backward reads a 16-bit output gradient widened (exactly) and writes dx in the
/// input's dtype: the same bits as after a cast of dy to F32, so autodiff makes no cast.
#[test]
fn norm_grads_read_a_narrower_dy_exactly_and_write_dx_in_the_input_dtype() {
    let mut rng = Rng::new(904);
    let x = rng.tensor(DType::F32, &[3, 8]);
    let w = rng.tensor(DType::F32, &[8]);
    let dy32 = rng.tensor(DType::F32, &[3, 8]);
    let dy16 = Tensor::from_f32(DType::BF16, [3, 8], f32s(&dy32).to_vec());
    for op in [
        Op::LayerNormGrad { eps: 1e-5 },
        Op::RmsNormGrad { eps: 1e-5 },
    ] {
        let cast = run_multi(op.clone(), &[&x, &w, &dy16.clone().to_f32()]).expect("runs");
        let low = run_multi(op, &[&x, &w, &dy16]).expect("runs");
        assert_eq!(low[0].dtype(), DType::F32);
        for (l, e) in low.iter().zip(&cast) {
            assert_eq!(l.dtype(), e.dtype());
            assert_eq!(l, e);
        }
    }
}

/// The F32 copy of a tensor's values (for rebinding a low-precision tensor as F32).
trait ToF32 {
    fn to_f32(self) -> Tensor;
}

impl ToF32 for Tensor {
    fn to_f32(self) -> Tensor {
        Tensor::from_f32(DType::F32, self.shape().clone(), f32s(&self).to_vec())
    }
}

#[test]
fn softmax_grad_matches_finite_differences() {
    let mut rng = Rng::new(905);
    let cases: [(&[usize], bool); 3] = [(&[3, 5], false), (&[2, 3, 7], false), (&[2, 3, 7], true)];
    for (shape, causal) in cases {
        let x = scaled(&mut rng, shape, 2.0, 0.0);
        let r = rng.tensor(DType::F32, shape);
        let forward = Op::Softmax {
            causal,
            window: None,
        };
        let y = run_op(forward.clone(), &[&x]).expect("forward runs");
        let dx = run_op(Op::SoftmaxGrad, &[&y, &r]).expect("grad runs");
        let want = numeric_grad(&forward, &[&x], 0, f32s(&r), H);
        assert_grad("softmax_grad", &dx, &want, TOL);
    }
}

#[test]
fn softmax_grad_through_a_padding_mask() {
    // Masked keys have y = 0, so they get no gradient; rows keep at least one key (a fully
    // masked row is uniform, and softmax_grad then gives PyTorch's gradient through the
    // finite mask, which finite differences of the masked forward cannot see).
    let mut rng = Rng::new(906);
    let x = scaled(&mut rng, &[2, 3, 7], 2.0, 0.0);
    let keep: Vec<bool> = (0..14).map(|i| i % 7 < 4 + i / 7).collect();
    let mask = Tensor::from_bool([2, 1, 7], keep);
    let r = rng.tensor(DType::F32, &[2, 3, 7]);
    let forward = Op::Softmax {
        causal: false,
        window: None,
    };
    let y = run_op(forward.clone(), &[&x, &mask]).expect("forward runs");
    let dx = run_op(Op::SoftmaxGrad, &[&y, &r]).expect("grad runs");
    let want = numeric_grad(&forward, &[&x, &mask], 0, f32s(&r), H);
    assert_grad("masked softmax_grad", &dx, &want, TOL);
    for (i, &g) in f32s(&dx).iter().enumerate() {
        let (b, k) = (i / 21, i % 7);
        if k >= 4 + b {
            assert_eq!(g, 0.0, "masked element {i}");
        }
    }
}

#[test]
fn rope_grad_matches_finite_differences() {
    let mut rng = Rng::new(907);
    for shape in [&[3, 5, 6][..], &[2, 3, 7, 4]] {
        let theta = 10_000.0;
        let x = rng.tensor(DType::F32, shape);
        let r = rng.tensor(DType::F32, shape);
        let dx = run_op(
            Op::RopeGrad {
                theta,
                scaling: castor_ir::RopeScaling::None,
            },
            &[&r],
        )
        .expect("grad runs");
        let want = numeric_grad(
            &Op::Rope {
                theta,
                scaling: castor_ir::RopeScaling::None,
            },
            &[&x],
            0,
            f32s(&r),
            H,
        );
        assert_grad("rope_grad", &dx, &want, TOL);
    }
}

#[test]
fn rope_grad_inverts_rope() {
    let mut rng = Rng::new(908);
    let theta = 500.0;
    let x = rng.tensor(DType::F32, &[2, 3, 9, 8]);
    let mut b = GraphBuilder::new("round_trip");
    let xv = b.input("x", x.ty().clone()).expect("name");
    let y = b
        .op(
            "y",
            Op::Rope {
                theta,
                scaling: castor_ir::RopeScaling::None,
            },
            &[xv],
        )
        .expect("typed");
    let z = b
        .op(
            "z",
            Op::RopeGrad {
                theta,
                scaling: castor_ir::RopeScaling::None,
            },
            &[y],
        )
        .expect("typed");
    b.set_outputs(vec![z]);
    let z = run(&b.finish(), &[("x", &x)]).expect("runs").remove(0);
    let want: Vec<f64> = f32s(&x).iter().map(|&v| v as f64).collect();
    assert_close(f32s(&z), &want, 1e-6);
}

#[test]
fn pad_is_the_transpose_of_slice() {
    let mut rng = Rng::new(909);
    let x = rng.tensor(DType::F32, &[2, 3, 7]);
    for (axis, start, end) in [(2, 2, 5), (0, 1, 2), (1, 0, 3), (1, 1, 2)] {
        let forward = Op::Slice { axis, start, end };
        let mut sliced = vec![2, 3, 7];
        sliced[axis] = end - start;
        let r = rng.tensor(DType::F32, &sliced);
        let pad = Op::Pad {
            axis,
            before: start,
            after: [2, 3, 7][axis] - end,
        };
        let dx = run_op(pad, &[&r]).expect("pad runs");
        assert_eq!(dx.shape().dims(), &[2, 3, 7]);
        let want = numeric_grad(&forward, &[&x], 0, f32s(&r), H);
        assert_grad("pad", &dx, &want, TOL);
    }
}

#[test]
fn broadcast_to_is_the_transpose_of_sum() {
    let mut rng = Rng::new(910);
    let x = rng.tensor(DType::F32, &[2, 3, 7]);
    let cases: [(&[usize], bool, &[usize]); 4] = [
        (&[1], true, &[2, 1, 7]),
        (&[0], false, &[3, 7]),
        (&[0, 2], true, &[1, 3, 1]),
        (&[0, 1, 2], false, &[]),
    ];
    for (axes, keepdim, reduced) in cases {
        let forward = Op::Reduce {
            op: ReduceOp::Sum,
            axes: axes.to_vec(),
            keepdim,
        };
        let r = rng.tensor(DType::F32, reduced);
        let dx = run_op(
            Op::BroadcastTo {
                shape: vec![2, 3, 7],
            },
            &[&r],
        )
        .expect("broadcast runs");
        let want = numeric_grad(&forward, &[&x], 0, f32s(&r), H);
        assert_grad("broadcast_to", &dx, &want, TOL);
    }
}

#[test]
fn embedding_grad_matches_finite_differences() {
    let mut rng = Rng::new(911);
    let table = rng.tensor(DType::F32, &[5, 3]);
    let ids = Tensor::from_i64(DType::I64, [2, 4], vec![1, 4, 1, 0, 4, 4, 2, 1]);
    let r = rng.tensor(DType::F32, &[2, 4, 3]);
    let dt = run_op(
        Op::EmbeddingGrad {
            vocab: 5,
            padding: None,
        },
        &[&ids, &r],
    )
    .expect("grad runs");
    assert_eq!(dt.shape().dims(), &[5, 3]);
    let want = numeric_grad(
        &Op::Embedding { padding: None },
        &[&table, &ids],
        0,
        f32s(&r),
        H,
    );
    assert_grad("embedding_grad", &dt, &want, TOL);
}

#[test]
fn cross_entropy_grad_matches_finite_differences() {
    let mut rng = Rng::new(912);
    let logits = scaled(&mut rng, &[5, 7], 3.0, 0.0);
    let labels = Tensor::from_i64(DType::I64, [5], vec![3, -100, 0, 6, 3]);
    let dloss = Tensor::from_f32(DType::F32, Vec::<usize>::new(), vec![0.7]);
    let forward = Op::CrossEntropy { ignore_index: -100 };
    let dx = run_op(
        Op::CrossEntropyGrad { ignore_index: -100 },
        &[&logits, &labels, &dloss],
    )
    .expect("grad runs");
    let want = numeric_grad(&forward, &[&logits, &labels], 0, &[0.7], H);
    assert_grad("cross_entropy_grad", &dx, &want, TOL);
}

#[test]
fn pad_then_slice_round_trips_every_storage() {
    let pad = Op::Pad {
        axis: 1,
        before: 2,
        after: 1,
    };
    let slice = Op::Slice {
        axis: 1,
        start: 2,
        end: 5,
    };
    let f = Tensor::from_f32(DType::BF16, [2, 3, 2], (1..13).map(|v| v as f32).collect());
    let i = Tensor::from_i64(DType::I32, [2, 3, 2], (1..13).collect());
    let b = Tensor::from_bool([2, 3, 2], vec![true; 12]);
    for x in [f, i, b] {
        let p = run_op(pad.clone(), &[&x]).expect("pad runs");
        assert_eq!(p.dtype(), x.dtype());
        assert_eq!(p.shape().dims(), &[2, 6, 2]);
        // Padding is the dtype's zero: 0, 0 or false.
        let nonzero: Vec<bool> = match p.data() {
            castor_ir::TensorData::F32(v) => v.iter().map(|&v| v != 0.0).collect(),
            castor_ir::TensorData::I64(v) => v.iter().map(|&v| v != 0).collect(),
            castor_ir::TensorData::Bool(v) => v.clone(),
            castor_ir::TensorData::U8(v) => v.iter().map(|&v| v != 0).collect(),
        };
        let want: Vec<bool> = (0..24).map(|k| (2..5).contains(&(k / 2 % 6))).collect();
        assert_eq!(nonzero, want);
        assert_eq!(run_op(slice.clone(), &[&p]).expect("slice runs"), x);
    }
}

#[test]
fn broadcast_to_matches_numpy_for_every_storage() {
    let to = [2, 3, 4];
    for from in [&[3, 1][..], &[2, 1, 4], &[4], &[], &[1, 1, 1], &[2, 3, 4]] {
        let n: usize = from.iter().product();
        let ints: Vec<i64> = (0..n as i64).map(|v| v * 7 - 5).collect();
        let op = Op::BroadcastTo { shape: to.to_vec() };
        let want: Vec<i64> = (0..24)
            .map(|k| ints[broadcast_index(&unravel(k, &to), from)])
            .collect();

        let i = Tensor::from_i64(DType::I64, from.to_vec(), ints.clone());
        let y = run_op(op.clone(), &[&i]).expect("runs");
        assert_eq!(y.as_i64(), Some(want.as_slice()), "{from:?}");

        let f = Tensor::from_f32(
            DType::F16,
            from.to_vec(),
            ints.iter().map(|&v| v as f32).collect(),
        );
        let y = run_op(op.clone(), &[&f]).expect("runs");
        assert_eq!(y.dtype(), DType::F16);
        let wf: Vec<f32> = want.iter().map(|&v| v as f32).collect();
        assert_eq!(f32s(&y), wf.as_slice(), "{from:?}");

        let b = Tensor::from_bool(from.to_vec(), ints.iter().map(|&v| v % 3 == 0).collect());
        let y = run_op(op, &[&b]).expect("runs");
        let wb: Vec<bool> = want.iter().map(|&v| v % 3 == 0).collect();
        assert_eq!(y.as_bool(), Some(wb.as_slice()), "{from:?}");
    }
}

#[test]
fn broadcast_then_sum_round_trips() {
    let mut rng = Rng::new(913);
    let x = rng.tensor(DType::F32, &[3, 1, 5]);
    let mut b = GraphBuilder::new("round_trip");
    let xv = b.input("x", x.ty().clone()).expect("name");
    let y = b
        .op(
            "y",
            Op::BroadcastTo {
                shape: vec![4, 3, 6, 5],
            },
            &[xv],
        )
        .expect("typed");
    let s = b
        .op(
            "s",
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![0, 2],
                keepdim: false,
            },
            &[y],
        )
        .expect("typed");
    b.set_outputs(vec![s]);
    let s = run(&b.finish(), &[("x", &x)]).expect("runs").remove(0);
    let want: Vec<f64> = f32s(&x).iter().map(|&v| v as f64 * 24.0).collect();
    assert_close(f32s(&s), &want, 1e-6);
}

#[test]
fn embedding_grad_sums_repeated_ids() {
    let ids = Tensor::from_i64(DType::I32, [4], vec![2, 0, 2, 2]);
    let dy = Tensor::from_f32(
        DType::BF16,
        [4, 2],
        vec![1.0, 2.0, 10.0, 20.0, 0.5, 0.25, -4.0, 8.0],
    );
    let dt = run_op(
        Op::EmbeddingGrad {
            vocab: 4,
            padding: None,
        },
        &[&ids, &dy],
    )
    .expect("runs");
    assert_eq!(dt.dtype(), DType::F32);
    assert_eq!(
        f32s(&dt),
        &[10.0, 20.0, 0.0, 0.0, -2.5, 10.25, 0.0, 0.0][..]
    );
}

#[test]
fn embedding_grad_rejects_out_of_range_ids() {
    let dy = Tensor::from_f32(DType::F32, [3, 2], vec![1.0; 6]);
    for bad in [4, -1, i64::MAX] {
        let ids = Tensor::from_i64(DType::I64, [3], vec![0, bad, 7]);
        let err = run_op(
            Op::EmbeddingGrad {
                vocab: 4,
                padding: None,
            },
            &[&ids, &dy],
        )
        .expect_err("bad id");
        assert_eq!(
            err,
            RuntimeError::IndexOutOfRange {
                node: "y".into(),
                what: "token id",
                index: bad,
                position: 1,
                limit: 4
            }
        );
    }
}

#[test]
fn cross_entropy_grad_zeroes_ignored_rows() {
    let logits = Tensor::from_f32(
        DType::F32,
        [3, 3],
        vec![1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 5.0, 1.0, 1.0],
    );
    let labels = Tensor::from_i64(DType::I64, [3], vec![2, -100, 0]);
    let dloss = Tensor::from_f32(DType::F32, Vec::<usize>::new(), vec![2.0]);
    let op = Op::CrossEntropyGrad { ignore_index: -100 };
    let dx = run_op(op.clone(), &[&logits, &labels, &dloss]).expect("runs");
    let softmax = |r: [f64; 3]| {
        let s: f64 = r.iter().map(|v| v.exp()).sum();
        r.map(|v| v.exp() / s)
    };
    // Two counted rows: each gets (p - onehot) * 2 / 2.
    let (p0, p2) = (softmax([1.0, 2.0, 3.0]), softmax([5.0, 1.0, 1.0]));
    let want = [
        p0[0],
        p0[1],
        p0[2] - 1.0,
        0.0,
        0.0,
        0.0,
        p2[0] - 1.0,
        p2[1],
        p2[2],
    ];
    assert_close(f32s(&dx), &want, 1e-6);
    assert_eq!(&f32s(&dx)[3..6], &[0.0; 3]);

    // Every row ignored: the loss is NaN (0 / 0) but its gradient is all zeros, as PyTorch's.
    let ignored = Tensor::from_i64(DType::I64, [3], vec![-100; 3]);
    let dx = run_op(op, &[&logits, &ignored, &dloss]).expect("runs");
    assert_eq!(f32s(&dx), &[0.0; 9][..]);
}

#[test]
fn cross_entropy_grad_rejects_out_of_range_labels() {
    let logits = Tensor::from_f32(DType::F32, [2, 3], vec![0.0; 6]);
    let dloss = Tensor::from_f32(DType::F32, Vec::<usize>::new(), vec![1.0]);
    for bad in [3, -1, -101] {
        let labels = Tensor::from_i64(DType::I64, [2], vec![-100, bad]);
        let err = run_op(
            Op::CrossEntropyGrad { ignore_index: -100 },
            &[&logits, &labels, &dloss],
        )
        .expect_err("bad label");
        assert_eq!(
            err,
            RuntimeError::IndexOutOfRange {
                node: "y".into(),
                what: "label",
                index: bad,
                position: 1,
                limit: 3
            }
        );
    }
}

#[test]
fn empty_shapes_give_empty_gradients() {
    let x = Tensor::from_f32(DType::F32, [3, 0], vec![]);
    let w = Tensor::from_f32(DType::F32, [0], vec![]);
    let g = run_multi(Op::LayerNormGrad { eps: 1e-5 }, &[&x, &w, &x]).expect("runs");
    assert!(g.iter().all(|t| t.numel() == 0));
    let g = run_multi(Op::RmsNormGrad { eps: 1e-5 }, &[&x, &w, &x]).expect("runs");
    assert!(g.iter().all(|t| t.numel() == 0));
    assert_eq!(run_op(Op::SoftmaxGrad, &[&x, &x]).expect("runs").numel(), 0);
    assert_eq!(
        run_op(
            Op::RopeGrad {
                theta: 1e4,
                scaling: castor_ir::RopeScaling::None
            },
            &[&x]
        )
        .expect("runs")
        .numel(),
        0
    );
    let ids = Tensor::from_i64(DType::I64, [3], vec![0, 1, 1]);
    let t = run_op(
        Op::EmbeddingGrad {
            vocab: 2,
            padding: None,
        },
        &[&ids, &x],
    )
    .expect("runs");
    assert_eq!(t.shape().dims(), &[2, 0]);
    // No rows at all: a zero table.
    let ids = Tensor::from_i64(DType::I64, [0], vec![]);
    let dy = Tensor::from_f32(DType::F32, [0, 3], vec![]);
    let t = run_op(
        Op::EmbeddingGrad {
            vocab: 2,
            padding: None,
        },
        &[&ids, &dy],
    )
    .expect("runs");
    assert_eq!(f32s(&t), &[0.0; 6][..]);
    let logits = Tensor::from_f32(DType::F32, [0, 4], vec![]);
    let labels = Tensor::from_i64(DType::I64, [0], vec![]);
    let dloss = Tensor::from_f32(DType::F32, Vec::<usize>::new(), vec![1.0]);
    let op = Op::CrossEntropyGrad { ignore_index: -100 };
    assert_eq!(
        run_op(op, &[&logits, &labels, &dloss])
            .expect("runs")
            .numel(),
        0
    );
}

/// Every gradient op on shapes large enough to run in parallel, for the determinism and
/// large-shape checks.
fn large_grads() -> Vec<Vec<Tensor>> {
    let mut rng = Rng::new(914);
    let (rows, hd) = (300, 200);
    let x = scaled(&mut rng, &[rows, hd], 2.0, 0.5);
    let w = rng.tensor(DType::F32, &[hd]);
    let dy = rng.tensor(DType::F32, &[rows, hd]);
    let ids: Vec<i64> = (0..4000).map(|_| rng.below(97) as i64).collect();
    let ids = Tensor::from_i64(DType::I64, [40, 100], ids);
    let dy_e = rng.tensor(DType::F32, &[40, 100, 64]);
    let logits = scaled(&mut rng, &[64, 1000], 5.0, 0.0);
    let labels: Vec<i64> = (0..64)
        .map(|i| {
            if i % 5 == 0 {
                -100
            } else {
                rng.below(1000) as i64
            }
        })
        .collect();
    let labels = Tensor::from_i64(DType::I64, [64], labels);
    let dloss = Tensor::from_f32(DType::F32, Vec::<usize>::new(), vec![1.0]);
    let y = run_op(
        Op::Softmax {
            causal: false,
            window: None,
        },
        &[&x],
    )
    .expect("runs");
    let x4 = x.clone().reshaped([3, 100, 200]);
    vec![
        run_multi(Op::LayerNormGrad { eps: 1e-5 }, &[&x, &w, &dy]).expect("runs"),
        run_multi(Op::RmsNormGrad { eps: 1e-6 }, &[&x, &w, &dy]).expect("runs"),
        run_multi(Op::SoftmaxGrad, &[&y, &dy]).expect("runs"),
        run_multi(Op::UnaryGrad(UnaryOp::GeluTanh), &[&x, &dy]).expect("runs"),
        run_multi(
            Op::RopeGrad {
                theta: 1e4,
                scaling: castor_ir::RopeScaling::None,
            },
            &[&x4],
        )
        .expect("runs"),
        run_multi(
            Op::EmbeddingGrad {
                vocab: 97,
                padding: None,
            },
            &[&ids, &dy_e],
        )
        .expect("runs"),
        run_multi(
            Op::CrossEntropyGrad { ignore_index: -100 },
            &[&logits, &labels, &dloss],
        )
        .expect("runs"),
        run_multi(
            Op::Pad {
                axis: 1,
                before: 3,
                after: 5,
            },
            &[&x],
        )
        .expect("runs"),
        run_multi(
            Op::BroadcastTo {
                shape: vec![4, 300, 200],
            },
            &[&x],
        )
        .expect("runs"),
    ]
}

fn bits(results: &[Vec<Tensor>]) -> Vec<Vec<Vec<u32>>> {
    results
        .iter()
        .map(|ts| {
            ts.iter()
                .map(|t| f32s(t).iter().map(|v| v.to_bits()).collect())
                .collect()
        })
        .collect()
}

#[test]
fn gradients_are_bitwise_deterministic_across_thread_counts() {
    let in_pool = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool")
            .install(large_grads)
    };
    let reference = bits(&large_grads());
    assert_eq!(bits(&large_grads()), reference, "two runs differ");
    assert_eq!(bits(&in_pool(1)), reference, "one thread differs");
    assert_eq!(bits(&in_pool(3)), reference, "three threads differ");
    assert_eq!(bits(&in_pool(8)), reference, "eight threads differ");
}

#[test]
fn large_norm_weight_grads_match_naive_sums() {
    // Many rows, so the weight gradients are summed over several blocks.
    let grads = large_grads();
    let mut rng = Rng::new(914);
    let (rows, hd) = (300, 200);
    let x = scaled(&mut rng, &[rows, hd], 2.0, 0.5);
    let _w = rng.tensor(DType::F32, &[hd]);
    let dy = rng.tensor(DType::F32, &[rows, hd]);
    let (x, dy) = (f32s(&x), f32s(&dy));
    let (mut dw_ln, mut db_ln, mut dw_rms) = (vec![0f64; hd], vec![0f64; hd], vec![0f64; hd]);
    for (xr, dr) in x.chunks(hd).zip(dy.chunks(hd)) {
        let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / hd as f64;
        let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / hd as f64;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        let r =
            1.0 / (xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / hd as f64 + 1e-6).sqrt();
        for i in 0..hd {
            dw_ln[i] += dr[i] as f64 * (xr[i] as f64 - mean) * rstd;
            db_ln[i] += dr[i] as f64;
            dw_rms[i] += dr[i] as f64 * xr[i] as f64 * r;
        }
    }
    assert_close(f32s(&grads[0][1]), &dw_ln, 1e-5);
    assert_close(f32s(&grads[0][2]), &db_ln, 1e-6);
    assert_close(f32s(&grads[1][1]), &dw_rms, 1e-5);
    // The embedding gradient: rows of dy summed per id.
    let mut rng = Rng::new(914);
    let _ = scaled(&mut rng, &[rows, hd], 2.0, 0.5);
    let _ = rng.tensor(DType::F32, &[hd]);
    let _ = rng.tensor(DType::F32, &[rows, hd]);
    let ids: Vec<usize> = (0..4000).map(|_| rng.below(97) as usize).collect();
    let dy_e = rng.tensor(DType::F32, &[40, 100, 64]);
    let mut table = vec![0f64; 97 * 64];
    for (p, &id) in ids.iter().enumerate() {
        for j in 0..64 {
            table[id * 64 + j] += f32s(&dy_e)[p * 64 + j] as f64;
        }
    }
    assert_close(f32s(&grads[5][0]), &table, 1e-6);
}

/// A weight gradient's bias-gradient epilogue (`matmul_bias_grad`) gives the separate `sum`
/// of the output gradient's rows bit for bit, in BF16 as in F32, from either operand; the
/// product is the plain `matmul`'s.
#[test]
fn bias_gradient_epilogue_gives_the_separate_sums_bits() {
    let mut rng = Rng::new(77);
    for dtype in [DType::F32, DType::BF16] {
        let x = rng.tensor(dtype, &[37, 5]);
        let dy = rng.tensor(dtype, &[37, 9]);
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![0],
            keepdim: false,
        };
        // The plan's sum writes F32 from the gradient's values (widened exactly).
        let wide = Tensor::from_f32(DType::F32, dy.shape().clone(), f32s(&dy).to_vec());
        let want = run_op(sum, &[&wide]).expect("sum runs");
        for lhs in [false, true] {
            let ins: [&Tensor; 2] = if lhs { [&dy, &x] } else { [&x, &dy] };
            let fused = run_multi(Op::MatMulBiasGrad { lhs }, &ins).expect("runs");
            let product = run_op(
                Op::MatMul {
                    transpose_a: true,
                    transpose_b: false,
                },
                &ins,
            )
            .expect("matmul runs");
            assert_eq!(fused[0], product, "{dtype} lhs={lhs}: product");
            assert_eq!(fused[1], want, "{dtype} lhs={lhs}: bias gradient");
        }
    }
}
