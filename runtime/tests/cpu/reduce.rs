//! Sum, mean and max over axis sets, with and without keepdim.

use crate::common::*;
use castor_ir::{DType, Op, ReduceOp, Tensor};

fn naive(op: ReduceOp, x: &[f32], dims: &[usize], axes: &[usize]) -> Vec<f64> {
    let out_dims: Vec<usize> = dims
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
        .collect();
    let n: usize = out_dims.iter().product();
    let mut acc = vec![(0f64, f64::NEG_INFINITY, 0usize); n];
    for (i, &v) in x.iter().enumerate() {
        let o = broadcast_index(&unravel(i, dims), &out_dims);
        acc[o].0 += v as f64;
        acc[o].1 = acc[o].1.max(v as f64);
        acc[o].2 += 1;
    }
    acc.into_iter()
        .map(|(s, m, c)| match op {
            ReduceOp::Sum => s,
            ReduceOp::Mean => s / c as f64,
            ReduceOp::Max => m,
        })
        .collect()
}

#[test]
fn reductions_match_naive() {
    let cases: [(&[usize], &[usize]); 9] = [
        (&[6, 4], &[1]),
        (&[6, 4], &[0]),
        (&[6, 4], &[0, 1]),
        (&[2, 3, 4], &[1]),
        (&[2, 3, 4], &[0, 2]),
        (&[2, 3, 4, 5], &[1, 3]),
        (&[3, 1, 4], &[1]),
        (&[4, 3000], &[0]),
        (&[2, 5000], &[1]),
    ];
    let mut rng = Rng::new(70);
    for (dims, axes) in cases {
        let x = rng.tensor(DType::F32, dims);
        for op in ReduceOp::ALL {
            for keepdim in [false, true] {
                let y = run_op(
                    Op::Reduce {
                        op,
                        axes: axes.to_vec(),
                        keepdim,
                    },
                    &[&x],
                )
                .expect("runs");
                let want_dims: Vec<usize> = dims
                    .iter()
                    .enumerate()
                    .filter_map(|(i, &d)| match (axes.contains(&i), keepdim) {
                        (false, _) => Some(d),
                        (true, true) => Some(1),
                        (true, false) => None,
                    })
                    .collect();
                assert_eq!(y.shape().dims(), want_dims.as_slice());
                assert_close(f32s(&y), &naive(op, f32s(&x), dims, axes), 1e-6);
            }
        }
    }
}

#[test]
fn reductions_over_empty_axes() {
    let x = Tensor::from_f32(DType::F32, [0, 3], vec![]);
    let sum = run_op(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![0],
            keepdim: false,
        },
        &[&x],
    )
    .expect("runs");
    assert_eq!(f32s(&sum), &[0.0; 3]);
    let mean = run_op(
        Op::Reduce {
            op: ReduceOp::Mean,
            axes: vec![0],
            keepdim: false,
        },
        &[&x],
    )
    .expect("runs");
    assert!(f32s(&mean).iter().all(|v| v.is_nan()));
    let err = run_op(
        Op::Reduce {
            op: ReduceOp::Max,
            axes: vec![0],
            keepdim: false,
        },
        &[&x],
    )
    .unwrap_err();
    assert!(err.to_string().contains("max over an empty axis"), "{err}");
}
