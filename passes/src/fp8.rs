//! `fp8`: under `--precision fp8`, the products of the transformer layers take FP8 operands.
//!
//! After autocast has made the graph BF16 (the `fp8` policy is the `bf16` policy for
//! everything else), each product of a layer's activation by a layer's weight, `x W` or
//! `x Wᵀ`, becomes the recipe of torchao's float8 training with tensorwise current scaling:
//!
//! ```text
//! x_scale = fp8_scale(x)            W_scale = fp8_scale(W)       to=f8e4m3
//! x_fp8   = quantize(x, x_scale)    W_fp8   = quantize(W, W_scale)
//! y       = fp8_matmul(x_fp8, W_fp8, x_scale, W_scale)   (BF16, or F32 as before)
//! ```
//!
//! The weight is quantized from its F32 master, not from its BF16 copy (one rounding, as
//! torchao casts the high-precision weight); a BF16 copy no other node reads is dropped. In a
//! training plan the `fp8_weights` pass moves the weights' casts into the optimizer step, after
//! each update, so the micro step reads FP8 copies kept as state. An
//! activation that several products read (the attention's q, k and v; the gated MLP's gate
//! and up) is cast once, named after its first product, and its cast is shared: the same
//! values as one cast per product. In the backward (the autodiff pass), the output gradient is
//! cast to E5M2 with its own scale and both gradient products run on FP8 operands too.
//!
//! Under `fp8:delayed` (Transformer Engine's delayed scaling) the activation's scale is state
//! rather than `fp8_scale(x)`: the cast's amax enters an amax history (`amax_history`), whose
//! largest amax gives the next cast's scale; the `fp8_scaling` plan pass makes both state
//! entries and writes them back. The weights keep their current scale.
//!
//! Kept in BF16, with the reason in the node's note (`--explain`): products that read no
//! weight (the attention's), the embedding, the LM head and classifier heads (products outside
//! the layers), the first and last layer under `--fp8-skip-first-last`, products matched by
//! `--keep-bf16`, and products whose inner or output dimension is not a multiple of 16, which
//! cuBLASLt's FP8 products require.

use crate::policy::Fp8Options;
use crate::{Pass, PassError, PassReport};
use castor_ir::{Accum, DType, Graph, Node, Op, Value};
use wildmatch::WildMatch;

/// cuBLASLt's FP8 products need the inner and output dimensions to be multiples of 16.
const FP8_DIM_MULTIPLE: usize = 16;

/// The forward operands' format (the backward's gradients take E5M2).
const FORWARD_FORMAT: DType = DType::F8E4M3;

pub struct Fp8Products {
    options: Fp8Options,
    /// `fp8:delayed`: the activations' casts read their scales from amax histories.
    delayed: bool,
}

impl Fp8Products {
    pub fn new(options: Fp8Options, delayed: bool) -> Self {
        Fp8Products { options, delayed }
    }
}

/// What the pass decided about one product by a weight.
enum Decision {
    /// FP8 operands: the weight parameter (F32 master).
    Fp8 { weight: Value },
    /// Stays BF16, for this reason.
    Keep(String),
}

impl Pass for Fp8Products {
    fn name(&self) -> &'static str {
        "fp8"
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        castor_ir::verify(g)?;
        let globs: Vec<WildMatch> = self
            .options
            .keep_bf16
            .iter()
            .map(|p| WildMatch::new(p))
            .collect();
        let mut matched = vec![false; globs.len()];
        let last_block = g.nodes().filter_map(|(_, n)| n.block).max();
        let decisions: Vec<Option<Decision>> = g
            .nodes()
            .map(|(_, node)| self.decide(g, node, last_block, &globs, &mut matched))
            .collect();
        if let Some(i) = matched.iter().position(|m| !m) {
            return Err(PassError::Policy {
                source_name: "--keep-bf16".into(),
                message: format!(
                    "'{}' matches no product by a weight (a product's name, or its weight's)",
                    self.options.keep_bf16[i]
                ),
            });
        }
        let fp8 = decisions
            .iter()
            .filter(|d| matches!(d, Some(Decision::Fp8 { .. })))
            .count();
        let kept = decisions
            .iter()
            .filter(|d| matches!(d, Some(Decision::Keep(_))))
            .count();
        let history = self.delayed.then(|| self.options.history());
        let out = rewrite(g, &decisions, history)?;
        let scaling = match history {
            Some(h) => format!(
                "delayed scales of the activations and gradients from amax histories of {h}, \
                 tensorwise current scales of the weights"
            ),
            None => "tensorwise current scales".to_string(),
        };
        let mut report = PassReport::new(format!(
            "{fp8} product(s) by a weight on FP8 operands (E4M3 forward, E5M2 gradients, \
             {scaling}), {kept} kept in BF16"
        ));
        report.details = g
            .nodes()
            .zip(&decisions)
            .filter_map(|((_, n), d)| match d {
                Some(Decision::Keep(why)) => Some(format!("{}: {why}", g.name(n.outputs[0]))),
                _ => None,
            })
            .collect();
        Ok((out, report))
    }
}

impl Fp8Products {
    /// The decision for a product by a weight; `None` for every other node.
    fn decide(
        &self,
        g: &Graph,
        node: &castor_ir::NodeData,
        last_block: Option<u32>,
        globs: &[WildMatch],
        matched: &mut [bool],
    ) -> Option<Decision> {
        let Op::MatMul {
            transpose_a: false,
            transpose_b,
        } = node.op
        else {
            return None;
        };
        // The weight: a BF16 working copy of an F32 matrix parameter, as the right operand.
        let copy = g.node(g.value(node.inputs[1]).producer);
        let Op::ParamCopy { to: DType::BF16 } = copy.op else {
            return None;
        };
        let weight = copy.inputs[0];
        if g.ty(weight).shape.rank() != 2 || g.ty(node.inputs[0]).dtype != DType::BF16 {
            return None;
        }
        let name = g.name(node.outputs[0]);
        let mut keep = None;
        for (i, glob) in globs.iter().enumerate() {
            if glob.matches(name) || glob.matches(g.name(weight)) {
                matched[i] = true;
                keep.get_or_insert_with(|| {
                    format!(
                        "--keep-bf16 '{}' keeps it in BF16",
                        self.options.keep_bf16[i]
                    )
                });
            }
        }
        if let Some(why) = keep {
            return Some(Decision::Keep(why));
        }
        let Some(block) = node.block else {
            return Some(Decision::Keep(
                "outside the transformer layers (embedding, LM head or classifier): BF16, as \
                 the FP8 recipes keep it"
                    .into(),
            ));
        };
        if self.options.skip_first_last && (block == 0 || Some(block) == last_block) {
            return Some(Decision::Keep(format!(
                "layer {block} is the {} layer: BF16 under --fp8-skip-first-last",
                if block == 0 { "first" } else { "last" }
            )));
        }
        let w = g.ty(weight).shape.dims();
        let (k, n) = if transpose_b {
            (w[1], w[0])
        } else {
            (w[0], w[1])
        };
        if !k.is_multiple_of(FP8_DIM_MULTIPLE) || !n.is_multiple_of(FP8_DIM_MULTIPLE) {
            return Some(Decision::Keep(format!(
                "{k} x {n} weight: cuBLASLt's FP8 products need both dimensions to be \
                 multiples of {FP8_DIM_MULTIPLE}"
            )));
        }
        Some(Decision::Fp8 { weight })
    }
}

/// The graph with every FP8 decision carried out and every kept product's reason noted;
/// `history`: the activations' amax history length under delayed scaling.
fn rewrite(
    g: &Graph,
    decisions: &[Option<Decision>],
    history: Option<usize>,
) -> Result<Graph, PassError> {
    // A BF16 weight copy that only FP8 products read is no longer needed.
    let users = g.users();
    let rewritten = |n: Node| matches!(decisions[n.index()], Some(Decision::Fp8 { .. }));
    let dead_copy = |v: Value| {
        matches!(g.node(g.value(v).producer).op, Op::ParamCopy { .. })
            && !users[v.index()].is_empty()
            && users[v.index()].iter().all(|&u| rewritten(u))
            && !g.outputs().contains(&v)
    };
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    // Each activation's FP8 cast and scale, made for the first product that reads it.
    let mut shared: std::collections::HashMap<Value, (Value, Value)> = Default::default();
    let at = |map: &[Option<Value>], v: Value| {
        map[v.index()].ok_or_else(|| PassError::Internal {
            pass: "fp8",
            message: format!("`%{}` is used before it is defined", g.name(v)),
        })
    };
    for (n, node) in g.nodes() {
        if node.outputs.iter().all(|&v| dead_copy(v)) {
            continue;
        }
        match &decisions[n.index()] {
            Some(Decision::Fp8 { weight }) => {
                let Op::MatMul {
                    transpose_a,
                    transpose_b,
                } = node.op
                else {
                    return Err(PassError::Internal {
                        pass: "fp8",
                        message: "an FP8 decision on a node that is no product".into(),
                    });
                };
                let y = node.outputs[0];
                let name = g.name(y);
                // Products that read one activation (q, k and v; gate and up) share its cast.
                let x = node.inputs[0];
                let (xq, xs) = match shared.get(&x) {
                    Some(&cast) => cast,
                    None => {
                        let cast = match history {
                            Some(h) => delayed_cast(&mut out, at(&map, x)?, name, h, node)?,
                            None => current_cast(&mut out, at(&map, x)?, name, "x", node)?,
                        };
                        *shared.entry(x).or_insert(cast)
                    }
                };
                let (wq, ws) = current_cast(&mut out, at(&map, *weight)?, name, "w", node)?;
                let made = out
                    .push_node(
                        Op::Fp8MatMul {
                            transpose_a,
                            transpose_b,
                        },
                        vec![xq, wq, xs, ws],
                        vec![(name.to_string(), g.ty(y).clone())],
                    )
                    .map_err(ir)?;
                out.set_block(made, node.block);
                out.set_acc(made, Some(Accum::F32));
                out.set_origin(made, node.origin);
                out.set_note(
                    made,
                    Some(format!(
                        "fp8: a layer's product by a weight: E4M3 operands with {} scales, F32 \
                         accumulation, {} result (E5M2 gradients in the backward)",
                        if history.is_some() {
                            "delayed (activation) and tensorwise (weight)"
                        } else {
                            "tensorwise"
                        },
                        g.ty(y).dtype
                    )),
                );
                map[y.index()] = Some(out.node(made).outputs[0]);
            }
            decision => {
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
                if let Some(Decision::Keep(why)) = decision {
                    let note = match &node.note {
                        Some(before) => format!("{before}; {why}"),
                        None => why.clone(),
                    };
                    out.set_note(copy, Some(note));
                }
                for (&old, &new) in node.outputs.iter().zip(&out.node(copy).outputs) {
                    map[old.index()] = Some(new);
                }
            }
        }
    }
    let outputs = g
        .outputs()
        .iter()
        .map(|&v| at(&map, v))
        .collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(outputs);
    Ok(out)
}

fn ir(e: castor_ir::IrError) -> PassError {
    PassError::Internal {
        pass: "fp8",
        message: e.to_string(),
    }
}

/// The cast of `operand` (the `role` operand of product `name`) to E4M3 with its tensorwise
/// current scale: `(q, scale)`.
fn current_cast(
    out: &mut Graph,
    operand: Value,
    name: &str,
    role: &str,
    product: &castor_ir::NodeData,
) -> Result<(Value, Value), PassError> {
    let scale = out
        .push_node(
            Op::Fp8Scale {
                to: FORWARD_FORMAT,
                margin: 0,
            },
            vec![operand],
            vec![(format!("{name}.{role}_scale"), scalar_f32())],
        )
        .map_err(ir)?;
    out.set_block(scale, product.block);
    out.set_acc(scale, Some(Accum::F32));
    out.set_note(
        scale,
        Some(format!(
            "fp8: the tensorwise scale of %{name}'s {role} operand, this step: 448 / amax"
        )),
    );
    let scale = out.node(scale).outputs[0];
    let q = quantize(out, operand, scale, name, role, product)?;
    Ok((q, scale))
}

/// The cast of product `name`'s activation operand to E4M3 under delayed scaling: the scale
/// and the amax history are state, the cast's amax enters the history, and the history gives
/// the scale of the next cast (`amax_history`, whose results the plan writes back).
fn delayed_cast(
    out: &mut Graph,
    operand: Value,
    name: &str,
    history: usize,
    product: &castor_ir::NodeData,
) -> Result<(Value, Value), PassError> {
    let state = |out: &mut Graph, n: String, ty: castor_ir::TensorType| {
        let node = out
            .push_node(Op::State, vec![], vec![(n, ty)])
            .map_err(ir)?;
        Ok::<Value, PassError>(out.node(node).outputs[0])
    };
    let scale = state(out, format!("{name}.x_scale"), scalar_f32())?;
    let past = state(
        out,
        format!("{name}.x_amax_history"),
        castor_ir::TensorType::new(DType::F32, castor_ir::Shape(vec![history])),
    )?;
    let q = quantize(out, operand, scale, name, "x", product)?;
    let amax = out.node(out.value(q).producer).outputs[1];
    record_amax(out, past, scale, amax, FORWARD_FORMAT, product.block)?;
    Ok((q, scale))
}

/// `amax_history(past, scale, amax)`: the next history and scale, named after the state
/// entries they replace (`<entry>.next`), which the training plan writes back (the autodiff
/// pass does the same for the gradients' casts).
fn record_amax(
    out: &mut Graph,
    past: Value,
    scale: Value,
    amax: Value,
    to: DType,
    block: Option<u32>,
) -> Result<(), PassError> {
    let (h, s) = (out.name(past).to_string(), out.name(scale).to_string());
    let node = out
        .push_node(
            Op::AmaxHistory { to, margin: 0 },
            vec![past, scale, amax],
            vec![
                (format!("{h}.next"), out.ty(past).clone()),
                (format!("{s}.next"), scalar_f32()),
            ],
        )
        .map_err(ir)?;
    out.set_block(node, block);
    out.set_acc(node, Some(Accum::F32));
    out.set_note(
        node,
        Some(format!(
            "fp8 delayed scaling: %{} enters %{h}, whose largest amax gives the next cast's \
             scale ({} / amax)",
            out.name(amax),
            castor_ir::fp8::Fp8Format::of(to).map_or(0.0, |f| f.max())
        )),
    );
    Ok(())
}

/// The saturating cast of `operand` to E4M3 by `scale`: `q` (its amax is the node's second
/// result).
fn quantize(
    out: &mut Graph,
    operand: Value,
    scale: Value,
    name: &str,
    role: &str,
    product: &castor_ir::NodeData,
) -> Result<Value, PassError> {
    let shape = out.ty(operand).shape.clone();
    let q = out
        .push_node(
            Op::Quantize { to: FORWARD_FORMAT },
            vec![operand, scale],
            vec![
                (
                    format!("{name}.{role}_fp8"),
                    castor_ir::TensorType::new(FORWARD_FORMAT, shape),
                ),
                (format!("{name}.{role}_amax"), scalar_f32()),
            ],
        )
        .map_err(ir)?;
    out.set_block(q, product.block);
    let shared = if role == "x" {
        "; the other products that read this activation share it"
    } else {
        ""
    };
    out.set_note(
        q,
        Some(format!(
            "fp8: %{name}'s {role} operand times its scale, rounded to E4M3 (nearest even, \
             saturating at 448){shared}"
        )),
    );
    Ok(out.node(q).outputs[0])
}

fn scalar_f32() -> castor_ir::TensorType {
    castor_ir::TensorType::new(DType::F32, castor_ir::Shape(vec![]))
}
