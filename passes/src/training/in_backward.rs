//! `--update-in-backward`: every parameter's update moves from the optimizer step into the
//! micro step, right after the node that completes its gradient, so no gradient outlives its
//! update and the full gradient set never exists at once (its bytes leave the persistent
//! state for the arena, where a few layers' gradients are live at a time).
//!
//! What this rules out, and what replaces it:
//! - accumulation over micro-batches (an update needs the whole step's gradient): refused;
//! - the global gradient norm of the current step, which only exists once every gradient
//!   does. Without loss scaling each update reads its own tensor's norm instead:
//!   `--grad-clip` clips each tensor by its own norm, and a tensor whose gradient is not
//!   finite skips its own update;
//! - with loss scaling (fp16) an overflow must skip the whole step before any update is
//!   applied. The micro step then runs the backward pass twice over the same saved
//!   activations (a re-run): the first pass only forms the global norm (each gradient's
//!   norm as soon as it exists, then the norm of those norms), the second applies the
//!   updates, every one reading that global norm. An overflow anywhere skips every update
//!   and backs the scale off, exactly as the ordinary plan does, for the cost of one more
//!   backward pass; `--grad-clip` clips by the global norm.
//!
//! The update ops are the optimizer step's own, with the same operands, so where every
//! gradient is finite and nothing is clipped the results equal the ordinary plan's bit for
//! bit (skipped steps included). The optimizer step keeps the step count and the loss-scale
//! update; the gradient norm it reports is the norm of the per-tensor norms, which the micro
//! step leaves in the state entry [`NORM_STATE`].

use super::PlanBuild;
use crate::PassError;
use castor_ir::{
    ControlState, DType, Graph, GraphBuilder, LossScaling, Node, Op, OpClass, Shape, StateInit,
    StateRole, StateSpec, TensorType, Value, Write, GRAD_NORM, LEARNING_RATE,
};
use std::collections::{HashMap, HashSet};

/// The state entry holding the last step's gradient norm (of the per-tensor norms).
pub const NORM_STATE: &str = "update_in_backward.grad_norm";

/// Moves the optimizer step's updates into the micro step; returns the report's phrase.
pub(super) fn apply(build: &mut PlanBuild) -> Result<String, PassError> {
    let settings = &build.plan.settings;
    if settings.grad_accum != 1 {
        return Err(refused(format!(
            "--update-in-backward applies each update as soon as its gradient is complete, so \
             it cannot accumulate gradients over {} micro-batches: use --grad-accum 1 (a larger \
             --batch, with --remat to fit it)",
            settings.grad_accum
        )));
    }
    // With loss scaling the step needs its global norm before the first update: a first
    // backward pass forms it.
    let pre_pass = settings.loss_scaling != LossScaling::None;
    let plan = &mut build.plan;
    let micro = std::mem::take(&mut plan.micro_step);
    let opt = std::mem::replace(&mut plan.optimizer_step, Graph::new("optimizer_step"));
    // The gradients, in the order the micro step wrote them, by their `grad.<name>` state.
    let written: Vec<(String, Value)> = plan
        .micro_step_writes
        .iter()
        .filter_map(|w| micro.lookup(&w.output).map(|v| (w.state.clone(), v)))
        .collect();
    let grads: Vec<Value> = written.iter().map(|(_, v)| *v).collect();
    let grad_of: HashMap<String, Value> = written.into_iter().collect();
    let deps = state_readers(&micro);
    let first_new = micro.num_nodes();
    let forward_nodes = plan.forward_nodes;
    let loss = micro.outputs()[0];
    let scalar = TensorType::new(DType::F32, Shape::scalar());
    let (micro, pre_grads) = if pre_pass {
        backward_again(micro, forward_nodes, &grads)?
    } else {
        (micro, Vec::new())
    };

    let mut b = GraphBuilder::from_graph(micro);
    let one = b.op(
        "update_in_backward.one",
        Op::Full {
            value: 1.0,
            dtype: DType::F32,
            shape: vec![],
        },
        &[],
    )?;
    let mut outputs = vec![loss];
    let mut writes = Vec::new();
    let mut norms = Vec::new();
    let global = if pre_pass {
        let scale = match b.graph().lookup(ControlState::LossScale.name()) {
            Some(v) => v,
            None => b.state(ControlState::LossScale.name(), ControlState::LossScale.ty())?,
        };
        let mut operands = Vec::with_capacity(pre_grads.len() + 1);
        for &g in &pre_grads {
            let name = format!("grad_norm.{}", b.graph().name(g));
            operands.push(b.op(&name, Op::GradNorm, &[g, scale])?);
        }
        operands.push(one);
        Some(b.op(&format!("{NORM_STATE}.next"), Op::GradNorm, &operands)?)
    } else {
        None
    };
    let mut after: HashMap<Node, Vec<Node>> = HashMap::new();
    let opt_writes: HashMap<&str, &str> = plan
        .optimizer_step_writes
        .iter()
        .map(|w| (w.output.as_str(), w.state.as_str()))
        .collect();
    for (_, node) in opt.nodes() {
        if !node.op.updates_parameter() {
            continue;
        }
        let master = opt.name(node.inputs[0]).to_string();
        let grad_state = opt.name(node.inputs[1]);
        let grad = *grad_of
            .get(grad_state)
            .ok_or_else(|| internal(format!("the micro step writes no gradient `{grad_state}`")))?;
        let norm = match global {
            Some(global) => global,
            None => {
                let scale = source(&mut b, &opt, node.inputs[node.inputs.len() - 2])?;
                let norm = b.op(&format!("grad_norm.{master}"), Op::GradNorm, &[grad, scale])?;
                norms.push(norm);
                norm
            }
        };
        let operand = |b: &mut GraphBuilder, i: usize, v: Value| match (i, opt.name(v)) {
            (1, _) => Ok(grad),
            (_, GRAD_NORM) => Ok(norm),
            _ => source(b, &opt, v),
        };
        let name = format!("update.{master}");
        let outs = replicate(&mut b, &opt, node, &name, operand, &opt_writes, &mut writes)?;
        outputs.extend(&outs);
        let update = b.graph().value(outs[0]).producer;
        after.insert(
            update,
            deps.get(master.as_str()).cloned().unwrap_or_default(),
        );
    }
    let total = match global {
        Some(global) => global,
        None => {
            let mut operands = norms.clone();
            operands.push(one);
            b.op(&format!("{NORM_STATE}.next"), Op::GradNorm, &operands)?
        }
    };
    outputs.push(total);
    writes.push(Write {
        output: format!("{NORM_STATE}.next"),
        state: NORM_STATE.into(),
    });
    b.set_outputs(outputs);
    plan.micro_step = place_early(&b.finish(), forward_nodes, first_new, &after)?;
    plan.micro_step_writes = writes;

    // The optimizer step: the norm the micro step left, the step count and the loss-scale
    // update, as the ordinary plan's.
    let mut o = GraphBuilder::new("optimizer_step");
    o.input(LEARNING_RATE, scalar.clone())?;
    let last = o.state(NORM_STATE, scalar.clone())?;
    let norm = o.op(GRAD_NORM, Op::Scale { factor: 1.0 }, &[last])?;
    let mut o_outputs = vec![norm];
    let mut o_writes = Vec::new();
    for (_, node) in opt.nodes() {
        if !matches!(node.op, Op::CountStep | Op::LossScaleUpdate { .. }) {
            continue;
        }
        let operand = |o: &mut GraphBuilder, _: usize, v: Value| match opt.name(v) {
            GRAD_NORM => Ok(norm),
            _ => source(o, &opt, v),
        };
        let name = node.op.mnemonic();
        let outs = replicate(
            &mut o,
            &opt,
            node,
            name,
            operand,
            &opt_writes,
            &mut o_writes,
        )?;
        o_outputs.extend(outs);
    }
    o.set_outputs(o_outputs);
    plan.optimizer_step = o.finish();
    plan.optimizer_step_writes = o_writes;

    // Gradients are no longer state; the norm is.
    plan.state.retain(|s| s.role != StateRole::Gradient);
    plan.state.push(StateSpec {
        shard_of: None,
        name: NORM_STATE.into(),
        ty: scalar,
        role: StateRole::OptimizerState,
        init: StateInit::Zeros,
    });
    Ok(format!(
        "{} update(s) in the micro step, each after its gradient ({}); state now {} entries, \
         no gradients",
        after.len(),
        if pre_pass {
            "a first backward pass forms the global norm, for the whole-step skip and clipping"
        } else {
            "per-tensor norms for clipping and the found-inf skip"
        },
        plan.state.len()
    ))
}

/// For each parameter (by name): the micro-step nodes that read its master or working copy,
/// directly or through layout views. Its update must come after all of them, so that it can
/// write the master and copy in place.
fn state_readers(g: &Graph) -> HashMap<String, Vec<Node>> {
    let users = g.users();
    let mut out = HashMap::new();
    for p in g.params() {
        let mut readers = Vec::new();
        let mut seen = HashSet::new();
        let mut todo = vec![p];
        while let Some(v) = todo.pop() {
            for &u in &users[v.index()] {
                if !seen.insert(u) {
                    continue;
                }
                readers.push(u);
                let op = &g.node(u).op;
                if matches!(op, Op::ParamCopy { .. }) || op.class() == OpClass::Layout {
                    todo.extend(g.node(u).outputs.iter().copied());
                }
            }
        }
        out.insert(g.name(p).to_string(), readers);
    }
    out
}

/// `g` with a second copy of its backward part (the nodes from `forward_nodes` on, reading the
/// same forward values and sources; results named `<name>.pre`), appended; and the copies of
/// `grads`.
fn backward_again(
    g: Graph,
    forward_nodes: usize,
    grads: &[Value],
) -> Result<(Graph, Vec<Value>), PassError> {
    let mut out = g.clone();
    let mut map: HashMap<Value, Value> = HashMap::new();
    for (n, d) in g.nodes().skip(forward_nodes) {
        if d.inputs.is_empty() {
            continue; // sources and constants are shared
        }
        let inputs = d
            .inputs
            .iter()
            .map(|v| map.get(v).copied().unwrap_or(*v))
            .collect();
        let outputs = d
            .outputs
            .iter()
            .map(|&v| (format!("{}.pre", g.name(v)), g.ty(v).clone()))
            .collect();
        let nn = out.push_copy(&g, n, inputs, outputs)?;
        for (&old, &new) in d.outputs.iter().zip(&out.node(nn).outputs) {
            map.insert(old, new);
        }
    }
    let pre = grads
        .iter()
        .map(|g| {
            map.get(g)
                .copied()
                .ok_or_else(|| internal("a gradient outside the backward pass".into()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((out, pre))
}

/// `g` with its nodes from `first_new` on moved as early as they can run (never among the
/// first `not_before` nodes, the forward part): each right after the last of its operands'
/// producers and of the nodes `after` names for it, and each new source (a state, parameter,
/// input or constant) right before its first new user. The nodes before `first_new` keep
/// their order.
fn place_early(
    g: &Graph,
    not_before: usize,
    first_new: usize,
    after: &HashMap<Node, Vec<Node>>,
) -> Result<Graph, PassError> {
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    let mut emitted = vec![false; g.num_nodes()];
    let is_source = |n: Node| g.node(n).inputs.is_empty();
    let new: Vec<Node> = g.nodes().map(|(n, _)| n).skip(first_new).collect();
    let mut pending: Vec<Node> = new.iter().copied().filter(|&n| !is_source(n)).collect();

    fn emit(
        g: &Graph,
        out: &mut Graph,
        map: &mut [Option<Value>],
        emitted: &mut [bool],
        n: Node,
    ) -> Result<(), PassError> {
        let d = g.node(n);
        let inputs = d
            .inputs
            .iter()
            .map(|&v| map[v.index()].ok_or_else(|| internal("operand placed later".into())))
            .collect::<Result<Vec<_>, _>>()?;
        let outputs = d
            .outputs
            .iter()
            .map(|&v| (g.name(v).to_string(), g.ty(v).clone()))
            .collect();
        let nn = out.push_copy(g, n, inputs, outputs)?;
        for (&old, &new) in d.outputs.iter().zip(&out.node(nn).outputs) {
            map[old.index()] = Some(new);
        }
        emitted[n.index()] = true;
        Ok(())
    }

    let ready = |emitted: &[bool], n: Node| -> bool {
        g.node(n).inputs.iter().all(|&v| {
            let p = g.value(v).producer;
            emitted[p.index()] || (p.index() >= first_new && is_source(p))
        }) && after
            .get(&n)
            .is_none_or(|deps| deps.iter().all(|d| emitted[d.index()]))
    };
    let flush = |out: &mut Graph,
                 map: &mut Vec<Option<Value>>,
                 emitted: &mut Vec<bool>,
                 pending: &mut Vec<Node>|
     -> Result<(), PassError> {
        loop {
            let Some(i) = pending.iter().position(|&n| ready(emitted, n)) else {
                return Ok(());
            };
            let n = pending.remove(i);
            for &v in &g.node(n).inputs {
                let p = g.value(v).producer;
                if !emitted[p.index()] {
                    emit(g, out, map, emitted, p)?;
                }
            }
            emit(g, out, map, emitted, n)?;
        }
    };
    for (n, _) in g.nodes().take(first_new) {
        emit(g, &mut out, &mut map, &mut emitted, n)?;
        if n.index() + 1 >= not_before {
            flush(&mut out, &mut map, &mut emitted, &mut pending)?;
        }
    }
    if let Some(&n) = pending.first() {
        return Err(internal(format!(
            "`%{}` could not be placed",
            g.name(g.node(n).outputs[0])
        )));
    }
    let outputs = g
        .outputs()
        .iter()
        .map(|&v| map[v.index()].ok_or_else(|| internal("an output was not placed".into())))
        .collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(outputs);
    Ok(out)
}

/// A copy in `b` of the optimizer step's `node` with operands from `operand` (by position and
/// value), its results named and written to state as the optimizer step's were (the writes
/// pushed to `writes`); returns the results.
fn replicate(
    b: &mut GraphBuilder,
    opt: &Graph,
    node: &castor_ir::NodeData,
    name: &str,
    operand: impl Fn(&mut GraphBuilder, usize, Value) -> Result<Value, PassError>,
    opt_writes: &HashMap<&str, &str>,
    writes: &mut Vec<Write>,
) -> Result<Vec<Value>, PassError> {
    let mut ins = Vec::with_capacity(node.inputs.len());
    for (i, &v) in node.inputs.iter().enumerate() {
        ins.push(operand(b, i, v)?);
    }
    let outs = b.op_multi(name, node.op.clone(), &ins)?;
    for (&old, &new) in node.outputs.iter().zip(&outs) {
        let name = opt.name(old);
        b.rename(new, name)?;
        let state = opt_writes
            .get(name)
            .ok_or_else(|| internal(format!("`%{name}` is written to no state")))?;
        writes.push(Write {
            output: name.to_string(),
            state: state.to_string(),
        });
    }
    Ok(outs)
}

/// The micro step's value for the optimizer step's source `v` (a state, parameter or input),
/// made as the same kind of source when the micro step has none of that name.
fn source(b: &mut GraphBuilder, from: &Graph, v: Value) -> Result<Value, PassError> {
    let name = from.name(v);
    if let Some(existing) = b.graph().lookup(name) {
        return Ok(existing);
    }
    let ty = from.ty(v).clone();
    Ok(match from.node(from.value(v).producer).op {
        Op::Param => b.param(name, ty)?,
        Op::Input => b.input(name, ty)?,
        _ => b.state(name, ty)?,
    })
}

fn refused(message: String) -> PassError {
    PassError::Training(message)
}

fn internal(message: String) -> PassError {
    PassError::Internal {
        pass: "optimizer",
        message,
    }
}
