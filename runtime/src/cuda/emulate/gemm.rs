//! The cuBLAS product, with cuBLAS's argument checks, computed by the CPU executor's own matrix
//! product on the same operands, so that an emulated plan's products are the CPU executor's
//! bit for bit. (The device's cuBLAS sums in its own order: on a GPU, products agree with the
//! CPU executor to F32 rounding, not bit for bit.)
//!
//! An FP8 product (cuBLASLt, `Gemm::fp8`) is checked against cuBLASLt's FP8 rules (types, the
//! "TN" form, alignment; `Gemm::check`), its FP8 operands are read from the bytes the program
//! wrote (the quantize kernels' output, or the transposed copies the lowering planned), and its
//! two dequantization factors from device memory through the scale pointers. It is computed as
//! the CPU executor computes `fp8_matmul` (`cpu/dispatch/products.rs`, which brings its operands
//! to the same "TN" form): the F32 product of the FP8 values, times the product of the two
//! factors, rounded once to C's type. What this checks is the lowering (layouts, transposed
//! copies, scale pointers and the kernels that fill them), not cuBLASLt's summation order or
//! its fast-accumulation mode, which only a GPU shows.

use super::memory::{check_uses, use_, Io, Mem, Ptr};
use super::R;
use crate::cpu::epilogue;
use crate::cpu::matmul::{matmul, Operand};
use crate::cuda::program::{Epilogue, Gemm, GemmCompute, Place};
use castor_ir::{round_tf32, DType};

/// `C[i] = op(A[i]) · op(B[i])` in column-major terms: the CPU executor's product of the
/// operands (rounded to TF32 first under [`GemmCompute::Tf32`], as the CPU executor rounds
/// them), the result rounded to `c_dtype`; under `accumulate` (beta = 1) the product is added
/// to C in F32 and then rounded, as the CPU executor adds a chunk's product to its sum.
pub(super) fn gemm(m: &mut Mem, g: &Gemm) -> R<()> {
    let (ea_bytes, eb_bytes, ec_bytes) = g.check()?;
    let (mm, nn, kk, batch) = (g.m as i64, g.n as i64, g.k as i64, g.batch as i64);
    if mm * nn * batch == 0 {
        return Ok(());
    }
    let (pa, pb, pc) = (m.place(g.a), m.place(g.b), m.place(g.c));
    let (ea, ec) = (g.a_dtype.size_bytes(), g.c_dtype.size_bytes());
    let extras = g.epilogue_extents()?;
    let mut uses = vec![
        use_("A", Some(pa), ea_bytes, ea, Io::R),
        use_("B", Some(pb), eb_bytes, ea, Io::R),
        use_(
            "C",
            Some(pc),
            ec_bytes,
            ec,
            if g.accumulate { Io::Rw } else { Io::W },
        ),
    ];
    for &(name, place, bytes, written) in &extras {
        let size = if name == "bias_grad" { 4 } else { ec };
        let io = if written { Io::W } else { Io::R };
        uses.push(use_(name, Some(m.place(place)), bytes, size, io));
    }
    for (name, place) in g.fp8.iter().flat_map(|s| s.buffers()) {
        uses.push(use_(name, Some(m.place(place)), 4, 4, Io::R));
    }
    check_uses(m, &uses, &[])?;
    let tf32 = g.compute == GemmCompute::Tf32;
    let load = |m: &Mem, p: Ptr, i: i64, d: DType| -> R<f32> {
        let v = m.f(p, i, d)?;
        Ok(if tf32 { round_tf32(v) } else { v })
    };
    let (mu, nu, ku) = (mm as usize, nn as usize, kk as usize);
    // In the CPU executor's row-major terms, C (column-major m x n) is C' = L R, row-major
    // n x m, with L = op(B)^T (n x k) and R = op(A)^T (k x m): the IR's own operands, which
    // the lowering passed as B and A. Each is gathered into the layout the IR stores it in:
    // L as [n, k], or [k, n] read transposed; R as [k, m], or [m, k] read transposed.
    let gather = |p: Ptr, at: i64, rows: usize, cols: usize, ld: i64, d: DType| -> R<Vec<f32>> {
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            for c in 0..cols {
                out.push(load(m, p, at + r as i64 * ld + c as i64, d)?);
            }
        }
        Ok(out)
    };
    // A right operand shared by every batch entry with contiguous left operands is one taller
    // product, as the CPU executor folds it (the same sums either way; folded, the product
    // shapes, and so `gemm`'s kernels, are the CPU executor's).
    let fold = batch > 1 && g.stride_a == 0 && !g.transb && g.ldb == kk && g.stride_b == nn * kk;
    let (entries, rows) = if fold {
        (1, nu * batch as usize)
    } else {
        (batch, nu)
    };
    let mut out = Vec::with_capacity((batch as usize) * nu * mu);
    for b in 0..entries {
        let (ao, bo) = (b * g.stride_a, b * g.stride_b);
        let (l_data, l_shape) = if g.transb {
            (gather(pb, bo, ku, rows, g.ldb, g.b_dtype)?, [ku, rows])
        } else {
            (gather(pb, bo, rows, ku, g.ldb, g.b_dtype)?, [rows, ku])
        };
        let (r_data, r_shape) = if g.transa {
            (gather(pa, ao, mu, ku, g.lda, g.a_dtype)?, [mu, ku])
        } else {
            (gather(pa, ao, ku, mu, g.lda, g.a_dtype)?, [ku, mu])
        };
        let l = Operand {
            data: &l_data,
            shape: &l_shape,
            transpose: g.transb,
        };
        let r = Operand {
            data: &r_data,
            shape: &r_shape,
            transpose: g.transa,
        };
        out.extend(matmul(&l, &r, &[rows, mu]));
    }
    // An operand stored `[k, cols]` with leading dimension `ld`, row-major, as loaded.
    let raw = |m: &Mem, p: Ptr, cols: usize, ld: i64, d: DType| -> R<Vec<f32>> {
        let mut v = Vec::with_capacity(ku * cols);
        for r in 0..ku as i64 {
            for c in 0..cols as i64 {
                v.push(m.f(p, r * ld + c, d)?);
            }
        }
        Ok(v)
    };
    let store_vector = |m: &mut Mem, p: Place, v: &[f32]| -> R<()> {
        let p = m.place(p);
        for (i, &x) in v.iter().enumerate() {
            m.set_f(p, i as i64, DType::F32, x)?;
        }
        Ok(())
    };
    // cuBLASLt's FP8 scales: the product of the two factors (each 1 / an operand's scale, in
    // F32), then the F32 sum times it, as the CPU executor's `fp8_matmul` dequantizes.
    if let Some(scales) = &g.fp8 {
        let a_scale = m.f(m.place(scales.a_scale), 0, DType::F32)?;
        let b_scale = m.f(m.place(scales.b_scale), 0, DType::F32)?;
        let factor = a_scale * b_scale;
        out.iter_mut().for_each(|v| *v *= factor);
    }
    // cuBLAS's alpha on the F32 product, before the epilogue (as the CPU executor's
    // `matmul_scaled` multiplies it).
    if g.alpha != 1.0 {
        epilogue::scale(&mut out, f64::from(g.alpha));
    }
    // The epilogue, on the F32 product of the single entry (row-major [n, m] here).
    let vector = |m: &Mem, p: Place, d: DType| -> R<Vec<f32>> {
        let p = m.place(p);
        (0..mu as i64).map(|i| m.f(p, i, d)).collect()
    };
    let matrix = |m: &Mem, p: Place| -> R<Vec<f32>> {
        let p = m.place(p);
        let mut v = Vec::with_capacity(nu * mu);
        for j in 0..nu as i64 {
            for i in 0..mu as i64 {
                v.push(m.f(p, i + j * g.ldc, g.c_dtype)?);
            }
        }
        Ok(v)
    };
    match g.epilogue {
        Epilogue::None => {}
        Epilogue::Bias { bias } => epilogue::add_bias(&mut out, &vector(m, bias, g.c_dtype)?),
        Epilogue::BiasGelu { bias, aux } => {
            let act = epilogue::bias_gelu(&mut out, &vector(m, bias, g.c_dtype)?);
            let pa = m.place(aux);
            for j in 0..nu {
                for i in 0..mu {
                    let at = i as i64 + j as i64 * g.ldc;
                    m.set_f(pa, at, g.c_dtype, out[j * mu + i])?;
                }
            }
            out = act;
        }
        Epilogue::GeluGrad { aux } => epilogue::gelu_grad(&mut out, &matrix(m, aux)?),
        // The summed operand as the IR stores it, `[k, len]` (the inner dim first: A not
        // transposed, B transposed), its values unrounded even under TF32.
        Epilogue::BiasGradA { bias_grad } if !g.transa => {
            let a = raw(m, pa, mu, g.lda, g.a_dtype)?;
            store_vector(m, bias_grad, &epilogue::bias_grad(&a, ku, mu))?;
        }
        Epilogue::BiasGradB { bias_grad } if g.transb => {
            let b = raw(m, pb, nu, g.ldb, g.b_dtype)?;
            store_vector(m, bias_grad, &epilogue::bias_grad(&b, ku, nu))?;
        }
        Epilogue::BiasGradA { .. } | Epilogue::BiasGradB { .. } => {
            return Err(format!(
                "the {} epilogue sums an operand stored with its inner dim first",
                g.epilogue.name()
            ));
        }
    }
    for b in 0..batch as usize {
        let co = b as i64 * g.stride_c;
        for j in 0..nu {
            for i in 0..mu {
                let at = co + i as i64 + j as i64 * g.ldc;
                let mut v = out[(b * nu + j) * mu + i];
                if g.accumulate {
                    v += m.f(pc, at, g.c_dtype)?;
                }
                m.set_f(pc, at, g.c_dtype, v)?;
            }
        }
    }
    Ok(())
}
