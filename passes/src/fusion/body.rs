//! The typed body of a pointwise unit, built from its members.

use super::groups::{group_inputs, group_outputs};
use castor_ir::{
    AmaxScale, Graph, IndexMap, Node, Op, PointwiseBody, Step, UnitAmax, UnitInput, UnitOutput,
    Value,
};
use std::collections::HashMap;

/// The body of the pointwise unit `members` (in node order): each input loaded once through
/// its index map, each member's op applied to F32 registers and rounded to the member's dtype
/// (so fused and unfused execution agree bit for bit), and the members read outside the unit
/// stored. A `quantize` ending the unit is its product by the scale, stored in FP8 (the store
/// rounds it), and the amax of the value it casts where something reads that amax; an
/// `fp8_scale` ending it is the scale of its operand's amax.
pub fn pointwise_body(g: &Graph, users: &[Vec<Node>], members: &[Node]) -> PointwiseBody {
    let inputs = group_inputs(g, members);
    let outputs = group_outputs(g, users, members);
    // The iteration space: the last member's shape (a scale ending the unit is a scalar).
    let dims = members
        .iter()
        .rev()
        .find(|&&m| !matches!(g.node(m).op, Op::Fp8Scale { .. }))
        .map(|&m| g.ty(g.node(m).outputs[0]).shape.dims().to_vec())
        .unwrap_or_default();
    let space = castor_ir::Shape::from(dims.clone());
    let mut steps = Vec::new();
    let mut amax = None;
    let mut reg: HashMap<Value, usize> = HashMap::new();
    for (k, &v) in inputs.iter().enumerate() {
        steps.push(Step::Load { input: k });
        reg.insert(v, k);
    }
    for &m in members {
        let node = g.node(m);
        let v = node.outputs[0];
        // Operands come from inputs or earlier members: both have registers.
        let r = |i: usize| {
            node.inputs
                .get(i)
                .and_then(|x| reg.get(x))
                .copied()
                .unwrap_or(0)
        };
        if let Op::Fp8Scale { to, margin } = node.op {
            amax = Some(UnitAmax {
                value: g.name(v).to_string(),
                step: r(0),
                scale: Some(AmaxScale { to, margin }),
            });
            continue;
        }
        if let Op::Quantize { .. } = node.op {
            let (x, scale) = (r(0), r(1));
            steps.push(Step::Quantize { x, scale });
            reg.insert(v, steps.len() - 1);
            let a = node.outputs[1];
            if !users[a.index()].is_empty() || g.outputs().contains(&a) {
                amax = Some(UnitAmax {
                    value: g.name(a).to_string(),
                    step: x,
                    scale: None,
                });
            }
            continue;
        }
        let op = match &node.op {
            Op::Unary(op) => Some(Step::Unary { op: *op, x: r(0) }),
            Op::UnaryGrad(op) => Some(Step::UnaryGrad {
                op: *op,
                x: r(0),
                dy: r(1),
            }),
            Op::Binary(op) => Some(Step::Binary {
                op: *op,
                a: r(0),
                b: r(1),
            }),
            Op::Scale { factor } => Some(Step::Scale {
                x: r(0),
                factor: *factor,
            }),
            // A float cast is only its rounding.
            _ => None,
        };
        let x = match op {
            Some(step) => {
                steps.push(step);
                steps.len() - 1
            }
            None => r(0),
        };
        steps.push(Step::Round {
            x,
            to: g.ty(v).dtype,
        });
        reg.insert(v, steps.len() - 1);
    }
    PointwiseBody {
        dims,
        inputs: inputs
            .iter()
            .map(|&v| UnitInput {
                value: g.name(v).to_string(),
                dtype: g.ty(v).dtype,
                index: IndexMap::of(&g.ty(v).shape, &space),
            })
            .collect(),
        steps,
        outputs: outputs
            .iter()
            .map(|&v| UnitOutput {
                value: g.name(v).to_string(),
                dtype: g.ty(v).dtype,
                step: reg.get(&v).copied().unwrap_or(0),
            })
            .collect(),
        amax,
    }
}
