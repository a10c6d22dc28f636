//! Row softmax and its backward: `softmax.cu` (causal and sliding-window masks, bool masks
//! broadcast over batch dims, or packed sequences' i64 positions `[.., 1, Tk]`).

use super::Kernel;
use crate::cuda::program::Arg;
use crate::cuda::lower::ops::{fold, row_threads, ROW_BLOCK};
use crate::cuda::lower::{copies, grid_rows, window_arg, LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{DType, Node, Value};

impl RunLowering<'_, '_> {
    pub(crate) fn softmax(
        &mut self,
        y: Value,
        ins: &[Value],
        causal: bool,
        window: Option<usize>,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let x = ins[0];
        let d = g.ty(x).shape.dims().to_vec();
        if d.len() < 2 {
            return Err(self.err(y, "softmax needs [.., Tq, Tk]"));
        }
        let r = d.len();
        let (tq, tk) = (d[r - 2], d[r - 1]);
        let rows = g.ty(x).shape.numel().unwrap_or(0) / tk.max(1);
        // The kernel sees [B, heads, tq, tk]: the dims before tq are split in two runs, each
        // folded into one index, at a point where the mask steps uniformly through each run
        // (the usual split, heads = the dim before tq, unless the mask needs another: e.g.
        // grouped-query attention's [B, kv, groups, tq, tk] with a [B, 1, 1, 1, tk] mask folds
        // kv and groups into heads).
        let lead_dims = &d[..r - 2];
        let (mask, positions, heads, strides) = match ins.get(1) {
            None => (
                Arg::Null,
                Arg::Null,
                lead_dims.last().copied().unwrap_or(1),
                [0i64; 4],
            ),
            Some(&m) => {
                let is_positions = match g.ty(m).dtype {
                    DType::Bool => false,
                    DType::I64 if causal => true,
                    DType::I64 => {
                        return Err(self.err(
                            y,
                            "softmax positions (an i64 mask) need the causal mask",
                        ))
                    }
                    other => {
                        return Err(self.err(
                            y,
                            format!(
                                "a softmax mask must be bool (kept keys) or i64 (positions), \
                                 found {other}"
                            ),
                        ))
                    }
                };
                let md = g.ty(m).shape.dims().to_vec();
                if md.len() > r {
                    return Err(self.err(y, "the mask has more dims than the scores"));
                }
                let ms = copies::strides(&md);
                let lead = r - md.len();
                let stride = |dim: usize| -> i64 {
                    if dim < lead || md[dim - lead] == 1 {
                        0
                    } else {
                        ms[dim - lead]
                    }
                };
                let st: Vec<i64> = (0..r - 2).map(stride).collect();
                let n = lead_dims.len();
                let splits = std::iter::once(n.saturating_sub(1)).chain(0..=n);
                let found = splits.into_iter().find_map(|k| {
                    let sb = fold(&lead_dims[..k], &st[..k])?;
                    let sh = fold(&lead_dims[k..], &st[k..])?;
                    Some((lead_dims[k..].iter().product::<usize>(), sb, sh))
                });
                let Some((heads, sb, sh)) = found else {
                    return Err(self.err(
                        y,
                        "the mask broadcasts over the batch dims in a way the softmax kernel \
                         cannot index",
                    ));
                };
                let strides = [sb, sh, stride(r - 2), stride(r - 1)];
                let at = Arg::Ptr(self.at(m)?);
                if !is_positions {
                    (at, Arg::Null, heads, strides)
                } else if strides[2] == 0 {
                    (Arg::Null, at, heads, strides)
                } else {
                    return Err(self.err(
                        y,
                        "softmax positions must be [.., 1, Tk]: one key row per batch",
                    ));
                }
            }
        };
        let xp = self.at(x)?;
        let out = self.out(y)?;
        self.launch(
            y,
            KernelId::Softmax(Kernel {
                backward: false,
                input: g.ty(x).dtype,
                output: g.ty(y).dtype,
            }),
            grid_rows(rows),
            (if tk > 2048 { 512 } else { row_threads(tk, 128) }, 1, 1),
            vec![
                ("x", Arg::Ptr(xp)),
                ("y", Arg::Ptr(out)),
                ("rows", Arg::I64(rows as i64)),
                ("tk", Arg::I32(tk as i32)),
                ("tq", Arg::I32(tq as i32)),
                ("heads", Arg::I32(heads as i32)),
                ("causal", Arg::I32(i32::from(causal))),
                ("window", Arg::I32(window_arg(window))),
                ("mask", mask),
                ("positions", positions),
                ("msb", Arg::I64(strides[0])),
                ("msh", Arg::I64(strides[1])),
                ("msq", Arg::I64(strides[2])),
                ("msk", Arg::I64(strides[3])),
            ],
        )
    }

    pub(crate) fn softmax_grad(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let y = node.outputs[0];
        let dt = |v: Value| g.ty(v).dtype;
        let numel = |v: Value| g.ty(v).shape.numel().unwrap_or(0);
        let (yv, dy) = (ins[0], ins[1]);
        let n = g.ty(yv).shape.last();
        let rows = numel(yv) / n.max(1);
        let (yp, dyp) = (self.at(yv)?, self.at(dy)?);
        let dx = self.out(y)?;
        self.launch(
            y,
            KernelId::Softmax(Kernel {
                backward: true,
                input: dt(y),
                output: dt(yv),
            }),
            grid_rows(rows),
            (row_threads(n, ROW_BLOCK), 1, 1),
            vec![
                ("y", Arg::Ptr(yp)),
                ("dy", Arg::Ptr(dyp)),
                ("dx", Arg::Ptr(dx)),
                ("rows", Arg::I64(rows as i64)),
                ("n", Arg::I32(n as i32)),
            ],
        )?;
        Ok(())
    }
}
