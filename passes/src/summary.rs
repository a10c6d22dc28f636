//! What the precision passes decided, for people: the summary line, the table per class and
//! dtype, and per-node explanations.

use castor_ir::{Accum, DType, Graph, NodeData, Op, OpClass};
use std::collections::BTreeMap;
use std::fmt::Write;
use wildmatch::WildMatch;

/// Counts over a precision-assigned graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrecisionSummary {
    pub low: Option<DType>,
    /// Nodes computing in the low dtype (contractions reading it, others writing it).
    pub converted: usize,
    /// Nodes with a float result, other than sources, casts and parameter copies.
    pub total: usize,
    /// Cast nodes, by target dtype.
    pub casts: BTreeMap<DType, usize>,
    /// Persistent parameter copies, by dtype.
    pub param_copies: BTreeMap<DType, usize>,
    /// Class -> compute dtype -> nodes.
    pub by_class: BTreeMap<OpClass, BTreeMap<DType, usize>>,
}

fn counted(node: &NodeData, g: &Graph) -> bool {
    !node.op.is_source()
        && !matches!(node.op, Op::Cast { .. } | Op::ParamCopy { .. })
        && node.outputs.iter().any(|&v| g.ty(v).dtype.is_float())
}

/// The dtype a node computes in, as the table shows it: a contraction's operand dtype (its
/// tensor-core input), any other node's result dtype.
fn compute_dtype(node: &NodeData, g: &Graph) -> DType {
    match node.inputs.first() {
        Some(&v) if node.op.class() == OpClass::Contraction => g.ty(v).dtype,
        _ => g.ty(node.outputs[0]).dtype,
    }
}

/// True if the node computes in the low dtype.
fn is_converted(node: &NodeData, g: &Graph, low: DType) -> bool {
    if node.op.class() == OpClass::Contraction {
        node.inputs.iter().any(|&v| g.ty(v).dtype == low)
    } else {
        g.ty(node.outputs[0]).dtype == low
    }
}

pub fn precision_summary(g: &Graph, low: Option<DType>) -> PrecisionSummary {
    let mut s = PrecisionSummary {
        low,
        converted: 0,
        total: 0,
        casts: BTreeMap::new(),
        param_copies: BTreeMap::new(),
        by_class: BTreeMap::new(),
    };
    for (_, node) in g.nodes() {
        match node.op {
            // Precision casts only: a mask's int -> bool cast is not one.
            Op::Cast { to } if to.is_float() && g.ty(node.inputs[0]).dtype.is_float() => {
                *s.casts.entry(to).or_default() += 1
            }
            Op::ParamCopy { to } => *s.param_copies.entry(to).or_default() += 1,
            _ => {}
        }
        if !counted(node, g) {
            continue;
        }
        s.total += 1;
        if low.is_some_and(|l| is_converted(node, g, l)) {
            s.converted += 1;
        }
        *s.by_class
            .entry(node.op.class())
            .or_default()
            .entry(compute_dtype(node, g))
            .or_default() += 1;
    }
    s
}

impl PrecisionSummary {
    pub fn cast_count(&self) -> usize {
        self.casts.values().sum()
    }

    /// "converted 40/120 nodes to bf16 with 12 casts", as TensorFlow's AMP pass says it.
    /// The table's rows: the four compute classes always, communication where the graph
    /// has collectives (data-parallel plans).
    pub fn shown_classes(&self) -> Vec<OpClass> {
        OpClass::ALL
            .into_iter()
            .filter(|c| *c != OpClass::Communication || self.by_class.contains_key(c))
            .collect()
    }

    pub fn headline(&self) -> String {
        let low = self
            .low
            .map_or("low precision".to_string(), |d| d.to_string());
        let mut s = format!(
            "converted {}/{} nodes to {low} with {} cast{}",
            self.converted,
            self.total,
            self.cast_count(),
            if self.cast_count() == 1 { "" } else { "s" }
        );
        let copies: usize = self.param_copies.values().sum();
        if copies > 0 {
            let _ = write!(
                s,
                " and {copies} persistent parameter cop{}",
                if copies == 1 { "y" } else { "ies" }
            );
        }
        s
    }

    /// The table: one row per class, one column per compute dtype.
    pub fn table_lines(&self) -> Vec<String> {
        let mut dtypes: Vec<DType> = self
            .by_class
            .values()
            .flat_map(|m| m.keys().copied())
            .collect();
        dtypes.sort();
        dtypes.dedup();
        let mut lines = Vec::new();
        let mut header = format!("{:<14}", "class");
        for d in &dtypes {
            let _ = write!(header, "{:>7}", d.name());
        }
        lines.push(header);
        for class in self.shown_classes() {
            let row = self.by_class.get(&class);
            let mut line = format!("{:<14}", class.name());
            for d in &dtypes {
                let _ = write!(
                    line,
                    "{:>7}",
                    row.and_then(|r| r.get(d)).copied().unwrap_or(0)
                );
            }
            lines.push(line);
        }
        lines.push(
            "(contractions by operand dtype, other ops by stored dtype; all accumulate in f32)"
                .into(),
        );
        let casts: Vec<String> = self
            .casts
            .iter()
            .map(|(d, n)| format!("{n} to {d}"))
            .collect();
        lines.push(format!(
            "{:<14}{}",
            "casts",
            if casts.is_empty() {
                "none".to_string()
            } else {
                casts.join(", ")
            }
        ));
        let copies: Vec<String> = self
            .param_copies
            .iter()
            .map(|(d, n)| format!("{n} {d}"))
            .collect();
        if !copies.is_empty() {
            lines.push(format!("{:<14}{}", "param copies", copies.join(", ")));
        }
        lines
    }
}

/// One node's precision decision, as `compile --explain` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The node's (first) result name.
    pub node: String,
    /// The op's mnemonic (`matmul`, `layer_norm`, ...).
    pub op: String,
    pub op_class: OpClass,
    /// Each input's name and dtype, in order.
    pub reads: Vec<(String, DType)>,
    /// The accumulator dtype, for ops that accumulate.
    pub accumulates: Option<Accum>,
    /// Each result's dtype.
    pub writes: Vec<DType>,
    /// The reason recorded by the pass that decided.
    pub why: String,
}

impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let reads: Vec<String> = self
            .reads
            .iter()
            .map(|(name, dtype)| format!("%{name}: {dtype}"))
            .collect();
        let writes: Vec<String> = self.writes.iter().map(|d| d.to_string()).collect();
        write!(
            f,
            "%{} = {} [{}]\n    reads {}\n    accumulates {}\n    writes {}\n    why: {}",
            self.node,
            self.op,
            self.op_class,
            if reads.is_empty() {
                "nothing".to_string()
            } else {
                reads.join(", ")
            },
            self.accumulates.map_or("-".to_string(), |a| a.to_string()),
            writes.join(", "),
            self.why
        )
    }
}

/// The decisions of the nodes whose result name matches `glob`, in graph order.
pub fn decisions(g: &Graph, glob: &str) -> Vec<Decision> {
    let m = WildMatch::new(glob);
    g.nodes()
        .filter(|(_, n)| n.outputs.iter().any(|&v| m.matches(g.name(v))))
        .map(|(_, n)| Decision {
            node: g.name(n.outputs[0]).to_string(),
            op: n.op.mnemonic().to_string(),
            op_class: n.op.class(),
            reads: n
                .inputs
                .iter()
                .map(|&v| (g.name(v).to_string(), g.ty(v).dtype))
                .collect(),
            accumulates: n.acc,
            writes: n.outputs.iter().map(|&v| g.ty(v).dtype).collect(),
            why: n
                .note
                .clone()
                .unwrap_or_else(|| "(no decision recorded)".to_string()),
        })
        .collect()
}

/// One text block per node whose result name matches `glob`: its three dtypes and the reason.
pub fn explain(g: &Graph, glob: &str) -> Vec<String> {
    decisions(g, glob).iter().map(|d| d.to_string()).collect()
}
