//! Pointwise ops: unary functions, `scale`, and binary arithmetic with broadcasting.
//!
//! Unary ops and `scale` work in place on a buffer the executor hands over (the operand's own
//! buffer when this node is its last use). Binary ops coalesce the broadcast to
//! `[rows, inner]` walks whose inner loop is a plain slice zip, and can write into the left
//! operand's buffer when it has the output's shape.

use super::math;
use super::par::{for_each_block, for_each_chunk};
use super::simd::multiversion;
use super::strides::{broadcast_strides, coalesce, offset};
use castor_ir::{BinaryOp, UnaryOp};

/// √(2/π), GELU's tanh-approximation constant.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// Applies `op` to every element of `x`, in place.
pub fn unary(op: UnaryOp, x: &mut [f32]) {
    for_each_chunk(x, |_, chunk| unary_chunk(op, chunk));
}

multiversion! {
    fn unary_chunk(op: UnaryOp, x: &mut [f32]) {
        match op {
            // 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), evaluated in HF's `gelu_new` order.
            UnaryOp::GeluTanh => x.iter_mut().for_each(|v| {
                let inner = SQRT_2_OVER_PI * (*v + 0.044_715 * (*v * *v * *v));
                *v = 0.5 * *v * (1.0 + math::tanh_abs(inner));
            }),
            // 0.5 x (1 + erf(x / √2)), as PyTorch's exact GELU.
            UnaryOp::GeluErf => x.iter_mut().for_each(|v| {
                *v = *v * 0.5 * (1.0 + libm::erff(*v * std::f32::consts::FRAC_1_SQRT_2));
            }),
            UnaryOp::Silu => x.iter_mut().for_each(|v| *v /= 1.0 + math::exp(-*v)),
            UnaryOp::Tanh => x.iter_mut().for_each(|v| *v = v.tanh()),
            UnaryOp::Exp => x.iter_mut().for_each(|v| *v = math::exp(*v)),
            UnaryOp::Rsqrt => x.iter_mut().for_each(|v| *v = 1.0 / v.sqrt()),
            UnaryOp::Sqrt => x.iter_mut().for_each(|v| *v = v.sqrt()),
            UnaryOp::Neg => x.iter_mut().for_each(|v| *v = -*v),
        }
    }
}

/// `x * factor`, in place. The factor is rounded to F32 first, as PyTorch does with a Python
/// scalar and an F32 tensor.
pub fn scale(x: &mut [f32], factor: f64) {
    let f = factor as f32;
    for_each_chunk(x, |_, chunk| chunk.iter_mut().for_each(|v| *v *= f));
}

/// The left operand of a binary op: a separate slice, or the output buffer itself (which then
/// holds the left operand, already of the output's shape).
pub enum Lhs<'a> {
    Slice(&'a [f32], &'a [usize]),
    InPlace,
}

/// `out = a op b` with NumPy broadcasting; `out` has the broadcast shape `out_shape`.
pub fn binary(
    op: BinaryOp,
    a: Lhs,
    b: &[f32],
    b_shape: &[usize],
    out: &mut [f32],
    out_shape: &[usize],
) {
    match op {
        BinaryOp::Add => broadcast(a, b, b_shape, out, out_shape, |x, y| x + y),
        BinaryOp::Sub => broadcast(a, b, b_shape, out, out_shape, |x, y| x - y),
        BinaryOp::Mul => broadcast(a, b, b_shape, out, out_shape, |x, y| x * y),
        BinaryOp::Div => broadcast(a, b, b_shape, out, out_shape, |x, y| x / y),
    }
}

/// One operand's view of an output row: a slice as long as the row, or one repeated value.
#[derive(Clone, Copy)]
enum Row<'a> {
    Slice(&'a [f32]),
    Scalar(f32),
}

impl<'a> Row<'a> {
    fn new(data: &'a [f32], start: usize, stride: usize, len: usize) -> Self {
        if stride == 0 {
            Row::Scalar(data[start])
        } else {
            Row::Slice(&data[start..start + len])
        }
    }
}

fn broadcast<F>(a: Lhs, b: &[f32], b_shape: &[usize], out: &mut [f32], out_shape: &[usize], f: F)
where
    F: Fn(f32, f32) -> f32 + Sync,
{
    if out.is_empty() {
        return;
    }
    let (a_data, a_strides) = match a {
        Lhs::Slice(data, shape) => (Some(data), broadcast_strides(shape, out_shape)),
        Lhs::InPlace => (None, broadcast_strides(out_shape, out_shape)),
    };
    let b_strides = broadcast_strides(b_shape, out_shape);
    let (dims, strides) = coalesce(out_shape, &[a_strides, b_strides]);
    let (sa, sb) = (&strides[0], &strides[1]);

    if dims.len() <= 1 {
        // Everything is one contiguous (or scalar) run: split it into chunks.
        let ia = sa.first().copied().unwrap_or(0);
        let ib = sb.first().copied().unwrap_or(0);
        for_each_chunk(out, |start, chunk| {
            let ra = a_data.map(|d| Row::new(d, start * ia, ia, chunk.len()));
            apply(chunk, ra, Row::new(b, start * ib, ib, chunk.len()), &f);
        });
        return;
    }
    let inner = dims[dims.len() - 1];
    let outer = &dims[..dims.len() - 1];
    let (ia, ib) = (sa[sa.len() - 1], sb[sb.len() - 1]);
    for_each_block(out, inner, inner, |row, chunk| {
        let oa = offset(row, outer, &sa[..outer.len()]);
        let ob = offset(row, outer, &sb[..outer.len()]);
        let ra = a_data.map(|d| Row::new(d, oa, ia, inner));
        apply(chunk, ra, Row::new(b, ob, ib, inner), &f);
    });
}

/// `out[j] = f(a[j], b[j])` for one row; `a` is `None` when `out` holds the left operand.
#[inline(always)]
fn apply(out: &mut [f32], a: Option<Row>, b: Row, f: &impl Fn(f32, f32) -> f32) {
    match (a, b) {
        (Some(Row::Slice(x)), Row::Slice(y)) => {
            for ((o, &x), &y) in out.iter_mut().zip(x).zip(y) {
                *o = f(x, y);
            }
        }
        (Some(Row::Slice(x)), Row::Scalar(y)) => {
            for (o, &x) in out.iter_mut().zip(x) {
                *o = f(x, y);
            }
        }
        (Some(Row::Scalar(x)), Row::Slice(y)) => {
            for (o, &y) in out.iter_mut().zip(y) {
                *o = f(x, y);
            }
        }
        (Some(Row::Scalar(x)), Row::Scalar(y)) => out.fill(f(x, y)),
        (None, Row::Slice(y)) => {
            for (o, &y) in out.iter_mut().zip(y) {
                *o = f(*o, y);
            }
        }
        (None, Row::Scalar(y)) => {
            for o in out.iter_mut() {
                *o = f(*o, y);
            }
        }
    }
}

/// `dy <- f'(x) * dy` for the unary op `f`, in place (`dx` is `dy`'s buffer): the formulas of
/// PyTorch's backward kernels, in F32, with `f'` evaluated at the forward input `x` (and the
/// forward's own `exp`, `tanh` and `rsqrt` where the derivative reuses the forward's value).
pub fn unary_grad(op: UnaryOp, x: &[f32], dy: &mut [f32]) {
    for_each_chunk(dy, |start, chunk| {
        unary_grad_chunk(op, &x[start..start + chunk.len()], chunk)
    });
}

multiversion! {
    fn unary_grad_chunk(op: UnaryOp, x: &[f32], dy: &mut [f32]) {
        let it = dy.iter_mut().zip(x);
        match op {
            // d/dx 0.5 x (1 + t), t = tanh(k (x + 0.044715 x³)):
            // 0.5 (1 + t) + 0.5 x (1 - t²) k (1 + 3 * 0.044715 x²).
            UnaryOp::GeluTanh => it.for_each(|(d, &x)| {
                let x_sq = x * x;
                let t = math::tanh_abs(SQRT_2_OVER_PI * (x + 0.044_715 * (x_sq * x)));
                let inner = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * x_sq);
                *d *= 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * inner;
            }),
            // Φ(x) + x φ(x).
            UnaryOp::GeluErf => it.for_each(|(d, &x)| {
                const INV_SQRT_2PI: f32 = 0.398_942_3;
                let cdf = 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
                let pdf = INV_SQRT_2PI * math::exp(-0.5 * x * x);
                *d *= cdf + x * pdf;
            }),
            // s (1 + x (1 - s)), s = sigmoid(x).
            UnaryOp::Silu => it.for_each(|(d, &x)| {
                let s = 1.0 / (1.0 + math::exp(-x));
                *d *= s * (1.0 + x * (1.0 - s));
            }),
            UnaryOp::Tanh => it.for_each(|(d, &x)| {
                let t = x.tanh();
                *d *= 1.0 - t * t;
            }),
            UnaryOp::Exp => it.for_each(|(d, &x)| *d *= math::exp(x)),
            // -0.5 x^-1.5 = -0.5 rsqrt(x)³.
            UnaryOp::Rsqrt => it.for_each(|(d, &x)| {
                let r = 1.0 / x.sqrt();
                *d *= -0.5 * (r * r * r);
            }),
            // 0.5 / √x.
            UnaryOp::Sqrt => it.for_each(|(d, &x)| *d *= 0.5 / x.sqrt()),
            UnaryOp::Neg => it.for_each(|(d, _)| *d = -*d),
        }
    }
}
