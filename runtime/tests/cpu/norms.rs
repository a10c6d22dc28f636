//! Layer norm and RMS norm against naive F64 references.

use crate::common::*;
use castor_ir::{DType, Op, Tensor};

fn naive_layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f64) -> Vec<f64> {
    let h = w.len();
    x.chunks(h)
        .flat_map(|row| {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            row.iter()
                .zip(w.iter().zip(b))
                .map(move |(&v, (&w, &b))| (v as f64 - mean) * rstd * w as f64 + b as f64)
        })
        .collect()
}

#[test]
fn layer_norm_matches_naive_f64() {
    let mut rng = Rng::new(40);
    for dims in [&[2, 3, 8][..], &[5, 768], &[64, 257]] {
        let h = dims[dims.len() - 1];
        // An offset mean, to exercise the two-pass variance.
        let x = Tensor::from_f32(
            DType::F32,
            dims.to_vec(),
            rng.vec(dims.iter().product())
                .iter()
                .map(|v| v * 3.0 + 10.0)
                .collect(),
        );
        let w = rng.tensor(DType::F32, &[h]);
        let b = rng.tensor(DType::F32, &[h]);
        let y = run_op(Op::LayerNorm { eps: 1e-5 }, &[&x, &w, &b]).expect("runs");
        assert_close(
            f32s(&y),
            &naive_layer_norm(f32s(&x), f32s(&w), f32s(&b), 1e-5),
            2e-6,
        );
    }
}

#[test]
fn layer_norm_hand_computed() {
    let x = Tensor::from_f32(DType::F32, [1, 4], vec![1.0, 2.0, 3.0, 4.0]);
    let w = Tensor::from_f32(DType::F32, [4], vec![1.0; 4]);
    let b = Tensor::from_f32(DType::F32, [4], vec![0.0, 0.0, 0.0, 1.0]);
    let y = run_op(Op::LayerNorm { eps: 0.0 }, &[&x, &w, &b]).expect("runs");
    // mean 2.5, var 1.25.
    let s = 1.25f64.sqrt();
    assert_close(
        f32s(&y),
        &[-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s + 1.0],
        1e-6,
    );
}

#[test]
fn rms_norm_matches_naive_f64() {
    let mut rng = Rng::new(41);
    let x = rng.tensor(DType::F32, &[3, 5, 96]);
    let w = rng.tensor(DType::F32, &[96]);
    let y = run_op(Op::RmsNorm { eps: 1e-6 }, &[&x, &w]).expect("runs");
    let want: Vec<f64> = f32s(&x)
        .chunks(96)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 96.0;
            let r = 1.0 / (ms + 1e-6).sqrt();
            row.iter()
                .zip(f32s(&w))
                .map(move |(&v, &w)| v as f64 * r * w as f64)
        })
        .collect();
    assert_close(f32s(&y), &want, 2e-6);
}

#[test]
fn norms_may_write_another_dtype() {
    // A layer norm reading F32 and writing BF16 rounds its F32 result.
    let mut rng = Rng::new(42);
    let x = rng.tensor(DType::F32, &[4, 16]);
    let w = rng.tensor(DType::F32, &[16]);
    let b = rng.tensor(DType::F32, &[16]);
    let g = op_graph(
        Op::LayerNorm { eps: 1e-5 },
        &[&x, &w, &b],
        Some(DType::BF16),
    );
    let y = run(&g, &[("x0", &x), ("x1", &w), ("x2", &b)])
        .expect("runs")
        .remove(0);
    let full = run_op(Op::LayerNorm { eps: 1e-5 }, &[&x, &w, &b]).expect("runs");
    let want: Vec<f32> = f32s(&full)
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(f32s(&y), want.as_slice());
}
