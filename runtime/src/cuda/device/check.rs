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
        // cuBLASLt only (FP8 products).
        DType::F8E4M3 => Some(blas_sys::cudaDataType::CUDA_R_8F_E4M3),
        DType::F8E5M2 => Some(blas_sys::cudaDataType::CUDA_R_8F_E5M2),
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

/// The cuBLAS types and 32-bit leading dimensions of `g`, or why cuBLAS cannot run it
/// ([`Gemm::check`], then cuBLAS's 32-bit arguments).
pub(super) fn gemm_params(g: &Gemm) -> Result<GemmParams, CudaError> {
    let unsupported = |why: String| CudaError::Unsupported(format!("node `%{}`: {why}", g.node));
    g.check().map_err(unsupported)?;
    let ty = |d: DType| {
        blas_type(d).ok_or_else(|| unsupported(format!("a matrix product of {d} operands")))
    };
    let (a_type, b_type, c_type) = (ty(g.a_dtype)?, ty(g.b_dtype)?, ty(g.c_dtype)?);
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

/// Buffer sizes of a program: the arena, then each slot.
pub(super) struct Extents<'p> {
    pub(super) program: &'p Program,
}

impl Extents<'_> {
    /// `Ok` when `bytes` from `p` lie inside its buffer.
    pub(super) fn check(&self, p: Place, bytes: u64) -> Result<(), String> {
        let (size, offset, what) = match p {
            Place::Arena { offset } => (self.program.arena_bytes, offset, "the arena".to_string()),
            Place::Buffer { buffer, .. } => {
                return Err(format!(
                    "arena buffer {} was never placed (a lowering bug)",
                    buffer.0
                ))
            }
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
        // A cuDNN attention's prelude and fallback are checked as commands of the run.
        let expanded = commands.iter().flat_map(|c| {
            let nested: Vec<&Command> = match c {
                Command::Sdpa(call) => call.nested().collect(),
                _ => Vec::new(),
            };
            std::iter::once(c).chain(nested)
        });
        for (i, c) in expanded.enumerate() {
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
                    let (a, b, c) = g.check().map_err(|why| bad(&at, why))?;
                    for (p, bytes) in [(g.a, a), (g.b, b), (g.c, c)] {
                        ext.check(p, bytes).map_err(|why| bad(&at, why))?;
                    }
                    for (_, p, bytes, _) in g.epilogue_extents().map_err(|why| bad(&at, why))? {
                        ext.check(p, bytes).map_err(|why| bad(&at, why))?;
                    }
                    for (_, p) in g.fp8.iter().flat_map(|s| s.buffers()) {
                        ext.check(p, 4).map_err(|why| bad(&at, why))?;
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
                Command::Collective {
                    src,
                    dst,
                    src_bytes,
                    dst_bytes,
                    ..
                } => {
                    let at = at("collective");
                    ext.check(*src, *src_bytes).map_err(|why| bad(&at, why))?;
                    ext.check(*dst, *dst_bytes).map_err(|why| bad(&at, why))?;
                }
                Command::Join { .. } => {}
                Command::Sdpa(call) => {
                    let at = at(&call.node);
                    for (role, bytes, place) in call.extents() {
                        ext.check(place, bytes)
                            .map_err(|why| bad(&at, format!("{role}: {why}")))?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks a launch's arguments against its kernel's parameter sizes (from its PTX).
pub(super) fn check_args(l: &Launch, module: &str, sizes: &[usize]) -> Result<(), CudaError> {
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
