//! The CPU reference executor.
//!
//! [`CpuExecutor::run`] walks a verified graph in node order (which is topological). Sources
//! borrow their bindings, so parameters are never copied. Every other node's results are
//! stored until their last use and freed right after it; a node that is a value's last use
//! gets the value's buffer and may compute in place, so peak memory stays close to the live
//! set of the forward pass. Other dead buffers go to a per-run pool (`pool`) that kernels
//! draw their outputs from, which spares the page faults of fresh large allocations.
//!
//! Arithmetic is F32 for every float dtype; each float result is rounded to the dtype the graph
//! records for it (round-to-nearest-even, `castor_ir::round_to`), exactly where a GPU would
//! store it. Kernels live in one module per op family and parallelize with rayon.

pub(crate) mod adafactor;
pub(crate) mod adamw8bit;
pub(crate) mod attention;
pub(crate) mod cast;
pub(crate) mod classifier;
pub mod collective;
mod dispatch;
pub(crate) mod dropout;
pub(crate) mod elementwise;
pub(crate) mod embedding;
pub(crate) mod epilogue;
pub(crate) mod fp8;
pub(crate) mod layout;
pub(crate) mod loss;
pub(crate) mod mask;
pub(crate) mod math;
pub(crate) mod matmul;
pub(crate) mod norm;
mod operand;
pub(crate) mod optimizer;
mod par;
mod pool;
pub(crate) mod reduce;
pub(crate) mod rope;
mod simd;
pub(crate) mod softmax;
mod strides;

use crate::RuntimeError;
use castor_ir::{Graph, Node, Op, Tensor, TensorData, TensorType, Value};
use operand::{Args, Operand};

/// Runs graphs on the host. Holds no state between runs.
#[derive(Clone, Debug, Default)]
pub struct CpuExecutor {
    /// This executor's rank in a data-parallel group (none: a group of one).
    member: Option<collective::Member>,
}

/// What the run holds for a value.
enum Slot<'t> {
    Empty,
    Bound(&'t Tensor),
    Computed(Tensor),
}

/// When a value can be freed.
#[derive(Clone, Copy, PartialEq)]
enum LastUse {
    /// Nothing reads it: drop it as soon as it is made.
    Unused,
    /// The last node that reads it.
    Node(Node),
    /// A graph output: keep it to the end.
    Output,
}

impl CpuExecutor {
    pub fn new() -> Self {
        CpuExecutor { member: None }
    }

    /// This executor's rank in its group (0 alone).
    pub fn rank(&self) -> usize {
        self.member.as_ref().map_or(0, |m| m.rank())
    }

    /// The executor of one rank of a data-parallel group: collectives exchange values with
    /// the group's other ranks.
    pub fn ranked(member: collective::Member) -> Self {
        CpuExecutor {
            member: Some(member),
        }
    }

    /// Runs `graph` and returns its outputs, in order.
    ///
    /// `bindings` maps the name of each `input` and `param` value to a host tensor of exactly
    /// the value's type (I32 and I64 both store `i64`s); bound tensors are borrowed, never
    /// copied. The graph is verified first.
    ///
    /// Errors: an invalid graph, a missing or mistyped binding, an out-of-range token id or
    /// label, a max over an empty axis. Never panics on bad bindings or data.
    pub fn run<'t>(
        &self,
        graph: &Graph,
        bindings: &dyn Fn(&str) -> Option<&'t Tensor>,
    ) -> Result<Vec<Tensor>, RuntimeError> {
        castor_ir::verify(graph).map_err(|source| RuntimeError::InvalidGraph {
            graph: graph.name.clone(),
            source,
        })?;
        let _pool = pool::Scope::enter();
        let last_use = last_uses(graph);
        let mut slots: Vec<Slot<'t>> = (0..graph.num_values()).map(|_| Slot::Empty).collect();

        for (n, node) in graph.nodes() {
            if node.op.is_source() {
                for &v in &node.outputs {
                    slots[v.index()] = Slot::Bound(bind(graph, v, bindings)?);
                }
                continue;
            }
            let name = node.outputs.first().map_or("?", |&v| graph.name(v));
            if matches!(
                node.op,
                Op::AllReduce { .. }
                    | Op::ReduceScatter { .. }
                    | Op::AllGather { .. }
                    | Op::Shard { .. }
            ) {
                let x = match node.inputs.first().map(|v| &slots[v.index()]) {
                    Some(Slot::Bound(t)) => *t,
                    Some(Slot::Computed(t)) => t,
                    _ => {
                        return Err(RuntimeError::Internal {
                            node: name.into(),
                            message: "a collective's operand was never computed".into(),
                        })
                    }
                };
                let out = graph.ty(node.outputs[0]);
                let t = collective::execute(&node.op, self.member.as_ref(), x, out, name)?;
                let input = node.inputs[0];
                if last_use[input.index()] == LastUse::Node(n) {
                    if let Slot::Computed(t) =
                        std::mem::replace(&mut slots[input.index()], Slot::Empty)
                    {
                        recycle(t);
                    }
                }
                let v = node.outputs[0];
                if last_use[v.index()] == LastUse::Unused {
                    recycle(t);
                } else {
                    slots[v.index()] = Slot::Computed(t);
                }
                continue;
            }
            let operands = operands(&mut slots, &node.inputs, n, &last_use);
            let mut args = Args::new(name, operands);
            let out_types: Vec<&TensorType> = node.outputs.iter().map(|&v| graph.ty(v)).collect();
            let results = dispatch::execute(&node.op, node.acc, &mut args, &out_types)?;
            args.into_owned().for_each(recycle);
            for &v in &node.inputs {
                if last_use[v.index()] == LastUse::Node(n) {
                    if let Slot::Computed(t) = std::mem::replace(&mut slots[v.index()], Slot::Empty)
                    {
                        recycle(t);
                    }
                }
            }
            for (&v, t) in node.outputs.iter().zip(results) {
                if last_use[v.index()] == LastUse::Unused {
                    recycle(t);
                } else {
                    slots[v.index()] = Slot::Computed(t);
                }
            }
        }

        let outputs = graph.outputs();
        let mut results = Vec::with_capacity(outputs.len());
        for (i, &v) in outputs.iter().enumerate() {
            let last = !outputs[i + 1..].contains(&v);
            let slot = if last {
                std::mem::replace(&mut slots[v.index()], Slot::Empty)
            } else {
                match &slots[v.index()] {
                    Slot::Bound(t) => Slot::Bound(t),
                    Slot::Computed(t) => Slot::Computed(t.clone()),
                    Slot::Empty => Slot::Empty,
                }
            };
            results.push(match slot {
                Slot::Bound(t) => t.clone(),
                Slot::Computed(t) => t,
                Slot::Empty => {
                    return Err(RuntimeError::Internal {
                        node: graph.name(v).to_string(),
                        message: "a graph output was never computed".into(),
                    })
                }
            });
        }
        Ok(results)
    }
}

/// Hands a dead value's F32 buffer to the pool.
fn recycle(t: Tensor) {
    if let TensorData::F32(v) = t.into_data() {
        pool::recycle(v);
    }
}

/// The binding of source value `v`, checked against its type.
fn bind<'t>(
    graph: &Graph,
    v: Value,
    bindings: &dyn Fn(&str) -> Option<&'t Tensor>,
) -> Result<&'t Tensor, RuntimeError> {
    let (name, expected) = (graph.name(v), graph.ty(v));
    let t = bindings(name).ok_or_else(|| RuntimeError::MissingBinding {
        name: name.to_string(),
        expected: expected.clone(),
    })?;
    if t.ty() != expected {
        return Err(RuntimeError::BindingMismatch {
            name: name.to_string(),
            expected: expected.clone(),
            found: t.ty().clone(),
        });
    }
    Ok(t)
}

/// Each value's last use, from node order.
fn last_uses(graph: &Graph) -> Vec<LastUse> {
    let mut last = vec![LastUse::Unused; graph.num_values()];
    for (n, node) in graph.nodes() {
        for &v in &node.inputs {
            last[v.index()] = LastUse::Node(n);
        }
    }
    for &v in graph.outputs() {
        last[v.index()] = LastUse::Output;
    }
    last
}

/// The operands of node `n`: a computed value whose last use this is, and which the node reads
/// once, is moved out of its slot; everything else is borrowed.
fn operands<'s, 't: 's>(
    slots: &'s mut [Slot<'t>],
    inputs: &[Value],
    n: Node,
    last_use: &[LastUse],
) -> Vec<Operand<'s>> {
    let mut owned: Vec<Option<Tensor>> = inputs
        .iter()
        .map(|&v| {
            let once = inputs.iter().filter(|&&u| u == v).count() == 1;
            let slot = &mut slots[v.index()];
            if once && last_use[v.index()] == LastUse::Node(n) && matches!(slot, Slot::Computed(_))
            {
                match std::mem::replace(slot, Slot::Empty) {
                    Slot::Computed(t) => Some(t),
                    _ => None,
                }
            } else {
                None
            }
        })
        .collect();
    let slots: &'s [Slot<'t>] = slots;
    inputs
        .iter()
        .zip(&mut owned)
        .map(|(&v, own)| match (own.take(), &slots[v.index()]) {
            (Some(t), _) => Operand::Owned(t),
            (None, Slot::Bound(t)) => Operand::Borrowed(t),
            (None, Slot::Computed(t)) => Operand::Borrowed(t),
            (None, Slot::Empty) => Operand::Taken,
        })
        .collect()
}
