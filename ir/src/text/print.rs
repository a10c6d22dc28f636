use crate::{Graph, NodeData};
use std::fmt::Write;

/// Prints a graph in the text format.
pub fn print(g: &Graph) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "graph {} {{", g.name);
    for (_, node) in g.nodes() {
        let _ = writeln!(out, "  {}", node_line(g, node));
    }
    let outputs: Vec<String> = g
        .outputs()
        .iter()
        .map(|&v| format!("%{}", g.name(v)))
        .collect();
    let _ = writeln!(out, "  return {}", outputs.join(", "));
    out.push_str("}\n");
    out
}

/// One node's line, without indentation.
pub(crate) fn node_line(g: &Graph, node: &NodeData) -> String {
    let results: Vec<String> = node
        .outputs
        .iter()
        .map(|&v| format!("%{}: {}", g.name(v), g.ty(v)))
        .collect();
    let mut line = format!("{} = {}", results.join(", "), node.op.mnemonic());
    if !node.op.is_source() {
        let operands: Vec<String> = node
            .inputs
            .iter()
            .map(|&v| format!("%{}", g.name(v)))
            .collect();
        let _ = write!(line, "({})", operands.join(", "));
    }
    let mut attrs: Vec<String> = node
        .op
        .attrs()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if let Some(acc) = node.acc {
        attrs.push(format!("acc={acc}"));
    }
    if !attrs.is_empty() {
        let _ = write!(line, " {{{}}}", attrs.join(", "));
    }
    if let Some(note) = &node.note {
        let _ = write!(line, "  # {}", note.replace('\n', " "));
    }
    line
}
