//! Softmax cross-entropy: `cross_entropy.cu`'s forward, finalize and backward.
use super::Kernel;
use crate::cuda::program::{Arg, Place};
use crate::cuda::lower::ops::{row_threads, ROW_BLOCK};
use crate::cuda::lower::{grid_rows, LowerError, RunLowering, Saved};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{DType, Value};

impl RunLowering<'_, '_> {
    pub(crate) fn cross_entropy(
        &mut self,
        y: Value,
        logits: Value,
        labels: Value,
        ignore: i64,
    ) -> Result<(), LowerError> {
        let g = self.g;
        if g.ty(labels).dtype != DType::I64 {
            return Err(self.err(y, "labels must be i64 on the CUDA executor"));
        }
        let rows = g.ty(logits).shape.dims()[0];
        let key = (logits, labels);
        let until = self.saved_until.get(&key).copied().unwrap_or(self.unit);
        let row_max = self.arena(rows as u64 * 4, until);
        let row_inv = self.arena(rows as u64 * 4, until);
        let count = self.arena(4, until);
        let loss = self.out(y)?;
        self.cross_entropy_forward(
            y,
            logits,
            labels,
            ignore,
            Some((row_max, row_inv)),
            loss,
            count,
        )?;
        self.saved.insert(
            key,
            Saved {
                a: row_max,
                b: row_inv,
                count: Some(count),
            },
        );
        Ok(())
    }

    /// The cross-entropy forward and its finalize: the mean loss into `loss`, the counted
    /// rows into `count`, and each row's max and inverse sum into `stats` when given (the
    /// backward reads them).
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_forward(
        &mut self,
        y: Value,
        logits: Value,
        labels: Value,
        ignore: i64,
        stats: Option<(Place, Place)>,
        loss: Place,
        count: Place,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let d = g.ty(logits).shape.dims().to_vec();
        let (rows, v) = (d[0], d[1]);
        let row_loss = self.scratch(rows as u64 * 8);
        let (lp, lab) = (self.at(logits)?, self.at(labels)?);
        let bad = self.flag(y, "label", lab, v, Some(ignore));
        let (row_max, row_inv) = match stats {
            Some((m, i)) => (Arg::Ptr(m), Arg::Ptr(i)),
            None => (Arg::Null, Arg::Null),
        };
        self.launch(
            y,
            KernelId::CrossEntropy(Kernel::CrossEntropy {
                backward: false,
                logits: g.ty(logits).dtype,
            }),
            grid_rows(rows),
            (ce_block(v), 1, 1),
            vec![
                ("logits", Arg::Ptr(lp)),
                ("labels", Arg::Ptr(lab)),
                ("rows", Arg::I64(rows as i64)),
                ("v", Arg::I32(v as i32)),
                ("ld", Arg::I64(v as i64)),
                ("ignore_index", Arg::I64(ignore)),
                ("row_loss", Arg::Ptr(row_loss)),
                ("row_max", row_max),
                ("row_inv", row_inv),
                ("bad", Arg::Ptr(bad)),
            ],
        )?;
        self.cross_entropy_finalize(y, row_loss, lab, rows, ignore, loss, count)
    }

    /// The mean of the row losses over the counted rows into `loss`, their count into
    /// `count`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cross_entropy_finalize(
        &mut self,
        y: Value,
        row_loss: Place,
        labels: Place,
        rows: usize,
        ignore: i64,
        loss: Place,
        count: Place,
    ) -> Result<(), LowerError> {
        self.launch(
            y,
            KernelId::CrossEntropy(Kernel::Finalize),
            (1, 1, 1),
            (row_threads(rows, ROW_BLOCK), 1, 1),
            vec![
                ("row_loss", Arg::Ptr(row_loss)),
                ("labels", Arg::Ptr(labels)),
                ("rows", Arg::I64(rows as i64)),
                ("ignore_index", Arg::I64(ignore)),
                ("loss", Arg::Ptr(loss)),
                ("count", Arg::Ptr(count)),
            ],
        )
    }

    pub(crate) fn cross_entropy_grad(
        &mut self,
        y: Value,
        ins: &[Value],
        ignore: i64,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let (logits, labels, dloss) = (ins[0], ins[1], ins[2]);
        let d = g.ty(logits).shape.dims().to_vec();
        let (rows, v) = (d[0], d[1]);
        let saved = match self.saved.get(&(logits, labels)) {
            Some(s) => *s,
            None => {
                // No forward in this graph: run one into scratch for the count (the backward
                // then recomputes each row's statistics itself).
                let loss = self.scratch(4);
                let count = self.scratch(4);
                self.cross_entropy_forward(y, logits, labels, ignore, None, loss, count)?;
                Saved {
                    a: loss,
                    b: loss,
                    count: Some(count),
                }
            }
        };
        let recompute = saved.a == saved.b;
        let count = saved
            .count
            .ok_or_else(|| self.err(y, "cross-entropy count missing"))?;
        let (lp, lab, dl) = (self.at(logits)?, self.at(labels)?, self.at(dloss)?);
        let out = self.out(y)?;
        let (mx, inv) = if recompute {
            (Arg::Null, Arg::Null)
        } else {
            (Arg::Ptr(saved.a), Arg::Ptr(saved.b))
        };
        self.launch(
            y,
            KernelId::CrossEntropy(Kernel::CrossEntropy {
                backward: true,
                logits: g.ty(logits).dtype,
            }),
            grid_rows(rows),
            (ce_block(v), 1, 1),
            vec![
                ("logits", Arg::Ptr(lp)),
                ("labels", Arg::Ptr(lab)),
                ("rows", Arg::I64(rows as i64)),
                ("v", Arg::I32(v as i32)),
                ("ld", Arg::I64(v as i64)),
                ("ignore_index", Arg::I64(ignore)),
                ("row_max", mx),
                ("row_inv", inv),
                ("dloss", Arg::Ptr(dl)),
                ("count", Arg::Ptr(count)),
                ("dlogits", Arg::Ptr(out)),
            ],
        )
    }
}

/// Threads per row block of the cross-entropy kernels (512 for large vocabularies).
pub(crate) fn ce_block(v: usize) -> u32 {
    if v >= 16_384 {
        512
    } else {
        row_threads(v, ROW_BLOCK)
    }
}
