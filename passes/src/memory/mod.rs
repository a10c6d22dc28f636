//! Schedule, liveness and the arena plan of one training step; the memory anatomy.
//!
//! The step is linearized as the micro step followed by the optimizer step, each in node
//! order (a topological order). Values of two kinds exist:
//!
//! - *persistent*: `param`, `state` and `param_copy` results, and graph outputs that a write
//!   stores into state (the accumulated gradients, the optimizer's updated buffers). They are
//!   the plan's state table and live in their own region for the whole run.
//! - *transient*: everything else (batch inputs included). A transient lives from the node
//!   that produces it to its last reader (as the CPU executor frees a value after its last
//!   use); a graph output that is not stored (the loss, the gradient norm) lives to the end of
//!   its graph; an unread result lives while its node runs.
//!
//! Transients get offsets in one arena, with sizes rounded up to 256 bytes. Placement is
//! greedy, best fit (the smallest gap between already-placed buffers that overlap in time and
//! that holds the buffer; else above them all), in three orders: by size, largest first (XLA's
//! heap simulator and TFLite's greedy-by-size); by size class (sizes within 1%, each
//! reserving its class's largest size) then first use, which keeps chains of equal buffers
//! (the logits and their gradients) in two alternating slots; and by first use. The smallest
//! arena wins. Its lower bound is the largest total of live transient bytes (aligned sizes) at
//! any point of the schedule.

mod model;
mod place;

pub use model::{MemoryModel, NodeLevel, StepMemory};
pub use place::PlacementOrder;

use castor_ir::{Graph, Op, StateRole, TrainingPlan, Value};
use std::collections::HashSet;

/// Arena offsets and sizes are multiples of this.
pub const ALIGNMENT: u64 = 256;

pub fn align(bytes: u64) -> u64 {
    bytes.div_ceil(ALIGNMENT) * ALIGNMENT
}

/// One transient buffer of the arena.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    /// 0 = micro step, 1 = optimizer step.
    pub graph: usize,
    pub value: Value,
    /// Aligned size in bytes.
    pub size: u64,
    /// First and last schedule positions (inclusive) at which it is live.
    pub start: usize,
    pub end: usize,
    pub offset: u64,
}

/// The arena plan of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    pub buffers: Vec<Buffer>,
    /// Bytes of the arena (the highest end of any buffer).
    pub arena_bytes: u64,
    /// Max over the schedule of live transient bytes (aligned sizes).
    pub lower_bound: u64,
    /// Schedule position at which the lower bound is reached.
    pub peak_position: usize,
    pub order: PlacementOrder,
    /// The smallest arena of the other placement orders.
    pub other_order_bytes: u64,
    /// Schedule length (nodes of both graphs).
    pub schedule_len: usize,
}

impl MemoryPlan {
    /// Arena over its lower bound (1.0 = optimal).
    pub fn ratio(&self) -> f64 {
        if self.lower_bound == 0 {
            1.0
        } else {
            self.arena_bytes as f64 / self.lower_bound as f64
        }
    }
}

/// A graph of the step and the names of its outputs that are stored into state.
pub struct ScheduledGraph<'a> {
    pub graph: &'a Graph,
    pub stored_outputs: HashSet<&'a str>,
}

fn stored(writes: &[castor_ir::Write]) -> HashSet<&str> {
    writes.iter().map(|w| w.output.as_str()).collect()
}

/// The plan's two graphs in schedule order.
pub fn step_graphs(plan: &TrainingPlan) -> [ScheduledGraph<'_>; 2] {
    [
        ScheduledGraph {
            graph: &plan.micro_step,
            stored_outputs: stored(&plan.micro_step_writes),
        },
        ScheduledGraph {
            graph: &plan.optimizer_step,
            stored_outputs: stored(&plan.optimizer_step_writes),
        },
    ]
}

/// True for the results that live in the persistent region.
fn is_persistent(g: &Graph, v: Value, stored: &HashSet<&str>) -> bool {
    matches!(
        g.node(g.value(v).producer).op,
        Op::Param | Op::State | Op::ParamCopy { .. }
    ) || stored.contains(g.name(v))
}

/// The transient buffers of the schedule with their live ranges (offsets unset).
pub fn liveness(graphs: &[ScheduledGraph<'_>]) -> (Vec<Buffer>, usize) {
    let mut buffers = Vec::new();
    let mut base = 0usize;
    for (gi, sg) in graphs.iter().enumerate() {
        let g = sg.graph;
        let n = g.num_nodes();
        let last = base + n.saturating_sub(1);
        let mut end: Vec<usize> = vec![0; g.num_values()];
        for (v, data) in g.values() {
            end[v.index()] = base + data.producer.index();
        }
        for (node, data) in g.nodes() {
            for &v in &data.inputs {
                let e = &mut end[v.index()];
                *e = (*e).max(base + node.index());
            }
        }
        for &v in g.outputs() {
            end[v.index()] = last;
        }
        for (v, data) in g.values() {
            if is_persistent(g, v, &sg.stored_outputs) {
                continue;
            }
            buffers.push(Buffer {
                graph: gi,
                value: v,
                size: align(data.ty.size_bytes().unwrap_or(0) as u64),
                start: base + data.producer.index(),
                end: end[v.index()],
                offset: 0,
            });
        }
        base += n;
    }
    (buffers, base)
}

/// Max over positions of live bytes, and where.
fn lower_bound(buffers: &[Buffer], len: usize) -> (u64, usize) {
    let mut delta = vec![0i128; len + 1];
    for b in buffers {
        delta[b.start] += b.size as i128;
        delta[b.end + 1] -= b.size as i128;
    }
    let (mut live, mut best, mut at) = (0i128, 0i128, 0usize);
    for (i, d) in delta.iter().take(len).enumerate() {
        live += d;
        if live > best {
            best = live;
            at = i;
        }
    }
    (best.max(0) as u64, at)
}

/// Plans the arena of a schedule of graphs.
pub fn plan_graphs(graphs: &[ScheduledGraph<'_>]) -> MemoryPlan {
    let (buffers, len) = liveness(graphs);
    place_buffers(buffers, len)
}

/// Places `buffers` (live ranges over a schedule of `len` positions) in one arena: best fit
/// in each [`PlacementOrder`], the smallest arena wins. Executors that schedule at another
/// granularity than nodes (fused kernels, scratch buffers) compute their own ranges and
/// place them here.
pub fn place_buffers(buffers: Vec<Buffer>, len: usize) -> MemoryPlan {
    let (lb, peak_position) = lower_bound(&buffers, len);
    let layout = place::IndexLayout::new(&buffers);
    // The orders are independent: each runs on its own thread.
    let placed: Vec<(u64, Vec<Buffer>)> = std::thread::scope(|scope| {
        let (layout, buffers) = (&layout, &buffers);
        let runs: Vec<_> = PlacementOrder::ALL
            .iter()
            .map(|&order| {
                scope.spawn(move || {
                    let (idx, reserve) = order.indices(buffers);
                    let mut placed = buffers.clone();
                    let bytes = place::place(layout, &mut placed, &idx, &reserve);
                    (bytes, placed)
                })
            })
            .collect();
        runs.into_iter()
            .map(|r| r.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let mut best: Option<(u64, PlacementOrder, Vec<Buffer>)> = None;
    let mut other = u64::MAX;
    for (order, (bytes, placed)) in PlacementOrder::ALL.into_iter().zip(placed) {
        match &best {
            Some((b, _, _)) if *b <= bytes => other = other.min(bytes),
            _ => {
                if let Some((b, _, _)) = &best {
                    other = other.min(*b);
                }
                best = Some((bytes, order, placed));
            }
        }
    }
    let (arena_bytes, order, buffers) = best.unwrap_or((0, PlacementOrder::BySize, buffers));
    let other = if other == u64::MAX {
        arena_bytes
    } else {
        other
    };
    MemoryPlan {
        buffers,
        arena_bytes,
        lower_bound: lb,
        peak_position,
        order,
        other_order_bytes: other,
        schedule_len: len,
    }
}

/// Bytes of the persistent region: the state table.
pub fn persistent_bytes(plan: &TrainingPlan) -> u64 {
    plan.state
        .iter()
        .map(|s| s.ty.size_bytes().unwrap_or(0) as u64)
        .sum()
}

/// Forward values read by the backward part of a micro-step graph whose first
/// `forward_nodes` nodes are the forward pass: (value, bytes), in definition order. Sources
/// (batch inputs, parameters, state) and parameter copies are not activations.
pub fn saved_activations(g: &Graph, forward_nodes: usize) -> Vec<(Value, u64)> {
    let mut read_later = vec![false; g.num_values()];
    for (n, data) in g.nodes().skip(forward_nodes) {
        let _ = n;
        for &v in &data.inputs {
            read_later[v.index()] = true;
        }
    }
    g.nodes()
        .take(forward_nodes)
        .filter(|(_, d)| !d.op.is_source() && !matches!(d.op, Op::ParamCopy { .. }))
        .flat_map(|(_, d)| d.outputs.iter().copied())
        .filter(|v| read_later[v.index()])
        .map(|v| (v, g.ty(v).size_bytes().unwrap_or(0) as u64))
        .collect()
}

/// Saved activation bytes per transformer block (by the producing node's block), and
/// outside blocks.
pub fn saved_per_block(g: &Graph, forward_nodes: usize) -> (Vec<(u32, u64)>, u64) {
    let mut per: std::collections::BTreeMap<u32, u64> = Default::default();
    let mut outside = 0;
    for (v, bytes) in saved_activations(g, forward_nodes) {
        match g.node(g.value(v).producer).block {
            Some(i) => *per.entry(i).or_default() += bytes,
            None => outside += bytes,
        }
    }
    (per.into_iter().collect(), outside)
}

/// What the bytes of one training step hold.
#[derive(Clone, Debug, PartialEq)]
pub struct Anatomy {
    pub params: u64,
    pub low_precision_weights: u64,
    /// Of the low-precision weights: the FP8 copies and their scales.
    pub fp8_copies: u64,
    /// Of the frozen weights: the FP8 copies and their scales.
    pub fp8_frozen: u64,
    pub master_weights: u64,
    /// Parameters that are not trained, stored once (the base under LoRA adapters).
    pub frozen_weights: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub control: u64,
    /// FP8 delayed scaling's scales and amax histories (`fp8:delayed`).
    pub fp8_scaling: u64,
    /// Forward values read by the backward pass (part of the arena).
    pub saved_activations: u64,
    /// The rest of the step as `model` lays it out: arena, workspace, other buffers.
    pub memory: StepMemory,
}

/// The bytes of the FP8 weight copies (and their scales) of `role`.
fn fp8_copy_bytes(plan: &TrainingPlan, role: StateRole) -> u64 {
    plan.state
        .iter()
        .filter(|s| s.role == role && matches!(s.init, castor_ir::StateInit::Fp8CopyOf { .. }))
        .map(|s| s.ty.size_bytes().unwrap_or(0) as u64)
        .sum()
}

impl Anatomy {
    /// The plan's state by role and its step's memory as `model` lays it out.
    pub fn of_plan(plan: &TrainingPlan, model: &dyn MemoryModel) -> Anatomy {
        Anatomy::with_memory(plan, model.step(plan, &plan.micro_step))
    }

    /// The plan's state by role beside step memory already laid out (`memory`).
    pub fn with_memory(plan: &TrainingPlan, memory: StepMemory) -> Anatomy {
        Anatomy {
            params: crate::cost::param_count(plan),
            low_precision_weights: plan.state_bytes(StateRole::WorkingCopy),
            fp8_copies: fp8_copy_bytes(plan, StateRole::WorkingCopy),
            fp8_frozen: fp8_copy_bytes(plan, StateRole::Frozen),
            master_weights: plan.state_bytes(StateRole::Master),
            frozen_weights: plan.state_bytes(StateRole::Frozen),
            gradients: plan.state_bytes(StateRole::Gradient),
            optimizer_state: plan.state_bytes(StateRole::OptimizerState),
            control: plan.state_bytes(StateRole::Control),
            fp8_scaling: plan.state_bytes(StateRole::Fp8Scaling),
            saved_activations: saved_activations(&plan.micro_step, plan.forward_nodes)
                .iter()
                .map(|(_, b)| b)
                .sum(),
            memory,
        }
    }

    pub fn persistent(&self) -> u64 {
        self.low_precision_weights
            + self.master_weights
            + self.frozen_weights
            + self.gradients
            + self.optimizer_state
            + self.control
            + self.fp8_scaling
    }

    /// Persistent state + the step's memory: the step's planned peak, what the executor
    /// allocates.
    pub fn total(&self) -> u64 {
        self.persistent() + self.memory.total()
    }
}
