//! What to keep and what to recompute, as a minimum cut over the forward/backward graph (the
//! partitioner of PyTorch's AOTAutograd, with recomputation priced in).
//!
//! Every computed forward node `v` becomes two vertices, `v.in` and `v.out`. A cut separates
//! what the forward part provides (the source side) from what the backward part needs (the sink
//! side):
//!
//! - `v.in -> v.out`, capacity `λ · bytes(v)`: cut when `v` is *saved* (computed in the
//!   forward part, read in the backward part), so the cut pays for the bytes kept;
//! - `source -> v.in`, capacity `seconds(v)` (the cost model's roofline time): cut when `v.in`
//!   lies on the sink side, i.e. `v` is *recomputed* in the backward part, so the cut pays for
//!   the time;
//! - `u.out -> v.in`, infinite, for every operand `u` of `v`: a recomputed `v` needs each
//!   computed operand either saved or recomputed too;
//! - `v.out -> sink`, infinite, when a backward node reads `v`.
//!
//! Sources (batch inputs, parameters, state) and parameter copies are persistent or live
//! throughout: always available, so free. Nodes outside the blocks and a block's outputs (the
//! values read after it) are never recomputed (`source -> v.in` infinite): recomputation stays
//! inside a block, whose backward part then holds only that block's recomputed values, as in
//! `full` recomputation.
//!
//! A minimum cut minimizes `λ · saved bytes + recompute seconds`; `λ`, the price of a byte,
//! sweeps a fixed range around the device's time per byte (`1 / memory bandwidth`), from "keep
//! everything" to "recompute all that may be", bisected between prices whose cuts differ. The
//! blocks of a model are alike, so their cuts change together; between two successive cuts the
//! candidates also take the dearer cut in the last `m` blocks only (the backward part reaches
//! them first), for up to [`MIXES`] evenly spaced `m`. The budget search rewrites each candidate, plans its real schedule's peak (a
//! proxy such as saved bytes is not the peak, which is not even monotonic in `λ`) and keeps the
//! cheapest that fits. The candidates do not depend on the budget.
//!
//! The maximum flow is petgraph's Dinic; capacities are integers (picoseconds and
//! picoseconds-per-byte times bytes), so residuals are exact.

use super::Forward;
use crate::cost::{node_cost, GpuSpec};
use castor_ir::{Graph, Node, Op};
use petgraph::algo::dinics;
use petgraph::graph::{DiGraph, EdgeIndex, NodeIndex};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::HashSet;

/// Units per second of the integer capacities.
const PICO: f64 = 1e12;
/// Capacity of the edges no cut may cross. Every path to the sink ends with a finite save
/// edge (a `v.out` is entered only from its `v.in`), so no flow comes near it.
const INFINITE: u64 = u64::MAX / 4;
/// Prices of a byte, as powers of two times the device's time per byte: the grid's ends, and
/// how many times an interval between two different cuts is halved.
const PRICE_RANGE: (i32, i32) = (-4, 12);
const BISECTIONS: usize = 4;
/// Block-wise mixes between two successive cuts: at most this many, evenly spaced.
const MIXES: usize = 11;

/// The cut network of a micro step's forward part.
pub(super) struct CutNetwork {
    graph: DiGraph<(), u64>,
    source: NodeIndex,
    sink: NodeIndex,
    /// `(forward node, v.in, the v.in -> v.out edge, bytes)` of every computed forward node.
    nodes: Vec<(usize, NodeIndex, EdgeIndex, f64)>,
    forward_nodes: usize,
}

/// A cut's recompute set: `r[i]` for forward node `i`.
pub(super) type RecomputeSet = Vec<bool>;

impl CutNetwork {
    /// The network of the forward part of `g` with recompute times on `gpu`; save
    /// capacities are set by [`CutNetwork::cut`].
    pub(super) fn new(g: &Graph, f: &Forward, gpu: &GpuSpec) -> CutNetwork {
        let n = f.n;
        let mut graph = DiGraph::<(), u64>::new();
        let source = graph.add_node(());
        let sink = graph.add_node(());
        // (v.in, v.out) of each computed forward node.
        let mut ends: Vec<Option<(NodeIndex, NodeIndex)>> = vec![None; n];
        let mut nodes = Vec::new();
        let mut read_later = vec![false; n];
        for (_, d) in g.nodes().skip(n) {
            for &v in &d.inputs {
                let p = g.value(v).producer.index();
                if p < n {
                    read_later[p] = true;
                }
            }
        }
        for (node, d) in g.nodes().take(n) {
            if d.op.is_source() || matches!(d.op, Op::ParamCopy { .. }) {
                continue;
            }
            let i = node.index();
            let (vin, vout) = (graph.add_node(()), graph.add_node(()));
            ends[i] = Some((vin, vout));
            // At least one unit, so a free node (a view) is recomputed only when that saves.
            let recompute = if f.eligible[i] {
                let secs = node_cost(g, Node(i as u32), gpu).seconds;
                ((secs * PICO).round() as u64).max(1)
            } else {
                INFINITE
            };
            graph.add_edge(source, vin, recompute);
            let save = graph.add_edge(vin, vout, 0);
            let bytes: f64 = d
                .outputs
                .iter()
                .map(|&v| g.ty(v).size_bytes().unwrap_or(0) as f64)
                .sum();
            nodes.push((i, vin, save, bytes));
            for &u in &d.inputs {
                if let Some((_, uout)) = ends[g.value(u).producer.index()] {
                    graph.add_edge(uout, vin, INFINITE);
                }
            }
            if read_later[i] {
                graph.add_edge(vout, sink, INFINITE);
            }
        }
        CutNetwork {
            graph,
            source,
            sink,
            nodes,
            forward_nodes: n,
        }
    }

    /// The forward nodes a minimum cut recomputes when a saved byte costs `price` seconds:
    /// `r[i]` for forward node `i`.
    pub(super) fn cut(&mut self, price: f64) -> RecomputeSet {
        for &(_, _, save, bytes) in &self.nodes {
            let cap = (price * bytes * PICO)
                .round()
                .clamp(0.0, (INFINITE / 1024) as f64);
            self.graph[save] = cap as u64;
        }
        let (_, flows) = dinics(&self.graph, self.source, self.sink);
        // The source side: what the residual network reaches from the source.
        let mut reached = vec![false; self.graph.node_count()];
        let mut stack = vec![self.source];
        reached[self.source.index()] = true;
        while let Some(x) = stack.pop() {
            let forward = self
                .graph
                .edges_directed(x, Direction::Outgoing)
                .filter(|e| flows[e.id().index()] < *e.weight())
                .map(|e| e.target());
            let backward = self
                .graph
                .edges_directed(x, Direction::Incoming)
                .filter(|e| flows[e.id().index()] > 0)
                .map(|e| e.source());
            for y in forward.chain(backward).collect::<Vec<_>>() {
                if !reached[y.index()] {
                    reached[y.index()] = true;
                    stack.push(y);
                }
            }
        }
        let mut recompute = vec![false; self.forward_nodes];
        for &(i, vin, _, _) in &self.nodes {
            recompute[i] = !reached[vin.index()];
        }
        recompute
    }
}

/// The budget search's candidates: the distinct minimum cuts over the range of byte prices,
/// in ascending price, and between each two successive cuts their block-wise mixes; the empty
/// set left out.
pub(super) fn candidates(g: &Graph, f: &Forward, gpu: &GpuSpec) -> Vec<RecomputeSet> {
    let cuts = cuts(g, f, gpu);
    let mut blocks: Vec<u32> = f.block.iter().flatten().copied().collect();
    blocks.sort_unstable();
    blocks.dedup();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut add = |r: RecomputeSet, out: &mut Vec<RecomputeSet>| {
        if r.iter().any(|&x| x) && seen.insert(r.clone()) {
            out.push(r);
        }
    };
    for pair in cuts.windows(2) {
        let (cheap, dear) = (&pair[0], &pair[1]);
        // The dearer cut in the last `m` blocks, the cheaper one elsewhere.
        let steps = MIXES.min(blocks.len().saturating_sub(1));
        for k in 1..=steps {
            let m = k * blocks.len() / (steps + 1);
            let from = blocks[blocks.len() - m];
            let mix = (0..f.n)
                .map(|i| match f.block[i] {
                    Some(b) if b >= from => dear[i],
                    _ => cheap[i],
                })
                .collect();
            add(mix, &mut out);
        }
        add(dear.clone(), &mut out);
    }
    out
}

/// The distinct minimum cuts, in ascending price: a grid of powers of two, each interval
/// between two different cuts halved [`BISECTIONS`] times.
fn cuts(g: &Graph, f: &Forward, gpu: &GpuSpec) -> Vec<RecomputeSet> {
    let mut net = CutNetwork::new(g, f, gpu);
    let base = 1.0 / gpu.memory_bandwidth;
    let mut at = |log2: f64| net.cut(base * log2.exp2());
    let mut found: Vec<(f64, RecomputeSet)> = Vec::new();
    for step in PRICE_RANGE.0..=PRICE_RANGE.1 {
        let x = f64::from(step);
        found.push((x, at(x)));
    }
    for _ in 0..BISECTIONS {
        let mut next = Vec::with_capacity(found.len() * 2);
        for i in 0..found.len() {
            if let Some((x1, r1)) = found.get(i + 1) {
                let (x0, r0) = &found[i];
                next.push((*x0, r0.clone()));
                if r0 != r1 {
                    let mid = (x0 + x1) / 2.0;
                    next.push((mid, at(mid)));
                }
            } else {
                next.push(found[i].clone());
            }
        }
        found = next;
    }
    let mut out: Vec<RecomputeSet> = Vec::new();
    for (_, r) in found {
        if out.last() != Some(&r) {
            out.push(r);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x -> a (cheap, big) -> b (costly, small) -> c`, all read by the backward part.
    fn chain() -> Graph {
        castor_ir::text::parse(
            "graph g {
               %x: f32[256,256] = input
               %w: f32[256,256] = param
               %a: f32[256,256] = tanh(%x) {block=0}
               %b: f32[256,16] = slice(%a) {axis=1, start=0, end=16, block=0}
               %c: f32[256,256] = matmul(%a, %w) {transpose_a=false, transpose_b=false, block=0}
               %db: f32[256,16] = neg(%b)
               %dc: f32[256,256] = neg(%c)
               %da: f32[256,256] = neg(%a)
               return %db, %dc, %da
             }",
        )
        .unwrap()
    }

    #[test]
    fn free_bytes_keep_everything_and_dear_bytes_recompute_the_cheap() {
        let g = chain();
        let gpu = GpuSpec::default();
        let f = super::super::analyse(&g, 5);
        let mut net = CutNetwork::new(&g, &f, &gpu);
        // Saving costs nothing: nothing is recomputed.
        assert!(net.cut(0.0).iter().all(|&r| !r));
        // Bytes dearer than any recomputation: every computed node is recomputed from the
        // sources (x and w), which cost nothing to keep.
        assert_eq!(net.cut(1.0), [false, false, true, true, true]);
        // In between, the cut recomputes `a` (a tanh: cheap) and the slice of it, but keeps
        // `c` (a product, costlier than its bytes).
        let base = 1.0 / gpu.memory_bandwidth;
        let mid = net.cut(4.0 * base);
        assert_eq!(mid, [false, false, true, true, false]);
        let all = candidates(&g, &f, &gpu);
        assert!(all.contains(&mid) && all.len() >= 2, "{all:?}");
    }

    /// The cut is a minimum: on a small network every recompute set that leaves the backward
    /// part able to run (each recomputed node's computed operands saved or recomputed) costs
    /// at least the cut's `λ · saved bytes + recompute seconds`.
    #[test]
    fn the_cut_is_the_cheapest_closed_set() {
        let g = chain();
        let gpu = GpuSpec::default();
        let n = 5;
        let cost = |r: &[bool], price: f64| -> f64 {
            let mut total = 0.0;
            let mut needed = vec![false; n];
            for (node, d) in g.nodes() {
                for &v in &d.inputs {
                    let p = g.value(v).producer.index();
                    if p < n && (node.index() >= n || r[node.index()]) {
                        needed[p] = true;
                    }
                }
            }
            for (node, d) in g.nodes().take(n) {
                let i = node.index();
                if d.op.is_source() {
                    continue;
                }
                let secs = ((node_cost(&g, node, &gpu).seconds * PICO).round()).max(1.0);
                if r[i] {
                    total += secs;
                } else if needed[i] {
                    let bytes: f64 = d
                        .outputs
                        .iter()
                        .map(|&v| g.ty(v).size_bytes().unwrap() as f64)
                        .sum();
                    total += (price * bytes * PICO).round();
                }
            }
            total
        };
        let f = super::super::analyse(&g, n);
        let mut net = CutNetwork::new(&g, &f, &gpu);
        for step in -8..=8 {
            let price = 2f64.powi(step) / gpu.memory_bandwidth;
            let cut = net.cut(price);
            for mask in 0u32..8 {
                let r = [false, false, mask & 1 != 0, mask & 2 != 0, mask & 4 != 0];
                // Closed: a recomputed slice needs `a` saved or recomputed; always true here,
                // since a saved `a` is allowed. Every set is feasible.
                assert!(
                    cost(&cut, price) <= cost(&r, price),
                    "price {price}: cut {cut:?} costs more than {r:?}"
                );
            }
        }
    }
}
