//! The commands of each non-pointwise op: which kernel of `kernels/*.cu`, its launch shape and
//! its arguments, in the order and meaning each kernel file's header comment gives.

use super::super::program::{Arg, Command, Place, SlotKind};
use super::{copies, gemm, grid_1d, grid_rows, io, sfx, window_arg, LowerError, RunLowering};
use castor_ir::{Accum, DType, Node, Op, ReduceOp, RopeScaling, Value};

/// Threads per block of the row kernels (norms, softmax, cross-entropy, embeddings).
pub(super) const ROW_BLOCK: u32 = 256;
/// Threads per block of the elementwise and copy kernels.
pub(super) const BLOCK: u32 = 256;

impl RunLowering<'_, '_> {
    pub(super) fn node(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let outs = node.outputs.clone();
        let Some(&y) = outs.first() else {
            return Ok(());
        };
        let dt = |v: Value| g.ty(v).dtype;
        let dims = |v: Value| g.ty(v).shape.dims().to_vec();
        let numel = |v: Value| g.ty(v).shape.numel().unwrap_or(0);
        match &node.op {
            Op::Input | Op::Param | Op::State | Op::ParamCopy { .. } => {}
            Op::Attention { .. } => self.attention(n)?,
            Op::AttentionGrad { .. } => self.attention_grad(n)?,
            Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Split { .. }
            | Op::BroadcastTo { .. } => {
                for &o in &outs {
                    self.layout_result(o, ins[0])?;
                }
            }
            Op::MatMul {
                transpose_a,
                transpose_b,
            } => {
                let (a, b) = (self.at(ins[0])?, self.at(ins[1])?);
                let c = self.out(y)?;
                let gm = gemm::matmul(
                    g.name(y),
                    (a, &g.ty(ins[0]).shape, dt(ins[0])),
                    (b, &g.ty(ins[1]).shape, dt(ins[1])),
                    (c, dt(y)),
                    *transpose_a,
                    *transpose_b,
                    node.acc == Some(Accum::Tf32),
                )
                .map_err(|m| self.err(y, m))?;
                self.commands.extend(gm.into_iter().map(Command::Gemm));
            }
            Op::Embedding { .. } => {
                let (table, ids) = (ins[0], ins[1]);
                if dt(ids) != DType::I64 {
                    return Err(self.err(y, "token ids must be i64 on the CUDA executor"));
                }
                if dt(table) != dt(y) {
                    return Err(self.err(y, "an embedding gathers rows in the table's dtype"));
                }
                let d = dims(table);
                let (v, h) = (d[0], d[1]);
                let rows = numel(ids);
                let (tp, ip) = (self.at(table)?, self.at(ids)?);
                let out = self.out(y)?;
                let bad = self.flag(y, "token id", ip, v, None);
                self.launch(
                    y,
                    &format!("embedding_fwd_{}", sfx(dt(y))),
                    grid_rows(rows),
                    (128, 1, 1),
                    vec![
                        ("table", Arg::Ptr(tp)),
                        ("ids", Arg::Ptr(ip)),
                        ("out", Arg::Ptr(out)),
                        ("n", Arg::I64(rows as i64)),
                        ("v", Arg::I64(v as i64)),
                        ("h", Arg::I32(h as i32)),
                        ("bad", Arg::Ptr(bad)),
                    ],
                )?;
            }
            Op::EmbeddingGrad { vocab, padding } => {
                self.embedding_grad(y, ins[0], ins[1], *vocab, *padding)?
            }
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => self.norm_unit(n, None)?,
            Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. } => self.norm_grad_unit(n, None)?,
            Op::Softmax { causal, window } => self.softmax(y, &ins, *causal, *window)?,
            Op::SoftmaxGrad => {
                let (yv, dy) = (ins[0], ins[1]);
                let n = g.ty(yv).shape.last();
                let rows = numel(yv) / n.max(1);
                let (yp, dyp) = (self.at(yv)?, self.at(dy)?);
                let dx = self.out(y)?;
                self.launch(
                    y,
                    &format!("softmax_bwd_{}", io(dt(y), dt(yv))),
                    grid_rows(rows),
                    (row_threads(n, ROW_BLOCK), 1, 1),
                    vec![
                        ("y", Arg::Ptr(yp)),
                        ("dy", Arg::Ptr(dyp)),
                        ("dx", Arg::Ptr(dx)),
                        ("rows", Arg::I64(rows as i64)),
                        ("n", Arg::I32(n as i32)),
                    ],
                )?;
            }
            Op::Rope { theta, scaling } | Op::RopeGrad { theta, scaling } => {
                let backward = matches!(node.op, Op::RopeGrad { .. });
                let d = dims(ins[0]);
                if d.len() < 2 || d[d.len() - 1] % 2 != 0 {
                    return Err(self.err(y, "rope needs [.., T, D] with D even"));
                }
                let (t, hd) = (d[d.len() - 2], d[d.len() - 1]);
                let rows = numel(ins[0]) / hd.max(1);
                let table = self.rope_table(t, hd, *theta, *scaling)?;
                let (x, out) = (self.at(ins[0])?, self.out(y)?);
                // The kernels name their operand and result by direction.
                let (dir, input, output) = if backward {
                    ("bwd", "dy", "dx")
                } else {
                    ("fwd", "x", "y")
                };
                self.launch(
                    y,
                    &format!("rope_{dir}_{}", sfx(dt(y))),
                    grid_1d(rows * hd / 2, BLOCK),
                    (BLOCK, 1, 1),
                    vec![
                        (input, Arg::Ptr(x)),
                        (output, Arg::Ptr(out)),
                        ("cs", Arg::Ptr(table)),
                        ("rows", Arg::I64(rows as i64)),
                        ("t", Arg::I32(t as i32)),
                        ("d", Arg::I32(hd as i32)),
                    ],
                )?;
            }
            Op::Concat { axis } => {
                let out_dims = dims(y);
                let dst = self.out(y)?;
                let mut start = 0;
                for &x in &ins {
                    let (root, view) = self.source(x);
                    let l = view
                        .place_into(&out_dims, *axis, start)
                        .map_err(|m| self.err(y, m))?;
                    start += dims(x)[*axis];
                    let src = self.at(root)?;
                    self.copy(y, src, dst, l)?;
                }
            }
            Op::Pad {
                axis,
                before,
                after,
            } => {
                let bytes = super::bytes_of(g.ty(y), g.name(y))?;
                let dst = self.out(y)?;
                // Zeros only where the copy below does not write.
                if before + after > 0 {
                    self.commands.push(Command::Memset {
                        dst,
                        bytes,
                        byte: 0,
                    });
                }
                let (root, view) = self.source(ins[0]);
                let l = view
                    .place_into(&dims(y), *axis, *before)
                    .map_err(|m| self.err(y, m))?;
                let src = self.at(root)?;
                self.copy(y, src, dst, l)?;
            }
            Op::Reduce { op, axes, .. } => self.reduce(y, ins[0], *op, axes)?,
            Op::Cast { to } => {
                // Float-to-float casts are pointwise kernels; these involve ints or bools.
                let from = dt(ins[0]);
                let n = numel(y);
                let (x, out) = (self.at(ins[0])?, self.out(y)?);
                if from == *to {
                    let bytes = super::bytes_of(g.ty(y), g.name(y))?;
                    self.commands.push(Command::Copy {
                        dst: out,
                        src: x,
                        bytes,
                    });
                } else {
                    self.launch(
                        y,
                        &format!("cast_{}_{}", sfx(from), sfx(*to)),
                        grid_1d(n, BLOCK),
                        (BLOCK, 1, 1),
                        vec![
                            ("x", Arg::Ptr(x)),
                            ("y", Arg::Ptr(out)),
                            ("n", Arg::I64(n as i64)),
                        ],
                    )?;
                }
            }
            Op::Full { value, dtype, .. } => {
                let n = numel(y);
                let (entry, bits) = match dtype {
                    DType::F32 => ("fill_b4", Arg::U32((*value as f32).to_bits())),
                    DType::F16 => ("fill_b2", Arg::U16(half::f16::from_f64(*value).to_bits())),
                    DType::BF16 => ("fill_b2", Arg::U16(half::bf16::from_f64(*value).to_bits())),
                    DType::I64 => ("fill_b8", Arg::U64(*value as i64 as u64)),
                    DType::I32 => ("fill_b4", Arg::U32(*value as i32 as u32)),
                    DType::Bool => ("fill_b1", Arg::U32(u32::from(*value != 0.0))),
                };
                let out = self.out(y)?;
                self.launch(
                    y,
                    entry,
                    grid_1d(n, BLOCK),
                    (BLOCK, 1, 1),
                    vec![
                        ("dst", Arg::Ptr(out)),
                        ("n", Arg::I64(n as i64)),
                        ("value", bits),
                    ],
                )?;
            }
            Op::CrossEntropy { ignore_index } => {
                self.cross_entropy(y, ins[0], ins[1], *ignore_index)?
            }
            Op::CrossEntropyGrad { ignore_index } => {
                self.cross_entropy_grad(y, &ins, *ignore_index)?
            }
            Op::GradNorm => self.grad_norm(y, &ins)?,
            Op::AdamW { .. } | Op::Sgd { .. } => self.optimizer(&[n])?,
            Op::CountStep => {
                let (step, gn) = (self.at(ins[0])?, self.at(ins[1])?);
                let out = self.out(y)?;
                self.launch(
                    y,
                    "count_step",
                    (1, 1, 1),
                    (1, 1, 1),
                    vec![
                        ("step_in", Arg::Ptr(step)),
                        ("grad_norm", Arg::Ptr(gn)),
                        ("step_out", Arg::Ptr(out)),
                    ],
                )?;
            }
            Op::LossScaleUpdate {
                growth_factor,
                backoff_factor,
                growth_interval,
                hysteresis,
                max_scale,
            } => {
                let (s, c, gn) = (self.at(ins[0])?, self.at(ins[1])?, self.at(ins[2])?);
                let (so, co) = (self.out(outs[0])?, self.out(outs[1])?);
                self.launch(
                    y,
                    "loss_scale_update",
                    (1, 1, 1),
                    (1, 1, 1),
                    vec![
                        ("scale_in", Arg::Ptr(s)),
                        ("counters_in", Arg::Ptr(c)),
                        ("grad_norm", Arg::Ptr(gn)),
                        ("scale_out", Arg::Ptr(so)),
                        ("counters_out", Arg::Ptr(co)),
                        ("growth_factor", Arg::F64(*growth_factor)),
                        ("backoff_factor", Arg::F64(*backoff_factor)),
                        ("growth_interval", Arg::I64(*growth_interval as i64)),
                        ("hysteresis", Arg::I64(*hysteresis as i64)),
                        ("max_scale", Arg::F64(*max_scale)),
                    ],
                )?;
            }
            Op::Unary(_) | Op::UnaryGrad(_) | Op::Binary(_) | Op::Scale { .. } => {
                return Err(self.err(y, "pointwise ops on non-float tensors have no CUDA kernel"));
            }
        }
        Ok(())
    }

    /// A layout op's result `o` (of operand `x`): nothing when it stays a view read by other
    /// layout ops, an alias of its operand's buffer when its elements are contiguous there,
    /// else one strided copy of the composed view into a buffer of its own.
    fn layout_result(&mut self, o: Value, x: Value) -> Result<(), LowerError> {
        let g = self.g;
        let named = !self.users[o.index()].is_empty()
            || g.outputs().contains(&o)
            || self.stored.contains_key(g.name(o));
        if !named {
            return Ok(()); // a split piece nothing reads
        }
        match (self.storage[o.index()], self.views[o.index()].clone()) {
            (super::Storage::Virtual, _) => Ok(()),
            (super::Storage::Alias, Some((root, view))) => {
                let bytes = view.offset as u64 * g.ty(o).dtype.size_bytes() as u64;
                let place = self.at(root)?.plus(bytes);
                self.loc[o.index()] = super::Loc::At(place);
                Ok(())
            }
            (_, view) => {
                // A reshape that no view expresses copies its operand's elements in order.
                let (root, view) = match view {
                    Some(rv) => rv,
                    None => self.source(x),
                };
                let l = view.materialize().map_err(|m| self.err(o, m))?;
                let (src, dst) = (self.at(root)?, self.out(o)?);
                self.copy(o, src, dst, l)
            }
        }
    }

    /// A strided copy of elements of `y`'s dtype.
    fn copy(
        &mut self,
        y: Value,
        src: Place,
        dst: Place,
        l: super::super::program::CopyLayout,
    ) -> Result<(), LowerError> {
        let size = self.g.ty(y).dtype.size_bytes();
        let n: i64 = l.shape[..l.rank.max(0) as usize].iter().product();
        self.launch(
            y,
            &format!("strided_copy_b{size}"),
            grid_1d(n as usize, BLOCK),
            (BLOCK, 1, 1),
            vec![
                ("src", Arg::Ptr(src)),
                ("dst", Arg::Ptr(dst)),
                ("n", Arg::I64(n)),
                ("l", Arg::Layout(l)),
            ],
        )
    }

    /// The RoPE `(cos, sin)` table for `(t, d, theta, scaling)`: the CPU twin's values,
    /// uploaded once.
    fn rope_table(
        &mut self,
        t: usize,
        d: usize,
        theta: f64,
        scaling: RopeScaling,
    ) -> Result<Place, LowerError> {
        let name = match scaling {
            RopeScaling::None => format!("rope.table.{t}.{d}.{theta}"),
            s => format!("rope.table.{t}.{d}.{theta}.scaled{:?}", s.numbers()),
        };
        if let Some(slot) = self.l.find_slot(&name) {
            return Ok(Place::Slot { slot, offset: 0 });
        }
        let mut bytes = Vec::with_capacity(t * d * 4);
        for (c, s) in crate::cpu::rope::rope_table(t, d, theta, scaling) {
            bytes.extend(c.to_le_bytes());
            bytes.extend(s.to_le_bytes());
        }
        let slot = self.l.slot(&name, SlotKind::Constant(bytes), &name)?;
        Ok(Place::Slot { slot, offset: 0 })
    }

    fn softmax(
        &mut self,
        y: Value,
        ins: &[Value],
        causal: bool,
        window: Option<usize>,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let x = ins[0];
        let d = g.ty(x).shape.dims().to_vec();
        if d.len() < 2 {
            return Err(self.err(y, "softmax needs [.., Tq, Tk]"));
        }
        let r = d.len();
        let (tq, tk) = (d[r - 2], d[r - 1]);
        let rows = g.ty(x).shape.numel().unwrap_or(0) / tk.max(1);
        // The kernel sees [B, heads, tq, tk]: the dims before tq are split in two runs, each
        // folded into one index, at a point where the mask steps uniformly through each run
        // (the usual split, heads = the dim before tq, unless the mask needs another: e.g.
        // grouped-query attention's [B, kv, groups, tq, tk] with a [B, 1, 1, 1, tk] mask folds
        // kv and groups into heads).
        let lead_dims = &d[..r - 2];
        let (mask, heads, strides) = match ins.get(1) {
            None => (Arg::Null, lead_dims.last().copied().unwrap_or(1), [0i64; 4]),
            Some(&m) => {
                if g.ty(m).dtype != DType::Bool {
                    return Err(self.err(y, "a softmax mask must be bool"));
                }
                let md = g.ty(m).shape.dims().to_vec();
                if md.len() > r {
                    return Err(self.err(y, "the mask has more dims than the scores"));
                }
                let ms = copies::strides(&md);
                let lead = r - md.len();
                let stride = |dim: usize| -> i64 {
                    if dim < lead || md[dim - lead] == 1 {
                        0
                    } else {
                        ms[dim - lead]
                    }
                };
                let st: Vec<i64> = (0..r - 2).map(stride).collect();
                let n = lead_dims.len();
                let splits = std::iter::once(n.saturating_sub(1)).chain(0..=n);
                let found = splits.into_iter().find_map(|k| {
                    let sb = fold(&lead_dims[..k], &st[..k])?;
                    let sh = fold(&lead_dims[k..], &st[k..])?;
                    Some((lead_dims[k..].iter().product::<usize>(), sb, sh))
                });
                let Some((heads, sb, sh)) = found else {
                    return Err(self.err(
                        y,
                        "the mask broadcasts over the batch dims in a way the softmax kernel \
                         cannot index",
                    ));
                };
                (
                    Arg::Ptr(self.at(m)?),
                    heads,
                    [sb, sh, stride(r - 2), stride(r - 1)],
                )
            }
        };
        let xp = self.at(x)?;
        let out = self.out(y)?;
        self.launch(
            y,
            &format!("softmax_fwd_{}", io(g.ty(x).dtype, g.ty(y).dtype)),
            grid_rows(rows),
            (if tk > 2048 { 512 } else { row_threads(tk, 128) }, 1, 1),
            vec![
                ("x", Arg::Ptr(xp)),
                ("y", Arg::Ptr(out)),
                ("rows", Arg::I64(rows as i64)),
                ("tk", Arg::I32(tk as i32)),
                ("tq", Arg::I32(tq as i32)),
                ("heads", Arg::I32(heads as i32)),
                ("causal", Arg::I32(i32::from(causal))),
                ("window", Arg::I32(window_arg(window))),
                ("mask", mask),
                ("msb", Arg::I64(strides[0])),
                ("msh", Arg::I64(strides[1])),
                ("msq", Arg::I64(strides[2])),
                ("msk", Arg::I64(strides[3])),
            ],
        )
    }

    fn reduce(
        &mut self,
        y: Value,
        x: Value,
        op: ReduceOp,
        axes: &[usize],
    ) -> Result<(), LowerError> {
        let g = self.g;
        let d = g.ty(x).shape.dims().to_vec();
        let (ti, to) = (g.ty(x).dtype, g.ty(y).dtype);
        if !ti.is_float() || !to.is_float() {
            return Err(self.err(y, "reductions are over float tensors"));
        }
        let reduced: Vec<bool> = (0..d.len()).map(|i| axes.contains(&i)).collect();
        let len: usize = d
            .iter()
            .zip(&reduced)
            .filter(|(_, &r)| r)
            .map(|(n, _)| n)
            .product();
        if op == ReduceOp::Max && len == 0 {
            return Err(self.err(y, "max over an empty axis"));
        }
        // Runs of (size, reduced?) with size-1 dims dropped, as the CPU twin coalesces them.
        let mut runs: Vec<(usize, bool)> = Vec::new();
        for (&n, &r) in d.iter().zip(&reduced) {
            match runs.last_mut() {
                _ if n == 1 => {}
                Some((size, kind)) if *kind == r => *size *= n,
                _ => runs.push((n, r)),
            }
        }
        let mut src = self.at(x)?;
        let (outer, inner) = match runs.as_slice() {
            // Nothing summed (axes of size 1): every element is its own column, 32 to a block.
            [] | [(_, false)] => (1, g.ty(y).shape.numel().unwrap_or(0)),
            [(_, true)] => (1, 1),
            [(_, true), (i, false)] => (1, *i),
            [(o, false), (_, true)] => (*o, 1),
            [(o, false), (_, true), (i, false)] => (*o, *i),
            _ => {
                // Reduced axes to the end first.
                let perm: Vec<usize> = (0..d.len())
                    .filter(|&i| !reduced[i])
                    .chain((0..d.len()).filter(|&i| reduced[i]))
                    .collect();
                let l = copies::transpose(&d, &perm).map_err(|m| self.err(y, m))?;
                let bytes = g.ty(x).size_bytes().unwrap_or(0) as u64;
                let t = self.scratch(bytes);
                let size = ti.size_bytes();
                let n: i64 = l.shape[..l.rank as usize].iter().product();
                self.launch(
                    y,
                    &format!("strided_copy_b{size}"),
                    grid_1d(n as usize, BLOCK),
                    (BLOCK, 1, 1),
                    vec![
                        ("src", Arg::Ptr(src)),
                        ("dst", Arg::Ptr(t)),
                        ("n", Arg::I64(n)),
                        ("l", Arg::Layout(l)),
                    ],
                )?;
                src = t;
                let kept = g.ty(y).shape.numel().unwrap_or(0);
                (kept, 1)
            }
        };
        let (outer, len) = if matches!(runs.as_slice(), [] | [(_, false)]) {
            (outer, 1)
        } else {
            (outer, len)
        };
        let out = self.out(y)?;
        if outer * inner == 0 {
            return Ok(()); // an empty result: nothing to launch
        }
        let name = match op {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
        };
        self.launch(
            y,
            &format!("reduce_{name}_{}", io(ti, to)),
            (
                inner.div_ceil(32).clamp(1, 65_535) as u32,
                outer.clamp(1, 65_535) as u32,
                1,
            ),
            (32, 8, 1),
            vec![
                ("x", Arg::Ptr(src)),
                ("y", Arg::Ptr(out)),
                ("outer", Arg::I64(outer as i64)),
                ("len", Arg::I64(len as i64)),
                ("inner", Arg::I64(inner as i64)),
            ],
        )
    }

    fn embedding_grad(
        &mut self,
        y: Value,
        ids: Value,
        dy: Value,
        vocab: usize,
        padding: Option<usize>,
    ) -> Result<(), LowerError> {
        let g = self.g;
        if g.ty(ids).dtype != DType::I64 {
            return Err(self.err(y, "token ids must be i64 on the CUDA executor"));
        }
        let n = g.ty(ids).shape.numel().unwrap_or(0);
        let h = g.ty(y).shape.last();
        let counts = self.scratch(vocab as u64 * 4);
        let starts = self.scratch((vocab as u64 + 1) * 4);
        let positions = self.scratch(n.max(1) as u64 * 4);
        let ip = self.at(ids)?;
        let bad = self.flag(y, "token id", ip, vocab, None);
        self.commands.push(Command::Memset {
            dst: counts,
            bytes: vocab as u64 * 4,
            byte: 0,
        });
        self.launch(
            y,
            "embedding_bwd_count",
            grid_1d(n, BLOCK),
            (BLOCK, 1, 1),
            vec![
                ("ids", Arg::Ptr(ip)),
                ("n", Arg::I64(n as i64)),
                ("v", Arg::I64(vocab as i64)),
                ("counts", Arg::Ptr(counts)),
                ("bad", Arg::Ptr(bad)),
            ],
        )?;
        self.launch(
            y,
            "embedding_bwd_scan",
            (1, 1, 1),
            (row_threads(vocab, 1024), 1, 1),
            vec![
                ("counts", Arg::Ptr(counts)),
                ("v", Arg::I64(vocab as i64)),
                ("starts", Arg::Ptr(starts)),
            ],
        )?;
        self.launch(
            y,
            "embedding_bwd_fill",
            (vocab.div_ceil(256).max(1) as u32, 1, 1),
            // One warp per 32 positions (each warp scans a slice of them), up to 32 warps.
            (row_threads(n, 1024), 1, 1),
            vec![
                ("ids", Arg::Ptr(ip)),
                ("n", Arg::I64(n as i64)),
                ("v", Arg::I64(vocab as i64)),
                ("starts", Arg::Ptr(starts)),
                ("positions", Arg::Ptr(positions)),
            ],
        )?;
        let dyp = self.at(dy)?;
        let out = self.out(y)?;
        self.launch(
            y,
            &format!(
                "embedding_bwd_accumulate_{}_{}",
                sfx(g.ty(dy).dtype),
                sfx(g.ty(y).dtype)
            ),
            grid_rows(vocab),
            (128, 1, 1),
            vec![
                ("dy", Arg::Ptr(dyp)),
                ("positions", Arg::Ptr(positions)),
                ("starts", Arg::Ptr(starts)),
                ("v", Arg::I64(vocab as i64)),
                ("h", Arg::I32(h as i32)),
                ("dtable", Arg::Ptr(out)),
            ],
        )?;
        // torch's padding_idx: that row gets no gradient (zero bytes are 0.0 in every dtype).
        if let Some(row) = padding.filter(|&p| p < vocab) {
            let bytes = (h * g.ty(y).dtype.size_bytes()) as u64;
            self.commands.push(Command::Memset {
                dst: out.plus(row as u64 * bytes),
                bytes,
                byte: 0,
            });
        }
        Ok(())
    }
}

/// The element stride of one index running over `dims` (row-major) through a tensor with
/// these per-dim `strides`, or `None` when the strides are not those of one folded index.
pub(super) fn fold(dims: &[usize], strides: &[i64]) -> Option<i64> {
    let mut base: Option<i64> = None;
    let mut expect = 0i64;
    for (&d, &s) in dims.iter().zip(strides).rev() {
        if d == 1 {
            continue;
        }
        match base {
            None => base = Some(s),
            Some(_) if s != expect => return None,
            Some(_) => {}
        }
        expect = s * d as i64;
    }
    Some(base.unwrap_or(0))
}

/// Threads for a block that works through `len` elements with block reductions: one per
/// element in whole warps, at most `most`. A row shorter than `most` gets a smaller block:
/// threads past its end would only join the reductions (their barriers and shuffles).
pub(super) fn row_threads(len: usize, most: u32) -> u32 {
    (len.div_ceil(32) * 32).clamp(32, most as usize) as u32
}
