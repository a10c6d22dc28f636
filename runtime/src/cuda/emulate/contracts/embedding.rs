//! `embedding.cu`: the lookup and the count, scan, fill, accumulate steps of its backward.

use super::{one_block, row_block};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{check_uses, use_, Io, Mem};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use std::collections::HashMap;

pub(super) fn embedding_fwd(m: &mut Mem, l: &Launch, t: DType) -> R<()> {
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
    check_uses(
        m,
        &[
            use_("table", Some(table), v as u64 * row, st, Io::R),
            use_("ids", Some(ids), n as u64 * 8, 8, Io::R),
            use_("out", Some(out), n as u64 * row, st, Io::W),
            use_("bad", bad, 4, 4, Io::Rw),
        ],
        &[],
    )?;
    for i in 0..n as i64 {
        let id = m.i64_at(ids, i)?;
        let bytes = if id < 0 || id >= v as i64 {
            m.report_bad(bad, i)?;
            let mut z = Vec::new();
            for _ in 0..h {
                z.extend(match t {
                    DType::F32 => 0f32.to_le_bytes().to_vec(),
                    _ => vec![0, 0],
                });
            }
            z
        } else {
            m.bytes(table, id * row as i64, row)?.to_vec()
        };
        m.bytes_mut(out, i * row as i64, row)?
            .copy_from_slice(&bytes);
    }
    Ok(())
}

pub(super) fn embedding_bwd_count(m: &mut Mem, l: &Launch) -> R<()> {
    let mut a = Args::new(l);
    let ids = a.need(m, "ids")?;
    let n = a.count("n")?;
    let v = a.count("v")?;
    let counts = a.need(m, "counts")?;
    let bad = a.ptr(m, "bad")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("ids", Some(ids), n as u64 * 8, 8, Io::R),
            use_("counts", Some(counts), v as u64 * 4, 4, Io::Rw),
            use_("bad", bad, 4, 4, Io::Rw),
        ],
        &[],
    )?;
    for i in 0..n as i64 {
        let id = m.i64_at(ids, i)?;
        if id < 0 || id >= v as i64 {
            m.report_bad(bad, i)?;
        } else {
            let c = m.i32_at(counts, id)?;
            m.set_i32(counts, id, c.wrapping_add(1))?;
        }
    }
    Ok(())
}

pub(super) fn embedding_bwd_scan(m: &mut Mem, l: &Launch) -> R<()> {
    row_block(l)?;
    one_block(l)?;
    let mut a = Args::new(l);
    let counts = a.need(m, "counts")?;
    let v = a.count("v")?;
    let starts = a.need(m, "starts")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("counts", Some(counts), v as u64 * 4, 4, Io::R),
            use_("starts", Some(starts), (v as u64 + 1) * 4, 4, Io::W),
        ],
        &[],
    )?;
    let mut run = 0i32;
    for k in 0..v as i64 {
        let c = m.i32_at(counts, k)?;
        m.set_i32(starts, k, run)?;
        run = run.wrapping_add(c);
    }
    m.set_i32(starts, v as i64, run)
}

pub(super) fn embedding_bwd_fill(m: &mut Mem, l: &Launch) -> R<()> {
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
    check_uses(
        m,
        &[
            use_("ids", Some(ids), n as u64 * 8, 8, Io::R),
            use_("starts", Some(starts), (v as u64 + 1) * 4, 4, Io::R),
            use_("positions", Some(positions), n as u64 * 4, 4, Io::W),
        ],
        &[],
    )?;
    let mut cursor: HashMap<i64, i64> = HashMap::new();
    for p in 0..n as i64 {
        let id = m.i64_at(ids, p)?;
        if id < 0 || id >= v as i64 {
            continue;
        }
        let slot = match cursor.get(&id) {
            Some(&c) => c,
            None => i64::from(m.i32_at(starts, id)?),
        };
        m.set_i32(positions, slot, p as i32)
            .map_err(|e| format!("`positions` for id {id}: {e}"))?;
        cursor.insert(id, slot + 1);
    }
    Ok(())
}

pub(super) fn embedding_bwd_accumulate(m: &mut Mem, l: &Launch, t: DType, o: DType) -> R<()> {
    let mut a = Args::new(l);
    let dy = a.need(m, "dy")?;
    let positions = a.need(m, "positions")?;
    let starts = a.need(m, "starts")?;
    let v = a.count("v")?;
    let h = a.count32("h")?;
    let dtable = a.need(m, "dtable")?;
    a.end()?;
    let so = o.size_bytes();
    check_uses(
        m,
        &[
            use_("starts", Some(starts), (v as u64 + 1) * 4, 4, Io::R),
            use_("dtable", Some(dtable), (v * h * so) as u64, so, Io::W),
        ],
        &[],
    )?;
    for k in 0..v as i64 {
        let (s0, s1) = (m.i32_at(starts, k)?, m.i32_at(starts, k + 1)?);
        let mut acc = vec![0f64; h];
        for s in s0..s1 {
            let p = i64::from(m.i32_at(positions, i64::from(s))?);
            for (j, x) in m.fv(dy, p * h as i64, h, t)?.into_iter().enumerate() {
                acc[j] += f64::from(x);
            }
        }
        let row: Vec<f32> = acc.into_iter().map(|x| x as f32).collect();
        m.set_fv(dtable, k * h as i64, o, &row)?;
    }
    Ok(())
}
