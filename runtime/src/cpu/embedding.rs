//! Row gathers from an embedding table, and their transpose, the scatter-add of gradient rows.

use super::par::for_each_block;
use super::pool;

/// An id outside `[0, V)`: its position in the ids tensor and its value.
pub struct BadId {
    pub position: usize,
    pub id: i64,
}

/// The first id outside `[0, v)`, if any.
fn check(ids: &[i64], v: usize) -> Result<(), BadId> {
    match ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| usize::try_from(id).map_or(true, |i| i >= v))
    {
        Some((position, &id)) => Err(BadId { position, id }),
        None => Ok(()),
    }
}

/// `out[i] = table[ids[i]]` for a `[v, h]` table. Every id is checked before anything is
/// copied.
pub fn embedding(table: &[f32], v: usize, h: usize, ids: &[i64]) -> Result<Vec<f32>, BadId> {
    check(ids, v)?;
    let mut out = pool::buffer(ids.len() * h);
    for_each_block(&mut out, h, h, |i, dst| {
        let row = ids[i] as usize;
        dst.copy_from_slice(&table[row * h..(row + 1) * h]);
    });
    Ok(out)
}

/// The gradient of the gather: a `[v, h]` table whose row `k` is the sum of the rows of `dy`
/// (`[ids.len(), h]`) whose id is `k`, zero for ids that do not occur. Each output row is
/// summed in F64 over its positions in increasing order, one row per task, so the result does
/// not depend on the thread count. Every id is checked first.
pub fn embedding_grad(ids: &[i64], dy: &[f32], v: usize, h: usize) -> Result<Vec<f32>, BadId> {
    check(ids, v)?;
    // The positions of each id, in order (a counting sort): `positions[starts[k]..starts[k + 1]]`.
    let mut starts = vec![0usize; v + 1];
    for &id in ids {
        starts[id as usize + 1] += 1;
    }
    for k in 0..v {
        starts[k + 1] += starts[k];
    }
    let mut next = starts.clone();
    let mut positions = vec![0usize; ids.len()];
    for (p, &id) in ids.iter().enumerate() {
        positions[next[id as usize]] = p;
        next[id as usize] += 1;
    }
    let mut out = pool::buffer(v * h);
    let work = h * (1 + ids.len() / v.max(1));
    for_each_block(&mut out, h, work, |k, dst| {
        match &positions[starts[k]..starts[k + 1]] {
            [] => dst.fill(0.0),
            [p] => dst.copy_from_slice(&dy[p * h..(p + 1) * h]),
            rows => {
                let mut acc = vec![0f64; h];
                for &p in rows {
                    for (a, &d) in acc.iter_mut().zip(&dy[p * h..(p + 1) * h]) {
                        *a += f64::from(d);
                    }
                }
                for (o, a) in dst.iter_mut().zip(acc) {
                    *o = a as f32;
                }
            }
        }
    });
    Ok(out)
}
