//! Splitting work across rayon's pool.
//!
//! Every parallel loop in the executor writes disjoint blocks of its output and computes each
//! block serially, so results do not depend on the number of threads or on work stealing.
//! Small outputs stay on the calling thread: spawning costs more than it saves.

use super::pool::Elem;
use rayon::prelude::*;

/// Work (roughly, elements touched) below which a loop runs on the calling thread.
const SERIAL_WORK: usize = 1 << 15;

/// Work per rayon task.
const GRAIN: usize = 1 << 14;

/// Calls `f(index, block)` for each consecutive `block_len`-sized block of `out` (the last one
/// may be shorter). `work_per_block` estimates the cost of one block in elements, to size the
/// tasks; blocks are grouped so each task does about [`GRAIN`] work.
pub fn for_each_block<T, F>(out: &mut [T], block_len: usize, work_per_block: usize, f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync,
{
    if out.is_empty() || block_len == 0 {
        return;
    }
    let blocks = out.len().div_ceil(block_len);
    let work = work_per_block.max(1);
    if blocks == 1 || blocks.saturating_mul(work) < SERIAL_WORK {
        for (i, b) in out.chunks_mut(block_len).enumerate() {
            f(i, b);
        }
        return;
    }
    let per_task = (GRAIN / work).max(1);
    out.par_chunks_mut(block_len * per_task)
        .enumerate()
        .for_each(|(t, chunk)| {
            for (i, b) in chunk.chunks_mut(block_len).enumerate() {
                f(t * per_task + i, b);
            }
        });
}

/// Calls `f(start, chunk)` over `out` in chunks, where `start` is the chunk's offset: for
/// pointwise loops, whose cost is one unit per element.
pub fn for_each_chunk<T, F>(out: &mut [T], f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync,
{
    for_each_block(out, GRAIN, GRAIN, |i, chunk| f(i * GRAIN, chunk));
}

/// A copy of `src`, made in parallel when it is large.
pub fn copy<T: Elem>(src: &[T]) -> Vec<T> {
    if src.len() < SERIAL_WORK {
        return src.to_vec();
    }
    let mut out = T::buffer(src.len());
    for_each_chunk(&mut out, |start, chunk| {
        chunk.copy_from_slice(&src[start..start + chunk.len()])
    });
    out
}
