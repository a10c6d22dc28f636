//! `cross_entropy.cu`: the fused log-softmax + NLL forward, its finalize, and its backward.

use super::{checked, one_block, row_block};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;

pub(super) fn cross_entropy_fwd(m: &Mem, l: &Launch, t: DType) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let logits = a.need(m, "logits")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let v = a.count32("v")?;
    a.i64("ignore_index")?;
    let row_loss = a.need(m, "row_loss")?;
    let row_max = a.ptr(m, "row_max")?;
    let row_inv = a.ptr(m, "row_inv")?;
    let bad = a.ptr(m, "bad")?;
    a.end()?;
    let st = t.size_bytes();
    checked(
        m,
        vec![
            use_("logits", Some(logits), (rows * v * st) as u64, st, Io::R),
            use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
            use_("row_loss", Some(row_loss), rows as u64 * 8, 8, Io::W),
            use_("row_max", row_max, rows as u64 * 4, 4, Io::W),
            use_("row_inv", row_inv, rows as u64 * 4, 4, Io::W),
            use_("bad", bad, 4, 4, Io::Rw),
        ],
        &[],
    )
}

pub(super) fn cross_entropy_finalize(m: &Mem, l: &Launch) -> R<Vec<Use>> {
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

pub(super) fn cross_entropy_bwd(m: &Mem, l: &Launch, t: DType) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let logits = a.need(m, "logits")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let v = a.count32("v")?;
    a.i64("ignore_index")?;
    let row_max = a.ptr(m, "row_max")?;
    let row_inv = a.ptr(m, "row_inv")?;
    let dloss = a.need(m, "dloss")?;
    let count = a.need(m, "count")?;
    let dlogits = a.need(m, "dlogits")?;
    a.end()?;
    let st = t.size_bytes();
    let big = (rows * v * st) as u64;
    checked(
        m,
        vec![
            use_("logits", Some(logits), big, st, Io::R),
            use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
            use_("row_max", row_max, rows as u64 * 4, 4, Io::R),
            use_("row_inv", row_inv, rows as u64 * 4, 4, Io::R),
            use_("dloss", Some(dloss), 4, 4, Io::R),
            use_("count", Some(count), 4, 4, Io::R),
            use_("dlogits", Some(dlogits), big, st, Io::W),
        ],
        &[("dlogits", "logits")],
    )
}
