//! The cuBLAS product: a naive column-major batched GEMM with cuBLAS's argument checks.

use super::memory::{check_uses, use_, Io, Mem, Ptr};
use super::R;
use crate::cuda::program::{Gemm, GemmCompute};
use castor_ir::{round_tf32, DType};

/// `C[i] = op(A[i]) · op(B[i])` in column-major terms: F32 accumulation by fused
/// multiply-adds in `k` order (cuBLAS's SGEMM accumulates with FFMA; the CPU executor's `gemm`
/// crate with FMA in the same order, so small products match it bit for bit), operands
/// rounded to TF32 under [`GemmCompute::Tf32`], the result rounded to `c_dtype` (beta = 0).
pub(super) fn gemm(m: &mut Mem, g: &Gemm) -> R<()> {
    let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    if g.a_dtype != g.b_dtype || !float(g.a_dtype) || !float(g.c_dtype) {
        return Err(format!(
            "cuBLAS has no {} x {} -> {} product",
            g.a_dtype.name(),
            g.b_dtype.name(),
            g.c_dtype.name()
        ));
    }
    if g.c_dtype != g.a_dtype && g.c_dtype != DType::F32 {
        return Err(format!(
            "a {} product cannot write {}",
            g.a_dtype.name(),
            g.c_dtype.name()
        ));
    }
    let dims = [g.m, g.n, g.k, g.batch];
    if dims.iter().any(|&d| d < 0) {
        return Err(format!("negative sizes m, n, k, batch = {dims:?}"));
    }
    let (mm, nn, kk, batch) = (g.m as i64, g.n as i64, g.k as i64, g.batch as i64);
    // cuBLAS's CUBLAS_STATUS_INVALID_VALUE conditions on the leading dimensions.
    let (a_rows, a_cols) = if g.transa { (kk, mm) } else { (mm, kk) };
    let (b_rows, b_cols) = if g.transb { (nn, kk) } else { (kk, nn) };
    if g.lda < a_rows.max(1) || g.ldb < b_rows.max(1) || g.ldc < mm.max(1) {
        return Err(format!(
            "leading dimensions lda {} ldb {} ldc {} below the rows {a_rows}, {b_rows}, {mm} \
             (cuBLAS refuses the call)",
            g.lda, g.ldb, g.ldc
        ));
    }
    if g.stride_a < 0 || g.stride_b < 0 || g.stride_c < 0 {
        return Err("negative batch strides".into());
    }
    if batch > 1 && g.stride_c < g.ldc * nn && mm * nn > 0 {
        return Err(format!(
            "stride_c {} < ldc * n = {}: the batch entries' outputs overlap",
            g.stride_c,
            g.ldc * nn
        ));
    }
    if mm * nn * batch == 0 {
        return Ok(());
    }
    let (pa, pb, pc) = (m.place(g.a), m.place(g.b), m.place(g.c));
    let extent = |rows: i64, cols: i64, ld: i64, stride: i64| -> u64 {
        if rows * cols == 0 {
            0
        } else {
            ((batch - 1) * stride + (cols - 1) * ld + rows) as u64
        }
    };
    let (ea, ec) = (g.a_dtype.size_bytes(), g.c_dtype.size_bytes());
    check_uses(
        m,
        &[
            use_(
                "A",
                Some(pa),
                extent(a_rows, a_cols, g.lda, g.stride_a) * ea as u64,
                ea,
                Io::R,
            ),
            use_(
                "B",
                Some(pb),
                extent(b_rows, b_cols, g.ldb, g.stride_b) * ea as u64,
                ea,
                Io::R,
            ),
            use_(
                "C",
                Some(pc),
                extent(mm, nn, g.ldc, g.stride_c) * ec as u64,
                ec,
                Io::W,
            ),
        ],
        &[],
    )?;
    let tf32 = g.compute == GemmCompute::Tf32;
    let load = |m: &Mem, p: Ptr, i: i64, d: DType| -> R<f32> {
        let v = m.f(p, i, d)?;
        Ok(if tf32 { round_tf32(v) } else { v })
    };
    let (mu, nu, ku) = (mm as usize, nn as usize, kk as usize);
    for b in 0..batch {
        let (ao, bo, co) = (b * g.stride_a, b * g.stride_b, b * g.stride_c);
        // op(A) row-major [m][k], op(B) column-major [n][k].
        let mut opa = vec![0f32; mu * ku];
        for i in 0..mm {
            for p in 0..kk {
                let at = if g.transa {
                    p + i * g.lda
                } else {
                    i + p * g.lda
                };
                opa[i as usize * ku + p as usize] = load(m, pa, ao + at, g.a_dtype)?;
            }
        }
        let mut opb = vec![0f32; nu * ku];
        for j in 0..nn {
            for p in 0..kk {
                let at = if g.transb {
                    j + p * g.ldb
                } else {
                    p + j * g.ldb
                };
                opb[j as usize * ku + p as usize] = load(m, pb, bo + at, g.b_dtype)?;
            }
        }
        for j in 0..nu {
            for i in 0..mu {
                let mut s = 0f32;
                for p in 0..ku {
                    s = opa[i * ku + p].mul_add(opb[j * ku + p], s);
                }
                m.set_f(pc, co + i as i64 + j as i64 * g.ldc, g.c_dtype, s)?;
            }
        }
    }
    Ok(())
}
