//! castor's hand-written CUDA kernels: the sources, embedded in the binary, and the offline
//! check that compiles them.
//!
//! Every kernel file in `kernels/*.cu` is listed in [`FILES`] with its `extern "C"` entry
//! points. The sources are compiled at run time with NVRTC ([`nvrtc::Nvrtc`]), which needs no
//! GPU and no CUDA toolkit, only the NVRTC library and the CUDA headers; [`ptxas`] reports
//! each kernel's registers, shared memory and spills when `ptxas` is available.
// Data from files and users must never reach an unwrap: errors are values here.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod attention;
pub mod cache;
pub mod host;
pub mod nvrtc;
pub mod ptx;
pub mod ptxas;
pub mod sass;
pub mod signature;

pub use cache::{CacheError, KernelCache, Outcome};
pub use nvrtc::{Nvrtc, NvrtcError};
pub use signature::{signature, Param, ParamKind, Signature, SignatureError};

/// The GPU architecture kernels are built for (H100, H200).
pub const DEFAULT_ARCH: &str = "sm_90";

/// The header every kernel file includes, as `(include name, source)`.
pub const COMMON_HEADER: (&str, &str) = ("castor_common.cuh", include_str!("../common.cuh"));

/// One kernel source file and the entry points it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelFile {
    /// The file name, e.g. `"norm.cu"`.
    pub name: &'static str,
    pub source: &'static str,
    /// Its `extern "C" __global__` functions, sorted by name.
    pub entry_points: &'static [&'static str],
}

/// The kernel file named `name` (`"norm.cu"`).
pub fn file(name: &str) -> Option<&'static KernelFile> {
    FILES.iter().find(|f| f.name == name)
}

/// Entry points whose blocks wait for blocks with a lower index (`wait_flag` in
/// `common.cuh`): the host build runs their blocks in index order, as the device dispatches
/// them, in either thread order.
pub const BLOCK_ORDERED: &[&str] = &[
    "attention_bwd_bf16_d128",
    "attention_bwd_bf16_d16",
    "attention_bwd_bf16_d32",
    "attention_bwd_bf16_d64",
    "attention_bwd_f16_d128",
    "attention_bwd_f16_d16",
    "attention_bwd_f16_d32",
    "attention_bwd_f16_d64",
];

/// Whether `entry`'s blocks wait for blocks with a lower index ([`BLOCK_ORDERED`]).
pub fn waits_for_earlier_blocks(entry: &str) -> bool {
    BLOCK_ORDERED.contains(&entry)
}

/// The kernel file that defines `entry`.
pub fn file_of(entry: &str) -> Option<&'static KernelFile> {
    FILES.iter().find(|f| f.entry_points.contains(&entry))
}

macro_rules! kernel_file {
    ($name:literal, [$($entry:literal),* $(,)?]) => {
        KernelFile {
            name: $name,
            source: include_str!(concat!("../", $name)),
            entry_points: &[$($entry),*],
        }
    };
}

/// Every kernel file, with its entry points.
pub const FILES: &[KernelFile] = &[
    kernel_file!(
        "attention.cu",
        [
            "attention_bwd_bf16_d128",
            "attention_bwd_bf16_d16",
            "attention_bwd_bf16_d32",
            "attention_bwd_bf16_d64",
            "attention_bwd_delta_bf16",
            "attention_bwd_delta_f16",
            "attention_bwd_delta_f32",
            "attention_bwd_dkdv_f32",
            "attention_bwd_dq_f32",
            "attention_bwd_f16_d128",
            "attention_bwd_f16_d16",
            "attention_bwd_f16_d32",
            "attention_bwd_f16_d64",
            "attention_fwd_bf16_d128",
            "attention_fwd_bf16_d16",
            "attention_fwd_bf16_d32",
            "attention_fwd_bf16_d64",
            "attention_fwd_f16_d128",
            "attention_fwd_f16_d16",
            "attention_fwd_f16_d32",
            "attention_fwd_f16_d64",
            "attention_fwd_f32",
        ]
    ),
    kernel_file!(
        "cast.cu",
        [
            "cast_bf16_f16",
            "cast_bf16_f32",
            "cast_f16_bf16",
            "cast_f16_f32",
            "cast_f32_bf16",
            "cast_f32_f16",
        ]
    ),
    kernel_file!(
        "elementwise.cu",
        [
            "add_bf16",
            "add_f16",
            "add_f32",
            "gelu_erf_bwd_bf16",
            "gelu_erf_bwd_f16",
            "gelu_erf_bwd_f32",
            "gelu_erf_fwd_bf16",
            "gelu_erf_fwd_f16",
            "gelu_erf_fwd_f32",
            "gelu_tanh_bwd_bf16",
            "gelu_tanh_bwd_f16",
            "gelu_tanh_bwd_f32",
            "gelu_tanh_fwd_bf16",
            "gelu_tanh_fwd_f16",
            "gelu_tanh_fwd_f32",
            "mul_bf16",
            "mul_f16",
            "mul_f32",
            "silu_bwd_bf16",
            "silu_bwd_f16",
            "silu_bwd_f32",
            "silu_fwd_bf16",
            "silu_fwd_f16",
            "silu_fwd_f32",
        ]
    ),
    kernel_file!(
        "norm.cu",
        [
            "layer_norm_bwd_bf16",
            "layer_norm_bwd_bf16_f32",
            "layer_norm_bwd_f16",
            "layer_norm_bwd_f16_f32",
            "layer_norm_bwd_f32",
            "layer_norm_bwd_f32_bf16",
            "layer_norm_bwd_f32_f16",
            "layer_norm_bwd_weight_bf16",
            "layer_norm_bwd_weight_bf16_f32",
            "layer_norm_bwd_weight_f16",
            "layer_norm_bwd_weight_f16_f32",
            "layer_norm_bwd_weight_f32",
            "layer_norm_bwd_weight_f32_bf16",
            "layer_norm_bwd_weight_f32_f16",
            "layer_norm_fwd_bf16",
            "layer_norm_fwd_bf16_f32",
            "layer_norm_fwd_f16",
            "layer_norm_fwd_f16_f32",
            "layer_norm_fwd_f32",
            "layer_norm_fwd_f32_bf16",
            "layer_norm_fwd_f32_f16",
            "norm_weight_grad_reduce",
            "rms_norm_bwd_bf16",
            "rms_norm_bwd_bf16_f32",
            "rms_norm_bwd_f16",
            "rms_norm_bwd_f16_f32",
            "rms_norm_bwd_f32",
            "rms_norm_bwd_f32_bf16",
            "rms_norm_bwd_f32_f16",
            "rms_norm_bwd_weight_bf16",
            "rms_norm_bwd_weight_bf16_f32",
            "rms_norm_bwd_weight_f16",
            "rms_norm_bwd_weight_f16_f32",
            "rms_norm_bwd_weight_f32",
            "rms_norm_bwd_weight_f32_bf16",
            "rms_norm_bwd_weight_f32_f16",
            "rms_norm_fwd_bf16",
            "rms_norm_fwd_bf16_f32",
            "rms_norm_fwd_f16",
            "rms_norm_fwd_f16_f32",
            "rms_norm_fwd_f32",
            "rms_norm_fwd_f32_bf16",
            "rms_norm_fwd_f32_f16",
        ]
    ),
    kernel_file!(
        "softmax.cu",
        [
            "softmax_bwd_bf16",
            "softmax_bwd_bf16_f32",
            "softmax_bwd_f16",
            "softmax_bwd_f16_f32",
            "softmax_bwd_f32",
            "softmax_bwd_f32_bf16",
            "softmax_bwd_f32_f16",
            "softmax_fwd_bf16",
            "softmax_fwd_bf16_f32",
            "softmax_fwd_f16",
            "softmax_fwd_f16_f32",
            "softmax_fwd_f32",
            "softmax_fwd_f32_bf16",
            "softmax_fwd_f32_f16",
        ]
    ),
    kernel_file!(
        "cross_entropy.cu",
        [
            "cross_entropy_bwd_bf16",
            "cross_entropy_bwd_f16",
            "cross_entropy_bwd_f32",
            "cross_entropy_finalize",
            "cross_entropy_fwd_bf16",
            "cross_entropy_fwd_f16",
            "cross_entropy_fwd_f32",
        ]
    ),
    kernel_file!(
        "embedding.cu",
        [
            "embedding_bwd_accumulate_bf16_bf16",
            "embedding_bwd_accumulate_bf16_f32",
            "embedding_bwd_accumulate_f16_f16",
            "embedding_bwd_accumulate_f16_f32",
            "embedding_bwd_accumulate_f32_f32",
            "embedding_bwd_count",
            "embedding_bwd_fill",
            "embedding_bwd_scan",
            "embedding_fwd_bf16",
            "embedding_fwd_f16",
            "embedding_fwd_f32",
        ]
    ),
    kernel_file!(
        "rope.cu",
        [
            "rope_bwd_bf16",
            "rope_bwd_f16",
            "rope_bwd_f32",
            "rope_fwd_bf16",
            "rope_fwd_f16",
            "rope_fwd_f32",
            "rope_table",
        ]
    ),
    kernel_file!(
        "optimizer.cu",
        [
            "adamw_bf16",
            "adamw_bf16state_bf16",
            "adamw_bf16state_f16",
            "adamw_bf16state_f32",
            "adamw_f16",
            "adamw_f32",
            "sgd_bf16",
            "sgd_bf16state_bf16",
            "sgd_bf16state_f16",
            "sgd_bf16state_f32",
            "sgd_f16",
            "sgd_f32",
        ]
    ),
    kernel_file!(
        "grad_norm.cu",
        ["grad_norm_finalize", "grad_norm_partials",]
    ),
    kernel_file!("loss_scale.cu", ["count_step", "loss_scale_update",]),
    kernel_file!(
        "adamw8bit.cu",
        ["adamw8bit_bf16", "adamw8bit_f16", "adamw8bit_f32",]
    ),
    kernel_file!(
        "nf4.cu",
        [
            "nf4_dequantize_bf16",
            "nf4_dequantize_f16",
            "nf4_dequantize_f32",
        ]
    ),
    kernel_file!(
        "adafactor.cu",
        [
            "adafactor_apply_bf16",
            "adafactor_apply_f16",
            "adafactor_apply_f32",
            "adafactor_cols",
            "adafactor_finalize",
            "adafactor_full",
            "adafactor_partials",
            "adafactor_row_mean",
            "adafactor_rows",
        ]
    ),
    kernel_file!(
        "layout.cu",
        [
            "cast_bool_bf16",
            "cast_bool_f16",
            "cast_bool_f32",
            "cast_bool_i64",
            "cast_f32_bool",
            "cast_f32_i64",
            "cast_i64_bf16",
            "cast_i64_bool",
            "cast_i64_f16",
            "cast_i64_f32",
            "fill_b1",
            "fill_b2",
            "fill_b4",
            "fill_b8",
            "strided_copy_b1",
            "strided_copy_b2",
            "strided_copy_b4",
            "strided_copy_b8",
            "strided_copy_b16",
        ]
    ),
    kernel_file!(
        "reduce.cu",
        [
            "reduce_max_bf16",
            "reduce_max_bf16_f16",
            "reduce_max_bf16_f32",
            "reduce_max_f16",
            "reduce_max_f16_bf16",
            "reduce_max_f16_f32",
            "reduce_max_f32",
            "reduce_max_f32_bf16",
            "reduce_max_f32_f16",
            "reduce_mean_bf16",
            "reduce_mean_bf16_f16",
            "reduce_mean_bf16_f32",
            "reduce_mean_f16",
            "reduce_mean_f16_bf16",
            "reduce_mean_f16_f32",
            "reduce_mean_f32",
            "reduce_mean_f32_bf16",
            "reduce_mean_f32_f16",
            "reduce_sum_bf16",
            "reduce_sum_bf16_f16",
            "reduce_sum_bf16_f32",
            "reduce_sum_f16",
            "reduce_sum_f16_bf16",
            "reduce_sum_f16_f32",
            "reduce_sum_f32",
            "reduce_sum_f32_bf16",
            "reduce_sum_f32_f16",
        ]
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_are_unique_and_found() {
        let mut seen = std::collections::HashSet::new();
        for f in FILES {
            assert!(
                f.source.contains("#include \"castor_common.cuh\""),
                "{}",
                f.name
            );
            assert!(
                f.source.starts_with("// "),
                "{} starts with its header comment",
                f.name
            );
            for e in f.entry_points {
                assert!(seen.insert(*e), "{e} is listed twice");
                assert_eq!(file_of(e).map(|f| f.name), Some(f.name));
            }
        }
        assert!(file("cast.cu").is_some());
    }
}
