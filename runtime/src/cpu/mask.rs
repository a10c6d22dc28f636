//! The mask operand of a softmax or an attention: kept keys, or packed sequences' positions.

use super::strides::{broadcast_strides, offset};

/// What the mask operand of a `[.., T, S]` softmax or attention holds.
#[derive(Clone, Copy)]
pub enum KeyMask<'a> {
    /// Bools broadcast to the scores: false = masked out.
    Keep(&'a [bool], &'a [usize]),
    /// Each key's position in its own sequence, `[.., 1, S]`: sequences packed in one row,
    /// each query seeing only its own sequence (with the causal mask).
    Positions(&'a [i64], &'a [usize]),
}

/// The first key of the sequence that key `a` belongs to, given its position `pos` (clamped
/// to `0..=a`, so a malformed position never reaches before the row).
#[inline]
pub fn sequence_start(a: usize, pos: i64) -> usize {
    a - pos.clamp(0, a as i64) as usize
}

/// The positions of a [`KeyMask::Positions`] broadcast to `scores` (`[batch.., T, S]`): for
/// query row `r` (flat over `[batch.., T]`), where its key row's positions start.
pub struct PositionRows<'a> {
    data: &'a [i64],
    rows_dims: Vec<usize>,
    strides: Vec<usize>,
    t: usize,
    s: usize,
}

impl<'a> PositionRows<'a> {
    pub fn new(data: &'a [i64], shape: &[usize], scores: &[usize]) -> Self {
        let n = scores.len();
        PositionRows {
            data,
            rows_dims: scores[..n - 1].to_vec(),
            strides: broadcast_strides(shape, scores),
            t: scores[n - 2],
            s: scores[n - 1],
        }
    }

    /// The first key query row `r` sees: the start of the sequence of its key `a = i + S - T`.
    pub fn first_key(&self, r: usize) -> usize {
        let n = self.strides.len();
        let a = (r % self.t + self.s).saturating_sub(self.t);
        let row = offset(r, &self.rows_dims, &self.strides[..n - 1]);
        sequence_start(a, self.data[row + a * self.strides[n - 1]])
    }
}
