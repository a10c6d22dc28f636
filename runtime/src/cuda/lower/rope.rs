//! Rotary position embeddings: `rope.cu`, with the (cos, sin) table uploaded once per shape.

use super::super::program::{Arg, Place, SlotKind};
use super::ops::BLOCK;
use super::{grid_1d, sfx, LowerError, RunLowering};
use castor_ir::{Node, Op, RopeScaling, Value};

impl RunLowering<'_, '_> {
    pub(super) fn rope(&mut self, n: Node) -> Result<(), LowerError> {
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
        let rows = numel(ins[0]) / hd.max(1);
        let table = self.rope_table(t, hd, *theta, *scaling)?;
        let (x, out) = (self.at(ins[0])?, self.out(y)?);
        // The kernels name their operand and result by direction.
        let (dir, input, output) = if backward {
            ("bwd", "dy", "dx")
        } else {
            ("fwd", "x", "y")
        };
        self.launch(
            y,
            &format!("rope_{dir}_{}", sfx(dt(y))),
            grid_1d(rows * hd / 2, BLOCK),
            (BLOCK, 1, 1),
            vec![
                (input, Arg::Ptr(x)),
                (output, Arg::Ptr(out)),
                ("cs", Arg::Ptr(table)),
                ("rows", Arg::I64(rows as i64)),
                ("t", Arg::I32(t as i32)),
                ("d", Arg::I32(hd as i32)),
            ],
        )?;
        Ok(())
    }

    /// The RoPE `(cos, sin)` table for `(t, d, theta, scaling)`: the CPU twin's values,
    /// uploaded once.
    pub(super) fn rope_table(
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
