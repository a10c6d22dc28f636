//! Operations, their classes, their attributes and their typing rules.
//!
//! The op set is small on purpose: it is what the GPT-2, BERT and LLaMA families need in the
//! forward pass and what their backward passes are written in. Every op has exactly one
//! [`OpClass`]; the precision passes decide dtypes by class.

use crate::{DType, Shape, TensorType};
use std::fmt;

/// The four classes the precision passes reason about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpClass {
    /// Matrix products: the work tensor cores do. Natural candidates for low precision.
    Contraction,
    /// Normalizations, reductions and numerically sensitive maths (softmax, exp, ...).
    Normalization,
    /// Pointwise arithmetic.
    Elementwise,
    /// Data movement with no arithmetic (reshape, transpose, gather, graph sources).
    Layout,
}

impl OpClass {
    pub const ALL: [OpClass; 4] = [
        OpClass::Contraction,
        OpClass::Normalization,
        OpClass::Elementwise,
        OpClass::Layout,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpClass::Contraction => "contraction",
            OpClass::Normalization => "normalization",
            OpClass::Elementwise => "elementwise",
            OpClass::Layout => "layout",
        }
    }
}

impl fmt::Display for OpClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Pointwise functions of one float operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// GELU with the tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    /// Exact GELU with erf (BERT's `gelu`).
    GeluErf,
    Silu,
    Tanh,
    Exp,
    Rsqrt,
    Neg,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 7] = [
        UnaryOp::GeluTanh,
        UnaryOp::GeluErf,
        UnaryOp::Silu,
        UnaryOp::Tanh,
        UnaryOp::Exp,
        UnaryOp::Rsqrt,
        UnaryOp::Neg,
    ];

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::GeluErf => "gelu_erf",
            UnaryOp::Silu => "silu",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Exp => "exp",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Neg => "neg",
        }
    }

    /// The mnemonic of the op's gradient (`gelu_tanh_grad`).
    pub fn grad_name(self) -> &'static str {
        match self {
            UnaryOp::GeluTanh => "gelu_tanh_grad",
            UnaryOp::GeluErf => "gelu_erf_grad",
            UnaryOp::Silu => "silu_grad",
            UnaryOp::Tanh => "tanh_grad",
            UnaryOp::Exp => "exp_grad",
            UnaryOp::Rsqrt => "rsqrt_grad",
            UnaryOp::Neg => "neg_grad",
        }
    }
}

/// Pointwise functions of two float operands, with NumPy broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 4] = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div];

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
        }
    }
}

/// Reductions over a set of axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
        }
    }
}

/// One operation. Operands are positional; attributes are the fields.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A graph input (token ids, masks), bound by its value name when the graph runs.
    Input,
    /// A model parameter, bound by its value name to a checkpoint tensor.
    Param,
    /// Persistent training state that is not a model parameter (optimizer moments, accumulated
    /// gradients, the step count, the loss scale), bound by its value name like a parameter.
    State,
    /// `(table [V, H], ids [..]) -> [.., H]`: row gather.
    Embedding,
    /// `(a [.., M, K], b [.., K, N]) -> [.., M, N]`, batch dims broadcast; `transpose_a/b`
    /// swap the last two dims of an operand first.
    MatMul {
        transpose_a: bool,
        transpose_b: bool,
    },
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// `x * factor`.
    Scale {
        factor: f64,
    },
    /// `(x [.., H], weight [H], bias [H])`: normalizes over the last axis.
    LayerNorm {
        eps: f64,
    },
    /// `(x [.., H], weight [H])`: `x / sqrt(mean(x^2) + eps) * weight` (LLaMA's RMSNorm).
    RmsNorm {
        eps: f64,
    },
    /// Softmax over the last axis of `x [.., Tq, Tk]`, with an optional causal mask (query i
    /// sees keys up to `i + Tk - Tq`) and an optional bool operand broadcast to `x` (false =
    /// masked out). A row with every key masked becomes uniform, as with a finite `-inf`.
    Softmax {
        causal: bool,
    },
    /// Rotary position embedding of `x [.., T, D]` at positions `0..T`, rotate-half layout
    /// (LLaMA's `apply_rotary_pos_emb`), frequencies `theta^(-2i/D)`.
    Rope {
        theta: f64,
    },
    Reshape {
        shape: Vec<usize>,
    },
    Transpose {
        perm: Vec<usize>,
    },
    /// Elements `start..end` along `axis`.
    Slice {
        axis: usize,
        start: usize,
        end: usize,
    },
    Concat {
        axis: usize,
    },
    /// One output per entry of `sizes`, consecutive pieces along `axis`.
    Split {
        axis: usize,
        sizes: Vec<usize>,
    },
    Reduce {
        op: ReduceOp,
        axes: Vec<usize>,
        keepdim: bool,
    },
    /// `(logits [N, V], labels [N] int) -> f32[]`: mean over labels != ignore_index.
    CrossEntropy {
        ignore_index: i64,
    },
    /// Converts to the output value's dtype (ints to bool: nonzero is true).
    Cast {
        to: DType,
    },
    /// The persistent low-precision working copy of a parameter, beside its F32 master (the
    /// operand, which must be a `param`). It is plan state, not work of the step: the optimizer
    /// writes it when it updates the master, so reading it never casts a weight in the step.
    /// Its values are the master rounded to `to`.
    ParamCopy {
        to: DType,
    },

    /// A tensor with every element `value`: zero gradients, the seed of the backward pass.
    Full {
        value: f64,
        dtype: DType,
        shape: Vec<usize>,
    },

    // Gradient ops: the vector-Jacobian products the autodiff pass emits.
    /// `(x, dy) -> dx = f'(x) * dy` for the unary op `f`.
    UnaryGrad(UnaryOp),
    /// `(x [.., H], weight [H], dy [.., H]) -> (dx, dweight [H], dbias [H])` of [`Op::LayerNorm`].
    LayerNormGrad {
        eps: f64,
    },
    /// `(x [.., H], weight [H], dy [.., H]) -> (dx, dweight [H])` of [`Op::RmsNorm`].
    RmsNormGrad {
        eps: f64,
    },
    /// `(y, dy) -> dx = y * (dy - sum(dy * y))` over the last axis, `y` being the softmax
    /// output (masked entries have `y = 0`, so they get no gradient).
    SoftmaxGrad,
    /// The transpose of [`Op::Rope`]: rotation by the negated angles.
    RopeGrad {
        theta: f64,
    },
    /// Zeros before and after along `axis`: the transpose of [`Op::Slice`].
    Pad {
        axis: usize,
        before: usize,
        after: usize,
    },
    /// NumPy broadcast to `shape`: the transpose of a sum over broadcast dims.
    BroadcastTo {
        shape: Vec<usize>,
    },
    /// `(ids [..], dy [.., H]) -> dtable [vocab, H]`: rows of `dy` added into the rows their
    /// ids name, in a fixed order (deterministic); the transpose of [`Op::Embedding`].
    EmbeddingGrad {
        vocab: usize,
    },
    /// `(logits [N, V], labels [N], dloss []) -> dlogits [N, V]` of [`Op::CrossEntropy`]:
    /// `(softmax(logits) - onehot(label)) * dloss / count` on counted rows, 0 on ignored ones.
    CrossEntropyGrad {
        ignore_index: i64,
    },

    // Training-step ops: the optimizer and loss-scaling logic of a training plan, as graph ops
    // so that no host round trip decides a skipped step.
    /// `(g1, .., gn, scale []) -> f32[]`: the global L2 norm of the gradients divided by
    /// `scale`, accumulated in F64. It is not finite when any gradient is inf or NaN, which is
    /// the found-inf test: optimizer steps are skipped then.
    GradNorm,
    /// One fused AdamW step (torch.optim.AdamW: decoupled weight decay, bias correction) of one
    /// F32 parameter buffer: `(master, grad, m, v, lr [], step [], scale [], grad_norm []) ->
    /// (master', m', v'[, copy'])`. The gradient is unscaled by `1/scale` and, when
    /// `max_grad_norm > 0`, multiplied by `min(1, max_grad_norm / (grad_norm + 1e-6))`; `step`
    /// counts earlier steps. When `grad_norm` is not finite every output equals its input.
    /// `copy` names the dtype of the parameter's working copy, written in the same pass.
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        max_grad_norm: f64,
        copy: Option<DType>,
    },
    /// One fused SGD step with momentum (torch.optim.SGD, dampening 0, coupled weight decay)
    /// with the operands and rules of [`Op::AdamW`] and one moment: `(master, grad, momentum,
    /// lr [], step [], scale [], grad_norm []) -> (master', momentum'[, copy'])`.
    Sgd {
        momentum: f64,
        weight_decay: f64,
        max_grad_norm: f64,
        copy: Option<DType>,
    },
    /// `(step [], grad_norm []) -> step'`: counts the optimizer steps that were not skipped.
    CountStep,
    /// Dynamic loss scaling (torch.amp.GradScaler, with DeepSpeed's hysteresis):
    /// `(scale [], counters [2], grad_norm []) -> (scale', counters')`, counters = (clean steps
    /// since the last change, overflows still tolerated). On an overflow (`grad_norm` not finite)
    /// the scale is multiplied by `backoff_factor` once `hysteresis` overflows have been seen
    /// since the last growth, and the clean-step count restarts; after `growth_interval`
    /// clean steps in a row it is multiplied by `growth_factor`, up to `max_scale`.
    LossScaleUpdate {
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: usize,
        hysteresis: usize,
        max_scale: f64,
    },
}

/// An attribute value in the text format.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    Ident(String),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Int(i) => write!(f, "{i}"),
            // `{:?}` prints the shortest text that parses back to the same f64.
            Attr::Float(x) => write!(f, "{x:?}"),
            Attr::Bool(b) => write!(f, "{b}"),
            Attr::Ints(v) => {
                f.write_str("[")?;
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{x}")?;
                }
                f.write_str("]")
            }
            Attr::Ident(s) => f.write_str(s),
        }
    }
}

impl Op {
    /// The op's class, which the precision passes use.
    pub fn class(&self) -> OpClass {
        match self {
            Op::MatMul { .. } => OpClass::Contraction,
            Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Softmax { .. }
            | Op::Reduce { .. }
            | Op::CrossEntropy { .. }
            | Op::Unary(UnaryOp::Exp | UnaryOp::Rsqrt) => OpClass::Normalization,
            Op::Unary(_) | Op::Binary(_) | Op::Scale { .. } | Op::Rope { .. } | Op::Cast { .. } => {
                OpClass::Elementwise
            }
            Op::Input
            | Op::Param
            | Op::Embedding
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Concat { .. }
            | Op::Split { .. }
            | Op::ParamCopy { .. }
            | Op::Pad { .. }
            | Op::BroadcastTo { .. }
            | Op::Full { .. } => OpClass::Layout,
            Op::UnaryGrad(u) => Op::Unary(*u).class(),
            Op::LayerNormGrad { .. }
            | Op::RmsNormGrad { .. }
            | Op::SoftmaxGrad
            | Op::EmbeddingGrad { .. }
            | Op::CrossEntropyGrad { .. } => OpClass::Normalization,
            Op::RopeGrad { .. } => OpClass::Elementwise,
            Op::State => OpClass::Layout,
            Op::GradNorm => OpClass::Normalization,
            Op::AdamW { .. } | Op::Sgd { .. } | Op::CountStep | Op::LossScaleUpdate { .. } => {
                OpClass::Elementwise
            }
        }
    }

    /// The op's name in the IR text.
    pub fn mnemonic(&self) -> &'static str {
        match self {
            Op::Input => "input",
            Op::Param => "param",
            Op::Embedding => "embedding",
            Op::MatMul { .. } => "matmul",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Scale { .. } => "scale",
            Op::LayerNorm { .. } => "layer_norm",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Softmax { .. } => "softmax",
            Op::Rope { .. } => "rope",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Split { .. } => "split",
            Op::Reduce { op, .. } => op.name(),
            Op::CrossEntropy { .. } => "cross_entropy",
            Op::Cast { .. } => "cast",
            Op::ParamCopy { .. } => "param_copy",
            Op::Full { .. } => "full",
            Op::UnaryGrad(u) => u.grad_name(),
            Op::LayerNormGrad { .. } => "layer_norm_grad",
            Op::RmsNormGrad { .. } => "rms_norm_grad",
            Op::SoftmaxGrad => "softmax_grad",
            Op::RopeGrad { .. } => "rope_grad",
            Op::Pad { .. } => "pad",
            Op::BroadcastTo { .. } => "broadcast_to",
            Op::EmbeddingGrad { .. } => "embedding_grad",
            Op::CrossEntropyGrad { .. } => "cross_entropy_grad",
            Op::State => "state",
            Op::GradNorm => "grad_norm",
            Op::AdamW { .. } => "adamw",
            Op::Sgd { .. } => "sgd",
            Op::CountStep => "count_step",
            Op::LossScaleUpdate { .. } => "loss_scale_update",
        }
    }

    /// True for the graph's sources, which have no operands.
    pub fn is_source(&self) -> bool {
        matches!(self, Op::Input | Op::Param | Op::State)
    }

    /// Attributes in the order the text format prints them.
    pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let ints = |v: &[usize]| Attr::Ints(v.iter().map(|&x| x as i64).collect());
        match self {
            Op::MatMul {
                transpose_a,
                transpose_b,
            } => vec![
                ("transpose_a", Attr::Bool(*transpose_a)),
                ("transpose_b", Attr::Bool(*transpose_b)),
            ],
            Op::Scale { factor } => vec![("factor", Attr::Float(*factor))],
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => vec![("eps", Attr::Float(*eps))],
            Op::Softmax { causal } => vec![("causal", Attr::Bool(*causal))],
            Op::Rope { theta } => vec![("theta", Attr::Float(*theta))],
            Op::Reshape { shape } => vec![("shape", ints(shape))],
            Op::Transpose { perm } => vec![("perm", ints(perm))],
            Op::Slice { axis, start, end } => vec![
                ("axis", Attr::Int(*axis as i64)),
                ("start", Attr::Int(*start as i64)),
                ("end", Attr::Int(*end as i64)),
            ],
            Op::Concat { axis } => vec![("axis", Attr::Int(*axis as i64))],
            Op::Split { axis, sizes } => {
                vec![("axis", Attr::Int(*axis as i64)), ("sizes", ints(sizes))]
            }
            Op::Reduce { axes, keepdim, .. } => {
                vec![("axes", ints(axes)), ("keepdim", Attr::Bool(*keepdim))]
            }
            Op::CrossEntropy { ignore_index } => {
                vec![("ignore_index", Attr::Int(*ignore_index))]
            }
            Op::Cast { to } | Op::ParamCopy { to } => {
                vec![("to", Attr::Ident(to.name().to_string()))]
            }
            Op::LayerNormGrad { eps } | Op::RmsNormGrad { eps } => vec![("eps", Attr::Float(*eps))],
            Op::RopeGrad { theta } => vec![("theta", Attr::Float(*theta))],
            Op::Pad {
                axis,
                before,
                after,
            } => vec![
                ("axis", Attr::Int(*axis as i64)),
                ("before", Attr::Int(*before as i64)),
                ("after", Attr::Int(*after as i64)),
            ],
            Op::BroadcastTo { shape } => vec![("shape", ints(shape))],
            Op::EmbeddingGrad { vocab } => vec![("vocab", Attr::Int(*vocab as i64))],
            Op::CrossEntropyGrad { ignore_index } => {
                vec![("ignore_index", Attr::Int(*ignore_index))]
            }
            Op::UnaryGrad(_) | Op::SoftmaxGrad => vec![],
            Op::Full {
                value,
                dtype,
                shape,
            } => vec![
                ("value", Attr::Float(*value)),
                ("dtype", Attr::Ident(dtype.name().to_string())),
                ("shape", ints(shape)),
            ],
            Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                max_grad_norm,
                copy,
            } => vec![
                ("beta1", Attr::Float(*beta1)),
                ("beta2", Attr::Float(*beta2)),
                ("eps", Attr::Float(*eps)),
                ("weight_decay", Attr::Float(*weight_decay)),
                ("max_grad_norm", Attr::Float(*max_grad_norm)),
                ("copy", copy_attr(*copy)),
            ],
            Op::Sgd {
                momentum,
                weight_decay,
                max_grad_norm,
                copy,
            } => vec![
                ("momentum", Attr::Float(*momentum)),
                ("weight_decay", Attr::Float(*weight_decay)),
                ("max_grad_norm", Attr::Float(*max_grad_norm)),
                ("copy", copy_attr(*copy)),
            ],
            Op::LossScaleUpdate {
                growth_factor,
                backoff_factor,
                growth_interval,
                hysteresis,
                max_scale,
            } => vec![
                ("growth_factor", Attr::Float(*growth_factor)),
                ("backoff_factor", Attr::Float(*backoff_factor)),
                ("growth_interval", Attr::Int(*growth_interval as i64)),
                ("hysteresis", Attr::Int(*hysteresis as i64)),
                ("max_scale", Attr::Float(*max_scale)),
            ],
            Op::Input
            | Op::Param
            | Op::State
            | Op::Embedding
            | Op::Unary(_)
            | Op::Binary(_)
            | Op::GradNorm
            | Op::CountStep => vec![],
        }
    }

    /// Builds an op from its mnemonic and attributes (the inverse of [`Op::mnemonic`] and
    /// [`Op::attrs`]). Every attribute must be given exactly once.
    pub fn from_parts(mnemonic: &str, attrs: Vec<(String, Attr)>) -> Result<Op, String> {
        let mut a = AttrReader {
            attrs,
            op: mnemonic,
        };
        let op = match mnemonic {
            "input" => Op::Input,
            "param" => Op::Param,
            "state" => Op::State,
            "grad_norm" => Op::GradNorm,
            "count_step" => Op::CountStep,
            "adamw" => Op::AdamW {
                beta1: a.float("beta1")?,
                beta2: a.float("beta2")?,
                eps: a.float("eps")?,
                weight_decay: a.float("weight_decay")?,
                max_grad_norm: a.float("max_grad_norm")?,
                copy: a.copy_dtype("copy")?,
            },
            "sgd" => Op::Sgd {
                momentum: a.float("momentum")?,
                weight_decay: a.float("weight_decay")?,
                max_grad_norm: a.float("max_grad_norm")?,
                copy: a.copy_dtype("copy")?,
            },
            "loss_scale_update" => Op::LossScaleUpdate {
                growth_factor: a.float("growth_factor")?,
                backoff_factor: a.float("backoff_factor")?,
                growth_interval: a.dim("growth_interval")?,
                hysteresis: a.dim("hysteresis")?,
                max_scale: a.float("max_scale")?,
            },
            "embedding" => Op::Embedding,
            "matmul" => Op::MatMul {
                transpose_a: a.bool("transpose_a")?,
                transpose_b: a.bool("transpose_b")?,
            },
            "scale" => Op::Scale {
                factor: a.float("factor")?,
            },
            "layer_norm" => Op::LayerNorm {
                eps: a.float("eps")?,
            },
            "rms_norm" => Op::RmsNorm {
                eps: a.float("eps")?,
            },
            "softmax" => Op::Softmax {
                causal: a.bool("causal")?,
            },
            "rope" => Op::Rope {
                theta: a.float("theta")?,
            },
            "reshape" => Op::Reshape {
                shape: a.dims("shape")?,
            },
            "transpose" => Op::Transpose {
                perm: a.dims("perm")?,
            },
            "slice" => Op::Slice {
                axis: a.dim("axis")?,
                start: a.dim("start")?,
                end: a.dim("end")?,
            },
            "concat" => Op::Concat {
                axis: a.dim("axis")?,
            },
            "split" => Op::Split {
                axis: a.dim("axis")?,
                sizes: a.dims("sizes")?,
            },
            "cross_entropy" => Op::CrossEntropy {
                ignore_index: a.int("ignore_index")?,
            },
            "cast" => Op::Cast {
                to: a.ident("to")?.parse()?,
            },
            "param_copy" => Op::ParamCopy {
                to: a.ident("to")?.parse()?,
            },
            "layer_norm_grad" => Op::LayerNormGrad {
                eps: a.float("eps")?,
            },
            "rms_norm_grad" => Op::RmsNormGrad {
                eps: a.float("eps")?,
            },
            "softmax_grad" => Op::SoftmaxGrad,
            "full" => Op::Full {
                value: a.float("value")?,
                dtype: a.ident("dtype")?.parse()?,
                shape: a.dims("shape")?,
            },
            "rope_grad" => Op::RopeGrad {
                theta: a.float("theta")?,
            },
            "pad" => Op::Pad {
                axis: a.dim("axis")?,
                before: a.dim("before")?,
                after: a.dim("after")?,
            },
            "broadcast_to" => Op::BroadcastTo {
                shape: a.dims("shape")?,
            },
            "embedding_grad" => Op::EmbeddingGrad {
                vocab: a.dim("vocab")?,
            },
            "cross_entropy_grad" => Op::CrossEntropyGrad {
                ignore_index: a.int("ignore_index")?,
            },
            other => {
                if let Some(u) = UnaryOp::ALL.into_iter().find(|u| u.name() == other) {
                    Op::Unary(u)
                } else if let Some(u) = UnaryOp::ALL.into_iter().find(|u| u.grad_name() == other) {
                    Op::UnaryGrad(u)
                } else if let Some(b) = BinaryOp::ALL.into_iter().find(|b| b.name() == other) {
                    Op::Binary(b)
                } else if let Some(r) = ReduceOp::ALL.into_iter().find(|r| r.name() == other) {
                    Op::Reduce {
                        op: r,
                        axes: a.dims("axes")?,
                        keepdim: a.bool("keepdim")?,
                    }
                } else {
                    return Err(format!("unknown op `{other}`"));
                }
            }
        };
        a.finish()?;
        Ok(op)
    }

    /// Number of operands the op takes, as an inclusive range.
    pub fn arity(&self) -> (usize, usize) {
        match self {
            Op::Input | Op::Param | Op::State | Op::Full { .. } => (0, 0),
            Op::GradNorm => (2, usize::MAX),
            Op::AdamW { .. } => (8, 8),
            Op::Sgd { .. } => (7, 7),
            Op::CountStep => (2, 2),
            Op::LossScaleUpdate { .. } => (3, 3),
            Op::Unary(_)
            | Op::Scale { .. }
            | Op::Rope { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Split { .. }
            | Op::Reduce { .. }
            | Op::Cast { .. }
            | Op::ParamCopy { .. }
            | Op::RopeGrad { .. }
            | Op::Pad { .. }
            | Op::BroadcastTo { .. } => (1, 1),
            Op::UnaryGrad(_) | Op::SoftmaxGrad | Op::EmbeddingGrad { .. } => (2, 2),
            Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. } | Op::CrossEntropyGrad { .. } => {
                (3, 3)
            }
            Op::Embedding
            | Op::MatMul { .. }
            | Op::Binary(_)
            | Op::RmsNorm { .. }
            | Op::CrossEntropy { .. } => (2, 2),
            Op::LayerNorm { .. } => (3, 3),
            Op::Softmax { .. } => (1, 2),
            Op::Concat { .. } => (1, usize::MAX),
        }
    }

    /// True if the output dtype may differ from the natural one that [`Op::infer`] gives:
    /// contractions and normalizations may write a different float dtype than they read
    /// (a BF16 matmul writing F32, a layer norm reading F32 and writing BF16).
    pub fn output_dtype_is_free(&self) -> bool {
        matches!(self.class(), OpClass::Contraction | OpClass::Normalization)
            && !matches!(self, Op::CrossEntropy { .. })
    }

    /// The output types of the op applied to operands of the given types, or a message
    /// saying which typing rule is broken. Sources have no operands and no inferred type.
    pub fn infer(&self, inputs: &[&TensorType]) -> Result<Vec<TensorType>, String> {
        let (lo, hi) = self.arity();
        if inputs.len() < lo || inputs.len() > hi {
            return Err(if lo == hi {
                format!(
                    "`{}` takes {lo} operand(s), found {}",
                    self.mnemonic(),
                    inputs.len()
                )
            } else {
                format!(
                    "`{}` takes {lo} to {hi} operands, found {}",
                    self.mnemonic(),
                    inputs.len()
                )
            });
        }
        let one = |t: TensorType| Ok(vec![t]);
        match self {
            Op::Input | Op::Param | Op::State => Err("sources have no inferred type".into()),
            Op::GradNorm => {
                let (scale, grads) = inputs.split_last().ok_or("grad_norm needs operands")?;
                for g in grads {
                    require_float("gradient", g)?;
                }
                require_f32_scalar("loss scale", scale)?;
                one(TensorType::new(DType::F32, Shape::scalar()))
            }
            Op::AdamW { copy, .. } | Op::Sgd { copy, .. } => {
                let moments = if matches!(self, Op::AdamW { .. }) {
                    2
                } else {
                    1
                };
                let master = inputs[0];
                if master.dtype != DType::F32 {
                    return Err(format!("the master weights must be f32, found {master}"));
                }
                for (i, t) in inputs[1..2 + moments].iter().enumerate() {
                    let what = if i == 0 {
                        "gradient"
                    } else {
                        "optimizer moment"
                    };
                    if *t != master {
                        return Err(format!(
                            "{what} must be {master} like the master, found {t}"
                        ));
                    }
                }
                for (what, t) in ["lr", "step", "loss scale", "grad norm"]
                    .iter()
                    .zip(&inputs[2 + moments..])
                {
                    require_f32_scalar(what, t)?;
                }
                let mut outs = vec![master.clone(); 1 + moments];
                if let Some(to) = copy {
                    if !to.is_float() {
                        return Err(format!(
                            "a parameter copy must be a float dtype, found {to}"
                        ));
                    }
                    outs.push(TensorType::new(*to, master.shape.clone()));
                }
                Ok(outs)
            }
            Op::CountStep => {
                require_f32_scalar("step", inputs[0])?;
                require_f32_scalar("grad norm", inputs[1])?;
                one(inputs[0].clone())
            }
            Op::LossScaleUpdate { .. } => {
                let (scale, counters, norm) = (inputs[0], inputs[1], inputs[2]);
                require_f32_scalar("loss scale", scale)?;
                require_f32_scalar("grad norm", norm)?;
                if *counters != TensorType::new(DType::F32, [2]) {
                    return Err(format!(
                        "loss-scale counters must be f32[2], found {counters}"
                    ));
                }
                Ok(vec![scale.clone(), counters.clone()])
            }
            Op::Embedding => {
                let (table, ids) = (inputs[0], inputs[1]);
                require_float("table", table)?;
                if table.shape.rank() != 2 {
                    return Err(format!(
                        "embedding table must be 2-D, found {}",
                        table.shape
                    ));
                }
                if !ids.dtype.is_int() {
                    return Err(format!(
                        "embedding ids must be i32 or i64, found {}",
                        ids.dtype
                    ));
                }
                let mut dims = ids.shape.0.clone();
                dims.push(table.shape.0[1]);
                one(TensorType::new(table.dtype, dims))
            }
            Op::MatMul {
                transpose_a,
                transpose_b,
            } => {
                let (a, b) = (inputs[0], inputs[1]);
                require_float("lhs", a)?;
                require_float("rhs", b)?;
                if a.dtype != b.dtype {
                    return Err(format!(
                        "matmul operands differ in dtype: {} and {}",
                        a.dtype, b.dtype
                    ));
                }
                if a.shape.rank() < 2 || b.shape.rank() < 2 {
                    return Err(format!(
                        "matmul operands must be at least 2-D, found {} and {}",
                        a.shape, b.shape
                    ));
                }
                let (m, ka) = last_two(&a.shape, *transpose_a);
                let (kb, n) = last_two(&b.shape, *transpose_b);
                if ka != kb {
                    return Err(format!(
                        "matmul inner dimensions differ: {} (lhs{}) vs {} (rhs{})",
                        ka,
                        if *transpose_a { ", transposed" } else { "" },
                        kb,
                        if *transpose_b { ", transposed" } else { "" }
                    ));
                }
                let ba = Shape(a.shape.0[..a.shape.rank() - 2].to_vec());
                let bb = Shape(b.shape.0[..b.shape.rank() - 2].to_vec());
                let mut batch = Shape::broadcast(&ba, &bb)
                    .ok_or_else(|| format!("matmul batch dims do not broadcast: {ba} and {bb}"))?;
                batch.0.extend([m, n]);
                one(TensorType::new(a.dtype, batch))
            }
            Op::Unary(_) | Op::Scale { .. } => {
                require_float("operand", inputs[0])?;
                one(inputs[0].clone())
            }
            Op::Binary(_) => {
                let (a, b) = (inputs[0], inputs[1]);
                require_float("lhs", a)?;
                require_float("rhs", b)?;
                if a.dtype != b.dtype {
                    return Err(format!(
                        "operands differ in dtype: {} and {}",
                        a.dtype, b.dtype
                    ));
                }
                let shape = Shape::broadcast(&a.shape, &b.shape).ok_or_else(|| {
                    format!("shapes {} and {} do not broadcast", a.shape, b.shape)
                })?;
                one(TensorType::new(a.dtype, shape))
            }
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
                let x = inputs[0];
                require_float("input", x)?;
                if x.shape.rank() == 0 {
                    return Err("normalized input must have at least one dim".into());
                }
                let h = x.shape.last();
                for (i, p) in inputs[1..].iter().enumerate() {
                    let what = if i == 0 { "weight" } else { "bias" };
                    require_float(what, p)?;
                    if p.shape.0 != [h] {
                        return Err(format!("{what} must be [{h}], found {}", p.shape));
                    }
                }
                one(x.clone())
            }
            Op::Softmax { causal } => {
                let x = inputs[0];
                require_float("input", x)?;
                if *causal {
                    if x.shape.rank() < 2 {
                        return Err("causal softmax needs a [.., Tq, Tk] input".into());
                    }
                    let d = x.shape.dims();
                    if d[d.len() - 2] > d[d.len() - 1] {
                        return Err(format!("causal softmax needs Tq <= Tk, found {}", x.shape));
                    }
                } else if x.shape.rank() == 0 {
                    return Err("softmax input must have at least one dim".into());
                }
                if let Some(mask) = inputs.get(1) {
                    if mask.dtype != DType::Bool {
                        return Err(format!("softmax mask must be bool, found {}", mask.dtype));
                    }
                    if Shape::broadcast(&mask.shape, &x.shape).as_ref() != Some(&x.shape) {
                        return Err(format!(
                            "softmax mask {} does not broadcast to {}",
                            mask.shape, x.shape
                        ));
                    }
                }
                one(x.clone())
            }
            Op::Rope { .. } => {
                let x = inputs[0];
                require_float("input", x)?;
                if x.shape.rank() < 2 || !x.shape.last().is_multiple_of(2) {
                    return Err(format!(
                        "rope needs [.., T, D] with even D, found {}",
                        x.shape
                    ));
                }
                one(x.clone())
            }
            Op::Reshape { shape } => {
                let x = inputs[0];
                let to = Shape(shape.clone());
                if x.shape.numel() != to.numel() {
                    return Err(format!(
                        "cannot reshape {} into {to}: element counts differ",
                        x.shape
                    ));
                }
                one(TensorType::new(x.dtype, to))
            }
            Op::Transpose { perm } => {
                let x = inputs[0];
                let mut seen = vec![false; x.shape.rank()];
                if perm.len() != x.shape.rank()
                    || perm
                        .iter()
                        .any(|&p| p >= seen.len() || std::mem::replace(&mut seen[p], true))
                {
                    return Err(format!(
                        "{perm:?} is not a permutation of the axes of {}",
                        x.shape
                    ));
                }
                let dims = perm.iter().map(|&p| x.shape.0[p]).collect::<Vec<_>>();
                one(TensorType::new(x.dtype, dims))
            }
            Op::Slice { axis, start, end } => {
                let x = inputs[0];
                let len = *x
                    .shape
                    .0
                    .get(*axis)
                    .ok_or_else(|| bad_axis(*axis, &x.shape))?;
                if start > end || *end > len {
                    return Err(format!(
                        "slice {start}..{end} out of range for axis {axis} of {}",
                        x.shape
                    ));
                }
                let mut dims = x.shape.0.clone();
                dims[*axis] = end - start;
                one(TensorType::new(x.dtype, dims))
            }
            Op::Concat { axis } => {
                let first = inputs[0];
                if *axis >= first.shape.rank() {
                    return Err(bad_axis(*axis, &first.shape));
                }
                let mut dims = first.shape.0.clone();
                dims[*axis] = 0;
                for t in inputs {
                    let same_rest = t.shape.rank() == first.shape.rank()
                        && (0..dims.len()).all(|i| i == *axis || t.shape.0[i] == first.shape.0[i]);
                    if t.dtype != first.dtype || !same_rest {
                        return Err(format!(
                            "concat operands must agree except on axis {axis}: {first} vs {t}"
                        ));
                    }
                    dims[*axis] += t.shape.0[*axis];
                }
                one(TensorType::new(first.dtype, dims))
            }
            Op::Split { axis, sizes } => {
                let x = inputs[0];
                let len = *x
                    .shape
                    .0
                    .get(*axis)
                    .ok_or_else(|| bad_axis(*axis, &x.shape))?;
                if sizes.is_empty() || sizes.iter().sum::<usize>() != len {
                    return Err(format!(
                        "split sizes {sizes:?} do not add up to {len} (axis {axis} of {})",
                        x.shape
                    ));
                }
                Ok(sizes
                    .iter()
                    .map(|&s| {
                        let mut dims = x.shape.0.clone();
                        dims[*axis] = s;
                        TensorType::new(x.dtype, dims)
                    })
                    .collect())
            }
            Op::Reduce { axes, keepdim, .. } => {
                let x = inputs[0];
                require_float("input", x)?;
                let mut seen = vec![false; x.shape.rank()];
                for &a in axes {
                    if a >= seen.len() || std::mem::replace(&mut seen[a], true) {
                        return Err(format!(
                            "bad or repeated reduction axis {a} for {}",
                            x.shape
                        ));
                    }
                }
                let dims = x
                    .shape
                    .0
                    .iter()
                    .enumerate()
                    .filter_map(|(i, &d)| match (seen[i], keepdim) {
                        (false, _) => Some(d),
                        (true, true) => Some(1),
                        (true, false) => None,
                    })
                    .collect::<Vec<_>>();
                one(TensorType::new(x.dtype, dims))
            }
            Op::CrossEntropy { .. } => {
                let (logits, labels) = (inputs[0], inputs[1]);
                require_float("logits", logits)?;
                if !labels.dtype.is_int() {
                    return Err(format!("labels must be i32 or i64, found {}", labels.dtype));
                }
                if logits.shape.rank() != 2 || labels.shape.0 != logits.shape.0[..1] {
                    return Err(format!(
                        "cross_entropy needs logits [N, V] and labels [N], found {} and {}",
                        logits.shape, labels.shape
                    ));
                }
                one(TensorType::new(DType::F32, Shape::scalar()))
            }
            Op::Cast { to } => one(TensorType::new(*to, inputs[0].shape.clone())),
            Op::Full { dtype, shape, .. } => one(TensorType::new(*dtype, shape.clone())),
            Op::UnaryGrad(_) | Op::SoftmaxGrad => {
                let (x, dy) = (inputs[0], inputs[1]);
                require_float("input", x)?;
                require_float("gradient", dy)?;
                if x.shape != dy.shape {
                    return Err(format!(
                        "gradient {} does not match input {}",
                        dy.shape, x.shape
                    ));
                }
                one(dy.clone())
            }
            Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. } => {
                let (x, w, dy) = (inputs[0], inputs[1], inputs[2]);
                require_float("input", x)?;
                require_float("weight", w)?;
                require_float("gradient", dy)?;
                let h = x.shape.last();
                if x.shape.rank() == 0 || w.shape.0 != [h] || dy.shape != x.shape {
                    return Err(format!(
                        "norm gradient needs x [.., H], weight [H], dy like x; found {}, {}, {}",
                        x.shape, w.shape, dy.shape
                    ));
                }
                let dw = TensorType::new(DType::F32, [h]);
                let mut outs = vec![TensorType::new(dy.dtype, x.shape.clone()), dw.clone()];
                if matches!(self, Op::LayerNormGrad { .. }) {
                    outs.push(dw);
                }
                Ok(outs)
            }
            Op::RopeGrad { .. } => Op::Rope { theta: 0.0 }.infer(inputs),
            Op::Pad {
                axis,
                before,
                after,
            } => {
                let x = inputs[0];
                if *axis >= x.shape.rank() {
                    return Err(bad_axis(*axis, &x.shape));
                }
                let mut dims = x.shape.0.clone();
                dims[*axis] += before + after;
                one(TensorType::new(x.dtype, dims))
            }
            Op::BroadcastTo { shape } => {
                let x = inputs[0];
                let to = Shape(shape.clone());
                if Shape::broadcast(&x.shape, &to).as_ref() != Some(&to) {
                    return Err(format!("{} does not broadcast to {to}", x.shape));
                }
                one(TensorType::new(x.dtype, to))
            }
            Op::EmbeddingGrad { vocab } => {
                let (ids, dy) = (inputs[0], inputs[1]);
                if !ids.dtype.is_int() {
                    return Err(format!(
                        "embedding ids must be i32 or i64, found {}",
                        ids.dtype
                    ));
                }
                require_float("gradient", dy)?;
                if dy.shape.rank() != ids.shape.rank() + 1
                    || dy.shape.0[..ids.shape.rank()] != ids.shape.0[..]
                {
                    return Err(format!(
                        "gradient {} does not match ids {} plus a row dim",
                        dy.shape, ids.shape
                    ));
                }
                one(TensorType::new(DType::F32, [*vocab, dy.shape.last()]))
            }
            Op::CrossEntropyGrad { .. } => {
                let (logits, labels, dloss) = (inputs[0], inputs[1], inputs[2]);
                Op::CrossEntropy { ignore_index: 0 }.infer(&[logits, labels])?;
                require_float("loss gradient", dloss)?;
                if dloss.shape.rank() != 0 {
                    return Err(format!(
                        "loss gradient must be a scalar, found {}",
                        dloss.shape
                    ));
                }
                one(logits.clone())
            }
            Op::ParamCopy { to } => {
                require_float("master", inputs[0])?;
                if !to.is_float() {
                    return Err(format!(
                        "a parameter copy must be a float dtype, found {to}"
                    ));
                }
                one(TensorType::new(*to, inputs[0].shape.clone()))
            }
        }
    }
}

fn require_float(what: &str, t: &TensorType) -> Result<(), String> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be a float tensor, found {}", t.dtype))
    }
}

fn require_f32_scalar(what: &str, t: &TensorType) -> Result<(), String> {
    if t.dtype == DType::F32 && t.shape.rank() == 0 {
        Ok(())
    } else {
        Err(format!("{what} must be an f32 scalar, found {t}"))
    }
}

/// The `copy` attribute of optimizer ops: a dtype or `none`.
fn copy_attr(copy: Option<DType>) -> Attr {
    Attr::Ident(copy.map_or("none", |d| d.name()).to_string())
}

fn bad_axis(axis: usize, shape: &Shape) -> String {
    format!("axis {axis} out of range for {shape}")
}

/// (rows, cols) of the last two dims, after an optional transpose.
fn last_two(s: &Shape, transpose: bool) -> (usize, usize) {
    let d = s.dims();
    let (r, c) = (d[d.len() - 2], d[d.len() - 1]);
    if transpose {
        (c, r)
    } else {
        (r, c)
    }
}

/// Takes attributes by name, so that missing, mistyped and unknown ones are all reported.
struct AttrReader<'a> {
    attrs: Vec<(String, Attr)>,
    op: &'a str,
}

impl AttrReader<'_> {
    fn take(&mut self, key: &str) -> Result<Attr, String> {
        let pos = self
            .attrs
            .iter()
            .position(|(k, _)| k == key)
            .ok_or_else(|| format!("`{}` needs attribute `{key}`", self.op))?;
        Ok(self.attrs.remove(pos).1)
    }

    fn bool(&mut self, key: &str) -> Result<bool, String> {
        match self.take(key)? {
            Attr::Bool(b) => Ok(b),
            other => Err(format!(
                "attribute `{key}` must be true or false, found `{other}`"
            )),
        }
    }

    fn int(&mut self, key: &str) -> Result<i64, String> {
        match self.take(key)? {
            Attr::Int(i) => Ok(i),
            other => Err(format!(
                "attribute `{key}` must be an integer, found `{other}`"
            )),
        }
    }

    fn dim(&mut self, key: &str) -> Result<usize, String> {
        let i = self.int(key)?;
        usize::try_from(i).map_err(|_| format!("attribute `{key}` must be non-negative, found {i}"))
    }

    fn float(&mut self, key: &str) -> Result<f64, String> {
        match self.take(key)? {
            Attr::Float(x) => Ok(x),
            Attr::Int(i) => Ok(i as f64),
            other => Err(format!(
                "attribute `{key}` must be a number, found `{other}`"
            )),
        }
    }

    fn dims(&mut self, key: &str) -> Result<Vec<usize>, String> {
        match self.take(key)? {
            Attr::Ints(v) => v
                .into_iter()
                .map(|i| {
                    usize::try_from(i)
                        .map_err(|_| format!("attribute `{key}` has negative entry {i}"))
                })
                .collect(),
            other => Err(format!(
                "attribute `{key}` must be a list like [1,2], found `{other}`"
            )),
        }
    }

    fn ident(&mut self, key: &str) -> Result<String, String> {
        match self.take(key)? {
            Attr::Ident(s) => Ok(s),
            other => Err(format!("attribute `{key}` must be a name, found `{other}`")),
        }
    }

    fn copy_dtype(&mut self, key: &str) -> Result<Option<DType>, String> {
        match self.ident(key)?.as_str() {
            "none" => Ok(None),
            other => other.parse().map(Some),
        }
    }

    fn finish(self) -> Result<(), String> {
        match self.attrs.first() {
            None => Ok(()),
            Some((k, _)) => Err(format!("`{}` has no attribute `{k}`", self.op)),
        }
    }
}
