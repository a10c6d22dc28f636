//! LLaMA (`LlamaModel`, `LlamaForCausalLM`), as transformers' `modeling_llama` computes it
//! in eval mode.
//!
//! Pre-RMSNorm layers, rotary embeddings on q and k in `[B, H, T, D]` layout, SwiGLU MLP.
//! Grouped-query attention is expressed without repeating k and v: q goes to
//! `[B, Hkv, G, T, D]` (query head `j*G + g` uses kv head `j`, as `repeat_kv` does), k and v
//! to `[B, Hkv, 1, T, D]`, and the matmuls broadcast the group axis. The LM head is
//! `lm_head.weight` unless `tie_word_embeddings`; `rotary_emb.inv_freq` buffers are ignored.
//!
//! Values: `embed_tokens`; per layer `layers.N.`: `input_layernorm`,
//! `self_attn.{q,k,v}_proj`, `self_attn.{q,k,v}.heads`, `self_attn.{q,k,v}`,
//! `self_attn.{q,k}.rope`, `self_attn.{q,k,v}.groups`, `self_attn.scores`,
//! `self_attn.scores.scaled`, `self_attn.probs`, `self_attn.context`,
//! `self_attn.context.heads`, `self_attn.context.t`, `self_attn.context.merged`,
//! `self_attn.o_proj`, `attn_residual`, `post_attention_layernorm`, `mlp.gate_proj`,
//! `mlp.act`, `mlp.up_proj`, `mlp.gated`, `mlp.down_proj`, `mlp_residual`; then `norm` (or
//! `last_hidden_state`) and `logits`.

use crate::build::Ctx;
use crate::config::LlamaConfig;
use crate::error::{ModelError, ParamSpec};
use crate::model::{pre, Arch, Head};
use castor_ir::{BinaryOp, DType, ModelShape, Op, TensorType, Value};

impl Arch for LlamaConfig {
    fn architectures(&self) -> &'static [(&'static str, Head)] {
        &[
            ("LlamaForCausalLM", Head::CausalLm),
            ("LlamaModel", Head::Base),
            (
                "LlamaForSequenceClassification",
                Head::SequenceClassification,
            ),
        ]
    }

    fn base_prefix(&self) -> &'static str {
        "model."
    }

    fn marker(&self) -> &'static str {
        "embed_tokens.weight"
    }

    fn canonical_prefix(&self, head: Head) -> &'static str {
        if matches!(head, Head::CausalLm | Head::SequenceClassification) {
            "model."
        } else {
            ""
        }
    }

    fn guess_head(&self, has: &dyn Fn(&str) -> bool, prefix: &str) -> Head {
        if has("score.weight") {
            Head::SequenceClassification
        } else if has("lm_head.weight") || prefix == "model." {
            Head::CausalLm
        } else {
            Head::Base
        }
    }

    fn params(&self, head: Head, prefix: &str) -> Vec<ParamSpec> {
        let (h, v, m) = (self.hidden_size, self.vocab_size, self.intermediate_size);
        let q_out = self.num_attention_heads * self.head_dim;
        let kv_out = self.num_key_value_heads * self.head_dim;
        let p = |n: &str| pre(prefix, n);
        let mut out = vec![ParamSpec::new(p("embed_tokens.weight"), [v, h])];
        for i in 0..self.num_hidden_layers {
            let l = |n: &str| p(&format!("layers.{i}.{n}"));
            out.push(ParamSpec::new(l("input_layernorm.weight"), [h]));
            for (proj, o, inp) in [
                ("q_proj", q_out, h),
                ("k_proj", kv_out, h),
                ("v_proj", kv_out, h),
                ("o_proj", h, q_out),
            ] {
                out.push(ParamSpec::new(
                    l(&format!("self_attn.{proj}.weight")),
                    [o, inp],
                ));
                if self.attention_bias {
                    out.push(ParamSpec::new(l(&format!("self_attn.{proj}.bias")), [o]));
                }
            }
            out.push(ParamSpec::new(l("post_attention_layernorm.weight"), [h]));
            for (proj, o, inp) in [("gate_proj", m, h), ("up_proj", m, h), ("down_proj", h, m)] {
                out.push(ParamSpec::new(l(&format!("mlp.{proj}.weight")), [o, inp]));
                if self.mlp_bias {
                    out.push(ParamSpec::new(l(&format!("mlp.{proj}.bias")), [o]));
                }
            }
        }
        out.push(ParamSpec::new(p("norm.weight"), [h]));
        if head == Head::CausalLm && !self.tie_word_embeddings {
            out.push(ParamSpec::new("lm_head.weight", [v, h]));
        }
        out
    }

    fn tied_copies(&self, head: Head, _prefix: &str) -> Vec<String> {
        if head == Head::CausalLm && self.tie_word_embeddings {
            vec!["lm_head.weight".into()]
        } else {
            vec![]
        }
    }

    fn is_buffer(&self, name: &str) -> bool {
        name.ends_with("rotary_emb.inv_freq")
    }

    fn max_positions(&self) -> Option<usize> {
        // Rotary positions are computed, not looked up: transformers does not enforce
        // `max_position_embeddings`, and neither does castor.
        None
    }

    fn shape(&self, batch: usize, seq: usize) -> ModelShape {
        ModelShape {
            layers: self.num_hidden_layers,
            width: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            vocab: self.vocab_size,
            batch,
            seq,
        }
    }

    fn widths(&self) -> (usize, usize) {
        let w = [
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_attention_heads * self.head_dim,
        ];
        (w.into_iter().max().unwrap_or(0), self.num_attention_heads)
    }

    fn build(&self, head: Head, prefix: &str, ctx: &mut Ctx) -> Result<Vec<Value>, ModelError> {
        let (b, t) = (ctx.batch, ctx.seq);
        let p = |n: &str| pre(prefix, n);
        let ids = ctx.input("input_ids", TensorType::new(DType::I64, [b, t]))?;
        let keys = ctx.keys();
        let am = ctx.input("attention_mask", TensorType::new(DType::I64, [b, keys]))?;
        let mask = ctx.key_mask(am, 5)?;

        let emb = ctx.param(&p("embed_tokens.weight"))?;
        let mut h = ctx.op("embed_tokens", Op::Embedding, &[emb, ids])?;
        for i in 0..self.num_hidden_layers {
            let l = p(&format!("layers.{i}."));
            h = ctx.block(i, &format!("layers.{i}"), |ctx| {
                layer(self, ctx, &l, i, h, mask)
            })?;
        }
        let final_name = if head == Head::CausalLm {
            "norm"
        } else {
            "last_hidden_state"
        };
        let w = ctx.param(&p("norm.weight"))?;
        let eps = self.rms_norm_eps;
        let h = ctx.op_exact(final_name, Op::RmsNorm { eps }, &[h, w])?;
        if head != Head::CausalLm {
            return Ok(vec![h]);
        }
        let lm = if self.tie_word_embeddings {
            p("embed_tokens.weight")
        } else {
            "lm_head.weight".to_string()
        };
        let lm = ctx.param(&lm)?;
        let logits = ctx.op_exact(
            "logits",
            Op::MatMul {
                transpose_a: false,
                transpose_b: true,
            },
            &[h, lm],
        )?;
        Ok(vec![logits])
    }
}

/// One decoder layer; `l` is its parameter prefix (`model.layers.0.`).
fn layer(
    c: &LlamaConfig,
    ctx: &mut Ctx,
    l: &str,
    index: usize,
    h: Value,
    mask: Value,
) -> Result<Value, ModelError> {
    let (b, t, keys) = (ctx.batch, ctx.seq, ctx.keys());
    let (heads, kv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let groups = heads / kv;
    let eps = c.rms_norm_eps;
    let w = |name: &str| format!("{l}{name}");
    let bias = |on: bool, name: &str| on.then(|| w(name));

    let g = ctx.param(&w("input_layernorm.weight"))?;
    let x = ctx.op("input_layernorm", Op::RmsNorm { eps }, &[h, g])?;
    let attn = ctx.scoped("self_attn", |ctx| -> Result<Value, ModelError> {
        let proj = |ctx: &mut Ctx, name: &str, role: &str, n: usize| {
            let y = ctx.linear(
                name,
                x,
                &w(&format!("self_attn.{name}.weight")),
                bias(c.attention_bias, &format!("self_attn.{name}.bias")).as_deref(),
                true,
            )?;
            ctx.split_heads(role, y, n, d)
        };
        let q = proj(ctx, "q_proj", "q", heads)?;
        let k = proj(ctx, "k_proj", "k", kv)?;
        let v = proj(ctx, "v_proj", "v", kv)?;
        let theta = c.rope_theta;
        let q = ctx.rope("q.rope", q, theta)?;
        let k = ctx.rope("k.rope", k, theta)?;
        let (k, v) = ctx.cache_kv(index, k, v)?;
        let q = ctx.op(
            "q.groups",
            Op::Reshape {
                shape: vec![b, kv, groups, t, d],
            },
            &[q],
        )?;
        let k = ctx.op(
            "k.groups",
            Op::Reshape {
                shape: vec![b, kv, 1, keys, d],
            },
            &[k],
        )?;
        let v = ctx.op(
            "v.groups",
            Op::Reshape {
                shape: vec![b, kv, 1, keys, d],
            },
            &[v],
        )?;
        let scale = 1.0 / (d as f64).sqrt();
        let context = ctx.attention(q, k, v, mask, &[scale], true)?;
        let context = ctx.op(
            "context.heads",
            Op::Reshape {
                shape: vec![b, heads, t, d],
            },
            &[context],
        )?;
        let merged = ctx.merge_heads("context", context)?;
        ctx.linear(
            "o_proj",
            merged,
            &w("self_attn.o_proj.weight"),
            bias(c.attention_bias, "self_attn.o_proj.bias").as_deref(),
            true,
        )
    })?;
    let h = ctx.add("attn_residual", h, attn)?;

    let g = ctx.param(&w("post_attention_layernorm.weight"))?;
    let x = ctx.op("post_attention_layernorm", Op::RmsNorm { eps }, &[h, g])?;
    let mlp = ctx.scoped("mlp", |ctx| -> Result<Value, ModelError> {
        let gate = ctx.linear(
            "gate_proj",
            x,
            &w("mlp.gate_proj.weight"),
            bias(c.mlp_bias, "mlp.gate_proj.bias").as_deref(),
            true,
        )?;
        let act = ctx.op("act", Op::Unary(c.hidden_act.unary()), &[gate])?;
        let up = ctx.linear(
            "up_proj",
            x,
            &w("mlp.up_proj.weight"),
            bias(c.mlp_bias, "mlp.up_proj.bias").as_deref(),
            true,
        )?;
        let gated = ctx.op("gated", Op::Binary(BinaryOp::Mul), &[act, up])?;
        ctx.linear(
            "down_proj",
            gated,
            &w("mlp.down_proj.weight"),
            bias(c.mlp_bias, "mlp.down_proj.bias").as_deref(),
            true,
        )
    })?;
    ctx.add("mlp_residual", h, mlp)
}
