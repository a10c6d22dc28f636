//! Rotary embedding against the direct formula.

use crate::common::*;
use castor_ir::{DType, Op, Tensor};

#[test]
fn rope_matches_direct_formula() {
    let mut rng = Rng::new(60);
    let (t, d, theta) = (7, 8, 10_000.0f64);
    let x = rng.tensor(DType::F32, &[2, 3, t, d]);
    let y = run_op(
        Op::Rope {
            theta,
            scaling: castor_ir::RopeScaling::None,
        },
        &[&x],
    )
    .expect("runs");
    let half = d / 2;
    let want: Vec<f64> = f32s(&x)
        .chunks(d)
        .enumerate()
        .flat_map(|(r, row)| {
            let pos = (r % t) as f64;
            let mut out = vec![0f64; d];
            for i in 0..half {
                let angle = pos * theta.powf(-2.0 * i as f64 / d as f64);
                let (c, s) = (angle.cos(), angle.sin());
                let (x1, x2) = (row[i] as f64, row[i + half] as f64);
                out[i] = x1 * c - x2 * s;
                out[i + half] = x2 * c + x1 * s;
            }
            out
        })
        .collect();
    assert_close(f32s(&y), &want, 2e-6);
}

#[test]
fn position_zero_is_identity_and_position_one_rotates() {
    // D = 2: one frequency, 1; position 1 rotates (1, 0) by one radian.
    let x = Tensor::from_f32(DType::F32, [2, 2], vec![1.0, 0.0, 1.0, 0.0]);
    let y = run_op(
        Op::Rope {
            theta: 10_000.0,
            scaling: castor_ir::RopeScaling::None,
        },
        &[&x],
    )
    .expect("runs");
    assert_close(f32s(&y), &[1.0, 0.0, 1f64.cos(), 1f64.sin()], 1e-7);
}
