//! Rematerialization: recompute forward values in the backward part instead of keeping them.
//!
//! The pass rewrites a micro-step graph whose first `forward_nodes` nodes are the forward
//! pass. For a chosen set of forward nodes, each is cloned (same op, same operands, same
//! dtypes and accumulation, so its results are bit-identical) into the backward part right
//! before the first backward node that needs it, with its results named `<name>.remat` and a
//! `# remat: ...` note; every backward use is redirected to the clone. A clone whose operand is
//! itself recomputed reads that operand's clone, so recomputation chains stay inside the
//! backward part. The originals then die after their last forward use.
//!
//! Modes:
//! - `full`: recompute every node of every transformer block except the block's outputs (the
//!   values read after the block), so only each block's input is kept (Hugging Face's
//!   gradient checkpointing).
//! - `selective`: recompute the attention scores (the `q·kᵀ` product, its scaling and the
//!   softmax) and every cheap pointwise and layout op of a block but a sum of two products (a
//!   LoRA adapter's beside its base product: recomputing it would keep both); keep contraction and
//!   normalization outputs (Megatron-LM's selective recomputation). The attention-weighted
//!   sum's output is kept, as Megatron keeps its checkpointed region's output.
//! - `budget:<bytes>`: what to keep and what to recompute is solved as minimum cuts of the
//!   forward/backward graph over a range of prices of a saved byte ([`mincut`]), plus
//!   `selective` and `full`. Each candidate is rewritten and its step planned by the plan's
//!   memory model (the CUDA executor's, from the command line); the cheapest (by the cost model's recompute time) whose planned peak fits is
//!   chosen. The candidates do not depend on the budget, so a larger budget never costs more
//!   recompute. The former fixed sequence of growing sets ([`BudgetSearch::Greedy`]) stays as
//!   the baseline the cut is measured against.
//!
//! Blocks come from the IR (each node's `block`, recorded by the front end), never from value
//! names.

mod greedy;
mod mincut;
mod select;

use crate::cost::{node_cost, GpuSpec, NodeCost};
use crate::memory::{plan_graphs, MemoryModel, ScheduledGraph};
use crate::training::parallel::GATHERED_SUFFIX;
use crate::PassError;
use castor_ir::{human_bytes, Graph, Node, Op, Origin, Remat, Value};
use std::collections::{HashMap, HashSet};

/// Suffix of recomputed values' names.
pub const REMAT_SUFFIX: &str = ".remat";

/// A name for the same value across blocks, for reports: the value's name (a recomputed
/// value's original name) with the name segment that spells its node's block index replaced
/// by `*` (`h.*.attn.probs` for `h.3.attn.probs` in block 3). The block comes from the node;
/// a name that does not spell it stays as it is.
pub fn group_name(g: &Graph, v: Value) -> String {
    let name = g.name(v);
    let name = match g.has_origin(v, Origin::Remat) {
        true => name.strip_suffix(REMAT_SUFFIX).unwrap_or(name),
        false => name,
    };
    let Some(block) = g.node(g.value(v).producer).block else {
        return name.to_string();
    };
    let index = block.to_string();
    let mut replaced = false;
    let parts: Vec<&str> = name
        .split('.')
        .map(|part| {
            if !replaced && part == index {
                replaced = true;
                "*"
            } else {
                part
            }
        })
        .collect();
    parts.join(".")
}

/// What the budget search needs besides the micro step: where the forward pass ends, the
/// cost model's GPU, and the step's planned peak with a candidate as its micro step.
pub struct RematContext<'a> {
    /// Nodes of the forward pass at the head of the micro step.
    pub forward_nodes: usize,
    pub gpu: GpuSpec,
    /// The planned peak (state and everything else the executor allocates) of the step with
    /// this micro step.
    pub peak: Box<dyn Fn(&Graph) -> u64 + 'a>,
}

impl<'a> RematContext<'a> {
    /// The context of a plan's micro step: its state and the rest of its step as `model`
    /// lays them out (the model the anatomy and the fit verdict read, so the budget holds
    /// for the plan they report).
    pub fn of_plan(
        plan: &'a castor_ir::TrainingPlan,
        gpu: GpuSpec,
        model: &'a dyn MemoryModel,
    ) -> RematContext<'a> {
        let persistent = crate::memory::persistent_bytes(plan);
        RematContext {
            forward_nodes: plan.forward_nodes,
            gpu,
            peak: Box::new(move |g| persistent + model.step(plan, g).total()),
        }
    }

    /// The context of a lone graph (a forward and backward with no optimizer step):
    /// `persistent` bytes plus its node-level arena.
    pub fn of_graph(forward_nodes: usize, persistent: u64, gpu: GpuSpec) -> RematContext<'a> {
        RematContext {
            forward_nodes,
            gpu,
            peak: Box::new(move |g| {
                let graphs = [ScheduledGraph {
                    graph: g,
                    stored_outputs: HashSet::new(),
                }];
                persistent + plan_graphs(&graphs).arena_bytes
            }),
        }
    }
}

/// The result of the pass.
pub struct RematOutcome {
    pub graph: Graph,
    /// The recomputed values of `graph` (the clones).
    pub recomputed: Vec<Value>,
    /// Recompute cost by the cost model.
    pub cost: NodeCost,
    /// The simulated peak (persistent + arena) when the budget search planned it.
    pub peak: Option<u64>,
    /// Candidates the budget search evaluated.
    pub evaluated: usize,
    /// One line for the report.
    pub summary: String,
}

/// Facts about the forward nodes the selections use.
struct Forward {
    n: usize,
    /// Block of each forward node, as the front end recorded it.
    block: Vec<Option<u32>>,
    /// Nodes that may be recomputed: in a block, not a source or parameter copy, no result
    /// read outside its block or a graph output.
    eligible: Vec<bool>,
}

fn analyse(g: &Graph, forward_nodes: usize) -> Forward {
    let n = forward_nodes.min(g.num_nodes());
    let block: Vec<Option<u32>> = g.nodes().take(n).map(|(_, d)| d.block).collect();
    let mut leaves = vec![false; n];
    for (node, d) in g.nodes().take(n) {
        for &v in &d.inputs {
            let p = g.value(v).producer.index();
            if p < n && block[p] != block[node.index()] {
                leaves[p] = true;
            }
        }
    }
    for &v in g.outputs() {
        let p = g.value(v).producer.index();
        if p < n {
            leaves[p] = true;
        }
    }
    let eligible = g
        .nodes()
        .take(n)
        .map(|(node, d)| {
            let i = node.index();
            block[i].is_some()
                && !leaves[i]
                && !d.op.is_source()
                && !matches!(d.op, Op::ParamCopy { .. })
        })
        .collect();
    Forward { n, block, eligible }
}

/// The suffix of a ZeRO-3 parameter gathered again for the backward.
pub const REGATHERED_SUFFIX: &str = ".regathered";

/// Whether `v` is a ZeRO-3 parameter gathered in the forward (the `parallel` pass's).
fn is_gather(g: &Graph, v: Value) -> bool {
    g.node(g.value(v).producer).origin == Some(Origin::Gather)
}

/// Whether `g`'s forward (its first `forward_nodes` nodes) gathers parameters (ZeRO-3).
fn gathers(g: &Graph, forward_nodes: usize) -> bool {
    g.nodes()
        .take(forward_nodes)
        .any(|(_, d)| d.outputs.first().is_some_and(|&v| is_gather(g, v)))
}

/// Rewrites `g`, recomputing the forward nodes marked in `recompute`.
pub fn apply(g: &Graph, forward_nodes: usize, recompute: &[bool]) -> Result<Graph, PassError> {
    let n = forward_nodes.min(g.num_nodes());
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    let mut clone: Vec<Option<Value>> = vec![None; g.num_values()];
    // A ZeRO-3 parameter gathered for the forward is gathered again for the backward rather
    // than kept whole in between, whatever the mode.
    let is_recomputed = |v: Value| -> bool {
        let p = g.value(v).producer.index();
        p < n && (recompute.get(p).copied().unwrap_or(false) || is_gather(g, v))
    };
    for (node, d) in g.nodes() {
        let backward = node.index() >= n;
        let mut inputs = Vec::with_capacity(d.inputs.len());
        for &v in &d.inputs {
            let nv = if backward && is_recomputed(v) {
                ensure_clone(g, &mut out, v, node, &map, &mut clone, &is_recomputed)?
            } else {
                map[v.index()].ok_or_else(|| internal("operand defined later".into()))?
            };
            inputs.push(nv);
        }
        let outputs = d
            .outputs
            .iter()
            .map(|&v| (g.name(v).to_string(), g.ty(v).clone()))
            .collect();
        let nn = out.push_copy(g, node, inputs, outputs)?;
        for (&old, &new) in d.outputs.iter().zip(&out.node(nn).outputs) {
            map[old.index()] = Some(new);
        }
    }
    let outputs = g
        .outputs()
        .iter()
        .map(|&v| map[v.index()].ok_or_else(|| internal("output not defined".into())))
        .collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(outputs);
    Ok(out)
}

/// The clone of forward value `v` for backward node `user`, made (with the clones it reads)
/// when this is its first backward use.
fn ensure_clone(
    g: &Graph,
    out: &mut Graph,
    v: Value,
    user: Node,
    map: &[Option<Value>],
    clone: &mut [Option<Value>],
    is_recomputed: &dyn Fn(Value) -> bool,
) -> Result<Value, PassError> {
    if let Some(c) = clone[v.index()] {
        return Ok(c);
    }
    let p = g.value(v).producer;
    let d = g.node(p);
    let mut inputs = Vec::with_capacity(d.inputs.len());
    for &u in &d.inputs {
        let nu = if is_recomputed(u) {
            ensure_clone(g, out, u, user, map, clone, is_recomputed)?
        } else {
            map[u.index()].ok_or_else(|| internal("operand defined later".into()))?
        };
        inputs.push(nu);
    }
    let gather = is_gather(g, v);
    let clone_name = |o: Value| match gather {
        true => format!(
            "{}{REGATHERED_SUFFIX}",
            g.name(o).trim_end_matches(GATHERED_SUFFIX)
        ),
        false => format!("{}{REMAT_SUFFIX}", g.name(o)),
    };
    let outputs = d
        .outputs
        .iter()
        .map(|&o| (clone_name(o), g.ty(o).clone()))
        .collect();
    let nn = out.push_copy(g, p, inputs, outputs)?;
    out.set_origin(
        nn,
        Some(match gather {
            true => Origin::Regather,
            false => Origin::Remat,
        }),
    );
    let first_user = g
        .node(user)
        .outputs
        .first()
        .map_or(String::new(), |&u| g.name(u).to_string());
    let what = if gather {
        "gathers again"
    } else {
        "recomputes"
    };
    out.set_note(
        nn,
        Some(format!(
            "remat: {what} %{} for %{first_user}",
            g.name(d.outputs[0])
        )),
    );
    for (&old, &new) in d.outputs.iter().zip(&out.node(nn).outputs) {
        clone[old.index()] = Some(new);
    }
    clone[v.index()].ok_or_else(|| internal("clone has no such result".into()))
}

fn internal(message: String) -> PassError {
    PassError::Internal {
        pass: "remat",
        message,
    }
}

/// `g` recomputing nothing: itself, or under ZeRO-3 with the parameters gathered again for
/// the backward.
fn keep_all(g: &Graph, forward_nodes: usize) -> Result<Graph, PassError> {
    match gathers(g, forward_nodes) {
        true => apply(g, forward_nodes, &[]),
        false => Ok(g.clone()),
    }
}

/// The recomputed values of a rewritten graph (the clones) and their cost.
pub fn recomputed(g: &Graph, gpu: &GpuSpec) -> (Vec<Value>, NodeCost) {
    let mut values = Vec::new();
    let mut cost = NodeCost::default();
    for (n, d) in g.nodes() {
        if d.origin == Some(Origin::Remat) {
            cost += node_cost(g, n, gpu);
            values.extend(d.outputs.iter().copied());
        }
    }
    (values, cost)
}

/// Values grouped by [`group_name`], with counts, in first-seen order: `h.*.attn.probs x12`.
pub fn group_counts(g: &Graph, values: &[Value]) -> Vec<(String, usize)> {
    let mut order: Vec<String> = Vec::new();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for &v in values {
        let k = group_name(g, v);
        let c = counts.entry(k.clone()).or_insert(0);
        if *c == 0 {
            order.push(k);
        }
        *c += 1;
    }
    order
        .into_iter()
        .map(|k| {
            let c = counts.get(&k).copied().unwrap_or(0);
            (k, c)
        })
        .collect()
}

/// Which recompute sets a budget search plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetSearch {
    /// Minimum cuts of the forward/backward graph over a range of prices of a saved byte
    /// ([`mincut`]), plus `selective` and `full`: what `--remat budget:` runs.
    MinCut,
    /// The former fixed sequence of growing sets ([`greedy`]), plus `selective` and `full`:
    /// the baseline the minimum cut is measured against.
    Greedy,
}

/// Runs rematerialization on a micro-step graph.
pub fn rematerialize(
    g: &Graph,
    mode: Remat,
    ctx: &RematContext<'_>,
) -> Result<RematOutcome, PassError> {
    match mode {
        Remat::Budget(budget) => fit_budget(g, ctx, budget, BudgetSearch::MinCut),
        Remat::None => Ok(outcome(keep_all(g, ctx.forward_nodes)?, mode, ctx, None, 0)),
        Remat::Full | Remat::Selective => {
            let f = analyse(g, ctx.forward_nodes);
            let r = if mode == Remat::Full {
                select::select_full(&f)
            } else {
                select::select_selective(g, &f)
            };
            Ok(outcome(apply(g, f.n, &r)?, mode, ctx, None, 0))
        }
    }
}

/// The cheapest recomputation (by the cost model's time) among `search`'s candidates whose
/// planned peak (state + the whole step's arena) fits `budget`. Keeping everything is tried
/// first. The candidates do not depend on the budget, so a larger budget never costs more.
pub fn fit_budget(
    g: &Graph,
    ctx: &RematContext<'_>,
    budget: u64,
    search: BudgetSearch,
) -> Result<RematOutcome, PassError> {
    let mode = Remat::Budget(budget);
    let f = analyse(g, ctx.forward_nodes);
    let mut evaluated = 0;
    let mut min_peak = u64::MAX;
    let mut best: Option<(f64, u64, Graph)> = None;
    let mut consider = |graph: Graph, best: &mut Option<(f64, u64, Graph)>| {
        evaluated += 1;
        let peak = (ctx.peak)(&graph);
        min_peak = min_peak.min(peak);
        if peak <= budget {
            let (_, cost) = recomputed(&graph, &ctx.gpu);
            if best.as_ref().is_none_or(|b| cost.seconds < b.0) {
                *best = Some((cost.seconds, peak, graph));
            }
        }
    };
    consider(keep_all(g, ctx.forward_nodes)?, &mut best);
    if best.is_none() {
        match search {
            BudgetSearch::MinCut => {
                for r in mincut::candidates(g, &f, &ctx.gpu) {
                    consider(apply(g, f.n, &r)?, &mut best);
                }
            }
            BudgetSearch::Greedy => {
                // Prefixes of the sequence cost more and more: the first that fits is the
                // cheapest of them.
                for r in greedy::budget_sequence(g, &f, &ctx.gpu) {
                    let before = best.is_some();
                    consider(apply(g, f.n, &r)?, &mut best);
                    if !before && best.is_some() {
                        break;
                    }
                }
            }
        }
        consider(apply(g, f.n, &select::select_selective(g, &f))?, &mut best);
        consider(apply(g, f.n, &select::select_full(&f))?, &mut best);
    }
    match best {
        Some((_, peak, graph)) => Ok(outcome(graph, mode, ctx, Some(peak), evaluated)),
        None => Err(PassError::Remat(format!(
            "no recomputation fits the step in {} ({budget} bytes): the smallest simulated \
             peak castor can plan is {} ({min_peak} bytes); use --remat budget:{min_peak} or \
             more",
            human_bytes(budget),
            human_bytes(min_peak)
        ))),
    }
}

/// The pass's result for a rewritten graph, with its report line.
fn outcome(
    graph: Graph,
    mode: Remat,
    ctx: &RematContext<'_>,
    peak: Option<u64>,
    evaluated: usize,
) -> RematOutcome {
    let (values, cost) = recomputed(&graph, &ctx.gpu);
    let groups = group_counts(&graph, &values);
    let shown: Vec<String> = groups
        .iter()
        .take(6)
        .map(|(k, c)| format!("{k} x{c}"))
        .collect();
    let more = groups.len().saturating_sub(shown.len());
    let budget = match (mode, peak) {
        (Remat::Budget(budget), Some(peak)) => format!(
            "; simulated peak {} of {} budget ({evaluated} candidates planned)",
            human_bytes(peak),
            human_bytes(budget),
        ),
        _ => String::new(),
    };
    let summary = format!(
        "remat {mode}: recomputes {} value(s) in {} group(s){}{}; +{:.3} GFLOP, +{:.3} ms on {}{budget}",
        values.len(),
        groups.len(),
        if shown.is_empty() {
            String::new()
        } else {
            format!(" ({})", shown.join(", "))
        },
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        },
        cost.flops / 1e9,
        cost.seconds * 1e3,
        ctx.gpu.name,
    );
    RematOutcome {
        graph,
        recomputed: values,
        cost,
        peak,
        evaluated,
        summary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_names_come_from_the_node_block() {
        let g = castor_ir::text::parse(
            "graph g {
               %x: f32[2] = input
               %h.11.act: f32[2] = tanh(%x) {block=11}
               %h.11.act.remat: f32[2] = tanh(%x) {block=11, origin=remat}
               %h.11.out.remat: f32[2] = tanh(%x) {block=11}
               %blk3_act: f32[2] = tanh(%x) {block=3}
               %h.1.act: f32[2] = tanh(%x)
               return %h.11.act
             }",
        )
        .unwrap();
        let v = |n: &str| g.lookup(n).unwrap();
        assert_eq!(group_name(&g, v("h.11.act")), "h.*.act");
        assert_eq!(group_name(&g, v("h.11.act.remat")), "h.*.act");
        // A name that only looks recomputed is its own group.
        assert_eq!(group_name(&g, v("h.11.out.remat")), "h.*.out.remat");
        assert_eq!(group_name(&g, v("blk3_act")), "blk3_act");
        assert_eq!(group_name(&g, v("h.1.act")), "h.1.act");
        assert_eq!(group_name(&g, v("x")), "x");
    }

    #[test]
    fn remat_modes_parse() {
        assert_eq!("none".parse::<Remat>(), Ok(Remat::None));
        assert_eq!("budget:2KiB".parse::<Remat>(), Ok(Remat::Budget(2048)));
        assert_eq!(
            "budget:1.5GB".parse::<Remat>(),
            Ok(Remat::Budget(1_500_000_000))
        );
        assert!("budget:lots".parse::<Remat>().is_err());
        assert!("some".parse::<Remat>().is_err());
    }
}
