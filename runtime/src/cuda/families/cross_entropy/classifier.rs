//! The fused classifier (`linear_cross_entropy` and its gradient), chunk by chunk: per chunk of
//! rows a cuBLAS product into one chunk-sized logits buffer and `cross_entropy.cu`'s row
//! kernels on it, so no `[rows, vocab]` buffer exists. The forward keeps each row's max and
//! inverse sum for the backward; the backward recomputes a chunk's logits, turns them into
//! `dlogits` in place, then `dhidden = dlogits @ weight` into the chunk's rows and
//! `dweight += dlogits^T @ hidden` (the first chunk writes, the others accumulate).

use super::Kernel;
use crate::cuda::program::{Arg, Command, Gemm, Place};
use super::lower::ce_block;
use crate::cuda::lower::{gemm, grid_rows, LowerError, RunLowering, Saved};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{Accum, DType, Node, Op, Shape, Value};

/// A chunk's logits rows start every this many elements (128 bytes in BF16): with GPT-2's
/// 50,257-token vocabulary a packed row would start at an odd element, so the products that
/// write and read the chunk (ldc, lda of 50,257) could not use cuBLAS's 16-byte-aligned tensor
/// core kernels (the first GPU profile measured the three head products at 17.2 ms of a
/// 65.5 ms GPT-2 124M step), and the cross-entropy kernels could vectorize only every eighth
/// row. The padding columns hold 0: the products read a weight padded with zero rows as well
/// (see `head_weight`), and the cross-entropy gradient writes 0 there.
const LOGITS_ROW_ALIGN: usize = 64;

/// A classifier node's operands and shapes.
struct Problem {
    hidden: Value,
    weight: Value,
    labels: Value,
    rows: usize,
    width: usize,
    vocab: usize,
    /// The row stride of a chunk's logits: the vocabulary rounded up to [`LOGITS_ROW_ALIGN`].
    ld: usize,
    chunk: usize,
    ignore: i64,
    logits: DType,
    tf32: bool,
}

impl RunLowering<'_, '_> {
    fn classifier_problem(&self, n: Node) -> Result<Problem, LowerError> {
        let g = self.g;
        let node = g.node(n);
        let y = node.outputs[0];
        let (ignore, chunk, logits) = match node.op {
            Op::LinearCrossEntropy {
                ignore_index,
                chunk_rows,
                logits,
            }
            | Op::LinearCrossEntropyGrad {
                ignore_index,
                chunk_rows,
                logits,
            }
            | Op::LinearCrossEntropyStep {
                ignore_index,
                chunk_rows,
                logits,
            } => (ignore_index, chunk_rows, logits),
            _ => return Err(self.err(y, "not a classifier node")),
        };
        let (hidden, weight, labels) = (node.inputs[0], node.inputs[1], node.inputs[2]);
        if g.ty(labels).dtype != DType::I64 {
            return Err(self.err(y, "labels must be i64 on the CUDA executor"));
        }
        if logits != g.ty(weight).dtype {
            return Err(self.err(
                y,
                format!(
                    "the fused classifier's logits ({logits}) must be in the weight's dtype ({}) \
                     on the CUDA executor",
                    g.ty(weight).dtype
                ),
            ));
        }
        let wd = g.ty(weight).shape.dims();
        Ok(Problem {
            hidden,
            weight,
            labels,
            rows: g.ty(hidden).shape.dims()[0],
            width: wd[1],
            vocab: wd[0],
            ld: wd[0].next_multiple_of(LOGITS_ROW_ALIGN),
            chunk: chunk.max(1),
            ignore,
            logits,
            tf32: node.acc == Some(Accum::Tf32),
        })
    }

    /// The chunks' first rows and lengths, in order.
    fn chunks(p: &Problem) -> Vec<(usize, usize)> {
        (0..p.rows)
            .step_by(p.chunk)
            .map(|r| (r, p.chunk.min(p.rows - r)))
            .collect()
    }

    /// The weight the chunks' products read: the node's own when the vocabulary is a
    /// multiple of [`LOGITS_ROW_ALIGN`], else a scratch copy with zero rows up to `ld`, so that
    /// the forward product's M and the input gradient's K are `ld` (cuBLAS's aligned kernels:
    /// the second GPU profile measured those two products at 92 TFLOP/s with M or K = 50,257)
    /// and the padded logits are exactly 0.
    fn head_weight(&mut self, p: &Problem) -> Result<Place, LowerError> {
        let w = self.at(p.weight)?;
        if p.ld == p.vocab {
            return Ok(w);
        }
        let row = (p.width * self.g.ty(p.weight).dtype.size_bytes()) as u64;
        let padded = self.scratch(p.ld as u64 * row);
        self.commands.push(Command::Copy {
            dst: padded,
            src: w,
            bytes: p.vocab as u64 * row,
        });
        self.commands.push(Command::Memset {
            dst: padded.plus(p.vocab as u64 * row),
            bytes: (p.ld - p.vocab) as u64 * row,
            byte: 0,
        });
        Ok(padded)
    }

    /// The product of rows `[first, first + len)` of hidden with the (padded) weight `w`, into
    /// `buf`: `len` rows of `ld` logits, the last `ld - vocab` of each 0.
    fn chunk_logits(
        &mut self,
        y: Value,
        p: &Problem,
        (first, len): (usize, usize),
        (w, buf): (Place, Place),
    ) -> Result<(), LowerError> {
        let g = self.g;
        let hd = g.ty(p.hidden).dtype;
        let h = self
            .at(p.hidden)?
            .plus((first * p.width * hd.size_bytes()) as u64);
        let gm = gemm::matmul(
            g.name(y),
            (h, &Shape::from(vec![len, p.width]), hd),
            (w, &Shape::from(vec![p.ld, p.width]), g.ty(p.weight).dtype),
            (buf, p.logits),
            false,
            true,
            p.tf32,
        )
        .map_err(|m| self.err(y, m))?;
        let gm = with_row_stride(gm, buf, p.ld).map_err(|m| self.err(y, m))?;
        self.commands.extend(gm.into_iter().map(Command::Gemm));
        Ok(())
    }

    /// Every chunk's logits and row statistics, then the mean loss into `loss` and the counted
    /// rows into `count`; the statistics into `stats` (`[rows]` F32 each).
    fn classifier_forward(
        &mut self,
        y: Value,
        p: &Problem,
        (row_max, row_inv): (Place, Place),
        loss: Place,
        count: Place,
    ) -> Result<(), LowerError> {
        let w = self.head_weight(p)?;
        let buf = self.scratch((p.chunk * p.ld * p.logits.size_bytes()) as u64);
        let row_loss = self.scratch(p.rows as u64 * 8);
        let lab = self.at(p.labels)?;
        for (first, len) in Self::chunks(p) {
            self.chunk_logits(y, p, (first, len), (w, buf))?;
            let labels = lab.plus(first as u64 * 8);
            let bad = self.chunk_flag(y, "label", (labels, first), p.vocab, Some(p.ignore));
            self.launch(
                y,
                KernelId::CrossEntropy(Kernel::CrossEntropy {
                    backward: false,
                    logits: p.logits,
                }),
                grid_rows(len),
                (ce_block(p.vocab), 1, 1),
                vec![
                    ("logits", Arg::Ptr(buf)),
                    ("labels", Arg::Ptr(labels)),
                    ("rows", Arg::I64(len as i64)),
                    ("v", Arg::I32(p.vocab as i32)),
                    ("ld", Arg::I64(p.ld as i64)),
                    ("ignore_index", Arg::I64(p.ignore)),
                    ("row_loss", Arg::Ptr(row_loss.plus(first as u64 * 8))),
                    ("row_max", Arg::Ptr(row_max.plus(first as u64 * 4))),
                    ("row_inv", Arg::Ptr(row_inv.plus(first as u64 * 4))),
                    ("bad", Arg::Ptr(bad)),
                ],
            )?;
        }
        self.cross_entropy_finalize(y, row_loss, lab, p.rows, p.ignore, loss, count)
    }

    pub(crate) fn linear_cross_entropy(&mut self, n: Node) -> Result<(), LowerError> {
        let p = self.classifier_problem(n)?;
        let y = self.g.node(n).outputs[0];
        let key = (p.hidden, p.labels);
        let until = self.saved_until.get(&key).copied().unwrap_or(self.unit);
        let stats = (
            self.arena(p.rows as u64 * 4, until),
            self.arena(p.rows as u64 * 4, until),
        );
        let count = self.arena(4, until);
        let loss = self.out(y)?;
        self.classifier_forward(y, &p, stats, loss, count)?;
        self.saved.insert(
            key,
            Saved {
                a: stats.0,
                b: stats.1,
                count: Some(count),
            },
        );
        Ok(())
    }

    pub(crate) fn linear_cross_entropy_grad(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let p = self.classifier_problem(n)?;
        let node = g.node(n);
        let (dh, dw) = (node.outputs[0], node.outputs[1]);
        let dloss = self.at(node.inputs[3])?;
        let saved = match self.saved.get(&(p.hidden, p.labels)) {
            Some(s) => *s,
            None => {
                // No forward in this graph: run it into scratch for the statistics and count.
                let stats = (
                    self.scratch(p.rows as u64 * 4),
                    self.scratch(p.rows as u64 * 4),
                );
                let (loss, count) = (self.scratch(4), self.scratch(4));
                self.classifier_forward(dh, &p, stats, loss, count)?;
                Saved {
                    a: stats.0,
                    b: stats.1,
                    count: Some(count),
                }
            }
        };
        let count = saved
            .count
            .ok_or_else(|| self.err(dh, "the classifier's count is missing"))?;
        let w = self.head_weight(&p)?;
        let buf = self.scratch((p.chunk * p.ld * p.logits.size_bytes()) as u64);
        for chunk in Self::chunks(&p) {
            self.chunk_logits(dh, &p, chunk, (w, buf))?;
            self.chunk_backward(
                &p,
                chunk,
                (w, buf),
                (saved.a, saved.b),
                (dloss, count),
                (dh, dw),
            )?;
        }
        Ok(())
    }

    /// A training step's head (`linear_cross_entropy_step`): the count of labelled rows
    /// first (the gradient's scale needs it before the first chunk), then per chunk the
    /// logits once, the forward row kernel (losses and statistics) and the backward, and
    /// last the mean loss: the forward and gradient ops' commands minus the recomputed
    /// products, so the same bits.
    pub(crate) fn linear_cross_entropy_step(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let p = self.classifier_problem(n)?;
        let node = g.node(n);
        let (loss, dh, dw) = (node.outputs[0], node.outputs[1], node.outputs[2]);
        let dloss = self.at(node.inputs[3])?;
        let lab = self.at(p.labels)?;
        let row_loss = self.scratch(p.rows as u64 * 8);
        let stats = (
            self.scratch(p.rows as u64 * 4),
            self.scratch(p.rows as u64 * 4),
        );
        let (count, loss_at) = (self.scratch(4), self.out(loss)?);
        self.commands.push(Command::Memset {
            dst: row_loss,
            bytes: p.rows as u64 * 8,
            byte: 0,
        });
        self.cross_entropy_finalize(loss, row_loss, lab, p.rows, p.ignore, loss_at, count)?;
        let w = self.head_weight(&p)?;
        let buf = self.scratch((p.chunk * p.ld * p.logits.size_bytes()) as u64);
        for (first, len) in Self::chunks(&p) {
            self.chunk_logits(loss, &p, (first, len), (w, buf))?;
            let labels = lab.plus(first as u64 * 8);
            let bad = self.chunk_flag(loss, "label", (labels, first), p.vocab, Some(p.ignore));
            self.launch(
                loss,
                KernelId::CrossEntropy(Kernel::CrossEntropy {
                    backward: false,
                    logits: p.logits,
                }),
                grid_rows(len),
                (ce_block(p.vocab), 1, 1),
                vec![
                    ("logits", Arg::Ptr(buf)),
                    ("labels", Arg::Ptr(labels)),
                    ("rows", Arg::I64(len as i64)),
                    ("v", Arg::I32(p.vocab as i32)),
                    ("ld", Arg::I64(p.ld as i64)),
                    ("ignore_index", Arg::I64(p.ignore)),
                    ("row_loss", Arg::Ptr(row_loss.plus(first as u64 * 8))),
                    ("row_max", Arg::Ptr(stats.0.plus(first as u64 * 4))),
                    ("row_inv", Arg::Ptr(stats.1.plus(first as u64 * 4))),
                    ("bad", Arg::Ptr(bad)),
                ],
            )?;
            self.chunk_backward(&p, (first, len), (w, buf), stats, (dloss, count), (dh, dw))?;
        }
        self.cross_entropy_finalize(loss, row_loss, lab, p.rows, p.ignore, loss_at, count)
    }

    /// One chunk's backward, its logits in `buf`: `dlogits` in place (0 in the padding), then
    /// `dhidden` into the chunk's rows from all `ld` columns and the padded weight `w`, and
    /// `dweight` from the first `vocab` (written by the first chunk, accumulated by the others).
    fn chunk_backward(
        &mut self,
        p: &Problem,
        (first, len): (usize, usize),
        (w, buf): (Place, Place),
        (row_max, row_inv): (Place, Place),
        (dloss, count): (Place, Place),
        (dh, dw): (Value, Value),
    ) -> Result<(), LowerError> {
        let g = self.g;
        let (h, lab) = (self.at(p.hidden)?, self.at(p.labels)?);
        let (dh_at, dw_at) = (self.out(dh)?, self.out(dw)?);
        let (hd, dhd) = (g.ty(p.hidden).dtype, g.ty(dh).dtype);
        self.launch(
            dh,
            KernelId::CrossEntropy(Kernel::CrossEntropy {
                backward: true,
                logits: p.logits,
            }),
            grid_rows(len),
            (ce_block(p.vocab), 1, 1),
            vec![
                ("logits", Arg::Ptr(buf)),
                ("labels", Arg::Ptr(lab.plus(first as u64 * 8))),
                ("rows", Arg::I64(len as i64)),
                ("v", Arg::I32(p.vocab as i32)),
                ("ld", Arg::I64(p.ld as i64)),
                ("ignore_index", Arg::I64(p.ignore)),
                ("row_max", Arg::Ptr(row_max.plus(first as u64 * 4))),
                ("row_inv", Arg::Ptr(row_inv.plus(first as u64 * 4))),
                ("dloss", Arg::Ptr(dloss)),
                ("count", Arg::Ptr(count)),
                ("dlogits", Arg::Ptr(buf)),
            ],
        )?;
        let dlogits = Shape::from(vec![len, p.vocab]);
        let rows_of = |at: Place, d: DType| at.plus((first * p.width * d.size_bytes()) as u64);
        let mut products = gemm::matmul(
            g.name(dh),
            (buf, &Shape::from(vec![len, p.ld]), p.logits),
            (w, &Shape::from(vec![p.ld, p.width]), g.ty(p.weight).dtype),
            (rows_of(dh_at, dhd), dhd),
            false,
            false,
            false,
        )
        .map_err(|m| self.err(dh, m))?;
        let mut weight_grad = gemm::matmul(
            g.name(dw),
            (buf, &dlogits, p.logits),
            (rows_of(h, hd), &Shape::from(vec![len, p.width]), hd),
            (dw_at, g.ty(dw).dtype),
            true,
            false,
            false,
        )
        .map_err(|m| self.err(dw, m))?;
        for gm in &mut weight_grad {
            gm.accumulate = first > 0;
        }
        products.append(&mut weight_grad);
        let products = with_row_stride(products, buf, p.ld).map_err(|m| self.err(dh, m))?;
        self.commands
            .extend(products.into_iter().map(Command::Gemm));
        Ok(())
    }
}

/// `gemms` reading or writing the chunk's logits at `buf` with their rows `ld` elements apart
/// (the products are built for packed `[len, vocab]` logits: single matrices, so only the
/// leading dimension of that operand changes).
fn with_row_stride(mut gemms: Vec<Gemm>, buf: Place, ld: usize) -> Result<Vec<Gemm>, String> {
    for g in &mut gemms {
        if g.batch != 1 {
            return Err("a batched product over the classifier's chunk".into());
        }
        let ld = ld as i64;
        if g.a == buf {
            g.lda = ld;
        }
        if g.b == buf {
            g.ldb = ld;
        }
        if g.c == buf {
            g.ldc = ld;
        }
    }
    Ok(gemms)
}
