//! Reshape, transpose, slice, concat and split, for float, int and bool tensors.

use crate::common::*;
use castor_ir::{DType, Op, Tensor};

fn iota(dims: &[usize]) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::from_f32(
        DType::F32,
        dims.to_vec(),
        (0..n).map(|i| i as f32).collect(),
    )
}

fn naive_transpose(x: &[f32], dims: &[usize], perm: &[usize]) -> Vec<f32> {
    let out: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let s = strides(dims);
    (0..x.len())
        .map(|i| {
            let idx = unravel(i, &out);
            x[perm
                .iter()
                .enumerate()
                .map(|(k, &p)| idx[k] * s[p])
                .sum::<usize>()]
        })
        .collect()
}

#[test]
fn transpose_matches_naive() {
    let cases: [(&[usize], &[usize]); 7] = [
        (&[2, 3], &[1, 0]),
        (&[2, 5, 3, 4], &[0, 2, 1, 3]),
        (&[2, 3, 4], &[2, 0, 1]),
        (&[2, 3, 4, 5], &[3, 1, 0, 2]),
        (&[1, 3, 1, 4], &[2, 3, 0, 1]),
        (&[4, 3], &[0, 1]),
        (&[8, 128, 6, 32], &[0, 2, 1, 3]),
    ];
    for (dims, perm) in cases {
        let x = iota(dims);
        let y = run_op(
            Op::Transpose {
                perm: perm.to_vec(),
            },
            &[&x],
        )
        .expect("runs");
        assert_eq!(
            f32s(&y),
            naive_transpose(f32s(&x), dims, perm).as_slice(),
            "{dims:?} {perm:?}"
        );
    }
}

#[test]
fn transpose_of_ints_and_bools() {
    let x = Tensor::from_i64(DType::I32, [2, 3], vec![1, 2, 3, 4, 5, 6]);
    let y = run_op(Op::Transpose { perm: vec![1, 0] }, &[&x]).expect("runs");
    assert_eq!(y.dtype(), DType::I32);
    assert_eq!(y.as_i64(), Some(&[1, 4, 2, 5, 3, 6][..]));
    let x = Tensor::from_bool([2, 2], vec![true, false, false, false]);
    let y = run_op(Op::Transpose { perm: vec![1, 0] }, &[&x]).expect("runs");
    assert_eq!(y.as_bool(), Some(&[true, false, false, false][..]));
}

#[test]
fn reshape_keeps_data() {
    let x = iota(&[2, 6]);
    let y = run_op(
        Op::Reshape {
            shape: vec![3, 1, 4],
        },
        &[&x],
    )
    .expect("runs");
    assert_eq!(y.shape().dims(), &[3, 1, 4]);
    assert_eq!(f32s(&y), f32s(&x));
}

#[test]
fn slice_along_each_axis() {
    let x = iota(&[2, 3, 4]);
    let y = run_op(
        Op::Slice {
            axis: 1,
            start: 1,
            end: 3,
        },
        &[&x],
    )
    .expect("runs");
    let want: Vec<f32> = [4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23]
        .iter()
        .map(|&v| v as f32)
        .collect();
    assert_eq!(f32s(&y), want.as_slice());
    let y = run_op(
        Op::Slice {
            axis: 2,
            start: 3,
            end: 4,
        },
        &[&x],
    )
    .expect("runs");
    assert_eq!(f32s(&y), &[3.0, 7.0, 11.0, 15.0, 19.0, 23.0]);
    let y = run_op(
        Op::Slice {
            axis: 0,
            start: 1,
            end: 1,
        },
        &[&x],
    )
    .expect("runs");
    assert_eq!(y.numel(), 0);
}

#[test]
fn concat_and_split_are_inverses() {
    let a = iota(&[2, 1, 3]);
    let b = Tensor::from_f32(
        DType::F32,
        [2, 2, 3],
        (100..112).map(|v| v as f32).collect(),
    );
    let y = run_op(Op::Concat { axis: 1 }, &[&a, &b]).expect("runs");
    let want: Vec<f32> = [
        0, 1, 2, 100, 101, 102, 103, 104, 105, 3, 4, 5, 106, 107, 108, 109, 110, 111,
    ]
    .iter()
    .map(|&v| v as f32)
    .collect();
    assert_eq!(f32s(&y), want.as_slice());

    let mut g = castor_ir::GraphBuilder::new("split");
    let x = g.input("x", y.ty().clone()).expect("name");
    let parts = g
        .op_multi(
            "p",
            Op::Split {
                axis: 1,
                sizes: vec![1, 2],
            },
            &[x],
        )
        .expect("typed");
    g.set_outputs(parts);
    let out = run(&g.finish(), &[("x", &y)]).expect("runs");
    assert_eq!(out, vec![a, b]);
}

#[test]
fn concat_of_ints() {
    let a = Tensor::from_i64(DType::I64, [2], vec![1, 2]);
    let b = Tensor::from_i64(DType::I64, [1], vec![3]);
    let y = run_op(Op::Concat { axis: 0 }, &[&a, &b]).expect("runs");
    assert_eq!(y.as_i64(), Some(&[1, 2, 3][..]));
}
