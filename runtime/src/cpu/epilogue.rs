//! cuBLASLt's matmul epilogues on an F32 product, with their rounding points: the CPU
//! executor runs the epilogue ops with these, and the emulator runs a cuBLASLt product's
//! epilogue with the same functions, so the two agree bit for bit.
//!
//! `acc` is the product as the accumulator holds it (`[rows, n]`, row-major, unrounded);
//! the per-column vectors (bias, bias gradient) have `n` values.

use super::elementwise;
use super::reduce;
use castor_ir::{round_to, DType, ReduceOp, UnaryOp};

/// `acc + bias` in F32, in place: the sum the stored result rounds once (`BIAS`).
pub fn add_bias(acc: &mut [f32], bias: &[f32]) {
    let n = bias.len();
    if n == 0 {
        return;
    }
    for row in acc.chunks_exact_mut(n) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// `GELU_AUX_BIAS`: `acc` becomes the pre-activation `acc + bias` (unrounded) and the
/// returned vector `gelu_tanh` of it, each rounded by whoever stores it.
pub fn bias_gelu(acc: &mut [f32], bias: &[f32]) -> Vec<f32> {
    add_bias(acc, bias);
    let mut out = acc.to_vec();
    elementwise::unary(UnaryOp::GeluTanh, &mut out);
    out
}

/// `DGELU_BGRAD`: `acc` (the incoming gradient's product) becomes `gelu_tanh'(pre) · acc`
/// rounded to `dtype`, the stored gradient; returns the bias gradient, the sum over rows of
/// that stored gradient (F64 sums as every reduction's), one value per column.
pub fn gelu_grad_bias(acc: &mut [f32], pre: &[f32], n: usize, dtype: DType) -> Vec<f32> {
    elementwise::unary_grad(UnaryOp::GeluTanh, pre, acc);
    for v in acc.iter_mut() {
        *v = round_to(dtype, *v);
    }
    let rows = acc.len().checked_div(n).unwrap_or(0);
    reduce::reduce(ReduceOp::Sum, acc, &[rows, n], &[0]).unwrap_or_default()
}

/// `BGRADA`/`BGRADB`: the bias gradient of a weight gradient's product, the sum over the `k`
/// rows of the operand `[k, n]` that holds the output gradient (F64 sums as every reduction's,
/// so the separate `sum` of the same values gives the same bits).
pub fn bias_grad(operand: &[f32], k: usize, n: usize) -> Vec<f32> {
    reduce::reduce(ReduceOp::Sum, operand, &[k, n], &[0]).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One rounding: BF16's unit at 1 is 2^-7; 1 + 0.375 * 2^-7 plus a bias of 0.375 * 2^-7 is
    /// 1 + 0.75 * 2^-7, which rounds up to 1 + 2^-7 when summed first, while each addend alone
    /// rounds down to 1, which two roundings would keep.
    #[test]
    fn the_bias_is_added_before_the_one_rounding() {
        let eps = 0.375 * 2f32.powi(-7);
        let mut acc = vec![1.0 + eps];
        add_bias(&mut acc, &[eps]);
        assert_eq!(round_to(DType::BF16, acc[0]), 1.0 + 2f32.powi(-7));
        let twice = round_to(DType::BF16, round_to(DType::BF16, 1.0 + eps) + eps);
        assert_eq!(twice, 1.0);
    }

    #[test]
    fn gelu_reads_the_unrounded_pre_activation_and_the_bias_gradient_the_stored_one() {
        let mut acc = vec![0.3, -1.2, 2.5, 0.01];
        let out = bias_gelu(&mut acc, &[0.1, -0.2]);
        let mut expect = vec![0.4f32, -1.4, 2.6, -0.19];
        for (a, e) in acc.iter().zip(&expect) {
            assert!((a - e).abs() < 1e-6);
        }
        elementwise::unary(UnaryOp::GeluTanh, &mut expect);
        for (o, e) in out.iter().zip(&expect) {
            assert!((o - e).abs() < 1e-6);
        }
        let pre = acc.clone();
        let mut grad = vec![1.0f32; 4];
        let db = gelu_grad_bias(&mut grad, &pre, 2, DType::BF16);
        assert!(grad.iter().all(|&g| g == round_to(DType::BF16, g)));
        assert_eq!(db, vec![grad[0] + grad[2], grad[1] + grad[3]]);
    }
}
