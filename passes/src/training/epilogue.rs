//! `epilogue`: under `--epilogues fused`, the work that follows a product by a weight runs in
//! the product's accumulator, as cuBLASLt's epilogues do it, instead of as separate passes
//! over memory:
//!
//! - `add(matmul(x, W), bias)` becomes `matmul_bias(x, W, bias)` (cuBLASLt `BIAS`);
//! - followed by `gelu_tanh`, `matmul_bias_gelu(x, W, bias)` with both the pre-activation
//!   (which the backward reads) and the activation as results (`GELU_AUX_BIAS`);
//! - in the backward, `gelu_tanh_grad(pre, matmul(dy, W^T))` becomes
//!   `matmul_gelu_grad(dy, W, pre)` (`DGELU`);
//! - every bias gradient, `sum(dy)` over the rows, joins the weight gradient's product that
//!   reads the same `dy` as rows: `matmul_bias_grad(x, dy)` (`BGRADA`/`BGRADB`). The GELU
//!   gradient's bias gradient too: cuBLASLt's `DGELU_BGRAD` would write it in the product's
//!   type (BF16 under the bf16 policy), and bias gradients are F32.
//!
//! - a `scale` of a product joins the product as cuBLAS's `alpha`: the eager attention's
//!   `scale(q kᵀ)` becomes `matmul_scaled(q, k)`, and in the backward the scaled gradient of
//!   the scores, read only by the two products that give dq and dk, is scaled inside each of
//!   them instead (`matmul_scaled(dS, k)`, `matmul_scaled(dSᵀ, q)`), so no pass over the
//!   `[.., T, S]` scores remains. In F32 a scale folds only when it is a power of two, which
//!   keeps the F32 plans bit-identical; in 16-bit it always folds (one rounding instead of
//!   two, as SDPA scales inside its kernel).
//!
//! - in the forward, `add(p, c)` where `p` is a product (or the scale of one) and the add is
//!   the only reader of both becomes `matmul_add(x, W, c)`: the product adds into `c` in its
//!   accumulator (cuBLAS's `beta = 1`, written in place of `c`), as a LoRA adapter's product
//!   joins its base product's result, instead of a pass that reads both and writes their
//!   sum. The backward's sums of input gradients stay one pointwise kernel
//!   (each product written once, then read once by it), which saves as much as a chain of
//!   adding products would.
//!
//! The same fusions are made under every `--remat` mode, so recomputation never changes the
//! arithmetic: a fused forward GELU is a product's result, which selective recomputation
//! keeps (as it keeps products) instead of recomputing it from the pre-activation.
//!
//! Each fused result is rounded once, from the F32 accumulator, where the separate ops round
//! the product and then the sum: PyTorch's `addmm` (every `nn.Linear` and GPT-2 `Conv1D`)
//! rounds once too. In F32 plans the results are bit-identical to the separate ops. The pass
//! runs right after `autodiff` because its backward pattern is the VJP's; it fuses a product
//! only when the product is read by nothing else, by weights (a 2-D right operand, a left
//! operand not transposed, so one cuBLASLt call covers every row), and keeps every dtype the
//! precision passes chose (a product, its bias and the sum all of one dtype).

use super::{set_mapped_outputs, PlanBuild, PlanPass};
use crate::{PassError, PassReport};
use castor_ir::{BinaryOp, Epilogues, Graph, Node, Op, ReduceOp, UnaryOp, Value};
use std::collections::HashSet;

pub(super) struct FuseEpilogues;

impl PlanPass for FuseEpilogues {
    fn name(&self) -> &'static str {
        "epilogue"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        if build.plan.settings.epilogues == Epilogues::Eager {
            return Ok(PassReport::new(
                "eager: bias adds, GELUs and bias gradients run as their own kernels",
            ));
        }
        let g = &build.plan.micro_step;
        // Under `--base nf4` the frozen base's products become `nf4_matmul` (the `nf4` pass,
        // later), which has no epilogue: they stay plain products here.
        let nf4 = build
            .plan
            .settings
            .lora
            .as_ref()
            .is_some_and(|l| l.base == castor_ir::LoraBase::Nf4);
        let plain: HashSet<String> = match nf4 {
            true => build
                .params
                .iter()
                .filter(|&&p| !build.is_trained(p))
                .map(|&p| build.forward.name(p).to_string())
                .collect(),
            false => HashSet::new(),
        };
        let fusions = find(g, &plain, build.plan.forward_nodes);
        let (graph, forward_nodes) = rewrite(g, &fusions, build.plan.forward_nodes)?;
        build.plan.micro_step = graph;
        build.plan.forward_nodes = forward_nodes;
        let count = |f: fn(&Fusion) -> bool| fusions.iter().filter(|x| f(x)).count();
        Ok(PassReport::new(format!(
            "{} bias add(s), {} bias + GELU(s), {} GELU gradient(s), {} bias gradient(s), {} \
             addition(s) and {} scale(s) fused into their products' epilogues (one rounding each)",
            count(|f| matches!(f, Fusion::Bias { gelu: None, .. })),
            count(|f| matches!(f, Fusion::Bias { gelu: Some(_), .. })),
            count(|f| matches!(f, Fusion::GeluGrad { .. })),
            count(|f| matches!(f, Fusion::BiasGrad { .. })),
            count(|f| matches!(f, Fusion::Accumulate { .. })),
            fusions
                .iter()
                .filter_map(|f| match *f {
                    Fusion::ScaledProduct { scale, .. } | Fusion::ScaledOperand { scale, .. } => {
                        Some(scale)
                    }
                    Fusion::Accumulate { scale, .. } => scale,
                    _ => None,
                })
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
        )))
    }
}

/// One product and the nodes its epilogue absorbs.
enum Fusion {
    /// `add(matmul, bias)` at node `add`, optionally followed by `gelu_tanh` at `gelu`.
    Bias {
        matmul: Node,
        add: Node,
        bias: Value,
        gelu: Option<Node>,
    },
    /// `gelu_tanh_grad(pre, matmul)` at node `grad`.
    GeluGrad { matmul: Node, grad: Node },
    /// `sum(dy)` over the rows at node `sum`, and the weight gradient `matmul` whose operand
    /// (`lhs` or not) holds the same `dy` as rows.
    BiasGrad { matmul: Node, sum: Node, lhs: bool },
    /// `scale(matmul)` at node `scale`: the product scaled in its accumulator.
    ScaledProduct {
        matmul: Node,
        scale: Node,
        alpha: f64,
    },
    /// A `matmul` that reads the result of `scale` (whose every reader is a product, or a
    /// reshape that only products read): the product reads the scale's input and scales in
    /// its accumulator.
    ScaledOperand {
        matmul: Node,
        scale: Node,
        alpha: f64,
    },
    /// `add(p, addend)` at node `add`, `p` the result of `matmul` (or of its `scale` by
    /// `alpha`): the product adds into the addend.
    Accumulate {
        matmul: Node,
        scale: Option<Node>,
        add: Node,
        addend: Value,
        alpha: f64,
    },
}

impl Fusion {
    /// Where the fused node goes: every operand is defined before it and every result is
    /// read after it.
    fn at(&self) -> Node {
        match *self {
            Fusion::Bias { add, .. } => add,
            Fusion::GeluGrad { grad, .. } => grad,
            Fusion::BiasGrad { matmul, .. } => matmul,
            Fusion::ScaledProduct { scale, .. } => scale,
            Fusion::ScaledOperand { matmul, .. } => matmul,
            Fusion::Accumulate { add, .. } => add,
        }
    }

    fn absorbed(&self) -> Vec<Node> {
        match *self {
            Fusion::Bias {
                matmul, add, gelu, ..
            } => [Some(matmul), Some(add), gelu]
                .into_iter()
                .flatten()
                .collect(),
            Fusion::GeluGrad { matmul, grad } => vec![matmul, grad],
            Fusion::BiasGrad { matmul, sum, .. } => vec![matmul, sum],
            Fusion::ScaledProduct { matmul, scale, .. }
            | Fusion::ScaledOperand { matmul, scale, .. } => vec![matmul, scale],
            Fusion::Accumulate {
                matmul, scale, add, ..
            } => [Some(matmul), scale, Some(add)]
                .into_iter()
                .flatten()
                .collect(),
        }
    }
}

/// A product by a weight whose one reader is `reader`: `(lhs, weight)` and its transposes;
/// none when the weight is one of `plain` (parameters whose products keep no epilogue).
fn weight_product(
    g: &Graph,
    users: &[Vec<Node>],
    v: Value,
    reader: Node,
    plain: &HashSet<String>,
) -> Option<Node> {
    let m = g.value(v).producer;
    let Op::MatMul {
        transpose_a: false, ..
    } = g.node(m).op
    else {
        return None;
    };
    let weight = g.node(m).inputs[1];
    let only_read_here = users[v.index()] == [reader] && !g.outputs().contains(&v);
    (only_read_here && g.ty(weight).shape.rank() == 2 && !plain.contains(g.name(weight)))
        .then_some(m)
}

/// The fusions in `g`, whose first `forward_nodes` nodes are the forward.
fn find(g: &Graph, plain: &HashSet<String>, forward_nodes: usize) -> Vec<Fusion> {
    let users = g.users();
    let mut found = Vec::new();
    for (n, node) in g.nodes() {
        match node.op {
            Op::Binary(BinaryOp::Add) => {
                let y = node.outputs[0];
                let dt = g.ty(y).dtype;
                let width = *g.ty(y).shape.dims().last().unwrap_or(&0);
                let is_bias = |v: Value| g.ty(v).dtype == dt && g.ty(v).shape.dims() == [width];
                let (m, bias) = match (node.inputs[0], node.inputs[1]) {
                    (p, b) if is_bias(b) => (weight_product(g, &users, p, n, plain), b),
                    (b, p) if is_bias(b) => (weight_product(g, &users, p, n, plain), b),
                    _ => {
                        if n.index() < forward_nodes {
                            found.extend(accumulate_fusion(g, &users, n, plain));
                        }
                        continue;
                    }
                };
                let Some(matmul) = m else { continue };
                if g.ty(g.node(matmul).outputs[0]) != g.ty(y) {
                    continue;
                }
                let gelu = users[y.index()].iter().copied().find(|&r| {
                    g.node(r).op == Op::Unary(UnaryOp::GeluTanh)
                        && g.ty(g.node(r).outputs[0]) == g.ty(y)
                });
                found.push(Fusion::Bias {
                    matmul,
                    add: n,
                    bias,
                    gelu,
                });
            }
            Op::UnaryGrad(UnaryOp::GeluTanh) => {
                let (pre, d, out) = (node.inputs[0], node.inputs[1], node.outputs[0]);
                let Some(matmul) = weight_product(g, &users, d, n, plain) else {
                    continue;
                };
                if g.ty(d) == g.ty(pre) && g.ty(out) == g.ty(pre) {
                    found.push(Fusion::GeluGrad { matmul, grad: n });
                }
            }
            Op::Reduce {
                op: ReduceOp::Sum,
                ref axes,
                keepdim: false,
            } => {
                if let Some((matmul, lhs)) = weight_gradient_of(g, &users, n, axes) {
                    found.push(Fusion::BiasGrad {
                        matmul,
                        sum: n,
                        lhs,
                    });
                }
            }
            _ => {}
        }
    }
    let mut taken: HashSet<Node> = found
        .iter()
        .flat_map(|f| match *f {
            Fusion::Bias { matmul, .. }
            | Fusion::GeluGrad { matmul, .. }
            | Fusion::BiasGrad { matmul, .. }
            | Fusion::Accumulate { matmul, .. } => Some(matmul),
            _ => None,
        })
        .collect();
    for (n, node) in g.nodes() {
        let Op::Scale { factor } = node.op else {
            continue;
        };
        let group = scale_fusions(g, &users, n, factor);
        let products: Vec<Node> = group
            .iter()
            .map(|f| match *f {
                Fusion::ScaledProduct { matmul, .. } | Fusion::ScaledOperand { matmul, .. } => {
                    matmul
                }
                _ => unreachable!("scale_fusions gives scale fusions"),
            })
            .collect();
        // A product takes part in one fusion, and a scale's group fuses whole or not at all:
        // the scale is gone only when every product that reads it scales instead.
        if products.iter().any(|m| taken.contains(m)) {
            continue;
        }
        taken.extend(products);
        found.extend(group);
    }
    found
}

/// The fusion of `add` (a node of the forward) as a product adding into its other operand:
/// the second operand's product where both are products (a LoRA adapter's, added to its base
/// product's result), else the first's; none unless the add alone reads both operands, one
/// of them a product's, or when the operands and the sum differ in type (a broadcast).
fn accumulate_fusion(
    g: &Graph,
    users: &[Vec<Node>],
    add: Node,
    plain: &HashSet<String>,
) -> Option<Fusion> {
    let node = g.node(add);
    let (x0, x1, y) = (node.inputs[0], node.inputs[1], node.outputs[0]);
    if x0 == x1 || g.ty(x0) != g.ty(y) || g.ty(x1) != g.ty(y) {
        return None;
    }
    // The product writes its sum over the addend, so the addend must be read by nothing else
    // (a residual stream that a norm and the backward read too keeps its add, which the
    // norm's kernel absorbs).
    let only_here = |v: Value| users[v.index()] == [add] && !g.outputs().contains(&v);
    [(x1, x0), (x0, x1)].into_iter().find_map(|(p, addend)| {
        if !only_here(addend) {
            return None;
        }
        let (matmul, scale, alpha) = added_product(g, users, p, add, plain)?;
        Some(Fusion::Accumulate {
            matmul,
            scale,
            add,
            addend,
            alpha,
        })
    })
}

/// The product whose result `p` is read by `reader` alone: a `matmul`, or the `scale` of a
/// `matmul` that only the scale reads (a factor that may fold, [`scale_folds`]); with that
/// scale and its factor (1 without). None for a product by one of `plain`.
fn added_product(
    g: &Graph,
    users: &[Vec<Node>],
    p: Value,
    reader: Node,
    plain: &HashSet<String>,
) -> Option<(Node, Option<Node>, f64)> {
    let only = |v: Value, r: Node| users[v.index()] == [r] && !g.outputs().contains(&v);
    if !only(p, reader) {
        return None;
    }
    let n = g.value(p).producer;
    let (m, scale, alpha) = match g.node(n).op {
        Op::Scale { factor } => {
            let x = g.node(n).inputs[0];
            let folds = g.ty(x) == g.ty(p) && scale_folds(factor, g.ty(p).dtype);
            if !folds || !only(x, n) {
                return None;
            }
            (g.value(x).producer, Some(n), factor)
        }
        _ => (n, None, 1.0),
    };
    let is_product = matches!(g.node(m).op, Op::MatMul { .. });
    (is_product && !plain.contains(g.name(g.node(m).inputs[1]))).then_some((m, scale, alpha))
}

/// Whether a scale by `factor` of a `dtype` value may join a product: always in 16 bits (one
/// rounding instead of two), in F32 only when exact (a power of two), which keeps F32 plans
/// bit-identical to the separate ops.
fn scale_folds(factor: f64, dtype: castor_ir::DType) -> bool {
    let power_of_two = factor > 0.0 && factor.log2().fract() == 0.0;
    power_of_two || matches!(dtype, castor_ir::DType::F16 | castor_ir::DType::BF16)
}

/// The fusions of the `scale` node `n`: into the product it scales, or into every product
/// that reads it; none when neither holds whole, or when a product would
/// take the scale twice.
fn scale_fusions(g: &Graph, users: &[Vec<Node>], n: Node, factor: f64) -> Vec<Fusion> {
    let node = g.node(n);
    let (x, y) = (node.inputs[0], node.outputs[0]);
    if g.ty(x) != g.ty(y) || !scale_folds(factor, g.ty(y).dtype) {
        return vec![];
    }
    let m = g.value(x).producer;
    let product_only_here = matches!(g.node(m).op, Op::MatMul { .. })
        && users[x.index()] == [n]
        && !g.outputs().contains(&x);
    if product_only_here {
        return vec![Fusion::ScaledProduct {
            matmul: m,
            scale: n,
            alpha: factor,
        }];
    }
    // The products that read `y`: directly, or through a reshape that only products read
    // (a weight gradient reads the output gradient reshaped to rows). Each reads it once.
    let reads_once = |r: Node, v: Value| {
        matches!(g.node(r).op, Op::MatMul { .. })
            && g.node(r).inputs.iter().filter(|&&i| i == v).count() == 1
    };
    let products_of = |v: Value| -> Option<Vec<Node>> {
        let mut readers = users[v.index()].clone();
        readers.dedup();
        let ok = !readers.is_empty()
            && !g.outputs().contains(&v)
            && readers.iter().all(|&r| reads_once(r, v));
        ok.then_some(readers)
    };
    if g.outputs().contains(&y) {
        return vec![];
    }
    let mut readers = users[y.index()].clone();
    readers.dedup();
    let mut products = Vec::new();
    for r in readers {
        match g.node(r).op {
            Op::MatMul { .. } if reads_once(r, y) => products.push(r),
            Op::Reshape { .. } => match products_of(g.node(r).outputs[0]) {
                Some(more) => products.extend(more),
                None => return vec![],
            },
            _ => return vec![],
        }
    }
    // A product that reads the scale twice (directly and reshaped) would take it twice.
    let mut distinct = products.clone();
    distinct.sort();
    distinct.dedup();
    if products.is_empty() || distinct.len() != products.len() {
        return vec![];
    }
    products
        .into_iter()
        .map(|matmul| Fusion::ScaledOperand {
            matmul,
            scale: n,
            alpha: factor,
        })
        .collect()
}

/// The weight gradient `matmul(x, dy) {transpose_a}` (or `matmul(dy, x)`) whose `dy` operand,
/// as `[rows, n]`, holds the rows the bias-gradient `sum` adds: the product and whether `dy`
/// is its lhs. The sum's result must not be read before the product runs.
fn weight_gradient_of(
    g: &Graph,
    users: &[Vec<Node>],
    sum: Node,
    axes: &[usize],
) -> Option<(Node, bool)> {
    let (v, out) = (g.node(sum).inputs[0], g.node(sum).outputs[0]);
    let dims = g.ty(v).shape.dims();
    let n = *dims.last()?;
    let leading: Vec<usize> = (0..dims.len() - 1).collect();
    if axes != leading.as_slice() || g.ty(out).dtype != castor_ir::DType::F32 {
        return None;
    }
    let rows = [dims.iter().product::<usize>() / n.max(1), n];
    // `dy` itself, or a reshape of it to `[rows, n]`.
    let mut as_rows = vec![v];
    as_rows.extend(users[v.index()].iter().filter_map(|&r| {
        let o = g.node(r).outputs[0];
        (matches!(g.node(r).op, Op::Reshape { .. }) && g.ty(o).shape.dims() == rows).then_some(o)
    }));
    let matmul = as_rows.iter().find_map(|&x| {
        users[x.index()].iter().find_map(|&m| {
            let node = g.node(m);
            let is_weight_grad = node.op
                == Op::MatMul {
                    transpose_a: true,
                    transpose_b: false,
                }
                && node.inputs.iter().all(|&i| g.ty(i).shape.rank() == 2)
                && g.ty(x).shape.dims() == rows;
            let lhs = node.inputs[0] == x;
            (is_weight_grad && (lhs || node.inputs[1] == x)).then_some((m, lhs))
        })
    })?;
    // The fused node runs where the product does: nothing may read the sum before.
    let read_early = users[out.index()]
        .iter()
        .any(|r| r.index() < matmul.0.index());
    (!read_early && matmul.0.index() > sum.index()).then_some(matmul)
}

/// A product scaled by `alpha` in its accumulator: a plain product when `alpha` is 1 (a
/// scale by 1, as LoRA gives with `lora_alpha = r`, asks for no work).
fn scaled_product(transpose_a: bool, transpose_b: bool, alpha: f64) -> Op {
    if alpha == 1.0 {
        Op::MatMul {
            transpose_a,
            transpose_b,
        }
    } else {
        Op::MatMulScaled {
            transpose_a,
            transpose_b,
            alpha,
        }
    }
}

/// The note of a product that took a scale by `alpha`: `note`, or for a scale by 1 that
/// it was dropped.
fn scale_note(alpha: f64, note: &'static str) -> &'static str {
    if alpha == 1.0 {
        "epilogue: a scale by 1 dropped"
    } else {
        note
    }
}

/// A fused product's transposes.
fn transposes(op: &Op) -> Result<(bool, bool), String> {
    match *op {
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => Ok((transpose_a, transpose_b)),
        _ => Err("a fused product is not a matmul".into()),
    }
}

/// `g` with each fusion's nodes replaced by its fused node; the new forward node count.
fn rewrite(
    g: &Graph,
    fusions: &[Fusion],
    forward_nodes: usize,
) -> Result<(Graph, usize), PassError> {
    let internal = |message: String| PassError::Internal {
        pass: "epilogue",
        message,
    };
    let mut at: Vec<Option<&Fusion>> = vec![None; g.num_nodes()];
    let mut absorbed = vec![false; g.num_nodes()];
    for f in fusions {
        at[f.at().index()] = Some(f);
        for n in f.absorbed() {
            absorbed[n.index()] = true;
        }
    }
    let operand_scales: HashSet<Node> = fusions
        .iter()
        .filter_map(|f| match *f {
            Fusion::ScaledOperand { scale, .. } => Some(scale),
            _ => None,
        })
        .collect();
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    let mut new_forward = 0;
    for (n, node) in g.nodes() {
        let mapped = |map: &[Option<Value>], v: Value| {
            map[v.index()].ok_or_else(|| internal(format!("`%{}` is unmapped", g.name(v))))
        };
        let result = |v: Value| (g.name(v).to_string(), g.ty(v).clone());
        let pushed = if let Some(f) = at[n.index()] {
            let (op, ins, olds, anchor, note) = match *f {
                Fusion::Bias {
                    matmul,
                    add,
                    bias,
                    gelu,
                } => {
                    let mm = g.node(matmul);
                    let (transpose_a, transpose_b) = transposes(&mm.op).map_err(internal)?;
                    let ins = vec![mm.inputs[0], mm.inputs[1], bias];
                    let pre = g.node(add).outputs[0];
                    match gelu {
                        None => (
                            Op::MatMulBias {
                                transpose_a,
                                transpose_b,
                            },
                            ins,
                            vec![pre],
                            matmul,
                            "epilogue: bias added in the product's F32 accumulator, rounded once (cuBLASLt BIAS, as addmm)",
                        ),
                        Some(gl) => (
                            Op::MatMulBiasGelu {
                                transpose_a,
                                transpose_b,
                            },
                            ins,
                            vec![pre, g.node(gl).outputs[0]],
                            matmul,
                            "epilogue: bias and tanh GELU in the product's F32 accumulator; the pre-activation kept for the backward (cuBLASLt GELU_AUX_BIAS)",
                        ),
                    }
                }
                Fusion::BiasGrad { matmul, sum, lhs } => (
                    Op::MatMulBiasGrad { lhs },
                    g.node(matmul).inputs.clone(),
                    vec![g.node(matmul).outputs[0], g.node(sum).outputs[0]],
                    matmul,
                    "epilogue: the bias gradient summed from the product's output-gradient operand (cuBLASLt BGRADA/BGRADB)",
                ),
                Fusion::ScaledProduct {
                    matmul,
                    scale,
                    alpha,
                } => {
                    let mm = g.node(matmul);
                    let (transpose_a, transpose_b) = transposes(&mm.op).map_err(internal)?;
                    (
                        scaled_product(transpose_a, transpose_b, alpha),
                        mm.inputs.clone(),
                        vec![g.node(scale).outputs[0]],
                        matmul,
                        scale_note(alpha, "epilogue: the scale applied in the product's F32 accumulator, rounded once (cuBLAS alpha)"),
                    )
                }
                Fusion::ScaledOperand {
                    matmul,
                    scale,
                    alpha,
                } => {
                    let mm = g.node(matmul);
                    let (transpose_a, transpose_b) = transposes(&mm.op).map_err(internal)?;
                    let (x, y) = (g.node(scale).inputs[0], g.node(scale).outputs[0]);
                    (
                        scaled_product(transpose_a, transpose_b, alpha),
                        mm.inputs
                            .iter()
                            .map(|&i| if i == y { x } else { i })
                            .collect(),
                        mm.outputs.clone(),
                        matmul,
                        scale_note(alpha, "epilogue: the operand's scale applied in the product's F32 accumulator instead (cuBLAS alpha)"),
                    )
                }
                Fusion::Accumulate {
                    matmul,
                    add,
                    addend,
                    alpha,
                    ..
                } => {
                    let mm = g.node(matmul);
                    let (transpose_a, transpose_b) = transposes(&mm.op).map_err(internal)?;
                    (
                        Op::MatMulAdd {
                            transpose_a,
                            transpose_b,
                            alpha,
                        },
                        vec![mm.inputs[0], mm.inputs[1], addend],
                        vec![g.node(add).outputs[0]],
                        matmul,
                        "epilogue: the product added to the other operand in its F32 accumulator, rounded once (cuBLAS beta = 1)",
                    )
                }
                Fusion::GeluGrad { matmul, grad } => {
                    let mm = g.node(matmul);
                    let (transpose_a, transpose_b) = transposes(&mm.op).map_err(internal)?;
                    (
                        Op::MatMulGeluGrad {
                            transpose_a,
                            transpose_b,
                        },
                        vec![mm.inputs[0], mm.inputs[1], g.node(grad).inputs[0]],
                        vec![g.node(grad).outputs[0]],
                        matmul,
                        "epilogue: tanh GELU gradient in the product's F32 accumulator (cuBLASLt DGELU)",
                    )
                }
            };
            let ins = ins
                .iter()
                .map(|&v| mapped(&map, v))
                .collect::<Result<Vec<_>, _>>()?;
            let f = out.push_node(op, ins, olds.iter().map(|&v| result(v)).collect())?;
            out.set_acc(f, g.node(anchor).acc);
            out.set_block(f, g.node(anchor).block);
            out.set_note(f, Some(note.to_string()));
            for (&old, &new) in olds.iter().zip(&out.node(f).outputs) {
                map[old.index()] = Some(new);
            }
            true
        } else if absorbed[n.index()] {
            if operand_scales.contains(&n) {
                // Every reader of the scale's result scales instead (directly, or through a
                // reshape that now reads the scale's input).
                map[node.outputs[0].index()] = Some(mapped(&map, node.inputs[0])?);
            }
            false
        } else {
            let ins = node
                .inputs
                .iter()
                .map(|&v| mapped(&map, v))
                .collect::<Result<Vec<_>, _>>()?;
            let copy =
                out.push_copy(g, n, ins, node.outputs.iter().map(|&v| result(v)).collect())?;
            for (&old, &new) in node.outputs.iter().zip(&out.node(copy).outputs) {
                map[old.index()] = Some(new);
            }
            true
        };
        if pushed && n.index() < forward_nodes {
            new_forward += 1;
        }
    }
    set_mapped_outputs(g, &mut out, &map).map_err(internal)?;
    Ok((out, new_forward))
}
