//! Fusion: decides what runs as one kernel, and records it as [`KernelUnit`]s.
//!
//! One pass makes every fusion decision of a graph:
//! - pointwise groups ([`fusion_groups`]) and every pointwise node in no group, each one
//!   generated kernel with a typed body ([`pointwise_body`]);
//! - a residual add in front of a normalization (with the cast that widens a 16-bit
//!   projection's result into an F32 residual stream, where the add reads one), and the add
//!   of another gradient behind a normalization's backward, absorbed by the norm kernels
//!   (taken out of their groups);
//! - the FP8 cast of a normalization's output (delayed scaling's `quantize`) or its scale
//!   (current scaling's `fp8_scale`), ending the norm's unit: the norm kernel writes the FP8
//!   values (or the output) and the amax, and does not store an output only the cast reads;
//! - a cast to FP8 whose scale is known before the unit runs (delayed scaling's), ending the
//!   pointwise unit that makes its operand ([`quantize_tail_ok`]): the kernel stores the FP8
//!   values and the amax; under current scaling the scale instead ([`scale_tail_ok`]): the
//!   kernel stores the value and its amax, and a one-block kernel makes the scale;
//! - AdamW/SGD/Lion updates sharing their scalars, one multi-tensor launch per batch, with
//!   the `fp8_scale`s of the masters they update (the launch takes the masters' maxima);
//! - delayed scaling's `amax_history` updates, one launch for all of a graph's.
//!
//! A training plan stores the units of both its graphs; executors read them back through
//! [`schedule`], which checks that each unit is one this pass could have made (so a plan file
//! cannot make a kernel compute something its graph does not say) and places each unit where
//! its last member stands. Device code is printed from the units by the CUDA side; nothing
//! here knows a device.

mod absorb;
mod body;
mod groups;

pub use body::pointwise_body;
pub use groups::{
    fp8_tail_ok, fused_order, fusion_groups, group_inputs, group_outputs, is_fp8_tail,
    is_pointwise, quantize_tail_ok, scale_tail_ok,
};

use castor_ir::{Graph, KernelUnit, Node, UnitKind};

/// The kernel units of graph `g` (named `graph` in the plan), in the order they run.
///
/// Names: `fused_<k>` for the `k`-th pointwise group, `pw_<n>` for pointwise node `n` alone,
/// `norm_<n>` for the unit around norm (or norm gradient) node `n`, `update_<n>` for the
/// optimizer batch whose last member is node `n`, `histories_<n>` for the batch of
/// `amax_history` updates whose last member is node `n`.
pub fn kernel_units(g: &Graph, graph: &str) -> Vec<KernelUnit> {
    let users = g.users();
    let mut groups = fusion_groups(g);
    let norms = absorb::norm_units(g, &users, &mut groups);
    fp8_tails(g, &users, &mut groups, &norms);
    let batches = absorb::optimizer_batches(g, &users);
    let histories = absorb::history_batch(g, &users);
    let mut claimed = vec![false; g.num_nodes()];
    let mut units: Vec<(Vec<Node>, String, Option<UnitKind>)> = Vec::new();
    for (k, members) in groups.into_iter().enumerate() {
        if !members.is_empty() {
            units.push((members, format!("fused_{k}"), None));
        }
    }
    for (members, kind) in norms {
        let at = absorb::norm_member(g, &members);
        units.push((members, format!("norm_{}", at.index()), Some(kind)));
    }
    for members in batches {
        let at = members.last().map_or(0, |m| m.index());
        units.push((
            members,
            format!("update_{at}"),
            Some(UnitKind::OptimizerBatch),
        ));
    }
    if let Some(members) = histories {
        let at = members.last().map_or(0, |m| m.index());
        units.push((
            members,
            format!("histories_{at}"),
            Some(UnitKind::AmaxHistoryBatch),
        ));
    }
    for (members, _, _) in &units {
        for m in members {
            claimed[m.index()] = true;
        }
    }
    for (n, _) in g.nodes() {
        if !claimed[n.index()] && is_pointwise(g, n) {
            units.push((vec![n], format!("pw_{}", n.index()), None));
        }
    }
    units.sort_by_key(|(members, _, _)| members.last().copied());
    units
        .into_iter()
        .map(|(members, name, kind)| {
            let kind =
                kind.unwrap_or_else(|| UnitKind::Pointwise(pointwise_body(g, &users, &members)));
            KernelUnit {
                graph: graph.to_string(),
                name,
                members: members
                    .iter()
                    .map(|&m| g.name(g.node(m).outputs[0]).to_string())
                    .collect(),
                kind,
            }
        })
        .collect()
}

/// Each `quantize` or `fp8_scale` that can end the pointwise unit making its operand joins it
/// (a lone pointwise node not in a norm unit becomes a unit of two with it), so the kernel
/// writes the FP8 values and their amax (or the value's scale) instead of storing the value
/// for a separate kernel to read back.
fn fp8_tails(
    g: &Graph,
    users: &[Vec<Node>],
    groups: &mut Vec<Vec<Node>>,
    norms: &[(Vec<Node>, UnitKind)],
) {
    let in_norm: std::collections::HashSet<Node> =
        norms.iter().flat_map(|(m, _)| m.iter().copied()).collect();
    for (t, node) in g.nodes() {
        if !is_fp8_tail(g, t) {
            continue;
        }
        let producer = g.value(node.inputs[0]).producer;
        match groups.iter().position(|m| m.contains(&producer)) {
            Some(gi) if fp8_tail_ok(g, users, &groups[gi], t) => groups[gi].push(t),
            Some(_) => {}
            None if is_pointwise(g, producer)
                && !in_norm.contains(&producer)
                && fp8_tail_ok(g, users, &[producer], t) =>
            {
                groups.push(vec![producer, t]);
            }
            None => {}
        }
    }
}

/// A unit that cannot run as its graph says.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("kernel unit `{unit}`: {message}")]
pub struct UnitError {
    pub unit: String,
    pub message: String,
}

/// A graph's kernel units resolved to its nodes, and the order in which everything runs.
pub struct UnitSchedule {
    pub units: Vec<KernelUnit>,
    /// Each unit's member nodes, in node order.
    pub members: Vec<Vec<Node>>,
    /// The unit of each node, if any.
    pub unit_of: Vec<Option<usize>>,
    /// Each node's place in the run, from 1 (sources: 0): a unit takes the place of its last
    /// member, every other non-source node one of its own.
    pub step_of: Vec<usize>,
    /// Places plus one (place 0 holds the sources).
    pub steps: usize,
}

/// Resolves `units` against `g` and checks each is one [`kernel_units`] could make: members
/// in node order, in one unit at most; a pointwise unit's members pointwise over one shape,
/// runnable at its last member, with exactly the body they make; a norm unit and an optimizer
/// batch as their rules allow.
pub fn schedule(g: &Graph, units: Vec<KernelUnit>) -> Result<UnitSchedule, UnitError> {
    let users = g.users();
    let mut unit_of: Vec<Option<usize>> = vec![None; g.num_nodes()];
    let mut all_members = Vec::with_capacity(units.len());
    for (ui, unit) in units.iter().enumerate() {
        let bad = |message: String| UnitError {
            unit: unit.name.clone(),
            message,
        };
        let mut members = Vec::with_capacity(unit.members.len());
        for name in &unit.members {
            let v = g
                .lookup(name)
                .ok_or_else(|| bad(format!("no value `%{name}` in graph `{}`", g.name)))?;
            let n = g.value(v).producer;
            if g.node(n).op.is_source() {
                return Err(bad(format!("`%{name}` is a source, which runs no kernel")));
            }
            if unit_of[n.index()].replace(ui).is_some() {
                return Err(bad(format!("`%{name}` is a member of two units")));
            }
            members.push(n);
        }
        if members.is_empty() || members.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad("members must be listed once each, in node order".into()));
        }
        let ok = match &unit.kind {
            UnitKind::Pointwise(body) => {
                // A cast to FP8, or the scale of one, may end the unit.
                let last = members[members.len() - 1];
                let tail = is_fp8_tail(g, last);
                let pointwise = if tail {
                    &members[..members.len() - 1]
                } else {
                    &members[..]
                };
                let Some(&space) = pointwise.last() else {
                    return Err(bad("a unit of a cast alone".into()));
                };
                let shape = &g.ty(g.node(space).outputs[0]).shape;
                let same = !pointwise.is_empty()
                    && pointwise
                        .iter()
                        .all(|&m| is_pointwise(g, m) && &g.ty(g.node(m).outputs[0]).shape == shape);
                if !same {
                    return Err(bad("members are not pointwise nodes of one shape".into()));
                }
                if tail && !fp8_tail_ok(g, &users, pointwise, last) {
                    return Err(bad(
                        "its last member does not cast a member's value to FP8 by a scale made \
                         before the unit, or take its scale"
                            .into(),
                    ));
                }
                if !groups::runs_at_last_member(g, &users, &members) {
                    return Err(bad(
                        "a member's value is read before the unit's last member".into(),
                    ));
                }
                if *body != pointwise_body(g, &users, &members) {
                    return Err(bad("its body is not what its members compute".into()));
                }
                true
            }
            UnitKind::NormPrologue => absorb::prologue_members_ok(g, &users, &members),
            UnitKind::NormFp8 => absorb::norm_fp8_ok(g, &users, &members),
            UnitKind::NormEpilogue => {
                (2..=3).contains(&members.len())
                    && absorb::epilogue_ok(
                        g,
                        &users,
                        members[0],
                        members[1],
                        members.get(2).copied(),
                    )
            }
            UnitKind::OptimizerBatch => absorb::batch_ok(g, &users, &members),
            UnitKind::AmaxHistoryBatch => absorb::history_batch_ok(g, &users, &members),
        };
        if !ok {
            return Err(bad(format!(
                "its members cannot run as one {} unit",
                unit.kind.name()
            )));
        }
        all_members.push(members);
    }
    let mut step_of = vec![0usize; g.num_nodes()];
    let mut steps = 1usize;
    for (n, node) in g.nodes() {
        if node.op.is_source() {
            continue;
        }
        match unit_of[n.index()] {
            Some(ui) if all_members[ui].last() != Some(&n) => {}
            Some(ui) => {
                for &m in &all_members[ui] {
                    step_of[m.index()] = steps;
                }
                steps += 1;
            }
            None => {
                step_of[n.index()] = steps;
                steps += 1;
            }
        }
    }
    Ok(UnitSchedule {
        units,
        members: all_members,
        unit_of,
        step_of,
        steps,
    })
}

/// The units of a graph that comes without them (a forward or test graph): the pass's own.
pub fn schedule_of(g: &Graph) -> Result<UnitSchedule, UnitError> {
    schedule(g, kernel_units(g, &g.name))
}

/// Counts for reports: pointwise nodes that share a kernel with another, and those kernels.
pub fn fused_counts(units: &[KernelUnit]) -> (usize, usize) {
    units
        .iter()
        .filter(|u| matches!(u.kind, UnitKind::Pointwise(_)) && u.members.len() > 1)
        .fold((0, 0), |(n, k), u| (n + u.members.len(), k + 1))
}
