//! Batched matrix products on the `gemm` crate.
//!
//! `gemm` takes row and column strides for every operand, so the `transpose_a/b` flags need no
//! copies: a transposed operand is the same buffer read with swapped strides. Batch dims
//! broadcast (NumPy rules); consecutive batch entries that share one right-hand matrix and
//! whose left-hand matrices are contiguous are folded into a single taller product (a
//! `[B, T, C] x [C, N]` projection is one `[B*T, C] x [C, N]` GEMM, grouped-query attention's
//! `[B, Hkv, G, T, D] x [B, Hkv, 1, D, T]` is `B*Hkv` products of `G*T` rows).
//!
//! Threading: each product's output is cut into tiles of at most [`TILE_ROWS`] x
//! [`TILE_COLS`], every tile is one single-threaded `gemm` call, and the tiles of all products
//! run in parallel. The tiling depends only on the shapes, so results do not depend on the
//! number of threads. Tiling the columns matters for short products (a projection of 128
//! tokens): `gemm`'s own threading splits the rows, so every thread would pack the whole
//! weight matrix, and it synchronizes once per block of the inner dimension.
//!
//! Transposed right operands: a `[N, K]` matrix used transposed (a tied LM head) has unit
//! stride along `K`, but `gemm` packs the right operand into panels contiguous along `N`,
//! gathering it element by element, which for GPT-2's `[50257, 768]` head costs about as much
//! as a 128-token product itself. When a tile has fewer rows than `K`, it is computed
//! transposed instead, `(A B)^T = B^T A^T` (where that operand is read as stored), into a
//! scratch buffer that is then transposed into place: `rows x cols` values move rather than
//! `K x cols`. Both ways sum the same terms in the same order.

use super::layout;
use super::pool;
use super::strides::{broadcast_strides, offset};
use gemm::Parallelism;
use rayon::prelude::*;
use std::cell::RefCell;

/// A matrix operand: its data, its shape as stored, and whether to use it transposed.
pub struct Operand<'a> {
    pub data: &'a [f32],
    pub shape: &'a [usize],
    pub transpose: bool,
}

impl Operand<'_> {
    /// (rows, cols) after the optional transpose, and the (row, col) strides that read it so.
    fn matrix(&self) -> ((usize, usize), (usize, usize)) {
        let r = self.shape.len();
        let (rows, cols) = (self.shape[r - 2], self.shape[r - 1]);
        if self.transpose {
            ((cols, rows), (1, cols))
        } else {
            ((rows, cols), (cols, 1))
        }
    }

    fn batch(&self) -> &[usize] {
        &self.shape[..self.shape.len() - 2]
    }
}

/// Output rows per tile.
const TILE_ROWS: usize = 256;

/// Output columns per tile. A multiple of `gemm`'s 64-wide AVX-512 kernel (the output's
/// columns are its rows), and small enough that a 768-wide projection makes 6 tiles.
const TILE_COLS: usize = 128;

/// Output columns per tile of a transposed tile: wider, to spread the cost of packing the
/// left operand over more columns (a tile reads it whole).
const TRANSPOSED_TILE_COLS: usize = 512;

/// Flops below which a product is not worth threading.
const THREAD_FLOPS: usize = 1 << 18;

/// A strided matrix: element `(i, j)` is `data[at + i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Matrix<'a> {
    data: &'a [f32],
    at: usize,
    rs: usize,
    cs: usize,
}

impl<'a> Matrix<'a> {
    /// The submatrix from row `i`, column `j` on.
    fn sub(self, i: usize, j: usize) -> Matrix<'a> {
        Matrix {
            at: self.at + i * self.rs + j * self.cs,
            ..self
        }
    }

    /// The transpose.
    fn t(self) -> Matrix<'a> {
        Matrix {
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// One tile of the output: `rows x cols` values at `out[dst..]` (row stride `n`) of the
/// product of `a` (its first `rows` rows) and `b` (its first `cols` columns).
struct Tile<'a> {
    a: Matrix<'a>,
    b: Matrix<'a>,
    dst: usize,
    rows: usize,
    cols: usize,
    /// Computed as `(b^T a^T)^T`, see the module docs.
    transposed: bool,
}

/// The output buffer, written by tiles in parallel.
struct Out(*mut f32);

// SAFETY: tiles write disjoint parts of the buffer (see `run`).
unsafe impl Sync for Out {}

thread_local! {
    /// Scratch for transposed tiles, kept per thread (at most `TILE_ROWS` x
    /// `TRANSPOSED_TILE_COLS` values).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

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

    // Offsets of each batch entry's matrices, folded where the left rows are contiguous:
    // (left offset, right offset, rows).
    let a_strides = broadcast_strides(a.batch(), batch);
    let b_strides = broadcast_strides(b.batch(), batch);
    let mut products: Vec<(usize, usize, usize)> = Vec::new();
    for i in 0..batches {
        let a_off = offset(i, batch, &a_strides) * m * k;
        let b_off = offset(i, batch, &b_strides) * k * n;
        match products.last_mut() {
            Some((pa, pb, rows)) if !a.transpose && *pb == b_off && *pa + *rows * k == a_off => {
                *rows += m
            }
            _ => products.push((a_off, b_off, m)),
        }
    }

    // A transposed tile reads the left operand transposed, best with unit stride along its
    // rows: make that copy once per product when `a` is not already stored so.
    let transposes = |rows: usize| b.transpose && rows.min(TILE_ROWS) < k;
    let copies: Vec<Option<Vec<f32>>> = products
        .iter()
        .map(|&(a_off, _, rows)| {
            (transposes(rows) && !a.transpose)
                .then(|| layout::transpose(&a.data[a_off..a_off + rows * k], &[rows, k], &[1, 0]))
        })
        .collect();

    let mut tiles: Vec<Tile> = Vec::new();
    let mut dst = 0;
    for (&(a_off, b_off, rows), copy) in products.iter().zip(&copies) {
        let transposed = transposes(rows);
        let a = match copy {
            Some(at) => Matrix {
                data: at,
                at: 0,
                rs: 1,
                cs: rows,
            },
            None => Matrix {
                data: a.data,
                at: a_off,
                rs: a_rs,
                cs: a_cs,
            },
        };
        let b = Matrix {
            data: b.data,
            at: b_off,
            rs: b_rs,
            cs: b_cs,
        };
        let tile_cols = if transposed {
            TRANSPOSED_TILE_COLS
        } else {
            TILE_COLS
        };
        for i in (0..rows).step_by(TILE_ROWS) {
            for j in (0..n).step_by(tile_cols) {
                tiles.push(Tile {
                    a: a.sub(i, 0),
                    b: b.sub(0, j),
                    dst: dst + i * n + j,
                    rows: TILE_ROWS.min(rows - i),
                    cols: tile_cols.min(n - j),
                    transposed,
                });
            }
        }
        dst += rows * n;
    }

    let ptr = Out(out.as_mut_ptr());
    let run = |t: &Tile| run(t, k, &ptr, n);
    if 2 * batches * m * n * k >= THREAD_FLOPS {
        tiles.par_iter().for_each(run);
    } else {
        tiles.iter().for_each(run);
    }
    copies.into_iter().flatten().for_each(pool::recycle);
    out
}

/// Computes one tile into `out` (row stride `n`).
fn run(t: &Tile, k: usize, out: &Out, n: usize) {
    let dst = t.dst;
    if !t.transposed {
        // SAFETY: the tile's `rows x cols` block at `dst` (row stride `n`) lies inside the
        // output, which `matmul` sized for every tile, and no other tile writes it.
        unsafe { gemm_into(t.rows, t.cols, k, out.0.add(dst), n, 1, t.a, t.b) };
        return;
    }
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let len = t.rows * t.cols;
        if s.len() < len {
            s.resize(len, 0.0);
        }
        let scratch = &mut s[..len];
        // SAFETY: `scratch` holds `cols x rows` values, written with row stride `rows`.
        unsafe {
            gemm_into(
                t.cols,
                t.rows,
                k,
                scratch.as_mut_ptr(),
                t.rows,
                1,
                t.b.t(),
                t.a.t(),
            )
        };
        // In square blocks, so that both sides stay in L1 cache.
        const BLOCK: usize = 16;
        for i0 in (0..t.rows).step_by(BLOCK) {
            for j0 in (0..t.cols).step_by(BLOCK) {
                for i in i0..t.rows.min(i0 + BLOCK) {
                    for j in j0..t.cols.min(j0 + BLOCK) {
                        // SAFETY: as above, `(i, j)` is inside this tile's block of the output.
                        unsafe { *out.0.add(dst + i * n + j) = scratch[j * t.rows + i] };
                    }
                }
            }
        }
    });
}

/// `dst = a @ b` for an `m x k` by `k x n` product; `dst` has strides `(d_rs, d_cs)`.
///
/// # Safety
/// `dst` must be valid for writes of the `m x n` elements the strides address, and nothing
/// else may access them meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    d_rs: usize,
    d_cs: usize,
    a: Matrix,
    b: Matrix,
) {
    let last = |x: &Matrix, rows: usize, cols: usize| x.at + (rows - 1) * x.rs + (cols - 1) * x.cs;
    assert!(last(&a, m, k) < a.data.len() && last(&b, k, n) < b.data.len());
    // SAFETY: every element the strides address lies inside `a.data` and `b.data` (checked
    // above); the caller vouches for `dst`; `read_dst` is false, so `dst` is only written.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            d_cs as isize,
            d_rs as isize,
            false,
            a.data.as_ptr().add(a.at),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.at),
            b.cs as isize,
            b.rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}
