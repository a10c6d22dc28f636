//! Fused attention: `attention.cu`'s forward, and its backward: `delta`, then (16-bit operands)
//! one pass over key blocks writing dq, dk and dv, its dQ counters zeroed first, or (F32) the
//! query gradient and the key and value gradients; the mask operand (kept keys, or packed
//! sequences' positions) as the kernels' `mask` or `positions`. Launch shapes, dynamic shared
//! memory and scratch come from `geometry.rs`, as the emulator's contract reads them.

use crate::cuda::program::{Arg, Command, Place};
use crate::cuda::sdpa::{
    self, kv_lengths_offset, Sdpa, SdpaGrads, SdpaMask, SdpaPass, SdpaProblem, Tensor4,
};
use crate::cuda::lower::copies;
use crate::cuda::lower::views::{fits_i32, heads_of, kernel_strides};
use crate::cuda::lower::{window_arg, LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::philox::{dropout_scale, keep_threshold};
use castor_ir::{
    Accum, AttentionDropout, AttentionLibrary, DType, Graph, Node, NodeData, Op, Value,
};
use super::geometry::{self, Kernel};

/// An attention op as the kernels see it: `bq` query batches of `t` rows and head dim `d`;
/// query batch `b` reads key/value batch `b / group` (`s` keys) and mask (or positions) row
/// `b / mask_group`.
struct Problem {
    bq: usize,
    t: usize,
    s: usize,
    d: usize,
    group: usize,
    mask_group: usize,
    /// Whether the mask operand is packed sequences' positions (i64), not kept keys (bool).
    positions: bool,
    dtype: DType,
    /// The tensor-core tile (`None`: the F32 kernels).
    tile: Option<u32>,
    /// Whether the `_dropout` entry points run (their dropout arguments are in the launch's).
    dropout: bool,
    /// Query batches per outer batch: the kernels split query batch `b` as
    /// `(b / heads, b % heads)` to find it through an operand's strides (a multiple of
    /// `group`, so that key batches split the same way by `heads / group`).
    heads: usize,
}

/// An operand as the kernels reach it: its place, and where batch `(outer, head)` and its rows
/// are (in elements; `attention.cu`'s AttStrides).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Operand {
    at: Place,
    batch: i64,
    head: i64,
    row: i64,
}

impl Operand {
    /// The operand as cuDNN's `(batch, heads, rows, head dim)` tensor.
    fn tensor4(&self) -> Tensor4 {
        Tensor4 {
            place: self.at,
            strides: [self.batch, self.head, self.row, 1],
        }
    }

    /// The kernel arguments `X_batch`, `X_head`, `X_row` of operand `x`.
    fn strides(&self, x: &str) -> [(&'static str, Arg); 3] {
        let names: [&'static str; 3] = match x {
            "q" => ["q_batch", "q_head", "q_row"],
            "k" => ["k_batch", "k_head", "k_row"],
            "v" => ["v_batch", "v_head", "v_row"],
            "o" => ["o_batch", "o_head", "o_row"],
            "d_o" => ["d_o_batch", "d_o_head", "d_o_row"],
            "dq" => ["dq_batch", "dq_head", "dq_row"],
            "dk" => ["dk_batch", "dk_head", "dk_row"],
            "dv" => ["dv_batch", "dv_head", "dv_row"],
            other => unreachable!("`{other}` is not an attention operand"),
        };
        [
            (names[0], Arg::I32(self.batch as i32)),
            (names[1], Arg::I32(self.head as i32)),
            (names[2], Arg::I32(self.row as i32)),
        ]
    }
}

/// The query heads and kv group of tensor-core attention node `node` (`None` for another
/// node, F32 operands, or operands the kernels cannot index).
fn tensor_core_heads(g: &Graph, node: &NodeData) -> Option<(usize, usize)> {
    if !matches!(node.op, Op::Attention { .. } | Op::AttentionGrad { .. }) {
        return None;
    }
    let dims = |v: Value| g.ty(v).shape.dims().to_vec();
    let (q, k) = (node.inputs[0], node.inputs[1]);
    if !matches!(g.ty(q).dtype, DType::F16 | DType::BF16) {
        return None;
    }
    let (qd, kd) = (dims(q), dims(k));
    if qd.len() < 2 || kd.len() < 2 {
        return None;
    }
    let qb = &qd[..qd.len() - 2];
    let group = sharing(qb, &kd[..kd.len() - 2])?;
    Some((heads_of(qb, group), group))
}

/// Whether attention node `node` writes its output `x` (the context; the query, key or value
/// gradient) through `view` of another buffer: the tensor-core kernels, a view they reach
/// by strides that gives every element its own address.
pub(crate) fn writes_in_place(g: &Graph, node: &NodeData, x: Value, view: &copies::View) -> bool {
    let Some((heads, group)) = tensor_core_heads(g, node) else {
        return false;
    };
    let side = match (&node.op, node.outputs.iter().position(|&o| o == x)) {
        (Op::Attention { .. }, Some(0)) | (Op::AttentionGrad { .. }, Some(0)) => heads,
        (Op::AttentionGrad { .. }, Some(1 | 2)) => heads / group,
        _ => return false,
    };
    kernel_strides(view, side, true).is_some()
}

/// Whether attention node `node` reads operand `x` (whose elements are `view` of another
/// buffer) in place, through strides: the tensor-core kernels' operands q, k, v, and for the
/// backward o and do.
pub(crate) fn reads_in_place(g: &Graph, node: &NodeData, x: Value, view: &copies::View) -> bool {
    let Some((heads, group)) = tensor_core_heads(g, node) else {
        return false;
    };
    let grad = matches!(node.op, Op::AttentionGrad { .. });
    let query_side = if grad { [0, 3, 5] } else { [0, 0, 0] };
    node.inputs.iter().enumerate().all(|(i, &input)| {
        if input != x {
            return true;
        }
        let side = if query_side.contains(&i) {
            heads
        } else if i == 1 || i == 2 {
            heads / group
        } else {
            return false;
        };
        kernel_strides(view, side, false).is_some()
    })
}

/// How many consecutive query batches share one batch of an operand whose batch dims are
/// `other` (right-aligned against the query's `qb`): `other` must equal `qb` up to some dim and
/// be 1 after it (grouped-query heads, or a mask per sequence shared by its heads).
fn sharing(qb: &[usize], other: &[usize]) -> Option<usize> {
    if other.len() > qb.len() {
        return None;
    }
    let mut o = vec![1; qb.len() - other.len()];
    o.extend_from_slice(other);
    let j = o.iter().rposition(|&x| x != 1).map_or(0, |p| p + 1);
    (o[..j] == qb[..j]).then(|| qb[j..].iter().product())
}

impl RunLowering<'_, '_> {
    /// The kernels' view of attention node `n` (operands `q, k, v` at `ins[..3]`, the mask at
    /// `mask`: kept keys, or with `causal` packed sequences' positions).
    fn attention_problem(
        &self,
        n: Node,
        y: Value,
        mask: Option<Value>,
        causal: bool,
    ) -> Result<Problem, LowerError> {
        let g = self.g;
        let node = g.node(n);
        let (q, k, v) = (node.inputs[0], node.inputs[1], node.inputs[2]);
        let dims = |x: Value| g.ty(x).shape.dims().to_vec();
        let (qd, kd, vd) = (dims(q), dims(k), dims(v));
        let dtype = g.ty(q).dtype;
        if g.ty(k).dtype != dtype || g.ty(v).dtype != dtype || !dtype.is_float() {
            return Err(self.err(
                y,
                "the attention kernels take q, k and v in one float dtype",
            ));
        }
        if node.acc == Some(Accum::Tf32) {
            return Err(self.err(
                y,
                "the attention kernels have no TF32 form (F32 attention is exact F32; compile \
                 the attention in F32 or in a 16-bit dtype)",
            ));
        }
        let (r, rk) = (qd.len(), kd.len());
        let (t, d, s) = (qd[r - 2], qd[r - 1], kd[rk - 2]);
        if vd[vd.len() - 1] != d || vd[vd.len() - 2] != s || kd[rk - 1] != d {
            return Err(self.err(
                y,
                "the attention kernels need k and v of q's head dim and as many keys as values",
            ));
        }
        let qb = &qd[..r - 2];
        let group = sharing(qb, &kd[..rk - 2])
            .filter(|_| kd[..rk - 2] == vd[..vd.len() - 2])
            .ok_or_else(|| {
                self.err(
                    y,
                    "k and v broadcast over q's batch dims in a way the attention kernels cannot \
                     index (they share a key batch among consecutive query batches)",
                )
            })?;
        let positions = mask.is_some_and(|m| g.ty(m).dtype == DType::I64);
        if positions && !causal {
            return Err(self.err(
                y,
                "attention positions (an i64 mask) need the causal mask",
            ));
        }
        let mask_group = match mask {
            None => 1,
            Some(m) => {
                let md = dims(m);
                let keys_only = md.len() < 2 || md[md.len() - 2] == 1;
                let dtype = g.ty(m).dtype;
                if !matches!(dtype, DType::Bool | DType::I64)
                    || !keys_only
                    || md.last() != Some(&s)
                {
                    return Err(self.err(
                        y,
                        "the attention kernels take a key-padding mask (bool [.., 1, S]) or \
                         packed sequences' positions (i64 [.., 1, S]); a mask per query row \
                         needs the unfused softmax",
                    ));
                }
                let batch = &md[..md.len().saturating_sub(2)];
                sharing(qb, batch).ok_or_else(|| {
                    self.err(
                        y,
                        "the mask broadcasts over q's batch dims in a way the kernels cannot index",
                    )
                })?
            }
        };
        let tile = match dtype {
            DType::F32 if d <= geometry::F32_MAX_HEAD_DIM => None,
            DType::F32 => {
                return Err(self.err(
                    y,
                    format!(
                        "head dim {d}: the F32 attention kernel takes at most {}",
                        geometry::F32_MAX_HEAD_DIM
                    ),
                ))
            }
            _ => Some(geometry::tile(d).ok_or_else(|| {
                self.err(
                    y,
                    format!("head dim {d}: the tensor-core attention kernels take at most 128"),
                )
            })?),
        };
        let bq: usize = qb.iter().product();
        let heads = heads_of(qb, group);
        Ok(Problem {
            bq,
            t,
            s,
            d,
            group,
            mask_group,
            positions,
            dtype,
            tile,
            dropout: false,
            heads,
        })
    }

    /// A launch of `kernel` for the problem's variant.
    fn attention_launch(
        &mut self,
        y: Value,
        p: &Problem,
        kernel: Kernel,
        mut args: crate::cuda::lower::Args,
        (causal, window, scale): (bool, Option<usize>, f64),
        strides: &[(&str, Operand)],
    ) -> Result<(), LowerError> {
        let id = KernelId::Attention(super::Kernel::Attention {
            kernel,
            dtype: p.dtype,
            tile: p.tile,
            packed: p.positions && p.tile.is_some(),
            dropout: p.dropout,
        });
        let per_key_batch = matches!(kernel, Kernel::Backward | Kernel::DkDv);
        let batches = if per_key_batch { p.bq / p.group } else { p.bq };
        let batches_name = if per_key_batch { "bkv" } else { "bq" };
        args.extend([
            (batches_name, Arg::I64(batches as i64)),
            ("t", Arg::I32(p.t as i32)),
            ("s", Arg::I32(p.s as i32)),
            ("d", Arg::I32(p.d as i32)),
            ("group", Arg::I32(p.group as i32)),
            ("mask_group", Arg::I32(p.mask_group as i32)),
            ("causal", Arg::I32(i32::from(causal))),
            ("window", Arg::I32(window_arg(window))),
            ("scale", Arg::F64(scale)),
        ]);
        let tensor_cores = p.tile.is_some();
        if tensor_cores {
            for (x, operand) in strides {
                if ![operand.batch, operand.head, operand.row]
                    .into_iter()
                    .all(fits_i32)
                {
                    return Err(self.err(
                        y,
                        format!("`{x}` is too large for the attention kernels' 32-bit strides"),
                    ));
                }
                args.extend(operand.strides(x));
            }
        }
        let grid = geometry::grid(
            kernel,
            p.tile,
            p.bq as u32,
            (p.heads as u32, p.group as u32),
            (p.t as u32, p.s as u32),
            geometry::banded(causal, window.unwrap_or(0)),
        );
        let shared = p.tile.map_or(0, |tile| {
            geometry::shared_bytes(kernel, tile, p.dtype.size_bytes() as u32)
        });
        let block = (geometry::threads(kernel, tensor_cores), 1, 1);
        self.launch_shared(y, id, grid, block, shared, args)
    }

    /// Attention operand `x` (batches split by `heads`): its own buffer, or read in place.
    fn attention_operand(&self, x: Value, heads: usize) -> Result<Operand, LowerError> {
        let (at, [batch, head, row]) = self.strided_read(x, heads)?;
        Ok(Operand {
            at,
            batch,
            head,
            row,
        })
    }

    /// Attention output `x`: its own buffer, or written in place.
    fn attention_output(&mut self, x: Value, heads: usize) -> Result<Operand, LowerError> {
        let (at, [batch, head, row]) = self.strided_write(x, heads)?;
        Ok(Operand {
            at,
            batch,
            head,
            row,
        })
    }

    /// q, k and v (operands 0 to 2 of `ins`).
    fn attention_inputs(
        &self,
        p: &Problem,
        ins: &[Value],
    ) -> Result<(Operand, Operand, Operand), LowerError> {
        let kv_heads = p.heads / p.group;
        Ok((
            self.attention_operand(ins[0], p.heads)?,
            self.attention_operand(ins[1], kv_heads)?,
            self.attention_operand(ins[2], kv_heads)?,
        ))
    }

    /// The kernels' `mask` and `positions` arguments: the mask operand as one of them (the
    /// other null), or both null.
    fn mask_args(
        &self,
        p: &Problem,
        mask: Option<Value>,
    ) -> Result<[(&'static str, Arg); 2], LowerError> {
        let at = match mask {
            Some(m) => Arg::Ptr(self.at(m)?),
            None => Arg::Null,
        };
        Ok(if p.positions {
            [("mask", Arg::Null), ("positions", at)]
        } else {
            [("mask", at), ("positions", Arg::Null)]
        })
    }

    /// The `_dropout` entry points' arguments (none without dropout): the key's place, the
    /// stream, the keep threshold and the F32 `1 / (1 - p)`, as a dropout node's launch.
    fn dropout_args(
        &self,
        key: Option<Value>,
        dropout: Option<AttentionDropout>,
    ) -> Result<Vec<(&'static str, Arg)>, LowerError> {
        let (Some(key), Some(d)) = (key, dropout) else {
            return Ok(Vec::new());
        };
        Ok(vec![
            ("dropout_key", Arg::Ptr(self.at(key)?)),
            ("stream", Arg::U32(d.stream as u32)),
            ("threshold", Arg::U64(keep_threshold(d.p))),
            ("keep_scale", Arg::F64(f64::from(dropout_scale(d.p)))),
        ])
    }

    /// The mask operand as cuDNN's call would take it.
    fn sdpa_mask(p: &Problem, mask: Option<Value>) -> Option<(Value, SdpaMask)> {
        mask.map(|m| {
            let kind = if p.positions {
                SdpaMask::Positions
            } else {
                SdpaMask::KeyPadding {
                    group: p.mask_group,
                }
            };
            (m, kind)
        })
    }

    /// `attention(q, k, v[, mask]) -> (o, lse)`.
    pub(crate) fn attention(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let Op::Attention {
            causal,
            window,
            scale,
            library,
            dropout,
        } = node.op
        else {
            return Err(self.err(node.outputs[0], "not an attention node"));
        };
        let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
        let (o, lse) = (outs[0], outs[1]);
        let (mask, key) = optional_operands(&node.op, &ins);
        let mut p = self.attention_problem(n, o, mask, causal)?;
        p.dropout = dropout.is_some();
        if g.ty(o).dtype != p.dtype || g.ty(lse).dtype != DType::F32 {
            return Err(self.err(o, "attention writes o in q's dtype and lse in F32"));
        }
        let mark = self.commands.len();
        let (qo, ko, vo) = self.attention_inputs(&p, &ins)?;
        let oo = self.attention_output(o, p.heads)?;
        let mut args = vec![
            ("q", Arg::Ptr(qo.at)),
            ("k", Arg::Ptr(ko.at)),
            ("v", Arg::Ptr(vo.at)),
        ];
        args.extend(self.mask_args(&p, mask)?);
        args.extend([("o", Arg::Ptr(oo.at)), ("lse", Arg::Ptr(self.out(lse)?))]);
        args.extend(self.dropout_args(key, dropout)?);
        let strides = [("q", qo), ("k", ko), ("v", vo), ("o", oo)];
        let attrs = (causal, window, scale);
        self.attention_launch(o, &p, Kernel::Forward, args, attrs, &strides)?;
        if !library.may_use_cudnn() {
            return Ok(());
        }
        let call = Sdpa {
            node: g.name(o).to_string(),
            pass: SdpaPass::Forward,
            problem: sdpa_problem(&p, mask.is_some() && !p.positions, causal, window, scale),
            q: qo.tensor4(),
            k: ko.tensor4(),
            v: vo.tensor4(),
            o: oo.tensor4(),
            lse: self.at(lse)?,
            grads: None,
            lengths: None,
            prelude: Vec::new(),
            fallback: Vec::new(),
            unsupported: None,
        };
        self.cudnn_or_kernels(o, call, mark, (library, p.dropout), Self::sdpa_mask(&p, mask))
    }

    /// Replaces the kernels lowered since `mark` by `call` run on cuDNN, those kernels its
    /// fallback under `library=auto`; where cuDNN cannot express the pass, the kernels run
    /// (auto, the reason in the listing) or the lowering fails naming it (cudnn). A key-padding
    /// `mask` becomes the sequence lengths cuDNN's graph reads, by the call's prelude. An op
    /// with `dropout` is castor's kernels' alone: cuDNN's dropout draws its own mask, not the
    /// Philox mask every other executor draws.
    fn cudnn_or_kernels(
        &mut self,
        y: Value,
        mut call: Sdpa,
        mark: usize,
        (library, dropout): (AttentionLibrary, bool),
        mask: Option<(Value, SdpaMask)>,
    ) -> Result<(), LowerError> {
        let p = call.problem;
        let windows = sdpa::env_switch(sdpa::WINDOWS_ENV).map_err(|e| self.err(y, e))?;
        call.unsupported = if dropout {
            Some(
                "dropout on the probabilities (cuDNN's dropout draws its own mask, not castor's \
                 Philox mask, which the CPU executor and the emulator draw)"
                    .into(),
            )
        } else {
            sdpa::unsupported(
                p.dtype,
                (p.rows_q, p.rows_kv, p.head_dim),
                (p.causal, p.window, windows),
                (p.heads_q, mask.map(|(_, kind)| kind)),
                call.pass,
            )
        };
        let padded = matches!(mask, Some((_, SdpaMask::KeyPadding { .. })));
        let zeroes_padded_keys = padded && call.pass == SdpaPass::Backward;
        if zeroes_padded_keys && !call.padded_key_rows_zeroable() && call.unsupported.is_none() {
            call.unsupported = Some(
                "a padded backward whose key or value gradient is written over an operand it \
                 reads (cuDNN leaves the padded keys' rows unwritten, and zeroing them first \
                 would overwrite that operand)"
                    .into(),
            );
        }
        if call.pass == SdpaPass::Backward && call.unsupported.is_none() {
            // cuDNN's backward plans need a score matrix per head of workspace: the program
            // sets it aside, so that they run rather than castor's kernels.
            if let Some(bytes) = sdpa::backward_workspace(&p) {
                let program = &mut self.l.program;
                program.workspace_bytes = program.workspace_bytes.max(bytes);
            }
        }
        if library == AttentionLibrary::Cudnn {
            if let Some(why) = &call.unsupported {
                return Err(self.err(
                    y,
                    format!(
                        "--attention cudnn: cuDNN's fused attention cannot run this op: {why} \
                         (--attention auto runs castor's kernels where cuDNN cannot)"
                    ),
                ));
            }
            self.commands.truncate(mark);
        } else {
            call.fallback = self.commands.split_off(mark);
        }
        if let (Some((m, SdpaMask::KeyPadding { .. })), None) = (mask, &call.unsupported) {
            // cuDNN's sequence lengths from the mask's flags, computed only where cuDNN runs
            // the pass (castor's kernels read the flags themselves and take any mask).
            let kv_offset = kv_lengths_offset(p.batch);
            let lengths = self.scratch(kv_offset + 4 * p.batch as u64);
            let flags = self.at(m)?;
            let bad = self.padding_flag(y, flags, p.rows_kv);
            let prelude = self.commands.len();
            let mut args = vec![
                ("flags", Arg::Ptr(flags)),
                ("rows", Arg::I32(p.batch as i32)),
                ("keys", Arg::I32(p.rows_kv as i32)),
                ("rows_q", Arg::I32(p.rows_q as i32)),
                ("lengths", Arg::Ptr(lengths)),
                ("kv_offset", Arg::I32(kv_offset as i32 / 4)),
                ("bad", Arg::Ptr(bad)),
            ];
            args.extend(padded_key_rows_args(&call, zeroes_padded_keys));
            self.launch(
                y,
                KernelId::Attention(super::Kernel::KeyLengths),
                (p.batch as u32, 1, 1),
                (256, 1, 1),
                args,
            )?;
            call.prelude = self.commands.split_off(prelude);
            call.lengths = Some(lengths);
        }
        self.commands.push(Command::Sdpa(Box::new(call)));
        Ok(())
    }

    /// `attention_grad(q, k, v, o, lse, do[, mask]) -> (dq, dk, dv)`: the row sums
    /// `delta = rowsum(do * o)`, then the gradients (one launch for 16-bit operands; the query
    /// gradient, then the key and value gradients, in F32).
    pub(crate) fn attention_grad(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let Op::AttentionGrad {
            causal,
            window,
            scale,
            library,
            dropout,
        } = node.op
        else {
            return Err(self.err(node.outputs[0], "not an attention gradient node"));
        };
        let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
        let (dq, dk, dv) = (outs[0], outs[1], outs[2]);
        let (mask, key) = optional_operands(&node.op, &ins);
        let mut p = self.attention_problem(n, dq, mask, causal)?;
        p.dropout = dropout.is_some();
        let same = |v: Value| g.ty(v).dtype == p.dtype;
        if !(same(ins[3]) && same(ins[5]) && same(dq) && same(dk) && same(dv))
            || g.ty(ins[4]).dtype != DType::F32
        {
            return Err(self.err(
                dq,
                "the attention backward takes o, do and writes dq, dk, dv in q's dtype, lse in F32",
            ));
        }
        let rows = p.bq * p.t;
        let mark = self.commands.len();
        // delta for the kernels; the same F32 rows for cuDNN's row sums.
        let delta = self.scratch(rows as u64 * 4);
        let (qo, ko, vo) = self.attention_inputs(&p, &ins)?;
        let oo = self.attention_operand(ins[3], p.heads)?;
        let doo = self.attention_operand(ins[5], p.heads)?;
        let mut delta_args = vec![
            ("o", Arg::Ptr(oo.at)),
            ("d_o", Arg::Ptr(doo.at)),
            ("delta", Arg::Ptr(delta)),
            ("rows", Arg::I64(rows as i64)),
            ("t", Arg::I32(p.t as i32)),
            ("d", Arg::I32(p.d as i32)),
            ("heads", Arg::I32(p.heads as i32)),
        ];
        delta_args.extend(oo.strides("o"));
        delta_args.extend(doo.strides("d_o"));
        self.launch_shared(
            dq,
            KernelId::Attention(super::Kernel::Delta { dtype: p.dtype }),
            geometry::delta_grid(rows as u64, p.d as u32),
            (geometry::THREADS, 1, 1),
            0,
            delta_args,
        )?;
        let kv_heads = p.heads / p.group;
        let dqo = self.attention_output(dq, p.heads)?;
        let dko = self.attention_output(dk, kv_heads)?;
        let dvo = self.attention_output(dv, kv_heads)?;
        let mut common = vec![
            ("q", Arg::Ptr(qo.at)),
            ("k", Arg::Ptr(ko.at)),
            ("v", Arg::Ptr(vo.at)),
        ];
        common.extend(self.mask_args(&p, mask)?);
        common.extend([
            ("d_o", Arg::Ptr(doo.at)),
            ("lse", Arg::Ptr(self.at(ins[4])?)),
            ("delta", Arg::Ptr(delta)),
        ]);
        common.extend(self.dropout_args(key, dropout)?);
        let strides = [
            ("q", qo),
            ("k", ko),
            ("v", vo),
            ("d_o", doo),
            ("dq", dqo),
            ("dk", dko),
            ("dv", dvo),
        ];
        // The kernel's F32 dq accumulator, which cuDNN's accumulating graph may use in its
        // place (the kernels and cuDNN never both run the pass).
        let mut kernel_acc = None;
        match p.tile {
            Some(tile) => {
                // One pass over key blocks: dq summed in dq_acc across key blocks, in the
                // order the dq_ready counters (zeroed here) keep.
                let scratch = geometry::backward_scratch(
                    tile,
                    (p.bq as u64, p.group as u64),
                    (p.t as u64, p.s as u64),
                    geometry::banded(causal, window.unwrap_or(0)),
                );
                let acc = self.scratch(scratch.acc_elems * 4);
                kernel_acc = Some(acc);
                let ready_bytes = scratch.ready_count * 4;
                let ready = self.scratch(ready_bytes);
                self.commands.push(Command::Memset {
                    dst: ready,
                    bytes: ready_bytes,
                    byte: 0,
                });
                let mut args = common;
                args.extend([
                    ("dq", Arg::Ptr(dqo.at)),
                    ("dk", Arg::Ptr(dko.at)),
                    ("dv", Arg::Ptr(dvo.at)),
                    ("dq_acc", Arg::Ptr(acc)),
                    ("dq_ready", Arg::Ptr(ready)),
                ]);
                let attrs = (causal, window, scale);
                self.attention_launch(dq, &p, Kernel::Backward, args, attrs, &strides)?;
            }
            None => {
                let attrs = (causal, window, scale);
                let mut args = common.clone();
                args.push(("dq", Arg::Ptr(dqo.at)));
                self.attention_launch(dq, &p, Kernel::Dq, args, attrs, &[])?;
                let mut args = common;
                args.push(("dk", Arg::Ptr(dko.at)));
                args.push(("dv", Arg::Ptr(dvo.at)));
                self.attention_launch(dk, &p, Kernel::DkDv, args, attrs, &[])?;
            }
        }
        if !library.may_use_cudnn() {
            return Ok(());
        }
        // cuDNN's dense [bq, t, d] F32 accumulator fits in the kernel's [bq, t, P], P >= d.
        let dq_accum = match kernel_acc {
            Some(acc) => acc,
            None => self.scratch(rows as u64 * p.d as u64 * 4),
        };
        let call = Sdpa {
            node: g.name(dq).to_string(),
            pass: SdpaPass::Backward,
            problem: sdpa_problem(&p, mask.is_some() && !p.positions, causal, window, scale),
            q: qo.tensor4(),
            k: ko.tensor4(),
            v: vo.tensor4(),
            o: oo.tensor4(),
            lse: self.at(ins[4])?,
            grads: Some(SdpaGrads {
                d_o: doo.tensor4(),
                dq: dqo.tensor4(),
                dk: dko.tensor4(),
                dv: dvo.tensor4(),
                row_sums: delta,
                dq_accum,
            }),
            lengths: None,
            prelude: Vec::new(),
            fallback: Vec::new(),
            unsupported: None,
        };
        self.cudnn_or_kernels(dq, call, mark, (library, p.dropout), Self::sdpa_mask(&p, mask))
    }
}

/// The key-lengths kernel's arguments that zero a padded backward's dK and dV rows past each
/// batch's length (cuDNN writes no gradient there): the two gradients with their strides, or
/// null pointers and zeros where the kernel only computes lengths (a forward).
fn padded_key_rows_args(call: &Sdpa, zero: bool) -> Vec<(&'static str, Arg)> {
    let (dk, dv, heads, dim, sk, sv) = match call.grads.as_ref().filter(|_| zero) {
        Some(g) => (
            Arg::Ptr(g.dk.place),
            Arg::Ptr(g.dv.place),
            call.problem.heads_kv as i32,
            call.problem.head_dim as i32,
            g.dk.strides,
            g.dv.strides,
        ),
        None => (Arg::Null, Arg::Null, 0, 0, [0; 4], [0; 4]),
    };
    vec![
        ("dk", dk),
        ("dv", dv),
        ("heads", Arg::I32(heads)),
        ("dim", Arg::I32(dim)),
        ("dk_batch", Arg::I32(sk[0] as i32)),
        ("dk_head", Arg::I32(sk[1] as i32)),
        ("dk_row", Arg::I32(sk[2] as i32)),
        ("dv_batch", Arg::I32(sv[0] as i32)),
        ("dv_head", Arg::I32(sv[1] as i32)),
        ("dv_row", Arg::I32(sv[2] as i32)),
    ]
}

/// The mask (or positions) and the dropout key of attention node `op` with operands `ins`.
fn optional_operands(op: &Op, ins: &[Value]) -> (Option<Value>, Option<Value>) {
    let at = op.attention_operands(ins.len());
    let pick = |i: Option<usize>| i.and_then(|i| ins.get(i).copied());
    (
        pick(at.and_then(|a| a.mask)),
        pick(at.and_then(|a| a.key)),
    )
}

/// The attention problem as cuDNN sees it: castor's query batches split as the kernels split
/// them, `heads` to a batch, so that every operand's strides carry over ([`Operand::tensor4`]).
fn sdpa_problem(
    p: &Problem,
    masked: bool,
    causal: bool,
    window: Option<usize>,
    scale: f64,
) -> SdpaProblem {
    SdpaProblem {
        dtype: p.dtype,
        batch: p.bq / p.heads.max(1),
        heads_q: p.heads,
        heads_kv: p.heads / p.group.max(1),
        rows_q: p.t,
        rows_kv: p.s,
        head_dim: p.d,
        causal,
        window,
        masked,
        scale_bits: scale.to_bits(),
    }
}

#[cfg(test)]
mod tests {
    use super::sharing;

    #[test]
    fn query_batches_share_key_batches_only_in_runs() {
        // [B, H] against [B, H]: no sharing; [B, Hkv, G] against [B, Hkv, 1]: groups of G.
        assert_eq!(sharing(&[2, 4], &[2, 4]), Some(1));
        assert_eq!(sharing(&[2, 2, 3], &[2, 2, 1]), Some(3));
        // A mask per sequence, [B, 1, 1] against [B, H, ..]: groups of H.
        assert_eq!(sharing(&[2, 4], &[2, 1]), Some(4));
        assert_eq!(sharing(&[2, 4], &[]), Some(8));
        // One key batch per head, shared across sequences: not consecutive.
        assert_eq!(sharing(&[2, 4], &[1, 4]), None);
        assert_eq!(sharing(&[2, 4], &[3, 4]), None);
    }
}
