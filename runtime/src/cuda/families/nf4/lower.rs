//! `nf4_matmul`: the NF4 weight dequantized into a scratch buffer (`nf4.cu`, in the product's
//! dtype), then one cuBLAS product reading it, so the dequantized weight lives only for the
//! product (`nf4.cu` says why a scratch buffer rather than the operand tiles).

use super::Kernel;
use crate::cuda::program::{Arg, Command};
use crate::cuda::lower::ops::BLOCK;
use crate::cuda::lower::{gemm, grid_1d, LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{Accum, Node, Op, Shape};

impl RunLowering<'_, '_> {
    pub(crate) fn nf4_matmul(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let (ins, y) = (node.inputs.clone(), node.outputs[0]);
        let Op::Nf4MatMul {
            transpose_b,
            rows,
            cols,
        } = node.op
        else {
            return Err(self.err(y, "not an nf4_matmul node"));
        };
        let dtype = g.ty(ins[0]).dtype;
        let numel = rows * cols;
        let weight = self.scratch((numel * dtype.size_bytes()) as u64);
        self.launch(
            y,
            KernelId::Nf4(Kernel { dtype }),
            grid_1d(numel.div_ceil(2), BLOCK),
            (BLOCK, 1, 1),
            vec![
                ("codes", Arg::Ptr(self.at(ins[1])?)),
                ("absmax", Arg::Ptr(self.at(ins[2])?)),
                ("n", Arg::I64(numel as i64)),
                ("block", Arg::I64(castor_ir::nf4::NF4_BLOCK as i64)),
                ("out", Arg::Ptr(weight)),
            ],
        )?;
        let x = self.at(ins[0])?;
        let c = self.out(y)?;
        let gm = gemm::matmul(
            g.name(y),
            (x, &g.ty(ins[0]).shape, dtype),
            (weight, &Shape::from(vec![rows, cols]), dtype),
            (c, g.ty(y).dtype),
            false,
            transpose_b,
            node.acc == Some(Accum::Tf32),
        )
        .map_err(|m| self.err(y, m))?;
        self.commands.extend(gm.into_iter().map(Command::Gemm));
        Ok(())
    }
}
