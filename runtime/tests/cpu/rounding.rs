//! Rounding to the dtype the graph records: results are computed in F32 and rounded once,
//! round-to-nearest-even, where they are stored.

use crate::common::*;
use crate::matmul::naive_matmul;
use castor_ir::{DType, Op, Tensor};
use half::{bf16, f16};

/// Values with few mantissa bits, so F32 sums of their products are exact and the reference
/// is the true product.
fn exact_operand(rng: &mut Rng, dtype: DType, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    let v = (0..n)
        .map(|_| (rng.below(65) as f32 - 32.0) / 8.0)
        .collect();
    Tensor::from_f32(dtype, dims.to_vec(), v)
}

fn matmul() -> Op {
    Op::MatMul {
        transpose_a: false,
        transpose_b: false,
    }
}

#[test]
fn matmul_retyped_to_bf16_rounds_exactly() {
    let mut rng = Rng::new(20);
    let a = exact_operand(&mut rng, DType::BF16, &[2, 9, 13]);
    let b = exact_operand(&mut rng, DType::BF16, &[13, 11]);
    let graph = op_graph(matmul(), &[&a, &b], Some(DType::BF16));
    let y = run(&graph, &[("x0", &a), ("x1", &b)])
        .expect("runs")
        .remove(0);
    assert_eq!(y.dtype(), DType::BF16);
    let (_, want) = naive_matmul(&a, false, &b, false);
    let want_f32: Vec<f32> = want.iter().map(|&w| w as f32).collect();
    let rounded: Vec<f32> = want_f32
        .iter()
        .map(|&w| bf16::from_f32(w).to_f32())
        .collect();
    assert_eq!(f32s(&y), rounded.as_slice());
    // The test means something only if rounding changed some values.
    assert!(rounded.iter().zip(&want_f32).any(|(r, w)| r != w));
}

#[test]
fn matmul_retyped_to_f16_rounds_exactly() {
    let mut rng = Rng::new(21);
    let a = Tensor::from_f32(DType::F32, [5, 7], rng.vec(35));
    let b = Tensor::from_f32(DType::F32, [7, 3], rng.vec(21));
    let graph = op_graph(matmul(), &[&a, &b], Some(DType::F16));
    let y = run(&graph, &[("x0", &a), ("x1", &b)])
        .expect("runs")
        .remove(0);
    let full = run_op(matmul(), &[&a, &b]).expect("runs");
    let rounded: Vec<f32> = f32s(&full)
        .iter()
        .map(|&w| f16::from_f32(w).to_f32())
        .collect();
    assert_eq!(f32s(&y), rounded.as_slice());
}

#[test]
fn bf16_operands_written_as_f32_are_not_rounded() {
    let mut rng = Rng::new(22);
    let a = exact_operand(&mut rng, DType::BF16, &[6, 13]);
    let b = exact_operand(&mut rng, DType::BF16, &[13, 4]);
    let graph = op_graph(matmul(), &[&a, &b], Some(DType::F32));
    let y = run(&graph, &[("x0", &a), ("x1", &b)])
        .expect("runs")
        .remove(0);
    let (_, want) = naive_matmul(&a, false, &b, false);
    let want: Vec<f32> = want.iter().map(|&w| w as f32).collect();
    assert_eq!(f32s(&y), want.as_slice());
}

#[test]
fn pointwise_results_round_to_their_dtype() {
    // bf16 spacing at 1 is 2^-7: 1 + 2^-8 and 1 + 3 * 2^-8 are ties, rounded to even.
    let a = Tensor::from_f32(DType::BF16, [2], vec![1.0, 1.0]);
    let b = Tensor::from_f32(DType::BF16, [2], vec![1.0 / 256.0, 3.0 / 256.0]);
    let y = run_op(Op::Binary(castor_ir::BinaryOp::Add), &[&a, &b]).expect("runs");
    let want: Vec<f32> = [1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0]
        .iter()
        .map(|&w: &f32| bf16::from_f32(w).to_f32())
        .collect();
    assert_eq!(f32s(&y), want.as_slice());
    assert_eq!(want, vec![1.0, 1.015625]);
}
