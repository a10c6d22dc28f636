//! Typed names of the hand-written kernels of the kernel families (`families/*/*.cu`): a launch says which kernel it
//! runs as a [`KernelId`] (family, variant, dtypes), the entry-point name the device loads is
//! derived from it ([`KernelId::entry`]), and the emulator's contracts match on it. No code
//! takes a kernel name apart; the test below holds that every entry point of every kernel
//! file is the name of exactly one id.

use crate::cuda::families::attention::geometry::Kernel as AttentionKernel;
use castor_ir::{DType, ReduceOp};

/// A hand-written kernel entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    Cast {
        from: DType,
        to: DType,
    },
    /// A strided copy of `bytes`-byte elements.
    StridedCopy {
        bytes: u32,
    },
    Fill {
        bytes: u32,
    },
    Reduce {
        op: ReduceOp,
        input: DType,
        output: DType,
    },
    /// Layer norm or RMSNorm (`rms`), one pass of it.
    Norm {
        rms: bool,
        pass: NormPass,
        input: DType,
        output: DType,
    },
    /// The sum of the norms' weight-gradient partials.
    NormWeightGradReduce,
    Softmax {
        backward: bool,
        input: DType,
        output: DType,
    },
    CrossEntropy {
        backward: bool,
        logits: DType,
    },
    CrossEntropyFinalize,
    EmbeddingFwd {
        table: DType,
    },
    EmbeddingBwd(EmbeddingBwdStage),
    EmbeddingBwdAccumulate {
        grad: DType,
        out: DType,
    },
    GradNormPartials,
    GradNormFinalize,
    CountStep,
    LossScaleUpdate,
    RopeTable,
    Rope {
        backward: bool,
        dtype: DType,
    },
    Adafactor(AdafactorStage),
    /// Adafactor's update, writing the parameter's working copy in `copy`.
    AdafactorApply {
        copy: DType,
    },
    AdamW8bit {
        copy: DType,
    },
    Nf4Dequantize {
        dtype: DType,
    },
    /// The multi-tensor AdamW or SGD update, moments in `state`, copies in `copy`.
    Update {
        rule: UpdateRule,
        state: DType,
        copy: DType,
    },
    Unary {
        op: UnaryOp,
        backward: bool,
        dtype: DType,
    },
    Binary {
        op: BinaryOp,
        dtype: DType,
    },
    /// castor's fused attention: tensor-core kernels for a head-dim `tile` (16-bit), the F32
    /// reference kernels without one.
    Attention {
        kernel: AttentionKernel,
        dtype: DType,
        tile: Option<u32>,
    },
    /// The attention backward's `rowsum(dO · O)`.
    AttentionDelta {
        dtype: DType,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormPass {
    Forward,
    /// The input's gradient.
    Backward,
    /// The weight's (and bias's) gradient partials.
    BackwardWeight,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EmbeddingBwdStage {
    Count,
    Scan,
    Fill,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AdafactorStage {
    Rows,
    Cols,
    Full,
    RowMean,
    Partials,
    Finalize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UpdateRule {
    AdamW,
    Sgd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    GeluTanh,
    GeluErf,
    Silu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Mul,
}

/// A dtype's entry-name suffix.
fn name(d: DType) -> &'static str {
    d.name()
}

/// `bf16` for (BF16, BF16), `f32_bf16` for (F32, BF16).
fn io(input: DType, output: DType) -> String {
    if input == output {
        name(input).to_string()
    } else {
        format!("{}_{}", name(input), name(output))
    }
}

impl KernelId {
    /// The entry point's name in its kernel file.
    pub fn entry(&self) -> String {
        use KernelId::*;
        match *self {
            Cast { from, to } => format!("cast_{}_{}", name(from), name(to)),
            StridedCopy { bytes } => format!("strided_copy_b{bytes}"),
            Fill { bytes } => format!("fill_b{bytes}"),
            Reduce { op, input, output } => format!("reduce_{}_{}", op.name(), io(input, output)),
            Norm {
                rms,
                pass,
                input,
                output,
            } => {
                let kind = if rms { "rms_norm" } else { "layer_norm" };
                let pass = match pass {
                    NormPass::Forward => "fwd",
                    NormPass::Backward => "bwd",
                    NormPass::BackwardWeight => "bwd_weight",
                };
                format!("{kind}_{pass}_{}", io(input, output))
            }
            NormWeightGradReduce => "norm_weight_grad_reduce".into(),
            Softmax {
                backward,
                input,
                output,
            } => format!("softmax_{}_{}", direction(backward), io(input, output)),
            CrossEntropy { backward, logits } => {
                format!("cross_entropy_{}_{}", direction(backward), name(logits))
            }
            CrossEntropyFinalize => "cross_entropy_finalize".into(),
            EmbeddingFwd { table } => format!("embedding_fwd_{}", name(table)),
            EmbeddingBwd(stage) => match stage {
                EmbeddingBwdStage::Count => "embedding_bwd_count",
                EmbeddingBwdStage::Scan => "embedding_bwd_scan",
                EmbeddingBwdStage::Fill => "embedding_bwd_fill",
            }
            .into(),
            EmbeddingBwdAccumulate { grad, out } => {
                format!("embedding_bwd_accumulate_{}_{}", name(grad), name(out))
            }
            GradNormPartials => "grad_norm_partials".into(),
            GradNormFinalize => "grad_norm_finalize".into(),
            CountStep => "count_step".into(),
            LossScaleUpdate => "loss_scale_update".into(),
            RopeTable => "rope_table".into(),
            Rope { backward, dtype } => format!("rope_{}_{}", direction(backward), name(dtype)),
            Adafactor(stage) => match stage {
                AdafactorStage::Rows => "adafactor_rows",
                AdafactorStage::Cols => "adafactor_cols",
                AdafactorStage::Full => "adafactor_full",
                AdafactorStage::RowMean => "adafactor_row_mean",
                AdafactorStage::Partials => "adafactor_partials",
                AdafactorStage::Finalize => "adafactor_finalize",
            }
            .into(),
            AdafactorApply { copy } => format!("adafactor_apply_{}", name(copy)),
            AdamW8bit { copy } => format!("adamw8bit_{}", name(copy)),
            Nf4Dequantize { dtype } => format!("nf4_dequantize_{}", name(dtype)),
            Update { rule, state, copy } => {
                let rule = match rule {
                    UpdateRule::AdamW => "adamw",
                    UpdateRule::Sgd => "sgd",
                };
                let state = if state == DType::BF16 {
                    "bf16state_"
                } else {
                    ""
                };
                format!("{rule}_{state}{}", name(copy))
            }
            Unary {
                op,
                backward,
                dtype,
            } => {
                let op = match op {
                    UnaryOp::GeluTanh => "gelu_tanh",
                    UnaryOp::GeluErf => "gelu_erf",
                    UnaryOp::Silu => "silu",
                };
                format!("{op}_{}_{}", direction(backward), name(dtype))
            }
            Binary { op, dtype } => {
                let op = match op {
                    BinaryOp::Add => "add",
                    BinaryOp::Mul => "mul",
                };
                format!("{op}_{}", name(dtype))
            }
            Attention {
                kernel,
                dtype,
                tile,
            } => {
                let kernel = match kernel {
                    AttentionKernel::Forward => "fwd",
                    AttentionKernel::Backward => "bwd",
                    AttentionKernel::Dq => "bwd_dq",
                    AttentionKernel::DkDv => "bwd_dkdv",
                };
                match tile {
                    Some(tile) => format!("attention_{kernel}_{}_d{tile}", name(dtype)),
                    None => format!("attention_{kernel}_{}", name(dtype)),
                }
            }
            AttentionDelta { dtype } => format!("attention_bwd_delta_{}", name(dtype)),
        }
    }

    /// The id whose entry point is `entry`, among the ids of every family over every dtype.
    /// For code that starts from a kernel file's entry list (the kernel tests); the lowering
    /// and the emulator hold ids.
    pub fn from_entry(entry: &str) -> Option<KernelId> {
        candidates().into_iter().find(|k| k.entry() == entry)
    }
}

fn direction(backward: bool) -> &'static str {
    if backward {
        "bwd"
    } else {
        "fwd"
    }
}

/// Every id of every family over every dtype and size a kernel could take: a superset of the
/// kernel files' entry points (their dtype combinations decide which exist).
fn candidates() -> Vec<KernelId> {
    use KernelId::*;
    const ALL: [DType; 7] = DType::ALL;
    const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
    let pairs = || FLOATS.into_iter().flat_map(|a| FLOATS.map(|b| (a, b)));
    let mut ids = vec![
        NormWeightGradReduce,
        CrossEntropyFinalize,
        GradNormPartials,
        GradNormFinalize,
        CountStep,
        LossScaleUpdate,
        RopeTable,
    ];
    ids.extend(
        ALL.into_iter()
            .flat_map(|from| ALL.map(|to| Cast { from, to })),
    );
    for bytes in [1, 2, 4, 8, 16] {
        ids.extend([StridedCopy { bytes }, Fill { bytes }]);
    }
    for stage in [
        EmbeddingBwdStage::Count,
        EmbeddingBwdStage::Scan,
        EmbeddingBwdStage::Fill,
    ] {
        ids.push(EmbeddingBwd(stage));
    }
    for stage in [
        AdafactorStage::Rows,
        AdafactorStage::Cols,
        AdafactorStage::Full,
        AdafactorStage::RowMean,
        AdafactorStage::Partials,
        AdafactorStage::Finalize,
    ] {
        ids.push(Adafactor(stage));
    }
    for (input, output) in pairs() {
        for op in ReduceOp::ALL {
            ids.push(Reduce { op, input, output });
        }
        for rms in [false, true] {
            for pass in [
                NormPass::Forward,
                NormPass::Backward,
                NormPass::BackwardWeight,
            ] {
                ids.push(Norm {
                    rms,
                    pass,
                    input,
                    output,
                });
            }
        }
        for backward in [false, true] {
            ids.push(Softmax {
                backward,
                input,
                output,
            });
        }
        ids.push(EmbeddingBwdAccumulate {
            grad: input,
            out: output,
        });
        for state in [DType::F32, DType::BF16] {
            if input == state {
                ids.push(Update {
                    rule: UpdateRule::AdamW,
                    state,
                    copy: output,
                });
                ids.push(Update {
                    rule: UpdateRule::Sgd,
                    state,
                    copy: output,
                });
            }
        }
    }
    for dtype in FLOATS {
        for backward in [false, true] {
            ids.push(CrossEntropy {
                backward,
                logits: dtype,
            });
            ids.push(Rope { backward, dtype });
            for op in [UnaryOp::GeluTanh, UnaryOp::GeluErf, UnaryOp::Silu] {
                ids.push(Unary {
                    op,
                    backward,
                    dtype,
                });
            }
        }
        ids.extend([
            EmbeddingFwd { table: dtype },
            AdafactorApply { copy: dtype },
            AdamW8bit { copy: dtype },
            Nf4Dequantize { dtype },
            AttentionDelta { dtype },
            Binary {
                op: BinaryOp::Add,
                dtype,
            },
            Binary {
                op: BinaryOp::Mul,
                dtype,
            },
        ]);
        for kernel in [
            AttentionKernel::Forward,
            AttentionKernel::Backward,
            AttentionKernel::Dq,
            AttentionKernel::DkDv,
        ] {
            for tile in [None, Some(16), Some(32), Some(64), Some(128)] {
                ids.push(Attention {
                    kernel,
                    dtype,
                    tile,
                });
            }
        }
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Every entry point of every kernel file is the name of exactly one id, and no two ids
    /// share a name: the typed ids and the files agree.
    #[test]
    fn every_entry_point_is_the_name_of_exactly_one_id() {
        let mut names: HashMap<String, KernelId> = HashMap::new();
        for id in candidates() {
            if let Some(other) = names.insert(id.entry(), id) {
                panic!("{other:?} and {id:?} are both `{}`", id.entry());
            }
        }
        let mut missing = Vec::new();
        for file in crate::cuda::families::files() {
            for &e in file.entry_points {
                match KernelId::from_entry(e) {
                    Some(id) => assert_eq!(id.entry(), e),
                    None => missing.push(format!("{} ({})", e, file.name)),
                }
            }
        }
        assert!(missing.is_empty(), "entry points with no id: {missing:?}");
    }
}
