//! `classifier`: under `--classifier fused`, the LM head's product and the cross-entropy of
//! the loss graph become one `linear_cross_entropy` op that runs a chunk of rows at a time, so
//! the `[rows, vocab]` logits (and their gradient, shifted and padded copies) never exist
//! whole: a chunk of logits is the head's working memory.
//!
//! The pattern is the language-model loss the model builder writes:
//! `logits = matmul(hidden, weight^T)` (weight `[V, C]`), then for the causal LM
//! `slice(logits, axis 1, 0..T-1)`, then `reshape [rows, V]`, then `cross_entropy` with the
//! labels' rows, each value read once. It becomes `slice(hidden)` (causal LM), `reshape
//! [rows, C]` and the fused op, the product's accumulation and the logits' dtype carried
//! over, so a chunk's logits round as the product stored them. A head with a bias (BERT's MLM
//! decoder) or a loss of another shape stays eager, and the report says why; so do weight
//! gradients in the compute dtype (`--param-grads compute`), which the fused gradient writes
//! in F32 only.

use super::{set_mapped_outputs, PlanBuild, PlanPass};
use crate::{PassError, PassReport};
use castor_ir::{Classifier, Graph, Node, Op, Shape, TensorType, Value};

/// Rows per chunk when `--classifier fused` names no row count. A chunk's weight-gradient
/// product reads and rewrites the whole F32 `[V, C]` gradient whatever its row count, while
/// its three products do 6 FLOPs per weight and row: the 8 bytes per weight cost less than a
/// quarter of the products from about 1,600 rows on an H100 (295 FLOPs per byte), and more
/// than the products themselves below 400 (LLaMA-3.2-1B at 256 rows a chunk spent 32 ms of a
/// 193 ms step accumulating its head's gradient).
const CHUNK_ROWS: usize = 2048;
/// A chunk's logits stay within 256 Mi values (512 MiB in BF16): a larger vocabulary gets
/// fewer rows.
const MAX_CHUNK_VALUES: usize = 1 << 28;
/// A small vocabulary gets more rows, up to 32 Mi logits a chunk.
const MIN_CHUNK_VALUES: usize = 1 << 25;

/// The default rows per chunk for a vocabulary of `vocab`: [`CHUNK_ROWS`] within the bounds on
/// a chunk's logits, a multiple of 64.
fn default_chunk_rows(vocab: usize) -> usize {
    let vocab = vocab.max(1);
    let rows = CHUNK_ROWS
        .max(MIN_CHUNK_VALUES / vocab)
        .min(MAX_CHUNK_VALUES / vocab);
    (rows / 64 * 64).max(64)
}

pub(super) struct FuseClassifier;

impl PlanPass for FuseClassifier {
    fn name(&self) -> &'static str {
        "classifier"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let settings = build.plan.settings.clone();
        let Classifier::Fused { chunk_rows } = settings.classifier else {
            return Ok(PassReport::new(
                "eager: the LM head's logits are stored whole",
            ));
        };
        if settings.param_grads_in_compute_dtype {
            return Ok(PassReport::new(
                "eager: --param-grads compute (the fused gradient writes the weight's in F32)",
            ));
        }
        let head = match find_head(&build.forward) {
            Ok(head) => head,
            Err(why) => return Ok(PassReport::new(format!("eager: {why}"))),
        };
        let (graph, report) = fuse(&build.forward, &head, chunk_rows)?;
        let memory = std::sync::Arc::clone(&build.memory);
        *build = PlanBuild::new(&graph, settings)?;
        build.memory = memory;
        Ok(PassReport::new(report))
    }
}

/// The nodes of the LM head and loss that the fused op replaces.
struct Head {
    matmul: Node,
    /// The causal LM's shift of the logits by one position.
    shift: Option<Node>,
    rows: Node,
    loss: Node,
}

/// The LM head and cross-entropy of `g`, or why there is none to fuse.
fn find_head(g: &Graph) -> Result<Head, String> {
    let users = g.users();
    let loss_value = *g.outputs().first().ok_or("the loss graph has no output")?;
    let loss = g.value(loss_value).producer;
    let only_reader = |v: Value| -> Result<Node, String> {
        match users[v.index()].as_slice() {
            [n] if !g.outputs().contains(&v) => Ok(*n),
            _ => Err(format!("`%{}` is read more than once", g.name(v))),
        }
    };
    let producer = |v: Value| g.value(v).producer;
    let Op::CrossEntropy { .. } = g.node(loss).op else {
        return Err("the loss is not a cross-entropy".into());
    };
    let rows = producer(g.node(loss).inputs[0]);
    if !matches!(g.node(rows).op, Op::Reshape { .. }) {
        return Err("the cross-entropy does not read rows of logits".into());
    }
    only_reader(g.node(rows).outputs[0])?;
    let mut logits_user = rows;
    let mut shift = None;
    let mut v = g.node(rows).inputs[0];
    if let Op::Slice {
        axis: 1, start: 0, ..
    } = g.node(producer(v)).op
    {
        shift = Some(producer(v));
        only_reader(v)?;
        logits_user = producer(v);
        v = g.node(producer(v)).inputs[0];
    }
    let matmul = producer(v);
    match g.node(matmul).op {
        Op::MatMul {
            transpose_a: false,
            transpose_b: true,
        } => {}
        Op::Binary(_) => return Err("the LM head adds a bias to its product".into()),
        _ => return Err("the logits are not a product with the head's weight".into()),
    }
    if only_reader(v)? != logits_user {
        return Err("the logits feed something besides the loss".into());
    }
    let (h, w) = (g.node(matmul).inputs[0], g.node(matmul).inputs[1]);
    if g.ty(w).shape.rank() != 2 || g.ty(h).shape.rank() < 2 {
        return Err("the head's weight is not a matrix".into());
    }
    Ok(Head {
        matmul,
        shift,
        rows,
        loss,
    })
}

/// `g` with the head's nodes replaced by the hidden rows and the fused op; the pass report.
fn fuse(g: &Graph, head: &Head, chunk_rows: Option<usize>) -> Result<(Graph, String), PassError> {
    let internal = |message: String| PassError::Internal {
        pass: "classifier",
        message,
    };
    let mm = g.node(head.matmul);
    let (h, w) = (mm.inputs[0], mm.inputs[1]);
    let logits_dtype = g.ty(mm.outputs[0]).dtype;
    let ce = g.node(head.loss);
    let Op::CrossEntropy { ignore_index } = ce.op else {
        return Err(internal("the loss is not a cross-entropy".into()));
    };
    let rows = g.ty(g.node(head.rows).outputs[0]).shape.dims()[0];
    let (vocab, width) = {
        let d = g.ty(w).shape.dims();
        (d[0], d[1])
    };
    let chunk = chunk_rows
        .unwrap_or_else(|| default_chunk_rows(vocab))
        .clamp(1, rows.max(1));

    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    let skipped = [Some(head.matmul), head.shift, Some(head.rows)];
    for (n, node) in g.nodes() {
        if skipped.contains(&Some(n)) {
            continue;
        }
        let mapped = |v: Value| {
            map[v.index()].ok_or_else(|| internal(format!("`%{}` is unmapped", g.name(v))))
        };
        if n == head.loss {
            // hidden (shifted for the causal LM) as rows, then the fused op in the loss's place.
            let mut hidden = mapped(h)?;
            let ty = |d: Vec<usize>| TensorType::new(g.ty(h).dtype, Shape::from(d));
            if let Some(shift) = head.shift {
                let mut dims = g.ty(h).shape.dims().to_vec();
                let Op::Slice { start, end, .. } = g.node(shift).op else {
                    return Err(internal("the shift is not a slice".into()));
                };
                dims[1] = end - start;
                let op = Op::Slice {
                    axis: 1,
                    start,
                    end,
                };
                let s = out.push_node(
                    op,
                    vec![hidden],
                    vec![("loss.hidden.shifted".into(), ty(dims))],
                )?;
                out.set_block(s, g.node(shift).block);
                hidden = out.node(s).outputs[0];
            }
            let reshape = Op::Reshape {
                shape: vec![rows, width],
            };
            let r = out.push_node(
                reshape,
                vec![hidden],
                vec![("loss.hidden.rows".into(), ty(vec![rows, width]))],
            )?;
            out.set_block(r, g.node(head.rows).block);
            let fused = Op::LinearCrossEntropy {
                ignore_index,
                chunk_rows: chunk,
                logits: logits_dtype,
            };
            let (weight, labels) = (mapped(w)?, mapped(node.inputs[1])?);
            let results = node
                .outputs
                .iter()
                .map(|&v| (g.name(v).to_string(), g.ty(v).clone()))
                .collect();
            let f = out.push_node(fused, vec![out.node(r).outputs[0], weight, labels], results)?;
            out.set_acc(f, mm.acc);
            out.set_block(f, mm.block);
            out.set_note(
                f,
                Some(format!(
                    "fused classifier: {chunk} of {rows} rows per chunk, logits in {logits_dtype}"
                )),
            );
            for (&old, &new) in node.outputs.iter().zip(&out.node(f).outputs) {
                map[old.index()] = Some(new);
            }
            continue;
        }
        let ins: Vec<Value> = node
            .inputs
            .iter()
            .map(|&v| mapped(v))
            .collect::<Result<_, _>>()?;
        let results = node
            .outputs
            .iter()
            .map(|&v| (g.name(v).to_string(), g.ty(v).clone()))
            .collect();
        let copy = out.push_copy(g, n, ins, results)?;
        for (&old, &new) in node.outputs.iter().zip(&out.node(copy).outputs) {
            map[old.index()] = Some(new);
        }
    }
    set_mapped_outputs(g, &mut out, &map).map_err(internal)?;
    let logits_bytes = rows * vocab * logits_dtype.size_bytes();
    let chunk_bytes = chunk * vocab * logits_dtype.size_bytes();
    let report = format!(
        "fused the LM head and its cross-entropy: {rows} rows x {vocab} logits in chunks of \
         {chunk} rows ({} of {logits_dtype} logits at a time instead of {})",
        castor_ir::human_bytes(chunk_bytes as u64),
        castor_ir::human_bytes(logits_bytes as u64),
    );
    Ok((out, report))
}

/// `classifier_step`: after autodiff, a fused head whose loss is read only as the step's
/// output and whose gradient reads the same operands becomes one `linear_cross_entropy_step`
/// op, where the gradient was: each chunk's logits are computed once per step instead of
/// twice. The loss then comes out of the backward part, which nothing in a step reads.
pub(super) struct ClassifierStep;

impl PlanPass for ClassifierStep {
    fn name(&self) -> &'static str {
        "classifier_step"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let g = &build.plan.micro_step;
        let Some((forward, grad)) = find_pair(g) else {
            return Ok(PassReport::new(
                "no fused classifier to merge with its gradient",
            ));
        };
        let merged = merge(g, forward, grad)?;
        build.plan.micro_step = merged;
        build.plan.forward_nodes -= 1;
        Ok(PassReport::new(
            "the fused classifier's loss and gradient in one pass: each chunk's logits once per \
             step",
        ))
    }
}

/// The fused head and its gradient, when they can be one op.
fn find_pair(g: &Graph) -> Option<(Node, Node)> {
    let users = g.users();
    let forward = g.nodes().find_map(|(n, node)| {
        let loss = node.outputs[0];
        let read_only_as_output = users[loss.index()].is_empty() && g.outputs().contains(&loss);
        (matches!(node.op, Op::LinearCrossEntropy { .. }) && read_only_as_output).then_some(n)
    })?;
    let f = g.node(forward);
    let grad = g.nodes().find_map(|(n, node)| {
        let same = match (&node.op, &f.op) {
            (
                Op::LinearCrossEntropyGrad {
                    ignore_index: a,
                    chunk_rows: b,
                    logits: c,
                },
                Op::LinearCrossEntropy {
                    ignore_index: x,
                    chunk_rows: y,
                    logits: z,
                },
            ) => (a, b, c) == (x, y, z) && node.inputs[..3] == f.inputs[..] && node.acc == f.acc,
            _ => false,
        };
        same.then_some(n)
    })?;
    Some((forward, grad))
}

fn merge(g: &Graph, forward: Node, grad: Node) -> Result<Graph, PassError> {
    let internal = |message: String| PassError::Internal {
        pass: "classifier_step",
        message,
    };
    let mut out = Graph::empty_like(g);
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    for (n, node) in g.nodes() {
        if n == forward {
            continue;
        }
        let ins: Vec<Value> = node
            .inputs
            .iter()
            .map(|&v| {
                map[v.index()].ok_or_else(|| internal(format!("`%{}` is unmapped", g.name(v))))
            })
            .collect::<Result<_, _>>()?;
        let result = |v: Value| (g.name(v).to_string(), g.ty(v).clone());
        let (new, olds): (Node, Vec<Value>) = if n == grad {
            let Op::LinearCrossEntropyGrad {
                ignore_index,
                chunk_rows,
                logits,
            } = node.op
            else {
                return Err(internal("the gradient is not the classifier's".into()));
            };
            let f = g.node(forward);
            let olds: Vec<Value> = std::iter::once(f.outputs[0])
                .chain(node.outputs.iter().copied())
                .collect();
            let op = Op::LinearCrossEntropyStep {
                ignore_index,
                chunk_rows,
                logits,
            };
            let s = out.push_node(op, ins, olds.iter().map(|&v| result(v)).collect())?;
            out.set_acc(s, f.acc);
            out.set_block(s, f.block);
            out.set_note(
                s,
                Some(format!(
                    "fused classifier, loss and gradient in one pass: {chunk_rows} rows per chunk, logits in {logits}"
                )),
            );
            (s, olds)
        } else {
            let outs = node.outputs.iter().map(|&v| result(v)).collect();
            (out.push_copy(g, n, ins, outs)?, node.outputs.clone())
        };
        for (&old, &v) in olds.iter().zip(&out.node(new).outputs) {
            map[old.index()] = Some(v);
        }
    }
    set_mapped_outputs(g, &mut out, &map).map_err(internal)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::default_chunk_rows;

    #[test]
    fn default_chunks_are_long_enough_to_amortize_the_weight_gradient() {
        // GPT-2 and LLaMA-2/3: 2,048 rows; Gemma's 256,000 and Qwen2's 151,936 entries keep
        // their logits within 256 Mi values; a tiny vocabulary takes up to 32 Mi values.
        assert_eq!(default_chunk_rows(50257), 2048);
        assert_eq!(default_chunk_rows(32000), 2048);
        assert_eq!(default_chunk_rows(128256), 2048);
        assert_eq!(default_chunk_rows(151936), 1728);
        assert_eq!(default_chunk_rows(256000), 1024);
        assert_eq!(default_chunk_rows(1000), 33536);
        assert_eq!(default_chunk_rows(usize::MAX), 64);
    }
}
