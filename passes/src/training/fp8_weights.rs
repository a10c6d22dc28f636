//! `fp8_weights`: under `--precision fp8`, each weight's FP8 copy is made once per optimizer
//! step, by the optimizer, as a BF16 working copy is, instead of once per micro-batch.
//!
//! The `fp8` pass casts a weight from its F32 master where the products read it
//! (`fp8_scale(W)`, `quantize(W, scale)`). Both are functions of the master alone, which
//! changes only in the optimizer step, so this pass moves them there: the micro step reads
//! the copy and its scale as state entries (`<weight>.fp8`, `<weight>.fp8_scale`), and the
//! optimizer step casts each updated master and writes them. The values are the same bits:
//! the cast reads the same master, whenever it runs. What changes is the cost: with
//! `--grad-accum N`, one cast per step instead of N, and the micro step no longer reads the
//! F32 master (4 bytes per weight) to cast it; the copy is kept between steps (1 byte per
//! weight, the anatomy's low-precision weights, where a BF16 copy would take 2).
//!
//! A frozen weight (the base under LoRA adapters) is never updated: its FP8 copy is made once,
//! from the checkpoint, and replaces its F32 entry, as `--base nf4` replaces it by NF4 codes.
//!
//! Left in the micro step, with the reason in the report:
//! - under `--update-in-backward` each update runs in the micro step already, once per step;
//! - under ZeRO-3 a rank updates a shard of the master, and the copy's scale needs the whole
//!   master's amax: the micro step casts the gathered master.

use super::{PlanBuild, PlanPass};
use crate::{PassError, PassReport};
use castor_ir::{
    thousands, Accum, DType, Fp8Part, Graph, Node, Op, StateInit, StateRole, StateSpec, TensorType,
    Value, Write,
};
use std::collections::{HashMap, HashSet};

pub(super) struct Fp8WeightCopies;

/// One weight the micro step casts to FP8 from its master.
struct Cast {
    /// The master (a parameter of the micro step).
    master: Value,
    format: DType,
    margin: usize,
    /// The `fp8_scale` and `quantize` nodes that make the copy.
    nodes: [Node; 2],
    /// Their results the products read: the scale and the FP8 values.
    scale: Value,
    values: Value,
}

impl PlanPass for Fp8WeightCopies {
    fn name(&self) -> &'static str {
        "fp8_weights"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let plan = &mut build.plan;
        let casts = weight_casts(&plan.micro_step)?;
        if casts.is_empty() {
            return Ok(PassReport::new("no FP8 weights"));
        }
        let settings = &plan.settings;
        if settings.update_in_backward {
            return Ok(PassReport::new(format!(
                "{} FP8 weight cast(s) kept in the micro step: under --update-in-backward the \
                 updates run there, once per step",
                casts.len()
            )));
        }
        if settings.parallel.zero >= 3 && !settings.parallel.is_single() {
            return Ok(PassReport::new(format!(
                "{} FP8 weight cast(s) kept in the micro step: under ZeRO-3 a rank updates a \
                 shard of each master, and the copy's scale needs the whole master's amax",
                casts.len()
            )));
        }
        let g = &plan.micro_step;
        let masters: Vec<String> = casts.iter().map(|c| g.name(c.master).to_string()).collect();
        let role_of = |name: &str| plan.state_spec(name).map(|s| s.role);
        let (micro_step, forward_nodes) = rebuild_micro_step(g, plan.forward_nodes, &casts)?;

        // State: each copy and its scale; a frozen master no graph reads any more leaves.
        let mut state = Vec::with_capacity(plan.state.len() + 2 * casts.len());
        let mut made: HashSet<String> = HashSet::new();
        let mut frozen = 0;
        let mut bytes = 0u64;
        let still_read = |name: &str| {
            micro_step.lookup(name).is_some() || plan.optimizer_step.lookup(name).is_some()
        };
        for spec in &plan.state {
            let cast = casts
                .iter()
                .zip(&masters)
                .find(|(_, m)| **m == spec.name)
                .map(|(c, _)| c);
            let Some(cast) = cast else {
                state.push(spec.clone());
                continue;
            };
            let role = match role_of(&spec.name) {
                Some(StateRole::Frozen) => {
                    if still_read(&spec.name) {
                        state.push(spec.clone());
                    } else {
                        frozen += 1;
                    }
                    StateRole::Frozen
                }
                _ => {
                    state.push(spec.clone());
                    StateRole::WorkingCopy
                }
            };
            if !made.insert(spec.name.clone()) {
                continue;
            }
            for (part, ty) in [
                (
                    Fp8Part::Values,
                    TensorType::new(cast.format, spec.ty.shape.clone()),
                ),
                (Fp8Part::Scale, scalar()),
            ] {
                bytes += ty.size_bytes().unwrap_or(0) as u64;
                state.push(StateSpec {
                    shard_of: None,
                    name: part.name(&spec.name),
                    ty,
                    role,
                    init: StateInit::Fp8CopyOf {
                        master: spec.name.clone(),
                        format: cast.format,
                        part,
                    },
                });
            }
        }
        if made.len() != masters.iter().collect::<HashSet<_>>().len() {
            return Err(internal("an FP8 weight's master has no state entry".into()));
        }

        // The optimizer step casts each updated master after its update.
        let (optimizer_step, writes) =
            cast_updates(&plan.optimizer_step, &plan.optimizer_step_writes, &casts, g)?;
        let updated = writes.len() / 2;
        plan.micro_step = micro_step;
        plan.forward_nodes = forward_nodes;
        plan.optimizer_step = optimizer_step;
        plan.optimizer_step_writes.extend(writes);
        plan.state = state;
        let mut what = Vec::new();
        if updated > 0 {
            what.push(format!(
                "{updated} cast by the optimizer step after each update, instead of in every \
                 micro-batch"
            ));
        }
        if frozen > 0 {
            what.push(format!(
                "{frozen} frozen, cast once from the checkpoint and kept instead of their F32 \
                 values"
            ));
        }
        let fixed = made.len().saturating_sub(updated + frozen);
        if fixed > 0 {
            what.push(format!(
                "{fixed} not trained (--freeze), cast once from the checkpoint"
            ));
        }
        Ok(PassReport::new(format!(
            "{} FP8 weight copies ({} bytes with their scales): {}",
            made.len(),
            thousands(bytes),
            what.join("; ")
        )))
    }
}

/// Every cast of a master to FP8 in the micro step: an `fp8_scale` of a parameter and the
/// `quantize` of that parameter by that scale, whose amax nothing reads.
fn weight_casts(g: &Graph) -> Result<Vec<Cast>, PassError> {
    let users = g.users();
    let mut casts = Vec::new();
    for (n, node) in g.nodes() {
        let Op::Fp8Scale { to, margin } = node.op else {
            continue;
        };
        let master = node.inputs[0];
        if g.node(g.value(master).producer).op != Op::Param {
            continue;
        }
        let scale = node.outputs[0];
        let quantize = users[scale.index()].iter().copied().find(|&u| {
            let q = g.node(u);
            matches!(q.op, Op::Quantize { to: t } if t == to) && q.inputs == [master, scale]
        });
        let Some(q) = quantize else {
            return Err(internal(format!(
                "the FP8 scale `%{}` of `%{}` has no cast",
                g.name(scale),
                g.name(master)
            )));
        };
        let (values, amax) = (g.node(q).outputs[0], g.node(q).outputs[1]);
        if !users[amax.index()].is_empty() || g.outputs().contains(&amax) {
            return Err(internal(format!(
                "the amax `%{}` of a weight's FP8 cast is read",
                g.name(amax)
            )));
        }
        casts.push(Cast {
            master,
            format: to,
            margin,
            nodes: [n, q],
            scale,
            values,
        });
    }
    Ok(casts)
}

/// The micro step reading each cast's results as state, the casts and the masters they alone
/// read removed; and the new count of forward nodes.
fn rebuild_micro_step(
    g: &Graph,
    forward_nodes: usize,
    casts: &[Cast],
) -> Result<(Graph, usize), PassError> {
    let users = g.users();
    let removed: HashSet<Node> = casts.iter().flat_map(|c| c.nodes).collect();
    let by_scale_node: HashMap<Node, &Cast> = casts.iter().map(|c| (c.nodes[0], c)).collect();
    let unread_master = |v: Value| {
        !g.outputs().contains(&v) && users[v.index()].iter().all(|u| removed.contains(u))
    };
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    let mut state_of: HashMap<Value, (Value, Value)> = HashMap::new();
    let mut forward = forward_nodes;
    for (n, node) in g.nodes() {
        if n.index() == forward_nodes {
            forward = out.num_nodes();
        }
        if let Some(cast) = by_scale_node.get(&n) {
            let (values, scale) = match state_of.get(&cast.master) {
                Some(&made) => made,
                None => {
                    let master = g.name(cast.master);
                    let mut state = |part: Fp8Part, ty: TensorType| {
                        let made = out
                            .push_node(Op::State, vec![], vec![(part.name(master), ty)])
                            .map_err(ir)?;
                        Ok::<Value, PassError>(out.node(made).outputs[0])
                    };
                    let values = state(Fp8Part::Values, g.ty(cast.values).clone())?;
                    let scale = state(Fp8Part::Scale, scalar())?;
                    *state_of.entry(cast.master).or_insert((values, scale))
                }
            };
            map[cast.values.index()] = Some(values);
            map[cast.scale.index()] = Some(scale);
            continue;
        }
        if removed.contains(&n) {
            continue;
        }
        if node.op == Op::Param && node.outputs.iter().all(|&v| unread_master(v)) {
            continue;
        }
        let ins = node
            .inputs
            .iter()
            .map(|&v| {
                map[v.index()].ok_or_else(|| {
                    internal(format!("`%{}` is used before it is defined", g.name(v)))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let outs = node
            .outputs
            .iter()
            .map(|&v| (g.name(v).to_string(), g.ty(v).clone()))
            .collect();
        let copy = out.push_copy(g, n, ins, outs).map_err(ir)?;
        for (&old, &new) in node.outputs.iter().zip(&out.node(copy).outputs) {
            map[old.index()] = Some(new);
        }
    }
    if forward_nodes >= g.num_nodes() {
        forward = out.num_nodes();
    }
    let outputs = g
        .outputs()
        .iter()
        .map(|&v| map[v.index()].ok_or_else(|| internal("an output is unmapped".into())))
        .collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(outputs);
    Ok((out, forward))
}

/// The optimizer step with each updated master of `casts` cast to FP8 after its update (the
/// same `fp8_scale` and `quantize` as the micro step's), and the writes of the copies.
fn cast_updates(
    opt: &Graph,
    writes: &[Write],
    casts: &[Cast],
    micro: &Graph,
) -> Result<(Graph, Vec<Write>), PassError> {
    let mut out = opt.clone();
    let mut outputs = out.outputs().to_vec();
    let mut new_writes = Vec::new();
    let mut done = HashSet::new();
    // The scales first, then the casts: the scales can then join the update's multi-tensor
    // launch (which takes the maxima of the masters it leaves) before any cast reads them.
    let mut scales = Vec::new();
    for cast in casts {
        let master = micro.name(cast.master);
        if !done.insert(master) {
            continue;
        }
        // The updated master: the output the optimizer step writes back to it (none for a
        // frozen weight).
        let Some(updated) = writes
            .iter()
            .find(|w| w.state == master)
            .and_then(|w| out.lookup(&w.output))
        else {
            continue;
        };
        let block = opt.node(opt.value(updated).producer).block;
        let scale_entry = Fp8Part::Scale.name(master);
        let scale = out
            .push_node(
                Op::Fp8Scale {
                    to: cast.format,
                    margin: cast.margin,
                },
                vec![updated],
                vec![(format!("{scale_entry}.next"), scalar())],
            )
            .map_err(ir)?;
        out.set_block(scale, block);
        out.set_acc(scale, Some(Accum::F32));
        out.set_note(
            scale,
            Some(format!(
                "fp8: the scale of the updated `{master}`'s FP8 copy, once per optimizer step"
            )),
        );
        scales.push((cast, master, updated, block, out.node(scale).outputs[0]));
    }
    for (cast, master, updated, block, scale) in scales {
        let (values_entry, scale_entry) =
            (Fp8Part::Values.name(master), Fp8Part::Scale.name(master));
        let q = out
            .push_node(
                Op::Quantize { to: cast.format },
                vec![updated, scale],
                vec![
                    (
                        format!("{values_entry}.next"),
                        TensorType::new(cast.format, out.ty(updated).shape.clone()),
                    ),
                    (format!("{values_entry}.amax"), scalar()),
                ],
            )
            .map_err(ir)?;
        out.set_block(q, block);
        out.set_note(
            q,
            Some(format!(
                "fp8: the updated `{master}` cast to its FP8 copy, which the next micro-batches \
                 read"
            )),
        );
        outputs.push(out.node(q).outputs[0]);
        outputs.push(scale);
        for entry in [values_entry, scale_entry] {
            new_writes.push(Write {
                output: format!("{entry}.next"),
                state: entry,
            });
        }
    }
    out.set_outputs(outputs);
    Ok((out, new_writes))
}

fn scalar() -> TensorType {
    TensorType::new(DType::F32, castor_ir::Shape(vec![]))
}

fn ir(e: castor_ir::IrError) -> PassError {
    internal(e.to_string())
}

fn internal(message: String) -> PassError {
    PassError::Internal {
        pass: "fp8_weights",
        message,
    }
}
