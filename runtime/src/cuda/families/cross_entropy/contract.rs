//! `cross_entropy.cu`: the fused log-softmax + NLL forward, its finalize, and its backward.

use crate::cuda::emulate::contracts::{checked, one_block, row_block};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{rows_use, use_, Io, Mem, Ptr, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::Kernel;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::CrossEntropy {
            backward: false,
            logits,
        } => cross_entropy_fwd(m, l, logits),
        Kernel::CrossEntropy {
            backward: true,
            logits,
        } => cross_entropy_bwd(m, l, logits),
        Kernel::Finalize => cross_entropy_finalize(m, l),
    }
}

pub(crate) fn cross_entropy_fwd(m: &Mem, l: &Launch, t: DType) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let logits = a.need(m, "logits")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let v = a.count32("v")?;
    let ld = row_stride(&mut a, v)?;
    a.i64("ignore_index")?;
    let row_loss = a.need(m, "row_loss")?;
    let row_max = a.ptr(m, "row_max")?;
    let row_inv = a.ptr(m, "row_inv")?;
    let bad = a.ptr(m, "bad")?;
    a.end()?;
    let st = t.size_bytes();
    let mut uses = rows_of("logits", logits, (rows, v, ld), st, Io::R);
    uses.extend([
        use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
        use_("row_loss", Some(row_loss), rows as u64 * 8, 8, Io::W),
        use_("row_max", row_max, rows as u64 * 4, 4, Io::W),
        use_("row_inv", row_inv, rows as u64 * 4, 4, Io::W),
        use_("bad", bad, 4, 4, Io::Rw),
    ]);
    checked(m, uses, &[])
}

pub(crate) fn cross_entropy_finalize(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    row_block(l)?;
    one_block(l)?;
    let mut a = Args::new(l);
    let row_loss = a.need(m, "row_loss")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    a.i64("ignore_index")?;
    let loss = a.need(m, "loss")?;
    let count = a.need(m, "count")?;
    a.end()?;
    checked(
        m,
        vec![
            use_("row_loss", Some(row_loss), rows as u64 * 8, 8, Io::R),
            use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
            use_("loss", Some(loss), 4, 4, Io::W),
            use_("count", Some(count), 4, 4, Io::W),
        ],
        &[],
    )
}

pub(crate) fn cross_entropy_bwd(m: &Mem, l: &Launch, t: DType) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let logits = a.need(m, "logits")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let v = a.count32("v")?;
    let ld = row_stride(&mut a, v)?;
    a.i64("ignore_index")?;
    let row_max = a.ptr(m, "row_max")?;
    let row_inv = a.ptr(m, "row_inv")?;
    let dloss = a.need(m, "dloss")?;
    let count = a.need(m, "count")?;
    let dlogits = a.need(m, "dlogits")?;
    a.end()?;
    let st = t.size_bytes();
    let mut uses = rows_of("logits", logits, (rows, v, ld), st, Io::R);
    // Whole rows: the padding past v is written 0.
    uses.extend(rows_of("dlogits", dlogits, (rows, ld, ld), st, Io::W));
    uses.extend([
        use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
        use_("row_max", row_max, rows as u64 * 4, 4, Io::R),
        use_("row_inv", row_inv, rows as u64 * 4, 4, Io::R),
        use_("dloss", Some(dloss), 4, 4, Io::R),
        use_("count", Some(count), 4, 4, Io::R),
    ]);
    checked(m, uses, &[("dlogits", "logits")])
}

/// The logits' row stride `ld`, which must leave room for a row of `v`.
fn row_stride(a: &mut Args, v: usize) -> R<usize> {
    let ld = a.count("ld")?;
    if ld < v {
        return Err(format!("ld {ld} is shorter than a row of {v}"));
    }
    Ok(ld)
}

/// `rows` rows of `v` elements `ld` apart from `p`, the padding between them untouched.
fn rows_of(
    what: &str,
    p: Ptr,
    (rows, v, ld): (usize, usize, usize),
    st: usize,
    io: Io,
) -> Vec<Option<Use>> {
    vec![rows_use(
        what,
        p,
        (rows as u64, (v * st) as u64, (ld * st) as u64),
        st,
        io,
    )]
}
