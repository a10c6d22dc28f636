//! Unary functions, `scale`, and binary ops with broadcasting.

use crate::common::*;
use castor_ir::{BinaryOp, DType, Op, Tensor, UnaryOp};

fn unary(u: UnaryOp, x: &[f32]) -> Vec<f32> {
    let t = Tensor::from_f32(DType::F32, [x.len()], x.to_vec());
    f32s(&run_op(Op::Unary(u), &[&t]).expect("runs")).to_vec()
}

#[test]
fn unary_hand_computed_values() {
    let got = unary(UnaryOp::GeluErf, &[1.0, 0.0, -1.0]);
    assert_close(&got, &[0.841_344_746, 0.0, -0.158_655_254], 1e-6);
    let got = unary(UnaryOp::GeluTanh, &[1.0, 0.0, -1.0]);
    assert_close(&got, &[0.841_191_990, 0.0, -0.158_808_010], 1e-6);
    let got = unary(UnaryOp::Silu, &[1.0, 0.0, -2.0]);
    assert_close(&got, &[0.731_058_579, 0.0, -0.238_405_844], 1e-6);
    assert_eq!(unary(UnaryOp::Rsqrt, &[4.0, 0.25]), vec![0.5, 2.0]);
    assert_eq!(unary(UnaryOp::Sqrt, &[4.0, 0.25, 0.0]), vec![2.0, 0.5, 0.0]);
    assert_eq!(unary(UnaryOp::Sqrt, &[f32::INFINITY]), vec![f32::INFINITY]);
    assert_eq!(unary(UnaryOp::Neg, &[1.5, -0.0]), vec![-1.5, 0.0]);
    assert_eq!(unary(UnaryOp::Exp, &[0.0]), vec![1.0]);
}

#[test]
fn unary_matches_formulas_on_random_data() {
    let mut rng = Rng::new(30);
    let x: Vec<f32> = rng.vec(50_000).iter().map(|v| v * 8.0).collect();
    let xs: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let c = (2.0 / std::f64::consts::PI).sqrt();
    type Reference<'a> = &'a dyn Fn(f64) -> f64;
    let cases: [(UnaryOp, Reference, f64); 8] = [
        (
            UnaryOp::GeluTanh,
            &|v| 0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh()),
            1e-6,
        ),
        (
            UnaryOp::GeluErf,
            &|v| 0.5 * v * (1.0 + libm::erf(v / 2f64.sqrt())),
            1e-6,
        ),
        (UnaryOp::Silu, &|v| v / (1.0 + (-v).exp()), 1e-6),
        (UnaryOp::Tanh, &f64::tanh, 1e-6),
        (UnaryOp::Exp, &f64::exp, 1e-6),
        (UnaryOp::Rsqrt, &|v| 1.0 / v.abs().sqrt(), 1e-6),
        (UnaryOp::Sqrt, &|v| v.abs().sqrt(), 1e-6),
        (UnaryOp::Neg, &|v| -v, 0.0),
    ];
    for (u, f, tol) in cases {
        let input: Vec<f32> = if matches!(u, UnaryOp::Rsqrt | UnaryOp::Sqrt) {
            x.iter().map(|v| v.abs()).collect()
        } else {
            x.clone()
        };
        let want: Vec<f64> = xs.iter().map(|&v| f(v)).collect();
        assert_close(&unary(u, &input), &want, tol);
    }
}

#[test]
fn scale_multiplies_by_the_f32_factor() {
    let x = Tensor::from_f32(DType::F32, [3], vec![1.0, -2.0, 0.5]);
    let y = run_op(Op::Scale { factor: 0.125 }, &[&x]).expect("runs");
    assert_eq!(f32s(&y), &[0.125, -0.25, 0.0625]);
}

fn naive_binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Vec<f64> {
    let out = castor_ir::Shape::broadcast(a.shape(), b.shape()).expect("broadcasts");
    let n = out.numel().unwrap_or(0);
    (0..n)
        .map(|i| {
            let idx = unravel(i, out.dims());
            let x = f32s(a)[broadcast_index(&idx, a.shape().dims())];
            let y = f32s(b)[broadcast_index(&idx, b.shape().dims())];
            // The same F32 operation the executor does.
            (match op {
                BinaryOp::Add => x + y,
                BinaryOp::Sub => x - y,
                BinaryOp::Mul => x * y,
                BinaryOp::Div => x / y,
            }) as f64
        })
        .collect()
}

#[test]
fn binary_broadcasting_matches_naive() {
    let shapes: [(&[usize], &[usize]); 9] = [
        (&[2, 3, 4], &[2, 3, 4]),
        (&[2, 3, 4], &[4]),
        (&[4], &[2, 3, 4]),
        (&[6, 4], &[6, 1]),
        (&[2, 1, 4], &[3, 1]),
        (&[2, 3, 4], &[]),
        (&[], &[5]),
        (&[3, 1, 5, 1], &[1, 4, 1, 2]),
        (&[64, 300], &[300]),
    ];
    let mut rng = Rng::new(31);
    for (sa, sb) in shapes {
        let a = rng.tensor(DType::F32, sa);
        // Keep divisors away from zero.
        let b = Tensor::from_f32(
            DType::F32,
            sb.to_vec(),
            rng.vec(sb.iter().product())
                .iter()
                .map(|v| v + 2.0)
                .collect(),
        );
        for op in BinaryOp::ALL {
            let y = run_op(Op::Binary(op), &[&a, &b]).expect("runs");
            assert_eq!(
                f32s(&y),
                naive_binary(op, &a, &b)
                    .iter()
                    .map(|&v| v as f32)
                    .collect::<Vec<_>>(),
                "{op:?} {sa:?} {sb:?}"
            );
        }
    }
}

#[test]
fn binary_in_place_paths_keep_operand_order() {
    // Each operand is produced by a node (so the executor owns it and may write into it), and
    // each has the output's shape in turn: sub and div must not swap their operands.
    let mut rng = Rng::new(32);
    for (sa, sb) in [
        (&[3usize, 4][..], &[4usize][..]),
        (&[4][..], &[3, 4][..]),
        (&[3, 4][..], &[3, 4][..]),
    ] {
        let a = rng.tensor(DType::F32, sa);
        let b = Tensor::from_f32(
            DType::F32,
            sb.to_vec(),
            rng.vec(sb.iter().product())
                .iter()
                .map(|v| v + 2.0)
                .collect(),
        );
        for op in BinaryOp::ALL {
            let mut g = castor_ir::GraphBuilder::new("in_place");
            let x0 = g.input("x0", a.ty().clone()).expect("name");
            let x1 = g.input("x1", b.ty().clone()).expect("name");
            let n0 = g.op("n0", Op::Scale { factor: 1.0 }, &[x0]).expect("typed");
            let n1 = g.op("n1", Op::Scale { factor: 1.0 }, &[x1]).expect("typed");
            let y = g.op("y", Op::Binary(op), &[n0, n1]).expect("typed");
            g.set_outputs(vec![y]);
            let y = run(&g.finish(), &[("x0", &a), ("x1", &b)])
                .expect("runs")
                .remove(0);
            let want: Vec<f32> = naive_binary(op, &a, &b).iter().map(|&v| v as f32).collect();
            assert_eq!(f32s(&y), want.as_slice(), "{op:?} {sa:?} {sb:?}");
        }
    }
}
