//! Batched matrix products on the `gemm` crate.
//!
//! `gemm` takes row and column strides for every operand, so the `transpose_a/b` flags cost
//! nothing: a transposed operand is the same buffer read with swapped strides. Batch dims
//! broadcast (NumPy rules); consecutive batch entries that share one right-hand matrix and
//! whose left-hand matrices are contiguous are folded into a single taller product (a
//! `[B, T, C] x [C, N]` projection is one `[B*T, C] x [C, N]` GEMM, grouped-query attention's
//! `[B, Hkv, G, T, D] x [B, Hkv, 1, D, T]` is `B*Hkv` products of `G*T` rows). Products run
//! in parallel across batch entries when there are enough of them, otherwise each product
//! uses `gemm`'s own threading.

use super::pool;
use super::strides::{broadcast_strides, offset};
use gemm::Parallelism;
use rayon::prelude::*;

/// A matrix operand: its data, its shape as stored, and whether to use it transposed.
pub struct Operand<'a> {
    pub data: &'a [f32],
    pub shape: &'a [usize],
    pub transpose: bool,
}

impl Operand<'_> {
    /// (rows, cols) after the optional transpose, and the (row, col) strides that read it so.
    fn matrix(&self) -> ((usize, usize), (isize, isize)) {
        let r = self.shape.len();
        let (rows, cols) = (self.shape[r - 2], self.shape[r - 1]);
        if self.transpose {
            ((cols, rows), (1, cols as isize))
        } else {
            ((rows, cols), (cols as isize, 1))
        }
    }

    fn batch(&self) -> &[usize] {
        &self.shape[..self.shape.len() - 2]
    }
}

/// One GEMM: `rows` rows of the left operand starting at `a`, the right matrix at `b`.
struct Product {
    a: usize,
    b: usize,
    rows: usize,
}

/// Flops below which a product is not worth threading.
const THREAD_FLOPS: usize = 1 << 18;

/// `a @ b` for an output of shape `out_shape` (`[..batch, M, N]`, as the typing rule gives).
pub fn matmul(a: &Operand, b: &Operand, out_shape: &[usize]) -> Vec<f32> {
    let ((m, k), (a_rs, a_cs)) = a.matrix();
    let ((_, n), (b_rs, b_cs)) = b.matrix();
    let batch = &out_shape[..out_shape.len() - 2];
    let batches: usize = batch.iter().product();
    let mut out = pool::buffer(batches * m * n);
    if out.is_empty() || k == 0 {
        out.fill(0.0);
        return out;
    }

    // Offsets of each batch entry's matrices, folded where the left rows are contiguous.
    let a_strides = broadcast_strides(a.batch(), batch);
    let b_strides = broadcast_strides(b.batch(), batch);
    let mut products: Vec<Product> = Vec::new();
    for i in 0..batches {
        let a_off = offset(i, batch, &a_strides) * m * k;
        let b_off = offset(i, batch, &b_strides) * k * n;
        match products.last_mut() {
            Some(p) if !a.transpose && p.b == b_off && p.a + p.rows * k == a_off => p.rows += m,
            _ => products.push(Product {
                a: a_off,
                b: b_off,
                rows: m,
            }),
        }
    }

    let run = |p: &Product, dst: &mut [f32], parallelism: Parallelism| {
        debug_assert!(
            p.a + (p.rows - 1) * (a_rs as usize) + (k - 1) * (a_cs as usize) < a.data.len()
        );
        debug_assert!(p.b + (k - 1) * (b_rs as usize) + (n - 1) * (b_cs as usize) < b.data.len());
        debug_assert_eq!(dst.len(), p.rows * n);
        // SAFETY: the operands' shapes come from a verified graph and match their data, so
        // every element the strides address lies inside `a.data`, `b.data` (checked above in
        // debug builds) and `dst`, which is exactly `rows x n`; `read_dst` is false, so `dst`
        // is only written.
        unsafe {
            gemm::gemm(
                p.rows,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.data.as_ptr().add(p.a),
                a_cs,
                a_rs,
                b.data.as_ptr().add(p.b),
                b_cs,
                b_rs,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            )
        }
    };

    let mut jobs: Vec<(&Product, &mut [f32])> = Vec::with_capacity(products.len());
    let mut rest = out.as_mut_slice();
    for p in &products {
        let (dst, tail) = rest.split_at_mut(p.rows * n);
        jobs.push((p, dst));
        rest = tail;
    }
    let flops = |p: &Product| 2 * p.rows * n * k;
    let total: usize = products.iter().map(flops).sum();
    if products.len() >= rayon::current_num_threads() && total >= THREAD_FLOPS {
        jobs.into_par_iter()
            .for_each(|(p, dst)| run(p, dst, Parallelism::None));
    } else {
        for (p, dst) in jobs {
            let parallelism = if flops(p) >= THREAD_FLOPS {
                Parallelism::Rayon(0)
            } else {
                Parallelism::None
            };
            run(p, dst, parallelism);
        }
    }
    out
}
