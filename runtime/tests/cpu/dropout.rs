//! Dropout against its definition: the mask of `castor_ir::philox`, kept elements times the
//! F32 `1 / (1 - p)` rounded to the storage dtype once, dropped ones times 0 (so NaN and Inf
//! stay visible, as in PyTorch's `x * mask * scale`); `p = 0` is the identity.

use crate::common::*;
use castor_ir::philox::{dropout_mask, dropout_scale};
use castor_ir::{round_to, DType, Op, Tensor};

fn key(seed: i64, offset: i64) -> Tensor {
    Tensor::from_i64(DType::I64, vec![2], vec![seed, offset])
}

#[test]
fn dropout_keeps_the_philox_mask_and_scales_by_one_over_keep() {
    let mut rng = Rng::new(77);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (p, stream) in [(0.1, 0usize), (0.5, 7), (0.0, 1)] {
            let mut x = rng.tensor(DType::F32, &[3, 5, 11]);
            let mut values = f32s(&x).to_vec();
            values[4] = f32::NAN;
            values[9] = f32::INFINITY;
            values = values.iter().map(|&v| round_to(dtype, v)).collect();
            x = Tensor::from_f32(dtype, vec![3, 5, 11], values.clone());
            let y = run_op(Op::Dropout { p, stream }, &[&x, &key(-5, 3)]).expect("runs");
            let mask = dropout_mask([-5, 3], stream as u32, p, values.len());
            let scale = dropout_scale(p);
            for (i, ((&got, &v), &keep)) in f32s(&y).iter().zip(&values).zip(&mask).enumerate() {
                let want = round_to(dtype, v * if keep { scale } else { 0.0 });
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{dtype} p={p} element {i}: {got} for {want}"
                );
            }
            if p == 0.0 {
                assert!(mask.iter().all(|&k| k));
            }
        }
    }
}

#[test]
fn dropout_keeps_the_mean_and_its_mask_follows_the_key() {
    let n = 1 << 16;
    let ones = Tensor::from_f32(DType::F32, vec![n], vec![1.0; n]);
    let y = run_op(Op::Dropout { p: 0.2, stream: 0 }, &[&ones, &key(1, 0)]).expect("runs");
    let mean = f32s(&y).iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
    // 1/(1-p) = 1.25 times a proportion kept of 0.8 within 5 standard deviations.
    assert!(
        (mean - 1.0).abs() < 5.0 * 1.25 * (0.16 / n as f64).sqrt(),
        "{mean}"
    );
    let again = run_op(Op::Dropout { p: 0.2, stream: 0 }, &[&ones, &key(1, 0)]).expect("runs");
    assert_eq!(f32s(&y), f32s(&again));
    let next = run_op(Op::Dropout { p: 0.2, stream: 0 }, &[&ones, &key(1, 1)]).expect("runs");
    assert_ne!(f32s(&y), f32s(&next));
    // Evaluation mode (a negative offset): the identity.
    let eval = run_op(Op::Dropout { p: 0.2, stream: 0 }, &[&ones, &key(1, -1)]).expect("runs");
    assert!(f32s(&eval).iter().all(|&v| v == 1.0));
}
