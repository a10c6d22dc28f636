//! Matrix products against a naive triple loop, over transposes, batch broadcasting and the
//! shapes the executor folds or parallelizes.

use crate::common::*;
use castor_ir::{DType, Op, Tensor};

/// `a @ b` with optional transposes and broadcast batch dims, in F64.
pub fn naive_matmul(a: &Tensor, ta: bool, b: &Tensor, tb: bool) -> (Vec<usize>, Vec<f64>) {
    let (ad, bd) = (a.shape().dims(), b.shape().dims());
    let (ar, br) = (ad.len(), bd.len());
    let (m, k) = if ta {
        (ad[ar - 1], ad[ar - 2])
    } else {
        (ad[ar - 2], ad[ar - 1])
    };
    let n = if tb { bd[br - 2] } else { bd[br - 1] };
    let batch =
        castor_ir::Shape::broadcast(&ad[..ar - 2].to_vec().into(), &bd[..br - 2].to_vec().into())
            .expect("batch dims broadcast")
            .0;
    let (av, bv) = (f32s(a), f32s(b));
    let nb: usize = batch.iter().product();
    let mut out = Vec::with_capacity(nb * m * n);
    for bi in 0..nb {
        let idx = unravel(bi, &batch);
        let a_off = broadcast_index(&idx, &ad[..ar - 2]) * ad[ar - 2] * ad[ar - 1];
        let b_off = broadcast_index(&idx, &bd[..br - 2]) * bd[br - 2] * bd[br - 1];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for l in 0..k {
                    let x = if ta {
                        av[a_off + l * m + i]
                    } else {
                        av[a_off + i * k + l]
                    };
                    let y = if tb {
                        bv[b_off + j * k + l]
                    } else {
                        bv[b_off + l * n + j]
                    };
                    s += x as f64 * y as f64;
                }
                out.push(s);
            }
        }
    }
    let mut dims = batch;
    dims.extend([m, n]);
    (dims, out)
}

/// Runs `a @ b` for every transpose combination, storing operands transposed as needed.
fn check(a_dims: &[usize], b_dims: &[usize], seed: u64) {
    let mut rng = Rng::new(seed);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let stored = |dims: &[usize], t: bool| {
            let mut d = dims.to_vec();
            let r = d.len();
            if t {
                d.swap(r - 1, r - 2);
            }
            d
        };
        let a = rng.tensor(DType::F32, &stored(a_dims, ta));
        let b = rng.tensor(DType::F32, &stored(b_dims, tb));
        let op = Op::MatMul {
            transpose_a: ta,
            transpose_b: tb,
        };
        let y = run_op(op, &[&a, &b]).expect("matmul runs");
        let (dims, want) = naive_matmul(&a, ta, &b, tb);
        assert_eq!(y.shape().dims(), dims.as_slice());
        assert_close(f32s(&y), &want, 1e-5);
    }
}

#[test]
fn plain_2d_with_odd_sizes() {
    check(&[7, 13], &[13, 5], 1);
    check(&[1, 1], &[1, 1], 2);
    check(&[3, 1], &[1, 4], 3);
}

#[test]
fn batch_dims_broadcast() {
    check(&[2, 3, 1, 4, 5], &[2, 1, 3, 5, 6], 4);
    check(&[4, 5], &[3, 5, 6], 5);
    check(&[2, 1, 4, 5], &[3, 5, 2], 6);
}

#[test]
fn projection_folds_batch_into_rows() {
    // [B, T, C] x [C, N]: one GEMM of B*T rows.
    check(&[2, 7, 12], &[12, 9], 7);
}

#[test]
fn grouped_query_attention_shapes() {
    // q [B, Hkv, G, T, D] x k^T [B, Hkv, 1, D, T].
    check(&[2, 2, 3, 5, 4], &[2, 2, 1, 4, 5], 8);
}

#[test]
fn large_products_use_threads() {
    check(&[130, 70], &[70, 90], 9);
    check(&[16, 33, 17], &[16, 17, 29], 10);
    check(&[3, 64, 96], &[96, 80], 11);
}

#[test]
fn empty_inner_dimension_gives_zeros() {
    let a = Tensor::from_f32(DType::F32, [2, 0], vec![]);
    let b = Tensor::from_f32(DType::F32, [0, 3], vec![]);
    let op = Op::MatMul {
        transpose_a: false,
        transpose_b: false,
    };
    let y = run_op(op, &[&a, &b]).expect("matmul runs");
    assert_eq!(f32s(&y), &[0.0; 6]);
}

/// A product that adds into its addend (`matmul_add`) is the product scaled by alpha, plus the
/// addend, in F32, rounded once to the result: in F32 with a power-of-two alpha the separate
/// `scale` and `add` bit for bit; in BF16 one rounding of the F32 sum (the separate ops round
/// the product, the scaled product and the sum).
#[test]
fn a_product_adds_into_its_addend_before_one_rounding() {
    let mut rng = Rng::new(5);
    for dtype in [DType::F32, DType::BF16] {
        let a = rng.tensor(dtype, &[3, 7, 5]);
        let b = rng.tensor(dtype, &[6, 5]);
        let c = rng.tensor(dtype, &[3, 7, 6]);
        let fused = run_op(
            Op::MatMulAdd {
                transpose_a: false,
                transpose_b: true,
                alpha: 2.0,
            },
            &[&a, &b, &c],
        )
        .expect("matmul_add runs");
        // The product of the operands widened to F32 (exactly) is the F32 accumulator.
        let wide = |t: &Tensor| Tensor::from_f32(DType::F32, t.shape().clone(), f32s(t).to_vec());
        let product = Op::MatMul {
            transpose_a: false,
            transpose_b: true,
        };
        let acc = run_op(product, &[&wide(&a), &wide(&b)]).expect("matmul runs");
        let sum: Vec<f32> = f32s(&acc)
            .iter()
            .zip(f32s(&c))
            .map(|(p, c)| p * 2.0 + c)
            .collect();
        let want = Tensor::from_f32(dtype, c.shape().clone(), sum);
        assert_eq!(fused, want, "{dtype}");
    }
    // The separate ops in F32, which the epilogue pass replaces in F32 plans.
    let (a, b, c) = (
        rng.tensor(DType::F32, &[4, 5]),
        rng.tensor(DType::F32, &[5, 3]),
        rng.tensor(DType::F32, &[4, 3]),
    );
    let fused = run_op(
        Op::MatMulAdd {
            transpose_a: false,
            transpose_b: false,
            alpha: 0.5,
        },
        &[&a, &b, &c],
    )
    .unwrap();
    let product = run_op(
        Op::MatMul {
            transpose_a: false,
            transpose_b: false,
        },
        &[&a, &b],
    )
    .unwrap();
    let scaled = run_op(Op::Scale { factor: 0.5 }, &[&product]).unwrap();
    let separate = run_op(Op::Binary(castor_ir::BinaryOp::Add), &[&c, &scaled]).unwrap();
    assert_eq!(fused, separate);
}
