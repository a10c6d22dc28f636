//! The budget search's former candidates, kept as the baseline the minimum cut is measured
//! against (`tests/remat.rs`, BENCHMARKS.md): a fixed sequence of ever larger recompute sets.
//! Eligible nodes are grouped by their name across blocks ([`super::group_name`]); groups are
//! ranked cheap pointwise and layout ops first by recompute time per byte, contractions last,
//! and each group is added a few blocks at a time, last blocks first.

use super::{group_name, Forward};
use crate::cost::{node_cost, GpuSpec};
use castor_ir::{Graph, Node, OpClass};
use std::collections::BTreeMap;

/// Blocks per step of the budget sequence: each group is added in up to this many chunks.
const CHUNKS: usize = 4;

/// The budget search's candidate sequence: ever larger recompute sets.
pub(super) fn budget_sequence(g: &Graph, f: &Forward, gpu: &GpuSpec) -> Vec<Vec<bool>> {
    // Groups of eligible nodes by name pattern, with cost per byte.
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (node, d) in g.nodes().take(f.n) {
        if let (true, Some(&v)) = (f.eligible[node.index()], d.outputs.first()) {
            groups
                .entry(group_name(g, v))
                .or_default()
                .push(node.index());
        }
    }
    let mut ranked: Vec<(bool, f64, String, Vec<usize>)> = groups
        .into_iter()
        .map(|(name, nodes)| {
            let mut secs = 0.0;
            let mut bytes = 0.0;
            let mut contraction = false;
            for &i in &nodes {
                let node = Node(i as u32);
                secs += node_cost(g, node, gpu).seconds;
                bytes += g
                    .node(node)
                    .outputs
                    .iter()
                    .map(|&v| g.ty(v).size_bytes().unwrap_or(0) as f64)
                    .sum::<f64>();
                contraction |= g.node(node).op.class() == OpClass::Contraction;
            }
            (contraction, secs / bytes.max(1.0), name, nodes)
        })
        .collect();
    ranked.sort_by(|a, b| {
        a.0.cmp(&b.0)
            .then(a.1.total_cmp(&b.1))
            .then_with(|| a.2.cmp(&b.2))
    });
    let mut seq = Vec::new();
    let mut cur = vec![false; f.n];
    for (_, _, _, mut nodes) in ranked {
        nodes.sort_by_key(|&i| std::cmp::Reverse(f.block[i]));
        let chunk = nodes.len().div_ceil(CHUNKS).max(1);
        for part in nodes.chunks(chunk) {
            for &i in part {
                cur[i] = true;
            }
            seq.push(cur.clone());
        }
    }
    seq
}
