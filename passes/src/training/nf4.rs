//! `nf4`: under `--base nf4` (QLoRA), the frozen base's linear weights are stored in NF4
//! ([`castor_ir::nf4`]: 4-bit codes and one F32 absmax per block of 64) instead of the
//! compute dtype, and every product that reads one becomes `nf4_matmul`, which dequantizes the
//! weight for the product alone (the forward's `x W^T` and the backward's `dy W` alike).
//!
//! A weight qualifies when it is frozen base (not an adapter), a matrix, and read only as the
//! right operand of products (an embedding table, which a gather also reads, stays; so does a
//! tied output layer). The output head (read by the product marked `origin=head`) is left in
//! the compute dtype, as bitsandbytes and PEFT leave `lm_head`. A quantized weight's state
//! entry becomes two (`<name>.nf4_codes`, `<name>.nf4_absmax`), quantized from the checkpoint
//! when the state is initialized. The pass runs after the optimizer's, whose state it
//! rewrites, and before recomputation: no dequantized weight is a value of the graph, so none
//! is ever saved for the backward.

use super::{PlanBuild, PlanPass};
use crate::{PassError, PassReport};
use castor_ir::nf4::NF4_BLOCK;
use castor_ir::{
    thousands, Graph, LoraBase, Nf4Part, Op, Origin, StateInit, StateRole, StateSpec, Value,
};

pub(super) struct Nf4Base;

impl PlanPass for Nf4Base {
    fn name(&self) -> &'static str {
        "nf4"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let nf4 = build
            .plan
            .settings
            .lora
            .as_ref()
            .is_some_and(|l| l.base == LoraBase::Nf4);
        if !nf4 {
            return Ok(PassReport::new("the frozen base stays in its stored dtype"));
        }
        let g = &build.plan.micro_step;
        let frozen: Vec<&StateSpec> = build
            .plan
            .state
            .iter()
            .filter(|s| s.role == StateRole::Frozen)
            .collect();
        let weights = quantizable(g, &frozen);
        if weights.is_empty() {
            return Err(PassError::Training(
                "--base nf4: no frozen base weight is read only by products".into(),
            ));
        }
        let before: u64 = weights
            .iter()
            .map(|&w| g.ty(w).size_bytes().unwrap_or(0) as u64)
            .sum();
        let (graph, added) = rewrite(g, &weights)?;
        let after: u64 = weights
            .iter()
            .map(|&w| {
                let n = g.ty(w).shape.numel().unwrap_or(0);
                castor_ir::nf4::nf4_bytes(n, NF4_BLOCK) as u64
            })
            .sum();
        let names: Vec<String> = weights.iter().map(|&w| g.name(w).to_string()).collect();
        let mut state = Vec::with_capacity(build.plan.state.len() + names.len());
        for spec in build.plan.state.drain(..) {
            if !names.contains(&spec.name) {
                state.push(spec);
                continue;
            }
            let n = spec.ty.shape.numel().unwrap_or(0);
            for part in [Nf4Part::Codes, Nf4Part::Absmax] {
                state.push(StateSpec {
                    shard_of: None,
                    name: part.name(&spec.name),
                    ty: part.ty(n),
                    role: StateRole::Frozen,
                    init: StateInit::Nf4 {
                        tensor: spec.name.clone(),
                        part,
                    },
                });
            }
        }
        build.plan.state = state;
        build.plan.micro_step = graph;
        build.plan.forward_nodes += added;
        Ok(PassReport::new(format!(
            "{} base weight(s) in NF4 (blocks of {NF4_BLOCK}): {} bytes, from {} in their \
             stored dtype; their products dequantize them one at a time",
            names.len(),
            thousands(after),
            thousands(before)
        )))
    }
}

/// The frozen weights of `g` that every reader multiplies from the right.
fn quantizable(g: &Graph, frozen: &[&StateSpec]) -> Vec<Value> {
    let users = g.users();
    g.params()
        .filter(|&p| {
            let name = g.name(p);
            frozen.iter().any(|s| s.name == name)
                && g.ty(p).shape.rank() == 2
                && g.ty(p).dtype.is_float()
                && !users[p.index()].is_empty()
                && users[p.index()].iter().all(|&u| {
                    let node = g.node(u);
                    matches!(
                        node.op,
                        Op::MatMul {
                            transpose_a: false,
                            ..
                        }
                    ) && node.inputs[1] == p
                        && node.inputs[0] != p
                        // The output head stays in its stored dtype, as bitsandbytes leaves
                        // `lm_head` out of a 4-bit model.
                        && node.origin != Some(Origin::Head)
                })
        })
        .collect()
}

/// `g` with each of `weights` replaced by its codes and block maxima, and its products by
/// `nf4_matmul`; how many nodes the forward part gained (one parameter per weight).
fn rewrite(g: &Graph, weights: &[Value]) -> Result<(Graph, usize), PassError> {
    let ir = |e: castor_ir::IrError| PassError::Internal {
        pass: "nf4",
        message: e.to_string(),
    };
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    // Per weight: its codes and absmax parameters in `out`.
    let mut quantized: Vec<Option<(Value, Value)>> = vec![None; g.num_values()];
    let at = |map: &[Option<Value>], v: Value| {
        map[v.index()].ok_or_else(|| PassError::Internal {
            pass: "nf4",
            message: format!("`%{}` is used before it is defined", g.name(v)),
        })
    };
    for (n, node) in g.nodes() {
        if let (Op::Param, Some(&w)) = (&node.op, node.outputs.first()) {
            if weights.contains(&w) {
                let numel = g.ty(w).shape.numel().unwrap_or(0);
                let mut param = |part: Nf4Part| {
                    let made = out
                        .push_node(
                            Op::Param,
                            vec![],
                            vec![(part.name(g.name(w)), part.ty(numel))],
                        )
                        .map_err(ir)?;
                    Ok::<Value, PassError>(out.node(made).outputs[0])
                };
                quantized[w.index()] = Some((param(Nf4Part::Codes)?, param(Nf4Part::Absmax)?));
                continue;
            }
        }
        let weight = match node.op {
            Op::MatMul { .. } => quantized[node.inputs[1].index()],
            _ => None,
        };
        if let (Some((codes, absmax)), Op::MatMul { transpose_b, .. }) = (weight, &node.op) {
            let w = node.inputs[1];
            let d = g.ty(w).shape.dims();
            let y = node.outputs[0];
            let made = out
                .push_node(
                    Op::Nf4MatMul {
                        transpose_b: *transpose_b,
                        rows: d[0],
                        cols: d[1],
                    },
                    vec![at(&map, node.inputs[0])?, codes, absmax],
                    vec![(g.name(y).to_string(), g.ty(y).clone())],
                )
                .map_err(ir)?;
            out.set_block(made, node.block);
            out.set_acc(made, node.acc);
            map[y.index()] = Some(out.node(made).outputs[0]);
            continue;
        }
        let ins = node
            .inputs
            .iter()
            .map(|&v| at(&map, v))
            .collect::<Result<Vec<_>, _>>()?;
        let outs = node
            .outputs
            .iter()
            .map(|&v| (g.name(v).to_string(), g.ty(v).clone()))
            .collect();
        let copy = out.push_copy(g, n, ins, outs).map_err(ir)?;
        for (&old, &new) in node.outputs.iter().zip(&out.node(copy).outputs) {
            map[old.index()] = Some(new);
        }
    }
    let outputs = g
        .outputs()
        .iter()
        .map(|&v| at(&map, v))
        .collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(outputs);
    // Each weight's one parameter became two.
    Ok((out, weights.len()))
}
