//! One 8-bit AdamW update: a launch of `adamw8bit.cu` over the parameter's quantization
//! blocks, master, codes and block maxima updated in place.
use super::Kernel;
use crate::cuda::program::{Arg, Command};
use crate::cuda::lower::{LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{quant, DType, Node, Op};

/// Threads per block: one per value of a quantization block (`ADAMW8BIT_BLOCK`).
const THREADS: u32 = quant::QUANT_BLOCK as u32;

impl RunLowering<'_, '_> {
    pub(crate) fn adamw8bit(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let y = node.outputs[0];
        let Op::AdamW8bit {
            hp: h,
            max_grad_norm,
            quant_block,
            copy,
        } = node.op
        else {
            return Err(self.err(y, "not an 8-bit AdamW node"));
        };
        if quant_block != quant::QUANT_BLOCK {
            return Err(self.err(
                y,
                format!(
                    "8-bit AdamW blocks of {} values have no CUDA kernel (it takes {})",
                    quant_block,
                    quant::QUANT_BLOCK
                ),
            ));
        }
        let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
        // State in place: master, codes and maxima are written where the plan stores the
        // results, copied there first when that is not where the inputs are.
        let mut state = Vec::new();
        for (&i, &o) in [0usize, 2, 3, 4, 5].iter().zip(&outs) {
            let (src, dst) = (self.at(ins[i])?, self.out(o)?);
            if dst != src {
                let bytes = g.ty(ins[i]).size_bytes().unwrap_or(0) as u64;
                self.commands.push(Command::Copy { dst, src, bytes });
            }
            state.push(dst);
        }
        let numel = g.ty(ins[0]).shape.numel().unwrap_or(0);
        let copy_arg = match copy.map(|_| outs[outs.len() - 1]) {
            Some(c) => Arg::Ptr(self.out(c)?),
            None => Arg::Null,
        };
        let blocks = quant::quant_blocks(numel).clamp(1, 65_535 * 4) as u32;
        let args = vec![
            ("master", Arg::Ptr(state[0])),
            ("grad", Arg::Ptr(self.at(ins[1])?)),
            ("m", Arg::Ptr(state[1])),
            ("m_absmax", Arg::Ptr(state[2])),
            ("v", Arg::Ptr(state[3])),
            ("v_absmax", Arg::Ptr(state[4])),
            ("code_maps", Arg::Ptr(self.at(ins[6])?)),
            ("copy", copy_arg),
            ("n", Arg::I64(numel as i64)),
            ("lr", Arg::Ptr(self.at(ins[7])?)),
            ("step", Arg::Ptr(self.at(ins[8])?)),
            ("scale", Arg::Ptr(self.at(ins[9])?)),
            ("grad_norm", Arg::Ptr(self.at(ins[10])?)),
            ("beta1", Arg::F64(h.beta1)),
            ("beta2", Arg::F64(h.beta2)),
            ("eps", Arg::F64(h.eps)),
            ("weight_decay", Arg::F64(h.weight_decay)),
            ("max_grad_norm", Arg::F64(max_grad_norm)),
        ];
        let kernel = KernelId::AdamW8bit(Kernel {
            copy: copy.unwrap_or(DType::F32),
        });
        self.launch(y, kernel, (blocks, 1, 1), (THREADS, 1, 1), args)
    }
}
