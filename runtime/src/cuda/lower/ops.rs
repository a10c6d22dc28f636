//! The per-op dispatch: each non-pointwise op to its kernel family's lowering (the family's
//! `lower.rs` in `super::super::families`), products to `gemm.rs`; and the helpers they
//! share.

use super::super::program::{Command, Epilogue, Gemm, Place};
use super::{gemm, Loc, LowerError, RunLowering, Storage};
use castor_ir::{Accum, Node, Op, ReduceOp, Value};

/// Threads per block of the row kernels (norms, softmax, cross-entropy, embeddings).
pub(crate) const ROW_BLOCK: u32 = 256;
/// Threads per block of the elementwise and copy kernels.
pub(crate) const BLOCK: u32 = 256;

impl RunLowering<'_, '_> {
    pub(crate) fn node(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let outs = node.outputs.clone();
        let Some(&y) = outs.first() else {
            return Ok(());
        };
        let dt = |v: Value| g.ty(v).dtype;
        match &node.op {
            Op::Input | Op::Param | Op::State | Op::ParamCopy { .. } => {}
            Op::AllReduce { .. }
            | Op::ReduceScatter { .. }
            | Op::AllGather { .. }
            | Op::Shard { .. } => {
                let (src, dst) = (self.at(ins[0])?, self.out(y)?);
                let bytes = |v: Value| g.ty(v).size_bytes().unwrap_or(0) as u64;
                let side = self.side.get(&n).copied();
                match side {
                    Some((k, join)) => self.pending.push((k, join)),
                    // One NCCL operation in flight per communicator: the ranks' kernels then
                    // meet in one order whatever the streams' timing (a ZeRO-3 gather waits for
                    // the reduction before it).
                    None if !matches!(node.op, Op::Shard { .. }) => self.join_side(usize::MAX),
                    None => {}
                }
                self.commands.push(Command::Collective {
                    node: g.name(y).to_string(),
                    op: node.op.clone(),
                    dtype: dt(ins[0]),
                    src,
                    dst,
                    src_bytes: bytes(ins[0]),
                    dst_bytes: bytes(y),
                    side: side.map(|(k, _)| k),
                });
            }
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
            // A scaled product is a product whose gemm scales in its accumulator (alpha).
            Op::MatMul {
                transpose_a,
                transpose_b,
            }
            | Op::MatMulScaled {
                transpose_a,
                transpose_b,
                ..
            } => {
                let alpha = match node.op {
                    Op::MatMulScaled { alpha, .. } => alpha,
                    _ => 1.0,
                };
                let c = self.out(y)?;
                self.product(n, (*transpose_a, *transpose_b), c, alpha, false)?;
            }
            Op::MatMulAdd { .. } => self.matmul_add(n)?,
            Op::MatMulBias { .. }
            | Op::MatMulBiasGelu { .. }
            | Op::MatMulGeluGrad { .. }
            | Op::MatMulBiasGrad { .. } => self.epilogue_product(n)?,
            Op::Nf4MatMul { .. } => self.nf4_matmul(n)?,
            Op::Embedding { .. } => self.embedding(n)?,
            Op::EmbeddingGrad { vocab, padding } => {
                self.embedding_grad(y, ins[0], ins[1], *vocab, *padding)?
            }
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => self.norm_unit(n, &[], None)?,
            Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. } => self.norm_grad_unit(n, None)?,
            Op::Softmax { causal, window } => self.softmax(y, &ins, *causal, *window)?,
            Op::SoftmaxGrad => self.softmax_grad(n)?,
            Op::Rope { .. } | Op::RopeGrad { .. } => self.rope(n)?,
            Op::Dropout { .. } => self.dropout(n)?,
            Op::Concat { .. } => self.concat(n)?,
            Op::Pad { .. } => self.pad(n)?,
            Op::Reduce { op, axes, .. } => self.reduce(y, ins[0], *op, axes)?,
            Op::Cast { .. } => self.cast(n)?,
            Op::Full { .. } => self.fill(n)?,
            Op::CrossEntropy { ignore_index } => {
                self.cross_entropy(y, ins[0], ins[1], *ignore_index)?
            }
            Op::CrossEntropyGrad { ignore_index } => {
                self.cross_entropy_grad(y, &ins, *ignore_index)?
            }
            Op::LinearCrossEntropy { .. } => self.linear_cross_entropy(n)?,
            Op::LinearCrossEntropyGrad { .. } => self.linear_cross_entropy_grad(n)?,
            Op::LinearCrossEntropyStep { .. } => self.linear_cross_entropy_step(n)?,
            Op::GradNorm => self.grad_norm(y, &ins)?,
            Op::AdamW { .. } | Op::Sgd { .. } | Op::Lion { .. } => self.optimizer(&[n])?,
            Op::Adafactor { .. } => self.adafactor(n)?,
            Op::AdamW8bit { .. } => self.adamw8bit(n)?,
            Op::CountStep => self.count_step(n)?,
            Op::LossScaleUpdate { .. } => self.loss_scale_update(n)?,
            Op::Unary(_) | Op::UnaryGrad(_) | Op::Binary(_) | Op::Scale { .. } => {
                return Err(self.err(y, "pointwise ops on non-float tensors have no CUDA kernel"));
            }
            Op::Fp8Scale { .. } => self.fp8_scale(n)?,
            Op::Quantize { .. } => self.quantize(n)?,
            Op::Fp8MatMul { .. } => self.fp8_matmul(n)?,
            Op::AmaxHistory { .. } => self.amax_histories(&[n])?,
        }
        Ok(())
    }
}

/// The element stride of one index running over `dims` (row-major) through a tensor with
/// these per-dim `strides`, or `None` when the strides are not those of one folded index.
pub(crate) fn fold(dims: &[usize], strides: &[i64]) -> Option<i64> {
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
pub(crate) fn row_threads(len: usize, most: u32) -> u32 {
    (len.div_ceil(32) * 32).clamp(32, most as usize) as u32
}

impl RunLowering<'_, '_> {
    /// `alpha · op(a)·op(b) + c` as products that add into C (cuBLAS's beta = 1): in place of
    /// `c` where the result may take its buffer over ([`Self::addend_buffer`]), else into a
    /// buffer of its own that `c` is copied into first.
    fn matmul_add(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let Op::MatMulAdd {
            transpose_a,
            transpose_b,
            alpha,
        } = node.op
        else {
            unreachable!("matmul_add is called for `matmul_add` nodes");
        };
        let (ins, y) = (node.inputs.clone(), node.outputs[0]);
        let dt = |v: Value| g.ty(v).dtype;
        let c = ins[2];
        if dt(c) != dt(y) {
            return Err(self.err(
                y,
                format!(
                    "a product adds into its addend's buffer: the addend `%{}` is {}, the result {}",
                    g.name(c),
                    dt(c),
                    dt(y)
                ),
            ));
        }
        let dst = match self.addend_buffer(n, c, y) {
            Some(place) => place,
            None => {
                let dst = self.out(y)?;
                let (root, view) = self.source(c);
                let l = view.materialize().map_err(|m| self.err(y, m))?;
                let src = self.at(root)?;
                self.copy(y, src, dst, l)?;
                dst
            }
        };
        self.product(n, (transpose_a, transpose_b), dst, alpha, true)
    }

    /// The gemms of node `n`'s product of its first two operands into `c` (its result's
    /// place), scaled by `alpha` in the accumulator, overwriting C or adding into it.
    fn product(
        &mut self,
        n: Node,
        (transpose_a, transpose_b): (bool, bool),
        c: Place,
        alpha: f64,
        accumulate: bool,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let (ins, y) = (&node.inputs, node.outputs[0]);
        let dt = |v: Value| g.ty(v).dtype;
        let (a, b) = (self.at(ins[0])?, self.at(ins[1])?);
        let gm = gemm::matmul(
            g.name(y),
            (a, &g.ty(ins[0]).shape, dt(ins[0])),
            (b, &g.ty(ins[1]).shape, dt(ins[1])),
            (c, dt(y)),
            transpose_a,
            transpose_b,
            node.acc == Some(Accum::Tf32),
        )
        .map_err(|m| self.err(y, m))?;
        self.commands.extend(gm.into_iter().map(|g| {
            Command::Gemm(Gemm {
                alpha: alpha as f32,
                accumulate,
                ..g
            })
        }));
        Ok(())
    }

    /// The buffer of `c` when node `n`'s result `y` may take it over and be written there:
    /// `c` has an arena buffer of its own that nothing reads after `n` (through no view
    /// either, on no side stream), and `y` would get a new one (it is no view, graph output
    /// or state). The buffer then lives until `y`'s last reader.
    fn addend_buffer(&mut self, n: Node, c: Value, y: Value) -> Option<Place> {
        let g = self.g;
        let Loc::At(
            place @ Place::Buffer {
                buffer, offset: 0, ..
            },
        ) = self.loc[c.index()]
        else {
            return None;
        };
        let own = |v: Value| self.storage[v.index()] == Storage::Own && self.root[v.index()] == v;
        let fixed = |v: Value| g.outputs().contains(&v) || self.stored.contains_key(g.name(v));
        let read_later = self.end_of[c.index()] > self.unit_of[n.index()];
        let unplaced = matches!(self.loc[y.index()], Loc::Unset);
        if !own(c) || !own(y) || fixed(c) || fixed(y) || read_later || !unplaced {
            return None;
        }
        let end = self.end_of[y.index()];
        let entry = &mut self.buffers[buffer.0 as usize];
        entry.2 = entry.2.max(end);
        self.loc[y.index()] = Loc::At(place);
        Some(place)
    }

    /// A product with a cuBLASLt epilogue: one call (the op's rhs is a matrix and its lhs is
    /// not transposed, so every leading dim folds into the product's rows).
    fn epilogue_product(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
        let dt = |v: Value| g.ty(v).dtype;
        let (transpose_a, transpose_b) = match node.op {
            Op::MatMulBias {
                transpose_a,
                transpose_b,
            }
            | Op::MatMulBiasGelu {
                transpose_a,
                transpose_b,
            }
            | Op::MatMulGeluGrad {
                transpose_a,
                transpose_b,
            } => (transpose_a, transpose_b),
            Op::MatMulBiasGrad { .. } => (true, false),
            _ => unreachable!("epilogue_product is called for epilogue products"),
        };
        // The stored result: the activation of a GELU product, else the first output.
        let y = match node.op {
            Op::MatMulBiasGelu { .. } => outs[1],
            _ => outs[0],
        };
        let (a, b) = (self.at(ins[0])?, self.at(ins[1])?);
        let c = self.out(y)?;
        // A small weight gradient: the plain product, and its bias gradient summed apart.
        let apart = match node.op {
            Op::MatMulBiasGrad { lhs } => {
                let d = g.ty(y).shape.dims();
                (!castor_passes::cost::bias_grad_in_epilogue(d[0], d[1])).then_some(lhs)
            }
            _ => None,
        };
        let epilogue = match node.op {
            _ if apart.is_some() => Epilogue::None,
            Op::MatMulBias { .. } => Epilogue::Bias {
                bias: self.at(ins[2])?,
            },
            Op::MatMulBiasGelu { .. } => Epilogue::BiasGelu {
                bias: self.at(ins[2])?,
                aux: self.out(outs[0])?,
            },
            // The IR's lhs is cuBLAS's B.
            Op::MatMulBiasGrad { lhs: true } => Epilogue::BiasGradB {
                bias_grad: self.out(outs[1])?,
            },
            Op::MatMulBiasGrad { lhs: false } => Epilogue::BiasGradA {
                bias_grad: self.out(outs[1])?,
            },
            _ => Epilogue::GeluGrad {
                aux: self.at(ins[2])?,
            },
        };
        let mut gm = gemm::matmul(
            g.name(y),
            (a, &g.ty(ins[0]).shape, dt(ins[0])),
            (b, &g.ty(ins[1]).shape, dt(ins[1])),
            (c, dt(y)),
            transpose_a,
            transpose_b,
            node.acc == Some(Accum::Tf32),
        )
        .map_err(|m| self.err(y, m))?;
        if gm.len() != 1 || gm[0].batch != 1 {
            return Err(self.err(
                y,
                format!(
                    "an epilogue product must be one cuBLASLt call, found {} call(s)",
                    gm.len()
                ),
            ));
        }
        gm[0].epilogue = epilogue;
        self.commands.push(Command::Gemm(gm.remove(0)));
        if let Some(lhs) = apart {
            // The summed operand is `[k, len]`: its columns' sums over the k rows.
            let (summed, db) = (ins[usize::from(!lhs)], outs[1]);
            let d = g.ty(summed).shape.dims();
            let x = (self.at(summed)?, dt(summed));
            let out = (self.out(db)?, dt(db));
            self.column_reduce_in_two_stages(db, ReduceOp::Sum, x, out, [1, d[0], d[1]])?;
        }
        Ok(())
    }
}
