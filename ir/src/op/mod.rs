//! Operations, their classes, their attributes and their typing rules.
//!
//! The op set is small on purpose: it is what the GPT-2, BERT and LLaMA families need in the
//! forward pass and what their backward passes are written in. Every op has exactly one
//! [`OpClass`]; the precision passes decide dtypes by class.
//!
//! Each op is declared once, in the table below: its variant (fields are its attributes), its
//! mnemonic, class, arity and typing rule. The macros in `define.rs` generate the enum and
//! the per-op properties from it, so adding an op is one entry (plus its typing rule in
//! `typing.rs` when no existing one fits).

mod attention;
mod attr;
mod define;
mod library;
mod typing;

pub use attention::{AttentionDropout, AttentionOperands};
pub use attr::Attr;
pub(crate) use attr::{AttrFields, AttrReader, AttrValue};
pub use library::AttentionLibrary;
pub use typing::adafactor_moments;

use crate::optim::{AdafactorHparams, AdamWHparams, LionHparams, SgdHparams};
use crate::{DType, RopeScaling, TensorType};
use define::{define_family, define_ops};
use std::fmt;
use OpClass::{Communication, Contraction, Elementwise, Layout, Normalization};

/// The classes the precision passes reason about.
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
    /// Values exchanged between the ranks of a data-parallel group (all-reduce,
    /// reduce-scatter, all-gather). The precision passes treat them as layout: they move
    /// values, in the producer's dtype.
    Communication,
}

impl OpClass {
    pub const ALL: [OpClass; 5] = [
        Contraction,
        Normalization,
        Elementwise,
        Layout,
        Communication,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Contraction => "contraction",
            Normalization => "normalization",
            Elementwise => "elementwise",
            Layout => "layout",
            Communication => "communication",
        }
    }
}

impl fmt::Display for OpClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

define_family! {
    /// Pointwise functions of one float operand.
    UnaryOp with grad_name {
        /// GELU with the tanh approximation (GPT-2's `gelu_new`).
        GeluTanh = "gelu_tanh",
        /// Exact GELU with erf (BERT's `gelu`).
        GeluErf = "gelu_erf",
        Silu = "silu",
        Tanh = "tanh",
        Exp = "exp",
        Rsqrt = "rsqrt",
        Sqrt = "sqrt",
        Neg = "neg",
    }
}

impl UnaryOp {
    /// Exponentials and (reciprocal) square roots are numerically sensitive (normalization
    /// class, computed in F32); the activations are elementwise.
    pub fn class(self) -> OpClass {
        match self {
            UnaryOp::Exp | UnaryOp::Rsqrt | UnaryOp::Sqrt => Normalization,
            _ => Elementwise,
        }
    }
}

define_family! {
    /// Pointwise functions of two float operands, with NumPy broadcasting.
    BinaryOp {
        Add = "add",
        Sub = "sub",
        Mul = "mul",
        Div = "div",
    }
}

define_family! {
    /// How [`Op::AllReduce`] combines the ranks' values.
    CollectiveOp {
        /// The sum over ranks.
        Sum = "sum",
        /// The sum divided by the number of ranks (data-parallel gradients).
        Mean = "mean",
    }
}

define_family! {
    /// Reductions over a set of axes.
    ReduceOp {
        Sum = "sum",
        Mean = "mean",
        Max = "max",
    }
}

define_ops! {
    // The names the generated code gives the operand types (which typing rules read), the
    // attribute reader and the mnemonic being parsed.
    operands: inputs, reader: attrs_in, mnemonic: mnemonic;

    /// A graph input (token ids, masks), bound by its value name when the graph runs.
    Input => "input", class Layout, arity (0, 0), typing typing::source();
    /// A model parameter, bound by its value name to a checkpoint tensor.
    Param => "param", class Layout, arity (0, 0), typing typing::source();
    /// Persistent training state that is not a model parameter (optimizer moments, accumulated
    /// gradients, the step count, the loss scale), bound by its value name like a parameter.
    State => "state", class Layout, arity (0, 0), typing typing::source();
    /// `(table [V, H], ids [..]) -> [.., H]`: row gather. `padding` is the row of a
    /// `torch.nn.Embedding(padding_idx=...)`: read like any other, but it gets no gradient.
    Embedding { padding: Option<usize> } => "embedding", class Layout, arity (2, 2),
        typing typing::embedding(inputs);
    /// `(a [.., M, K], b [.., K, N]) -> [.., M, N]`, batch dims broadcast; `transpose_a/b`
    /// swap the last two dims of an operand first.
    MatMul { transpose_a: bool, transpose_b: bool } => "matmul", class Contraction,
        arity (2, 2), typing typing::matmul(inputs, *transpose_a, *transpose_b);
    /// A product scaled in its accumulator (cuBLAS's `alpha`): `alpha · op(a)·op(b)` with the
    /// operands and result of [`Op::MatMul`], the F32 product multiplied by `alpha` (as an F32)
    /// and rounded once. The eager attention's `q kᵀ` and its gradient's products absorb the
    /// 1/sqrt(d) scale this way, instead of a pass over the `[.., T, S]` scores.
    MatMulScaled { transpose_a: bool, transpose_b: bool, alpha: f64 } => "matmul_scaled",
        class Contraction, arity (2, 2), typing typing::matmul(inputs, *transpose_a, *transpose_b);
    /// A product added to a tensor in its accumulator (cuBLAS's `beta = 1`): `(a, b, c) ->
    /// alpha · op(a)·op(b) + c`, `c` of the result's type and shape; the F32 product
    /// multiplied by `alpha` (as an F32), `c` added in F32 and the sum rounded once. A LoRA
    /// adapter's product joins its base product's result this way (the CUDA executor adds it
    /// in place of `c` where nothing else reads `c`), instead of by a pass of its own.
    MatMulAdd { transpose_a: bool, transpose_b: bool, alpha: f64 } => "matmul_add",
        class Contraction, arity (3, 3),
        typing typing::matmul_add(inputs, *transpose_a, *transpose_b);
    /// A product with a bias-add epilogue (cuBLASLt's `BIAS`): `(a [.., M, K], b [K, N],
    /// bias [N]) -> [.., M, N]`, `op(a)·op(b) + bias` with the bias added to the F32
    /// accumulator and the sum rounded once, as PyTorch's `addmm` stores it.
    MatMulBias { transpose_a: bool, transpose_b: bool } => "matmul_bias", class Contraction,
        arity (3, 3), typing typing::matmul_bias(inputs, *transpose_a, *transpose_b, 1);
    /// A product with a bias + tanh-GELU epilogue (cuBLASLt's `GELU_AUX_BIAS`): `(a, b, bias)
    /// -> (pre, out)`, both `[.., M, N]`: `pre` is `op(a)·op(b) + bias` rounded once (kept for
    /// the backward), `out` is `gelu_tanh` of the unrounded sum, rounded once.
    MatMulBiasGelu { transpose_a: bool, transpose_b: bool } => "matmul_bias_gelu",
        class Contraction, arity (3, 3),
        typing typing::matmul_bias(inputs, *transpose_a, *transpose_b, 2);
    /// A product with the tanh-GELU gradient epilogue (cuBLASLt's `DGELU`): `(dy [.., M, K],
    /// w [K, N], pre [.., M, N]) -> dpre [.., M, N]`, `gelu_tanh_grad(pre, op(dy)·op(w))` on the
    /// unrounded product, rounded once. The bias gradient is not summed here: `DGELU_BGRAD`
    /// writes it in the output's type, and castor's bias gradients are F32, so the weight
    /// gradient's product that reads `dpre` sums it (`matmul_bias_grad`).
    /// A weight gradient with the bias-gradient epilogue (cuBLASLt's `BGRADA`/`BGRADB`):
    /// `(a [K, M], b [K, N]) -> (a^T b [M, N], dbias f32)`, `dbias` summing the rows of the
    /// operand that holds the output gradient (`lhs`: `a`, else `b`) in F32 as the separate
    /// `sum` would; `transpose_a` is always set (the rows are the product's inner dim).
    MatMulBiasGrad { lhs: bool } => "matmul_bias_grad", class Contraction, arity (2, 2),
        typing typing::matmul_bias_grad(inputs, *lhs);
    /// A product by a frozen weight stored in NF4 ([`crate::nf4`], QLoRA's base): `(x [.., K],
    /// codes u8 [ceil(rows * cols / 2)], absmax f32 [ceil(rows * cols / 64)]) -> [.., N]`, the
    /// weight `[rows, cols]` dequantized (`code * absmax`, rounded to `x`'s dtype) and
    /// multiplied as [`Op::MatMul`] would: `x W^T` (`transpose_b`, K = cols, N = rows) or
    /// `x W` (K = rows, N = cols, the input gradient's product).
    Nf4MatMul { transpose_b: bool, rows: usize, cols: usize } => "nf4_matmul",
        class Contraction, arity (3, 3),
        typing typing::nf4_matmul(inputs, *transpose_b, *rows, *cols);
    /// A product of FP8 operands with F32 accumulation, as cuBLASLt's FP8 matmul computes it:
    /// `(a [.., M, K], b [.., K, N], a_scale f32[], b_scale f32[]) -> [.., M, N]`. Each
    /// operand holds its values times its scale ([`Op::Quantize`]); the F32 sum of the
    /// products (exact for FP8 values) is multiplied by `(1 / a_scale) · (1 / b_scale)`, each
    /// reciprocal and their product rounded to F32 (the dequantization factors cuBLASLt's
    /// scale pointers give), and rounded once to the result's dtype (BF16, or F32 where a
    /// consumer needs it). The operands may be E4M3 or E5M2, each its own.
    Fp8MatMul { transpose_a: bool, transpose_b: bool } => "fp8_matmul", class Contraction,
        arity (4, 4), typing typing::fp8_matmul(inputs, *transpose_a, *transpose_b);
    /// The FP8 scale of a tensor (`amax_to_scale` of Transformer Engine and torchao):
    /// `x -> f32[]`, `fmax / max(amax, 1e-12) / 2^margin` computed in F64 and rounded to F32,
    /// where `amax` is the largest magnitude in `x` and `fmax` the largest finite value of
    /// `to`. Tensorwise current scaling reads the tensor itself (the scale of this step's
    /// values); delayed scaling reads an amax history. No gradient flows through a scale.
    Fp8Scale { to: DType, margin: usize } => "fp8_scale", class Normalization, arity (1, 1),
        typing typing::fp8_scale(inputs, *to);
    /// A cast to FP8 with a scale: `(x, scale f32[]) -> (q [..] of to, amax f32[])`, `q` the
    /// F32 product `x · scale` rounded to nearest even and saturated at `to`'s largest finite
    /// value (torchao's `to_fp8_saturated`, cuBLASLt's `SATFINITE`), `amax` the largest
    /// magnitude in `x` (what delayed scaling records). In the backward it passes the gradient
    /// through unchanged, as torchao's cast does: the products that read `q` differentiate
    /// with respect to the value `q / scale` stands for.
    Quantize { to: DType } => "quantize", class Elementwise, arity (2, 2),
        typing typing::quantize(inputs, *to);
    /// One step of delayed scaling (Transformer Engine's `DelayedScaling`, max algorithm):
    /// `(history f32[H], scale f32[], amax f32[]) -> (history' f32[H], scale' f32[])`.
    /// `history'` is `[amax, history[0], .., history[H-2]]` (newest first; the oldest amax
    /// leaves), and `scale'` is `fmax / a / 2^margin` with `a` the largest value of `history'`
    /// (NaN if it holds one), computed in F64 and rounded to F32 (F32's largest value where
    /// that overflows) — or `scale` unchanged when `a` is 0 or not finite, as Transformer
    /// Engine's `_default_sf_compute` does. The scale a cast uses is the
    /// one its history gave at the previous cast; the new one serves the next.
    AmaxHistory { to: DType, margin: usize } => "amax_history", class Normalization,
        arity (3, 3), typing typing::amax_history(inputs, *to);
    MatMulGeluGrad { transpose_a: bool, transpose_b: bool } => "matmul_gelu_grad",
        class Contraction, arity (3, 3),
        typing typing::matmul_gelu_grad(inputs, *transpose_a, *transpose_b);
    Unary(u: UnaryOp) => family name, class u.class(), arity (1, 1),
        typing typing::pointwise(inputs);
    Binary(b: BinaryOp) => family name, class Elementwise, arity (2, 2),
        typing typing::binary(inputs);
    /// `x * factor`.
    Scale { factor: f64 } => "scale", class Elementwise, arity (1, 1),
        typing typing::pointwise(inputs);
    /// `(x [.., H], weight [H], bias [H])`: normalizes over the last axis.
    LayerNorm { eps: f64 } => "layer_norm", class Normalization, arity (3, 3),
        typing typing::norm(inputs);
    /// `(x [.., H], weight [H])`: `x / sqrt(mean(x^2) + eps) * weight` (LLaMA's RMSNorm).
    RmsNorm { eps: f64 } => "rms_norm", class Normalization, arity (2, 2),
        typing typing::norm(inputs);
    /// Softmax over the last axis of `x [.., Tq, Tk]`, with an optional causal mask (query i
    /// sees keys up to `i + Tk - Tq`), narrowed by a sliding `window` when given (query i sees
    /// only the `window` keys ending there, as Mistral's sliding-window attention), and an
    /// optional bool operand broadcast to `x` (false = masked out). A row with every key masked
    /// becomes uniform, as with a finite `-inf`. The operand may instead be i64 *positions*
    /// `[.., 1, Tk]`, each key's position in its own sequence, for sequences packed in one row
    /// (with `causal` only): query `i`, key `a = i + Tk - Tq`, then sees only keys
    /// `a - pos[a] ..= a` (`pos[a]` clamped to `0..=a`), its own sequence, as FlashAttention's
    /// varlen does with the sequences' offsets.
    Softmax { causal: bool, window: Option<usize> } => "softmax", class Normalization,
        arity (1, 2), typing typing::softmax(inputs, *causal, *window);
    /// Scaled dot-product attention in one op, as FlashAttention computes it: `(q [.., T, D],
    /// k [.., S, D], v [.., S, Dv][, mask]) -> (o [.., T, Dv], lse f32 [.., T])`, with
    /// `o = softmax(scale * q k^T, causal, mask) v` and `lse` each row's log-sum-exp of the
    /// scaled scores (saved for the backward). The batch dims of `k`, `v` and the bool `mask`
    /// (`[.., T, S]`, false = masked out) broadcast to `q`'s, which expresses grouped-query
    /// attention without repeating `k` and `v`. With `causal`, query `i` sees keys
    /// `j <= i + S - T`, and with a sliding `window` also only `j > i + S - T - window`. A row
    /// with every key masked attends uniformly to all `S` keys, as a finite `-inf` mask gives.
    /// The mask may instead be i64 positions `[.., 1, S]` (packed sequences), as for
    /// [`Op::Softmax`]. No `[T, S]` tensor exists outside the op. `library` says what runs it on CUDA
    /// ([`AttentionLibrary`]); every other executor computes the same function.
    ///
    /// With `dropout` ([`AttentionDropout`]: attributes `dropout=P, stream=N`) the op takes one
    /// more operand, last: the dropout key `i64[2]` (`[seed, offset]`, the `key` a
    /// [`Op::Dropout`] node reads), so the operands are `(q, k, v[, mask][, key])`, the key there
    /// exactly when the op has dropout ([`Op::attention_operands`]). Then
    /// `o = dropout(softmax(scale * q k^T, causal, mask)) v`, the probabilities dropped and
    /// scaled by `1 / (1 - P)` exactly where a dropout node with `P` and `stream` would drop
    /// the `[.., T, S]` probabilities (row-major element index, [`crate::philox`]), so the op
    /// equals the eager softmax, dropout, product; `lse` stays the undropped scores'. A
    /// negative key offset is evaluation mode: no dropout. The mask is regenerated by the
    /// backward, never stored.
    Attention {
        causal: bool, window: Option<usize>, scale: f64, library: AttentionLibrary,
        dropout: Option<AttentionDropout>
    } => "attention",
        class Contraction, arity (3, 5),
        typing typing::attention(inputs, *causal, *window, *dropout);
    /// Rotary position embedding of `x [.., T, D]` at positions `0..T`, or at the positions of
    /// an i64 operand broadcasting to `[.., T]` (packed sequences, each restarting at 0 and so
    /// within `0..T`; a position outside is clamped into it),
    /// rotate-half layout (LLaMA's `apply_rotary_pos_emb`), frequencies `theta^(-2i/D)`
    /// rescaled as `scaling` says ([`crate::rope_inv_freq`]).
    Rope { theta: f64, scaling: RopeScaling } => "rope", class Elementwise, arity (1, 2),
        typing typing::rope(inputs);
    /// Inverted dropout, as `torch.nn.functional.dropout` in training: `(x, key i64[2]) -> y`,
    /// each element kept with probability `1 - p` and scaled by `1 / (1 - p)`, else zero. The
    /// mask is drawn from Philox4x32-10 keyed by `key = [seed, offset]`, the node's `stream`
    /// and the element's index ([`crate::philox`]): every executor draws the same mask, and it
    /// is regenerated, never stored. The gradient is the same dropout of `dy` (same key). A
    /// negative offset is evaluation mode: `y = x`.
    Dropout { p: f64, stream: usize } => "dropout", class Elementwise, arity (2, 2),
        typing typing::dropout(inputs, *p, *stream);
    Reshape { shape: Vec<usize> } => "reshape", class Layout, arity (1, 1),
        typing typing::reshape(inputs, shape);
    Transpose { perm: Vec<usize> } => "transpose", class Layout, arity (1, 1),
        typing typing::transpose(inputs, perm);
    /// Elements `start..end` along `axis`.
    Slice { axis: usize, start: usize, end: usize } => "slice", class Layout, arity (1, 1),
        typing typing::slice(inputs, *axis, *start, *end);
    Concat { axis: usize } => "concat", class Layout, arity (1, usize::MAX),
        typing typing::concat(inputs, *axis);
    /// One output per entry of `sizes`, consecutive pieces along `axis`.
    Split { axis: usize, sizes: Vec<usize> } => "split", class Layout, arity (1, 1),
        typing typing::split(inputs, *axis, sizes);
    Reduce { op: ReduceOp => family name; axes: Vec<usize>, keepdim: bool } =>
        class Normalization, arity (1, 1), typing typing::reduce(inputs, axes, *keepdim);
    /// `(logits [N, V], labels [N] int) -> f32[]`: mean over labels != ignore_index.
    CrossEntropy { ignore_index: i64 } => "cross_entropy", class Normalization, arity (2, 2),
        typing typing::cross_entropy(inputs);
    /// Converts to the output value's dtype (ints to bool: nonzero is true).
    Cast { to: DType } => "cast", class Elementwise, arity (1, 1),
        typing typing::cast(inputs, *to);
    /// The persistent low-precision working copy of a parameter, beside its F32 master (the
    /// operand, which must be a `param`). It is plan state, not work of the step: the optimizer
    /// writes it when it updates the master, so reading it never casts a weight in the step.
    /// Its values are the master rounded to `to`.
    ParamCopy { to: DType } => "param_copy", class Layout, arity (1, 1),
        typing typing::param_copy(inputs, *to);
    /// A tensor with every element `value`: zero gradients, the seed of the backward pass.
    Full { value: f64, dtype: DType, shape: Vec<usize> } => "full", class Layout,
        arity (0, 0), typing typing::full(*dtype, shape);

    // Collectives: a data-parallel group of `world` ranks runs the same graph, each on its
    // own batch and its own shards of the state. A flat *shard* of a value is its elements in
    // row-major order, padded with zeros to `world * ceil(n / world)`, cut in `world` equal
    // pieces; rank r holds piece r.

    /// `x -> x` combined over the ranks as `reduce` says; every rank gets the same result,
    /// summed in rank order (so every rank's bits are equal).
    AllReduce { reduce: CollectiveOp, world: usize } => "all_reduce", class Communication,
        arity (1, 1), typing typing::all_reduce(inputs);
    /// `x [..] -> [ceil(n / world)]`: the sum over ranks (divided by `world` when `average`)
    /// of this rank's flat shard (what an all-reduce followed by [`Op::Shard`] gives, with a
    /// `1 / world` of the traffic).
    ReduceScatter { world: usize, average: bool } => "reduce_scatter", class Communication,
        arity (1, 1), typing typing::shard(inputs, *world);
    /// `shard [ceil(n / world)] -> [shape]`: every rank's shard, in rank order, the padding
    /// dropped: the value the shards were cut from.
    AllGather { world: usize, shape: Vec<usize> } => "all_gather", class Communication,
        arity (1, 1), typing typing::all_gather(inputs, *world, shape);
    /// `x [..] -> [ceil(n / world)]`: this rank's flat shard of a value every rank holds
    /// whole; no communication.
    Shard { world: usize } => "shard", class Layout, arity (1, 1),
        typing typing::shard(inputs, *world);

    // Gradient ops: the vector-Jacobian products the autodiff pass emits.

    /// `(x, dy) -> dx = f'(x) * dy` for the unary op `f`.
    UnaryGrad(u: UnaryOp) => family grad_name, class u.class(), arity (2, 2),
        typing typing::pointwise_grad(inputs);
    /// `(x [.., H], weight [H], dy [.., H]) -> (dx, dweight [H], dbias [H])` of [`Op::LayerNorm`].
    LayerNormGrad { eps: f64 } => "layer_norm_grad", class Normalization, arity (3, 3),
        typing typing::norm_grad(inputs, true);
    /// `(x [.., H], weight [H], dy [.., H]) -> (dx, dweight [H])` of [`Op::RmsNorm`].
    RmsNormGrad { eps: f64 } => "rms_norm_grad", class Normalization, arity (3, 3),
        typing typing::norm_grad(inputs, false);
    /// `(y, dy) -> dx = y * (dy - sum(dy * y))` over the last axis, `y` being the softmax
    /// output (masked entries have `y = 0`, so they get no gradient).
    SoftmaxGrad => "softmax_grad", class Normalization, arity (2, 2),
        typing typing::pointwise_grad(inputs);
    /// `(q, k, v, o, lse, do[, mask][, key]) -> (dq, dk, dv)` of [`Op::Attention`], from its
    /// saved output and log-sum-exp (FlashAttention-2's backward: the probabilities are
    /// recomputed, never stored); `dk` and `dv` are summed over the batch dims `k` and `v`
    /// broadcast. With `dropout`, the key (last) regenerates the forward's mask: `dP = dO V^T`
    /// is dropped and scaled as the probabilities were, `dS = P (dP - delta)` with
    /// `delta = rowsum(dO o)`, and `dv` sums the dropped, scaled probabilities times `dO`.
    AttentionGrad {
        causal: bool, window: Option<usize>, scale: f64, library: AttentionLibrary,
        dropout: Option<AttentionDropout>
    } => "attention_grad",
        class Contraction, arity (6, 8),
        typing typing::attention_grad(inputs, *causal, *window, *dropout);
    /// The transpose of [`Op::Rope`] (with its positions operand, if any): rotation by the
    /// negated angles.
    RopeGrad { theta: f64, scaling: RopeScaling } => "rope_grad", class Elementwise,
        arity (1, 2),
        typing typing::rope(inputs);
    /// Zeros before and after along `axis`: the transpose of [`Op::Slice`].
    Pad { axis: usize, before: usize, after: usize } => "pad", class Layout, arity (1, 1),
        typing typing::pad(inputs, *axis, *before, *after);
    /// NumPy broadcast to `shape`: the transpose of a sum over broadcast dims.
    BroadcastTo { shape: Vec<usize> } => "broadcast_to", class Layout, arity (1, 1),
        typing typing::broadcast_to(inputs, shape);
    /// `(ids [..], dy [.., H]) -> dtable [vocab, H]`: rows of `dy` added into the rows their
    /// ids name, in a fixed order (deterministic); the transpose of [`Op::Embedding`].
    EmbeddingGrad { vocab: usize, padding: Option<usize> } => "embedding_grad",
        class Normalization, arity (2, 2),
        typing typing::embedding_grad(inputs, *vocab);
    /// `(logits [N, V], labels [N], dloss []) -> dlogits [N, V]` of [`Op::CrossEntropy`]:
    /// `(softmax(logits) - onehot(label)) * dloss / count` on counted rows, 0 on ignored ones.
    CrossEntropyGrad { ignore_index: i64 } => "cross_entropy_grad", class Normalization,
        arity (3, 3), typing typing::cross_entropy_grad(inputs);

    /// The LM head's product and the softmax cross-entropy as one op (a fused classifier):
    /// `(hidden [N, C], weight [V, C], labels [N] i64) -> loss []`, the mean over counted rows
    /// of `cross_entropy(round_logits(hidden @ weight^T), labels)`, computed `chunk_rows` rows
    /// at a time so no more than a chunk of logits ever exists, each chunk rounded to `logits`
    /// as the separate product would store it.
    LinearCrossEntropy {
        ignore_index: i64,
        chunk_rows: usize,
        logits: DType,
    } => "linear_cross_entropy", class Contraction, arity (3, 3),
        typing typing::linear_cross_entropy(inputs, *chunk_rows, *logits);
    /// The gradients of [`Op::LinearCrossEntropy`]: `(hidden, weight, labels, dloss []) ->
    /// (dhidden [N, C] in hidden's dtype, dweight [V, C] F32)`, chunk by chunk: the chunk's
    /// logits recomputed, `dlogits = (softmax - onehot) * dloss / count` rounded to `logits`,
    /// `dhidden = dlogits @ weight` and `dweight += dlogits^T @ hidden` (F32, chunk by chunk).
    LinearCrossEntropyGrad {
        ignore_index: i64,
        chunk_rows: usize,
        logits: DType,
    } => "linear_cross_entropy_grad", class Contraction, arity (4, 4),
        typing typing::linear_cross_entropy_grad(inputs, *chunk_rows, *logits);
    /// The fused classifier's loss and gradients in one pass over the chunks, each chunk's
    /// logits computed once (a training step's head: the loss is read only as the step's
    /// output): `(hidden, weight, labels, dloss []) -> (loss [] f32, dhidden, dweight [V, C]
    /// f32)`, bit for bit what [`Op::LinearCrossEntropy`] and its gradient compute.
    LinearCrossEntropyStep {
        ignore_index: i64,
        chunk_rows: usize,
        logits: DType,
    } => "linear_cross_entropy_step", class Contraction, arity (4, 4),
        typing typing::linear_cross_entropy_step(inputs, *chunk_rows, *logits);

    // Training-step ops: the optimizer and loss-scaling logic of a training plan, as graph ops
    // so that no host round trip decides a skipped step.

    /// `(g1, .., gn, scale []) -> f32[]`: the global L2 norm of the gradients divided by
    /// `scale`, accumulated in F64. It is not finite when any gradient is inf or NaN, which is
    /// the found-inf test: optimizer steps are skipped then.
    GradNorm => "grad_norm", class Normalization, arity (2, usize::MAX),
        typing typing::grad_norm(inputs);
    /// One fused AdamW step (torch.optim.AdamW: decoupled weight decay, bias correction) of one
    /// F32 parameter buffer: `(master, grad, m, v, lr [], step [], scale [], grad_norm []) ->
    /// (master', m', v'[, copy'])`. The gradient is unscaled by `1/scale` and, when
    /// `max_grad_norm > 0`, multiplied by `min(1, max_grad_norm / (grad_norm + 1e-6))`; `step`
    /// counts earlier steps. When `grad_norm` is not finite every output equals its input.
    /// `copy` names the dtype of the parameter's working copy, written in the same pass.
    AdamW {
        hp: AdamWHparams,
        max_grad_norm: f64,
        copy: Option<DType>,
    } => "adamw", class Elementwise, arity (8, 8), typing typing::optimizer(inputs, 2, *copy);
    /// One 8-bit AdamW step (bitsandbytes' `AdamW8bit`) of one F32 parameter buffer, with the
    /// gradient rules of [`Op::AdamW`]: `(master, grad, m, m_absmax, v, v_absmax, code_maps,
    /// lr [], step [], scale [], grad_norm []) -> (master', m', m_absmax', v', v_absmax'[,
    /// copy'])`. The moments are U8 codes of the parameter's shape, quantized block-wise
    /// ([`crate::quant`]: blocks of `quant_block` values, each with its F32 absolute maximum), the
    /// first against the signed dynamic map (`code_maps` row 0), the second against the
    /// unsigned one (row 1). Each block is dequantized, updated in F32 as bitsandbytes does
    /// (decay, `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`, `p -= lr/(1 - b1^t) * m /
    /// (sqrt(v) / sqrt(1 - b2^t) + eps)`) and quantized again to the nearest codes.
    AdamW8bit {
        hp: AdamWHparams,
        max_grad_norm: f64,
        quant_block: usize,
        copy: Option<DType>,
    } => "adamw8bit", class Elementwise, arity (11, 11),
        typing typing::adamw8bit(inputs, *quant_block, *copy);
    /// One fused SGD step with momentum (torch.optim.SGD, dampening 0, coupled weight decay)
    /// with the operands and rules of [`Op::AdamW`] and one moment: `(master, grad, momentum,
    /// lr [], step [], scale [], grad_norm []) -> (master', momentum'[, copy'])`.
    Sgd {
        hp: SgdHparams,
        max_grad_norm: f64,
        copy: Option<DType>,
    } => "sgd", class Elementwise, arity (7, 7), typing typing::optimizer(inputs, 1, *copy);
    /// One fused Lion step ([`LionHparams`]) with the operands and rules of [`Op::AdamW`] and
    /// one moment: `(master, grad, exp_avg, lr [], step [], scale [], grad_norm []) ->
    /// (master', exp_avg'[, copy'])`.
    Lion {
        hp: LionHparams,
        max_grad_norm: f64,
        copy: Option<DType>,
    } => "lion", class Elementwise, arity (7, 7), typing typing::optimizer(inputs, 1, *copy);
    /// One Adafactor step (transformers' `Adafactor`, Shazeer & Stern 2018) of one F32
    /// parameter buffer, with the gradient rules of [`Op::AdamW`]: `(master, grad[, exp_avg],
    /// row, col | exp_avg_sq, lr [], step [], scale [], grad_norm []) -> (master'[,
    /// exp_avg'], row', col' | exp_avg_sq'[, copy'])`. A parameter of rank 2 or more keeps
    /// factored second moments (`row`: its shape without the last axis, `col`: without the
    /// one before), a vector the full `exp_avg_sq`; `exp_avg` exists when `beta1` is given.
    /// Under `relative_step` the `lr` operand is ignored for `min(1e-2, 1/sqrt(t))` (or
    /// `1e-6 t` with `warmup_init`); `scale_parameter` multiplies the step by
    /// `max(eps2, rms(master))`. The update is divided by `max(1, rms(update) /
    /// clip_threshold)`.
    Adafactor {
        hp: AdafactorHparams,
        max_grad_norm: f64,
        copy: Option<DType>,
    } => "adafactor", class Elementwise, arity (7, 9),
        typing typing::adafactor(inputs, hp.beta1.is_some(), *copy);
    /// `(step [], grad_norm []) -> step'`: counts the optimizer steps that were not skipped.
    CountStep => "count_step", class Elementwise, arity (2, 2),
        typing typing::count_step(inputs);
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
    } => "loss_scale_update", class Elementwise, arity (3, 3),
        typing typing::loss_scale_update(inputs);
}

impl Op {
    /// True for the optimizer updates of one parameter buffer (`(master, grad, state..,
    /// lr, step, scale, grad_norm) -> (master', state'..[, copy'])`).
    pub fn updates_parameter(&self) -> bool {
        matches!(
            self,
            Op::AdamW { .. }
                | Op::AdamW8bit { .. }
                | Op::Sgd { .. }
                | Op::Lion { .. }
                | Op::Adafactor { .. }
        )
    }

    /// True for the graph's sources, which have no operands.
    pub fn is_source(&self) -> bool {
        matches!(self, Op::Input | Op::Param | Op::State)
    }

    /// True if the output dtype may differ from the natural one that [`Op::infer`] gives:
    /// contractions and normalizations may write a different float dtype than they read
    /// (a BF16 matmul writing F32, a layer norm reading F32 and writing BF16). A
    /// `matmul_add` writes its addend's type, which it adds to in place.
    pub fn output_dtype_is_free(&self) -> bool {
        matches!(self.class(), Contraction | Normalization)
            && !matches!(self, Op::CrossEntropy { .. } | Op::MatMulAdd { .. })
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
        self.typing(inputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every op prints and parses back to itself, attributes in declaration order.
    #[test]
    fn mnemonics_and_attributes_round_trip() {
        let ops = [
            Op::Input,
            Op::MatMul {
                transpose_a: true,
                transpose_b: false,
            },
            Op::MatMulBias {
                transpose_a: false,
                transpose_b: true,
            },
            Op::MatMulScaled {
                transpose_a: false,
                transpose_b: true,
                alpha: 0.125,
            },
            Op::MatMulAdd {
                transpose_a: false,
                transpose_b: true,
                alpha: 2.0,
            },
            Op::MatMulBiasGelu {
                transpose_a: false,
                transpose_b: false,
            },
            Op::MatMulGeluGrad {
                transpose_a: false,
                transpose_b: true,
            },
            Op::MatMulBiasGrad { lhs: true },
            Op::Unary(UnaryOp::GeluErf),
            Op::UnaryGrad(UnaryOp::Silu),
            Op::Binary(BinaryOp::Div),
            Op::Reduce {
                op: ReduceOp::Max,
                axes: vec![0, 2],
                keepdim: true,
            },
            Op::Full {
                value: -0.5,
                dtype: DType::BF16,
                shape: vec![2, 3],
            },
            Op::AdamW {
                hp: AdamWHparams {
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.0,
                },
                max_grad_norm: 1.0,
                copy: None,
            },
            Op::AdamW8bit {
                hp: AdamWHparams {
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.01,
                },
                max_grad_norm: 0.0,
                quant_block: 256,
                copy: Some(DType::BF16),
            },
            Op::Sgd {
                hp: SgdHparams {
                    momentum: 0.9,
                    weight_decay: 0.1,
                },
                max_grad_norm: 0.0,
                copy: Some(DType::F16),
            },
            Op::Lion {
                hp: LionHparams {
                    beta1: 0.9,
                    beta2: 0.99,
                    weight_decay: 0.1,
                },
                max_grad_norm: 1.0,
                copy: Some(DType::BF16),
            },
            Op::Adafactor {
                hp: AdafactorHparams {
                    beta1: Some(0.9),
                    decay_rate: -0.8,
                    eps1: 1e-30,
                    eps2: 1e-3,
                    clip_threshold: 1.0,
                    weight_decay: 0.0,
                    relative_step: true,
                    scale_parameter: true,
                    warmup_init: false,
                },
                max_grad_norm: 0.0,
                copy: Some(DType::BF16),
            },
            Op::CrossEntropy { ignore_index: -100 },
            Op::LinearCrossEntropy {
                ignore_index: -100,
                chunk_rows: 640,
                logits: DType::BF16,
            },
            Op::LinearCrossEntropyGrad {
                ignore_index: -100,
                chunk_rows: 3,
                logits: DType::F32,
            },
            Op::LinearCrossEntropyStep {
                ignore_index: 0,
                chunk_rows: 64,
                logits: DType::F16,
            },
            Op::Softmax {
                causal: true,
                window: Some(4096),
            },
            Op::AttentionGrad {
                causal: true,
                window: Some(3),
                scale: 0.125,
                library: AttentionLibrary::Auto,
                dropout: None,
            },
            Op::Attention {
                causal: false,
                window: None,
                scale: 0.125,
                library: AttentionLibrary::Kernels,
                dropout: Some(AttentionDropout { p: 0.1, stream: 2 }),
            },
            Op::Rope {
                theta: 500000.0,
                scaling: RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original: 8192,
                },
            },
            Op::RopeGrad {
                theta: 1e6,
                scaling: RopeScaling::Linear { factor: 2.0 },
            },
            Op::Dropout { p: 0.1, stream: 3 },
        ];
        for op in ops {
            let attrs: Vec<(String, Attr)> = op
                .attrs()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            // `acc`, `block` and `origin` are the node's own attributes in the text format.
            assert!(
                attrs
                    .iter()
                    .all(|(k, _)| !["acc", "block", "origin"].contains(&k.as_str())),
                "{} has an attribute the text format keeps for the node",
                op.mnemonic()
            );
            assert_eq!(Op::from_parts(op.mnemonic(), attrs), Ok(op.clone()));
        }
        assert_eq!(
            Op::Reduce {
                op: ReduceOp::Mean,
                axes: vec![1],
                keepdim: false
            }
            .mnemonic(),
            "mean"
        );
        assert_eq!(
            Op::UnaryGrad(UnaryOp::GeluTanh).mnemonic(),
            "gelu_tanh_grad"
        );
        assert_eq!(Op::Unary(UnaryOp::Exp).class(), Normalization);
        assert_eq!(Op::UnaryGrad(UnaryOp::Tanh).class(), Elementwise);
    }

    /// A feature only some models use (no window, no rope scaling) prints nothing, and its
    /// absence reads back as "none".
    #[test]
    fn absent_attributes_are_not_printed() {
        let plain = Op::Rope {
            theta: 1e4,
            scaling: RopeScaling::None,
        };
        assert_eq!(plain.attrs(), vec![("theta", Attr::Float(1e4))]);
        assert_eq!(
            Op::from_parts("rope", vec![("theta".into(), Attr::Float(1e4))]),
            Ok(plain)
        );
        let softmax = Op::Softmax {
            causal: true,
            window: None,
        };
        assert_eq!(softmax.attrs(), vec![("causal", Attr::Bool(true))]);
        let scaled = Op::Rope {
            theta: 1e4,
            scaling: RopeScaling::Linear { factor: 4.0 },
        };
        assert_eq!(scaled.attrs()[1], ("scaling", Attr::Floats(vec![4.0])));
        let a = |k: &str, v: Attr| vec![("causal".to_string(), Attr::Bool(true)), (k.into(), v)];
        assert_eq!(
            Op::from_parts("softmax", a("window", Attr::Int(-1))),
            Err("attribute `window` must be non-negative, found -1".into())
        );
        assert!(Op::from_parts(
            "rope",
            vec![
                ("theta".into(), Attr::Float(1e4)),
                ("scaling".into(), Attr::Floats(vec![1.0, 2.0])),
            ]
        )
        .is_err_and(|e| e.contains("found 2 numbers")));
    }

    #[test]
    fn a_window_needs_a_causal_mask() {
        let x = TensorType::new(DType::F32, [2, 4, 4]);
        let op = Op::Softmax {
            causal: false,
            window: Some(2),
        };
        assert!(op.infer(&[&x]).is_err_and(|e| e.contains("no causal mask")));
        let op = Op::Softmax {
            causal: true,
            window: Some(0),
        };
        assert!(op
            .infer(&[&x])
            .is_err_and(|e| e.contains("window of 0 keys")));
    }

    #[test]
    fn attribute_errors_name_the_attribute() {
        let a = |k: &str, v: Attr| vec![(k.to_string(), v)];
        assert_eq!(
            Op::from_parts("softmax", vec![]),
            Err("`softmax` needs attribute `causal`".into())
        );
        assert_eq!(
            Op::from_parts("softmax", a("causal", Attr::Int(1))),
            Err("attribute `causal` must be true or false, found `1`".into())
        );
        assert_eq!(
            Op::from_parts("exp", a("axis", Attr::Int(1))),
            Err("`exp` has no attribute `axis`".into())
        );
        assert_eq!(
            Op::from_parts("slice", a("axis", Attr::Int(-1))),
            Err("attribute `axis` must be non-negative, found -1".into())
        );
        assert_eq!(
            Op::from_parts("frobnicate", vec![]),
            Err("unknown op `frobnicate`".into())
        );
    }
}
