//! The IR's row-major batched `matmul` as a cuBLAS strided-batched product.
//!
//! A row-major `[r, c]` matrix is, read by cuBLAS, the column-major `[c, r]` matrix: its
//! transpose. So `C = op(a) · op(b)` (row-major) is computed as `Cᵀ = op(b)ᵀ · op(a)ᵀ` in
//! cuBLAS terms, with cuBLAS's `A` being the IR's `b` and its `B` the IR's `a`, and no data
//! moved. Batch dims: equal on both sides (strided batches), or present on one side only (the
//! other operand's stride is 0; a plain `x @ W` with `x [.., M, K]` folds the batch into `M`,
//! one large product).

use super::super::program::{Epilogue, Fp8Scales, Gemm, GemmCompute, Place};
use castor_ir::{DType, Shape};

/// The product `out = op(a) · op(b)` as one or more cuBLAS calls, or why cuBLAS cannot run
/// it.
///
/// Batch dims broadcast as in NumPy. Trailing batch dims that only `a` has (`b` broadcast over
/// them, as grouped-query attention's keys over the query groups, or a weight over the batch)
/// fold into `M` when `a` is not transposed; the remaining batch dims become the strided batch
/// as far as both operands step uniformly through them, and a call per index of the dims
/// before that.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    node: &str,
    (a, a_shape, a_dtype): (Place, &Shape, DType),
    (b, b_shape, b_dtype): (Place, &Shape, DType),
    (c, c_dtype): (Place, DType),
    transpose_a: bool,
    transpose_b: bool,
    tf32: bool,
) -> Result<Vec<Gemm>, String> {
    let dtype_ok = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    if a_dtype != b_dtype || !dtype_ok(a_dtype) || !dtype_ok(c_dtype) {
        return Err(format!(
            "cuBLAS multiplies equal float operand dtypes, found {} x {} -> {}",
            a_dtype.name(),
            b_dtype.name(),
            c_dtype.name()
        ));
    }
    if c_dtype != a_dtype && c_dtype != DType::F32 {
        return Err(format!(
            "a {} product cannot write {}",
            a_dtype.name(),
            c_dtype.name()
        ));
    }
    calls(
        node,
        (a, a_shape, a_dtype),
        (b, b_shape, b_dtype),
        (c, c_dtype),
        (transpose_a, transpose_b),
        if tf32 && a_dtype == DType::F32 {
            GemmCompute::Tf32
        } else {
            GemmCompute::F32
        },
    )
}

/// The FP8 product `out = a · bᵀ` of `a` stored `[.., M, K]` and `b` stored `[N, K]` (both
/// contiguous along the inner dim: the IR's `fp8_matmul` with its operands brought to that
/// form) as one cuBLASLt FP8 call, `C = (a_scale · b_scale) · op(A) op(B)` with cuBLAS's `A`
/// the IR's `b` (transposed) and `B` the IR's `a` (not): the "TN" form cuBLASLt's FP8 kernels
/// require. `scales` points at the dequantization factors of cuBLAS's `A` and `B`. Or why
/// cuBLASLt cannot run it ([`Gemm::check`]'s FP8 rules, or a product that is not one call).
pub fn fp8_matmul(
    node: &str,
    a: (Place, &Shape, DType),
    b: (Place, &Shape, DType),
    c: (Place, DType),
    scales: Fp8Scales,
) -> Result<Gemm, String> {
    let mut gemms = calls(node, a, b, c, (false, true), GemmCompute::F32)?;
    if gemms.len() != 1 || gemms[0].batch != 1 {
        return Err(format!(
            "an FP8 product of {} by {} is {} cuBLASLt call(s) of batch {}; castor's FP8 \
             products are single products (a batch of matrices by one matrix)",
            a.1,
            b.1,
            gemms.len(),
            gemms.first().map_or(0, |g| g.batch)
        ));
    }
    let mut g = gemms.remove(0);
    g.fp8 = Some(scales);
    g.check()
        .map_err(|e| format!("{e} (the FP8 product of {} by {}ᵀ)", a.1, b.1))?;
    Ok(g)
}

/// The cuBLAS calls of `out = op(a) · op(b)` (see [`matmul`]), types unchecked.
fn calls(
    node: &str,
    (a, a_shape, a_dtype): (Place, &Shape, DType),
    (b, b_shape, b_dtype): (Place, &Shape, DType),
    (c, c_dtype): (Place, DType),
    (transpose_a, transpose_b): (bool, bool),
    compute: GemmCompute,
) -> Result<Vec<Gemm>, String> {
    let (ad, bd) = (a_shape.dims(), b_shape.dims());
    if ad.len() < 2 || bd.len() < 2 {
        return Err("matmul operands must have at least two dims".into());
    }
    let (ar, ac) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (br, bc) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, k) = if transpose_a { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if transpose_b { (bc, br) } else { (br, bc) };
    if k != k2 {
        return Err(format!(
            "inner dims differ: {a_shape} and {b_shape} (transpose {transpose_a}/{transpose_b})"
        ));
    }
    // Batch dims, right-aligned, with each operand's matrix stride per dim (0: broadcast).
    let (ab, bb) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
    let rank = ab.len().max(bb.len());
    let dim = |x: &[usize], d: usize| -> usize {
        let lead = rank - x.len();
        if d < lead {
            1
        } else {
            x[d - lead]
        }
    };
    let mut out_batch = Vec::with_capacity(rank);
    for d in 0..rank {
        let (x, y) = (dim(ab, d), dim(bb, d));
        if x != y && x != 1 && y != 1 {
            return Err(format!(
                "batch dims of {a_shape} and {b_shape} do not broadcast"
            ));
        }
        out_batch.push(x.max(y));
    }
    let matrix_strides = |x: &[usize], size: usize| -> Vec<usize> {
        let mut s = vec![0usize; rank];
        let mut step = size;
        for d in (0..rank).rev() {
            if dim(x, d) != 1 {
                s[d] = step;
            }
            step *= dim(x, d);
        }
        s
    };
    let mut sa = matrix_strides(ab, m * k);
    let mut sb = matrix_strides(bb, k * n);
    // Fold trailing dims that only `a` steps through into M.
    let mut rows = m;
    let mut batch_dims = out_batch.clone();
    if !transpose_a {
        while let Some(&last) = batch_dims.last() {
            let d = batch_dims.len() - 1;
            if last != 1 && sb[d] != 0 {
                break;
            }
            rows *= last;
            batch_dims.pop();
            sa.pop();
            sb.pop();
        }
    }
    // The longest suffix both operands step through uniformly is the strided batch.
    let uniform = |s: &[usize], from: usize| -> Option<usize> {
        // Element stride per flattened index of dims from.., if uniform.
        let dims = &batch_dims[from..];
        let st = &s[from..];
        let inner: usize = match st.iter().rposition(|&x| x != 0) {
            None => return Some(0),
            Some(i) => st[i] / dims[i + 1..].iter().product::<usize>().max(1),
        };
        let mut expect = inner;
        for i in (0..dims.len()).rev() {
            if dims[i] != 1 && st[i] != expect {
                return None;
            }
            expect *= dims[i];
        }
        Some(inner)
    };
    let mut from = batch_dims.len();
    while from > 0 && uniform(&sa, from - 1).is_some() && uniform(&sb, from - 1).is_some() {
        from -= 1;
    }
    let (stride_a, stride_b) = (
        uniform(&sa, from).unwrap_or(0),
        uniform(&sb, from).unwrap_or(0),
    );
    let batch: usize = batch_dims[from..].iter().product();
    let calls: usize = batch_dims[..from].iter().product();
    let narrow = |x: usize, what: &str| {
        i32::try_from(x).map_err(|_| format!("{what} = {x} exceeds cuBLAS's 32-bit sizes"))
    };
    let (ea, ec) = (a_dtype.size_bytes() as u64, c_dtype.size_bytes() as u64);
    let mut gemms = Vec::with_capacity(calls);
    for call in 0..calls {
        // Offsets of this call's first matrices.
        let (mut rest, mut oa, mut ob) = (call, 0usize, 0usize);
        for d in (0..from).rev() {
            let idx = rest % batch_dims[d];
            rest /= batch_dims[d];
            oa += idx * sa[d];
            ob += idx * sb[d];
        }
        let oc = call * batch * rows * n;
        gemms.push(Gemm {
            node: node.to_string(),
            // cuBLAS's A is the IR's b: its column-major view is bᵀ (b stored [k, n]), which
            // is op(b)ᵀ as is; stored [n, k] (transpose_b) it needs cuBLAS's transpose.
            a: b.plus(ob as u64 * ea),
            a_dtype: b_dtype,
            transa: transpose_b,
            lda: bc as i64,
            stride_a: stride_b as i64,
            // cuBLAS's B is the IR's a, by the same argument.
            b: a.plus(oa as u64 * ea),
            b_dtype: a_dtype,
            transb: transpose_a,
            ldb: ac as i64,
            stride_b: stride_a as i64,
            c: c.plus(oc as u64 * ec),
            c_dtype,
            m: narrow(n, "n")?,
            n: narrow(rows, "m")?,
            k: narrow(k, "k")?,
            ldc: n as i64,
            stride_c: (rows * n) as i64,
            batch: narrow(batch, "batch")?,
            compute,
            accumulate: false,
            alpha: 1.0,
            epilogue: Epilogue::None,
            fp8: None,
        });
    }
    Ok(gemms)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Three separate buffers: places carry byte offsets within each.
    const A: Place = Place::Slot { slot: 0, offset: 0 };
    const B: Place = Place::Slot { slot: 1, offset: 0 };
    const C: Place = Place::Slot { slot: 2, offset: 0 };

    fn elems(p: Place) -> usize {
        match p {
            Place::Slot { offset, .. } | Place::Arena { offset } | Place::Buffer { offset, .. } => {
                offset as usize / 4
            }
        }
    }

    /// Multiplies with cuBLAS's column-major, strided-batched semantics on the host, into `c`.
    fn reference(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        for bi in 0..g.batch as usize {
            let (ao, bo, co) = (
                elems(g.a) + bi * g.stride_a as usize,
                elems(g.b) + bi * g.stride_b as usize,
                elems(g.c) + bi * g.stride_c as usize,
            );
            // Column-major element (r, c) of op(X) with leading dim ld.
            let at = |r: usize, col: usize| {
                if g.transa {
                    a[ao + col + r * g.lda as usize]
                } else {
                    a[ao + r + col * g.lda as usize]
                }
            };
            let bt = |r: usize, col: usize| {
                if g.transb {
                    b[bo + col + r * g.ldb as usize]
                } else {
                    b[bo + r + col * g.ldb as usize]
                }
            };
            for i in 0..m {
                for j in 0..n {
                    let s: f32 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
                    c[co + i + j * g.ldc as usize] = s;
                }
            }
        }
    }

    /// Row-major batched `op(a) @ op(b)` with NumPy broadcasting of the batch dims.
    fn row_major(a: &[f32], ad: &[usize], b: &[f32], bd: &[usize], ta: bool, tb: bool) -> Vec<f32> {
        let (ar, ac) = (ad[ad.len() - 2], ad[ad.len() - 1]);
        let (br, bc) = (bd[bd.len() - 2], bd[bd.len() - 1]);
        let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
        let n = if tb { br } else { bc };
        let (abd, bbd) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
        let rank = abd.len().max(bbd.len());
        let pad = |x: &[usize]| -> Vec<usize> {
            let mut v = vec![1; rank - x.len()];
            v.extend_from_slice(x);
            v
        };
        let (pa, pb) = (pad(abd), pad(bbd));
        let ob: Vec<usize> = pa.iter().zip(&pb).map(|(x, y)| *x.max(y)).collect();
        let batch: usize = ob.iter().product();
        let offset = |dims: &[usize], mut idx: usize, size: usize| -> usize {
            let (mut off, mut step) = (0, size);
            for d in (0..rank).rev() {
                let i = idx % ob[d];
                idx /= ob[d];
                if dims[d] != 1 {
                    off += i * step;
                }
                step *= dims[d];
            }
            off
        };
        let mut out = vec![0f32; batch * m * n];
        for bi in 0..batch {
            let ao = offset(&pa, bi, ar * ac);
            let bo = offset(&pb, bi, br * bc);
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0f32;
                    for p in 0..k {
                        let x = if ta {
                            a[ao + p * ac + i]
                        } else {
                            a[ao + i * ac + p]
                        };
                        let y = if tb {
                            b[bo + j * bc + p]
                        } else {
                            b[bo + p * bc + j]
                        };
                        s += x * y;
                    }
                    out[bi * m * n + i * n + j] = s;
                }
            }
        }
        out
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2654435761u32) ^ seed) as f32 % 17.0 - 8.0)
            .collect()
    }

    /// Every supported batch and transpose layout computes what the IR means.
    #[test]
    fn cublas_mapping_matches_row_major_semantics() {
        let cases: &[(&[usize], &[usize])] = &[
            (&[3, 4], &[4, 5]),
            (&[2, 3, 4], &[4, 5]),
            (&[2, 2, 3, 4], &[2, 2, 4, 5]),
            (&[3, 4], &[2, 4, 5]),
            // Grouped-query attention: keys broadcast over the query groups.
            (&[1, 2, 2, 3, 4], &[1, 2, 1, 4, 5]),
            (&[2, 3, 3, 4], &[3, 4, 5]),
            (&[2, 1, 3, 4], &[1, 2, 4, 5]),
        ];
        for &(ad0, bd0) in cases {
            for ta in [false, true] {
                for tb in [false, true] {
                    let mut ad = ad0.to_vec();
                    let mut bd = bd0.to_vec();
                    let (ra, rb) = (ad.len(), bd.len());
                    if ta {
                        ad.swap(ra - 2, ra - 1);
                    }
                    if tb {
                        bd.swap(rb - 2, rb - 1);
                    }
                    let a = data(ad.iter().product(), 1);
                    let b = data(bd.iter().product(), 7);
                    let g = matmul(
                        "t",
                        (A, &Shape::from(ad.clone()), DType::F32),
                        (B, &Shape::from(bd.clone()), DType::F32),
                        (C, DType::F32),
                        ta,
                        tb,
                        false,
                    )
                    .unwrap();
                    let want = row_major(&a, &ad, &b, &bd, ta, tb);
                    let mut got = vec![f32::NAN; want.len()];
                    for call in &g {
                        reference(call, &b, &a, &mut got);
                    }
                    assert_eq!(got, want, "{ad:?} {bd:?} {ta} {tb}");
                }
            }
        }
    }

    #[test]
    fn mixed_dtypes_and_bad_broadcasts_are_refused() {
        let s = |d: &[usize]| Shape::from(d.to_vec());
        let e = matmul(
            "t",
            (A, &s(&[2, 3, 3, 4]), DType::F32),
            (B, &s(&[3, 1, 4, 5]), DType::F32),
            (C, DType::F32),
            false,
            false,
            false,
        );
        assert!(e.unwrap_err().contains("do not broadcast"));
        let e = matmul(
            "t",
            (A, &s(&[3, 4]), DType::BF16),
            (B, &s(&[4, 5]), DType::F16),
            (C, DType::F32),
            false,
            false,
            false,
        );
        assert!(e.unwrap_err().contains("equal float operand dtypes"));
    }
}
