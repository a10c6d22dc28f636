//! `loss_scale.cu`: the step counter and the dynamic loss scaler's update.

use super::Kernel;
use crate::cuda::program::Arg;
use crate::cuda::lower::{LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{Node, Op};

impl RunLowering<'_, '_> {
    pub(crate) fn count_step(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let y = node.outputs[0];
        let (step, gn) = (self.at(ins[0])?, self.at(ins[1])?);
        let out = self.out(y)?;
        self.launch(
            y,
            KernelId::Optimizer(Kernel::CountStep),
            (1, 1, 1),
            (1, 1, 1),
            vec![
                ("step_in", Arg::Ptr(step)),
                ("grad_norm", Arg::Ptr(gn)),
                ("step_out", Arg::Ptr(out)),
            ],
        )?;
        Ok(())
    }

    pub(crate) fn loss_scale_update(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let outs = node.outputs.clone();
        let y = node.outputs[0];
        let Op::LossScaleUpdate {
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            max_scale,
        } = &node.op
        else {
            return Err(self.err(y, "not a loss scale update node"));
        };
        let (s, c, gn) = (self.at(ins[0])?, self.at(ins[1])?, self.at(ins[2])?);
        let (so, co) = (self.out(outs[0])?, self.out(outs[1])?);
        self.launch(
            y,
            KernelId::Optimizer(Kernel::LossScaleUpdate),
            (1, 1, 1),
            (1, 1, 1),
            vec![
                ("scale_in", Arg::Ptr(s)),
                ("counters_in", Arg::Ptr(c)),
                ("grad_norm", Arg::Ptr(gn)),
                ("scale_out", Arg::Ptr(so)),
                ("counters_out", Arg::Ptr(co)),
                ("growth_factor", Arg::F64(*growth_factor)),
                ("backoff_factor", Arg::F64(*backoff_factor)),
                ("growth_interval", Arg::I64(*growth_interval as i64)),
                ("hysteresis", Arg::I64(*hysteresis as i64)),
                ("max_scale", Arg::F64(*max_scale)),
            ],
        )?;
        Ok(())
    }
}
