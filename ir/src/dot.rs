//! Graphviz export: one box per node, coloured by the dtype it writes; casts are diamonds,
//! persistent parameter copies are folders with a double border, and recomputed values
//! (rematerialization: a note starting with `remat`, or a name ending in `.remat`) have a
//! dashed red border. In a graph with LoRA adapters the adapter parameters have a thick green
//! border and every other parameter, the frozen base, a dashed one.

use crate::{DType, Graph, Op};
use std::fmt::Write;

/// Fill colour for each dtype, so a glance shows where low precision runs.
pub fn dtype_colour(d: DType) -> &'static str {
    match d {
        DType::F32 => "#9ecae1",
        DType::BF16 => "#fdae6b",
        DType::F16 => "#fb6a4a",
        DType::I32 | DType::I64 => "#d9d9d9",
        DType::Bool => "#f0f0f0",
        DType::U8 => "#bcbddc",
        DType::F8E4M3 => "#a1d99b",
        DType::F8E5M2 => "#31a354",
    }
}

/// The graph in DOT, with a legend of the dtypes it uses.
pub fn to_dot(g: &Graph) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph \"{}\" {{", escape(&g.name));
    out.push_str("  rankdir=TB;\n  node [style=filled, fontname=\"Helvetica\", fontsize=10];\n");
    let mut used = Vec::new();
    let (mut copies, mut remats) = (false, false);
    let lora = g.with_origin(crate::Origin::Adapter).next().is_some();
    for (n, data) in g.nodes() {
        let first = data.outputs[0];
        let ty = g.ty(first);
        if !used.contains(&ty.dtype) {
            used.push(ty.dtype);
        }
        let shape = match data.op {
            Op::Cast { .. } => "diamond",
            Op::Input => "invhouse",
            Op::Param => "note",
            Op::ParamCopy { .. } => "folder",
            Op::State => "cylinder",
            _ => "box",
        };
        let mut label = format!("{}\\n{}", escape(g.name(first)), data.op.mnemonic());
        for &v in &data.outputs {
            let _ = write!(label, "\\n{}", g.ty(v));
        }
        let mut extra = String::new();
        if matches!(data.op, Op::ParamCopy { .. }) {
            copies = true;
            extra.push_str(", peripheries=2");
        }
        if lora && data.op == Op::Param {
            if data.origin == Some(crate::Origin::Adapter) {
                label.push_str("\\n(LoRA adapter)");
                extra.push_str(ADAPTER_STYLE);
            } else {
                label.push_str("\\n(frozen base)");
                extra.push_str(FROZEN_STYLE);
            }
        }
        if is_remat(data) {
            remats = true;
            label.push_str("\\n(recomputed)");
            extra.push_str(REMAT_STYLE);
        }
        let _ = writeln!(
            out,
            "  {n} [label=\"{label}\", shape={shape}, fillcolor=\"{}\"{extra}];",
            dtype_colour(ty.dtype)
        );
        for &v in &data.inputs {
            let _ = writeln!(out, "  {} -> {n};", g.value(v).producer);
        }
    }
    for (i, &v) in g.outputs().iter().enumerate() {
        let _ = writeln!(
            out,
            "  out{i} [label=\"return {}\", shape=house, fillcolor=white];",
            escape(g.name(v))
        );
        let _ = writeln!(out, "  {} -> out{i};", g.value(v).producer);
    }
    used.sort();
    out.push_str("  subgraph cluster_legend {\n    label=\"dtype\";\n");
    for d in used {
        let _ = writeln!(
            out,
            "    legend_{d} [label=\"{d}\", shape=box, fillcolor=\"{}\"];",
            dtype_colour(d)
        );
    }
    if copies {
        out.push_str(
            "    legend_param_copy [label=\"persistent parameter copy\", shape=folder, \
             peripheries=2, fillcolor=white];\n",
        );
    }
    if remats {
        let _ = writeln!(
            out,
            "    legend_remat [label=\"recomputed in the backward pass\", shape=box, \
             fillcolor=white{REMAT_STYLE}];"
        );
    }
    if lora {
        let _ = writeln!(
            out,
            "    legend_adapter [label=\"LoRA adapter (trained)\", shape=note, \
             fillcolor=white{ADAPTER_STYLE}];\n    legend_frozen [label=\"frozen base \
             (not trained)\", shape=note, fillcolor=white{FROZEN_STYLE}];"
        );
    }
    out.push_str("  }\n}\n");
    out
}

/// How a LoRA adapter parameter and a frozen base parameter are drawn.
const ADAPTER_STYLE: &str = ", color=\"#238b45\", penwidth=3";
const FROZEN_STYLE: &str = ", style=\"filled,dashed\", color=\"#636363\"";

/// How a recomputed value is drawn.
const REMAT_STYLE: &str = ", style=\"filled,dashed\", color=\"#d62728\", penwidth=2.5";

/// A value recomputed (or gathered again) for the backward pass, as the remat pass marks it.
fn is_remat(data: &crate::graph::NodeData) -> bool {
    matches!(
        data.origin,
        Some(crate::Origin::Remat | crate::Origin::Regather)
    )
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}
