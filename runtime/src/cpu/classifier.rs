//! The fused classifier (`linear_cross_entropy` and its gradient): the LM head's product and
//! the softmax cross-entropy over chunks of rows, so at most a chunk of logits exists.
//!
//! Each chunk's logits are the product of the chunk's hidden rows with the weight, by the
//! executor's own matrix product called as the separate `matmul` node would call it (operands
//! rounded to TF32 under `acc=tf32`), rounded to the logits' dtype as the product would store
//! them. The loss and the row gradients are `loss.rs`'s, row for row. The gradient recomputes
//! a chunk's logits, turns them into `dlogits` in place (rounded to the logits' dtype, as the
//! separate gradient would be stored), then `dhidden = dlogits @ weight` (rounded to hidden's
//! dtype) and `dweight += dlogits^T @ hidden` (F32, chunk by chunk in row order). The CUDA
//! lowering issues the same products chunk by chunk, so the emulator agrees bit for bit.

use super::loss::{self, BadLabel};
use super::matmul::{matmul, Operand};
use castor_ir::{round_slice, round_tf32, DType};

/// One classifier op's operands and shapes.
pub struct Classifier<'a> {
    /// `[rows, width]`.
    pub hidden: &'a [f32],
    /// `[vocab, width]`.
    pub weight: &'a [f32],
    pub labels: &'a [i64],
    pub width: usize,
    pub vocab: usize,
    pub chunk_rows: usize,
    pub ignore_index: i64,
    /// The dtype each chunk's logits (and their gradient) are stored in.
    pub logits: DType,
    /// The forward product accumulates in TF32 (its operands rounded to TF32 first).
    pub tf32: bool,
}

impl Classifier<'_> {
    fn rows(&self) -> usize {
        self.labels.len()
    }

    /// The row ranges of the chunks, in order.
    fn chunks(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let (n, step) = (self.rows(), self.chunk_rows.max(1));
        (0..n).step_by(step).map(move |r| r..(r + step).min(n))
    }

    /// The logits of rows `r`, `[r.len(), vocab]`, rounded to the logits' dtype.
    fn logits(&self, r: &std::ops::Range<usize>, weight: &[f32]) -> Vec<f32> {
        let c = self.width;
        let rows = &self.hidden[r.start * c..r.end * c];
        let tf32_rows: Vec<f32>;
        let rows = if self.tf32 {
            tf32_rows = rows.iter().map(|&x| round_tf32(x)).collect();
            &tf32_rows
        } else {
            rows
        };
        let a = Operand {
            data: rows,
            shape: &[r.len(), c],
            transpose: false,
        };
        let b = Operand {
            data: weight,
            shape: &[self.vocab, c],
            transpose: true,
        };
        let mut out = matmul(&a, &b, &[r.len(), self.vocab]);
        round_slice(self.logits, &mut out);
        out
    }

    /// The forward product's weight operand (rounded to TF32 once, when it accumulates so).
    fn forward_weight(&self) -> std::borrow::Cow<'_, [f32]> {
        if self.tf32 {
            self.weight.iter().map(|&x| round_tf32(x)).collect()
        } else {
            std::borrow::Cow::Borrowed(self.weight)
        }
    }
}

/// The mean cross-entropy over counted rows, chunk by chunk.
pub fn loss(p: &Classifier) -> Result<f32, BadLabel> {
    loss::check(p.vocab, p.labels, p.ignore_index)?;
    let weight = p.forward_weight();
    let mut row_losses = vec![0f64; p.rows()];
    for r in p.chunks() {
        let logits = p.logits(&r, &weight);
        loss::row_losses(
            &logits,
            p.vocab,
            &p.labels[r.clone()],
            p.ignore_index,
            &mut row_losses[r],
        );
    }
    Ok(loss::mean(&row_losses, p.labels, p.ignore_index))
}

/// `(dhidden, dweight)` for the loss gradient `dloss`; dhidden rounded to `hidden_dtype`.
pub fn grad(
    p: &Classifier,
    dloss: f32,
    hidden_dtype: DType,
) -> Result<(Vec<f32>, Vec<f32>), BadLabel> {
    loss::check(p.vocab, p.labels, p.ignore_index)?;
    let (c, v) = (p.width, p.vocab);
    let scale = loss::grad_scale(p.labels, p.ignore_index, dloss);
    let weight = p.forward_weight();
    let mut dhidden = vec![0f32; p.rows() * c];
    let mut dweight = vec![0f32; v * c];
    for r in p.chunks() {
        let mut dlogits = p.logits(&r, &weight);
        loss::row_grads(&mut dlogits, v, &p.labels[r.clone()], p.ignore_index, scale);
        round_slice(p.logits, &mut dlogits);
        let n = r.len();
        let dy = Operand {
            data: &dlogits,
            shape: &[n, v],
            transpose: false,
        };
        let w = Operand {
            data: p.weight,
            shape: &[v, c],
            transpose: false,
        };
        let mut dh = matmul(&dy, &w, &[n, c]);
        round_slice(hidden_dtype, &mut dh);
        dhidden[r.start * c..r.end * c].copy_from_slice(&dh);
        let dy_t = Operand {
            data: &dlogits,
            shape: &[n, v],
            transpose: true,
        };
        let h = Operand {
            data: &p.hidden[r.start * c..r.end * c],
            shape: &[n, c],
            transpose: false,
        };
        let partial = matmul(&dy_t, &h, &[v, c]);
        if r.start == 0 {
            dweight = partial;
        } else {
            dweight.iter_mut().zip(&partial).for_each(|(d, x)| *d += x);
        }
    }
    Ok((dhidden, dweight))
}
