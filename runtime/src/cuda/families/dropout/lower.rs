//! Dropout nodes: one launch of `dropout_<t>`, the key read from device memory.

use super::Kernel;
use crate::cuda::kernel_id::KernelId;
use crate::cuda::lower::ops::BLOCK;
use crate::cuda::lower::{grid_1d, LowerError, RunLowering};
use crate::cuda::program::Arg;
use castor_ir::philox::{dropout_scale, keep_threshold};
use castor_ir::{Node, Op};

impl RunLowering<'_, '_> {
    pub(crate) fn dropout(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let (x, key, y) = (node.inputs[0], node.inputs[1], node.outputs[0]);
        let Op::Dropout { p, stream } = node.op else {
            return Err(self.err(y, "not a dropout node"));
        };
        let count = g.ty(y).shape.numel().unwrap_or(0);
        let (px, pkey, out) = (self.at(x)?, self.at(key)?, self.out(y)?);
        self.launch(
            y,
            KernelId::Dropout(Kernel::Dropout {
                dtype: g.ty(y).dtype,
            }),
            // One thread per block of four elements (one Philox call).
            grid_1d(count.div_ceil(4), BLOCK),
            (BLOCK, 1, 1),
            vec![
                ("x", Arg::Ptr(px)),
                ("y", Arg::Ptr(out)),
                ("key", Arg::Ptr(pkey)),
                ("n", Arg::I64(count as i64)),
                ("stream", Arg::U32(stream as u32)),
                ("threshold", Arg::U64(keep_threshold(p))),
                ("scale", Arg::F64(f64::from(dropout_scale(p)))),
            ],
        )
    }
}
