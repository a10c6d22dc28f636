//! Sums, means and maxima over axes: `reduce.cu`, after one strided copy when the reduced
//! axes are not one run; column sums and means whose one-stage launch would have few blocks
//! in two stages of one launch (row groups' partials, then their sum).

use super::Kernel;
use crate::cuda::kernel_id::KernelId;
use crate::cuda::lower::{copies, LowerError, RunLowering};
use crate::cuda::program::{Arg, Place};
use castor_ir::{DType, ReduceOp, Value};

/// A column reduction whose one-stage launch has fewer blocks than this runs in two stages:
/// 256 blocks of 256 threads is two an SM on an H100 (132 SMs), about what keeps its memory
/// busy with one 2-byte load in flight a thread. A bias gradient of 768 columns is 24 blocks.
const ONE_STAGE_MIN_BLOCKS: usize = 256;
/// Threads the first stage aims for, 8 columns each (one 16-byte load of a 16-bit row): with
/// two rows' loads in flight, enough to keep a large GPU's memory busy (an H100 holds 132 x
/// 2048 threads), and few groups for the second stage to read; from the shape alone, so that
/// the grouping, and so the sums, are the same on every device. The norms' weight gradients
/// group their rows by the same rule.
const PARTIAL_THREADS: usize = 1 << 16;
/// Columns a first-stage block takes: 32 lanes of 8.
const PARTIAL_BLOCK_COLUMNS: usize = 32 * 8;

/// Rows per group of a two-stage column reduction of `[outer, len, inner]`: groups enough for
/// [`PARTIAL_THREADS`] threads, at least 8 rows each (one per thread of a column).
pub(crate) fn rows_per_group(outer: usize, len: usize, inner: usize) -> usize {
    let threads_per_group = outer * inner.div_ceil(PARTIAL_BLOCK_COLUMNS).max(1) * 256;
    let groups = PARTIAL_THREADS.div_ceil(threads_per_group.max(1)).max(1);
    len.div_ceil(groups).max(8)
}

/// Whether a column reduction of `[outer, len, inner]` by `op` runs in two stages.
fn two_stages(op: ReduceOp, outer: usize, len: usize, inner: usize) -> bool {
    op != ReduceOp::Max
        && inner > 1
        && outer * inner.div_ceil(32) < ONE_STAGE_MIN_BLOCKS
        && len > rows_per_group(outer, len, inner)
}

impl RunLowering<'_, '_> {
    pub(crate) fn reduce(
        &mut self,
        y: Value,
        x: Value,
        op: ReduceOp,
        axes: &[usize],
    ) -> Result<(), LowerError> {
        let g = self.g;
        let d = g.ty(x).shape.dims().to_vec();
        let (ti, to) = (g.ty(x).dtype, g.ty(y).dtype);
        if !ti.is_float() || !to.is_float() {
            return Err(self.err(y, "reductions are over float tensors"));
        }
        let reduced: Vec<bool> = (0..d.len()).map(|i| axes.contains(&i)).collect();
        let len: usize = d
            .iter()
            .zip(&reduced)
            .filter(|(_, &r)| r)
            .map(|(n, _)| n)
            .product();
        if op == ReduceOp::Max && len == 0 {
            return Err(self.err(y, "max over an empty axis"));
        }
        // Runs of (size, reduced?) with size-1 dims dropped, as the CPU twin coalesces them.
        let mut runs: Vec<(usize, bool)> = Vec::new();
        for (&n, &r) in d.iter().zip(&reduced) {
            match runs.last_mut() {
                _ if n == 1 => {}
                Some((size, kind)) if *kind == r => *size *= n,
                _ => runs.push((n, r)),
            }
        }
        let mut src = self.at(x)?;
        let (outer, inner) = match runs.as_slice() {
            // Nothing summed (axes of size 1): every element is its own column, 32 to a block.
            [] | [(_, false)] => (1, g.ty(y).shape.numel().unwrap_or(0)),
            [(_, true)] => (1, 1),
            [(_, true), (i, false)] => (1, *i),
            [(o, false), (_, true)] => (*o, 1),
            [(o, false), (_, true), (i, false)] => (*o, *i),
            _ => {
                // Reduced axes to the end first.
                let perm: Vec<usize> = (0..d.len())
                    .filter(|&i| !reduced[i])
                    .chain((0..d.len()).filter(|&i| reduced[i]))
                    .collect();
                let l = copies::transpose(&d, &perm).map_err(|m| self.err(y, m))?;
                let bytes = g.ty(x).size_bytes().unwrap_or(0) as u64;
                let t = self.scratch(bytes);
                self.strided_copy(y, ti, src, t, l)?;
                src = t;
                let kept = g.ty(y).shape.numel().unwrap_or(0);
                (kept, 1)
            }
        };
        let (outer, len) = if matches!(runs.as_slice(), [] | [(_, false)]) {
            (outer, 1)
        } else {
            (outer, len)
        };
        let out = self.out(y)?;
        if outer * inner == 0 {
            return Ok(()); // an empty result: nothing to launch
        }
        if two_stages(op, outer, len, inner) {
            return self.column_reduce_in_two_stages(y, op, (src, ti), (out, to), [outer, len, inner]);
        }
        self.launch(
            y,
            KernelId::Reduce(Kernel::Whole {
                op,
                input: ti,
                output: to,
            }),
            (
                inner.div_ceil(32).clamp(1, 65_535) as u32,
                outer.clamp(1, 65_535) as u32,
                1,
            ),
            (32, 8, 1),
            vec![
                ("x", Arg::Ptr(src)),
                ("y", Arg::Ptr(out)),
                ("outer", Arg::I64(outer as i64)),
                ("len", Arg::I64(len as i64)),
                ("inner", Arg::I64(inner as i64)),
            ],
        )
    }

    /// The sums (or means, `op`) of the columns of `x` viewed as `[outer, len, inner]` into
    /// `y` (`[outer, inner]`), in two stages of one launch: each group of rows summed per
    /// column into F64 scratch, then the groups' sums per column by each column block's last
    /// group to finish. Nothing is launched for an empty `y`.
    pub(crate) fn column_reduce_in_two_stages(
        &mut self,
        v: Value,
        op: ReduceOp,
        (x, ti): (Place, DType),
        (y, to): (Place, DType),
        [outer, len, inner]: [usize; 3],
    ) -> Result<(), LowerError> {
        if outer * inner == 0 {
            return Ok(());
        }
        let per_group = rows_per_group(outer, len, inner);
        let groups = len.div_ceil(per_group).max(1);
        let dims = [inner.div_ceil(PARTIAL_BLOCK_COLUMNS), groups, outer];
        if dims.iter().any(|&d| d > 65_535) {
            return Err(self.err(v, "too many columns or rows for a two-stage column reduction"));
        }
        let part = self.scratch((outer * groups * inner * 8) as u64);
        // One counter per (outer index, column block), zero between launches.
        let done = self.l.handoff_counters(dims[0] * outer);
        self.launch(
            v,
            KernelId::Reduce(Kernel::Grouped {
                op,
                input: ti,
                output: to,
            }),
            (dims[0] as u32, dims[1] as u32, dims[2] as u32),
            (32, 8, 1),
            vec![
                ("x", Arg::Ptr(x)),
                ("part", Arg::Ptr(part)),
                ("y", Arg::Ptr(y)),
                ("done", Arg::Ptr(done)),
                ("outer", Arg::I64(outer as i64)),
                ("len", Arg::I64(len as i64)),
                ("inner", Arg::I64(inner as i64)),
                ("rows_per_group", Arg::I64(per_group as i64)),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bias_gradient_runs_in_two_stages_of_about_65536_threads() {
        // GPT-2 124M's bias gradients: 8192 rows of 768 and of 3072 columns.
        assert!(two_stages(ReduceOp::Sum, 1, 8192, 768));
        assert_eq!(rows_per_group(1, 8192, 768), 96); // 86 groups x 3 blocks
        assert_eq!(rows_per_group(1, 8192, 3072), 373); // 22 groups x 12 blocks
        // A max, a wide launch, few rows, or rows (inner 1) keep one stage.
        assert!(!two_stages(ReduceOp::Max, 1, 8192, 768));
        assert!(!two_stages(ReduceOp::Sum, 64, 8192, 768));
        assert!(!two_stages(ReduceOp::Sum, 1, 8, 768));
        assert!(!two_stages(ReduceOp::Sum, 1024, 8192, 1));
    }
}
