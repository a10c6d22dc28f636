//! Rotary position embeddings: `rope.cu`, with the (cos, sin) table of positions `0..T`
//! uploaded once per shape, and packed sequences' positions (an optional i64 operand
//! broadcast to `[.., T]`) read through strides.

use super::Kernel;
use crate::cuda::program::{Arg, Place, SlotKind};
use crate::cuda::lower::copies;
use crate::cuda::lower::ops::fold;
use crate::cuda::lower::views::{fits_i32, heads_of, kernel_strides};
use crate::cuda::lower::{LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{Graph, Node, NodeData, Op, RopeScaling, Value};

/// The heads of rope node `node`'s operand, split as its kernels split batches.
fn rope_heads(g: &Graph, node: &NodeData) -> Option<usize> {
    if !matches!(node.op, Op::Rope { .. } | Op::RopeGrad { .. }) {
        return None;
    }
    let d = g.ty(node.inputs[0]).shape.dims().to_vec();
    (d.len() >= 2).then(|| heads_of(&d[..d.len() - 2], 1))
}

/// Whether rope node `node` reads its operand `x` in place through `view`.
pub(crate) fn reads_in_place(g: &Graph, node: &NodeData, x: Value, view: &copies::View) -> bool {
    rope_heads(g, node).is_some_and(|heads| {
        node.inputs[0] == x && node.inputs[1..].iter().all(|&i| i != x) && {
            kernel_strides(view, heads, false).is_some()
        }
    })
}

/// Whether rope node `node` writes its result `x` through `view` of another buffer.
pub(crate) fn writes_in_place(g: &Graph, node: &NodeData, x: Value, view: &copies::View) -> bool {
    rope_heads(g, node)
        .is_some_and(|heads| node.outputs[0] == x && kernel_strides(view, heads, true).is_some())
}

impl RunLowering<'_, '_> {
    pub(crate) fn rope(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let y = node.outputs[0];
        let dt = |v: Value| g.ty(v).dtype;
        let dims = |v: Value| g.ty(v).shape.dims().to_vec();
        let numel = |v: Value| g.ty(v).shape.numel().unwrap_or(0);
        let (Op::Rope { theta, scaling } | Op::RopeGrad { theta, scaling }) = &node.op else {
            return Err(self.err(y, "not a rope node"));
        };
        let backward = matches!(node.op, Op::RopeGrad { .. });
        let d = dims(ins[0]);
        if d.len() < 2 || d[d.len() - 1] % 2 != 0 {
            return Err(self.err(y, "rope needs [.., T, D] with D even"));
        }
        let (t, hd) = (d[d.len() - 2], d[d.len() - 1]);
        let batches = numel(ins[0]) / (hd * t).max(1);
        if !fits_i32(batches as i64) {
            return Err(self.err(y, "too many batches for rope's 32-bit count"));
        }
        let lead = &d[..d.len() - 2];
        let heads = heads_of(lead, 1);
        let (positions, positions_strides) = match ins.get(1) {
            None => (Arg::Null, [0; 3]),
            Some(&p) => (
                Arg::Ptr(self.at(p)?),
                self.rope_positions(y, p, lead, heads, t)?,
            ),
        };
        let table = self.rope_table(t, hd, *theta, *scaling)?;
        // The operand read, and the result written, in place when they are views.
        let (x, xs) = self.strided_read(ins[0], heads)?;
        let (out, ys) = self.strided_write(y, heads)?;
        // The kernels name their operand and result by direction.
        let (input, output) = if backward { ("dy", "dx") } else { ("x", "y") };
        let names: [[&'static str; 3]; 3] = if backward {
            [
                ["dy_batch", "dy_head", "dy_row"],
                ["dx_batch", "dx_head", "dx_row"],
                ["positions_batch", "positions_head", "positions_row"],
            ]
        } else {
            [
                ["x_batch", "x_head", "x_row"],
                ["y_batch", "y_head", "y_row"],
                ["positions_batch", "positions_head", "positions_row"],
            ]
        };
        let mut args = vec![
            (input, Arg::Ptr(x)),
            (output, Arg::Ptr(out)),
            ("cs", Arg::Ptr(table)),
            ("positions", positions),
            ("batches", Arg::I32(batches as i32)),
            ("t", Arg::I32(t as i32)),
            ("d", Arg::I32(hd as i32)),
            ("heads", Arg::I32(heads as i32)),
        ];
        for (names, strides) in names.iter().zip([xs, ys, positions_strides]) {
            for (name, stride) in names.iter().zip(strides) {
                if !fits_i32(stride) {
                    return Err(self.err(y, "too large for rope's 32-bit strides"));
                }
                args.push((*name, Arg::I32(stride as i32)));
            }
        }
        self.launch(
            y,
            KernelId::Rope(Kernel::Rope {
                backward,
                dtype: dt(y),
            }),
            rope_grid(batches, t, lanes(hd)),
            (lanes(hd), THREADS / lanes(hd), 1),
            args,
        )?;
        Ok(())
    }

    /// The (batch, head, row) strides, in elements, by which the kernels read positions
    /// operand `p` (i64, broadcast to x's rows `[lead.., t]`) for batch `(outer, head)` of x's
    /// leading dims `lead` split by `heads`, as [`heads_of`] splits them.
    fn rope_positions(
        &self,
        y: Value,
        p: Value,
        lead: &[usize],
        heads: usize,
        t: usize,
    ) -> Result<[i64; 3], LowerError> {
        let g = self.g;
        let mut rows = lead.to_vec();
        rows.push(t);
        let pd = g.ty(p).shape.dims().to_vec();
        if g.ty(p).dtype != castor_ir::DType::I64 || pd.len() > rows.len() {
            return Err(self.err(
                y,
                format!("rope positions must be i64 broadcasting to {rows:?}, one per row of x"),
            ));
        }
        // Element strides of the positions over [lead.., t]: 0 along a broadcast dim.
        let own = copies::strides(&pd);
        let skip = rows.len() - pd.len();
        let st: Vec<i64> = (0..rows.len())
            .map(|i| {
                if i < skip || pd[i - skip] == 1 {
                    0
                } else {
                    own[i - skip]
                }
            })
            .collect();
        // The lead dims split as the kernels split batches: outer `lead[..k]`, heads `lead[k..]`.
        let k = (0..=lead.len())
            .find(|&k| lead[k..].iter().product::<usize>() == heads)
            .unwrap_or(0);
        let n = lead.len();
        let (Some(batch), Some(head)) = (fold(&lead[..k], &st[..k]), fold(&lead[k..], &st[k..n]))
        else {
            return Err(self.err(
                y,
                "the rope positions broadcast over x's batch dims in a way the kernels cannot \
                 index",
            ));
        };
        let strides = [batch, head, st[n]];
        if !strides.into_iter().all(fits_i32) {
            return Err(self.err(y, "rope positions too large for the kernels' 32-bit strides"));
        }
        Ok(strides)
    }

    /// The RoPE `(cos, sin)` table for `(t, d, theta, scaling)`: the CPU twin's values,
    /// uploaded once.
    pub(crate) fn rope_table(
        &mut self,
        t: usize,
        d: usize,
        theta: f64,
        scaling: RopeScaling,
    ) -> Result<Place, LowerError> {
        let name = match scaling {
            RopeScaling::None => format!("rope.table.{t}.{d}.{theta}"),
            s => format!("rope.table.{t}.{d}.{theta}.scaled{:?}", s.numbers()),
        };
        if let Some(slot) = self.l.find_slot(&name) {
            return Ok(Place::Slot { slot, offset: 0 });
        }
        let mut bytes = Vec::with_capacity(t * d * 4);
        for (c, s) in crate::cpu::rope::rope_table(t, d, theta, scaling) {
            bytes.extend(c.to_le_bytes());
            bytes.extend(s.to_le_bytes());
        }
        let slot = self.l.slot(&name, SlotKind::Constant(bytes), &name)?;
        Ok(Place::Slot { slot, offset: 0 })
    }
}

/// Positions per block of the RoPE kernels: blocks of (32 pairs, 8 positions), 256 threads.
/// Threads in a RoPE block.
const THREADS: u32 = 256;

/// Threads along a row of `d` elements: one per 8 elements of each half where the halves
/// are whole vectors of 8 (the kernels' vector path, taken where the rows are aligned too),
/// else one per pair; at most 32.
fn lanes(d: usize) -> u32 {
    let half = d / 2;
    let lanes = if half.is_multiple_of(8) { half / 8 } else { half };
    lanes.clamp(1, 32) as u32
}

/// The RoPE kernels' grid for blocks of `THREADS / lanes` positions: x over blocks of
/// positions, y over batches (each loop of the kernel is grid-stride, so the caps only bound
/// the grid).
fn rope_grid(batches: usize, t: usize, lanes: u32) -> (u32, u32, u32) {
    let positions = (THREADS / lanes) as usize;
    let x = t.div_ceil(positions).clamp(1, 65_535 * 4);
    (x as u32, batches.clamp(1, 65_535) as u32, 1)
}
