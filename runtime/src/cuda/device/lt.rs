//! Products with an epilogue, and FP8 products, through cuBLASLt: the matmul descriptor
//! carries the epilogue and its buffers, or an FP8 product's scale pointers and its fast
//! accumulation setting; the algorithm is cuBLASLt's first heuristic choice within the
//! products' workspace (`PRODUCT_WORKSPACE`) and the operands' actual alignment, and split-K
//! reductions are kept out of a 16-bit output type (as the cuBLAS handle's math mode does for
//! plain products: [`reduction_schemes`]), so C is rounded once.
//!
//! An FP8 product (`Gemm::fp8`): A and B are `CUDA_R_8F_E4M3` or `CUDA_R_8F_E5M2` in the "TN"
//! form `Gemm::check` holds them to, C (= D) BF16, F16 or F32, compute `CUBLAS_COMPUTE_32F`
//! with F32 scalars, `A_SCALE_POINTER` and `B_SCALE_POINTER` at the device F32 dequantization
//! factors the program wrote before the call, and `FAST_ACCUM` as the program says (off in
//! castor's plans: see `Fp8Scales::fast_accum`). No C or D scale and no `AMAX_D_POINTER`:
//! cuBLASLt reads those only for an FP8 C or D.

use super::check::GemmParams;
use super::load::Loaded;
use super::CudaError;
use crate::cuda::program::{Epilogue, Gemm, GemmCompute, Place, PRODUCT_WORKSPACE};
use castor_ir::DType;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lt_sys;
use std::ffi::c_void;

/// A cuBLASLt handle, destroyed on drop.
pub(super) struct LtHandle(pub(super) lt_sys::cublasLtHandle_t);

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by cublasLtCreate and is destroyed once, here.
        let _ = unsafe { lt::destroy_handle(self.0) };
    }
}

impl LtHandle {
    pub(super) fn create() -> Result<LtHandle, CudaError> {
        lt::create_handle()
            .map(LtHandle)
            .map_err(|e| lt_error("", "cublasLtCreate", e))
    }
}

fn lt_error(node: &str, call: &str, e: lt::CublasError) -> CudaError {
    let hint = match e.0 {
        lt_sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => {
            " (cuBLASLt has no kernel for this epilogue with these types, transposes and sizes)"
        }
        lt_sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE => {
            " (a size, leading dimension or epilogue buffer is invalid)"
        }
        _ => "",
    };
    CudaError::Cublas {
        node: node.to_string(),
        message: format!("{call} returned {:?}{hint}", e.0),
    }
}

fn lt_type(d: DType) -> lt_sys::cudaDataType {
    match d {
        DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => lt_sys::cudaDataType::CUDA_R_16BF,
        DType::F8E4M3 => lt_sys::cudaDataType::CUDA_R_8F_E4M3,
        DType::F8E5M2 => lt_sys::cudaDataType::CUDA_R_8F_E5M2,
        _ => lt_sys::cudaDataType::CUDA_R_32F,
    }
}

/// The alignment cuBLASLt's `MIN_ALIGNMENT_*_BYTES` preferences take for a buffer at
/// `address`: the largest power of two dividing it, at most 256 (the preferences' default).
fn min_alignment(address: u64) -> u32 {
    if address == 0 {
        return 256;
    }
    1u32 << address.trailing_zeros().min(8)
}

/// The split-K reduction schemes a product with output type `c` may use
/// (`CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK`; an algorithm without split-K is always
/// allowed): the partial sums kept in the compute type (F32) in the workspace and summed in a
/// separate step, so C is rounded once; and, for an F32 C only, the in-place scheme, which adds
/// the parts up in C's own type (for a 16-bit C that would round after every part).
fn reduction_schemes(c: DType) -> u32 {
    use lt_sys::cublasLtReductionScheme_t as R;
    let compute = R::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
    match c {
        DType::F32 => compute | R::CUBLASLT_REDUCTION_SCHEME_INPLACE as u32,
        _ => compute,
    }
}

/// Descriptors destroyed on drop, whatever fails in between.
struct Descriptors {
    desc: Option<lt_sys::cublasLtMatmulDesc_t>,
    layouts: Vec<lt_sys::cublasLtMatrixLayout_t>,
    pref: Option<lt_sys::cublasLtMatmulPreference_t>,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by its cuBLASLt constructor and is destroyed
        // once, here.
        unsafe {
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            if let Some(d) = self.desc {
                let _ = lt::destroy_matmul_desc(d);
            }
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
        }
    }
}

impl Loaded {
    /// Issues `g` (which has an epilogue) as one `cublasLtMatmul` on the stream.
    pub(super) fn gemm_lt(&self, g: &Gemm, p: &GemmParams) -> Result<(), CudaError> {
        let err = |call: &'static str| move |e: lt::CublasError| lt_error(&g.node, call, e);
        let ptr = |place: Place| -> *mut c_void {
            std::ptr::without_provenance_mut(self.address(place) as usize)
        };
        let compute = match g.compute {
            GemmCompute::F32 => lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            GemmCompute::Tf32 => lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        };
        let mut d = Descriptors {
            desc: None,
            layouts: Vec::new(),
            pref: None,
        };
        let desc = lt::create_matmul_desc(compute, lt_sys::cudaDataType::CUDA_R_32F)
            .map_err(err("cublasLtMatmulDescCreate"))?;
        d.desc = Some(desc);
        let set = |attr: lt_sys::cublasLtMatmulDescAttributes_t, value: &[u8]| {
            // SAFETY: the descriptor is live; `value` holds the attribute's documented type.
            unsafe { lt::set_matmul_desc_attribute(desc, attr, value.as_ptr().cast(), value.len()) }
                .map_err(err("cublasLtMatmulDescSetAttribute"))
        };
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        let op = |t: bool| (t as i32).to_ne_bytes();
        set(A::CUBLASLT_MATMUL_DESC_TRANSA, &op(g.transa))?;
        set(A::CUBLASLT_MATMUL_DESC_TRANSB, &op(g.transb))?;
        use lt_sys::cublasLtEpilogue_t as E;
        let (epilogue, bias, aux, bias_type) = match g.epilogue {
            Epilogue::None => (E::CUBLASLT_EPILOGUE_DEFAULT, None, None, None),
            Epilogue::Bias { bias } => (E::CUBLASLT_EPILOGUE_BIAS, Some(bias), None, None),
            Epilogue::BiasGelu { bias, aux } => (
                E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                Some(bias),
                Some(aux),
                None,
            ),
            Epilogue::GeluGrad { aux } => (E::CUBLASLT_EPILOGUE_DGELU, None, Some(aux), None),
            // The bias gradients are F32 whatever C's type.
            Epilogue::BiasGradA { bias_grad } => (
                E::CUBLASLT_EPILOGUE_BGRADA,
                Some(bias_grad),
                None,
                Some(lt_sys::cudaDataType::CUDA_R_32F),
            ),
            Epilogue::BiasGradB { bias_grad } => (
                E::CUBLASLT_EPILOGUE_BGRADB,
                Some(bias_grad),
                None,
                Some(lt_sys::cudaDataType::CUDA_R_32F),
            ),
        };
        set(
            A::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &(epilogue as u32).to_ne_bytes(),
        )?;
        if let Some(b) = bias {
            set(
                A::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &(ptr(b) as usize).to_ne_bytes(),
            )?;
        }
        if let Some(t) = bias_type {
            set(
                A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                &(t as i32).to_ne_bytes(),
            )?;
        }
        if let Some(a) = aux {
            set(
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                &(ptr(a) as usize).to_ne_bytes(),
            )?;
            set(
                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                &g.ldc.to_ne_bytes(),
            )?;
        }
        if let Some(scales) = &g.fp8 {
            for (attr, place) in [
                (A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scales.a_scale),
                (A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scales.b_scale),
            ] {
                set(attr, &(ptr(place) as usize).to_ne_bytes())?;
            }
            // An int8_t: 0 promotes the tensor cores' partial sums to F32 at intervals.
            set(
                A::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                &[i8::from(scales.fast_accum) as u8],
            )?;
        }
        // Layouts of A, B and C (= D) as stored, column-major.
        let (m, n, k) = (g.m as u64, g.n as u64, g.k as u64);
        let (ar, ac) = if g.transa { (k, m) } else { (m, k) };
        let (br, bc) = if g.transb { (n, k) } else { (k, n) };
        for (dtype, rows, cols, ld) in [
            (g.a_dtype, ar, ac, p.lda),
            (g.b_dtype, br, bc, p.ldb),
            (g.c_dtype, m, n, p.ldc),
        ] {
            let l = lt::create_matrix_layout(lt_type(dtype), rows, cols, i64::from(ld))
                .map_err(err("cublasLtMatrixLayoutCreate"))?;
            d.layouts.push(l);
        }
        let pref = lt::create_matmul_pref().map_err(err("cublasLtMatmulPreferenceCreate"))?;
        d.pref = Some(pref);
        use lt_sys::cublasLtMatmulPreferenceAttributes_t as P;
        let workspace = self.workspace_bytes.min(PRODUCT_WORKSPACE) as usize;
        let scheme = reduction_schemes(g.c_dtype).to_ne_bytes();
        // The heuristic assumes 256-byte aligned operands unless told otherwise, and an
        // algorithm chosen for alignment the pointers lack makes `cublasLtMatmul` itself return
        // NOT_SUPPORTED; so it is told each operand's alignment (as PyTorch's cuBLASLt calls
        // do). Places are fixed for the program's life, so the choice holds for every replay.
        let align = |place: Place| min_alignment(self.address(place)).to_ne_bytes();
        let (align_a, align_b, align_c) = (align(g.a), align(g.b), align(g.c));
        for (attr, value) in [
            (
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &(workspace as u64).to_ne_bytes()[..],
            ),
            (P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &scheme[..]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a[..]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b[..]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c[..]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c[..]),
        ] {
            // SAFETY: the preference is live; `value` holds the attribute's documented type.
            unsafe {
                lt::set_matmul_pref_attribute(pref, attr, value.as_ptr().cast(), value.len())
            }
            .map_err(err("cublasLtMatmulPreferenceSetAttribute"))?;
        }
        let (la, lb, lc) = (d.layouts[0], d.layouts[1], d.layouts[2]);
        // SAFETY: every descriptor is live.
        let heuristic =
            unsafe { lt::get_matmul_algo_heuristic(self.dev.lt.0, desc, la, lb, lc, lc, pref) }
                .map_err(err("cublasLtMatmulAlgoGetHeuristic"))?;
        let (alpha, beta) = (g.alpha, 0.0f32);
        // SAFETY: the handle and descriptors are live; alpha and beta are host F32 scalars
        // (the default pointer mode and the F32 scale type); every operand and epilogue buffer
        // spans what its layout implies inside a live allocation (checked at load); the
        // workspace is a live allocation of `workspace` bytes.
        unsafe {
            lt::matmul(
                self.dev.lt.0,
                desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                ptr(g.a),
                la,
                ptr(g.b),
                lb,
                ptr(g.c),
                lc,
                ptr(g.c),
                lc,
                &heuristic.algo,
                std::ptr::without_provenance_mut(self.workspace as usize),
                workspace,
                self.dev.stream().cast(),
            )
        }
        .map_err(err("cublasLtMatmul"))
    }
}

#[cfg(test)]
mod tests {
    use super::{min_alignment, reduction_schemes};
    use castor_ir::DType;
    use cudarc::cublaslt::sys::cublasLtReductionScheme_t as R;

    #[test]
    fn split_k_parts_are_summed_in_f32_never_in_a_16_bit_output() {
        let (inplace, compute, output) = (
            R::CUBLASLT_REDUCTION_SCHEME_INPLACE as u32,
            R::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32,
            R::CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE as u32,
        );
        for c in [DType::BF16, DType::F16] {
            assert_eq!(reduction_schemes(c), compute, "{c}");
            assert_eq!(reduction_schemes(c) & (inplace | output), 0, "{c}");
        }
        assert_eq!(reduction_schemes(DType::F32), compute | inplace);
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(min_alignment(0x7f00_0000_0000), 256);
        assert_eq!(min_alignment(0x7f00_0000_0100 + 64), 64);
        assert_eq!(min_alignment(0x7f00_0000_0000 + 16), 16);
        assert_eq!(min_alignment(0x7f00_0000_0000 + 2), 2);
        assert_eq!(min_alignment(0x7f00_0000_0000 + 3), 1);
    }
}
