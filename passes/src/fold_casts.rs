//! FoldCasts: removes casts that change nothing.
//!
//! A cast to the dtype its operand already has is the operand. A cast back to where a lossless
//! widening came from (F16 -> F32 -> F16, BF16 -> F32 -> BF16) is the original value. Two casts
//! of one value to one dtype are one cast. Casts that nothing reads any more are dropped.

use crate::autocast::fresh;
use crate::{Pass, PassError, PassReport};
use castor_ir::{verify, DType, Graph, Op, Value};
use std::collections::HashMap;

pub struct FoldCasts;

/// True if every `from` value is exactly representable in `to`.
fn lossless(from: DType, to: DType) -> bool {
    from == to || (to == DType::F32 && matches!(from, DType::F16 | DType::BF16))
}

impl Pass for FoldCasts {
    fn name(&self) -> &'static str {
        "fold_casts"
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        verify(g)?;
        // Old value -> the old value it is equal to.
        let mut same: Vec<Value> = (0..g.num_values() as u32).map(Value).collect();
        let (mut identities, mut round_trips, mut duplicates) = (0, 0, 0);
        let mut seen: HashMap<(Value, DType), Value> = HashMap::new();
        for (_, node) in g.nodes() {
            let Op::Cast { to } = node.op else { continue };
            let x = same[node.inputs[0].index()];
            let out = node.outputs[0];
            if g.ty(x).dtype == to {
                same[out.index()] = x;
                identities += 1;
                continue;
            }
            let producer = g.node(g.value(x).producer);
            if let Op::Cast { .. } = producer.op {
                let y = same[producer.inputs[0].index()];
                if g.ty(y).dtype == to && lossless(to, g.ty(x).dtype) {
                    same[out.index()] = y;
                    round_trips += 1;
                    continue;
                }
            }
            match seen.get(&(x, to)) {
                Some(&first) => {
                    same[out.index()] = first;
                    duplicates += 1;
                }
                None => {
                    seen.insert((x, to), out);
                }
            }
        }

        // Liveness, backwards: a cast lives if a live node or a graph output reads it.
        let mut live_value = vec![false; g.num_values()];
        for &v in g.outputs() {
            live_value[same[v.index()].index()] = true;
        }
        let mut live_node = vec![false; g.num_nodes()];
        for (n, node) in g.nodes().collect::<Vec<_>>().into_iter().rev() {
            let is_cast = matches!(node.op, Op::Cast { .. });
            let replaced = is_cast && same[node.outputs[0].index()] != node.outputs[0];
            let live =
                !replaced && (!is_cast || node.outputs.iter().any(|v| live_value[v.index()]));
            if live {
                live_node[n.index()] = true;
                for &v in &node.inputs {
                    live_value[same[v.index()].index()] = true;
                }
            }
        }

        let mut out = Graph::empty_like(g);
        let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
        let mut dead = 0;
        for (n, node) in g.nodes() {
            if !live_node[n.index()] {
                if matches!(node.op, Op::Cast { .. })
                    && same[node.outputs[0].index()] == node.outputs[0]
                {
                    dead += 1;
                }
                continue;
            }
            let inputs = node
                .inputs
                .iter()
                .map(|&v| emitted(&map, same[v.index()], g))
                .collect::<Result<Vec<_>, _>>()?;
            let results = node
                .outputs
                .iter()
                .map(|&v| (fresh(&out, g.name(v)), g.ty(v).clone()))
                .collect();
            let new = out.push_copy(g, n, inputs, results)?;
            for (i, &v) in node.outputs.iter().enumerate() {
                map[v.index()] = Some(out.node(new).outputs[i]);
            }
        }
        let outputs = g
            .outputs()
            .iter()
            .map(|&v| emitted(&map, same[v.index()], g))
            .collect::<Result<Vec<_>, _>>()?;
        out.set_outputs(outputs);
        let total = identities + round_trips + duplicates + dead;
        let report = PassReport::new(format!(
            "folded {total} cast(s): {identities} identity, {round_trips} lossless round trip(s), {duplicates} duplicate(s), {dead} unused"
        ));
        Ok((out, report))
    }
}

/// The new value for old value `v`, which liveness guarantees was emitted.
fn emitted(map: &[Option<Value>], v: Value, g: &Graph) -> Result<Value, PassError> {
    map[v.index()].ok_or_else(|| PassError::Internal {
        pass: "fold_casts",
        message: format!("%{} is read but was not emitted", g.name(v)),
    })
}
