//! A fused attention run by cuDNN: the call as program data ([`Sdpa`]), which problems cuDNN can
//! express ([`unsupported`]), and the operation graphs its backend API builds for them
//! ([`graph`]), as plain data the device layer translates into descriptors one for one. Kept
//! apart from the device layer so that the graphs are built and checked without a GPU.
//!
//! The graphs are cuDNN's composite scaled-dot-product attention (the patterns its runtime
//! fusion engines recognise, as cudnn-frontend's SDPA nodes build them for cuDNN 9): the
//! forward `S = scale Q Kᵀ`, masks, softmax with the F32 log-sum-exp saved (`Stats`), `O = P V`;
//! the backward from Q, K, V, O, dO and the log-sum-exp, in one of two shapes ([`DqForm`]).
//! With `dQ = dS K` written directly, cuDNN runs a deterministic backward (on Hopper the one
//! cudnn-frontend builds when asked for a deterministic algorithm). With `dQ` summed into an F32
//! accumulator first (the frontend's default graph on Hopper, and PyTorch's), cuDNN runs its
//! flash backward, whose key blocks add their shares of dQ by atomic adds: faster, but a
//! replay is not bit-identical.
//! Tensors are 4-D `(batch, heads, rows, head dim)` with strides: castor's flattened query
//! batches split as its kernels split them (`(b / heads, b % heads)`), so that a head read in
//! place from a fused QKV product has the same strides here as there; a key-padding mask row
//! serves the heads of one batch, and grouped-query attention is `h_kv < h_q` as cuDNN reads
//! it (query head `i` uses key head `i / group`, castor's consecutive sharing).
//!
//! A key-padding mask reaches the graphs as cuDNN's own padding masks take it: INT32 sequence
//! lengths per batch (the query rows, all of them, and the keys kept), compared with each
//! score's row and column index, and the products' M, N and K taken from them, as
//! cudnn-frontend builds its `padding_mask` (the backward masks twice, before and after the
//! log-sum-exp is taken off, as the frontend does for cuDNN 9). That expresses a
//! right-padded batch whose rows each keep at least one key, which is what castor's data
//! feeds (token windows keep every key; SFT and classification rows are right-padded). The
//! lengths come from the mask's flags by `attention_key_lengths` just before the call, which
//! reports any other row through an error flag: castor's kernels, which read the flags
//! themselves, run such masks (`--attention fused`).
//!
//! Masks replace a masked score by [`FILL`], a finite value rather than `-inf`, as castor's
//! kernels, the CPU executor and PyTorch's finite-minimum masks do: a masked key gets
//! `exp(FILL - max) = 0` unless every score its row sees is below -9900, which scaled dot
//! products do not reach.

use super::program::{Command, Place};
use castor_ir::DType;

/// Which direction an [`Sdpa`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SdpaPass {
    Forward,
    Backward,
}

/// What a masked score becomes (see the module docs).
pub const FILL: f32 = -10000.0;

/// The shape and attributes of one fused attention, as cuDNN sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SdpaProblem {
    /// The operands' dtype: F16 or BF16.
    pub dtype: DType,
    /// Batches: the rows of the key-padding mask (1 without one).
    pub batch: usize,
    /// Query and key heads per batch.
    pub heads_q: usize,
    pub heads_kv: usize,
    pub rows_q: usize,
    pub rows_kv: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub window: Option<usize>,
    /// Whether a key-padding mask applies ([`Sdpa::mask`]).
    pub masked: bool,
    /// The score scale's bits (f64), so that the problem can key a plan cache.
    pub scale_bits: u64,
}

impl SdpaProblem {
    pub fn scale(&self) -> f64 {
        f64::from_bits(self.scale_bits)
    }
}

/// A tensor of a call: where it is and its element strides over (batch, heads, rows, head
/// dim); its dims are the problem's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tensor4 {
    pub place: Place,
    pub strides: [i64; 4],
}

impl Tensor4 {
    /// A dense `[batch, heads, rows, dim]` tensor at `place`.
    pub fn dense(place: Place, heads: usize, rows: usize, dim: usize) -> Tensor4 {
        let (h, r, d) = (heads as i64, rows as i64, dim as i64);
        Tensor4 {
            place,
            strides: [h * r * d, r * d, d, 1],
        }
    }
}

/// The backward's extra tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct SdpaGrads {
    pub d_o: Tensor4,
    pub dq: Tensor4,
    pub dk: Tensor4,
    pub dv: Tensor4,
    /// F32 `[heads_q, rows_q]` scratch for `rowsum(dO · O)`, which the backward graph writes
    /// and reads (cuDNN's "softmax_sum").
    pub row_sums: Place,
    /// F32 dense `[batch, heads_q, rows_q, head_dim]` scratch in which the accumulating graph
    /// ([`DqForm::Accumulated`]) sums dQ; the direct graph leaves it alone.
    pub dq_accum: Place,
}

/// How the backward graph produces dQ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DqForm {
    /// `dQ = dS K` into dQ itself: the graph of cuDNN's deterministic backward.
    Direct,
    /// `dQ = dS K` summed into the F32 [`SdpaGrads::dq_accum`], then converted into dQ: the
    /// graph of cuDNN's flash backward, which adds each key block's share by atomic adds
    /// (cuDNN zeroes the accumulator itself from 9.6 on; the caller does before that).
    Accumulated,
}

/// One fused attention pass run by cuDNN, with what runs instead where cuDNN does not.
#[derive(Clone, Debug, PartialEq)]
pub struct Sdpa {
    /// The node it computes (for messages and the listing).
    pub node: String,
    pub pass: SdpaPass,
    pub problem: SdpaProblem,
    pub q: Tensor4,
    pub k: Tensor4,
    pub v: Tensor4,
    pub o: Tensor4,
    /// F32 `[heads_q, rows_q]`: the log-sum-exp of each row's scaled scores.
    pub lse: Place,
    /// The backward's tensors (`None` for the forward).
    pub grads: Option<SdpaGrads>,
    /// With a key-padding mask: cuDNN's INT32 sequence lengths, each batch's query rows at
    /// `lengths`, then the keys each batch keeps at `lengths + `[`kv_lengths_offset`]
    /// (written by the `prelude`).
    pub lengths: Option<Place>,
    /// What runs just before cuDNN's graph, and only where cuDNN runs the pass: the kernel
    /// that writes the sequence lengths from the mask's flags (and reports a mask they cannot
    /// express).
    pub prelude: Vec<Command>,
    /// castor's kernels for the same pass, run where cuDNN is missing or builds no plan for
    /// it (`library=auto`); empty when cuDNN is required (`library=cudnn`).
    pub fallback: Vec<Command>,
    /// Why cuDNN cannot express this pass ([`unsupported`]): the fallback always runs it.
    pub unsupported: Option<String>,
}

impl Sdpa {
    /// Every place the call reads or writes, with its role.
    pub fn places(&self) -> Vec<(&'static str, Place)> {
        let mut out = vec![
            ("q", self.q.place),
            ("k", self.k.place),
            ("v", self.v.place),
            ("o", self.o.place),
            ("lse", self.lse),
        ];
        if let Some(lengths) = self.lengths {
            let kv = lengths.plus(kv_lengths_offset(self.problem.batch));
            out.extend([("seq len q", lengths), ("seq len kv", kv)]);
        }
        if let Some(g) = &self.grads {
            out.extend([
                ("do", g.d_o.place),
                ("dq", g.dq.place),
                ("dk", g.dk.place),
                ("dv", g.dv.place),
                ("row sums", g.row_sums),
                ("dq accum", g.dq_accum),
            ]);
        }
        out
    }

    /// The commands inside the call: its prelude, then its fallback.
    pub fn nested(&self) -> impl Iterator<Item = &Command> {
        self.prelude.iter().chain(&self.fallback)
    }

    /// Bytes of the backward's F32 dQ accumulator.
    pub fn dq_accum_bytes(&self) -> u64 {
        let p = &self.problem;
        4 * (p.batch * p.heads_q * p.rows_q * p.head_dim) as u64
    }

    /// Each tensor's role, bytes (from its first element to one past its last) and place.
    pub fn extents(&self) -> Vec<(&'static str, u64, Place)> {
        let p = &self.problem;
        let elem = p.dtype.size_bytes() as u64;
        // The last element of `batch` batches of `heads` heads of `rows` rows (strides >= 0).
        let span = |t: &Tensor4, heads: usize, rows: usize| -> u64 {
            let last = (p.batch as i64 - 1) * t.strides[0]
                + (heads as i64 - 1) * t.strides[1]
                + (rows as i64 - 1) * t.strides[2]
                + (p.head_dim as i64 - 1) * t.strides[3];
            (last.max(0) as u64 + 1) * elem
        };
        let (hq, hk, sq, sk) = (p.heads_q, p.heads_kv, p.rows_q, p.rows_kv);
        let rows = 4 * (p.batch * hq * sq) as u64;
        let mut out = vec![
            ("q", span(&self.q, hq, sq), self.q.place),
            ("k", span(&self.k, hk, sk), self.k.place),
            ("v", span(&self.v, hk, sk), self.v.place),
            ("o", span(&self.o, hq, sq), self.o.place),
            ("lse", rows, self.lse),
        ];
        if let Some(lengths) = self.lengths {
            let bytes = kv_lengths_offset(p.batch) + 4 * p.batch as u64;
            out.push(("seq lens", bytes, lengths));
        }
        if let Some(g) = &self.grads {
            out.extend([
                ("do", span(&g.d_o, hq, sq), g.d_o.place),
                ("dq", span(&g.dq, hq, sq), g.dq.place),
                ("dk", span(&g.dk, hk, sk), g.dk.place),
                ("dv", span(&g.dv, hk, sk), g.dv.place),
                ("row sums", rows, g.row_sums),
                ("dq accum", self.dq_accum_bytes(), g.dq_accum),
            ]);
        }
        out
    }

    /// Whether the key-lengths kernel before a padded backward may zero dK's and dV's rows for
    /// the keys past each batch's length, so that those keys get a zero gradient, as every
    /// other executor gives them: cuDNN writes no dK or dV row for them (cudnn-frontend's own
    /// tests zero them in cuDNN's output before comparing). It zeroes them through the
    /// gradients' strides (a fused QKV product's interleaved gradient too), so it needs a dense
    /// last dim, strides an `int` holds, and gradients that overlap no operand the graph reads
    /// (a gradient written in place of an operand would be zeroed before it is read). `false`
    /// for a forward.
    pub fn padded_key_rows_zeroable(&self) -> bool {
        let Some(g) = self.grads.as_ref() else {
            return false;
        };
        let fits = |t: &Tensor4| {
            t.strides[3] == 1
                && t.strides
                    .iter()
                    .all(|&x| (0..=i32::MAX as i64).contains(&x))
        };
        if !fits(&g.dk) || !fits(&g.dv) {
            return false;
        }
        let extents = self.extents();
        let overlaps = |(place, bytes): (Place, u64), (other, other_bytes): (Place, u64)| {
            let ((a, x), (b, y)) = (split_place(place), split_place(other));
            a == b && x < y + other_bytes && y < x + bytes
        };
        let written = extents
            .iter()
            .filter(|(role, _, _)| matches!(*role, "dk" | "dv"))
            .map(|&(_, bytes, place)| (place, bytes))
            .collect::<Vec<_>>();
        let read = extents
            .iter()
            .filter(|(role, _, _)| !matches!(*role, "dq" | "dk" | "dv" | "row sums" | "dq accum"))
            .map(|&(_, bytes, place)| (place, bytes))
            .collect::<Vec<_>>();
        written
            .iter()
            .all(|&w| read.iter().all(|&r| !overlaps(w, r)))
    }

    /// The same call with every place mapped by `f` (the fallback's commands too, by
    /// `commands`).
    pub fn map_places(
        &mut self,
        f: &mut dyn FnMut(Place) -> Place,
        commands: &mut dyn FnMut(&mut Vec<Command>),
    ) {
        for t in [&mut self.q, &mut self.k, &mut self.v, &mut self.o] {
            t.place = f(t.place);
        }
        self.lse = f(self.lse);
        self.lengths = self.lengths.map(&mut *f);
        if let Some(g) = &mut self.grads {
            for t in [&mut g.d_o, &mut g.dq, &mut g.dk, &mut g.dv] {
                t.place = f(t.place);
            }
            g.row_sums = f(g.row_sums);
            g.dq_accum = f(g.dq_accum);
        }
        commands(&mut self.prelude);
        commands(&mut self.fallback);
    }
}

/// The start of the buffer `p` lies in, and its byte offset there.
fn split_place(p: Place) -> (Place, u64) {
    match p {
        Place::Arena { offset } => (Place::Arena { offset: 0 }, offset),
        Place::Slot { slot, offset } => (Place::Slot { slot, offset: 0 }, offset),
        Place::Buffer { buffer, offset } => (Place::Buffer { buffer, offset: 0 }, offset),
    }
}

/// The most workspace a program sets aside for cuDNN's attention backward
/// ([`backward_workspace`]): 4 GiB, a score matrix per head at LLaMA-3.2-1B's 32 heads, batch 4
/// and about 5.8k rows; a longer backward runs castor's kernels, which need none.
pub const BACKWARD_WORKSPACE_CAP: u64 = 4 << 30;

/// The workspace a program sets aside for cuDNN's backward of `p`, so that cuDNN runs it
/// rather than castor's kernels: what cuDNN 9.19's backward plans asked for on an H200
/// (2026-11-30; 50,331,776 bytes at GPT-2's 12 heads, B2 x T1024; 201,326,720 at B8;
/// 1,140,850,816 at LLaMA-3.2-1B's 32 of 8 heads, B4 x T2048), which is a BF16 score matrix
/// per query head, `heads x rows_q x rows_kv x 2` bytes, plus, with grouped heads, an F32
/// `heads x rows_q x head_dim` accumulator, plus 128 bytes; rounded up to a MiB. `None` above
/// [`BACKWARD_WORKSPACE_CAP`]. (cuDNN picks its plan when the program loads and refuses one
/// that needs more: the attention line then names the pass and the bytes.) The score matrix
/// is the price of determinism on Hopper: castor asks for a deterministic engine, and before
/// cuDNN 9.25 the fused backward's deterministic form stores dP in the workspace, quadratic in
/// the sequence length. From 9.25 an engine option orders the F32 dQ reductions across key
/// tiles instead, with a workspace linear in the rows (cudnn-frontend's pull request 398
/// describes both forms); castor does not set that option yet.
pub fn backward_workspace(p: &SdpaProblem) -> Option<u64> {
    let heads = (p.batch * p.heads_q) as u64;
    let scores = heads * p.rows_q as u64 * p.rows_kv as u64 * 2;
    let grouped = if p.heads_q != p.heads_kv {
        heads * p.rows_q as u64 * p.head_dim as u64 * 4
    } else {
        0
    };
    let bytes = (scores + grouped + 128).next_multiple_of(1 << 20);
    (bytes <= BACKWARD_WORKSPACE_CAP).then_some(bytes)
}

/// Bytes from the query rows' sequence lengths to the keys' in [`Sdpa::lengths`]: `batch`
/// INT32 values, rounded up to the 16 bytes cuDNN's tensors are declared aligned to.
pub fn kv_lengths_offset(batch: usize) -> u64 {
    (4 * batch as u64).next_multiple_of(16)
}

/// The mask operand of an attention op, as [`unsupported`] weighs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SdpaMask {
    /// A key-padding mask whose rows each serve `group` consecutive query heads.
    KeyPadding { group: usize },
    /// Packed sequences' positions (each query sees only its own sequence).
    Positions,
}

/// Set to 1, cuDNN may run a sliding window ([`unsupported`] lets it through), so that the GPU
/// check can test the windowed graphs against the CPU executor; unset or 0, a window runs
/// castor's kernels. Not for training: see [`unsupported`].
pub const WINDOWS_ENV: &str = "CASTOR_CUDNN_WINDOWS";

/// The value of an on/off environment variable `name`: unset or `0` off, `1` on, anything else
/// an error naming it.
pub fn env_switch(name: &str) -> Result<bool, String> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(false),
        Ok(v) => switch_value(name, &v),
        Err(e) => Err(format!("{name}: {e}")),
    }
}

fn switch_value(name: &str, v: &str) -> Result<bool, String> {
    match v {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(format!("{name}={v}: expected 0 or 1")),
    }
}

/// Why cuDNN's fused attention cannot run an attention op of these shapes and attributes, or
/// `None` when it can: 16-bit operands, a head dim that is a multiple of 8 and at most 256,
/// equal query and key counts when causal (castor's causal mask is aligned to the last key,
/// cuDNN's graphs here to the first; they agree when the counts do), no packed sequences'
/// positions (cuDNN's attention takes packed rows as ragged THD layouts, sequence offsets
/// rather than positions, which castor does not build), a key-padding mask each of whose rows
/// serves the `heads` query heads of one batch, no sliding window unless `windows`, and a
/// backward of more than one row. (A key-padding mask must also be right-padded when the plan
/// runs: see the module docs.)
///
/// The sliding window is refused (unless `windows`, [`WINDOWS_ENV`]) because the graphs first
/// built for it, which cuDNN 9.19 built and ran, gave an H200 gradients 0.75 away from the CPU
/// executor's (the GPU tests' windowed Mistral plans, 2026-11-30) while castor's kernels
/// matched. The likely cause is a padded query row more than the window past its sequence's
/// end: it sees no key. cuDNN's graphs compute only the kept keys (the products' sizes come
/// from the sequence lengths), so such a row attends to those, and its backward, which masks
/// again after the log-sum-exp is taken off, gives it none; castor's kernels and the CPU
/// executor attend to every key, as PyTorch's finite-minimum masks do. The GPU tests scored
/// those rows; castor's own batches never do (padded positions get the ignore index), and then
/// they reach no gradient. Their backward also masked causally before the log-sum-exp was
/// taken off and by the window after, as cudnn-frontend 1.9 did (December 2024); it now
/// applies both after, as the frontend has since 1.10, the one NVIDIA recommends for cuDNN 9.7
/// and later ([`graph`]). Until a GPU run shows those graphs matching on batches whose padding
/// reaches no loss, windows stay castor's.
pub fn unsupported(
    dtype: DType,
    (rows_q, rows_kv, head_dim): (usize, usize, usize),
    (causal, window, windows): (bool, Option<usize>, bool),
    (heads, mask): (usize, Option<SdpaMask>),
    pass: SdpaPass,
) -> Option<String> {
    if !matches!(dtype, DType::F16 | DType::BF16) {
        return Some(format!(
            "{} operands (cuDNN's fused attention takes f16 and bf16)",
            dtype.name()
        ));
    }
    if head_dim % 8 != 0 || head_dim > 256 {
        return Some(format!(
            "head dim {head_dim} (cuDNN needs a multiple of 8, at most 256)"
        ));
    }
    match mask {
        Some(SdpaMask::Positions) => {
            return Some(
                "packed sequences' positions (cuDNN takes packed rows as ragged THD layouts, \
                 which castor does not build)"
                    .into(),
            )
        }
        Some(SdpaMask::KeyPadding { group }) if group != heads => {
            return Some(format!(
                "a mask row shared by {group} query heads, not by the {heads} heads of one batch"
            ));
        }
        _ => {}
    }
    if let (Some(w), false) = (window, windows) {
        return Some(format!(
            "a sliding window of {w} keys (cuDNN's windowed gradients did not match the CPU \
             executor's in the GPU tests)"
        ));
    }
    if causal && rows_q != rows_kv {
        return Some(format!(
            "a causal mask over {rows_q} queries and {rows_kv} keys (aligned to the last key; \
             the graphs here align it to the first)"
        ));
    }
    if pass == SdpaPass::Backward && rows_q == 1 && rows_kv == 1 {
        return Some("a backward over one query and one key (cuDNN has none)".into());
    }
    None
}

// ---- the operation graphs ------------------------------------------------------------------

/// A tensor's element type in a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    /// The operands' dtype (F16 or BF16).
    Io,
    F32,
    I32,
    Bool,
}

/// Where a graph tensor's data comes from when the plan runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Binding {
    /// Produced and consumed inside the graph: no memory.
    Virtual,
    /// A tensor of the call (by its role in [`Sdpa::places`]).
    Operand(&'static str),
    /// A scalar passed by value from the host.
    Scalar(f32),
}

/// One tensor of a graph.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    /// cuDNN's unique id (the variant pack matches pointers to tensors by it).
    pub uid: i64,
    pub name: &'static str,
    pub elem: ElemType,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
    pub binding: Binding,
}

/// A pointwise operation's mode (cuDNN's `cudnnPointwiseMode_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pointwise {
    Add,
    Sub,
    Mul,
    Div,
    Exp,
    Log,
    CmpGe,
    CmpGt,
    CmpLt,
    LogicalAnd,
    /// `y = t ? x : b`.
    BinarySelect,
    /// Each element's index along an axis.
    GenIndex {
        axis: i64,
    },
    /// `y = x`, converted to `y`'s type.
    Identity,
}

impl Pointwise {
    /// Operand count: `x` (and `b`, and `t`).
    pub fn inputs(self) -> usize {
        match self {
            Pointwise::Exp | Pointwise::Log | Pointwise::GenIndex { .. } | Pointwise::Identity => 1,
            Pointwise::BinarySelect => 3,
            _ => 2,
        }
    }
}

/// One operation of a graph; operands are indices into [`Graph::tensors`].
#[derive(Clone, Debug, PartialEq)]
pub enum OpSpec {
    /// `c = a b` over the last two dims (F32 compute), its M, N or K per batch taken from the
    /// sequence lengths in a padded graph (`overrides`).
    Matmul {
        a: usize,
        b: usize,
        c: usize,
        overrides: Overrides,
    },
    /// `y = mode(inputs..)`, computed in `compute`.
    Pointwise {
        mode: Pointwise,
        inputs: Vec<usize>,
        y: usize,
        compute: ElemType,
    },
    /// Sum (`max = false`) or maximum over the dims where `y` is 1 (F32 compute).
    Reduce { max: bool, x: usize, y: usize },
    /// The same elements under other dims and strides (a transposed view).
    Reshape { x: usize, y: usize },
}

/// The tensors (indices into [`Graph::tensors`]) from which a product takes its M, N or K per
/// batch: a padded graph's sequence lengths, as cudnn-frontend's SDPA nodes set them on every
/// product (`CUDNN_ATTR_OPERATION_MATMUL_GEMM_*_OVERRIDE_DESC`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub m: Option<usize>,
    pub n: Option<usize>,
    pub k: Option<usize>,
}

impl Overrides {
    fn all(self) -> impl Iterator<Item = usize> {
        [self.m, self.n, self.k].into_iter().flatten()
    }
}

/// A padded graph's sequence lengths: INT32 `[b, 1, 1, 1]` tensors of the call. (cuDNN's fused
/// engines read a tensor of the call beside the scores only in such a form: 9.14 refused
/// castor's earlier F32 and then INT32 per-key flags.)
#[derive(Clone, Copy)]
struct Lengths {
    q: usize,
    kv: usize,
}

impl Lengths {
    /// The tensors of a masked problem (none without a key-padding mask).
    fn of(g: &mut Graph, p: &SdpaProblem) -> Option<Lengths> {
        let b = p.batch as i64;
        let mut tensor = |name, role| {
            g.tensor(
                name,
                ElemType::I32,
                [b, 1, 1, 1],
                [1, 1, 1, 1],
                Binding::Operand(role),
            )
        };
        p.masked.then(|| Lengths {
            q: tensor("seq len q", "seq len q"),
            kv: tensor("seq len kv", "seq len kv"),
        })
    }
}

/// The overrides of a product whose M and N (`rows`, `cols`) and K (`inner`) each run over
/// queries (`Q`), keys (`K`) or neither.
fn overrides(lengths: Option<Lengths>, [m, n, k]: [Axis; 3]) -> Overrides {
    let Some(l) = lengths else {
        return Overrides::default();
    };
    let pick = |a: Axis| match a {
        Axis::Q => Some(l.q),
        Axis::Kv => Some(l.kv),
        Axis::Dim => None,
    };
    Overrides {
        m: pick(m),
        n: pick(n),
        k: pick(k),
    }
}

/// What a product's dim runs over: queries, keys, or the head dim.
#[derive(Clone, Copy)]
enum Axis {
    Q,
    Kv,
    Dim,
}

/// An operation graph: tensors and the operations over them, in order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    pub tensors: Vec<TensorSpec>,
    pub ops: Vec<OpSpec>,
}

impl Graph {
    fn tensor(
        &mut self,
        name: &'static str,
        elem: ElemType,
        dims: [i64; 4],
        strides: [i64; 4],
        binding: Binding,
    ) -> usize {
        self.tensors.push(TensorSpec {
            uid: self.tensors.len() as i64 + 1,
            name,
            elem,
            dims,
            strides,
            binding,
        });
        self.tensors.len() - 1
    }

    /// A dense virtual tensor.
    fn virt(&mut self, name: &'static str, elem: ElemType, dims: [i64; 4]) -> usize {
        self.tensor(name, elem, dims, dense(dims), Binding::Virtual)
    }

    fn matmul(&mut self, a: usize, b: usize, c: usize, overrides: Overrides) {
        self.ops.push(OpSpec::Matmul { a, b, c, overrides });
    }

    fn scalar(&mut self, name: &'static str, value: f32) -> usize {
        self.tensor(name, ElemType::F32, [1; 4], [1; 4], Binding::Scalar(value))
    }

    fn pointwise(&mut self, mode: Pointwise, inputs: &[usize], y: usize, compute: ElemType) {
        self.ops.push(OpSpec::Pointwise {
            mode,
            inputs: inputs.to_vec(),
            y,
            compute,
        });
    }

    /// `y = mode(inputs)` into a new dense virtual tensor of `dims`.
    fn apply(
        &mut self,
        name: &'static str,
        mode: Pointwise,
        inputs: &[usize],
        elem: ElemType,
        dims: [i64; 4],
    ) -> usize {
        let y = self.virt(name, elem, dims);
        let compute = match mode {
            Pointwise::GenIndex { .. } => ElemType::I32,
            Pointwise::CmpGe | Pointwise::CmpGt | Pointwise::LogicalAnd => ElemType::Bool,
            _ => ElemType::F32,
        };
        self.pointwise(mode, inputs, y, compute);
        y
    }

    /// The tensors the variant pack binds: (index, binding), in tensor order.
    pub fn bound(&self) -> impl Iterator<Item = (usize, Binding)> + '_ {
        self.tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| t.binding != Binding::Virtual)
            .map(|(i, t)| (i, t.binding))
    }

    /// Checks the graph's structure: unique ids, operands in range and defined before use,
    /// every virtual tensor written once and read, the right operand counts.
    pub fn check(&self) -> Result<(), String> {
        let n = self.tensors.len();
        let mut written = vec![false; n];
        let mut read = vec![false; n];
        let mut uids: Vec<i64> = self.tensors.iter().map(|t| t.uid).collect();
        uids.sort_unstable();
        uids.dedup();
        if uids.len() != n {
            return Err("two tensors share a unique id".into());
        }
        let ready = |i: usize, written: &[bool]| -> Result<(), String> {
            let t = self
                .tensors
                .get(i)
                .ok_or(format!("tensor {i} out of range"))?;
            if t.binding == Binding::Virtual && !written[i] {
                return Err(format!("`{}` is read before it is written", t.name));
            }
            Ok(())
        };
        for op in &self.ops {
            let (ins, out): (Vec<usize>, usize) = match op {
                OpSpec::Matmul {
                    a, b, c, overrides, ..
                } => {
                    let mut ins = vec![*a, *b];
                    ins.extend(overrides.all());
                    (ins, *c)
                }
                OpSpec::Pointwise {
                    mode, inputs, y, ..
                } => {
                    if inputs.len() != mode.inputs() {
                        return Err(format!("{mode:?} takes {} operands", mode.inputs()));
                    }
                    (inputs.clone(), *y)
                }
                OpSpec::Reduce { x, y, .. } | OpSpec::Reshape { x, y } => (vec![*x], *y),
            };
            for &i in &ins {
                ready(i, &written)?;
                read[i] = true;
            }
            let t = self.tensors.get(out).ok_or("an output out of range")?;
            if written[out] {
                return Err(format!("`{}` is written twice", t.name));
            }
            if matches!(t.binding, Binding::Scalar(_)) {
                return Err(format!("`{}` is a scalar and cannot be written", t.name));
            }
            written[out] = true;
        }
        for (i, t) in self.tensors.iter().enumerate() {
            if t.binding == Binding::Virtual && !(written[i] && read[i]) {
                return Err(format!("virtual `{}` is not both written and read", t.name));
            }
        }
        Ok(())
    }
}

/// Row-major strides of `dims`.
fn dense(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

/// A tensor's dims and strides with its last two dims swapped (Kᵀ, Vᵀ as the same memory).
fn swapped(dims: [i64; 4], strides: [i64; 4]) -> ([i64; 4], [i64; 4]) {
    (
        [dims[0], dims[1], dims[3], dims[2]],
        [strides[0], strides[1], strides[3], strides[2]],
    )
}

/// `s` with the scores where `keep` is false replaced by [`FILL`].
fn select(g: &mut Graph, name: &'static str, s: usize, keep: usize) -> usize {
    let dims = g.tensors[s].dims;
    let fill = g.scalar("fill", FILL);
    g.apply(
        name,
        Pointwise::BinarySelect,
        &[s, fill, keep],
        ElemType::F32,
        dims,
    )
}

/// Each score's row and column index (INT32), generated from scores `s` as each mask of
/// cudnn-frontend's generates its own.
fn indices(g: &mut Graph, s: usize, [row, col]: [&'static str; 2]) -> (usize, usize) {
    let dims = g.tensors[s].dims;
    let mut index = |name, axis| {
        g.apply(
            name,
            Pointwise::GenIndex { axis },
            &[s],
            ElemType::I32,
            dims,
        )
    };
    (index(row, 2), index(col, 3))
}

/// The key-padding mask of scores `s` (`[b, hq, sq, skv]`), as cudnn-frontend's padding mask:
/// the scores of rows below the batch's query length and keys below its key length are kept.
/// The comparisons compute in `compare` (the frontend's forward compares in INT32, its
/// backward in BOOLEAN).
fn padding(
    g: &mut Graph,
    s: usize,
    l: Lengths,
    compare: ElemType,
    names: [&'static str; 6],
) -> usize {
    let dims = g.tensors[s].dims;
    let [row_name, col_name, rows_name, cols_name, keep_name, out_name] = names;
    let (row, col) = indices(g, s, [row_name, col_name]);
    let mut less = |name, index, length| {
        let y = g.virt(name, compare, dims);
        g.pointwise(Pointwise::CmpLt, &[index, length], y, compare);
        y
    };
    let rows = less(rows_name, row, l.q);
    let cols = less(cols_name, col, l.kv);
    let keep = g.apply(
        keep_name,
        Pointwise::LogicalAnd,
        &[rows, cols],
        ElemType::Bool,
        dims,
    );
    select(g, out_name, s, keep)
}

/// The causal mask of scores `s`: `col <= row` kept.
fn causal(g: &mut Graph, s: usize) -> usize {
    let dims = g.tensors[s].dims;
    let (row, col) = indices(g, s, ["row", "col"]);
    let keep = g.apply(
        "causal",
        Pointwise::CmpGe,
        &[row, col],
        ElemType::Bool,
        dims,
    );
    select(g, "causal scores", s, keep)
}

/// The sliding window of `w` keys of scores `s`: `col + w > row` kept.
fn window(g: &mut Graph, s: usize, w: usize) -> usize {
    let dims = g.tensors[s].dims;
    let (row, col) = indices(g, s, ["window row", "window col"]);
    let width = g.scalar("window", w as f32);
    let edge = g.apply(
        "window edge",
        Pointwise::Add,
        &[col, width],
        ElemType::F32,
        dims,
    );
    let keep = g.apply(
        "window",
        Pointwise::CmpGt,
        &[edge, row],
        ElemType::Bool,
        dims,
    );
    select(g, "window scores", s, keep)
}

const PADDING: [&str; 6] = [
    "padding row",
    "padding col",
    "row < seq len q",
    "col < seq len kv",
    "kept",
    "padded scores",
];

/// The operation graph of `call` for cuDNN `version` (`91900` for 9.19.0); a backward's
/// produces dQ in `form`.
pub fn graph(call: &Sdpa, form: DqForm, version: usize) -> Result<Graph, String> {
    match (call.pass, &call.grads) {
        (SdpaPass::Forward, _) => Ok(forward(call)),
        (SdpaPass::Backward, Some(grads)) => Ok(backward(call, grads, form, version)),
        (SdpaPass::Backward, None) => Err(format!(
            "the backward of %{} names no gradient tensors",
            call.node
        )),
    }
}

fn forward(c: &Sdpa) -> Graph {
    let p = &c.problem;
    let (b, hq, hk) = (p.batch as i64, p.heads_q as i64, p.heads_kv as i64);
    let (sq, sk, d) = (p.rows_q as i64, p.rows_kv as i64, p.head_dim as i64);
    let mut g = Graph::default();
    let q = g.tensor(
        "q",
        ElemType::Io,
        [b, hq, sq, d],
        c.q.strides,
        Binding::Operand("q"),
    );
    let (kt_dims, kt_strides) = swapped([b, hk, sk, d], c.k.strides);
    let kt = g.tensor(
        "k",
        ElemType::Io,
        kt_dims,
        kt_strides,
        Binding::Operand("k"),
    );
    let v = g.tensor(
        "v",
        ElemType::Io,
        [b, hk, sk, d],
        c.v.strides,
        Binding::Operand("v"),
    );
    let o = g.tensor(
        "o",
        ElemType::Io,
        [b, hq, sq, d],
        c.o.strides,
        Binding::Operand("o"),
    );
    let rows = [b, hq, sq, 1];
    let stats = g.tensor(
        "lse",
        ElemType::F32,
        rows,
        dense(rows),
        Binding::Operand("lse"),
    );
    let lengths = Lengths::of(&mut g, p);
    let scale = g.scalar("scale", p.scale() as f32);
    let scores = [b, hq, sq, sk];
    let s1 = g.virt("q k^T", ElemType::F32, scores);
    g.matmul(
        q,
        kt,
        s1,
        overrides(lengths, [Axis::Q, Axis::Kv, Axis::Dim]),
    );
    let mut s3 = g.apply(
        "scores",
        Pointwise::Mul,
        &[s1, scale],
        ElemType::F32,
        scores,
    );
    // The masks in cudnn-frontend's order: padding, causal, window.
    if let Some(l) = lengths {
        s3 = padding(&mut g, s3, l, ElemType::I32, PADDING);
    }
    if p.causal {
        s3 = causal(&mut g, s3);
    }
    if let Some(w) = p.window {
        s3 = window(&mut g, s3, w);
    }
    let m = g.virt("max", ElemType::F32, rows);
    g.ops.push(OpSpec::Reduce {
        max: true,
        x: s3,
        y: m,
    });
    let centred = g.apply("s - max", Pointwise::Sub, &[s3, m], ElemType::F32, scores);
    let e = g.apply("exp", Pointwise::Exp, &[centred], ElemType::F32, scores);
    let z = g.virt("sum", ElemType::F32, rows);
    g.ops.push(OpSpec::Reduce {
        max: false,
        x: e,
        y: z,
    });
    let log_z = g.apply("log sum", Pointwise::Log, &[z], ElemType::F32, rows);
    g.pointwise(Pointwise::Add, &[m, log_z], stats, ElemType::F32);
    // P enters the second product in the operands' dtype.
    let probs = g.apply("p", Pointwise::Div, &[e, z], ElemType::Io, scores);
    g.matmul(
        probs,
        v,
        o,
        overrides(lengths, [Axis::Q, Axis::Dim, Axis::Kv]),
    );
    g
}

fn backward(c: &Sdpa, grads: &SdpaGrads, form: DqForm, version: usize) -> Graph {
    let p = &c.problem;
    let (b, hq, hk) = (p.batch as i64, p.heads_q as i64, p.heads_kv as i64);
    let (sq, sk, d) = (p.rows_q as i64, p.rows_kv as i64, p.head_dim as i64);
    let mut g = Graph::default();
    let q_dims = [b, hq, sq, d];
    let kv_dims = [b, hk, sk, d];
    let q = g.tensor(
        "q",
        ElemType::Io,
        q_dims,
        c.q.strides,
        Binding::Operand("q"),
    );
    let (kt_dims, kt_strides) = swapped(kv_dims, c.k.strides);
    let kt = g.tensor(
        "k",
        ElemType::Io,
        kt_dims,
        kt_strides,
        Binding::Operand("k"),
    );
    let (vt_dims, vt_strides) = swapped(kv_dims, c.v.strides);
    let vt = g.tensor(
        "v",
        ElemType::Io,
        vt_dims,
        vt_strides,
        Binding::Operand("v"),
    );
    let o = g.tensor(
        "o",
        ElemType::Io,
        q_dims,
        c.o.strides,
        Binding::Operand("o"),
    );
    let d_o = g.tensor(
        "do",
        ElemType::Io,
        q_dims,
        grads.d_o.strides,
        Binding::Operand("do"),
    );
    let rows = [b, hq, sq, 1];
    let stats = g.tensor(
        "lse",
        ElemType::F32,
        rows,
        dense(rows),
        Binding::Operand("lse"),
    );
    let dq = g.tensor(
        "dq",
        ElemType::Io,
        q_dims,
        grads.dq.strides,
        Binding::Operand("dq"),
    );
    let dk = g.tensor(
        "dk",
        ElemType::Io,
        kv_dims,
        grads.dk.strides,
        Binding::Operand("dk"),
    );
    let dv = g.tensor(
        "dv",
        ElemType::Io,
        kv_dims,
        grads.dv.strides,
        Binding::Operand("dv"),
    );
    let row_sums = g.tensor(
        "row sums",
        ElemType::F32,
        rows,
        dense(rows),
        Binding::Operand("row sums"),
    );
    let lengths = Lengths::of(&mut g, p);
    let scale = g.scalar("scale", p.scale() as f32);
    let one = g.scalar("one", 1.0);
    let scores = [b, hq, sq, sk];
    let transposed = [b, hq, sk, sq];
    let transposed_strides = [hq * sq * sk, sq * sk, 1, sk];

    // rowsum(dO · O), through the product by one that cuDNN's pattern has there.
    let prod = g.apply("do * o", Pointwise::Mul, &[d_o, o], ElemType::F32, q_dims);
    let sums = g.virt("rowsum(do * o)", ElemType::F32, rows);
    g.ops.push(OpSpec::Reduce {
        max: false,
        x: prod,
        y: sums,
    });
    g.pointwise(Pointwise::Mul, &[sums, one], row_sums, ElemType::F32);
    // P = exp(masked scale Q Kᵀ - lse), the masks where cudnn-frontend's backward puts them:
    // the padding before the log-sum-exp is taken off, and again after it (the frontend's
    // workaround for cuDNN before 9.10). Without a window, the causal mask comes before the
    // log-sum-exp is taken off too, so that a row that sees no kept key under the masks gets
    // back its forward's uniform probabilities, and the padding comes again whatever the
    // version: this is the graph the GPU tests passed. With a window, the graph is the one
    // the frontend has built since 1.10: the padding again only before cuDNN 9.10, then the
    // causal mask and the window together after the subtraction, the diagonal band (its
    // right bound, then its left bound). The graph with the causal mask before and the window
    // after, which frontend 1.9 built, gave an H200 with cuDNN 9.19 gradients 0.75 away from
    // the CPU executor's. Under a window a row that sees no key gets P = 0 rather than
    // uniform probabilities; only padded rows can (each row keeps its own key), and their
    // output gradients are zero (their outputs reach no loss), so their contributions are
    // zero either way.
    let s1 = g.virt("q k^T", ElemType::F32, scores);
    g.matmul(
        q,
        kt,
        s1,
        overrides(lengths, [Axis::Q, Axis::Kv, Axis::Dim]),
    );
    let mut s3 = g.apply(
        "scores",
        Pointwise::Mul,
        &[s1, scale],
        ElemType::F32,
        scores,
    );
    if let Some(l) = lengths {
        s3 = padding(&mut g, s3, l, ElemType::Bool, PADDING);
    }
    let band_after_lse = p.window.is_some();
    if p.causal && !band_after_lse {
        s3 = causal(&mut g, s3);
    }
    let mut s4 = g.apply(
        "s - lse",
        Pointwise::Sub,
        &[s3, stats],
        ElemType::F32,
        scores,
    );
    let padding_again = !band_after_lse || version < 91000;
    if let (Some(l), true) = (lengths, padding_again) {
        let names = [
            "padding row again",
            "padding col again",
            "row < seq len q again",
            "col < seq len kv again",
            "kept again",
            "padded scores again",
        ];
        s4 = padding(&mut g, s4, l, ElemType::Bool, names);
    }
    if p.causal && band_after_lse {
        s4 = causal(&mut g, s4);
    }
    if let Some(w) = p.window {
        s4 = window(&mut g, s4, w);
    }
    let probs = g.apply("p", Pointwise::Exp, &[s4], ElemType::F32, scores);
    // dV = Pᵀ dO (summed over a group's query heads).
    let pt = g.tensor(
        "p^T",
        ElemType::Io,
        transposed,
        transposed_strides,
        Binding::Virtual,
    );
    g.ops.push(OpSpec::Reshape { x: probs, y: pt });
    let kv_by_q = overrides(lengths, [Axis::Kv, Axis::Dim, Axis::Q]);
    grouped_product(
        &mut g,
        "dv",
        (pt, d_o, dv),
        [b, hq, sk, d],
        hq != hk,
        kv_by_q,
    );
    // dS = scale P (dO Vᵀ · 1 - rowsum) (the product by one where cudnn-frontend's graph
    // multiplies by the dropout mask).
    let dp = g.virt("do v^T", ElemType::F32, scores);
    g.matmul(
        d_o,
        vt,
        dp,
        overrides(lengths, [Axis::Q, Axis::Kv, Axis::Dim]),
    );
    let dp = g.apply(
        "do v^T * 1",
        Pointwise::Mul,
        &[dp, one],
        ElemType::F32,
        scores,
    );
    let centred = g.apply(
        "dp - rowsum",
        Pointwise::Sub,
        &[dp, row_sums],
        ElemType::F32,
        scores,
    );
    let ds_unscaled = g.apply(
        "p (dp - rowsum)",
        Pointwise::Mul,
        &[centred, probs],
        ElemType::F32,
        scores,
    );
    let ds = g.apply(
        "ds",
        Pointwise::Mul,
        &[ds_unscaled, scale],
        ElemType::F32,
        scores,
    );
    // dK = dSᵀ Q (summed over a group's query heads).
    let dst = g.tensor(
        "ds^T",
        ElemType::Io,
        transposed,
        transposed_strides,
        Binding::Virtual,
    );
    g.ops.push(OpSpec::Reshape { x: ds, y: dst });
    grouped_product(
        &mut g,
        "dk",
        (dst, q, dk),
        [b, hq, sk, d],
        hq != hk,
        kv_by_q,
    );
    // dQ = dS K, written directly (the deterministic engine's graph) or through the F32
    // accumulator (the flash backward's).
    let k_view = g.tensor(
        "k view",
        ElemType::Io,
        kv_dims,
        c.k.strides,
        Binding::Virtual,
    );
    g.ops.push(OpSpec::Reshape { x: kt, y: k_view });
    let q_by_kv = overrides(lengths, [Axis::Q, Axis::Dim, Axis::Kv]);
    match form {
        DqForm::Direct => g.matmul(ds, k_view, dq, q_by_kv),
        DqForm::Accumulated => {
            let accum = g.tensor(
                "dq accum",
                ElemType::F32,
                q_dims,
                dense(q_dims),
                Binding::Operand("dq accum"),
            );
            g.matmul(ds, k_view, accum, q_by_kv);
            g.pointwise(Pointwise::Identity, &[accum], dq, ElemType::F32);
        }
    }
    g
}

/// `out = a b`, through a per-query-head product summed over each group of query heads when
/// `grouped` (fewer key heads).
fn grouped_product(
    g: &mut Graph,
    name: &'static str,
    (a, b, out): (usize, usize, usize),
    full: [i64; 4],
    grouped: bool,
    overrides: Overrides,
) {
    if !grouped {
        g.matmul(a, b, out, overrides);
        return;
    }
    let per_head = g.virt(name, ElemType::Io, full);
    g.matmul(a, b, per_head, overrides);
    g.ops.push(OpSpec::Reduce {
        max: false,
        x: per_head,
        y: out,
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The cuDNN of the GPU machine's PyTorch on the 2026-11-30 H200 run.
    const CUDNN_9_19: usize = 91900;

    /// A call on GPT-2-like heads (two batches of 256 rows, head dim 64) at arena places.
    pub(crate) fn call(
        pass: SdpaPass,
        heads: (usize, usize),
        causal: bool,
        window: Option<usize>,
        masked: bool,
    ) -> Sdpa {
        let (hq, hk) = heads;
        let (s, d) = (256, 64);
        let at = |offset| Place::Arena { offset };
        let problem = SdpaProblem {
            dtype: DType::BF16,
            batch: 2,
            heads_q: hq,
            heads_kv: hk,
            rows_q: s,
            rows_kv: s,
            head_dim: d,
            causal,
            window,
            masked,
            scale_bits: 0.125f64.to_bits(),
        };
        let t = |o, h| Tensor4::dense(at(o), h, s, d);
        let lengths = masked.then(|| at(10 << 20));
        Sdpa {
            node: "context".into(),
            pass,
            problem,
            q: t(0, hq),
            k: t(1 << 20, hk),
            v: t(2 << 20, hk),
            o: t(3 << 20, hq),
            lse: at(4 << 20),
            grads: (pass == SdpaPass::Backward).then(|| SdpaGrads {
                d_o: t(5 << 20, hq),
                dq: t(6 << 20, hq),
                dk: t(7 << 20, hk),
                dv: t(8 << 20, hk),
                row_sums: at(9 << 20),
                dq_accum: at(11 << 20),
            }),
            lengths,
            prelude: Vec::new(),
            fallback: Vec::new(),
            unsupported: None,
        }
    }

    /// Every variant's graph is well formed, and binds exactly the call's places and scalars
    /// (the direct backward all but the dQ accumulator).
    #[test]
    fn graphs_are_well_formed_and_bind_the_calls_tensors() {
        for (pass, form) in [
            (SdpaPass::Forward, DqForm::Direct),
            (SdpaPass::Backward, DqForm::Direct),
            (SdpaPass::Backward, DqForm::Accumulated),
        ] {
            for heads in [(4, 4), (8, 2)] {
                for (causal, window, masked) in [
                    (false, None, false),
                    (true, None, false),
                    (true, Some(64), true),
                    (false, None, true),
                ] {
                    let c = call(pass, heads, causal, window, masked);
                    let g = graph(&c, form, CUDNN_9_19).unwrap();
                    g.check()
                        .unwrap_or_else(|e| panic!("{pass:?} {heads:?} {causal}: {e}"));
                    let mut operands: Vec<&str> = g
                        .bound()
                        .filter_map(|(_, b)| match b {
                            Binding::Operand(role) => Some(role),
                            _ => None,
                        })
                        .collect();
                    operands.sort_unstable();
                    let mut roles: Vec<&str> = c
                        .places()
                        .iter()
                        .map(|(r, _)| *r)
                        .filter(|r| *r != "dq accum" || form == DqForm::Accumulated)
                        .collect();
                    roles.sort_unstable();
                    assert_eq!(operands, roles, "{pass:?} {form:?}");
                    let masks = g
                        .ops
                        .iter()
                        .filter(|op| {
                            matches!(
                                op,
                                OpSpec::Pointwise {
                                    mode: Pointwise::BinarySelect,
                                    ..
                                }
                            )
                        })
                        .count();
                    // The backward masks the padding twice, as cudnn-frontend's does, but
                    // for cuDNN 9.10 on under a window (its graph since frontend 1.10).
                    let twice = pass == SdpaPass::Backward && window.is_none();
                    let padding = usize::from(masked) * if twice { 2 } else { 1 };
                    let want = usize::from(causal) + usize::from(window.is_some()) + padding;
                    assert_eq!(masks, want, "{pass:?} {causal} {window:?} {masked}");
                    // cuDNN's fused engines refuse a pointwise op on the scores' path whose
                    // first operand is a tensor of the call (the padding flags once were):
                    // such an op reads only the call's tensors (the backward's dO · O and
                    // the accumulator's conversion into dQ).
                    // And the sequence lengths they read beside the scores are INT32
                    // `[b, 1, 1, 1]` (castor's first graphs read F32, then INT32 per-key
                    // flags, which cuDNN 9.14's engines refused), compared in INT32.
                    for op in &g.ops {
                        let OpSpec::Pointwise { mode, inputs, .. } = op else {
                            continue;
                        };
                        let bound =
                            |i: &usize| matches!(g.tensors[*i].binding, Binding::Operand(_));
                        assert!(
                            !bound(&inputs[0]) || inputs.iter().all(bound),
                            "{pass:?} masked={masked}: {mode:?} takes `{}` first",
                            g.tensors[inputs[0]].name
                        );
                        for i in inputs {
                            let t = &g.tensors[*i];
                            if matches!(t.binding, Binding::Operand("seq len q" | "seq len kv")) {
                                assert_eq!((t.elem, t.dims), (ElemType::I32, [2, 1, 1, 1]));
                                assert_eq!(*mode, Pointwise::CmpLt);
                                // The frontend compares in INT32 forward, BOOLEAN backward.
                                let compare = match pass {
                                    SdpaPass::Forward => ElemType::I32,
                                    SdpaPass::Backward => ElemType::Bool,
                                };
                                assert!(op_computes(op, compare), "{pass:?} {mode:?}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// A padded graph's products take their M, N and K from the sequence lengths as
    /// cudnn-frontend's SDPA nodes set them (each query or key axis of a product, never the
    /// head dim); an unpadded graph's take none.
    #[test]
    fn padded_products_take_their_sizes_from_the_sequence_lengths() {
        for (pass, form) in [
            (SdpaPass::Forward, DqForm::Direct),
            (SdpaPass::Backward, DqForm::Direct),
            (SdpaPass::Backward, DqForm::Accumulated),
        ] {
            for heads in [(4, 4), (8, 2)] {
                let plain = graph(&call(pass, heads, true, None, false), form, CUDNN_9_19).unwrap();
                let g = graph(&call(pass, heads, true, None, true), form, CUDNN_9_19).unwrap();
                let name = |t: Option<usize>| t.map(|i| g.tensors[i].name);
                let products: Vec<(&str, [Option<&str>; 3])> = g
                    .ops
                    .iter()
                    .filter_map(|op| match op {
                        OpSpec::Matmul { c, overrides, .. } => Some((
                            g.tensors[*c].name,
                            [name(overrides.m), name(overrides.n), name(overrides.k)],
                        )),
                        _ => None,
                    })
                    .collect();
                let (q, kv) = (Some("seq len q"), Some("seq len kv"));
                let grouped = heads.0 != heads.1;
                let want: Vec<(&str, [Option<&str>; 3])> = match pass {
                    SdpaPass::Forward => vec![("q k^T", [q, kv, None]), ("o", [q, None, kv])],
                    SdpaPass::Backward => {
                        let dq = if form == DqForm::Direct {
                            "dq"
                        } else {
                            "dq accum"
                        };
                        vec![
                            ("q k^T", [q, kv, None]),
                            ("dv", [kv, None, q]),
                            ("do v^T", [q, kv, None]),
                            ("dk", [kv, None, q]),
                            (dq, [q, None, kv]),
                        ]
                    }
                };
                assert_eq!(products, want, "{pass:?} {form:?} grouped={grouped}");
                assert!(plain.ops.iter().all(|op| match op {
                    OpSpec::Matmul { overrides, .. } => *overrides == Overrides::default(),
                    _ => true,
                }));
            }
        }
    }

    fn op_computes(op: &OpSpec, elem: ElemType) -> bool {
        matches!(op, OpSpec::Pointwise { compute, .. } if *compute == elem)
    }

    /// The direct backward writes dQ by its product; the accumulating one sums the product
    /// into the dense F32 accumulator and converts that into dQ, as cudnn-frontend's graph.
    #[test]
    fn dq_is_written_directly_or_through_the_f32_accumulator() {
        let c = call(SdpaPass::Backward, (8, 2), true, None, false);
        let writer = |g: &Graph, name: &str| {
            g.ops
                .iter()
                .find(|op| match op {
                    OpSpec::Matmul { c, .. } => g.tensors[*c].name == name,
                    OpSpec::Pointwise { y, .. } => g.tensors[*y].name == name,
                    _ => false,
                })
                .cloned()
        };
        let direct = graph(&c, DqForm::Direct, CUDNN_9_19).unwrap();
        assert!(matches!(writer(&direct, "dq"), Some(OpSpec::Matmul { .. })));
        assert!(direct.tensors.iter().all(|t| t.name != "dq accum"));
        let accumulated = graph(&c, DqForm::Accumulated, CUDNN_9_19).unwrap();
        let accum = accumulated
            .tensors
            .iter()
            .position(|t| t.name == "dq accum")
            .unwrap();
        let t = &accumulated.tensors[accum];
        assert_eq!((t.elem, t.dims), (ElemType::F32, [2, 8, 256, 64]));
        assert_eq!(t.strides, [8 * 256 * 64, 256 * 64, 64, 1]);
        assert!(matches!(
            writer(&accumulated, "dq accum"),
            Some(OpSpec::Matmul { .. })
        ));
        assert_eq!(
            writer(&accumulated, "dq"),
            Some(OpSpec::Pointwise {
                mode: Pointwise::Identity,
                inputs: vec![accum],
                y: accumulated
                    .tensors
                    .iter()
                    .position(|t| t.name == "dq")
                    .unwrap(),
                compute: ElemType::F32,
            })
        );
        assert_eq!(c.dq_accum_bytes(), 4 * 2 * 8 * 256 * 64);
        assert_eq!(accumulated.ops.len(), direct.ops.len() + 1);
    }

    /// Kᵀ is K's memory with the last two dims and strides swapped, and grouped heads sum
    /// their per-head gradients into the key heads.
    #[test]
    fn k_is_transposed_by_strides_and_groups_reduce() {
        let c = call(SdpaPass::Backward, (8, 2), true, None, false);
        let g = graph(&c, DqForm::Direct, CUDNN_9_19).unwrap();
        let k = g.tensors.iter().find(|t| t.name == "k").unwrap();
        assert_eq!(k.dims, [2, 2, 64, 256]);
        assert_eq!(k.strides, [2 * 256 * 64, 256 * 64, 1, 64]);
        let reductions_into_grads = g
            .ops
            .iter()
            .filter(|op| match op {
                OpSpec::Reduce { y, .. } => matches!(g.tensors[*y].name, "dk" | "dv"),
                _ => false,
            })
            .count();
        assert_eq!(reductions_into_grads, 2);
    }

    /// Before a padded backward the key-lengths kernel zeroes the padded keys' dK and dV rows
    /// through their strides: dense gradients, a fused QKV product's interleaved ones, and rows
    /// with gaps between them alike; never where a gradient would overwrite an operand the
    /// graph reads, a stride is beyond an `int`, or the last dim is not dense; a forward has
    /// none.
    #[test]
    fn padded_key_rows_are_zeroed_through_strides_unless_an_operand_lies_under_them() {
        let backward = |heads| call(SdpaPass::Backward, heads, true, None, true);
        assert!(backward((8, 2)).padded_key_rows_zeroable());
        // [b, s, 3, h, d] gradients of a fused QKV product.
        let mut fused = backward((4, 4));
        let (h, s, d) = (4i64, 256i64, 64i64);
        let strides = [s * 3 * h * d, d, 3 * h * d, 1];
        let g = fused.grads.as_mut().unwrap();
        for (i, t) in [&mut g.dq, &mut g.dk, &mut g.dv].into_iter().enumerate() {
            t.place = Place::Arena {
                offset: (6 << 20) + (i as i64 * h * d * 2) as u64,
            };
            t.strides = strides;
        }
        assert!(fused.padded_key_rows_zeroable());
        // Strided dK and dV with a gap between their rows.
        let mut gapped = backward((4, 4));
        let g = gapped.grads.as_mut().unwrap();
        g.dk.strides = [h * s * 2 * d, s * 2 * d, 2 * d, 1];
        g.dv.strides = g.dk.strides;
        assert!(gapped.padded_key_rows_zeroable());
        // dV written in place of V.
        let mut aliased = backward((8, 2));
        aliased.grads.as_mut().unwrap().dv.place = aliased.v.place;
        assert!(!aliased.padded_key_rows_zeroable());
        // A batch stride beyond an int, and a strided last dim.
        let mut wide = backward((8, 2));
        wide.grads.as_mut().unwrap().dk.strides[0] = 1 << 31;
        assert!(!wide.padded_key_rows_zeroable());
        let mut transposed = backward((8, 2));
        transposed.grads.as_mut().unwrap().dv.strides[3] = 2;
        assert!(!transposed.padded_key_rows_zeroable());
        // A forward zeroes nothing.
        assert!(!call(SdpaPass::Forward, (8, 2), true, None, true).padded_key_rows_zeroable());
    }

    #[test]
    fn the_backward_workspace_covers_what_cudnn_asked_for_on_the_h200() {
        let problem = |batch, heads_q, heads_kv, rows| SdpaProblem {
            dtype: DType::BF16,
            batch,
            heads_q,
            heads_kv,
            rows_q: rows,
            rows_kv: rows,
            head_dim: 64,
            causal: true,
            window: None,
            masked: false,
            scale_bits: 0.125f64.to_bits(),
        };
        // The bytes cuDNN 9.19's backward plans needed on the 2026-11-30 H200 run: GPT-2 at
        // B2 and B8 x T1024, LLaMA-3.2-1B at B4 x T2048.
        for (p, asked) in [
            (problem(1, 2 * 12, 2 * 12, 1024), 50_331_776u64),
            (problem(1, 8 * 12, 8 * 12, 1024), 201_326_720),
            (problem(4, 32, 8, 2048), 1_140_850_816),
        ] {
            let set_aside = backward_workspace(&p).unwrap();
            assert!(set_aside >= asked && set_aside - asked < 1 << 20, "{p:?}");
        }
        assert_eq!(backward_workspace(&problem(4, 32, 8, 8192)), None);
    }

    #[test]
    fn what_cudnn_cannot_express_is_named() {
        let f = SdpaPass::Forward;
        let plain = (1, None);
        let causal = (true, None, false);
        let padding = |group| Some(SdpaMask::KeyPadding { group });
        assert!(unsupported(DType::BF16, (1024, 1024, 64), causal, plain, f).is_none());
        assert!(unsupported(DType::BF16, (1024, 1024, 64), causal, (32, padding(32)), f).is_none());
        let why = |r: Option<String>| r.unwrap_or_default();
        assert!(why(unsupported(DType::F32, (8, 8, 64), causal, plain, f)).contains("f32 operands"));
        assert!(why(unsupported(DType::F16, (8, 8, 60), causal, plain, f)).contains("head dim 60"));
        let shared = why(unsupported(
            DType::F16,
            (8, 8, 64),
            causal,
            (4, padding(2)),
            f,
        ));
        assert!(shared.contains("mask row shared by 2"), "{shared}");
        let packed = why(unsupported(
            DType::BF16,
            (8, 8, 64),
            causal,
            (4, Some(SdpaMask::Positions)),
            f,
        ));
        assert!(packed.contains("packed sequences' positions"), "{packed}");
        assert!(why(unsupported(DType::F16, (8, 9, 64), causal, plain, f)).contains("causal"));
        let b = SdpaPass::Backward;
        assert!(why(unsupported(
            DType::F16,
            (1, 1, 64),
            (false, None, false),
            plain,
            b
        ))
        .contains("one query"));
        let windowed = why(unsupported(
            DType::BF16,
            (8, 8, 64),
            (true, Some(4), false),
            plain,
            f,
        ));
        assert!(windowed.contains("sliding window of 4 keys"), "{windowed}");
        // Let through by CASTOR_CUDNN_WINDOWS=1, for the GPU check's test of the graphs.
        assert!(unsupported(DType::BF16, (8, 8, 64), (true, Some(4), true), plain, f).is_none());
    }

    #[test]
    fn an_on_off_variable_takes_0_or_1() {
        assert_eq!(switch_value("CASTOR_X", "0"), Ok(false));
        assert_eq!(switch_value("CASTOR_X", "1"), Ok(true));
        assert_eq!(
            switch_value("CASTOR_CUDNN_NONDETERMINISTIC", "yes"),
            Err("CASTOR_CUDNN_NONDETERMINISTIC=yes: expected 0 or 1".into())
        );
    }

    /// The backward's masks in order: without a window the padding and the causal mask before
    /// the log-sum-exp is taken off and the padding again after (the graph the GPU tests
    /// passed); with one, as cudnn-frontend has built it since 1.10: the padding again only
    /// before cuDNN 9.10, then the causal mask and the window together, a diagonal band.
    #[test]
    fn a_windowed_backward_masks_the_band_after_the_log_sum_exp() {
        let order = |window, version| {
            let c = call(SdpaPass::Backward, (4, 4), true, window, true);
            let g = graph(&c, DqForm::Direct, version).unwrap();
            g.ops
                .iter()
                .filter_map(|op| match op {
                    OpSpec::Pointwise {
                        mode: Pointwise::BinarySelect | Pointwise::Sub,
                        y,
                        ..
                    } => Some(g.tensors[*y].name),
                    _ => None,
                })
                .filter(|n| *n != "dp - rowsum")
                .collect::<Vec<_>>()
        };
        for version in [90200, CUDNN_9_19] {
            assert_eq!(
                order(None, version),
                [
                    "padded scores",
                    "causal scores",
                    "s - lse",
                    "padded scores again"
                ]
            );
        }
        assert_eq!(
            order(Some(64), 90200),
            [
                "padded scores",
                "s - lse",
                "padded scores again",
                "causal scores",
                "window scores"
            ]
        );
        assert_eq!(
            order(Some(64), CUDNN_9_19),
            ["padded scores", "s - lse", "causal scores", "window scores"]
        );
    }
}
