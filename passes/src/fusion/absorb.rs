//! Units beside the pointwise groups: normalizations that absorb a residual add or end with
//! their output's FP8 cast, and batches of optimizer updates. Each rule is one predicate, used
//! both to decide the units and to check the units a plan file brings.

use castor_ir::{BinaryOp, DType, Graph, Node, NodeData, Op, UnitKind, Value};
use std::collections::HashSet;

fn is_norm(op: &Op) -> bool {
    matches!(op, Op::LayerNorm { .. } | Op::RmsNorm { .. })
}

fn is_norm_grad(op: &Op) -> bool {
    matches!(op, Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. })
}

fn is_add(op: &Op) -> bool {
    matches!(op, Op::Binary(BinaryOp::Add))
}

/// The norm (or norm gradient) node of a norm unit's `members`, which names the unit.
pub(super) fn norm_member(g: &Graph, members: &[Node]) -> Node {
    members
        .iter()
        .copied()
        .find(|&m| is_norm(&g.node(m).op) || is_norm_grad(&g.node(m).op))
        .unwrap_or(members[0])
}

/// `members` are a norm prologue: `[add, norm]` ([`prologue_ok`]), or `[cast, add, norm]`
/// where the cast also joins ([`prologue_cast_ok`]).
pub(super) fn prologue_members_ok(g: &Graph, users: &[Vec<Node>], members: &[Node]) -> bool {
    match *members {
        [add, norm] => prologue_ok(g, users, add, norm),
        [cast, add, norm] => {
            prologue_ok(g, users, add, norm) && prologue_cast_ok(g, users, cast, add, norm)
        }
        _ => false,
    }
}

/// `[add, norm]` can be a norm prologue: `add` sums two operands of the norm input's dtype
/// and shape into the norm's input, and nothing reads the sum before the norm. The norm
/// kernel rounds the sum to the input dtype exactly where the separate add stores it.
pub(super) fn prologue_ok(g: &Graph, users: &[Vec<Node>], add: Node, norm: Node) -> bool {
    let nn = g.node(norm);
    let an = g.node(add);
    if !is_norm(&nn.op) || !is_add(&an.op) || an.inputs.len() != 2 {
        return false;
    }
    let x = nn.inputs[0];
    an.outputs.first() == Some(&x)
        && g.ty(x).dtype.is_float()
        && an.inputs.iter().all(|&v| g.ty(v) == g.ty(x))
        && users[x.index()].iter().all(|&u| u >= norm)
}

/// `cast` can open the prologue `[add, norm]`: it widens one operand of the add, and only
/// the add reads the widened copy, which is a graph output neither. The operand is a 16-bit
/// float of the norm output's dtype (the products' dtype, which the norm kernels take beside
/// their F32 input: a projection's result on its way into an F32 residual stream) and the
/// cast makes F32, so the widening is exact: the kernel loads the narrow operand and widens it
/// in registers, the same values the separate cast stores.
pub(super) fn prologue_cast_ok(
    g: &Graph,
    users: &[Vec<Node>],
    cast: Node,
    add: Node,
    norm: Node,
) -> bool {
    let c = g.node(cast);
    let (&[narrow], &[wide]) = (c.inputs.as_slice(), c.outputs.as_slice()) else {
        return false;
    };
    let low = g.ty(narrow).dtype;
    let adds = g.node(add).inputs.iter().filter(|&&v| v == wide).count();
    matches!(c.op, Op::Cast { to: DType::F32 })
        && matches!(low, DType::F16 | DType::BF16)
        && low == g.ty(g.node(norm).outputs[0]).dtype
        && g.ty(g.node(norm).inputs[0]).dtype == DType::F32
        && adds == 1
        && users[wide.index()].as_slice() == [add]
        && !g.outputs().contains(&wide)
}

/// The cast that can open the prologue `[add, norm]`: the producer of one of the add's
/// operands, where [`prologue_cast_ok`] takes it.
fn prologue_cast(g: &Graph, users: &[Vec<Node>], add: Node, norm: Node) -> Option<Node> {
    g.node(add)
        .inputs
        .iter()
        .map(|&v| g.value(v).producer)
        .find(|&c| prologue_cast_ok(g, users, c, add, norm))
}

/// `[norm_grad, add]` can be a norm epilogue: the input gradient's only reader is an `add` of
/// another gradient of its type, the gradient is not a graph output, and nothing reads the
/// norm gradient's other results before the add (the unit runs there). The kernel rounds
/// `dx` to its dtype before the add, as the separate ops do.
///
/// `[norm_grad, add, cast]` also takes the cast of the sum to the norm's output-gradient dtype
/// (the residual stream's gradient going back into the products' dtype), which the kernel
/// writes beside the sum; then nothing may read the sum before the cast either.
pub(super) fn epilogue_ok(
    g: &Graph,
    users: &[Vec<Node>],
    grad: Node,
    add: Node,
    cast: Option<Node>,
) -> bool {
    let node = g.node(grad);
    let en = g.node(add);
    if !is_norm_grad(&node.op) || !is_add(&en.op) || en.inputs.len() != 2 {
        return false;
    }
    let dx = node.outputs[0];
    let sum = en.outputs[0];
    let last = cast.unwrap_or(add);
    let other = en.inputs.iter().copied().find(|&v| v != dx);
    let cast_ok = cast.is_none_or(|c| low_copy_ok(g, users, node, sum, c));
    users[dx.index()].as_slice() == [add]
        && other.is_some_and(|o| g.ty(o) == g.ty(dx))
        && g.ty(sum) == g.ty(dx)
        && !g.outputs().contains(&dx)
        && cast_ok
        && node.outputs[1..]
            .iter()
            .all(|o| users[o.index()].iter().all(|&u| u > last))
}

/// `cast` narrows the epilogue's `sum` to the norm's output-gradient dtype (a 16-bit float),
/// and every other reader of the sum comes after it.
fn low_copy_ok(g: &Graph, users: &[Vec<Node>], grad: &NodeData, sum: Value, cast: Node) -> bool {
    let c = g.node(cast);
    let low = g.ty(grad.inputs[2]).dtype;
    matches!(c.op, Op::Cast { to } if to == low)
        && c.inputs.as_slice() == [sum]
        && matches!(low, DType::F16 | DType::BF16)
        && g.ty(sum).dtype != low
        && users[sum.index()].iter().all(|&u| u >= cast)
}

/// The cast that can join the epilogue `[grad, add]`: the first narrowing cast of the sum.
fn low_copy(g: &Graph, users: &[Vec<Node>], grad: Node, add: Node) -> Option<Node> {
    let sum = g.node(add).outputs[0];
    users[sum.index()]
        .iter()
        .copied()
        .find(|&c| low_copy_ok(g, users, g.node(grad), sum, c))
}

/// `members` (`[norm, tail]`, `[add, norm, tail]` or `[cast, add, norm, tail]`) can be a
/// [`UnitKind::NormFp8`] unit: the add (and cast), if any, are the norm's prologue
/// ([`prologue_members_ok`]); the tail reads the norm's output and is either its
/// `quantize` to E4M3 (the format `norm.cu`'s FP8 kernels write, the forward's) by a scalar
/// scale no member makes, or its `fp8_scale`; and nothing outside the unit reads what the
/// members make before the tail, where the unit runs.
pub(super) fn norm_fp8_ok(g: &Graph, users: &[Vec<Node>], members: &[Node]) -> bool {
    let (norm, tail) = match *members {
        [norm, tail] => (norm, tail),
        [.., norm, tail] if prologue_members_ok(g, users, &members[..members.len() - 1]) => {
            (norm, tail)
        }
        _ => return false,
    };
    let nn = g.node(norm);
    let tn = g.node(tail);
    if !is_norm(&nn.op) || tn.inputs[0] != nn.outputs[0] || tail < norm {
        return false;
    }
    let tail_ok = match tn.op {
        Op::Quantize { to } => {
            let scale = tn.inputs[1];
            to == DType::F8E4M3
                && g.ty(scale).shape.numel() == Some(1)
                && !members.contains(&g.value(scale).producer)
        }
        Op::Fp8Scale { .. } => true,
        _ => false,
    };
    tail_ok
        && matches!(
            g.ty(nn.outputs[0]).dtype,
            DType::F32 | DType::F16 | DType::BF16
        )
        && super::groups::runs_at_last_member(g, users, members)
}

/// The FP8 tail that can end the norm unit `base` (`[norm]` or a prologue): the first reader
/// of the norm's output that [`norm_fp8_ok`] takes.
fn fp8_tail(g: &Graph, users: &[Vec<Node>], base: &[Node]) -> Option<Node> {
    let norm = *base.last()?;
    let y = g.node(norm).outputs[0];
    users[y.index()].iter().copied().find(|&t| {
        let mut members = base.to_vec();
        members.push(t);
        norm_fp8_ok(g, users, &members)
    })
}

/// The norm prologues and epilogues of `g`, with each absorbed node taken out of its pointwise
/// group in `groups` (the nodes a unit absorbs are taken only when they read nothing else
/// their group makes, so the rest of the group still runs where it did: its readers of the
/// sum come after the add, so after the norm unit, and read the sum the norm kernel writes).
/// A prologue's add takes the cast that widens its operand ([`prologue_cast_ok`]) with it
/// where it can, and is absorbed alone otherwise.
///
/// A forward norm (with its prologue, or alone) whose output's FP8 cast or scale can end it
/// ([`norm_fp8_ok`]) becomes a [`UnitKind::NormFp8`] unit instead.
pub(super) fn norm_units(
    g: &Graph,
    users: &[Vec<Node>],
    groups: &mut [Vec<Node>],
) -> Vec<(Vec<Node>, UnitKind)> {
    let mut out = Vec::new();
    let mut claimed = HashSet::new();
    // Takes `nodes` out of their groups, where none reads what another member of its group
    // makes; else changes nothing and says so.
    let take = |nodes: &[Node], groups: &mut [Vec<Node>]| -> bool {
        let reads_group = groups.iter().any(|members| {
            nodes.iter().filter(|n| members.contains(n)).any(|&n| {
                g.node(n).inputs.iter().any(|v| {
                    members
                        .iter()
                        .any(|m| !nodes.contains(m) && g.node(*m).outputs.contains(v))
                })
            })
        });
        if reads_group {
            return false;
        }
        for members in groups.iter_mut() {
            members.retain(|m| !nodes.contains(m));
        }
        true
    };
    for (n, node) in g.nodes() {
        if is_norm(&node.op) {
            let p = g.value(node.inputs[0]).producer;
            let mut members = vec![n];
            if prologue_ok(g, users, p, n) && !claimed.contains(&p) {
                let cast = prologue_cast(g, users, p, n).filter(|c| !claimed.contains(c));
                let prologue = match cast {
                    Some(c) if take(&[c, p], groups) => vec![c, p],
                    _ if take(&[p], groups) => vec![p],
                    _ => vec![],
                };
                claimed.extend(prologue.iter().copied());
                members.splice(0..0, prologue);
            }
            let tail = fp8_tail(g, users, &members);
            let kind = match tail {
                Some(t) => {
                    members.push(t);
                    UnitKind::NormFp8
                }
                None => UnitKind::NormPrologue,
            };
            if members.len() > 1 {
                out.push((members, kind));
            }
        } else if is_norm_grad(&node.op) {
            let [e] = users[node.outputs[0].index()].as_slice() else {
                continue;
            };
            if !(epilogue_ok(g, users, n, *e, None) && !claimed.contains(e) && take(&[*e], groups))
            {
                continue;
            }
            claimed.insert(*e);
            let mut members = vec![n, *e];
            if let Some(c) = low_copy(g, users, n, *e) {
                if epilogue_ok(g, users, n, *e, Some(c))
                    && !claimed.contains(&c)
                    && take(&[c], groups)
                {
                    claimed.insert(c);
                    members.push(c);
                }
            }
            out.push((members, UnitKind::NormEpilogue));
        }
    }
    out
}

/// True when `n` and `first` (AdamW, SGD or Lion) update with the same scalars (learning rate,
/// step, loss scale, gradient norm: the last four operands), so one launch serves both.
fn shares_scalars(g: &Graph, first: Node, n: Node) -> bool {
    let a = g.node(first);
    let b = g.node(n);
    let k = b.inputs.len();
    let update = is_multi_tensor(&b.op);
    if first == n {
        return update;
    }
    update
        && a.op == b.op
        && a.inputs.len() == k
        && k >= 4
        && a.inputs[k - 4..] == b.inputs[k - 4..]
}

/// True when nothing outside the batch reads its results before its last member (where it
/// runs).
fn batch_runs_at_end(g: &Graph, users: &[Vec<Node>], batch: &[Node]) -> bool {
    let Some(&last) = batch.last() else {
        return true;
    };
    batch.iter().all(|&m| {
        g.node(m).outputs.iter().all(|o| {
            users[o.index()]
                .iter()
                .all(|&u| u > last || batch.contains(&u))
        })
    })
}

/// `batch` (in node order) can run as one multi-tensor launch: updates sharing their scalars,
/// then any `fp8_scale` of a master they update (the launch takes the maxima of the masters
/// it leaves, and one-block kernels make the scales of them), nothing reading what the batch
/// makes before its last member.
pub(super) fn batch_ok(g: &Graph, users: &[Vec<Node>], batch: &[Node]) -> bool {
    let updates = batch
        .iter()
        .take_while(|&&n| is_multi_tensor(&g.node(n).op))
        .count();
    let (updates, tails) = batch.split_at(updates);
    updates.first().is_some_and(|&first| {
        updates.iter().all(|&n| shares_scalars(g, first, n))
            && tails.iter().all(|&t| scales_an_update(g, updates, t))
            && batch_runs_at_end(g, users, batch)
    })
}

/// `t` is the `fp8_scale` of a master one of `updates` writes.
fn scales_an_update(g: &Graph, updates: &[Node], t: Node) -> bool {
    let node = g.node(t);
    matches!(node.op, Op::Fp8Scale { .. })
        && updates
            .iter()
            .any(|&u| g.node(u).outputs[0] == node.inputs[0])
}

/// `batch` with the `fp8_scale`s of the masters it updates, where the batch can still run as
/// one launch with them (the FP8 weight copies' scales, made once per optimizer step).
fn with_master_scales(g: &Graph, users: &[Vec<Node>], batch: Vec<Node>) -> Vec<Node> {
    let mut trial = batch.clone();
    for &u in &batch {
        let master = g.node(u).outputs[0];
        trial.extend(
            users[master.index()]
                .iter()
                .copied()
                .filter(|&t| scales_an_update(g, &batch, t)),
        );
    }
    trial.sort();
    trial.dedup();
    if trial.len() > batch.len() && batch_ok(g, users, &trial) {
        trial
    } else {
        batch
    }
}

/// `batch` (in node order) can run as one `amax_history` launch: every member is one, and
/// nothing reads their results before the last.
pub(super) fn history_batch_ok(g: &Graph, users: &[Vec<Node>], batch: &[Node]) -> bool {
    !batch.is_empty()
        && batch
            .iter()
            .all(|&n| matches!(g.node(n).op, Op::AmaxHistory { .. }))
        && batch_runs_at_end(g, users, batch)
}

/// The graph's `amax_history` nodes as one batch (two or more), where it can run at its last
/// member; else none (each runs alone). In a micro step nothing reads them: their results are
/// written back to state after the micro-batch.
pub(super) fn history_batch(g: &Graph, users: &[Vec<Node>]) -> Option<Vec<Node>> {
    let batch: Vec<Node> = g
        .nodes()
        .filter(|(_, node)| matches!(node.op, Op::AmaxHistory { .. }))
        .map(|(n, _)| n)
        .collect();
    (batch.len() >= 2 && history_batch_ok(g, users, &batch)).then_some(batch)
}

/// The updates the multi-tensor kernels run (`optimizer.cu`): AdamW, SGD and Lion.
fn is_multi_tensor(op: &Op) -> bool {
    matches!(op, Op::AdamW { .. } | Op::Sgd { .. } | Op::Lion { .. })
}

/// AdamW/SGD/Lion nodes grouped by shared scalars; a batch whose results are read before its last
/// member splits into one launch per node.
pub(super) fn optimizer_batches(g: &Graph, users: &[Vec<Node>]) -> Vec<Vec<Node>> {
    let mut batches: Vec<Vec<Node>> = Vec::new();
    for (n, node) in g.nodes() {
        if !is_multi_tensor(&node.op) {
            continue;
        }
        match batches.iter_mut().find(|b| shares_scalars(g, b[0], n)) {
            Some(b) => b.push(n),
            None => batches.push(vec![n]),
        }
    }
    let mut out = Vec::new();
    for b in batches {
        if batch_ok(g, users, &b) {
            out.push(b);
        } else {
            out.extend(b.into_iter().map(|m| vec![m]));
        }
    }
    out.into_iter()
        .map(|b| with_master_scales(g, users, b))
        .collect()
}
