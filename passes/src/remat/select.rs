//! The named modes' recompute sets, chosen from the blocks the front end recorded.

use super::Forward;
use castor_ir::{Graph, Op, OpClass};

/// `full`: every eligible node.
pub(super) fn select_full(f: &Forward) -> Vec<bool> {
    f.eligible.clone()
}

/// `selective`: attention scores chains and cheap ops.
pub(super) fn select_selective(g: &Graph, f: &Forward) -> Vec<bool> {
    let mut r = vec![false; f.n];
    for (node, d) in g.nodes().take(f.n) {
        let i = node.index();
        if !f.eligible[i] {
            continue;
        }
        match d.op.class() {
            // A sum of two products (a LoRA adapter's beside its base product) would keep
            // both products to recompute one sum: twice the bytes, so it is kept instead.
            OpClass::Elementwise if sum_of_products(g, d) => {}
            OpClass::Elementwise | OpClass::Layout => r[i] = true,
            _ => {}
        }
        if matches!(d.op, Op::Softmax { .. }) {
            r[i] = true;
            // Back through the pointwise ops to the scores product.
            let mut v = d.inputs[0];
            loop {
                let p = g.value(v).producer;
                let pi = p.index();
                if pi >= f.n || !f.eligible[pi] || f.block[pi] != f.block[i] {
                    break;
                }
                let pd = g.node(p);
                r[pi] = true;
                if pd.op.class() == OpClass::Contraction {
                    break;
                }
                if !matches!(pd.op.class(), OpClass::Elementwise | OpClass::Layout) {
                    break;
                }
                v = pd.inputs[0];
            }
        }
    }
    r
}

/// `add(a, b)` where both operands are products (directly, or through a scale).
fn sum_of_products(g: &Graph, d: &castor_ir::NodeData) -> bool {
    let product = |v: castor_ir::Value| {
        let mut p = g.node(g.value(v).producer);
        if matches!(p.op, Op::Scale { .. }) {
            p = g.node(g.value(p.inputs[0]).producer);
        }
        p.op.class() == OpClass::Contraction
    };
    d.op == Op::Binary(castor_ir::BinaryOp::Add) && d.inputs.iter().all(|&v| product(v))
}
