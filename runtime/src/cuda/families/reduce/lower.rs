//! Sums, means and maxima over axes: `reduce.cu`, after one strided copy when the reduced
//! axes are not one run.

use super::Kernel;
use crate::cuda::program::Arg;
use crate::cuda::lower::{copies, LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{ReduceOp, Value};

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
        self.launch(
            y,
            KernelId::Reduce(Kernel {
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
}
