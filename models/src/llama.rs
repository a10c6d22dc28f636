//! LLaMA (`LlamaModel`, `LlamaForCausalLM`), as transformers' `modeling_llama` computes it
//! in eval mode, and the families built from its layers: Qwen2 (biases on q, k and v),
//! Mistral (a sliding attention window) and Gemma (GeGLU, RMSNorm by `1 + weight`, embeddings
//! scaled by √hidden, a head size apart from hidden / heads), each as its own
//! `modeling_<family>` computes it. Rotary frequencies follow `rope_scaling`.
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

use crate::build::{Ctx, KeysSeen};
use crate::config::{Family, LlamaConfig};
use crate::error::{ModelError, ParamSpec};
use crate::model::{pre, Arch, Head};
use castor_ir::{BinaryOp, DType, ModelShape, Op, TensorType, Value};

impl Arch for LlamaConfig {
    fn architectures(&self) -> &'static [(&'static str, Head)] {
        match self.family {
            Family::Qwen2 => &[
                ("Qwen2ForCausalLM", Head::CausalLm),
                ("Qwen2Model", Head::Base),
                (
                    "Qwen2ForSequenceClassification",
                    Head::SequenceClassification,
                ),
            ],
            Family::Mistral => &[
                ("MistralForCausalLM", Head::CausalLm),
                ("MistralModel", Head::Base),
                (
                    "MistralForSequenceClassification",
                    Head::SequenceClassification,
                ),
            ],
            Family::Gemma => &[
                ("GemmaForCausalLM", Head::CausalLm),
                ("GemmaModel", Head::Base),
                (
                    "GemmaForSequenceClassification",
                    Head::SequenceClassification,
                ),
            ],
            _ => &[
                ("LlamaForCausalLM", Head::CausalLm),
                ("LlamaModel", Head::Base),
                (
                    "LlamaForSequenceClassification",
                    Head::SequenceClassification,
                ),
            ],
        }
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
                if self.proj_bias(proj) {
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

    fn dropout(&self) -> crate::config::DropoutRates {
        self.dropout
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
        let mask = ctx.sequence_mask(5)?;

        let emb = ctx.param(&p("embed_tokens.weight"))?;
        let padding = self.pad_token_id;
        let mut h = ctx.op("embed_tokens", Op::Embedding { padding }, &[emb, ids])?;
        if self.gemma_norm_and_embed {
            // Gemma scales the embeddings by √hidden (in the activation dtype).
            let factor = f64::from((self.hidden_size as f32).sqrt());
            h = ctx.op("embed_tokens.scaled", Op::Scale { factor }, &[h])?;
        }
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
        let h = rms_norm(self, ctx, final_name, &p("norm.weight"), h, true)?;
        if head != Head::CausalLm {
            return Ok(vec![h]);
        }
        let lm = if self.tie_word_embeddings {
            p("embed_tokens.weight")
        } else {
            "lm_head.weight".to_string()
        };
        let logits = ctx.lm_head(h, &lm)?;
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
    mask: Option<Value>,
) -> Result<Value, ModelError> {
    let (b, t, keys) = (ctx.batch, ctx.seq, ctx.keys());
    let (heads, kv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let groups = heads / kv;
    let w = |name: &str| format!("{l}{name}");
    let bias = |on: bool, name: &str| on.then(|| w(name));
    // The window matters only when the keys reach past it.
    let keys_seen = match c.sliding_window {
        Some(sw) if index >= sw.first_layer && sw.size < keys => KeysSeen::Window(sw.size),
        _ => KeysSeen::Causal,
    };

    let x = rms_norm(
        c,
        ctx,
        "input_layernorm",
        &w("input_layernorm.weight"),
        h,
        false,
    )?;
    let attn = ctx.scoped("self_attn", |ctx| -> Result<Value, ModelError> {
        let proj = |ctx: &mut Ctx, name: &str, role: &str, n: usize| {
            let y = ctx.linear(
                name,
                x,
                &w(&format!("self_attn.{name}.weight")),
                bias(c.proj_bias(name), &format!("self_attn.{name}.bias")).as_deref(),
                true,
            )?;
            ctx.split_heads(role, y, n, d)
        };
        let q = proj(ctx, "q_proj", "q", heads)?;
        let k = proj(ctx, "k_proj", "k", kv)?;
        let v = proj(ctx, "v_proj", "v", kv)?;
        let (theta, scaling) = (c.rope_theta, c.rope_scaling);
        let q = ctx.rope("q.rope", q, theta, scaling)?;
        let k = ctx.rope("k.rope", k, theta, scaling)?;
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
        let context = ctx.attention(q, k, v, mask, &[scale], keys_seen)?;
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
            bias(c.proj_bias("o_proj"), "self_attn.o_proj.bias").as_deref(),
            true,
        )
    })?;
    let h = ctx.add("attn_residual", h, attn)?;

    let x = rms_norm(
        c,
        ctx,
        "post_attention_layernorm",
        &w("post_attention_layernorm.weight"),
        h,
        false,
    )?;
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

impl LlamaConfig {
    /// Whether attention projection `proj` (`q_proj`, ..., `o_proj`) has a bias.
    fn proj_bias(&self, proj: &str) -> bool {
        self.attention_bias || (self.qkv_bias && proj != "o_proj")
    }
}

/// RMSNorm of `x` by the weight `weight`: `x / rms(x) * weight`, or for Gemma
/// `x / rms(x) * (1 + weight)` (the sum in F32, `name.gain`). `exact` keeps the node's name
/// as given (a graph output).
fn rms_norm(
    c: &LlamaConfig,
    ctx: &mut Ctx,
    name: &str,
    weight: &str,
    x: Value,
    exact: bool,
) -> Result<Value, ModelError> {
    let mut g = ctx.param(weight)?;
    if c.gemma_norm_and_embed {
        let one = ctx.op(
            &format!("{name}.one"),
            Op::Full {
                value: 1.0,
                dtype: DType::F32,
                shape: vec![c.hidden_size],
            },
            &[],
        )?;
        g = ctx.op(
            &format!("{name}.gain"),
            Op::Binary(BinaryOp::Add),
            &[one, g],
        )?;
    }
    let op = Op::RmsNorm {
        eps: c.rms_norm_eps,
    };
    if exact {
        ctx.op_exact(name, op, &[x, g])
    } else {
        ctx.op(name, op, &[x, g])
    }
}
