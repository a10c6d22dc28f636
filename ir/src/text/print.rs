use crate::{Attr, Graph, NodeData};
use std::fmt::Write;

/// Prints a graph in the text format.
pub fn print(g: &Graph) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "graph {} {{", g.name);
    if let Some(shape) = &g.shape {
        let _ = writeln!(out, "  model {{{}}}", attr_list(&shape.attrs()));
    }
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
    let mut attrs = node.op.attrs();
    if let Some(acc) = node.acc {
        attrs.push(("acc", Attr::Ident(acc.to_string())));
    }
    if let Some(block) = node.block {
        attrs.push(("block", Attr::Int(i64::from(block))));
    }
    if let Some(origin) = node.origin {
        attrs.push(("origin", Attr::Ident(origin.name().into())));
    }
    if !attrs.is_empty() {
        let _ = write!(line, " {{{}}}", attr_list(&attrs));
    }
    if let Some(note) = &node.note {
        let _ = write!(line, "  # {}", note.replace('\n', " "));
    }
    line
}

/// `key=value, key=value`.
fn attr_list(attrs: &[(&str, Attr)]) -> String {
    let items: Vec<String> = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    items.join(", ")
}
