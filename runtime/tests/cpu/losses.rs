//! Cross-entropy and embedding gathers, including their data errors.

use crate::common::*;
use castor_ir::{DType, Op, Tensor};
use castor_runtime::RuntimeError;

fn ce(ignore_index: i64) -> Op {
    Op::CrossEntropy { ignore_index }
}

#[test]
fn cross_entropy_hand_computed_with_ignored_labels() {
    let logits = Tensor::from_f32(
        DType::F32,
        [3, 3],
        vec![1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 5.0, 1.0, 1.0],
    );
    let labels = Tensor::from_i64(DType::I64, [3], vec![2, -100, 0]);
    let y = run_op(ce(-100), &[&logits, &labels]).expect("runs");
    assert_eq!(y.dtype(), DType::F32);
    assert!(y.shape().dims().is_empty());
    let lse = |r: [f64; 3]| r.iter().map(|v| v.exp()).sum::<f64>().ln();
    let want = ((lse([1.0, 2.0, 3.0]) - 3.0) + (lse([5.0, 1.0, 1.0]) - 5.0)) / 2.0;
    assert_close(f32s(&y), &[want], 1e-6);
}

#[test]
fn cross_entropy_matches_naive_on_large_vocab() {
    let mut rng = Rng::new(80);
    let (n, v) = (9, 5000);
    let logits = Tensor::from_f32(
        DType::F32,
        [n, v],
        rng.vec(n * v).iter().map(|x| x * 30.0).collect(),
    );
    let labels: Vec<i64> = (0..n)
        .map(|i| {
            if i % 4 == 3 {
                -1
            } else {
                rng.below(v as u64) as i64
            }
        })
        .collect();
    let y = run_op(
        ce(-1),
        &[&logits, &Tensor::from_i64(DType::I32, [n], labels.clone())],
    )
    .expect("runs");
    let (mut total, mut count) = (0f64, 0);
    for (row, &l) in f32s(&logits).chunks(v).zip(&labels) {
        if l == -1 {
            continue;
        }
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let lse = row
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        total += lse - row[l as usize] as f64;
        count += 1;
    }
    assert_close(f32s(&y), &[total / count as f64], 1e-6);
}

#[test]
fn cross_entropy_with_every_label_ignored_is_nan() {
    let logits = Tensor::from_f32(DType::F32, [2, 2], vec![0.0; 4]);
    let labels = Tensor::from_i64(DType::I64, [2], vec![-100, -100]);
    let y = run_op(ce(-100), &[&logits, &labels]).expect("runs");
    assert!(f32s(&y)[0].is_nan());
}

#[test]
fn cross_entropy_rejects_out_of_range_labels() {
    let logits = Tensor::from_f32(DType::F32, [2, 3], vec![0.0; 6]);
    for bad in [3, -1] {
        let labels = Tensor::from_i64(DType::I64, [2], vec![0, bad]);
        let err = run_op(ce(-100), &[&logits, &labels]).unwrap_err();
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
fn embedding_gathers_rows() {
    let table = Tensor::from_f32(
        DType::F32,
        [4, 2],
        vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0],
    );
    let ids = Tensor::from_i64(DType::I32, [2, 2], vec![3, 0, 1, 3]);
    let y = run_op(Op::Embedding { padding: None }, &[&table, &ids]).expect("runs");
    assert_eq!(y.shape().dims(), &[2, 2, 2]);
    assert_eq!(f32s(&y), &[30.0, 31.0, 0.0, 1.0, 10.0, 11.0, 30.0, 31.0]);
}

#[test]
fn embedding_rejects_out_of_range_ids() {
    let table = Tensor::from_f32(DType::F32, [4, 2], vec![0.0; 8]);
    for bad in [4, -2, i64::MAX] {
        let ids = Tensor::from_i64(DType::I64, [3], vec![0, 1, bad]);
        let err = run_op(Op::Embedding { padding: None }, &[&table, &ids]).unwrap_err();
        assert_eq!(
            err,
            RuntimeError::IndexOutOfRange {
                node: "y".into(),
                what: "token id",
                index: bad,
                position: 2,
                limit: 4
            }
        );
        let msg = err.to_string();
        assert!(
            msg.contains("%y") && msg.contains(&bad.to_string()) && msg.contains("[0, 4)"),
            "{msg}"
        );
    }
}
