//! Pointwise groups: chains of pointwise nodes over one iteration space that run as one
//! kernel.
//!
//! A group is a set of pointwise nodes (`unary`, `unary_grad`, `binary`, `scale`, float
//! `cast`) over one iteration space (every member has the same output shape; operands from
//! outside may broadcast, as a bias does). A node joins the group of a pointwise producer it
//! reads. The group runs where its last member stood, so a node may join only if every value
//! the group's members make that is read outside the group is read after that point. Its
//! results are those values (a training step's forward keeps pre-activations for the backward,
//! so a bias add + GELU group writes both).

use castor_ir::{Graph, Node, Op, Value};
use std::collections::HashMap;

/// The pointwise groups of `g` (two members or more), each in node order.
pub fn fusion_groups(g: &Graph) -> Vec<Vec<Node>> {
    let users = g.users();
    let mut group_of: Vec<Option<usize>> = vec![None; g.num_nodes()];
    let mut groups: Vec<Vec<Node>> = Vec::new();
    for (n, node) in g.nodes() {
        if !is_pointwise(g, n) {
            continue;
        }
        let shape = &g.ty(node.outputs[0]).shape;
        let mut candidate: Vec<usize> = Vec::new();
        for &v in &node.inputs {
            let p = g.value(v).producer;
            if let Some(gi) = group_of[p.index()] {
                if &g.ty(v).shape == shape && !candidate.contains(&gi) {
                    candidate.push(gi);
                }
            }
        }
        // Join each candidate group that can still run at `n` with the others joined so far.
        let mut members: Vec<Node> = vec![n];
        let mut joined: Vec<usize> = Vec::new();
        for gi in candidate {
            let mut trial = members.clone();
            trial.extend(groups[gi].iter().copied());
            if runs_at_last_member(g, &users, &trial) {
                members = trial;
                joined.push(gi);
            }
        }
        let target = match joined.first() {
            None => {
                groups.push(Vec::new());
                groups.len() - 1
            }
            Some(&first) => {
                for &other in &joined[1..] {
                    for m in std::mem::take(&mut groups[other]) {
                        group_of[m.index()] = Some(first);
                        groups[first].push(m);
                    }
                }
                first
            }
        };
        groups[target].push(n);
        group_of[n.index()] = Some(target);
    }
    let mut out: Vec<Vec<Node>> = groups.into_iter().filter(|m| m.len() >= 2).collect();
    for m in &mut out {
        m.sort();
    }
    out.sort_by_key(|m| m.last().copied());
    out
}

/// True if every value the members make that is read outside them is read after the last
/// member (so the group can run there).
pub(super) fn runs_at_last_member(g: &Graph, users: &[Vec<Node>], members: &[Node]) -> bool {
    let Some(&last) = members.iter().max() else {
        return true;
    };
    members.iter().all(|&m| {
        users[g.node(m).outputs[0].index()]
            .iter()
            .all(|u| members.contains(u) || *u > last)
    })
}

/// `quantize` node `q` can end the pointwise unit `members` (a cast to FP8 that the kernel
/// writes instead of, or beside, the value it casts): it casts a member's value, of the unit's
/// iteration shape, by a scalar scale made before the unit runs (delayed scaling's, from the
/// amax history: a current scale is the amax of the value itself, which only exists once the
/// whole value does), and the unit with `q` can run where `q` stands.
pub fn quantize_tail_ok(g: &Graph, users: &[Vec<Node>], members: &[Node], q: Node) -> bool {
    let node = g.node(q);
    let Op::Quantize { .. } = node.op else {
        return false;
    };
    let scale = node.inputs[1];
    ends_unit(g, users, members, q)
        && g.ty(scale).shape.numel() == Some(1)
        && !members.contains(&g.value(scale).producer)
}

/// `fp8_scale` node `s` can end the pointwise unit `members` (current scaling: the kernel that
/// makes the value also takes its amax, and a one-block kernel turns it into the scale, so the
/// cast's own kernel is the only other read of the value): it reads a member's value, of the
/// unit's iteration shape, and the unit with `s` can run where `s` stands.
pub fn scale_tail_ok(g: &Graph, users: &[Vec<Node>], members: &[Node], s: Node) -> bool {
    matches!(g.node(s).op, Op::Fp8Scale { .. }) && ends_unit(g, users, members, s)
}

/// What every tail of a pointwise unit needs: `tail` comes after the pointwise `members`, its
/// first operand is a float member value of the unit's iteration shape, and the unit with
/// `tail` can run where `tail` stands.
fn ends_unit(g: &Graph, users: &[Vec<Node>], members: &[Node], tail: Node) -> bool {
    let Some(&last) = members.last() else {
        return false;
    };
    let x = g.node(tail).inputs[0];
    let space = &g.ty(g.node(last).outputs[0]).shape;
    let mut all = members.to_vec();
    all.push(tail);
    tail > last
        && members.iter().all(|&m| is_pointwise(g, m))
        && members.contains(&g.value(x).producer)
        && g.ty(x).dtype.is_float()
        && &g.ty(x).shape == space
        && runs_at_last_member(g, users, &all)
}

/// Whether `n` may end a pointwise unit (a cast to FP8, or the scale of one).
pub fn is_fp8_tail(g: &Graph, n: Node) -> bool {
    matches!(g.node(n).op, Op::Quantize { .. } | Op::Fp8Scale { .. })
}

/// Whether `tail` can end the pointwise unit `members` (see [`quantize_tail_ok`] and
/// [`scale_tail_ok`]).
pub fn fp8_tail_ok(g: &Graph, users: &[Vec<Node>], members: &[Node], tail: Node) -> bool {
    quantize_tail_ok(g, users, members, tail) || scale_tail_ok(g, users, members, tail)
}

/// The members' values read outside the group or returned by the graph: the group's results.
pub fn group_outputs(g: &Graph, users: &[Vec<Node>], members: &[Node]) -> Vec<Value> {
    members
        .iter()
        // A scale is the unit's amax, not one of its per-element results.
        .filter(|&&m| !matches!(g.node(m).op, Op::Fp8Scale { .. }))
        .map(|&m| g.node(m).outputs[0])
        .filter(|v| {
            g.outputs().contains(v) || users[v.index()].iter().any(|u| !members.contains(u))
        })
        .collect()
}

/// The nodes a pointwise kernel computes: one float result from float operands.
pub fn is_pointwise(g: &Graph, n: Node) -> bool {
    let node = g.node(n);
    let float_in = node.inputs.iter().all(|&v| g.ty(v).dtype.is_float());
    let float_out = node.outputs.len() == 1 && g.ty(node.outputs[0]).dtype.is_float();
    let op = matches!(
        node.op,
        Op::Unary(_) | Op::UnaryGrad(_) | Op::Binary(_) | Op::Scale { .. } | Op::Cast { .. }
    );
    op && float_in && float_out
}

/// The values a group reads from outside, in order of first use.
pub fn group_inputs(g: &Graph, members: &[Node]) -> Vec<Value> {
    let inside: std::collections::HashSet<Value> =
        members.iter().map(|&m| g.node(m).outputs[0]).collect();
    let mut inputs = Vec::new();
    for &m in members {
        for &v in &g.node(m).inputs {
            if !inside.contains(&v) && !inputs.contains(&v) {
                inputs.push(v);
            }
        }
    }
    inputs
}

/// `g` with every group's members moved to run back to back where the group's last member
/// stood: the order in which a fused plan executes. Running it gives the fused plan's results
/// (each member rounded where the graph stores it), so comparing it with `g` checks that the
/// groups are legal.
pub fn fused_order(g: &Graph, groups: &[Vec<Node>]) -> Result<Graph, castor_ir::IrError> {
    let mut last_of: HashMap<Node, usize> = HashMap::new();
    let mut member = vec![false; g.num_nodes()];
    for (gi, m) in groups.iter().enumerate() {
        if let Some(&last) = m.last() {
            last_of.insert(last, gi);
        }
        for &n in m {
            member[n.index()] = true;
        }
    }
    let mut order = Vec::with_capacity(g.num_nodes());
    for (n, _) in g.nodes() {
        if let Some(&gi) = last_of.get(&n) {
            order.extend(groups[gi].iter().copied());
        } else if !member[n.index()] {
            order.push(n);
        }
    }
    let mut out = Graph::empty_like(g);
    let mut map: HashMap<Value, Value> = HashMap::new();
    for n in order {
        let node = g.node(n);
        let inputs = node
            .inputs
            .iter()
            .map(|v| {
                map.get(v)
                    .copied()
                    .ok_or_else(|| castor_ir::IrError::Invalid {
                        site: castor_ir::Site {
                            node: g.name(node.outputs[0]).to_string(),
                            location: None,
                        },
                        message: format!("reads `%{}` before a fused group makes it", g.name(*v)),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let outputs = node
            .outputs
            .iter()
            .map(|&v| (g.name(v).to_string(), g.ty(v).clone()))
            .collect();
        let new = out.push_copy(g, n, inputs, outputs)?;
        for (&old, &v) in node.outputs.iter().zip(&out.node(new).outputs.clone()) {
            map.insert(old, v);
        }
    }
    out.set_outputs(
        g.outputs()
            .iter()
            .map(|v| map.get(v).copied().unwrap_or(*v))
            .collect(),
    );
    Ok(out)
}
