//! The verifier: checks a graph's invariants and every op's typing rule.

use crate::{Graph, IrError, Node, Site, TensorType};
use petgraph::graph::DiGraph;

/// Checks, in order: operands refer to existing values; the node graph has no cycle (petgraph);
/// every operand is defined before its use; blocks are on non-source nodes and within the
/// model's layers; each node's result count and types follow its op's rule; graph outputs
/// exist. Returns the first error, located by node name and, for parsed
/// text, line and column.
pub fn verify(g: &Graph) -> Result<(), IrError> {
    let site = |n: Node| Site {
        node: g
            .node(n)
            .outputs
            .first()
            .map(|&v| g.name(v).to_string())
            .unwrap_or_else(|| n.to_string()),
        location: g.location(n),
    };
    let invalid = |n: Node, message: String| IrError::Invalid {
        site: site(n),
        message,
    };

    for (n, data) in g.nodes() {
        if let Some(v) = data.inputs.iter().find(|v| v.index() >= g.num_values()) {
            return Err(invalid(n, format!("operand {v} does not exist")));
        }
        if data.outputs.is_empty() {
            return Err(invalid(n, "node has no results".into()));
        }
    }

    // Cycles: an edge from each operand's producer to its user.
    let mut dg = DiGraph::<(), ()>::with_capacity(g.num_nodes(), g.num_values());
    for _ in 0..g.num_nodes() {
        dg.add_node(());
    }
    for (n, data) in g.nodes() {
        for &v in &data.inputs {
            let p = g.value(v).producer;
            dg.add_edge((p.index() as u32).into(), (n.index() as u32).into(), ());
        }
    }
    if let Err(cycle) = petgraph::algo::toposort(&dg, None) {
        let n = Node(cycle.node_id().index() as u32);
        return Err(IrError::Cycle { site: site(n) });
    }

    for (n, data) in g.nodes() {
        for &v in &data.inputs {
            let p = g.value(v).producer;
            if p >= n {
                return Err(invalid(
                    n,
                    format!("operand `%{}` is used before it is defined", g.name(v)),
                ));
            }
        }
        if let Some(b) = data.block {
            if data.op.is_source() {
                return Err(invalid(n, "sources belong to no block".into()));
            }
            if let Some(shape) = &g.shape {
                if b as usize >= shape.layers {
                    return Err(invalid(
                        n,
                        format!(
                            "block {b} is out of range for a {}-layer model",
                            shape.layers
                        ),
                    ));
                }
            }
        }
        let out_types: Vec<&TensorType> = data.outputs.iter().map(|&v| g.ty(v)).collect();
        if data.op.is_source() {
            if out_types.len() != 1 {
                return Err(invalid(
                    n,
                    format!("`{}` has exactly one result", data.op.mnemonic()),
                ));
            }
            if out_types[0].shape.numel().is_none() {
                return Err(invalid(
                    n,
                    format!("shape {} has too many elements", out_types[0].shape),
                ));
            }
            continue;
        }
        if data.acc == Some(crate::Accum::Tf32) && data.op.class() != crate::OpClass::Contraction {
            return Err(invalid(
                n,
                "tf32 accumulation is only for contractions".into(),
            ));
        }
        if matches!(data.op, crate::Op::ParamCopy { .. })
            && data
                .inputs
                .first()
                .is_some_and(|&v| g.node(g.value(v).producer).op != crate::Op::Param)
        {
            return Err(invalid(n, "`param_copy` must copy a `param`".into()));
        }
        let in_types: Vec<&TensorType> = data.inputs.iter().map(|&v| g.ty(v)).collect();
        let expected = data.op.infer(&in_types).map_err(|m| invalid(n, m))?;
        if expected.len() != out_types.len() {
            return Err(invalid(
                n,
                format!(
                    "`{}` has {} result(s), found {}",
                    data.op.mnemonic(),
                    expected.len(),
                    out_types.len()
                ),
            ));
        }
        for (i, (want, got)) in expected.iter().zip(&out_types).enumerate() {
            let dtype_ok = want.dtype == got.dtype
                || (data.op.output_dtype_is_free()
                    && want.dtype.is_float()
                    && got.dtype.is_float());
            if want.shape != got.shape || !dtype_ok {
                let which = if out_types.len() > 1 {
                    format!("result {i}")
                } else {
                    "result".into()
                };
                return Err(invalid(
                    n,
                    format!(
                        "{which} of `{}` should be {want}, found {got}",
                        data.op.mnemonic()
                    ),
                ));
            }
        }
    }

    if let Some(v) = g.outputs().iter().find(|v| v.index() >= g.num_values()) {
        return Err(IrError::Invalid {
            site: Site {
                node: "return".into(),
                location: None,
            },
            message: format!("graph output {v} does not exist"),
        });
    }
    Ok(())
}
