//! `embedding.cu`: the lookup and the count, scan, fill, accumulate steps of its backward.

use crate::cuda::emulate::contracts::{checked, one_block, row_block};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::{BackwardStage, Kernel};

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::Forward { table } => embedding_fwd(m, l, table),
        Kernel::Backward(BackwardStage::Count) => embedding_bwd_count(m, l),
        Kernel::Backward(BackwardStage::Scan) => embedding_bwd_scan(m, l),
        Kernel::Backward(BackwardStage::Fill) => embedding_bwd_fill(m, l),
        Kernel::BackwardAccumulate { grad, out } => embedding_bwd_accumulate(m, l, grad, out),
    }
}

pub(crate) fn embedding_fwd(m: &Mem, l: &Launch, t: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let table = a.need(m, "table")?;
    let ids = a.need(m, "ids")?;
    let out = a.need(m, "out")?;
    let n = a.count("n")?;
    let v = a.count("v")?;
    let h = a.count32("h")?;
    let bad = a.ptr(m, "bad")?;
    a.end()?;
    let st = t.size_bytes();
    let row = (h * st) as u64;
    checked(
        m,
        vec![
            use_("table", Some(table), v as u64 * row, st, Io::R),
            use_("ids", Some(ids), n as u64 * 8, 8, Io::R),
            use_("out", Some(out), n as u64 * row, st, Io::W),
            use_("bad", bad, 4, 4, Io::Rw),
        ],
        &[],
    )
}

pub(crate) fn embedding_bwd_count(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let ids = a.need(m, "ids")?;
    let n = a.count("n")?;
    let v = a.count("v")?;
    let counts = a.need(m, "counts")?;
    let bad = a.ptr(m, "bad")?;
    a.end()?;
    checked(
        m,
        vec![
            use_("ids", Some(ids), n as u64 * 8, 8, Io::R),
            use_("counts", Some(counts), v as u64 * 4, 4, Io::Rw),
            use_("bad", bad, 4, 4, Io::Rw),
        ],
        &[],
    )
}

pub(crate) fn embedding_bwd_scan(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    row_block(l)?;
    one_block(l)?;
    let mut a = Args::new(l);
    let counts = a.need(m, "counts")?;
    let v = a.count("v")?;
    let starts = a.need(m, "starts")?;
    a.end()?;
    checked(
        m,
        vec![
            use_("counts", Some(counts), v as u64 * 4, 4, Io::R),
            use_("starts", Some(starts), (v as u64 + 1) * 4, 4, Io::W),
        ],
        &[],
    )
}

pub(crate) fn embedding_bwd_fill(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    row_block(l)?;
    let mut a = Args::new(l);
    let ids = a.need(m, "ids")?;
    let n = a.count("n")?;
    let v = a.count("v")?;
    let starts = a.need(m, "starts")?;
    let positions = a.need(m, "positions")?;
    a.end()?;
    // Block b owns ids [256 b, 256 b + 256): not grid-stride.
    let covered = l.grid.0 as usize * 256;
    if covered < v {
        return Err(format!(
            "grid {:?} covers ids below {covered}, the vocabulary has {v}",
            l.grid
        ));
    }
    checked(
        m,
        vec![
            use_("ids", Some(ids), n as u64 * 8, 8, Io::R),
            use_("starts", Some(starts), (v as u64 + 1) * 4, 4, Io::R),
            use_("positions", Some(positions), n as u64 * 4, 4, Io::W),
        ],
        &[],
    )
}

pub(crate) fn embedding_bwd_accumulate(m: &Mem, l: &Launch, t: DType, o: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let dy = a.need(m, "dy")?;
    let positions = a.need(m, "positions")?;
    let starts = a.need(m, "starts")?;
    let v = a.count("v")?;
    let h = a.count32("h")?;
    let dtable = a.need(m, "dtable")?;
    a.end()?;
    // The positions read are the first `starts[v]` (the fill wrote them), and the rows of `dy`
    // read are the ones they name.
    let n = m
        .i32_at(starts, v as i64)
        .map_err(|e| format!("`starts`: {e}"))?;
    let n = usize::try_from(n).map_err(|_| format!("`starts` ends at {n}"))?;
    let mut rows = 0usize;
    for s in 0..n as i64 {
        let p = m
            .i32_at(positions, s)
            .map_err(|e| format!("`positions`: {e}"))?;
        let p = usize::try_from(p).map_err(|_| format!("`positions` holds {p}"))?;
        rows = rows.max(p + 1);
    }
    let (st, so) = (t.size_bytes(), o.size_bytes());
    checked(
        m,
        vec![
            use_("dy", Some(dy), (rows * h * st) as u64, st, Io::R),
            use_("positions", Some(positions), n as u64 * 4, 4, Io::R),
            use_("starts", Some(starts), (v as u64 + 1) * 4, 4, Io::R),
            use_("dtable", Some(dtable), (v * h * so) as u64, so, Io::W),
        ],
        &[],
    )
}
