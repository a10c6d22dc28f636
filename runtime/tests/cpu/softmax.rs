//! Softmax with the causal and bool masks, including fully masked rows.

use crate::common::*;
use castor_ir::{DType, Op, Tensor};

/// Softmax of each row over the entries `keep(row, j)` allows; uniform if none.
fn naive(x: &[f32], tk: usize, keep: impl Fn(usize, usize) -> bool) -> Vec<f64> {
    x.chunks(tk)
        .enumerate()
        .flat_map(|(r, row)| {
            let allowed: Vec<bool> = (0..tk).map(|j| keep(r, j)).collect();
            if !allowed.iter().any(|&a| a) {
                return vec![1.0 / tk as f64; tk];
            }
            let max = row
                .iter()
                .zip(&allowed)
                .filter(|(_, &a)| a)
                .map(|(&v, _)| v as f64)
                .fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = row
                .iter()
                .zip(&allowed)
                .map(|(&v, &a)| if a { (v as f64 - max).exp() } else { 0.0 })
                .collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|v| v / s).collect()
        })
        .collect()
}

#[test]
fn hand_computed_row() {
    let x = Tensor::from_f32(DType::F32, [3], vec![1.0, 2.0, 3.0]);
    let y = run_op(
        Op::Softmax {
            causal: false,
            window: None,
        },
        &[&x],
    )
    .expect("runs");
    let e = [(-2f64).exp(), (-1f64).exp(), 1.0];
    let s: f64 = e.iter().sum();
    assert_close(f32s(&y), &[e[0] / s, e[1] / s, e[2] / s], 1e-6);
}

#[test]
fn causal_with_fewer_queries_than_keys() {
    // Tq = 3, Tk = 5: query i sees keys j <= i + 2.
    let mut rng = Rng::new(50);
    let x = rng.tensor(DType::F32, &[2, 3, 5]);
    let y = run_op(
        Op::Softmax {
            causal: true,
            window: None,
        },
        &[&x],
    )
    .expect("runs");
    let want = naive(f32s(&x), 5, |r, j| j <= r % 3 + 2);
    assert_close(f32s(&y), &want, 1e-6);
    assert_eq!(&f32s(&y)[3..5], &[0.0, 0.0]);
}

#[test]
fn mask_and_causal_with_a_fully_masked_row() {
    // x [2, 2, 4, 4]; mask [2, 1, 1, 4] keeps batch 0's keys 0..3 and batch 1's key 3 only,
    // so in batch 1 queries 0..2 see nothing (causally they see keys <= i) and are uniform.
    let mut rng = Rng::new(51);
    let x = rng.tensor(DType::F32, &[2, 2, 4, 4]);
    let keep = [true, true, true, false, false, false, false, true];
    let mask = Tensor::from_bool([2, 1, 1, 4], keep.to_vec());
    let y = run_op(
        Op::Softmax {
            causal: true,
            window: None,
        },
        &[&x, &mask],
    )
    .expect("runs");
    let want = naive(f32s(&x), 4, |r, j| {
        let (batch, query) = (r / 8, r % 4);
        j <= query && keep[batch * 4 + j]
    });
    assert_close(f32s(&y), &want, 1e-6);
    // Batch 1, head 0, query 0: fully masked, uniform over all keys.
    assert_eq!(&f32s(&y)[32..36], &[0.25; 4]);
}

#[test]
fn full_mask_shape_and_scalar_mask() {
    let mut rng = Rng::new(52);
    let x = rng.tensor(DType::F32, &[3, 6]);
    let bits: Vec<bool> = (0..18).map(|_| rng.below(3) != 0).collect();
    let mask = Tensor::from_bool([3, 6], bits.clone());
    let y = run_op(
        Op::Softmax {
            causal: false,
            window: None,
        },
        &[&x, &mask],
    )
    .expect("runs");
    assert_close(f32s(&y), &naive(f32s(&x), 6, |r, j| bits[r * 6 + j]), 1e-6);

    let none = Tensor::from_bool(Vec::<usize>::new(), vec![false]);
    let y = run_op(
        Op::Softmax {
            causal: false,
            window: None,
        },
        &[&x, &none],
    )
    .expect("runs");
    assert_eq!(f32s(&y), &[1.0 / 6.0; 18]);
}

#[test]
fn large_rows_match_naive() {
    let mut rng = Rng::new(53);
    let x = Tensor::from_f32(
        DType::F32,
        [4, 64, 64],
        rng.vec(4 * 64 * 64).iter().map(|v| v * 20.0).collect(),
    );
    let y = run_op(
        Op::Softmax {
            causal: true,
            window: None,
        },
        &[&x],
    )
    .expect("runs");
    assert_close(f32s(&y), &naive(f32s(&x), 64, |r, j| j <= r % 64), 1e-6);
}

#[test]
fn empty_rows_and_empty_tensors() {
    let x = Tensor::from_f32(DType::F32, [2, 0], vec![]);
    let mask = Tensor::from_bool([2, 0], vec![]);
    let y = run_op(
        Op::Softmax {
            causal: false,
            window: None,
        },
        &[&x, &mask],
    )
    .expect("runs");
    assert_eq!(y.numel(), 0);
    let x = Tensor::from_f32(DType::F32, [0, 3], vec![]);
    let y = run_op(
        Op::Softmax {
            causal: true,
            window: None,
        },
        &[&x],
    )
    .expect("runs");
    assert_eq!(y.numel(), 0);
}
