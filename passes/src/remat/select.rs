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
