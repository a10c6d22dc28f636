//! Fused attention: `attention.cu`'s forward, and its backward: `delta`, then (16-bit operands)
//! one pass over key blocks writing dq, dk and dv, its dQ counters zeroed first, or (F32) the
//! query gradient and the key and value gradients. Launch shapes, dynamic shared memory and
//! scratch come from `castor_kernels::attention`, as the emulator's contract reads them.

use super::super::program::{Arg, Command};
use super::super::sdpa::{self, Sdpa, SdpaGrads, SdpaPass, SdpaProblem, Tensor4};
use super::{sfx, window_arg, LowerError, RunLowering};
use castor_ir::{Accum, AttentionLibrary, DType, Node, Op, Value};
use castor_kernels::attention::{self as geometry, Kernel};

/// An attention op as the kernels see it: `bq` query batches of `t` rows and head dim `d`;
/// query batch `b` reads key/value batch `b / group` (`s` keys) and mask row
/// `b / mask_group`.
struct Problem {
    bq: usize,
    t: usize,
    s: usize,
    d: usize,
    group: usize,
    mask_group: usize,
    dtype: DType,
    /// The tensor-core tile (`None`: the F32 kernels).
    tile: Option<u32>,
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
    /// `mask`).
    fn attention_problem(
        &self,
        n: Node,
        y: Value,
        mask: Option<Value>,
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
        let mask_group = match mask {
            None => 1,
            Some(m) => {
                let md = dims(m);
                let keys_only = md.len() < 2 || md[md.len() - 2] == 1;
                if g.ty(m).dtype != DType::Bool || !keys_only || md.last() != Some(&s) {
                    return Err(self.err(
                        y,
                        "the attention kernels take a key-padding mask (bool [.., 1, S]); \
                         a mask per query row needs the unfused softmax",
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
        Ok(Problem {
            bq: qb.iter().product(),
            t,
            s,
            d,
            group,
            mask_group,
            dtype,
            tile,
        })
    }

    /// The entry point of `kernel` for the problem's variant.
    fn attention_launch(
        &mut self,
        y: Value,
        p: &Problem,
        kernel: Kernel,
        mut args: super::Args,
        (causal, window): (bool, Option<usize>),
        scale: f64,
    ) -> Result<(), LowerError> {
        let name = match kernel {
            Kernel::Forward => "fwd",
            Kernel::Backward => "bwd",
            Kernel::Dq => "bwd_dq",
            Kernel::DkDv => "bwd_dkdv",
        };
        let entry = match p.tile {
            Some(tile) => format!("attention_{name}_{}_d{tile}", sfx(p.dtype)),
            None => format!("attention_{name}_f32"),
        };
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
        let grid = geometry::grid(
            kernel,
            tensor_cores,
            p.bq as u32,
            p.group as u32,
            p.t as u32,
            p.s as u32,
        );
        let shared = p.tile.map_or(0, |tile| {
            geometry::shared_bytes(kernel, tile, p.dtype.size_bytes() as u32)
        });
        let block = (geometry::threads(kernel, tensor_cores), 1, 1);
        self.launch_shared(y, &entry, grid, block, shared, args)
    }

    fn mask_arg(&self, mask: Option<Value>) -> Result<Arg, LowerError> {
        Ok(match mask {
            Some(m) => Arg::Ptr(self.at(m)?),
            None => Arg::Null,
        })
    }

    /// `attention(q, k, v[, mask]) -> (o, lse)`.
    pub(super) fn attention(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let Op::Attention {
            causal,
            window,
            scale,
            library,
        } = node.op
        else {
            return Err(self.err(node.outputs[0], "not an attention node"));
        };
        let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
        let (o, lse) = (outs[0], outs[1]);
        let mask = ins.get(3).copied();
        let p = self.attention_problem(n, o, mask)?;
        if g.ty(o).dtype != p.dtype || g.ty(lse).dtype != DType::F32 {
            return Err(self.err(o, "attention writes o in q's dtype and lse in F32"));
        }
        let mark = self.commands.len();
        let args = vec![
            ("q", Arg::Ptr(self.at(ins[0])?)),
            ("k", Arg::Ptr(self.at(ins[1])?)),
            ("v", Arg::Ptr(self.at(ins[2])?)),
            ("mask", self.mask_arg(mask)?),
            ("o", Arg::Ptr(self.out(o)?)),
            ("lse", Arg::Ptr(self.out(lse)?)),
        ];
        self.attention_launch(o, &p, Kernel::Forward, args, (causal, window), scale)?;
        if !library.may_use_cudnn() {
            return Ok(());
        }
        let call = Sdpa {
            node: g.name(o).to_string(),
            pass: SdpaPass::Forward,
            problem: sdpa_problem(&p, mask.is_some(), causal, window, scale),
            q: Tensor4::dense(self.at(ins[0])?, p.bq, p.t, p.d),
            k: Tensor4::dense(self.at(ins[1])?, p.bq / p.group, p.s, p.d),
            v: Tensor4::dense(self.at(ins[2])?, p.bq / p.group, p.s, p.d),
            o: Tensor4::dense(self.at(o)?, p.bq, p.t, p.d),
            lse: self.at(lse)?,
            grads: None,
            mask: None,
            fallback: Vec::new(),
            unsupported: None,
        };
        self.cudnn_or_kernels(o, call, mark, library, mask)
    }

    /// Replaces the kernels lowered since `mark` by `call` run on cuDNN, those kernels its
    /// fallback under `library=auto`; where cuDNN cannot express the pass, the kernels run
    /// (auto, the reason in the listing) or the lowering fails naming it (cudnn). A key-padding
    /// `mask` is cast to the F32 keep flags cuDNN's graph reads, just before the call.
    fn cudnn_or_kernels(
        &mut self,
        y: Value,
        mut call: Sdpa,
        mark: usize,
        library: AttentionLibrary,
        mask: Option<Value>,
    ) -> Result<(), LowerError> {
        let p = call.problem;
        let (bq, group) = (p.batch * p.heads_q, p.heads_q / p.heads_kv.max(1));
        call.unsupported = sdpa::unsupported(
            p.dtype,
            (p.rows_q, p.rows_kv, p.head_dim),
            p.causal,
            (group, mask.is_some().then_some(p.heads_q)),
            call.pass,
        );
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
        if let (Some(m), None) = (mask, &call.unsupported) {
            let n = p.batch * p.rows_kv;
            let flags = self.scratch(n as u64 * 4);
            self.launch(
                y,
                "cast_bool_f32",
                super::grid_1d(n, 256),
                (256, 1, 1),
                vec![
                    ("x", Arg::Ptr(self.at(m)?)),
                    ("y", Arg::Ptr(flags)),
                    ("n", Arg::I64(n as i64)),
                ],
            )?;
            call.mask = Some(flags);
        }
        debug_assert_eq!(bq % p.batch.max(1), 0);
        self.commands.push(Command::Sdpa(Box::new(call)));
        Ok(())
    }

    /// `attention_grad(q, k, v, o, lse, do[, mask]) -> (dq, dk, dv)`: the row sums
    /// `delta = rowsum(do * o)`, then the gradients (one launch for 16-bit operands; the query
    /// gradient, then the key and value gradients, in F32).
    pub(super) fn attention_grad(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let Op::AttentionGrad {
            causal,
            window,
            scale,
            library,
        } = node.op
        else {
            return Err(self.err(node.outputs[0], "not an attention gradient node"));
        };
        let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
        let (dq, dk, dv) = (outs[0], outs[1], outs[2]);
        let mask = ins.get(6).copied();
        let p = self.attention_problem(n, dq, mask)?;
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
        let (o_at, do_at) = (self.at(ins[3])?, self.at(ins[5])?);
        self.launch_shared(
            dq,
            &format!("attention_bwd_delta_{}", sfx(p.dtype)),
            geometry::delta_grid(rows as u64),
            (geometry::THREADS, 1, 1),
            0,
            vec![
                ("o", Arg::Ptr(o_at)),
                ("d_o", Arg::Ptr(do_at)),
                ("delta", Arg::Ptr(delta)),
                ("rows", Arg::I64(rows as i64)),
                ("d", Arg::I32(p.d as i32)),
            ],
        )?;
        let common = vec![
            ("q", Arg::Ptr(self.at(ins[0])?)),
            ("k", Arg::Ptr(self.at(ins[1])?)),
            ("v", Arg::Ptr(self.at(ins[2])?)),
            ("mask", self.mask_arg(mask)?),
            ("d_o", Arg::Ptr(do_at)),
            ("lse", Arg::Ptr(self.at(ins[4])?)),
            ("delta", Arg::Ptr(delta)),
        ];
        match p.tile {
            Some(tile) => {
                // One pass over key blocks: dq summed in dq_acc across key blocks, in the
                // order the dq_ready counters (zeroed here) keep.
                let (bq, t) = (p.bq as u64, p.t as u64);
                let acc = self.scratch(geometry::dq_acc_elems(bq, t, tile) * 4);
                let ready_bytes = geometry::dq_ready_count(bq, t, tile) * 4;
                let ready = self.scratch(ready_bytes);
                self.commands.push(Command::Memset {
                    dst: ready,
                    bytes: ready_bytes,
                    byte: 0,
                });
                let mut args = common;
                args.extend([
                    ("dq", Arg::Ptr(self.out(dq)?)),
                    ("dk", Arg::Ptr(self.out(dk)?)),
                    ("dv", Arg::Ptr(self.out(dv)?)),
                    ("dq_acc", Arg::Ptr(acc)),
                    ("dq_ready", Arg::Ptr(ready)),
                ]);
                self.attention_launch(dq, &p, Kernel::Backward, args, (causal, window), scale)?;
            }
            None => {
                let mut args = common.clone();
                args.push(("dq", Arg::Ptr(self.out(dq)?)));
                self.attention_launch(dq, &p, Kernel::Dq, args, (causal, window), scale)?;
                let mut args = common;
                args.push(("dk", Arg::Ptr(self.out(dk)?)));
                args.push(("dv", Arg::Ptr(self.out(dv)?)));
                self.attention_launch(dk, &p, Kernel::DkDv, args, (causal, window), scale)?;
            }
        }
        if !library.may_use_cudnn() {
            return Ok(());
        }
        let (hq, hk) = (p.bq, p.bq / p.group);
        let call = Sdpa {
            node: g.name(dq).to_string(),
            pass: SdpaPass::Backward,
            problem: sdpa_problem(&p, mask.is_some(), causal, window, scale),
            q: Tensor4::dense(self.at(ins[0])?, hq, p.t, p.d),
            k: Tensor4::dense(self.at(ins[1])?, hk, p.s, p.d),
            v: Tensor4::dense(self.at(ins[2])?, hk, p.s, p.d),
            o: Tensor4::dense(o_at, hq, p.t, p.d),
            lse: self.at(ins[4])?,
            grads: Some(SdpaGrads {
                d_o: Tensor4::dense(do_at, hq, p.t, p.d),
                dq: Tensor4::dense(self.at(dq)?, hq, p.t, p.d),
                dk: Tensor4::dense(self.at(dk)?, hk, p.s, p.d),
                dv: Tensor4::dense(self.at(dv)?, hk, p.s, p.d),
                row_sums: delta,
            }),
            mask: None,
            fallback: Vec::new(),
            unsupported: None,
        };
        self.cudnn_or_kernels(dq, call, mark, library, mask)
    }
}

/// The attention problem as cuDNN sees it: castor's query batches split into the batches of
/// the key-padding mask's rows and the heads sharing each (one batch of all heads without a
/// mask). The dense `[bq, rows, d]` tensors are the same memory either way.
fn sdpa_problem(
    p: &Problem,
    masked: bool,
    causal: bool,
    window: Option<usize>,
    scale: f64,
) -> SdpaProblem {
    let per_batch = if masked { p.mask_group } else { p.bq };
    SdpaProblem {
        dtype: p.dtype,
        batch: p.bq / per_batch.max(1),
        heads_q: per_batch,
        heads_kv: per_batch / p.group.max(1),
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
