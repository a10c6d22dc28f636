//! Sum, mean and max over a set of axes.
//!
//! The shape is coalesced into `[outer, reduced, inner]` when the reduced axes are adjacent
//! (the common cases: a trailing axis, or leading axes as in bias gradients); otherwise the
//! reduced axes are first transposed to the end. Sums accumulate in F64.

use super::layout::transpose;
use super::math;
use super::par::for_each_block;
use super::pool;
use castor_ir::ReduceOp;

/// Column blocks for reductions whose output rows are long.
const COLUMNS: usize = 512;

/// Reduces `x` (shape `dims`) over `axes` (distinct, in range). The result is in row-major
/// order of the kept axes, so it serves `keepdim` either way. `None` for a max over an empty
/// axis, which has no value.
pub fn reduce(op: ReduceOp, x: &[f32], dims: &[usize], axes: &[usize]) -> Option<Vec<f32>> {
    let reduced: Vec<bool> = (0..dims.len()).map(|i| axes.contains(&i)).collect();
    let count: usize = dims
        .iter()
        .zip(&reduced)
        .filter(|(_, &r)| r)
        .map(|(d, _)| d)
        .product();
    let kept: usize = dims
        .iter()
        .zip(&reduced)
        .filter(|(_, &r)| !r)
        .map(|(d, _)| d)
        .product();
    if kept == 0 {
        return Some(Vec::new());
    }
    if count == 0 {
        return match op {
            ReduceOp::Sum => Some(vec![0.0; kept]),
            ReduceOp::Mean => Some(vec![f32::NAN; kept]),
            ReduceOp::Max => None,
        };
    }

    // Runs of (size, reduced?) with size-1 dims dropped and same-kind neighbours merged.
    let mut runs: Vec<(usize, bool)> = Vec::new();
    for (&d, &r) in dims.iter().zip(&reduced) {
        match runs.last_mut() {
            _ if d == 1 => {}
            Some((size, kind)) if *kind == r => *size *= d,
            _ => runs.push((d, r)),
        }
    }
    let (outer, inner) = match runs.as_slice() {
        // One element per result: a max is that element; a sum (and a mean) starts from +0,
        // as PyTorch's and the kernels' do, so -0 becomes +0 and nothing else changes.
        [] | [(_, false)] => {
            return Some(match op {
                ReduceOp::Max => x.to_vec(),
                ReduceOp::Sum | ReduceOp::Mean => x.iter().map(|&v| v + 0.0).collect(),
            })
        }
        [(_, true)] => (1, 1),
        [(_, true), (i, false)] => (1, *i),
        [(o, false), (_, true)] => (*o, 1),
        [(o, false), (_, true), (i, false)] => (*o, *i),
        _ => {
            let perm: Vec<usize> = (0..dims.len())
                .filter(|&i| !reduced[i])
                .chain((0..dims.len()).filter(|&i| reduced[i]))
                .collect();
            return Some(reduce_rows(op, &transpose(x, dims, &perm), kept, count));
        }
    };
    Some(if inner == 1 {
        reduce_rows(op, x, outer, count)
    } else {
        reduce_columns(op, x, outer, count, inner)
    })
}

/// Reduces each of `outer` contiguous rows of `len` elements.
fn reduce_rows(op: ReduceOp, x: &[f32], outer: usize, len: usize) -> Vec<f32> {
    let mut out = pool::buffer(outer);
    for_each_block(&mut out, 1, len, |o, dst| {
        let row = &x[o * len..(o + 1) * len];
        dst[0] = match op {
            ReduceOp::Sum => math::sum(row) as f32,
            ReduceOp::Mean => (math::sum(row) / len as f64) as f32,
            ReduceOp::Max => math::max(row),
        };
    });
    out
}

/// Reduces `x` viewed as `[outer, len, inner]` over the middle axis.
fn reduce_columns(op: ReduceOp, x: &[f32], outer: usize, len: usize, inner: usize) -> Vec<f32> {
    let mut out = pool::buffer(outer * inner);
    // Output columns `j0..j0 + dst.len()` of output row `o`.
    let columns = |o: usize, j0: usize, dst: &mut [f32]| {
        let width = dst.len();
        let rows = (0..len).map(|r| &x[(o * len + r) * inner + j0..][..width]);
        match op {
            ReduceOp::Max => {
                dst.fill(f32::NEG_INFINITY);
                for src in rows {
                    for (d, &v) in dst.iter_mut().zip(src) {
                        *d = math::max2(*d, v);
                    }
                }
            }
            ReduceOp::Sum | ReduceOp::Mean => {
                let mut acc = vec![0f64; dst.len()];
                for src in rows {
                    for (a, &v) in acc.iter_mut().zip(src) {
                        *a += v as f64;
                    }
                }
                let div = if op == ReduceOp::Mean {
                    len as f64
                } else {
                    1.0
                };
                for (d, a) in dst.iter_mut().zip(acc) {
                    *d = (a / div) as f32;
                }
            }
        }
    };
    if inner < 4 * COLUMNS {
        for_each_block(&mut out, inner, inner * len, |o, dst| columns(o, 0, dst));
    } else {
        for (o, row) in out.chunks_mut(inner).enumerate() {
            for_each_block(row, COLUMNS, COLUMNS * len, |c, dst| {
                columns(o, c * COLUMNS, dst)
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sum over a size-1 axis starts from +0 as PyTorch's does: -0 becomes +0 (a max keeps
    /// it), so the CPU and the kernels agree on the sign of a zero gradient.
    #[test]
    fn a_sum_over_one_element_starts_from_positive_zero() {
        let x = [-0.0f32, 1.5, -2.0];
        let sum = reduce(ReduceOp::Sum, &x, &[1, 3], &[0]).unwrap();
        assert_eq!(
            sum.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            [0.0f32.to_bits(), 1.5f32.to_bits(), (-2.0f32).to_bits()]
        );
        let max = reduce(ReduceOp::Max, &x, &[1, 3], &[0]).unwrap();
        assert_eq!(max[0].to_bits(), (-0.0f32).to_bits());
    }
}
