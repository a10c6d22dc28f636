//! From a precision-assigned loss graph to a [`TrainingPlan`].
//!
//! The micro step is the autodiff pass's forward + backward, seeded with `loss_scale /
//! grad_accum` (so gradients come out scaled, and averaged over micro-batches), writing each
//! trainable parameter's F32 gradient into its `grad.<name>` state (added to it when gradients
//! accumulate over several micro-batches). The optimizer step computes the global gradient
//! norm of the unscaled gradients (its finiteness is the found-inf flag), applies one fused
//! AdamW or SGD op per parameter buffer (unscale, clip, update master and moments, write the
//! working copy), counts the step unless it was skipped, and updates the loss scale. Every
//! decision that depends on the step's data is a graph op, so nothing is decided on the host.

use crate::{Autodiff, PassError, PassReport, Seed};
use castor_ir::{
    BinaryOp, ControlState, DType, Graph, GraphBuilder, LossScaling, Op, OptimizerKind, Shape,
    StateInit, StateRole, StateSpec, TensorType, TrainSettings, TrainingPlan, Value, Write,
    GRAD_NORM, LEARNING_RATE,
};
use wildmatch::WildMatch;

/// Builds the training plan for `forward`, whose first output is the scalar loss and whose
/// dtypes the precision passes have assigned.
pub fn build_training_plan(
    forward: &Graph,
    settings: TrainSettings,
) -> Result<(TrainingPlan, PassReport), PassError> {
    if settings.grad_accum == 0 {
        return Err(bad("--grad-accum must be at least 1".into()));
    }
    let params: Vec<Value> = forward.params().collect();
    let frozen = matching(forward, &params, &settings.frozen, "--freeze")?;
    let no_decay = matching(forward, &params, &settings.no_decay, "--no-decay")?;
    let trainable: Vec<Value> = params
        .iter()
        .copied()
        .filter(|&p| !frozen.contains(&p))
        .collect();
    if trainable.is_empty() {
        return Err(bad("every parameter is frozen: nothing to train".into()));
    }

    let autodiff = Autodiff {
        frozen: frozen
            .iter()
            .map(|&p| forward.name(p).to_string())
            .collect(),
        seed: Seed::Scaled {
            state: ControlState::LossScale.name().into(),
            factor: 1.0 / settings.grad_accum as f64,
        },
        param_grads_in_compute_dtype: settings.param_grads_in_compute_dtype,
    };
    let (backward, _) = crate::Pass::run(&autodiff, forward)?;
    let (micro_step, micro_step_writes) = accumulate(backward, settings.grad_accum)?;

    let mut state = Vec::new();
    for &p in &params {
        state.push(StateSpec {
            name: forward.name(p).to_string(),
            ty: forward.ty(p).clone(),
            role: StateRole::Master,
            init: StateInit::Checkpoint(forward.name(p).to_string()),
        });
    }
    let copies = working_copies(forward);
    for (master, copy) in &copies {
        state.push(StateSpec {
            name: forward.name(*copy).to_string(),
            ty: forward.ty(*copy).clone(),
            role: StateRole::WorkingCopy,
            init: StateInit::CopyOf(forward.name(*master).to_string()),
        });
    }
    for &p in &trainable {
        state.push(StateSpec {
            name: grad_name(forward, p),
            ty: TensorType::new(DType::F32, forward.ty(p).shape.clone()),
            role: StateRole::Gradient,
            init: StateInit::Zeros,
        });
    }
    let moments: &[&str] = match settings.optimizer {
        OptimizerKind::AdamW { .. } => &["adamw.m", "adamw.v"],
        OptimizerKind::Sgd { .. } => &["sgd.momentum"],
    };
    for &p in &trainable {
        for m in moments {
            state.push(StateSpec {
                name: format!("{m}.{}", forward.name(p)),
                ty: TensorType::new(DType::F32, forward.ty(p).shape.clone()),
                role: StateRole::OptimizerState,
                init: StateInit::Zeros,
            });
        }
    }
    // Every control entry, the counters included when they stay unused, so the state table
    // has one shape whatever the loss scaling.
    for c in ControlState::ALL {
        state.push(StateSpec {
            name: c.name().into(),
            ty: c.ty(),
            role: StateRole::Control,
            init: StateInit::Values(c.initial(&settings.loss_scaling)),
        });
    }

    let (optimizer_step, optimizer_step_writes) =
        optimizer_graph(forward, &settings, &trainable, &no_decay, &copies, moments)?;
    let remat = remat_micro_step(
        &micro_step,
        forward.num_nodes(),
        &micro_step_writes,
        &state,
        &optimizer_step,
        &optimizer_step_writes,
        settings.remat,
    )?;
    let micro_step = remat.graph;
    let fused_kernels = crate::fusion::fused_kernels(&micro_step, "micro_step", "fused_");
    let fused_nodes: usize = fused_kernels.iter().map(|k| k.members.len()).sum();
    let plan = TrainingPlan {
        format: castor_ir::PLAN_FORMAT.into(),
        settings,
        micro_step,
        forward_nodes: forward.num_nodes(),
        micro_step_writes,
        optimizer_step,
        optimizer_step_writes,
        state,
        fused_kernels,
    };
    plan.check()
        .map_err(|e| internal(format!("the plan is inconsistent: {e}")))?;
    let report = PassReport::new(format!(
        "training plan: {} of {} parameter buffers trained{}; micro step {} nodes{} ({} fused into {} kernel(s)), optimizer step {} nodes",
        trainable.len(),
        params.len(),
        if frozen.is_empty() {
            String::new()
        } else {
            format!(" ({} frozen)", frozen.len())
        },
        plan.micro_step.num_nodes(),
        if plan.settings.grad_accum > 1 {
            format!(" (x{} per step)", plan.settings.grad_accum)
        } else {
            String::new()
        },
        fused_nodes,
        plan.fused_kernels.len(),
        plan.optimizer_step.num_nodes()
    ));
    let report = if plan.settings.remat.is_none() {
        report
    } else {
        PassReport::new(format!("{}; {}", report.summary, remat.summary))
    };
    Ok((plan, report))
}

/// Rematerializes the micro step (whose first `forward_nodes` nodes are the forward pass)
/// under `mode`, the budget measured against the whole step's simulated peak.
fn remat_micro_step(
    micro_step: &Graph,
    forward_nodes: usize,
    micro_step_writes: &[Write],
    state: &[StateSpec],
    optimizer_step: &Graph,
    optimizer_step_writes: &[Write],
    mode: castor_ir::Remat,
) -> Result<crate::remat::RematOutcome, PassError> {
    let stored = |w: &[Write]| -> std::collections::HashSet<String> {
        w.iter().map(|w| w.output.clone()).collect()
    };
    let (micro_stored, opt_stored) = (stored(micro_step_writes), stored(optimizer_step_writes));
    let ctx = crate::remat::RematContext {
        forward_nodes,
        persistent_bytes: state
            .iter()
            .map(|s| s.ty.size_bytes().unwrap_or(0) as u64)
            .sum(),
        stored_outputs: micro_stored.iter().map(String::as_str).collect(),
        after: vec![crate::memory::ScheduledGraph {
            graph: optimizer_step,
            stored_outputs: opt_stored.iter().map(String::as_str).collect(),
        }],
        gpu: crate::cost::GpuSpec::default(),
    };
    crate::remat::rematerialize(micro_step, mode, &ctx)
}

fn grad_name(g: &Graph, p: Value) -> String {
    format!("grad.{}", g.name(p))
}

/// Parameters whose names match one of `globs`; a glob that matches nothing is an error (a
/// typo would otherwise silently train or decay everything).
fn matching(
    g: &Graph,
    params: &[Value],
    globs: &[String],
    flag: &str,
) -> Result<Vec<Value>, PassError> {
    let mut out = Vec::new();
    for glob in globs {
        let w = WildMatch::new(glob);
        let hits: Vec<Value> = params
            .iter()
            .copied()
            .filter(|&p| w.matches(g.name(p)))
            .collect();
        if hits.is_empty() {
            return Err(bad(format!(
                "{flag} `{glob}` matches no parameter (names look like `{}`)",
                params.first().map_or("", |&p| g.name(p))
            )));
        }
        for p in hits {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// `(master, copy)` for every `param_copy` in the forward graph.
fn working_copies(g: &Graph) -> Vec<(Value, Value)> {
    g.nodes()
        .filter(|(_, n)| matches!(n.op, Op::ParamCopy { .. }))
        .map(|(_, n)| (n.inputs[0], n.outputs[0]))
        .collect()
}

/// The micro-step graph and its writes: gradients go straight into their state with one
/// micro-batch per step, else are added to it.
fn accumulate(backward: Graph, grad_accum: usize) -> Result<(Graph, Vec<Write>), PassError> {
    let grads: Vec<Value> = backward.outputs()[1..].to_vec();
    let loss = backward.outputs()[0];
    let mut b = GraphBuilder::from_graph(backward);
    let mut outputs = vec![loss];
    let mut writes = Vec::new();
    for g in grads {
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
    let mut g = b.finish();
    g.name = "micro_step".into();
    Ok((g, writes))
}

fn optimizer_graph(
    fwd: &Graph,
    settings: &TrainSettings,
    trainable: &[Value],
    no_decay: &[Value],
    copies: &[(Value, Value)],
    moments: &[&str],
) -> Result<(Graph, Vec<Write>), PassError> {
    let scalar = TensorType::new(DType::F32, Shape::scalar());
    let mut b = GraphBuilder::new("optimizer_step");
    let lr = b.input(LEARNING_RATE, scalar)?;
    let step = b.state(ControlState::Step.name(), ControlState::Step.ty())?;
    let scale = b.state(ControlState::LossScale.name(), ControlState::LossScale.ty())?;
    let mut grads = Vec::new();
    for &p in trainable {
        let ty = TensorType::new(DType::F32, fwd.ty(p).shape.clone());
        grads.push(b.state(&grad_name(fwd, p), ty)?);
    }
    let mut operands = grads.clone();
    operands.push(scale);
    let norm = b.op(GRAD_NORM, Op::GradNorm, &operands)?;
    if b.graph().name(norm) != GRAD_NORM {
        return Err(internal("the gradient norm could not take its name".into()));
    }

    let mut outputs = vec![norm];
    let mut writes = Vec::new();
    let mut write = |b: &mut GraphBuilder, v: Value, state: &str| -> Result<(), PassError> {
        let name = format!("{state}.next");
        b.rename(v, &name)?;
        outputs.push(v);
        writes.push(Write {
            output: name,
            state: state.to_string(),
        });
        Ok(())
    };
    for (&p, &grad) in trainable.iter().zip(&grads) {
        let pname = fwd.name(p);
        let master = b.param(pname, fwd.ty(p).clone())?;
        let mut ins = vec![master, grad];
        for m in moments {
            let ty = fwd.ty(p).clone();
            ins.push(b.state(&format!("{m}.{pname}"), ty)?);
        }
        ins.extend([lr, step, scale, norm]);
        let copy = copies.iter().find(|(m, _)| *m == p).map(|&(_, c)| c);
        let decay = !no_decay.contains(&p);
        let op = match settings.optimizer {
            OptimizerKind::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay: if decay { weight_decay } else { 0.0 },
                max_grad_norm: settings.max_grad_norm,
                copy: copy.map(|c| fwd.ty(c).dtype),
            },
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
            } => Op::Sgd {
                momentum,
                weight_decay: if decay { weight_decay } else { 0.0 },
                max_grad_norm: settings.max_grad_norm,
                copy: copy.map(|c| fwd.ty(c).dtype),
            },
        };
        let n_out = 1 + moments.len() + usize::from(copy.is_some());
        let outs = b.op_multi(&format!("update.{pname}"), op, &ins)?;
        if outs.len() != n_out {
            return Err(internal(format!(
                "the update of `{pname}` has {} results",
                outs.len()
            )));
        }
        write(&mut b, outs[0], pname)?;
        for (m, &v) in moments.iter().zip(&outs[1..]) {
            write(&mut b, v, &format!("{m}.{pname}"))?;
        }
        if let Some(c) = copy {
            write(&mut b, outs[n_out - 1], fwd.name(c))?;
        }
    }
    let next_step = b.op("count_step", Op::CountStep, &[step, norm])?;
    write(&mut b, next_step, ControlState::Step.name())?;
    if let LossScaling::Dynamic {
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        max_scale,
        ..
    } = settings.loss_scaling
    {
        let counters = b.state(
            ControlState::LossScaleCounters.name(),
            ControlState::LossScaleCounters.ty(),
        )?;
        let op = Op::LossScaleUpdate {
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            max_scale,
        };
        let outs = b.op_multi("loss_scale_update", op, &[scale, counters, norm])?;
        write(&mut b, outs[0], ControlState::LossScale.name())?;
        write(&mut b, outs[1], ControlState::LossScaleCounters.name())?;
    }
    b.set_outputs(outputs);
    Ok((b.finish(), writes))
}

fn bad(message: String) -> PassError {
    PassError::Training(message)
}

fn internal(message: String) -> PassError {
    PassError::Internal {
        pass: "training",
        message,
    }
}
