//! GPT-2 (`GPT2Model`, `GPT2LMHeadModel`), as transformers' `modeling_gpt2` computes it in
//! eval mode.
//!
//! Pre-LN blocks; `Conv1D` weights are `[in, out]` and multiply untransposed; `c_attn` makes
//! q, k and v in one product, split along the feature axis. The LM head is tied to `wte`
//! unless `tie_word_embeddings` is false. Old checkpoints store the causal mask as buffers
//! `h.N.attn.bias` / `h.N.attn.masked_bias`; those are ignored.
//!
//! Values: `wte`, `wpe`, `embeddings`; per block `h.N.`: `ln_1`, `attn.qkv`,
//! `attn.qkv.split{,.1,.2}`, `attn.{q,k,v}.heads`, `attn.{q,k,v}`, `attn.scores`,
//! `attn.scores.scaled`, `attn.probs`, `attn.context`, `attn.context.t`,
//! `attn.context.merged`, `attn.proj`, `attn_residual`, `ln_2`, `mlp.fc`, `mlp.act`,
//! `mlp.proj`, `mlp_residual`; then `ln_f` (or `last_hidden_state`) and `logits`.

use crate::build::{Ctx, KeysSeen};
use crate::config::Gpt2Config;
use crate::error::{ModelError, ParamSpec};
use crate::model::{pre, Arch, Head};
use castor_ir::{DType, ModelShape, Op, TensorType, Value};

impl Arch for Gpt2Config {
    fn architectures(&self) -> &'static [(&'static str, Head)] {
        &[
            ("GPT2LMHeadModel", Head::CausalLm),
            ("GPT2Model", Head::Base),
        ]
    }

    fn base_prefix(&self) -> &'static str {
        "transformer."
    }

    fn marker(&self) -> &'static str {
        "wte.weight"
    }

    fn canonical_prefix(&self, head: Head) -> &'static str {
        if head == Head::CausalLm {
            "transformer."
        } else {
            ""
        }
    }

    fn guess_head(&self, has: &dyn Fn(&str) -> bool, prefix: &str) -> Head {
        if has("lm_head.weight") || prefix == "transformer." {
            Head::CausalLm
        } else {
            Head::Base
        }
    }

    fn params(&self, head: Head, prefix: &str) -> Vec<ParamSpec> {
        let (h, v) = (self.n_embd, self.vocab_size);
        let p = |n: &str| pre(prefix, n);
        let mut out = vec![
            ParamSpec::new(p("wte.weight"), [v, h]),
            ParamSpec::new(p("wpe.weight"), [self.n_positions, h]),
        ];
        for i in 0..self.n_layer {
            let l = |n: &str| p(&format!("h.{i}.{n}"));
            out.extend([
                ParamSpec::new(l("ln_1.weight"), [h]),
                ParamSpec::new(l("ln_1.bias"), [h]),
                ParamSpec::new(l("attn.c_attn.weight"), [h, 3 * h]),
                ParamSpec::new(l("attn.c_attn.bias"), [3 * h]),
                ParamSpec::new(l("attn.c_proj.weight"), [h, h]),
                ParamSpec::new(l("attn.c_proj.bias"), [h]),
                ParamSpec::new(l("ln_2.weight"), [h]),
                ParamSpec::new(l("ln_2.bias"), [h]),
                ParamSpec::new(l("mlp.c_fc.weight"), [h, self.n_inner]),
                ParamSpec::new(l("mlp.c_fc.bias"), [self.n_inner]),
                ParamSpec::new(l("mlp.c_proj.weight"), [self.n_inner, h]),
                ParamSpec::new(l("mlp.c_proj.bias"), [h]),
            ]);
        }
        out.push(ParamSpec::new(p("ln_f.weight"), [h]));
        out.push(ParamSpec::new(p("ln_f.bias"), [h]));
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
        name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
    }

    fn dropout(&self) -> crate::config::DropoutRates {
        self.dropout
    }

    fn max_positions(&self) -> Option<usize> {
        Some(self.n_positions)
    }

    fn shape(&self, batch: usize, seq: usize) -> ModelShape {
        ModelShape {
            layers: self.n_layer,
            width: self.n_embd,
            heads: self.n_head,
            kv_heads: self.n_head,
            head_dim: self.n_embd / self.n_head,
            vocab: self.vocab_size,
            batch,
            seq,
        }
    }

    fn widths(&self) -> (usize, usize) {
        let w = [self.vocab_size, 3 * self.n_embd, self.n_inner];
        (w.into_iter().max().unwrap_or(0), self.n_head)
    }

    fn build(&self, head: Head, prefix: &str, ctx: &mut Ctx) -> Result<Vec<Value>, ModelError> {
        let (b, t) = (ctx.batch, ctx.seq);
        let p = |n: &str| pre(prefix, n);
        let ids = ctx.input("input_ids", TensorType::new(DType::I64, [b, t]))?;
        let mask = ctx.sequence_mask(4)?;

        let wte = ctx.param(&p("wte.weight"))?;
        let tokens = ctx.op("wte", Op::Embedding { padding: None }, &[wte, ids])?;
        let wpe = ctx.param(&p("wpe.weight"))?;
        let past = ctx.past();
        let positions = match ctx.positions()? {
            // Packed rows: each token's learned position in its own sequence.
            Some(ids) => ctx.op("wpe", Op::Embedding { padding: None }, &[wpe, ids])?,
            None => ctx.op(
                "wpe",
                Op::Slice {
                    axis: 0,
                    start: past,
                    end: past + t,
                },
                &[wpe],
            )?,
        };
        let mut h = ctx.add("embeddings", tokens, positions)?;
        let rate = ctx.dropout.embeddings;
        h = ctx.dropout("embeddings.dropout", h, rate)?;
        for i in 0..self.n_layer {
            h = ctx.block(i, &format!("h.{i}"), |ctx| {
                block(self, ctx, &p(&format!("h.{i}.")), i, h, mask)
            })?;
        }

        let eps = self.layer_norm_epsilon;
        let final_name = if head == Head::CausalLm {
            "ln_f"
        } else {
            "last_hidden_state"
        };
        let (w, bias) = (ctx.param(&p("ln_f.weight"))?, ctx.param(&p("ln_f.bias"))?);
        let h = ctx.op_exact(final_name, Op::LayerNorm { eps }, &[h, w, bias])?;
        if head != Head::CausalLm {
            return Ok(vec![h]);
        }
        let lm = if self.tie_word_embeddings {
            p("wte.weight")
        } else {
            "lm_head.weight".to_string()
        };
        let logits = ctx.lm_head(h, &lm)?;
        Ok(vec![logits])
    }
}

/// One pre-LN block; `l` is the block's parameter prefix (`transformer.h.3.`).
fn block(
    c: &Gpt2Config,
    ctx: &mut Ctx,
    l: &str,
    layer: usize,
    h: Value,
    mask: Option<Value>,
) -> Result<Value, ModelError> {
    let (n, heads) = (c.n_embd, c.n_head);
    let d = n / heads;
    let w = |name: &str| format!("{l}{name}");
    let eps = c.layer_norm_epsilon;
    let ln = |ctx: &mut Ctx, name: &str, x: Value| -> Result<Value, ModelError> {
        let (g, b) = (
            ctx.param(&w(&format!("{name}.weight")))?,
            ctx.param(&w(&format!("{name}.bias")))?,
        );
        ctx.op(name, Op::LayerNorm { eps }, &[x, g, b])
    };

    let x = ln(ctx, "ln_1", h)?;
    let attn = ctx.scoped("attn", |ctx| -> Result<Value, ModelError> {
        let qkv = ctx.linear(
            "qkv",
            x,
            &w("attn.c_attn.weight"),
            Some(&w("attn.c_attn.bias")),
            false,
        )?;
        let parts = ctx.op_multi(
            "qkv.split",
            Op::Split {
                axis: 2,
                sizes: vec![n, n, n],
            },
            &[qkv],
        )?;
        let q = ctx.split_heads("q", parts[0], heads, d)?;
        let k = ctx.split_heads("k", parts[1], heads, d)?;
        let v = ctx.split_heads("v", parts[2], heads, d)?;
        let (k, v) = ctx.cache_kv(layer, k, v)?;
        let mut scales = Vec::new();
        if c.scale_attn_weights {
            scales.push(1.0 / (d as f64).sqrt());
        }
        if c.scale_attn_by_inverse_layer_idx {
            scales.push(1.0 / (layer + 1) as f64);
        }
        let context = ctx.attention(q, k, v, mask, &scales, KeysSeen::Causal)?;
        let merged = ctx.merge_heads("context", context)?;
        let out = ctx.linear(
            "proj",
            merged,
            &w("attn.c_proj.weight"),
            Some(&w("attn.c_proj.bias")),
            false,
        )?;
        let rate = ctx.dropout.residual;
        ctx.dropout("proj.dropout", out, rate)
    })?;
    let h = ctx.add("attn_residual", attn, h)?;

    let x = ln(ctx, "ln_2", h)?;
    let mlp = ctx.scoped("mlp", |ctx| -> Result<Value, ModelError> {
        let fc = ctx.linear(
            "fc",
            x,
            &w("mlp.c_fc.weight"),
            Some(&w("mlp.c_fc.bias")),
            false,
        )?;
        let act = ctx.op("act", Op::Unary(c.activation.unary()), &[fc])?;
        let out = ctx.linear(
            "proj",
            act,
            &w("mlp.c_proj.weight"),
            Some(&w("mlp.c_proj.bias")),
            false,
        )?;
        let rate = ctx.dropout.residual;
        ctx.dropout("proj.dropout", out, rate)
    })?;
    ctx.add("mlp_residual", mlp, h)
}
