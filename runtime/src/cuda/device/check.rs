//! What is checked before anything is issued: every place a program names lies inside its
//! buffer, every product has types and sizes cuBLAS takes, every launch passes what its kernel
//! declares.

use super::args::arg_bytes;
use super::{blas_sys, CudaError};
use crate::cuda::program::{
    Arg, Command, Field, Gemm, GemmCompute, Launch, Place, Program, SlotKind, Table,
};
use castor_ir::DType;

/// cuBLAS's type for `d`, if it has one castor uses.
fn blas_type(d: DType) -> Option<blas_sys::cudaDataType> {
    match d {
        DType::F32 => Some(blas_sys::cudaDataType::CUDA_R_32F),
        DType::F16 => Some(blas_sys::cudaDataType::CUDA_R_16F),
        DType::BF16 => Some(blas_sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

/// The checked cuBLAS parameters of a product.
pub(super) struct GemmParams {
    pub(super) a_type: blas_sys::cudaDataType,
    pub(super) b_type: blas_sys::cudaDataType,
    pub(super) c_type: blas_sys::cudaDataType,
    pub(super) compute: blas_sys::cublasComputeType_t,
    pub(super) lda: i32,
    pub(super) ldb: i32,
    pub(super) ldc: i32,
}

/// The cuBLAS types and 32-bit leading dimensions of `g`, or why cuBLAS cannot run it.
pub(super) fn gemm_params(g: &Gemm) -> Result<GemmParams, CudaError> {
    let unsupported = |why: String| CudaError::Unsupported(format!("node `%{}`: {why}", g.node));
    let ty = |d: DType| {
        blas_type(d).ok_or_else(|| unsupported(format!("a matrix product of {d} operands")))
    };
    let (a_type, b_type, c_type) = (ty(g.a_dtype)?, ty(g.b_dtype)?, ty(g.c_dtype)?);
    // cublasGemmEx's table for CUBLAS_COMPUTE_32F: A and B of one type, C of that type or F32;
    // the TF32 compute type takes F32 only.
    let types_ok = g.a_dtype == g.b_dtype
        && (g.c_dtype == g.a_dtype || g.c_dtype == DType::F32)
        && (g.a_dtype != DType::F32 || g.c_dtype == DType::F32)
        && (g.compute != GemmCompute::Tf32 || g.a_dtype == DType::F32);
    if !types_ok {
        return Err(unsupported(format!(
            "cuBLAS has no product of {} x {} into {} with {:?} compute",
            g.a_dtype, g.b_dtype, g.c_dtype, g.compute
        )));
    }
    let compute = match g.compute {
        GemmCompute::F32 => blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        GemmCompute::Tf32 => blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
    };
    let int = |what: &str, v: i64| {
        i32::try_from(v).map_err(|_| unsupported(format!("{what} = {v} exceeds cuBLAS's 32 bits")))
    };
    Ok(GemmParams {
        a_type,
        b_type,
        c_type,
        compute,
        lda: int("lda", g.lda)?,
        ldb: int("ldb", g.ldb)?,
        ldc: int("ldc", g.ldc)?,
    })
}

/// The bytes each operand of `g` spans from its place: `(a, b, c)`, in column-major terms.
pub(super) fn gemm_extents(g: &Gemm) -> Result<(u64, u64, u64), String> {
    let (m, n, k, batch) = (
        i128::from(g.m),
        i128::from(g.n),
        i128::from(g.k),
        i128::from(g.batch),
    );
    if m < 0 || n < 0 || k < 0 || batch < 0 {
        return Err(format!("negative size m={m} n={n} k={k} batch={batch}"));
    }
    // (rows, cols) as stored, leading dimension, batch stride, element size.
    let operand = |name: &str, rows: i128, cols: i128, ld: i64, stride: i64, d: DType| {
        let (ld, stride) = (i128::from(ld), i128::from(stride));
        if ld < rows.max(1) {
            return Err(format!(
                "ld{name} = {ld} is less than the {rows} rows {name} stores"
            ));
        }
        if stride < 0 {
            return Err(format!("stride_{name} = {stride} is negative"));
        }
        let one = if rows == 0 || cols == 0 {
            0
        } else {
            (cols - 1) * ld + rows
        };
        let elems = if one == 0 || batch == 0 {
            0
        } else {
            (batch - 1) * stride + one
        };
        u64::try_from(elems * d.size_bytes() as i128)
            .map_err(|_| format!("operand {name} spans more than 2^64 bytes"))
    };
    let (ar, ac) = if g.transa { (k, m) } else { (m, k) };
    let (br, bc) = if g.transb { (n, k) } else { (k, n) };
    Ok((
        operand("a", ar, ac, g.lda, g.stride_a, g.a_dtype)?,
        operand("b", br, bc, g.ldb, g.stride_b, g.b_dtype)?,
        operand("c", m, n, g.ldc, g.stride_c, g.c_dtype)?,
    ))
}

/// Buffer sizes of a program: the arena, then each slot.
pub(super) struct Extents<'p> {
    pub(super) program: &'p Program,
}

impl Extents<'_> {
    /// `Ok` when `bytes` from `p` lie inside its buffer.
    pub(super) fn check(&self, p: Place, bytes: u64) -> Result<(), String> {
        let (size, offset, what) = match p {
            Place::Arena { offset } => (self.program.arena_bytes, offset, "the arena".to_string()),
            Place::Slot { slot, offset } => match self.program.slots.get(slot) {
                Some(s) => (s.bytes, offset, format!("slot {slot} (`{}`)", s.name)),
                None => {
                    return Err(format!(
                        "slot {slot} does not exist (the program has {})",
                        self.program.slots.len()
                    ))
                }
            },
        };
        match offset.checked_add(bytes) {
            Some(end) if end <= size => Ok(()),
            _ => Err(format!(
                "{bytes} bytes at offset {offset} overrun {what} ({size} bytes)"
            )),
        }
    }
}

/// Every place, module and table a program names, checked against its buffers, so that
/// nothing issued later can address memory outside them (kernel pointers are checked to
/// start inside their buffer; copies, fills and products to end inside it).
pub(super) fn check_program(program: &Program) -> Result<(), CudaError> {
    let ext = Extents { program };
    let bad = |at: &str, why: String| CudaError::Data(format!("{at}: {why}"));
    for (i, slot) in program.slots.iter().enumerate() {
        if let SlotKind::Constant(bytes) = &slot.kind {
            if bytes.len() as u64 > slot.bytes {
                return Err(bad(
                    &format!("slot {i} (`{}`)", slot.name),
                    format!(
                        "{} constant bytes do not fit its {} bytes",
                        bytes.len(),
                        slot.bytes
                    ),
                ));
            }
        }
    }
    for (t, table) in program.tables.iter().enumerate() {
        if let Table::Rows(rows) = table {
            for (r, row) in rows.iter().enumerate() {
                for f in row {
                    if let Field::Ptr(p) = f {
                        ext.check(*p, 0)
                            .map_err(|why| bad(&format!("table {t} row {r}"), why))?;
                    }
                }
            }
        }
    }
    let runs = std::iter::once(("the prologue", &program.prologue))
        .chain(program.runs.iter().map(|r| (r.name.as_str(), &r.commands)));
    for (run, commands) in runs {
        for (i, c) in commands.iter().enumerate() {
            let at = |node: &str| format!("run `{run}` command {i} (node `%{node}`)");
            match c {
                Command::Launch(l) => {
                    let at = at(&l.node);
                    if l.module >= program.modules.len() {
                        return Err(bad(
                            &at,
                            format!(
                                "module {} does not exist (the program has {})",
                                l.module,
                                program.modules.len()
                            ),
                        ));
                    }
                    let (g, b) = (l.grid, l.block);
                    if [g.0, g.1, g.2, b.0, b.1, b.2].contains(&0) {
                        return Err(bad(
                            &at,
                            format!("kernel `{}` launched with grid {g:?} block {b:?}", l.entry),
                        ));
                    }
                    for arg in &l.args {
                        match arg {
                            Arg::Ptr(p) => ext.check(*p, 0).map_err(|why| bad(&at, why))?,
                            Arg::Table(t) if *t >= program.tables.len() => {
                                return Err(bad(
                                    &at,
                                    format!(
                                        "table {t} does not exist (the program has {})",
                                        program.tables.len()
                                    ),
                                ))
                            }
                            _ => {}
                        }
                    }
                }
                Command::Gemm(g) => {
                    let at = at(&g.node);
                    gemm_params(g)?;
                    let (a, b, c) = gemm_extents(g).map_err(|why| bad(&at, why))?;
                    for (p, bytes) in [(g.a, a), (g.b, b), (g.c, c)] {
                        ext.check(p, bytes).map_err(|why| bad(&at, why))?;
                    }
                }
                Command::Copy { dst, src, bytes } => {
                    let at = at("copy");
                    ext.check(*dst, *bytes).map_err(|why| bad(&at, why))?;
                    ext.check(*src, *bytes).map_err(|why| bad(&at, why))?;
                }
                Command::Memset { dst, bytes, .. } => {
                    ext.check(*dst, *bytes)
                        .map_err(|why| bad(&at("memset"), why))?;
                }
            }
        }
    }
    Ok(())
}

/// Checks a launch's arguments against its kernel's parameter sizes.
pub(super) fn check_args(l: &Launch, module: &str, sizes: &[usize]) -> Result<(), CudaError> {
    // The driver reporting no parameters for a kernel launched with some is more likely a
    // query it does not support than a kernel without parameters: let the launch decide.
    if sizes.is_empty() && !l.args.is_empty() {
        return Ok(());
    }
    let at = || {
        format!(
            "node `%{}`: kernel `{}` of module `{module}`",
            l.node, l.entry
        )
    };
    if sizes.len() != l.args.len() {
        return Err(CudaError::Data(format!(
            "{} takes {} parameters, the launch passes {}",
            at(),
            sizes.len(),
            l.args.len()
        )));
    }
    for (i, (arg, &size)) in l.args.iter().zip(sizes).enumerate() {
        let n = arg_bytes(arg, &|_| 0, &|_| 0).len();
        if n != size {
            return Err(CudaError::Data(format!(
                "{}: parameter {i} is {size} bytes, the launch passes {arg:?} ({n} bytes)",
                at()
            )));
        }
    }
    Ok(())
}
