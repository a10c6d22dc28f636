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

/// A cast to an FP8 dtype rounds to nearest even, saturating: finite overflow and infinities
/// become ±max, NaN stays NaN, ties go to the even mantissa, subnormals are exact. Casting
/// back is exact, and layout ops move FP8 values (an E5M2 infinity read from bytes included)
/// without rounding them again.
#[test]
fn float_to_fp8_rounds_saturating() {
    use castor_ir::fp8::{Fp8Format, Overflow};
    let x = Tensor::from_f32(
        DType::F32,
        [11],
        vec![
            1000.0,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            464.0,                // E4M3: the tie above 448 goes to 448
            61440.0,              // E5M2: the tie above 57344 overflows, so saturates
            0.0175,               // between 1.0 and 1.125 times 2^-6
            3.0 * 2f32.powi(-10), // E4M3: a subnormal tie, to even (2^-8)
            -0.0,
            1e-30,
        ],
    );
    let e4m3 = cast(&x, DType::F8E4M3);
    let want = [
        448.0,
        -448.0,
        448.0,
        -448.0,
        f32::NAN,
        448.0,
        448.0,
        0.017578125,
        2f32.powi(-8),
        -0.0,
        0.0,
    ];
    let e5m2 = cast(&x, DType::F8E5M2);
    let want5 = [
        1024.0,
        -57344.0,
        57344.0,
        -57344.0,
        f32::NAN,
        448.0,
        57344.0,
        0.015625, // 1.12 times 2^-6 is nearer 1.0 than 1.25
        3.0 * 2f32.powi(-10),
        -0.0,
        0.0,
    ];
    for (y, want, format) in [
        (&e4m3, &want, Fp8Format::E4M3),
        (&e5m2, &want5, Fp8Format::E5M2),
    ] {
        for (i, (&g, &w)) in f32s(y).iter().zip(want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{format} {i}: {g:e} vs {w:e}"
            );
            let x = f32s(&x)[i];
            let one = format.decode(format.encode(x, Overflow::Saturate));
            assert!(g.to_bits() == one.to_bits() || (g.is_nan() && one.is_nan()));
        }
        // Back to F32 and BF16 exactly (every FP8 value is a BF16 value).
        let back = cast(y, DType::F32);
        assert_eq!(
            f32s(&back).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            f32s(y).iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            f32s(&cast(y, DType::BF16))[..4],
            f32s(y)[..4],
            "{format} to bf16"
        );
    }
    // From BF16 through its exact value: the BF16 infinity saturates too.
    let g = Tensor::from_f32(DType::BF16, [2], vec![f32::INFINITY, 0.3]);
    assert_eq!(f32s(&cast(&g, DType::F8E5M2)), &[57344.0, 0.3125]);
    // A transpose moves an E5M2 infinity as it is; a cast to E5M2 saturates it.
    let bytes = [0x7C, 0xFC, 0x3C, 0x7B];
    let stored = Tensor::from_fp8_bytes(DType::F8E5M2, [2, 2], &bytes);
    let t = run_op(Op::Transpose { perm: vec![1, 0] }, &[&stored]).expect("runs");
    assert_eq!(t.dtype(), DType::F8E5M2);
    assert_eq!(f32s(&t), &[f32::INFINITY, 1.0, f32::NEG_INFINITY, 57344.0]);
    assert_eq!(t.fp8_bytes().unwrap(), [0x7C, 0x3C, 0xFC, 0x7B]);
    assert_eq!(
        f32s(&cast(&stored, DType::F8E5M2)),
        &[57344.0, -57344.0, 1.0, 57344.0]
    );
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
