//! cuBLASLt's matmul epilogues on an F32 product, with their rounding points: the CPU
//! executor runs the epilogue ops with these, and the emulator runs a cuBLASLt product's
//! epilogue with the same functions, so the two agree bit for bit.
//!
//! `acc` is the product as the accumulator holds it (`[rows, n]`, row-major, unrounded);
//! the per-column vectors (bias, bias gradient) have `n` values.

use super::elementwise;
use super::reduce;
use castor_ir::{ReduceOp, UnaryOp};

/// `alpha · acc` in F32, in place: the scaled product the stored result rounds once (cuBLAS's
/// `alpha`, a host F32 scalar), as the separate `scale` op multiplies.
pub fn scale(acc: &mut [f32], alpha: f64) {
    let a = alpha as f32;
    acc.iter_mut().for_each(|v| *v *= a);
}

/// `acc + c` in F32, element by element, in place: the sum the stored result rounds once
/// (cuBLAS's `beta = 1` with C the addend), as the separate `add` would add the rounded
/// product.
pub fn add_addend(acc: &mut [f32], c: &[f32]) {
    acc.iter_mut().zip(c).for_each(|(v, c)| *v += c);
}

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

/// `DGELU`: `acc` (the incoming gradient's product, unrounded) becomes `gelu_tanh'(pre) · acc`,
/// which whoever stores it rounds once.
pub fn gelu_grad(acc: &mut [f32], pre: &[f32]) {
    elementwise::unary_grad(UnaryOp::GeluTanh, pre, acc);
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
    use castor_ir::{round_to, DType};

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
    fn gelu_and_its_gradient_read_the_unrounded_values() {
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
        let mut grad = vec![0.5f32; 4];
        gelu_grad(&mut grad, &pre);
        let mut expect = vec![0.5f32; 4];
        elementwise::unary_grad(UnaryOp::GeluTanh, &pre, &mut expect);
        assert_eq!(grad, expect);
    }
}
