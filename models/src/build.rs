//! Shared graph-building pieces: parameter binding, scoped value names, linear layers, head
//! splitting, the attention core and the KV cache, so the three families differ only where
//! the models do.
//!
//! Parameters are declared on first use, F32 (the master precision; the precision passes
//! choose storage dtypes later), under their checkpoint tensor names; a tied weight used twice
//! is one parameter value. Every other value is named `scope.role`, where the scope is the HF
//! module path without the model prefix (`h.3`, `encoder.layer.1`, `layers.0`). Names never
//! end in `.weight` or `.bias`, so they cannot collide with parameter names.

use crate::error::ModelError;
use castor_ir::{
    AttentionDropout, BinaryOp, DType, Graph, GraphBuilder, IrError, ModelShape, Op, Origin,
    RopeScaling, TensorType, Value,
};
use std::collections::HashMap;

pub(crate) struct Ctx<'m> {
    b: GraphBuilder,
    /// Canonical parameter name -> (checkpoint tensor name, shape).
    params: HashMap<&'m str, (&'m str, &'m [usize])>,
    declared: HashMap<String, Value>,
    scope: Vec<String>,
    architecture: &'static str,
    pub batch: usize,
    /// Tokens this graph computes (the new tokens of a decoding step).
    pub seq: usize,
    /// Incremental decoding: positions already in the KV cache (their keys and values are
    /// inputs `past.N.key` / `past.N.value`), and the new keys and values become outputs
    /// `present.N.key` / `present.N.value`. `None` for the plain forward graph.
    pub cache: Option<usize>,
    /// The cache outputs, in layer order (key, value), appended after the model's outputs.
    presents: Vec<Value>,
    /// How the attention core is built.
    pub attention: AttentionImpl,
    /// Rows hold several sequences packed end to end: the graph reads `position_ids` (each
    /// token's position in its own sequence) instead of `attention_mask`, positions are
    /// looked up or rotated at them, and each attention sees only its query's sequence.
    pub packed: bool,
    /// Rows keep every key (windows of a token stream): the graph reads no
    /// `attention_mask`, and attention applies only the causal mask and window.
    pub unpadded: bool,
    /// `position_ids` and its views, declared on first use (packed graphs).
    positions: Option<Value>,
    position_rows: Option<Value>,
    /// Dropout applied in this graph (training graphs with `--dropout`), its key input
    /// `dropout_key` (declared on first use) and the stream the next dropout node takes.
    pub dropout: crate::config::DropoutRates,
    dropout_key: Option<Value>,
    dropout_streams: usize,
}

/// How a model's attention core is built, as transformers' `attn_implementation` chooses it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionImpl {
    /// The ops of the textbook formula: `q k^T`, scale, masked softmax, `p v` (a `[.., T, S]`
    /// score and probability tensor per layer).
    #[default]
    Eager,
    /// One `attention` op (FlashAttention-2: no `[.., T, S]` tensor; the backward recomputes
    /// the probabilities from the saved log-sum-exp), run on CUDA by castor's kernels.
    Fused,
    /// The fused op, run on CUDA by cuDNN's fused attention (an error where cuDNN is missing
    /// or cannot express it).
    Cudnn,
    /// The fused op, run on CUDA by cuDNN where it loads and expresses the op, else by
    /// castor's kernels.
    Auto,
}

impl AttentionImpl {
    /// The CUDA library of the fused op (`None`: the eager ops).
    pub fn library(self) -> Option<castor_ir::AttentionLibrary> {
        use castor_ir::AttentionLibrary as L;
        match self {
            AttentionImpl::Eager => None,
            AttentionImpl::Fused => Some(L::Kernels),
            AttentionImpl::Cudnn => Some(L::Cudnn),
            AttentionImpl::Auto => Some(L::Auto),
        }
    }
}

impl<'m> Ctx<'m> {
    pub fn new(
        architecture: &'static str,
        params: HashMap<&'m str, (&'m str, &'m [usize])>,
        batch: usize,
        seq: usize,
    ) -> Self {
        Ctx {
            b: GraphBuilder::new(architecture),
            params,
            declared: HashMap::new(),
            scope: Vec::new(),
            architecture,
            batch,
            seq,
            cache: None,
            presents: Vec::new(),
            attention: AttentionImpl::Eager,
            packed: false,
            unpadded: false,
            positions: None,
            position_rows: None,
            dropout: Default::default(),
            dropout_key: None,
            dropout_streams: 0,
        }
    }

    /// The graph with `outputs`, then the KV cache's `present.*` values when decoding.
    pub fn finish(mut self, mut outputs: Vec<Value>, shape: ModelShape) -> Graph {
        outputs.append(&mut self.presents);
        self.b.set_outputs(outputs);
        self.b.set_shape(shape);
        self.b.finish()
    }

    /// Positions before the first token of this graph (the cache's length).
    pub fn past(&self) -> usize {
        self.cache.unwrap_or(0)
    }

    /// Keys: the cache's positions then this graph's.
    pub fn keys(&self) -> usize {
        self.past() + self.seq
    }

    /// With a KV cache, `k` and `v` (`[B, H, T, D]`, positions already applied) join the
    /// cached ones along the sequence axis and become the layer's `present` outputs; without
    /// one they are returned as they are.
    pub fn cache_kv(
        &mut self,
        layer: usize,
        k: Value,
        v: Value,
    ) -> Result<(Value, Value), ModelError> {
        let Some(past) = self.cache else {
            return Ok((k, v));
        };
        let mut out = [k, v];
        for (x, role) in out.iter_mut().zip(["key", "value"]) {
            let mut all = *x;
            if past > 0 {
                let mut dims = self.ty(*x).shape.0.clone();
                dims[2] = past;
                let cached = self.input(
                    &format!("past.{layer}.{role}"),
                    TensorType::new(DType::F32, dims),
                )?;
                all = self.op_exact(
                    &format!("present.{layer}.{role}"),
                    Op::Concat { axis: 2 },
                    &[cached, *x],
                )?;
            } else {
                // The first step's keys are the whole cache: name them as outputs.
                all = self.op_exact(
                    &format!("present.{layer}.{role}"),
                    Op::Reshape {
                        shape: self.ty(all).shape.0.clone(),
                    },
                    &[all],
                )?;
            }
            self.presents.push(all);
            *x = all;
        }
        Ok((out[0], out[1]))
    }

    /// `x` through dropout with probability `p` (nothing for `None` or 0) as `scope.name`: a
    /// `dropout` node keyed by the graph input `dropout_key` (i64 `[2]`: seed, offset; the
    /// trainer gives each micro-batch its own offset, and a negative one is evaluation mode)
    /// and its own stream, so no two nodes draw the same mask.
    pub fn dropout(&mut self, name: &str, x: Value, p: Option<f64>) -> Result<Value, ModelError> {
        let p = p.unwrap_or(0.0);
        if p == 0.0 {
            return Ok(x);
        }
        let (key, stream) = self.dropout_stream()?;
        self.op(name, Op::Dropout { p, stream }, &[x, key])
    }

    /// The graph input `dropout_key` (declared on first use) and the next dropout's stream.
    fn dropout_stream(&mut self) -> Result<(Value, usize), ModelError> {
        let key = match self.dropout_key {
            Some(key) => key,
            None => {
                let key = self.input("dropout_key", TensorType::new(DType::I64, [2]))?;
                *self.dropout_key.insert(key)
            }
        };
        let stream = self.dropout_streams;
        self.dropout_streams += 1;
        Ok((key, stream))
    }

    /// A packed graph's `position_ids` (i64 `[B, T]`, declared on first use); `None` for other
    /// graphs, whose positions are `past..past + T` in every row.
    pub fn positions(&mut self) -> Result<Option<Value>, ModelError> {
        if !self.packed {
            return Ok(None);
        }
        if self.positions.is_none() {
            let ty = TensorType::new(DType::I64, [self.batch, self.seq]);
            self.positions = Some(self.input("position_ids", ty)?);
        }
        Ok(self.positions)
    }

    /// The mask operand of every attention over `[B, .., T, keys]` scores of rank `rank`: the
    /// key-padding mask from `attention_mask` (int `[B, keys]`), in a packed graph the
    /// positions as `[B, 1, .., 1, T]` (each query then sees only its own sequence), and none
    /// in an unpadded graph.
    pub fn sequence_mask(&mut self, rank: usize) -> Result<Option<Value>, ModelError> {
        let (b, keys) = (self.batch, self.keys());
        let mut shape = vec![1; rank];
        shape[0] = b;
        shape[rank - 1] = keys;
        if let Some(positions) = self.positions()? {
            let view = self.op_exact("position_ids.keys", Op::Reshape { shape }, &[positions])?;
            return Ok(Some(view));
        }
        if self.unpadded {
            return Ok(None);
        }
        let am = self.input("attention_mask", TensorType::new(DType::I64, [b, keys]))?;
        self.key_mask(am, rank).map(Some)
    }

    /// Rotary embedding of `x [.., T, D]` at this graph's positions (a packed graph's
    /// `position_ids`, broadcast over the heads as `[B, 1, T]`). Decoding after `past`
    /// cached positions pads `past` zero rows in front, rotates, and keeps the last `T` rows:
    /// the rotation at position `p` is then computed exactly as the full sequence computes
    /// it (the padding's rows cost what the attention over the cache costs anyway).
    pub fn rope(
        &mut self,
        name: &str,
        x: Value,
        theta: f64,
        scaling: RopeScaling,
    ) -> Result<Value, ModelError> {
        let past = self.past();
        if let Some(positions) = self.positions()? {
            let rows = match self.position_rows {
                Some(rows) => rows,
                None => {
                    let shape = vec![self.batch, 1, self.seq];
                    let rows =
                        self.op_exact("position_ids.rows", Op::Reshape { shape }, &[positions])?;
                    *self.position_rows.insert(rows)
                }
            };
            return self.op(name, Op::Rope { theta, scaling }, &[x, rows]);
        }
        if past == 0 {
            return self.op(name, Op::Rope { theta, scaling }, &[x]);
        }
        let axis = self.ty(x).shape.rank() - 2;
        let padded = self.op(
            &format!("{name}.padded"),
            Op::Pad {
                axis,
                before: past,
                after: 0,
            },
            &[x],
        )?;
        let rotated = self.op(
            &format!("{name}.all"),
            Op::Rope { theta, scaling },
            &[padded],
        )?;
        self.op(
            name,
            Op::Slice {
                axis,
                start: past,
                end: past + self.seq,
            },
            &[rotated],
        )
    }

    pub fn ty(&self, v: Value) -> &TensorType {
        self.b.ty(v)
    }

    fn ir(&self, source: IrError) -> ModelError {
        ModelError::Graph {
            architecture: self.architecture.to_string(),
            source,
        }
    }

    /// The parameter with this canonical name (declared once, then reused).
    pub fn param(&mut self, canonical: &str) -> Result<Value, ModelError> {
        if let Some(&v) = self.declared.get(canonical) {
            return Ok(v);
        }
        let &(name, shape) =
            self.params
                .get(canonical)
                .ok_or_else(|| ModelError::NotAParameter {
                    architecture: self.architecture.to_string(),
                    tensor: canonical.to_string(),
                })?;
        let v = self
            .b
            .param(name, TensorType::new(DType::F32, shape.to_vec()))
            .map_err(|e| self.ir(e))?;
        self.declared.insert(canonical.to_string(), v);
        Ok(v)
    }

    /// A graph input with an exact name.
    pub fn input(&mut self, name: &str, ty: TensorType) -> Result<Value, ModelError> {
        self.b.input(name, ty).map_err(|e| self.ir(e))
    }

    /// Runs `f` as transformer block `index`: its nodes record the block (so passes find
    /// blocks by data, not by name) and their names take `scope` (`h.3`).
    pub fn block<T>(&mut self, index: usize, scope: &str, f: impl FnOnce(&mut Self) -> T) -> T {
        let outer = self.b.block();
        self.b.set_block(Some(index as u32));
        let out = self.scoped(scope, f);
        self.b.set_block(outer);
        out
    }

    /// Runs `f` with `scope` appended to the name prefix.
    pub fn scoped<T>(&mut self, scope: &str, f: impl FnOnce(&mut Self) -> T) -> T {
        self.scope.push(scope.to_string());
        let out = f(self);
        self.scope.pop();
        out
    }

    fn full_name(&self, name: &str) -> String {
        let mut s = self.scope.join(".");
        if !s.is_empty() {
            s.push('.');
        }
        s.push_str(name);
        s
    }

    /// A single-result op named `scope.name`.
    pub fn op(&mut self, name: &str, op: Op, inputs: &[Value]) -> Result<Value, ModelError> {
        let full = self.full_name(name);
        self.b.op(&full, op, inputs).map_err(|e| self.ir(e))
    }

    /// A multi-result op; result `i > 0` is named `scope.name.i`.
    pub fn op_multi(
        &mut self,
        name: &str,
        op: Op,
        inputs: &[Value],
    ) -> Result<Vec<Value>, ModelError> {
        let full = self.full_name(name);
        self.b.op_multi(&full, op, inputs).map_err(|e| self.ir(e))
    }

    /// An op named exactly `name`, ignoring the scope, in no block (graph outputs, values
    /// shared by every block).
    pub fn op_exact(&mut self, name: &str, op: Op, inputs: &[Value]) -> Result<Value, ModelError> {
        let saved = std::mem::take(&mut self.scope);
        let block = self.b.block();
        self.b.set_block(None);
        let out = self.op(name, op, inputs);
        self.b.set_block(block);
        self.scope = saved;
        out
    }

    /// A causal LM's output head: `logits = h · Wᵀ` by the parameter `weight` (its own
    /// `lm_head.weight` or the tied token embeddings), marked `origin=head` so that passes
    /// find the output layer without knowing its name.
    pub fn lm_head(&mut self, h: Value, weight: &str) -> Result<Value, ModelError> {
        let w = self.param(weight)?;
        let product = Op::MatMul {
            transpose_a: false,
            transpose_b: true,
        };
        let logits = self.op_exact("logits", product, &[h, w])?;
        self.b.set_origin(logits, Some(Origin::Head));
        Ok(logits)
    }

    pub fn add(&mut self, name: &str, a: Value, b: Value) -> Result<Value, ModelError> {
        self.op(name, Op::Binary(BinaryOp::Add), &[a, b])
    }

    /// `x @ w (+ bias)`. `w_is_out_in`: a `torch.nn.Linear` weight `[out, in]` (multiplied
    /// transposed); otherwise a GPT-2 `Conv1D` weight `[in, out]`. With a bias, the product is
    /// `name.matmul` and the sum is `name`.
    pub fn linear(
        &mut self,
        name: &str,
        x: Value,
        w: &str,
        bias: Option<&str>,
        w_is_out_in: bool,
    ) -> Result<Value, ModelError> {
        let w = self.param(w)?;
        let mm = Op::MatMul {
            transpose_a: false,
            transpose_b: w_is_out_in,
        };
        match bias {
            None => self.op(name, mm, &[x, w]),
            Some(b) => {
                let b = self.param(b)?;
                let y = self.op(&format!("{name}.matmul"), mm, &[x, w])?;
                self.add(name, y, b)
            }
        }
    }

    /// `attention_mask` (int `[B, keys]`, 1 = attend) as a bool key mask of rank `rank`:
    /// `[B, 1, .., 1, keys]`, which broadcasts to every score tensor.
    pub fn key_mask(&mut self, mask: Value, rank: usize) -> Result<Value, ModelError> {
        let (b, t) = (self.batch, self.keys());
        let m = self.op_exact("attention_mask.bool", Op::Cast { to: DType::Bool }, &[mask])?;
        let mut shape = vec![1; rank];
        shape[0] = b;
        shape[rank - 1] = t;
        self.op_exact("attention_mask.keys", Op::Reshape { shape }, &[m])
    }

    /// `[B, T, heads*d]` -> `[B, heads, T, d]` as `role.heads` (reshape) and `role`
    /// (transpose).
    pub fn split_heads(
        &mut self,
        role: &str,
        x: Value,
        heads: usize,
        d: usize,
    ) -> Result<Value, ModelError> {
        let (b, t) = (self.batch, self.seq);
        let r = self.op(
            &format!("{role}.heads"),
            Op::Reshape {
                shape: vec![b, t, heads, d],
            },
            &[x],
        )?;
        self.op(
            role,
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[r],
        )
    }

    /// `[B, heads, T, d]` -> `[B, T, heads*d]` as `role.t` (transpose) and `role.merged`
    /// (reshape), where `role` names `x`.
    pub fn merge_heads(&mut self, role: &str, x: Value) -> Result<Value, ModelError> {
        let dims = self.ty(x).shape.0.clone();
        let (b, t) = (self.batch, self.seq);
        let width = dims[1] * dims[3];
        let tr = self.op(
            &format!("{role}.t"),
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[x],
        )?;
        self.op(
            &format!("{role}.merged"),
            Op::Reshape {
                shape: vec![b, t, width],
            },
            &[tr],
        )
    }

    /// The attention core: `scores = q k^T`, each factor of `scales` applied in turn
    /// (`scores.scaled`, `scores.scaled.1`, ...), `probs = softmax(scores, causal, mask)`,
    /// `context = probs v`; or, with a fused [`AttentionImpl`], one `attention` op scaled by the
    /// product of the factors (`context`, with its log-sum-exp `context.1`). Works for any
    /// matching batch dims (4-D heads, 5-D GQA groups). Attention dropout is the eager core's
    /// `probs.dropout` node, or the fused op's `dropout` attribute with the same stream (the
    /// next one in either case) and the `dropout_key` operand: both drop the same
    /// probabilities.
    pub fn attention(
        &mut self,
        q: Value,
        k: Value,
        v: Value,
        mask: Option<Value>,
        scales: &[f64],
        keys: KeysSeen,
    ) -> Result<Value, ModelError> {
        let (causal, window) = match keys {
            KeysSeen::All => (false, None),
            KeysSeen::Causal => (true, None),
            KeysSeen::Window(w) => (true, Some(w)),
        };
        let attention_dropout = self.dropout.attention.filter(|&p| p > 0.0);
        if let Some(library) = self.attention.library() {
            let scale = scales.iter().product();
            let mut operands = vec![q, k, v];
            operands.extend(mask);
            let dropout = match attention_dropout {
                Some(p) => {
                    let (key, stream) = self.dropout_stream()?;
                    operands.push(key);
                    Some(AttentionDropout { p, stream })
                }
                None => None,
            };
            let op = Op::Attention {
                causal,
                window,
                scale,
                library,
                dropout,
            };
            let out = self.op_multi("context", op, &operands)?;
            return Ok(out[0]);
        }
        let mut s = self.op(
            "scores",
            Op::MatMul {
                transpose_a: false,
                transpose_b: true,
            },
            &[q, k],
        )?;
        for &factor in scales {
            s = self.op("scores.scaled", Op::Scale { factor }, &[s])?;
        }
        let mut operands = vec![s];
        operands.extend(mask);
        let mut p = self.op("probs", Op::Softmax { causal, window }, &operands)?;
        p = self.dropout("probs.dropout", p, attention_dropout)?;
        self.op(
            "context",
            Op::MatMul {
                transpose_a: false,
                transpose_b: false,
            },
            &[p, v],
        )
    }
}

/// Which keys each query sees, besides the padding mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeysSeen {
    /// Every key (BERT).
    All,
    /// Keys up to the query's position.
    Causal,
    /// The last `n` keys up to the query's position (a sliding window).
    Window(usize),
}
