//! `parallel`: a data-parallel plan (`--world-size N --zero S`), one rank's view of it.
//!
//! Every rank runs the same micro step on its own micro-batch; each gradient is averaged
//! across the ranks right after the backward completes it (an all-reduce, or under ZeRO-2 a
//! reduce-scatter that leaves each rank the mean of its shard), so the reductions of late layers
//! overlap the backward of early ones, and the IR shows where each runs. ZeRO-1 shards the
//! optimizer moments and the masters the micro step reads only through working copies: the
//! micro step then reads those copies as state, each rank updates its shard of the master,
//! and the ranks all-gather the updated copy. A master the micro step reads itself stays
//! replicated: its shard is cut locally (`shard`) for the update and the updated master is
//! gathered. ZeRO-2 also keeps only the gradient's shard, and the global gradient norm (the
//! clipping factor, and the found-inf test) combines the ranks' shard norms, so every rank
//! skips or clips the same step.
//!
//! ZeRO-3 (FSDP's full sharding) also keeps only a shard of every master and working copy.
//! The micro step gathers each parameter (an `all_gather` of its shard) right before the
//! forward's first use of it; the `remat` pass then gathers it again for the backward (in
//! every recomputation mode), so the memory plan frees the whole parameter between the two; the gradient is reduce-scattered as
//! under ZeRO-2 (all-gather's VJP). The optimizer step then updates shards and gathers
//! nothing.
//!
//! Sharded state entries hold one rank's flat shard: `[ceil(n / world)]` (the IR's `shard`).

use super::{PlanBuild, PlanPass};
use crate::{PassError, PassReport};
use castor_ir::{
    CollectiveOp, Graph, Op, OptimizerKind, Origin, Shape, StateRole, TensorType, Value, GRAD_NORM,
};
use std::collections::{HashMap, HashSet};

pub(super) struct DataParallel;

/// The suffix of a ZeRO-3 parameter's gathered value: `<name>.gathered`.
pub const GATHERED_SUFFIX: &str = ".gathered";

impl PlanPass for DataParallel {
    fn name(&self) -> &'static str {
        "parallel"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let plan = &mut build.plan;
        let parallel = plan.settings.parallel;
        if parallel.is_single() {
            return Ok(PassReport::new("one rank: no collectives"));
        }
        let (world, zero) = (parallel.world_size, parallel.zero);
        check(plan, zero)?;
        let shard_ty = |ty: &TensorType| shard_type(ty, world);
        // Masters the micro step reads only through working copies: under ZeRO-1 and 2 a
        // rank keeps their shard, and the micro step reads the (gathered) copies as state.
        let copied = if zero >= 1 {
            copied_masters(&plan.micro_step)
        } else {
            HashSet::new()
        };
        // The entries each rank keeps a shard of.
        let mut sharded: HashMap<String, TensorType> = HashMap::new();
        for spec in &mut plan.state {
            let shard = match spec.role {
                StateRole::OptimizerState => zero >= 1,
                StateRole::Gradient => zero >= 2,
                StateRole::Master => zero >= 3 || copied.contains(&spec.name),
                StateRole::WorkingCopy => zero >= 3,
                _ => false,
            };
            if shard {
                spec.shard_of = Some(spec.ty.clone());
                spec.ty = shard_ty(&spec.ty);
                sharded.insert(spec.name.clone(), spec.ty.clone());
            }
        }
        let gradients: HashSet<&str> = plan
            .state
            .iter()
            .filter(|s| s.role == StateRole::Gradient)
            .map(|s| s.name.as_str())
            .collect();
        // Micro step: each gradient reduced as soon as it is complete.
        let micro = &plan.micro_step;
        let mut targets = HashSet::new();
        for w in plan
            .micro_step_writes
            .iter()
            .filter(|w| gradients.contains(w.state.as_str()))
        {
            let out = micro
                .lookup(&w.output)
                .ok_or_else(|| internal(format!("no micro step output `{}`", w.output)))?;
            targets.insert(accumulated(micro, out, &w.state));
        }
        let reduced = targets.len();
        // The forward part loses the sharded masters' `param` nodes (their copies' nodes
        // become state sources in place) and under ZeRO-3 gains the gathers; the reductions
        // go into the backward part.
        let gather = (zero >= 3).then_some(Gather { world });
        // What the micro step writes to a sharded entry is a shard (under gradient
        // accumulation, the sum of the entry and the reduced micro-batch gradient).
        let written: HashMap<String, TensorType> = plan
            .micro_step_writes
            .iter()
            .filter_map(|w| sharded.get(&w.state).map(|t| (w.output.clone(), t.clone())))
            .collect();
        let (micro_step, forward_nodes) = rebuild(
            micro,
            plan.forward_nodes,
            Retyped {
                sharded: &sharded,
                written: &written,
            },
            &copied,
            gather,
            |g, v, local| {
                let name = g.name(v).to_string();
                let ty = g.ty(v).clone();
                let (op, ty) = if zero >= 2 {
                    (
                        Op::ReduceScatter {
                            world,
                            average: true,
                        },
                        shard_ty(&ty),
                    )
                } else {
                    (
                        Op::AllReduce {
                            reduce: CollectiveOp::Mean,
                            world,
                        },
                        ty,
                    )
                };
                Ok(targets.contains(&v).then(|| vec![(op, local, name, ty)]))
            },
        )?;
        plan.micro_step = micro_step;
        plan.forward_nodes = forward_nodes;
        // Optimizer step: the updates on shards.
        if zero >= 1 {
            plan.optimizer_step = shard_updates(
                &plan.optimizer_step,
                &plan.optimizer_step_writes,
                &sharded,
                world,
                zero,
            )?;
        }
        let what = match zero {
            0 => "state replicated",
            1 => "optimizer moments and copied masters sharded",
            2 => "optimizer moments, copied masters and gradients sharded",
            _ => "parameters, gradients and optimizer moments sharded; parameters gathered before use",
        };
        Ok(PassReport::new(format!(
            "{world} ranks, ZeRO-{zero} ({what}): {reduced} gradient(s) {} as they complete; \
             {} state entries sharded",
            if zero >= 2 {
                "reduce-scattered"
            } else {
                "all-reduced"
            },
            sharded.len()
        )))
    }
}

/// What data parallelism does not support yet, refused with the reason.
fn check(plan: &castor_ir::TrainingPlan, zero: u8) -> Result<(), PassError> {
    let refuse = |m: &str| Err(PassError::Training(m.into()));
    if plan.settings.update_in_backward {
        return refuse(
            "--update-in-backward with --world-size: the update would run before the other \
             ranks' gradients arrive",
        );
    }
    if zero >= 1
        && matches!(
            plan.settings.optimizer,
            OptimizerKind::AdamW8bit(_) | OptimizerKind::Adafactor(_)
        )
    {
        return refuse(
            "--zero 1, 2 and 3 shard AdamW's, SGD's and Lion's moments: 8-bit AdamW's \
             quantization blocks and Adafactor's factored moments follow the parameter's shape \
             (use --zero 0)",
        );
    }
    Ok(())
}

/// The value the backward completes for gradient entry `state`: the written output, or with
/// gradient accumulation the micro-batch's gradient added to the entry.
fn accumulated(g: &Graph, out: Value, state: &str) -> Value {
    let node = g.node(g.value(out).producer);
    if node.op == Op::Binary(castor_ir::BinaryOp::Add) {
        let is_entry = |v: Value| g.node(g.value(v).producer).op == Op::State && g.name(v) == state;
        if let [a, b] = node.inputs[..] {
            if is_entry(a) {
                return b;
            }
            if is_entry(b) {
                return a;
            }
        }
    }
    out
}

/// A node to insert after a value: its op, the name the value takes, the inserted node's
/// result name and type.
type Insert = (Op, String, String, TensorType);

/// The values whose type the rebuilt micro step changes: the state sources of `sharded`
/// entries, and the `written` outputs (by name) that the micro step writes to them.
#[derive(Clone, Copy)]
struct Retyped<'a> {
    sharded: &'a HashMap<String, TensorType>,
    written: &'a HashMap<String, TensorType>,
}

/// ZeRO-3's gathers in the micro step: every sharded parameter is gathered right before its
/// first use (the `remat` pass gathers it again for the backward).
#[derive(Clone, Copy)]
struct Gather {
    world: usize,
}

impl Gather {
    /// Appends the gather of shard `shard` (of whole type `whole`) to `out`, named `name`.
    fn push(
        &self,
        out: &mut Graph,
        shard: Value,
        name: String,
        whole: &TensorType,
    ) -> Result<Value, PassError> {
        let op = Op::AllGather {
            world: self.world,
            shape: whole.shape.0.clone(),
        };
        let node = out.push_node(op, vec![shard], vec![(name, whole.clone())])?;
        out.set_origin(node, Some(Origin::Gather));
        Ok(out.node(node).outputs[0])
    }
}

/// `g` rebuilt in the same order, state sources of `sharded` entries retyped, and after each
/// value `after` names the nodes to insert: the value is renamed, the last inserted result
/// takes its place for every later use. With `gather` (ZeRO-3) the sharded parameters are
/// gathered where they are read. `g`'s first `forward_nodes` nodes are its forward; returns
/// the graph and how many of its nodes are.
fn rebuild(
    g: &Graph,
    forward_nodes: usize,
    retyped: Retyped<'_>,
    copied: &HashSet<String>,
    gather: Option<Gather>,
    mut after: impl FnMut(&Graph, Value, String) -> Result<Option<Vec<Insert>>, PassError>,
) -> Result<(Graph, usize), PassError> {
    let sharded = retyped.sharded;
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    // ZeRO-3: the sharded parameters (by their values in `g`), each with its gather once made.
    let mut shards: HashMap<Value, Option<Value>> = HashMap::new();
    let mut forward = None;
    for (n, node) in g.nodes() {
        if n.index() == forward_nodes {
            forward = Some(out.num_nodes());
        }
        // A sharded master leaves the graph; its working copy becomes a state source (under
        // ZeRO-3 every working copy does, its master being sharded).
        let is_copied = |v: Value| copied.contains(g.name(v));
        if node.op == Op::Param && node.outputs.iter().all(|&v| is_copied(v)) {
            continue;
        }
        let copy_is_state =
            |v: Value| is_copied(v) || (gather.is_some() && sharded.contains_key(g.name(v)));
        if matches!(node.op, Op::ParamCopy { .. }) && node.inputs.iter().all(|&v| copy_is_state(v))
        {
            let copy = node.outputs[0];
            let name = g.name(copy).to_string();
            let ty = sharded.get(&name).unwrap_or(g.ty(copy)).clone();
            let new = out.push_node(Op::State, vec![], vec![(name.clone(), ty)])?;
            if gather.is_some() && sharded.contains_key(&name) {
                shards.insert(copy, None);
            }
            map[copy.index()] = Some(out.node(new).outputs[0]);
            continue;
        }
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &v in &node.inputs {
            let mapped =
                map[v.index()].ok_or_else(|| internal("an operand out of order".into()))?;
            // ZeRO-3: a parameter is read through a gather made before its first use.
            let input = match (gather, shards.get_mut(&v)) {
                (Some(gt), Some(gathered)) => match *gathered {
                    Some(whole) => whole,
                    None => {
                        let name = format!("{}{GATHERED_SUFFIX}", g.name(v));
                        let whole = gt.push(&mut out, mapped, name, g.ty(v))?;
                        *gathered = Some(whole);
                        whole
                    }
                },
                _ => mapped,
            };
            inputs.push(input);
        }
        let mut inserts = Vec::new();
        let outputs = node
            .outputs
            .iter()
            .map(|&v| {
                let name = g.name(v).to_string();
                let ty = rebuilt_type(g, node, v, sharded);
                let local = format!("{name}.local");
                match after(g, v, local.clone())? {
                    Some(ins) => {
                        let local_name = ins.first().map_or(local, |i| i.1.clone());
                        inserts.push((v, ins));
                        Ok((local_name, ty))
                    }
                    None => {
                        let ty = retyped.written.get(&name).cloned().unwrap_or(ty);
                        Ok((name, ty))
                    }
                }
            })
            .collect::<Result<Vec<_>, PassError>>()?;
        let new = out.push_copy(g, n, inputs, outputs)?;
        let new_outputs = out.node(new).outputs.clone();
        for (&old, &fresh) in node.outputs.iter().zip(&new_outputs) {
            map[old.index()] = Some(fresh);
            // ZeRO-3: a sharded master the micro step reads itself is gathered where read.
            if gather.is_some() && node.op == Op::Param && sharded.contains_key(g.name(old)) {
                shards.insert(old, None);
            }
        }
        for (v, ins) in inserts {
            let mut current = map[v.index()].ok_or_else(|| internal("lost a value".into()))?;
            for (op, _, name, ty) in ins {
                let node = out.push_node(op, vec![current], vec![(name, ty)])?;
                out.set_block(node, g.node(n).block);
                current = out.node(node).outputs[0];
            }
            map[v.index()] = Some(current);
        }
    }
    out.set_outputs(
        g.outputs()
            .iter()
            .map(|v| map[v.index()].ok_or_else(|| internal("an output was lost".into())))
            .collect::<Result<_, _>>()?,
    );
    let forward = forward.unwrap_or(out.num_nodes());
    Ok((out, forward))
}

/// The optimizer step with every update on this rank's shards: masters (and under ZeRO-1 the
/// gradients) cut locally before the update, the updated masters and working copies gathered
/// after it; under ZeRO-2 the gradient norm combined across ranks.
fn shard_updates(
    g: &Graph,
    writes: &[castor_ir::Write],
    sharded: &HashMap<String, TensorType>,
    world: usize,
    zero: u8,
) -> Result<Graph, PassError> {
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    let get = |map: &[Option<Value>], v: Value| {
        map[v.index()].ok_or_else(|| internal("an operand out of order".into()))
    };
    for (n, node) in g.nodes() {
        let mut inputs = node
            .inputs
            .iter()
            .map(|&v| get(&map, v))
            .collect::<Result<Vec<_>, _>>()?;
        if node.op.updates_parameter() {
            // (master, grad, ..): cut what is whole (a sharded master or gradient is not).
            let whole = if zero >= 2 { 1 } else { 2 };
            for slot in inputs.iter_mut().take(whole) {
                if sharded.contains_key(out.name(*slot)) {
                    continue;
                }
                let name = format!("{}.shard", out.name(*slot));
                let ty = shard_type(out.ty(*slot), world);
                let cut = out.push_node(Op::Shard { world }, vec![*slot], vec![(name, ty)])?;
                *slot = out.node(cut).outputs[0];
            }
            // Moments stay shards (they write a sharded state entry); the master and its copy
            // are gathered.
            let stays_shard: Vec<bool> = node
                .outputs
                .iter()
                .map(|&v| {
                    writes
                        .iter()
                        .any(|w| w.output == g.name(v) && sharded.contains_key(&w.state))
                })
                .collect();
            let outputs: Vec<(String, TensorType)> = node
                .outputs
                .iter()
                .zip(&stays_shard)
                .map(|(&v, &stays)| {
                    let shard = shard_type(g.ty(v), world);
                    let name = g.name(v).to_string();
                    match stays {
                        true => (name, shard),
                        false => (format!("{name}.shard"), shard),
                    }
                })
                .collect();
            let new = out.push_copy(g, n, inputs, outputs)?;
            let fresh = out.node(new).outputs.clone();
            for ((&old, &f), &stays) in node.outputs.iter().zip(&fresh).zip(&stays_shard) {
                let gathered = if !stays {
                    let op = Op::AllGather {
                        world,
                        shape: g.ty(old).shape.0.clone(),
                    };
                    let node = out.push_node(
                        op,
                        vec![f],
                        vec![(g.name(old).to_string(), g.ty(old).clone())],
                    )?;
                    out.node(node).outputs[0]
                } else {
                    f
                };
                map[old.index()] = Some(gathered);
            }
            continue;
        }
        let outputs: Vec<(String, TensorType)> = node
            .outputs
            .iter()
            .map(|&v| {
                let name = g.name(v).to_string();
                let ty = rebuilt_type(g, node, v, sharded);
                // Under ZeRO-2 each rank's norm is its shards'; the global one combines them.
                if zero >= 2 && node.op == Op::GradNorm {
                    return (format!("{name}.rank"), ty);
                }
                (name, ty)
            })
            .collect();
        let new = out.push_copy(g, n, inputs, outputs)?;
        let mut fresh = out.node(new).outputs[0..].to_vec();
        if zero >= 2 && node.op == Op::GradNorm {
            fresh[0] = combine_norms(&mut out, fresh[0], world)?;
        }
        for (&old, &f) in node.outputs.iter().zip(&fresh) {
            map[old.index()] = Some(f);
        }
    }
    out.set_outputs(
        g.outputs()
            .iter()
            .map(|&v| get(&map, v))
            .collect::<Result<_, _>>()?,
    );
    Ok(out)
}

/// The global norm from each rank's norm of its shards: the square root of the ranks' summed
/// squares (not finite when any rank's is not), named `grad_norm`.
fn combine_norms(out: &mut Graph, rank_norm: Value, world: usize) -> Result<Value, PassError> {
    let ty = out.ty(rank_norm).clone();
    let mut push = |op: Op, inputs: Vec<Value>, name: String| -> Result<Value, PassError> {
        let node = out.push_node(op, inputs, vec![(name, ty.clone())])?;
        Ok(out.node(node).outputs[0])
    };
    let squared = push(
        Op::Binary(castor_ir::BinaryOp::Mul),
        vec![rank_norm, rank_norm],
        format!("{GRAD_NORM}.rank.squared"),
    )?;
    let sum = push(
        Op::AllReduce {
            reduce: CollectiveOp::Sum,
            world,
        },
        vec![squared],
        format!("{GRAD_NORM}.squared"),
    )?;
    push(
        Op::Unary(castor_ir::UnaryOp::Sqrt),
        vec![sum],
        GRAD_NORM.to_string(),
    )
}

/// The type of one rank's flat shard of a `ty` value.
fn shard_type(ty: &TensorType, world: usize) -> TensorType {
    TensorType::new(
        ty.dtype,
        Shape(vec![ty.shape.numel().unwrap_or(0).div_ceil(world)]),
    )
}

/// The type value `v` of node `node` takes in the rebuilt graph: a state source of a sharded
/// entry is its shard.
fn rebuilt_type(
    g: &Graph,
    node: &castor_ir::NodeData,
    v: Value,
    sharded: &HashMap<String, TensorType>,
) -> TensorType {
    match sharded.get(g.name(v)) {
        Some(ty) if matches!(node.op, Op::State | Op::Param) => ty.clone(),
        _ => g.ty(v).clone(),
    }
}

/// The parameters `g` reads only through working copies (`param_copy`), by name.
fn copied_masters(g: &Graph) -> HashSet<String> {
    let users = g.users();
    g.params()
        .filter(|p| {
            let u = &users[p.index()];
            !u.is_empty()
                && u.iter()
                    .all(|&n| matches!(g.node(n).op, Op::ParamCopy { .. }))
        })
        .map(|p| g.name(p).to_string())
        .collect()
}

fn internal(message: String) -> PassError {
    PassError::Internal {
        pass: "parallel",
        message,
    }
}
