//! Row gathers from an embedding table.

use super::par::for_each_block;
use super::pool;

/// An id outside `[0, V)`: its position in the ids tensor and its value.
pub struct BadId {
    pub position: usize,
    pub id: i64,
}

/// `out[i] = table[ids[i]]` for a `[v, h]` table. Every id is checked before anything is
/// copied.
pub fn embedding(table: &[f32], v: usize, h: usize, ids: &[i64]) -> Result<Vec<f32>, BadId> {
    if let Some((position, &id)) = ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| usize::try_from(id).map_or(true, |i| i >= v))
    {
        return Err(BadId { position, id });
    }
    let mut out = pool::buffer(ids.len() * h);
    for_each_block(&mut out, h, h, |i, dst| {
        let row = ids[i] as usize;
        dst.copy_from_slice(&table[row * h..(row + 1) * h]);
    });
    Ok(out)
}
