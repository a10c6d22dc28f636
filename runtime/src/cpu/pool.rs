//! Recycling large F32 buffers within one run.
//!
//! A fresh multi-megabyte allocation is mapped lazily by the OS, and first touching it costs a
//! page fault per 4 KiB (zeroed by the kernel): for attention scores and logits that is a
//! tenth of the run. A transformer's forward pass frees and then needs buffers of the same
//! sizes in every layer, so the executor hands dead values' buffers back here and kernels take
//! them for outputs of the same length. The pool lives for one run (a [`Scope`]) on the thread
//! that runs the graph, holds at most [`MAX_BYTES`], and is emptied when the run ends.

use std::cell::RefCell;
use std::collections::HashMap;

/// Buffers shorter than this come from the allocator's free lists anyway.
const MIN_LEN: usize = 1 << 16;

/// The most the pool keeps, in bytes.
const MAX_BYTES: usize = 1 << 30;

#[derive(Default)]
struct Pool {
    /// Free buffers by length.
    free: HashMap<usize, Vec<Vec<f32>>>,
    bytes: usize,
    active: bool,
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// Enables the pool on this thread until dropped, then frees what it holds.
pub struct Scope(());

impl Scope {
    pub fn enter() -> Scope {
        POOL.with(|p| p.borrow_mut().active = true);
        Scope(())
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        POOL.with(|p| *p.borrow_mut() = Pool::default());
    }
}

/// A buffer of `len` elements whose contents are unspecified (a recycled buffer keeps its old
/// values): for kernels that overwrite every element.
pub fn buffer(len: usize) -> Vec<f32> {
    let reused = if len >= MIN_LEN {
        POOL.with(|p| {
            let mut p = p.borrow_mut();
            let v = p.free.get_mut(&len).and_then(Vec::pop);
            if v.is_some() {
                p.bytes -= len * 4;
            }
            v
        })
    } else {
        None
    };
    reused.unwrap_or_else(|| vec![0.0; len])
}

/// Gives a dead value's buffer back for reuse.
pub fn recycle(v: Vec<f32>) {
    let len = v.len();
    if len < MIN_LEN || v.capacity() != len {
        return;
    }
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        if p.active && p.bytes + len * 4 <= MAX_BYTES {
            p.bytes += len * 4;
            p.free.entry(len).or_default().push(v);
        }
    });
}

/// Element types the kernels store, with how to get an output buffer of each (F32 ones come
/// from the pool).
pub trait Elem: Copy + Default + Send + Sync {
    /// `len` elements with unspecified contents, for kernels that overwrite all of them.
    fn buffer(len: usize) -> Vec<Self>;
}

impl Elem for f32 {
    fn buffer(len: usize) -> Vec<f32> {
        buffer(len)
    }
}

impl Elem for i64 {
    fn buffer(len: usize) -> Vec<i64> {
        vec![0; len]
    }
}

impl Elem for bool {
    fn buffer(len: usize) -> Vec<bool> {
        vec![false; len]
    }
}

impl Elem for u8 {
    fn buffer(len: usize) -> Vec<u8> {
        vec![0; len]
    }
}
