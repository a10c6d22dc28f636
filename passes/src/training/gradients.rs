//! The micro step's gradients: `autodiff` appends the backward pass, `accumulate` writes each
//! trainable parameter's gradient into its state entry.

use super::{PlanBuild, PlanPass};
use crate::{Autodiff, Pass, PassError, PassReport, Seed};
use castor_ir::{BinaryOp, ControlState, GraphBuilder, Op, Value, Write};

/// `autodiff`: the backward pass of the loss, seeded with `loss_scale / grad_accum` (scaled
/// gradients, averaged over micro-batches); frozen parameters get none.
pub(super) struct Differentiate;

impl PlanPass for Differentiate {
    fn name(&self) -> &'static str {
        "autodiff"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let settings = &build.plan.settings;
        let trainable = &build.trainable;
        let autodiff = Autodiff {
            frozen: build
                .params
                .iter()
                .filter(|p| !trainable.contains(p))
                .map(|&p| build.forward.name(p).to_string())
                .collect(),
            seed: Seed::Scaled {
                state: ControlState::LossScale.name().into(),
                factor: 1.0 / settings.grad_accum as f64,
            },
            param_grads_in_compute_dtype: settings.param_grads_in_compute_dtype,
        };
        let (backward, report) = autodiff.run(&build.plan.micro_step)?;
        build.plan.micro_step = backward;
        Ok(report)
    }
}

/// `accumulate`: the micro step's gradient outputs go straight into their `grad.<name>` state
/// with one micro-batch per step, else are added to it.
pub(super) struct Accumulate;

impl PlanPass for Accumulate {
    fn name(&self) -> &'static str {
        "accumulate"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let plan = &mut build.plan;
        let grad_accum = plan.settings.grad_accum;
        let backward = std::mem::take(&mut plan.micro_step);
        let grads: Vec<Value> = backward.outputs()[1..].to_vec();
        let loss = backward.outputs()[0];
        let mut b = GraphBuilder::from_graph(backward);
        let mut outputs = vec![loss];
        let mut writes = Vec::new();
        for &g in &grads {
            let name = b.graph().name(g).to_string();
            let out = if grad_accum == 1 {
                g
            } else {
                b.rename(g, &format!("{name}.micro"))?;
                let ty = b.ty(g).clone();
                let acc = b.state(&name, ty)?;
                b.op(&format!("{name}.sum"), Op::Binary(BinaryOp::Add), &[acc, g])?
            };
            writes.push(Write {
                output: b.graph().name(out).to_string(),
                state: name,
            });
            outputs.push(out);
        }
        b.set_outputs(outputs);
        plan.micro_step = b.finish();
        plan.micro_step_writes = writes;
        Ok(PassReport::new(if grad_accum == 1 {
            format!("{} gradient(s) written to state", grads.len())
        } else {
            format!(
                "{} gradient(s) added to state over {grad_accum} micro-batches",
                grads.len()
            )
        }))
    }
}
