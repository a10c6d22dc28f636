//! Softmax over the last axis, in place, with the causal mask and a mask operand (kept keys,
//! or packed sequences' positions).
//!
//! Masked entries get probability exactly 0 (HF adds the dtype's finite minimum, whose `exp`
//! underflows to 0). A row with every key masked becomes uniform, `1 / Tk`, which is what the
//! finite mask gives: every entry is then the same minimum.

use super::mask::{KeyMask, PositionRows};
use super::math;
use super::par::for_each_block;
use super::simd::multiversion;
use super::strides::{broadcast_strides, offset};

/// One row's view of the mask.
#[derive(Clone, Copy)]
enum Keep<'a> {
    All,
    Scalar(bool),
    /// A row of the mask, and the position of its first `false` (its length if none).
    Slice(&'a [bool], usize),
}

impl Keep<'_> {
    #[inline(always)]
    fn get(self, j: usize) -> bool {
        match self {
            Keep::All => true,
            Keep::Scalar(k) => k,
            Keep::Slice(s, _) => s[j],
        }
    }
}

/// Softmax of `x` (shape `dims`, at least 1-D) over its last axis. With `causal`, query `i`
/// of `Tq` (the second-to-last axis) sees keys `j <= i + Tk - Tq`, and with a sliding
/// `window` only the last `window` of those; with positions, only the keys of its own packed
/// sequence.
pub fn softmax(
    x: &mut [f32],
    dims: &[usize],
    causal: bool,
    window: Option<usize>,
    mask: Option<KeyMask>,
) {
    if x.is_empty() {
        return;
    }
    let rank = dims.len();
    let tk = dims[rank - 1];
    let tq = if rank >= 2 { dims[rank - 2] } else { 1 };
    let outer = &dims[..rank - 1];
    let (keep_mask, positions) = match mask {
        None => (None, None),
        Some(KeyMask::Keep(data, shape)) => {
            let strides = broadcast_strides(shape, dims);
            // Where each mask row's first `false` is, found once rather than per query row.
            let first_false: Vec<usize> = if strides[rank - 1] == 0 {
                Vec::new()
            } else {
                data.chunks(tk)
                    .map(|r| r.iter().position(|&k| !k).unwrap_or(tk))
                    .collect()
            };
            (Some((data, strides, first_false)), None)
        }
        // Typing admits positions only with the causal mask, so `dims` is `[.., Tq, Tk]`.
        Some(KeyMask::Positions(data, shape)) => (None, Some(PositionRows::new(data, shape, dims))),
    };
    for_each_block(x, tk, tk, |r, row| {
        let visible = if causal {
            (r % tq + 1 + tk - tq).min(tk)
        } else {
            tk
        };
        let mut first = window.map_or(0, |w| visible.saturating_sub(w));
        if let Some(p) = &positions {
            first = first.max(p.first_key(r));
        }
        let keep = match &keep_mask {
            None => Keep::All,
            Some((data, strides, first_false)) => {
                let start = offset(r, outer, &strides[..rank - 1]);
                if strides[rank - 1] == 0 {
                    Keep::Scalar(data[start])
                } else {
                    Keep::Slice(&data[start..start + tk], first_false[start / tk])
                }
            }
        };
        softmax_row(row, first, visible, keep);
    });
}

multiversion! {
/// Softmax of one row over the entries `first..visible` that `keep` keeps; zeros elsewhere.
fn softmax_row(row: &mut [f32], first: usize, visible: usize, keep: Keep) {
    let keep = match keep {
        // Rows without padding among the visible keys take the unmasked path.
        Keep::Slice(_, first_false) if first_false >= visible => Keep::All,
        k => k,
    };
    let (head, hidden) = row.split_at_mut(visible);
    hidden.fill(0.0);
    let (before, seen) = head.split_at_mut(first);
    before.fill(0.0);
    let keep_all = matches!(keep, Keep::All | Keep::Scalar(true));
    let max = if keep_all {
        (visible > first).then(|| math::max(seen))
    } else {
        (0..seen.len())
            .filter(|&j| keep.get(first + j))
            .map(|j| seen[j])
            .reduce(math::max2)
    };
    let Some(max) = max else {
        // Every key is masked.
        let uniform = 1.0 / row.len() as f32;
        row.fill(uniform);
        return;
    };
    if keep_all {
        seen.iter_mut().for_each(|v| *v = math::exp(*v - max));
    } else {
        for (j, v) in seen.iter_mut().enumerate() {
            *v = if keep.get(first + j) {
                math::exp(*v - max)
            } else {
                0.0
            };
        }
    }
    let inv = (1.0 / math::sum(seen)) as f32;
    seen.iter_mut().for_each(|v| *v *= inv);
}
}

/// The softmax's gradient over rows of `n`, from its output `y`: `dx = y * (dy - Σ dy y)`, as
/// PyTorch's `_softmax_backward_data`, with the sum in F64. `dy` is overwritten with `dx`.
/// Masked entries have `y = 0` and so get 0.
pub fn softmax_grad(y: &[f32], dy: &mut [f32], n: usize) {
    for_each_block(dy, n, 2 * n, |r, row| {
        softmax_grad_row(&y[r * n..(r + 1) * n], row)
    });
}

multiversion! {
    fn softmax_grad_row(y: &[f32], dy: &mut [f32]) {
        let mut dot = 0f64;
        for (&y, &d) in y.iter().zip(dy.iter()) {
            dot += f64::from(y) * f64::from(d);
        }
        let dot = dot as f32;
        for (&y, d) in y.iter().zip(dy.iter_mut()) {
            *d = y * (*d - dot);
        }
    }
}
