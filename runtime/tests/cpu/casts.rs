//! Conversions between every pair of dtype families.

use crate::common::*;
use castor_ir::{DType, Op, Tensor};

fn cast(x: &Tensor, to: DType) -> Tensor {
    let y = run_op(Op::Cast { to }, &[x]).expect("runs");
    assert_eq!(y.dtype(), to);
    y
}

#[test]
fn float_to_float_rounds() {
    let x = Tensor::from_f32(
        DType::F32,
        [3],
        vec![1.0 + 1.0 / 1024.0, 65504.0 * 2.0, 0.1],
    );
    let y = cast(&x, DType::F16);
    let want: Vec<f32> = f32s(&x)
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect();
    assert_eq!(f32s(&y), want.as_slice());
    assert_eq!(f32s(&y)[1], f32::INFINITY);
    let y = cast(&x, DType::BF16);
    let want: Vec<f32> = f32s(&x)
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    assert_eq!(f32s(&y), want.as_slice());
    assert_eq!(f32s(&cast(&y, DType::F32)), want.as_slice());
}

#[test]
fn float_to_int_truncates_toward_zero() {
    let x = Tensor::from_f32(DType::F32, [4], vec![1.9, -1.9, 0.5, 3e9]);
    assert_eq!(
        cast(&x, DType::I64).as_i64(),
        Some(&[1, -1, 0, 3_000_000_000][..])
    );
    assert_eq!(
        cast(&x, DType::I32).as_i64(),
        Some(&[1, -1, 0, i32::MAX as i64][..])
    );
}

#[test]
fn to_and_from_bool() {
    let ints = Tensor::from_i64(DType::I64, [3], vec![0, 7, -1]);
    let b = cast(&ints, DType::Bool);
    assert_eq!(b.as_bool(), Some(&[false, true, true][..]));
    assert_eq!(cast(&b, DType::I32).as_i64(), Some(&[0, 1, 1][..]));
    assert_eq!(f32s(&cast(&b, DType::BF16)), &[0.0, 1.0, 1.0]);
    let floats = Tensor::from_f32(DType::F32, [3], vec![0.0, -0.0, 0.25]);
    assert_eq!(
        cast(&floats, DType::Bool).as_bool(),
        Some(&[false, false, true][..])
    );
}

#[test]
fn int_to_float_and_int() {
    let ints = Tensor::from_i64(DType::I64, [3], vec![3, -2, (1 << 31) + 5]);
    assert_eq!(
        f32s(&cast(&ints, DType::F32)),
        &[3.0, -2.0, 2_147_483_648.0]
    );
    // I32 wraps, as PyTorch's `.to(torch.int32)`.
    assert_eq!(
        cast(&ints, DType::I32).as_i64(),
        Some(&[3, -2, -2_147_483_643][..])
    );
    let small = Tensor::from_i64(DType::I32, [1], vec![257]);
    assert_eq!(f32s(&cast(&small, DType::BF16)), &[256.0]);
}
