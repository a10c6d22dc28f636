//! Autocast: decides every node's dtypes under a [`Policy`], and inserts the casts and
//! parameter copies that make the decision executable.
//!
//! The engine paints nodes as TensorFlow's AMP graph pass does, on the op-kind table and name
//! rules of the policy:
//!
//! 1. *allow* nodes (contractions) are low precision, *deny* nodes (normalizations) F32;
//! 2. deny spreads forward through infer and clear nodes that also lead to deny nodes;
//! 3. infer and clear nodes between two low-precision nodes become low precision;
//! 4. clear nodes take the colour of low-precision neighbours;
//! 5. in BF16, an infer node whose float inputs are all low precision follows them (TVM's
//!    *follow*: a mixed F32/BF16 binary op stays F32, as PyTorch autocast promotes it);
//! 6. everything else computes in F32.
//!
//! Then each node gets its three dtypes. Operands of low-precision nodes are low precision;
//! F32 normalizations read whatever their producer wrote (the kernel widens on load, so a
//! layer norm reads BF16 without a cast) and accumulate in F32; other F32 nodes read F32.
//! Contractions and normalizations write F32 when any consumer needs F32 (or the value is a
//! graph output), else low precision: a BF16 matmul feeding only BF16 consumers writes BF16,
//! one feeding an F32 residual add writes F32 directly. Every other node writes its colour.
//!
//! Where a value's dtype differs from what a consumer reads, one cast per (value, dtype) is
//! placed right after the producer and shared by every consumer. Parameters are never cast in
//! the step: a parameter read in low precision gets one persistent `param_copy` beside its
//! F32 master. Graph inputs and outputs keep their declared dtypes. Every painted node records
//! why in its note, which the IR text prints.

use crate::policy::{Policy, Rule, Target};
use crate::summary::precision_summary;
use crate::{Pass, PassError, PassReport};
use castor_ir::Precision;
use castor_ir::{Accum, DType, Graph, Node, Op, OpClass, TensorType, Value};
use std::collections::{BTreeMap, BTreeSet};

/// The autocast pass for one policy.
pub struct Autocast {
    policy: Policy,
}

impl Autocast {
    pub fn new(policy: Policy) -> Self {
        Autocast { policy }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Colour {
    Low,
    F32,
}

/// A painted node's rule, colour and the reason for it.
#[derive(Clone, Debug)]
struct Paint {
    rule: Rule,
    /// Set by a name rule; painting never changes it.
    forced: bool,
    colour: Option<Colour>,
    reason: String,
}

/// What a consumer reads an operand as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    /// Exactly this dtype.
    Dtype(DType),
    /// Whatever float dtype the producer wrote.
    Any,
}

impl Pass for Autocast {
    fn name(&self) -> &'static str {
        "autocast"
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        castor_ir::verify(g)?;
        let users = g.users();
        let mut paints = self.initial_paint(g)?;
        match self.policy.precision.low() {
            Some(low) => paint_low(g, &users, &mut paints, low),
            None => {
                for p in paints.iter_mut().flatten() {
                    p.colour = Some(Colour::F32);
                    if !p.forced {
                        p.reason = format!("{}: {} policy", p.rule, self.policy.precision);
                    }
                }
            }
        }
        let out = assign(g, &users, &paints, &self.policy)?;
        let s = precision_summary(&out, self.policy.precision.low());
        let mut report = PassReport::new(s.headline());
        report.details = s.table_lines();
        Ok((out, report))
    }
}

impl Autocast {
    /// Table rule and name rule for every node the policy governs.
    fn initial_paint(&self, g: &Graph) -> Result<Vec<Option<Paint>>, PassError> {
        let low = self.policy.precision.low();
        let residual = if self.policy.residual_low() {
            residual_stream(g)
        } else {
            BTreeSet::new()
        };
        g.nodes()
            .map(|(n, node)| {
                let Some((rule, origin)) = self.policy.rule_for(&node.op) else {
                    return Ok(None);
                };
                if !node.outputs.iter().any(|&v| g.ty(v).dtype.is_float()) {
                    return Ok(None);
                }
                let name = g.name(node.outputs[0]);
                let params: Vec<&str> = node
                    .inputs
                    .iter()
                    .filter(|&&v| g.node(g.value(v).producer).op == Op::Param)
                    .map(|&v| g.name(v))
                    .collect();
                let paint = match self.policy.rule_for_names(name, &params)? {
                    Some(r) => Paint {
                        rule: if r.target == Target::F32 {
                            Rule::Deny
                        } else {
                            Rule::Allow
                        },
                        forced: true,
                        colour: Some(if r.target == Target::F32 {
                            Colour::F32
                        } else {
                            Colour::Low
                        }),
                        reason: format!("override: {}", r.describe(low)),
                    },
                    None if residual.contains(&n) => Paint {
                        rule: Rule::Allow,
                        forced: true,
                        colour: Some(Colour::Low),
                        reason: format!(
                            "residual stream in {} (--residual low)",
                            low.map_or("low precision".to_string(), |d| d.to_string())
                        ),
                    },
                    None => Paint {
                        rule,
                        forced: false,
                        colour: None,
                        reason: format!("{rule}: {origin}"),
                    },
                };
                Ok(Some(paint))
            })
            .collect()
    }
}

/// The residual stream, found by structure: every `add` whose sum a normalization reads as
/// its input (pre-norm models: the stream itself; post-norm: the residual adds) or that sums
/// embeddings, and every embedding that feeds one of those or a normalization directly (where
/// the stream starts).
fn residual_stream(g: &Graph) -> BTreeSet<Node> {
    let users = g.users();
    let normalized = |v: Value| {
        users[v.index()].iter().any(|&u| {
            let node = g.node(u);
            matches!(node.op, Op::LayerNorm { .. } | Op::RmsNorm { .. }) && node.inputs[0] == v
        })
    };
    let is_add = |op: &Op| *op == Op::Binary(castor_ir::BinaryOp::Add);
    let embedded = |v: Value| matches!(g.node(g.value(v).producer).op, Op::Embedding { .. });
    // The stream's adds, and sums of embeddings (BERT's words + token types) before them.
    let adds: BTreeSet<Node> = g
        .nodes()
        .filter(|(_, node)| {
            is_add(&node.op)
                && (normalized(node.outputs[0]) || node.inputs.iter().all(|&v| embedded(v)))
        })
        .map(|(n, _)| n)
        .collect();
    let starts = g
        .nodes()
        .filter(|(_, node)| {
            matches!(node.op, Op::Embedding { .. }) && {
                let v = node.outputs[0];
                normalized(v) || users[v.index()].iter().any(|u| adds.contains(u))
            }
        })
        .map(|(n, _)| n);
    adds.iter().copied().chain(starts).collect()
}

/// Steps 1-6 of the module doc, for a policy with a low-precision dtype.
fn paint_low(g: &Graph, users: &[Vec<Node>], paints: &mut [Option<Paint>], low: DType) {
    let n = g.num_nodes();
    let rule = |paints: &[Option<Paint>], i: usize| paints[i].as_ref().map(|p| p.rule);
    let is_candidate = |paints: &[Option<Paint>], i: usize| {
        paints[i]
            .as_ref()
            .is_some_and(|p| !p.forced && matches!(p.rule, Rule::Infer | Rule::Clear))
    };
    let producers = |i: usize| -> Vec<usize> {
        g.node(Node(i as u32))
            .inputs
            .iter()
            .filter(|&&v| g.ty(v).dtype.is_float())
            .map(|&v| g.value(v).producer.index())
            .collect()
    };
    let consumers = |i: usize| -> Vec<usize> {
        let mut c: Vec<usize> = g
            .node(Node(i as u32))
            .outputs
            .iter()
            .filter(|&&v| g.ty(v).dtype.is_float())
            .flat_map(|&v| users[v.index()].iter().map(|u| u.index()))
            .collect();
        c.dedup();
        c
    };

    // 1. Allow and deny nodes.
    for p in paints.iter_mut().flatten() {
        match (p.rule, p.colour) {
            (Rule::Allow, None) => p.colour = Some(Colour::Low),
            (Rule::Deny, None) => p.colour = Some(Colour::F32),
            _ => {}
        }
    }

    // 2. Deny spreads through infer/clear nodes that are downstream *and* upstream of deny.
    let mut after_deny = vec![false; n];
    for i in 0..n {
        if is_candidate(paints, i) {
            after_deny[i] = producers(i)
                .into_iter()
                .any(|p| rule(paints, p) == Some(Rule::Deny) || after_deny[p]);
        }
    }
    let mut before_deny = vec![false; n];
    for i in (0..n).rev() {
        if is_candidate(paints, i) {
            before_deny[i] = consumers(i)
                .into_iter()
                .any(|c| rule(paints, c) == Some(Rule::Deny) || before_deny[c]);
        }
    }
    for i in 0..n {
        if after_deny[i] && before_deny[i] {
            if let Some(p) = paints[i].as_mut() {
                p.colour = Some(Colour::F32);
                p.reason = format!("deny: {} between f32 normalizations", p.rule);
                p.rule = Rule::Deny;
            }
        }
    }

    // 3. Infer and clear nodes between two low-precision nodes.
    let open = |paints: &[Option<Paint>], i: usize| {
        is_candidate(paints, i) && paints[i].as_ref().is_some_and(|p| p.colour.is_none())
    };
    let is_low = |paints: &[Option<Paint>], i: usize| {
        paints[i]
            .as_ref()
            .is_some_and(|p| p.colour == Some(Colour::Low))
    };
    let mut after_low = vec![false; n];
    for i in 0..n {
        if open(paints, i) {
            after_low[i] = producers(i)
                .into_iter()
                .any(|p| is_low(paints, p) || after_low[p]);
        }
    }
    let mut before_low = vec![false; n];
    for i in (0..n).rev() {
        if open(paints, i) {
            before_low[i] = consumers(i)
                .into_iter()
                .any(|c| is_low(paints, c) || before_low[c]);
        }
    }
    for i in 0..n {
        if after_low[i] && before_low[i] {
            if let Some(p) = paints[i].as_mut() {
                p.colour = Some(Colour::Low);
                p.reason = format!("{}: between {low} contractions", p.rule);
            }
        }
    }

    // 4 and 5, until nothing changes: clear nodes join low neighbours; in BF16, infer nodes
    // follow inputs that are all low precision.
    loop {
        let mut changed = false;
        for i in 0..n {
            if !open(paints, i) {
                continue;
            }
            let r = rule(paints, i);
            let reason = if r == Some(Rule::Clear) {
                producers(i)
                    .into_iter()
                    .chain(consumers(i))
                    .find(|&j| is_low(paints, j))
                    .map(|j| format!("clear: next to %{} ({low})", first_name(g, j)))
            } else if low == DType::BF16 {
                follow_reason(g, paints, i, low)
            } else {
                None
            };
            if let (Some(reason), Some(p)) = (reason, paints[i].as_mut()) {
                p.colour = Some(Colour::Low);
                p.reason = reason;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }

    // 6. Everything left computes in F32.
    for p in paints.iter_mut().flatten() {
        if p.colour.is_none() {
            p.colour = Some(Colour::F32);
            p.reason = format!("{}: no {low} neighbours, stays f32", p.rule);
        }
    }
}

/// BF16 follow: every float operand that is not a parameter comes from a low node.
fn follow_reason(g: &Graph, paints: &[Option<Paint>], i: usize, low: DType) -> Option<String> {
    let mut first_low = None;
    for &v in &g.node(Node(i as u32)).inputs {
        if !g.ty(v).dtype.is_float() || g.node(g.value(v).producer).op == Op::Param {
            continue;
        }
        let p = g.value(v).producer.index();
        if paints[p]
            .as_ref()
            .is_some_and(|p| p.colour == Some(Colour::Low))
        {
            first_low.get_or_insert(v);
        } else {
            return None;
        }
    }
    first_low.map(|v| format!("follow: input %{} is {low}", g.name(v)))
}

fn first_name(g: &Graph, node: usize) -> &str {
    g.name(g.node(Node(node as u32)).outputs[0])
}

/// Builds the output graph: dtypes, casts at producers, parameter copies, notes.
fn assign(
    g: &Graph,
    users: &[Vec<Node>],
    paints: &[Option<Paint>],
    policy: &Policy,
) -> Result<Graph, PassError> {
    let low = policy.precision.low();
    let colour_dtype = |c: Colour| match c {
        Colour::Low => low.unwrap_or(DType::F32),
        Colour::F32 => DType::F32,
    };
    // What each node reads each float operand as.
    let want = |n: Node, v: Value| -> Want {
        if !g.ty(v).dtype.is_float() {
            return Want::Dtype(g.ty(v).dtype);
        }
        let node = g.node(n);
        match &paints[n.index()] {
            Some(p) => match p.colour.unwrap_or(Colour::F32) {
                Colour::Low => Want::Dtype(colour_dtype(Colour::Low)),
                Colour::F32 if node.op.class() == OpClass::Normalization => Want::Any,
                Colour::F32 => Want::Dtype(DType::F32),
            },
            None if matches!(node.op, Op::Cast { .. }) => Want::Any,
            None => Want::Dtype(g.ty(v).dtype),
        }
    };
    let outputs: BTreeSet<Value> = g.outputs().iter().copied().collect();

    // Pass 1: the dtype each value is produced in, and the casts its consumers need.
    let mut produced: Vec<TensorType> = Vec::with_capacity(g.num_values());
    let mut needed: BTreeMap<Value, BTreeSet<DType>> = BTreeMap::new();
    for (n, node) in g.nodes() {
        let mut operand_types = Vec::new();
        for &v in &node.inputs {
            let have = produced[v.index()].dtype;
            let dtype = match want(n, v) {
                Want::Dtype(w) if w != have => {
                    needed.entry(v).or_default().insert(w);
                    w
                }
                _ => have,
            };
            operand_types.push(TensorType::new(dtype, g.ty(v).shape.clone()));
        }
        if node.op.is_source() {
            produced.push(g.ty(node.outputs[0]).clone());
            continue;
        }
        let refs: Vec<&TensorType> = operand_types.iter().collect();
        let mut types = match node.op.infer(&refs) {
            Ok(t) => t,
            // Unpainted nodes keep their types; an inference failure here is a pass bug.
            Err(message) => {
                return Err(castor_ir::IrError::Invalid {
                    site: castor_ir::Site {
                        node: g.name(node.outputs[0]).to_string(),
                        location: None,
                    },
                    message: format!("autocast produced untypeable operands: {message}"),
                }
                .into())
            }
        };
        if let Some(p) = &paints[n.index()] {
            if node.op.output_dtype_is_free() {
                let v = node.outputs[0];
                let wants: Vec<Want> = users[v.index()].iter().map(|&u| want(u, v)).collect();
                let f32_needed = outputs.contains(&v) && g.ty(v).dtype == DType::F32
                    || wants.contains(&Want::Dtype(DType::F32));
                let low_needed = low.is_some_and(|l| wants.contains(&Want::Dtype(l)));
                // A node kept in F32 by a name rule stores F32 too; otherwise the result is
                // stored the way its readers read it (the cast fused into the kernel).
                types[0].dtype = if f32_needed || (p.forced && p.colour == Some(Colour::F32)) {
                    DType::F32
                } else if low_needed {
                    colour_dtype(Colour::Low)
                } else {
                    colour_dtype(p.colour.unwrap_or(Colour::F32))
                };
            }
        } else {
            // Unpainted nodes (casts, integer ops) keep their recorded result types.
            types = node.outputs.iter().map(|&v| g.ty(v).clone()).collect();
        }
        produced.extend(types);
    }
    for &v in g.outputs() {
        if produced[v.index()].dtype != g.ty(v).dtype {
            needed.entry(v).or_default().insert(g.ty(v).dtype);
        }
    }

    // Pass 2: emit nodes, each followed by the casts (or parameter copies) of its results.
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    let mut casts: BTreeMap<(Value, DType), Value> = BTreeMap::new();
    for (n, node) in g.nodes() {
        let inputs = node
            .inputs
            .iter()
            .map(|&v| {
                let have = produced[v.index()].dtype;
                match want(n, v) {
                    Want::Dtype(w) if w != have => cast_of(&casts, v, w, g),
                    _ => defined(&map, v, g),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A graph output computed in another dtype than declared keeps its name on the cast
        // back, so outputs are still found by name.
        let renamed = |v: Value| outputs.contains(&v) && produced[v.index()].dtype != g.ty(v).dtype;
        let results = node
            .outputs
            .iter()
            .map(|&v| {
                let name = if renamed(v) {
                    fresh(
                        &out,
                        &format!("{}.{}", g.name(v), produced[v.index()].dtype),
                    )
                } else {
                    g.name(v).to_string()
                };
                (name, produced[v.index()].clone())
            })
            .collect();
        let new_node = out.push_copy(g, n, inputs, results)?;
        if let Some(p) = &paints[n.index()] {
            let mut reason = p.reason.clone();
            let stored = produced[node.outputs[0].index()].dtype;
            if p.colour == Some(Colour::F32) && stored.is_low_precision() {
                reason.push_str(&format!("; stores {stored}, as all its readers read it"));
            }
            out.set_note(new_node, Some(reason));
            let class = node.op.class();
            if matches!(class, OpClass::Contraction | OpClass::Normalization) {
                // TF32 is for matrix products; fused attention has no TF32 form and stays
                // exact F32 (its kernels' F32 path), as PyTorch's fused SDPA kernels do.
                let tf32 = policy.precision == Precision::Tf32
                    && class == OpClass::Contraction
                    && !matches!(node.op, Op::Attention { .. } | Op::AttentionGrad { .. });
                out.set_acc(new_node, Some(if tf32 { Accum::Tf32 } else { Accum::F32 }));
            }
        }
        for (&v, &nv) in node.outputs.iter().zip(&out.node(new_node).outputs.clone()) {
            map[v.index()] = Some(nv);
            for &dtype in needed.get(&v).into_iter().flatten() {
                let is_param = node.op == Op::Param;
                let op = if is_param {
                    Op::ParamCopy { to: dtype }
                } else {
                    Op::Cast { to: dtype }
                };
                let name = if renamed(v) && dtype == g.ty(v).dtype {
                    g.name(v).to_string()
                } else {
                    fresh(&out, &format!("{}.{dtype}", g.name(v)))
                };
                let ty = TensorType::new(dtype, g.ty(v).shape.clone());
                let c = out.push_node(op, vec![nv], vec![(name, ty)])?;
                // A cast runs where its producer does (parameter copies: in no block).
                out.set_block(c, node.block);
                let readers = users[v.index()]
                    .iter()
                    .filter(|&&u| want(u, v) == Want::Dtype(dtype))
                    .count()
                    + usize::from(outputs.contains(&v) && g.ty(v).dtype == dtype);
                let note = if is_param {
                    format!("persistent {dtype} copy of the f32 master, written by the optimizer; {readers} reader(s)")
                } else {
                    format!("one cast to {dtype}, shared by {readers} reader(s)")
                };
                out.set_note(c, Some(note));
                casts.insert((v, dtype), out.node(c).outputs[0]);
            }
        }
    }
    let new_outputs = g
        .outputs()
        .iter()
        .map(|&v| {
            if produced[v.index()].dtype == g.ty(v).dtype {
                defined(&map, v, g)
            } else {
                cast_of(&casts, v, g.ty(v).dtype, g)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(new_outputs);
    Ok(out)
}

/// The new value standing for old value `v`; emitted before any use in a verified graph.
fn defined(map: &[Option<Value>], v: Value, g: &Graph) -> Result<Value, PassError> {
    map[v.index()].ok_or_else(|| PassError::Internal {
        pass: "autocast",
        message: format!("%{} is used before it is emitted", g.name(v)),
    })
}

/// The cast of old value `v` to `dtype`, emitted right after `v`'s producer.
fn cast_of(
    casts: &BTreeMap<(Value, DType), Value>,
    v: Value,
    dtype: DType,
    g: &Graph,
) -> Result<Value, PassError> {
    casts
        .get(&(v, dtype))
        .copied()
        .ok_or_else(|| PassError::Internal {
            pass: "autocast",
            message: format!("no cast of %{} to {dtype} was emitted", g.name(v)),
        })
}

/// `base`, or `base.1`, `base.2`, ... whichever is free.
pub(crate) fn fresh(g: &Graph, base: &str) -> String {
    if g.lookup(base).is_none() {
        return base.to_string();
    }
    let mut i = 1;
    loop {
        let candidate = format!("{base}.{i}");
        if g.lookup(&candidate).is_none() {
            return candidate;
        }
        i += 1;
    }
}
