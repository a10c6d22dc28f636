//! Scaled dot-product attention, forward and backward, without a `[T, S]` tensor: the CPU twin
//! of a FlashAttention-2 kernel.
//!
//! Rounding points (the kernel's, so the two differ only in summation order): a score is the
//! query-key dot product summed in F64, scaled in F64 and rounded to F32; probabilities are
//! `exp(s - max)` in F32 (`math::exp`), rounded to the operands' dtype before they multiply
//! the values, as they are when they enter a tensor-core product; the row sum `l` is the F64
//! sum of the unrounded probabilities; `o = (Σ p̃ v) / l` with the product summed in F64;
//! `lse = max + ln l` in F32. The backward recomputes `p = exp(s - lse)` from the saved
//! log-sum-exp, takes `D = Σ do·o` (F64) per row, `dp = do·v` (F64), `ds = p (dp - D)` in F32,
//! rounded to the operands' dtype before the `dq = scale Σ ds k` and `dk = scale Σ ds q`
//! products, and `dv = Σ p̃ do`; every sum is F64, in a fixed order (so results do not depend
//! on the thread count).
//!
//! With dropout ([`Dropout`]) the probabilities are dropped where a `dropout` node over the
//! `[batch.., T, S]` probabilities would drop them (the Philox draw of element
//! `(row * S + key)`, [`castor_ir::philox`]): a dropped probability does not enter `Σ p̃ v`
//! (the row sum `l` still adds it: `lse` is the undropped scores'), and `o = (Σ p̃ v) / l · c`
//! with `c = 1 / (1 - p)` (the F32 [`castor_ir::philox::dropout_scale`]), in F64. The backward
//! regenerates the mask: `dp` of a dropped key is 0, of a kept one `dp · c`, and
//! `ds = p (dp - D)`; `dv = Σ z̃ do` with `z = p · c` (F32) for a kept key, 0 for a dropped one,
//! rounded as `p̃` is.
//!
//! Masking follows [`super::softmax`] (with positions, a query sees only its own packed
//! sequence): masked keys get probability exactly 0, and a row with
//! no visible key attends uniformly to all `S` keys (every score then equals the mask's finite
//! minimum, which is what PyTorch computes), with the gradient of that uniform softmax.

use super::mask::{KeyMask, PositionRows};
use super::par::for_each_block;
use super::strides::{broadcast_strides, offset};
use castor_ir::philox::{dropout_draws, dropout_scale, keep_threshold};
use castor_ir::{round_tf32, round_to, DType};

/// How a value entering a product is rounded: to the operands' dtype, or to TF32.
#[derive(Clone, Copy, Debug)]
pub enum Operand {
    Dtype(DType),
    Tf32,
}

impl Operand {
    #[inline]
    fn round(self, x: f32) -> f32 {
        match self {
            Operand::Dtype(d) => round_to(d, x),
            Operand::Tf32 => round_tf32(x),
        }
    }
}

/// The shapes and attributes of one attention op.
pub struct Problem<'a> {
    pub q: &'a [usize],
    pub k: &'a [usize],
    pub v: &'a [usize],
    pub mask: Option<KeyMask<'a>>,
    pub causal: bool,
    /// A sliding window narrowing the causal mask: only the last `window` causal keys.
    pub window: Option<usize>,
    pub scale: f64,
    pub operand: Operand,
    /// Dropout on the probabilities (`None` also in evaluation mode).
    pub dropout: Option<Dropout>,
}

/// Dropout on an attention's probabilities: the key (`[seed, offset]`, training mode), the
/// stream and the probability, as the `dropout` node they stand for.
#[derive(Clone, Copy, Debug)]
pub struct Dropout {
    pub key: [i64; 2],
    pub stream: u32,
    pub p: f64,
}

impl Dropout {
    /// Which keys of query row `row` (flattened over the batch dims) are kept: the draws of
    /// elements `row * s .. row * s + s`.
    fn kept(&self, row: usize, s: usize) -> Vec<bool> {
        let threshold = keep_threshold(self.p);
        let (first, end) = ((row * s) as u64, (row * s + s) as u64);
        let mut keep = Vec::with_capacity(s);
        let mut block = first / 4;
        while block * 4 < end {
            let draws = dropout_draws(self.key, self.stream, block);
            for (lane, &r) in draws.iter().enumerate() {
                let i = block * 4 + lane as u64;
                if (first..end).contains(&i) {
                    keep.push(u64::from(r) < threshold);
                }
            }
            block += 1;
        }
        keep
    }

    /// The factor kept probabilities are multiplied by.
    fn scale(&self) -> f32 {
        dropout_scale(self.p)
    }
}

/// Index arithmetic shared by the forward and the backward.
struct Layout<'a> {
    /// The query's batch dims, and their count.
    batch: &'a [usize],
    batches: usize,
    t: usize,
    s: usize,
    d: usize,
    dv: usize,
    /// Strides of k's and v's batch dims (in batches) broadcast to the query's.
    k_batch: Vec<usize>,
    v_batch: Vec<usize>,
    k_batches: usize,
    v_batches: usize,
    /// The bool mask, with its strides broadcast to `[batch.., T, S]`.
    mask: Option<(&'a [bool], Vec<usize>)>,
    /// Packed sequences' positions.
    positions: Option<PositionRows<'a>>,
    /// `[batch.., T]`: the dims whose rows are query rows.
    rows_dims: Vec<usize>,
    causal: bool,
    window: Option<usize>,
    scale: f64,
    operand: Operand,
    dropout: Option<Dropout>,
}

impl<'a> Layout<'a> {
    fn new(p: &Problem<'a>) -> Layout<'a> {
        let r = p.q.len();
        let batch = &p.q[..r - 2];
        let mut scores = batch.to_vec();
        let (t, s) = (p.q[r - 2], p.k[p.k.len() - 2]);
        scores.extend([t, s]);
        let rows_dims = scores[..scores.len() - 1].to_vec();
        let strides_of = |shape: &[usize]| broadcast_strides(&shape[..shape.len() - 2], batch);
        Layout {
            batch,
            batches: batch.iter().product(),
            t,
            s,
            d: p.q[r - 1],
            dv: p.v[p.v.len() - 1],
            k_batch: strides_of(p.k),
            v_batch: strides_of(p.v),
            k_batches: p.k[..p.k.len() - 2].iter().product(),
            v_batches: p.v[..p.v.len() - 2].iter().product(),
            mask: match p.mask {
                Some(KeyMask::Keep(data, shape)) => Some((data, broadcast_strides(shape, &scores))),
                _ => None,
            },
            positions: match p.mask {
                Some(KeyMask::Positions(data, shape)) => {
                    Some(PositionRows::new(data, shape, &scores))
                }
                _ => None,
            },
            rows_dims,
            causal: p.causal,
            window: p.window,
            scale: p.scale,
            operand: p.operand,
            dropout: p.dropout,
        }
    }

    /// The dropout mask of query row `r` (`None`: no dropout).
    fn dropped(&self, r: usize) -> Option<Vec<bool>> {
        self.dropout.map(|d| d.kept(r, self.s))
    }

    fn k_index(&self, b: usize) -> usize {
        offset(b, self.batch, &self.k_batch)
    }

    fn v_index(&self, b: usize) -> usize {
        offset(b, self.batch, &self.v_batch)
    }

    /// Which keys query row `i` of batch `b` sees (causally, in its window and through the
    /// mask), or `None` when it sees none (the row is then uniform over all keys).
    fn keys(&self, b: usize, i: usize) -> Option<Vec<bool>> {
        let visible = if self.causal {
            (i + 1 + self.s - self.t).min(self.s)
        } else {
            self.s
        };
        let mut first = self.window.map_or(0, |w| visible.saturating_sub(w));
        if let Some(p) = &self.positions {
            first = first.max(p.first_key(b * self.t + i));
        }
        let mut keep = vec![false; self.s];
        let (row, last) = match &self.mask {
            Some((_, strides)) => {
                let n = strides.len();
                (
                    offset(b * self.t + i, &self.rows_dims, &strides[..n - 1]),
                    strides[n - 1],
                )
            }
            None => (0, 0),
        };
        let mut any = false;
        for (j, k) in keep.iter_mut().enumerate().take(visible).skip(first) {
            *k = self
                .mask
                .as_ref()
                .is_none_or(|(data, _)| data[row + j * last]);
            any |= *k;
        }
        any.then_some(keep)
    }

    /// The scaled score of query `qi` against key `kj`: an F64 dot product, scaled, rounded.
    #[inline]
    fn score(&self, qi: &[f32], kj: &[f32]) -> f32 {
        let dot: f64 = qi
            .iter()
            .zip(kj)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        (dot * self.scale) as f32
    }
}

/// One row's scores and their maximum: the kept keys' scores (masked ones unused), or, for a
/// row that sees no key, zeros over all keys.
fn row_scores(l: &Layout, q: &[f32], k: &[f32], b: usize, i: usize) -> (Vec<f32>, Vec<bool>, f32) {
    let qi = &q[(b * l.t + i) * l.d..][..l.d];
    let kb = l.k_index(b) * l.s * l.d;
    match l.keys(b, i) {
        None => (vec![0.0; l.s], vec![true; l.s], 0.0),
        Some(keep) => {
            let mut s = vec![0f32; l.s];
            let mut max = f32::NEG_INFINITY;
            for j in 0..l.s {
                if keep[j] {
                    s[j] = l.score(qi, &k[kb + j * l.d..][..l.d]);
                    max = super::math::max2(max, s[j]);
                }
            }
            (s, keep, max)
        }
    }
}

/// The forward: `(o [batch.., T, Dv], lse [batch.., T])`.
pub fn attention(q: &[f32], k: &[f32], v: &[f32], p: &Problem) -> (Vec<f32>, Vec<f32>) {
    let l = Layout::new(p);
    let rows = l.batches * l.t;
    let mut o = vec![0f32; rows * l.dv];
    let mut lse = vec![0f32; rows];
    // Each output row carries its log-sum-exp: one block per query row, [o.., lse].
    let mut packed = vec![0f32; rows * (l.dv + 1)];
    for_each_block(&mut packed, l.dv + 1, l.s * (l.d + l.dv), |r, out| {
        let (b, i) = (r / l.t, r % l.t);
        let (s, keep, max) = row_scores(&l, q, k, b, i);
        let kept = l.dropped(r);
        let vb = l.v_index(b) * l.s * l.dv;
        let mut sum = 0f64;
        let mut acc = vec![0f64; l.dv];
        for j in 0..l.s {
            if !keep[j] {
                continue;
            }
            let pj = super::math::exp(s[j] - max);
            sum += f64::from(pj);
            if kept.as_ref().is_some_and(|z| !z[j]) {
                continue;
            }
            let pr = f64::from(l.operand.round(pj));
            for (a, &x) in acc.iter_mut().zip(&v[vb + j * l.dv..][..l.dv]) {
                *a += pr * f64::from(x);
            }
        }
        let c = l.dropout.map_or(1.0, |d| f64::from(d.scale()));
        for (dst, a) in out[..l.dv].iter_mut().zip(&acc) {
            *dst = (a / sum * c) as f32;
        }
        out[l.dv] = max + (sum.ln() as f32);
    });
    for (r, chunk) in packed.chunks(l.dv + 1).enumerate() {
        o[r * l.dv..(r + 1) * l.dv].copy_from_slice(&chunk[..l.dv]);
        lse[r] = chunk[l.dv];
    }
    (o, lse)
}

/// The backward: `(dq, dk, dv)` shaped like `q`, `k` and `v`. `o` is the forward's stored
/// output, `lse` its log-sum-exp, `d_o` the output gradient.
pub fn attention_grad(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    p: &Problem,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let l = Layout::new(p);
    let rows = l.batches * l.t;
    // D_i = Σ do·o, per query row.
    let delta: Vec<f32> = (0..rows)
        .map(|r| {
            let dot: f64 = d_o[r * l.dv..][..l.dv]
                .iter()
                .zip(&o[r * l.dv..][..l.dv])
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            dot as f32
        })
        .collect();
    // The probability and score gradient of row (b, i) against key j.
    let ds_row = |b: usize, i: usize| -> (Vec<f32>, Vec<f32>, Vec<bool>) {
        let r = b * l.t + i;
        let (s, keep, _) = row_scores(&l, q, k, b, i);
        let kept = l.dropped(r);
        let c = l.dropout.map(|d| d.scale());
        let vb = l.v_index(b) * l.s * l.dv;
        let doi = &d_o[r * l.dv..][..l.dv];
        // With dropout, `pr` holds the dropped, scaled probabilities that multiplied v.
        let mut pr = vec![0f32; l.s];
        let mut ds = vec![0f32; l.s];
        for j in 0..l.s {
            if !keep[j] {
                continue;
            }
            let pj = super::math::exp(s[j] - lse[r]);
            let dp: f64 = doi
                .iter()
                .zip(&v[vb + j * l.dv..][..l.dv])
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            let (zj, dp) = match (c, &kept) {
                (Some(_), Some(z)) if !z[j] => (0.0, 0.0),
                (Some(c), _) => (pj * c, dp as f32 * c),
                _ => (pj, dp as f32),
            };
            pr[j] = zj;
            ds[j] = pj * (dp - delta[r]);
        }
        (pr, ds, keep)
    };

    // One block per key batch: every query row that reads it, in batch then row order, each
    // row's probabilities and score gradients computed once for its dq row, the key batch's dk
    // and, where the value batches are read by the same rows (always, unless k and v broadcast
    // differently), its dv. A block's output is [dk | dv | the readers' dq rows].
    let readers = |batches: usize, index: &dyn Fn(usize) -> usize| -> Vec<Vec<usize>> {
        let mut by = vec![Vec::new(); batches];
        for b in 0..l.batches {
            by[index(b)].push(b);
        }
        by
    };
    let k_readers = readers(l.k_batches, &|b| l.k_index(b));
    let v_readers = readers(l.v_batches, &|b| l.v_index(b));
    let dv_with_dk = k_readers == v_readers;
    let per_kb = (l.batches / l.k_batches.max(1)).max(1);
    let work = l.t * l.s * (l.d + l.dv) * per_kb;
    let (dk_len, dv_len) = (l.s * l.d, if dv_with_dk { l.s * l.dv } else { 0 });
    let mut blocks = vec![0f32; l.k_batches * (dk_len + dv_len + per_kb * l.t * l.d)];
    let block_len = blocks.len() / l.k_batches.max(1);
    for_each_block(&mut blocks, block_len, work, |kb, out| {
        let (dk_out, rest) = out.split_at_mut(dk_len);
        let (dv_out, dq_out) = rest.split_at_mut(dv_len);
        let mut dk_acc = vec![0f64; dk_len];
        let mut dv_acc = vec![0f64; dv_len];
        let mut dq_acc = vec![0f64; l.d];
        for (n, &b) in k_readers[kb].iter().enumerate() {
            let kbase = l.k_index(b) * l.s * l.d;
            for i in 0..l.t {
                let (pr, ds, keep) = ds_row(b, i);
                let r = b * l.t + i;
                let qi = &q[r * l.d..][..l.d];
                let doi = &d_o[r * l.dv..][..l.dv];
                dq_acc.fill(0.0);
                for j in (0..l.s).filter(|&j| keep[j]) {
                    let g = f64::from(l.operand.round(ds[j]));
                    let kj = &k[kbase + j * l.d..][..l.d];
                    for (a, &x) in dq_acc.iter_mut().zip(kj) {
                        *a += g * f64::from(x);
                    }
                    for (a, &x) in dk_acc[j * l.d..][..l.d].iter_mut().zip(qi) {
                        *a += g * f64::from(x);
                    }
                    if dv_with_dk {
                        let pj = f64::from(l.operand.round(pr[j]));
                        for (a, &x) in dv_acc[j * l.dv..][..l.dv].iter_mut().zip(doi) {
                            *a += pj * f64::from(x);
                        }
                    }
                }
                let dq_row = &mut dq_out[(n * l.t + i) * l.d..][..l.d];
                for (dst, a) in dq_row.iter_mut().zip(&dq_acc) {
                    *dst = (a * l.scale) as f32;
                }
            }
        }
        for (dst, a) in dk_out.iter_mut().zip(&dk_acc) {
            *dst = (a * l.scale) as f32;
        }
        for (dst, a) in dv_out.iter_mut().zip(&dv_acc) {
            *dst = *a as f32;
        }
    });
    let mut dq = vec![0f32; rows * l.d];
    let mut dk = vec![0f32; l.k_batches * dk_len];
    let mut dv = vec![0f32; l.v_batches * l.s * l.dv];
    for (kb, block) in blocks.chunks(block_len).enumerate() {
        let (dk_block, rest) = block.split_at(dk_len);
        let (dv_block, dq_rows) = rest.split_at(dv_len);
        dk[kb * dk_len..][..dk_len].copy_from_slice(dk_block);
        if dv_with_dk {
            dv[kb * dv_len..][..dv_len].copy_from_slice(dv_block);
        }
        for (&b, rows) in k_readers[kb].iter().zip(dq_rows.chunks(l.t * l.d)) {
            dq[b * l.t * l.d..][..l.t * l.d].copy_from_slice(rows);
        }
    }
    if !dv_with_dk {
        // k and v broadcast differently: dv per value batch, in a pass of its own.
        for_each_block(&mut dv, l.s * l.dv, work, |vb, out| {
            let mut acc = vec![0f64; l.s * l.dv];
            for &b in &v_readers[vb] {
                for i in 0..l.t {
                    let (pr, _, keep) = ds_row(b, i);
                    let doi = &d_o[(b * l.t + i) * l.dv..][..l.dv];
                    for j in (0..l.s).filter(|&j| keep[j]) {
                        let pj = f64::from(l.operand.round(pr[j]));
                        for (a, &x) in acc[j * l.dv..][..l.dv].iter_mut().zip(doi) {
                            *a += pj * f64::from(x);
                        }
                    }
                }
            }
            for (dst, a) in out.iter_mut().zip(&acc) {
                *dst = *a as f32;
            }
        });
    }
    (dq, dk, dv)
}
