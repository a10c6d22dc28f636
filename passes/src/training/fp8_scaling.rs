//! `fp8_scaling`: under `--precision fp8:delayed`, the amax histories and scales the micro
//! step's FP8 casts read become state entries of role [`StateRole::Fp8Scaling`], and each
//! `amax_history` node's results (the history with this micro-batch's amax, the scale of the
//! next cast) are written back after every micro-batch. Histories start at zero and scales at
//! 1, as Transformer Engine's `DelayedScaling` starts them. A checkpoint saves them with the
//! optimizer state, so a resumed run casts with the scales it would have used.

use super::{PlanBuild, PlanPass};
use crate::{PassError, PassReport};
use castor_ir::{Op, StateInit, StateRole, StateSpec, Write};

pub(super) struct DelayedScaling;

impl PlanPass for DelayedScaling {
    fn name(&self) -> &'static str {
        "fp8_scaling"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let plan = &mut build.plan;
        let g = &plan.micro_step;
        let mut outputs = g.outputs().to_vec();
        let mut writes = Vec::new();
        let mut state = Vec::new();
        let mut history = None;
        for (_, node) in g.nodes() {
            if !matches!(node.op, Op::AmaxHistory { .. }) {
                continue;
            }
            for (i, init) in [(0, StateInit::Zeros), (1, StateInit::Values(vec![1.0]))] {
                let (read, next) = (node.inputs[i], node.outputs[i]);
                if g.node(g.value(read).producer).op != Op::State {
                    return Err(PassError::Internal {
                        pass: "fp8_scaling",
                        message: format!(
                            "`%{}` updates `%{}`, which is not state",
                            g.name(next),
                            g.name(read)
                        ),
                    });
                }
                state.push(StateSpec {
                    shard_of: None,
                    name: g.name(read).to_string(),
                    ty: g.ty(read).clone(),
                    role: StateRole::Fp8Scaling,
                    init,
                });
                writes.push(Write {
                    output: g.name(next).to_string(),
                    state: g.name(read).to_string(),
                });
                outputs.push(next);
            }
            history = g.ty(node.inputs[0]).shape.dims().first().copied();
        }
        let Some(history) = history else {
            return Ok(PassReport::new("no delayed FP8 scaling"));
        };
        let casts = state.len() / 2;
        plan.micro_step.set_outputs(outputs);
        plan.micro_step_writes.extend(writes);
        plan.state.extend(state);
        Ok(PassReport::new(format!(
            "{casts} FP8 cast(s) with delayed scales: amax histories of {history} and scales \
             in state, updated after every micro-batch"
        )))
    }
}
