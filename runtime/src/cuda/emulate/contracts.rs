//! What each kernel may touch: for every entry point, its arguments read by name and type, the
//! launch shape its header requires, and the buffers it reads and writes (how many bytes from
//! each pointer, and which in-place uses its header allows), checked against the program's
//! memory before the real kernel runs. One submodule per kernel file (or family of files), and
//! `generated` for the kernels the fusion pass writes.
//!
//! These are the header comments' contracts, not the kernels' arithmetic: the kernels
//! themselves run from their sources (`super::launch`).

pub(crate) use crate::cuda::families::pointwise::contract::generated;

use super::args::Args;
use super::memory::{check_uses, ranges_use, Io, Mem, Ptr, Use};
use super::R;
use crate::cuda::kernel_id::KernelId;
use crate::cuda::program::Launch;

/// Kernels whose block reductions need `blockDim = (32 k, 1, 1)`, `k <= 32`.
pub(crate) fn row_block(l: &Launch) -> R<()> {
    let (bx, by, bz) = l.block;
    if bx % 32 != 0 || by != 1 || bz != 1 {
        return Err(format!(
            "block {:?}: the kernel needs blockDim.x a multiple of 32 (at most 1024) and a 1-D \
             block",
            l.block
        ));
    }
    Ok(())
}

/// Kernels that declare no dynamic shared memory.
pub(crate) fn no_dynamic_shared(l: &Launch) -> R<()> {
    if l.shared_bytes != 0 {
        return Err(format!(
            "{} bytes of dynamic shared memory: the kernel declares none",
            l.shared_bytes
        ));
    }
    Ok(())
}

/// Kernels documented as one block.
pub(crate) fn one_block(l: &Launch) -> R<()> {
    if l.grid != (1, 1, 1) {
        return Err(format!("grid {:?}: the kernel runs as one block", l.grid));
    }
    Ok(())
}

/// The uses that exist, checked to lie in their buffers and not to overlap except as
/// `in_place` allows.
pub(crate) fn checked(m: &Mem, uses: Vec<Option<Use>>, in_place: &[(&str, &str)]) -> R<Vec<Use>> {
    check_uses(m, &uses, in_place)?;
    Ok(uses.into_iter().flatten().collect())
}

/// The buffers a launch of a kernel family's entry point uses: its kernel id's contract.
pub(crate) fn builtin(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let kernel = l
        .kernel
        .ok_or_else(|| format!("the launch of `{}` names no kernel id", l.entry))?;
    // Only the attention kernels declare dynamic shared memory.
    if !matches!(kernel, KernelId::Attention(_)) {
        no_dynamic_shared(l)?;
    }
    kernel.uses(m, l)
}

/// Where a kernel's operand read or written in place is (`attention.cu`'s AttStrides,
/// `rope.cu`'s RopeStrides): batch `b` at `(b / heads) batch + (b % heads) head`, its rows
/// `row` elements apart, each of `d` contiguous elements (all in elements).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strides {
    batch: i64,
    head: i64,
    row: i64,
}

impl Strides {
    /// `X_batch`, `X_head`, `X_row` of operand `x`.
    pub(crate) fn read(a: &mut Args, x: &str) -> R<Strides> {
        let st = Strides {
            batch: a.i32(&format!("{x}_batch"))?.into(),
            head: a.i32(&format!("{x}_head"))?.into(),
            row: a.i32(&format!("{x}_row"))?.into(),
        };
        if st.batch < 0 || st.head < 0 || st.row < 0 {
            return Err(format!("`{x}`: negative strides {st:?}"));
        }
        Ok(st)
    }

    /// The use of `batches` batches (split by `heads`) of `rows` rows of `d` elements: the
    /// rows it touches, one range each.
    pub(crate) fn use_of(
        &self,
        what: &str,
        p: Ptr,
        (batches, heads, rows, d): (usize, usize, usize, usize),
        elem: usize,
        io: Io,
    ) -> R<Option<Use>> {
        if heads == 0 {
            return Err(format!("`{what}`: heads 0"));
        }
        let e = elem as u64;
        let mut ranges = Vec::with_capacity(batches * rows);
        for b in 0..batches {
            let base = (b / heads) as i64 * self.batch + (b % heads) as i64 * self.head;
            for r in 0..rows {
                let at = (base + r as i64 * self.row) as u64;
                ranges.push((at * e, d as u64 * e));
            }
        }
        Ok(ranges_use(what, p, ranges, elem, io))
    }
}
