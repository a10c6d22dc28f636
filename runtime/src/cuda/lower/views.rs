//! Where each value's elements live before any buffer is placed: layout results as views of
//! the buffer they read (composed through chains of layout ops), kept virtual, aliased or
//! copied; and values their producer writes straight into the buffer their layout chain
//! leads to (an attention context written where the output projection reads it, a head's
//! gradient into its slot of the fused QKV gradient), so that no copy runs in between.

use super::super::program::Place;
use super::{copies, LowerError, RunLowering};
use crate::cuda::families::{attention::lower as attention, rope::lower as rope};
use castor_ir::{Graph, Node, NodeData, Op, Value};
use std::collections::HashMap;

/// How a value is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Storage {
    /// A buffer of its own (every value that is not a layout result, too).
    Own,
    /// Never stored: only layout ops (and kernels that read it in place) read it, each
    /// composing its view.
    Virtual,
    /// Read in place: its view of another buffer is contiguous.
    Alias,
    /// Written by its producer through its view into the buffer of the value its layout
    /// chain leads to ([`written_in_place`]), and read there.
    Into,
}

impl Storage {
    /// Whether the value's elements are a view of another value's buffer.
    pub(crate) fn is_view(self) -> bool {
        self != Storage::Own
    }
}

/// The layout ops whose input is read through a view (one strided copy of the composed
/// view, or a further view).
fn reads_views(op: &Op) -> bool {
    matches!(
        op,
        Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Split { .. }
            | Op::Reshape { .. }
            | Op::Concat { .. }
            | Op::Pad { .. }
            | Op::BroadcastTo { .. }
    )
}

/// Every layout result's view of the buffer it reads (composed through chains of layout
/// ops) and how it is stored, with the values written in place ([`written_in_place`]) as
/// views of their targets. Graph outputs and values written to state have buffers of their
/// own.
#[allow(clippy::type_complexity)]
pub(crate) fn layout_views(
    g: &Graph,
    users: &[Vec<Node>],
    stored: &HashMap<String, String>,
) -> (Vec<Option<(Value, copies::View)>>, Vec<Storage>) {
    let n = g.num_values();
    let mut views: Vec<Option<(Value, copies::View)>> = vec![None; n];
    let mut storage = vec![Storage::Own; n];
    for (x, target, view) in written_in_place(g, users, stored) {
        views[x.index()] = Some((target, view));
        storage[x.index()] = Storage::Into;
    }
    for (_, node) in g.nodes() {
        let Some(&x) = node.inputs.first() else {
            continue;
        };
        let (root, base) = match (&views[x.index()], storage[x.index()]) {
            (Some((r, v)), s) if s.is_view() => (*r, v.clone()),
            _ => (x, copies::View::contiguous(g.ty(x).shape.dims())),
        };
        let dims = |v: Value| g.ty(v).shape.dims().to_vec();
        let made: Vec<(Value, Option<copies::View>)> = match &node.op {
            Op::Transpose { perm } => vec![(node.outputs[0], Some(base.transpose(perm)))],
            Op::Slice { axis, start, end } => {
                vec![(
                    node.outputs[0],
                    Some(base.slice(*axis, *start, end - start)),
                )]
            }
            Op::Split { axis, sizes } => {
                let mut start = 0;
                node.outputs
                    .iter()
                    .zip(sizes)
                    .map(|(&o, &size)| {
                        let v = base.slice(*axis, start, size);
                        start += size;
                        (o, Some(v))
                    })
                    .collect()
            }
            Op::Reshape { .. } => {
                let o = node.outputs[0];
                // A reshape no view expresses, read only by concats: each concat copies the
                // operand's view straight into its slot, reshaped (a reshape keeps row-major
                // order), so nothing is stored in between.
                let view = base
                    .reshape(&dims(o))
                    .or_else(|| into_concats(g, users, o, &base).then(|| base.clone()));
                vec![(o, view)]
            }
            Op::BroadcastTo { .. } => {
                vec![(node.outputs[0], base.broadcast(&dims(node.outputs[0])))]
            }
            _ => continue,
        };
        for (o, view) in made {
            let Some(view) = view else { continue };
            if root == o {
                // The end of a chain written in place: its own buffer, filled already.
                continue;
            }
            let fixed = g.outputs().contains(&o) || stored.contains_key(g.name(o));
            // Read only through views: by layout ops (each composing its view), or in place
            // by the attention kernels (a head of a fused QKV product).
            let only_layout = users[o.index()].iter().all(|&u| {
                let node = g.node(u);
                reads_views(&node.op) || reads_in_place(g, node, o, &view)
            });
            storage[o.index()] = if fixed || view.dims.len() > super::super::program::MAX_RANK {
                Storage::Own
            } else if only_layout {
                Storage::Virtual
            } else if view.is_contiguous() {
                Storage::Alias
            } else {
                Storage::Own
            };
            views[o.index()] = Some((root, view));
        }
    }
    (views, storage)
}

/// Whether every reader of `o` is a concat that can take `view` (`o`'s elements in row-major
/// order over other dims) into its slot: the slot reshaped to the view's dims is a view.
fn into_concats(g: &Graph, users: &[Vec<Node>], o: Value, view: &copies::View) -> bool {
    let readers = &users[o.index()];
    !readers.is_empty()
        && readers.iter().all(|&u| {
            let node = g.node(u);
            let Op::Concat { axis } = node.op else {
                return false;
            };
            let out = g.ty(node.outputs[0]).shape.dims().to_vec();
            let mut start = 0;
            node.inputs.iter().all(|&x| {
                let len = g.ty(x).shape.dims()[axis];
                let fits = x != o
                    || copies::View::contiguous(&out)
                        .slice(axis, start, len)
                        .reshape(&view.dims)
                        .is_some();
                start += len;
                fits
            })
        })
}

/// Whether `node` reads its operand `x` (`view` of another buffer) in place, through strides.
fn reads_in_place(g: &Graph, node: &NodeData, x: Value, view: &copies::View) -> bool {
    attention::reads_in_place(g, node, x, view) || rope::reads_in_place(g, node, x, view)
}

/// Whether `node` writes its output `x` through `view` of another buffer.
fn writes_in_place(g: &Graph, node: &NodeData, x: Value, view: &copies::View) -> bool {
    attention::writes_in_place(g, node, x, view) || rope::writes_in_place(g, node, x, view)
}

/// Values written in place: an attention or RoPE output (the context, the query, key or
/// value gradient, a rotated head's gradient) read by a chain of transposes and reshapes, each
/// value read by the next step alone, that ends in a value stored in a buffer of its own or
/// in a slot of a concatenation that alone reads it. The kernels write the output through the
/// chain's inverse view of that buffer, and every other reader reads it there (the backward
/// reading the context in place, a recomputed chain through a view); the chain's copies then
/// have nothing to move. Each entry: the
/// value, the value whose buffer takes it, and its view of that buffer.
fn written_in_place(
    g: &Graph,
    users: &[Vec<Node>],
    stored: &HashMap<String, String>,
) -> Vec<(Value, Value, copies::View)> {
    let fixed = |v: Value| g.outputs().contains(&v) || stored.contains_key(g.name(v));
    let dims = |v: Value| g.ty(v).shape.dims().to_vec();
    let is_step = |u: Node| matches!(g.node(u).op, Op::Transpose { .. } | Op::Reshape { .. });
    let mut out = Vec::new();
    for (_, node) in g.nodes() {
        let outputs = match node.op {
            Op::Attention { .. } | Op::Rope { .. } | Op::RopeGrad { .. } => &node.outputs[..1],
            Op::AttentionGrad { .. } => &node.outputs[..3],
            _ => continue,
        };
        for &x in outputs {
            if fixed(x) {
                continue;
            }
            // The first chain decides the buffer; any other layout reader of x (a chain that
            // recomputes the same layout for the backward) then reads a view of it.
            let Some(first) = users[x.index()].iter().copied().find(|&u| is_step(u)) else {
                continue;
            };
            let mut steps = vec![first];
            let mut end = g.node(first).outputs[0];
            while let [u] = users[end.index()][..] {
                if !is_step(u) || fixed(end) {
                    break;
                }
                steps.push(u);
                end = g.node(u).outputs[0];
            }
            if fixed(end) {
                continue;
            }
            // The buffer: the chain end's own, or its slot in the concatenation reading it.
            let (target, mut view) = match users[end.index()][..] {
                [c] if matches!(g.node(c).op, Op::Concat { .. }) => {
                    let cn = g.node(c);
                    let Op::Concat { axis } = cn.op else {
                        continue;
                    };
                    let start: usize = cn
                        .inputs
                        .iter()
                        .take_while(|&&i| i != end)
                        .map(|&i| dims(i)[axis])
                        .sum();
                    let y = cn.outputs[0];
                    let slot =
                        copies::View::contiguous(&dims(y)).slice(axis, start, dims(end)[axis]);
                    (y, slot)
                }
                _ => (end, copies::View::contiguous(&dims(end))),
            };
            if fixed(target) || cn_reads_twice(g, target, end) {
                continue;
            }
            // x's elements in that buffer: the chain undone, its last step first.
            let mut undone = true;
            for &s in steps.iter().rev() {
                let sn = g.node(s);
                let input = dims(sn.inputs[0]);
                view = match &sn.op {
                    Op::Transpose { perm } => {
                        let mut inverse = vec![0; perm.len()];
                        for (i, &p) in perm.iter().enumerate() {
                            inverse[p] = i;
                        }
                        view.transpose(&inverse)
                    }
                    _ => match view.reshape(&input) {
                        Some(v) => v,
                        None => {
                            undone = false;
                            break;
                        }
                    },
                };
            }
            if !undone || !writes_in_place(g, node, x, &view) {
                continue;
            }
            let others_read_there = users[x.index()].iter().all(|&u| {
                let un = g.node(u);
                u == first || reads_views(&un.op) || reads_in_place(g, un, x, &view)
            });
            if others_read_there {
                out.push((x, target, view));
            }
        }
    }
    out
}

/// Whether concatenation output `y` reads `x` at more than one of its operands (its slots
/// would then share one producer's write).
fn cn_reads_twice(g: &Graph, y: Value, x: Value) -> bool {
    let producer = g.node(g.value(y).producer);
    producer.inputs.iter().filter(|&&i| i == x).count() > 1
}

/// Query batches per outer batch for query batch dims `qb` with key batches shared by `group`:
/// the dims after the first (all of them when the key batches are not whole groups of those).
pub(crate) fn heads_of(qb: &[usize], group: usize) -> usize {
    let bq: usize = qb.iter().product();
    match qb.first() {
        Some(&outer) if qb.len() >= 2 && outer > 0 && (bq / outer).is_multiple_of(group) => {
            bq / outer
        }
        _ => bq.max(1),
    }
}

/// Whether a stride fits the kernels' 32-bit stride arguments (offsets are 64-bit).
pub(crate) fn fits_i32(x: i64) -> bool {
    (0..=i64::from(i32::MAX)).contains(&x)
}

/// The (batch, head, row) strides by which a kernel reaches `view` in place (the attention
/// and RoPE kernels take them), an operand
/// of `[.., rows, d]` whose batches split by `heads`: `None` unless its batch dims fold into
/// (outer, heads) and its rows are contiguous, or (`write`) where two elements would share
/// an address.
pub(crate) fn kernel_strides(view: &copies::View, heads: usize, write: bool) -> Option<[i64; 3]> {
    let r = view.dims.len();
    if r < 2 || heads == 0 {
        return None;
    }
    let (rows, d) = (view.dims[r - 2], view.dims[r - 1]);
    let batches: usize = view.dims[..r - 2].iter().product();
    if !batches.is_multiple_of(heads) {
        return None;
    }
    let v = view.reshape(&[batches / heads, heads, rows, d])?;
    if d > 1 && v.strides[3] != 1 {
        return None;
    }
    // A dim of one element has no stride of its own (a reshape gives it 1): it gets the
    // packed one, the next dim's extent, which every alignment test and cuDNN accept.
    let row = if rows == 1 { d as i64 } else { v.strides[2] };
    let head = if heads == 1 {
        rows as i64 * row
    } else {
        v.strides[1]
    };
    let batch = if batches / heads == 1 {
        heads as i64 * head
    } else {
        v.strides[0]
    };
    let strides = [batch, head, row];
    if strides.iter().any(|&x| !fits_i32(x)) {
        return None;
    }
    if write
        && v.dims
            .iter()
            .zip(&v.strides)
            .any(|(&n, &st)| n > 1 && st == 0)
    {
        return None;
    }
    Some(strides)
}

impl RunLowering<'_, '_> {
    /// Where a kernel that takes strides reads `x` (`[.., rows, d]`, batches split by
    /// `heads`): its own buffer with dense strides, or in place through its view.
    pub(crate) fn strided_read(
        &self,
        x: Value,
        heads: usize,
    ) -> Result<(Place, [i64; 3]), LowerError> {
        let (root, view) = self.source(x);
        if root == x {
            return Ok((self.at(x)?, self.dense_strides(x, heads)));
        }
        let strides = kernel_strides(&view, heads, false)
            .ok_or_else(|| self.err(x, "a view its kernel cannot read (a lowering bug)"))?;
        Ok((self.at(root)?.plus(self.elements(x, view.offset)), strides))
    }

    /// Where a kernel that takes strides writes `x`: its own buffer with dense strides, or
    /// the buffer it is written into ([`Storage::Into`]) through its view.
    pub(crate) fn strided_write(
        &mut self,
        x: Value,
        heads: usize,
    ) -> Result<(Place, [i64; 3]), LowerError> {
        let (Storage::Into, Some((target, view))) =
            (self.storage[x.index()], self.views[x.index()].clone())
        else {
            return Ok((self.out(x)?, self.dense_strides(x, heads)));
        };
        let strides = kernel_strides(&view, heads, true)
            .ok_or_else(|| self.err(x, "a view its kernel cannot write (a lowering bug)"))?;
        Ok((
            self.out(target)?.plus(self.elements(x, view.offset)),
            strides,
        ))
    }

    /// The (batch, head, row) strides of `x` stored dense.
    fn dense_strides(&self, x: Value, heads: usize) -> [i64; 3] {
        let dims = self.g.ty(x).shape.dims();
        let r = dims.len();
        let (rows, d) = (dims[r - 2] as i64, dims[r - 1] as i64);
        [heads as i64 * rows * d, rows * d, d]
    }

    /// Bytes of `n` elements of `x`'s dtype.
    fn elements(&self, x: Value, n: i64) -> u64 {
        n as u64 * self.g.ty(x).dtype.size_bytes() as u64
    }
}
