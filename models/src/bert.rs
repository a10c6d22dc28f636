//! BERT (`BertModel` with or without pooler, `BertForMaskedLM`), as transformers'
//! `modeling_bert` computes it in eval mode.
//!
//! Embeddings are word + token type + position (rows `0..T`), then LayerNorm; encoder layers
//! are post-LN with `nn.Linear` weights `[out, in]`; attention is bidirectional with the
//! padding mask. The MLM head's decoder is tied to the word embeddings (unless
//! `tie_word_embeddings` is false) and its bias is `cls.predictions.bias`
//! (`cls.predictions.decoder.bias` is the same parameter, so a stored copy is ignored).
//! `embeddings.position_ids` / `embeddings.token_type_ids` buffers are ignored.
//!
//! Values: `embeddings.{words,token_types,with_token_types,positions,with_positions,
//! LayerNorm}`; per layer `encoder.layer.N.`: `attention.{query,key,value}`,
//! `attention.{q,k,v}.heads`, `attention.{q,k,v}`, `attention.scores`,
//! `attention.scores.scaled`, `attention.probs`, `attention.context`, `attention.context.t`,
//! `attention.context.merged`, `attention.output.dense`, `attention.output.residual`,
//! `attention.output.LayerNorm`, `intermediate.dense`, `intermediate.act`, `output.dense`,
//! `output.residual`, `output.LayerNorm` (the last layer's is `last_hidden_state`); then
//! `pooler.first_token{,.flat}`, `pooler.dense`, `pooler_output`, or
//! `cls.predictions.transform.{dense,act,LayerNorm}`, `cls.predictions.decoder.matmul`,
//! `logits`.

use crate::build::{Ctx, KeysSeen};
use crate::config::BertConfig;
use crate::error::{ModelError, ParamSpec};
use crate::model::{pre, Arch, Head};
use castor_ir::{DType, ModelShape, Op, TensorType, Value};

impl Arch for BertConfig {
    fn architectures(&self) -> &'static [(&'static str, Head)] {
        &[
            ("BertForMaskedLM", Head::MaskedLm),
            ("BertModel", Head::Pooler),
            (
                "BertForSequenceClassification",
                Head::SequenceClassification,
            ),
        ]
    }

    fn base_prefix(&self) -> &'static str {
        "bert."
    }

    fn marker(&self) -> &'static str {
        "embeddings.word_embeddings.weight"
    }

    fn canonical_prefix(&self, head: Head) -> &'static str {
        if matches!(head, Head::MaskedLm | Head::SequenceClassification) {
            "bert."
        } else {
            ""
        }
    }

    fn guess_head(&self, has: &dyn Fn(&str) -> bool, prefix: &str) -> Head {
        if has("cls.predictions.bias") {
            Head::MaskedLm
        } else if has("classifier.weight") {
            Head::SequenceClassification
        } else {
            self.confirm_head(Head::Pooler, has, prefix)
        }
    }

    fn confirm_head(&self, head: Head, has: &dyn Fn(&str) -> bool, prefix: &str) -> Head {
        if head == Head::Pooler && !has(&pre(prefix, "pooler.dense.weight")) {
            Head::Base
        } else {
            head
        }
    }

    fn params(&self, head: Head, prefix: &str) -> Vec<ParamSpec> {
        let (h, v, i_sz) = (self.hidden_size, self.vocab_size, self.intermediate_size);
        let p = |n: &str| pre(prefix, n);
        let mut out = vec![
            ParamSpec::new(p("embeddings.word_embeddings.weight"), [v, h]),
            ParamSpec::new(
                p("embeddings.position_embeddings.weight"),
                [self.max_position_embeddings, h],
            ),
            ParamSpec::new(
                p("embeddings.token_type_embeddings.weight"),
                [self.type_vocab_size, h],
            ),
            ParamSpec::new(p("embeddings.LayerNorm.weight"), [h]),
            ParamSpec::new(p("embeddings.LayerNorm.bias"), [h]),
        ];
        for i in 0..self.num_hidden_layers {
            let l = |n: &str| p(&format!("encoder.layer.{i}.{n}"));
            for m in ["query", "key", "value"] {
                out.push(ParamSpec::new(
                    l(&format!("attention.self.{m}.weight")),
                    [h, h],
                ));
                out.push(ParamSpec::new(l(&format!("attention.self.{m}.bias")), [h]));
            }
            out.extend([
                ParamSpec::new(l("attention.output.dense.weight"), [h, h]),
                ParamSpec::new(l("attention.output.dense.bias"), [h]),
                ParamSpec::new(l("attention.output.LayerNorm.weight"), [h]),
                ParamSpec::new(l("attention.output.LayerNorm.bias"), [h]),
                ParamSpec::new(l("intermediate.dense.weight"), [i_sz, h]),
                ParamSpec::new(l("intermediate.dense.bias"), [i_sz]),
                ParamSpec::new(l("output.dense.weight"), [h, i_sz]),
                ParamSpec::new(l("output.dense.bias"), [h]),
                ParamSpec::new(l("output.LayerNorm.weight"), [h]),
                ParamSpec::new(l("output.LayerNorm.bias"), [h]),
            ]);
        }
        match head {
            // The classifier itself is `classify.rs`'s.
            Head::Pooler | Head::SequenceClassification => out.extend([
                ParamSpec::new(p("pooler.dense.weight"), [h, h]),
                ParamSpec::new(p("pooler.dense.bias"), [h]),
            ]),
            Head::MaskedLm => {
                out.extend([
                    ParamSpec::new("cls.predictions.bias", [v]),
                    ParamSpec::new("cls.predictions.transform.dense.weight", [h, h]),
                    ParamSpec::new("cls.predictions.transform.dense.bias", [h]),
                    ParamSpec::new("cls.predictions.transform.LayerNorm.weight", [h]),
                    ParamSpec::new("cls.predictions.transform.LayerNorm.bias", [h]),
                ]);
                if !self.tie_word_embeddings {
                    out.push(ParamSpec::new("cls.predictions.decoder.weight", [v, h]));
                }
            }
            Head::Base | Head::CausalLm => {}
        }
        out
    }

    fn tied_copies(&self, head: Head, _prefix: &str) -> Vec<String> {
        if head != Head::MaskedLm {
            return vec![];
        }
        let mut out = vec!["cls.predictions.decoder.bias".to_string()];
        if self.tie_word_embeddings {
            out.push("cls.predictions.decoder.weight".into());
        }
        out
    }

    fn is_buffer(&self, name: &str) -> bool {
        name.ends_with("position_ids") || name.ends_with("embeddings.token_type_ids")
    }

    fn dropout(&self) -> crate::config::DropoutRates {
        self.dropout
    }

    fn max_positions(&self) -> Option<usize> {
        Some(self.max_position_embeddings)
    }

    fn shape(&self, batch: usize, seq: usize) -> ModelShape {
        ModelShape {
            layers: self.num_hidden_layers,
            width: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_attention_heads,
            head_dim: self.hidden_size / self.num_attention_heads,
            vocab: self.vocab_size,
            batch,
            seq,
        }
    }

    fn widths(&self) -> (usize, usize) {
        let w = [self.vocab_size, self.hidden_size, self.intermediate_size];
        (w.into_iter().max().unwrap_or(0), self.num_attention_heads)
    }

    fn build(&self, head: Head, prefix: &str, ctx: &mut Ctx) -> Result<Vec<Value>, ModelError> {
        let (b, t) = (ctx.batch, ctx.seq);
        let eps = self.layer_norm_eps;
        let p = |n: &str| pre(prefix, n);
        let ids_ty = TensorType::new(DType::I64, [b, t]);
        let ids = ctx.input("input_ids", ids_ty.clone())?;
        let am = ctx.input("attention_mask", ids_ty.clone())?;
        let tt = ctx.input("token_type_ids", ids_ty)?;
        let mask = ctx.key_mask(am, 4)?;

        let mut h = ctx.scoped("embeddings", |ctx| -> Result<Value, ModelError> {
            let we = ctx.param(&p("embeddings.word_embeddings.weight"))?;
            let padding = self.pad_token_id;
            let words = ctx.op("words", Op::Embedding { padding }, &[we, ids])?;
            let te = ctx.param(&p("embeddings.token_type_embeddings.weight"))?;
            let types = ctx.op("token_types", Op::Embedding { padding: None }, &[te, tt])?;
            let x = ctx.add("with_token_types", words, types)?;
            let pe = ctx.param(&p("embeddings.position_embeddings.weight"))?;
            let pos = ctx.op(
                "positions",
                Op::Slice {
                    axis: 0,
                    start: 0,
                    end: t,
                },
                &[pe],
            )?;
            let x = ctx.add("with_positions", x, pos)?;
            let x = layer_norm(ctx, "LayerNorm", &p("embeddings.LayerNorm"), x, eps, false)?;
            let rate = ctx.dropout.embeddings;
            ctx.dropout("dropout", x, rate)
        })?;

        let n = self.num_hidden_layers;
        for i in 0..n {
            let last = i + 1 == n && head != Head::MaskedLm;
            let l = p(&format!("encoder.layer.{i}."));
            h = ctx.block(i, &format!("encoder.layer.{i}"), |ctx| {
                layer(self, ctx, &l, h, mask, last)
            })?;
        }

        match head {
            Head::Base | Head::CausalLm => Ok(vec![h]),
            Head::Pooler | Head::SequenceClassification => {
                let pooled = ctx.scoped("pooler", |ctx| -> Result<Value, ModelError> {
                    let first = ctx.op(
                        "first_token",
                        Op::Slice {
                            axis: 1,
                            start: 0,
                            end: 1,
                        },
                        &[h],
                    )?;
                    let first = ctx.op(
                        "first_token.flat",
                        Op::Reshape {
                            shape: vec![b, self.hidden_size],
                        },
                        &[first],
                    )?;
                    ctx.linear(
                        "dense",
                        first,
                        &p("pooler.dense.weight"),
                        Some(&p("pooler.dense.bias")),
                        true,
                    )
                })?;
                let pooled = ctx.op_exact(
                    "pooler_output",
                    Op::Unary(castor_ir::UnaryOp::Tanh),
                    &[pooled],
                )?;
                Ok(vec![h, pooled])
            }
            Head::MaskedLm => {
                let y = ctx.scoped("cls.predictions", |ctx| -> Result<Value, ModelError> {
                    let x = ctx.linear(
                        "transform.dense",
                        h,
                        "cls.predictions.transform.dense.weight",
                        Some("cls.predictions.transform.dense.bias"),
                        true,
                    )?;
                    let x = ctx.op("transform.act", Op::Unary(self.hidden_act.unary()), &[x])?;
                    let x = layer_norm(
                        ctx,
                        "transform.LayerNorm",
                        "cls.predictions.transform.LayerNorm",
                        x,
                        eps,
                        false,
                    )?;
                    let dec = if self.tie_word_embeddings {
                        p("embeddings.word_embeddings.weight")
                    } else {
                        "cls.predictions.decoder.weight".to_string()
                    };
                    let dec = ctx.param(&dec)?;
                    ctx.op(
                        "decoder.matmul",
                        Op::MatMul {
                            transpose_a: false,
                            transpose_b: true,
                        },
                        &[x, dec],
                    )
                })?;
                let bias = ctx.param("cls.predictions.bias")?;
                let logits =
                    ctx.op_exact("logits", Op::Binary(castor_ir::BinaryOp::Add), &[y, bias])?;
                Ok(vec![logits])
            }
        }
    }
}

/// LayerNorm with parameters `{module}.weight` / `{module}.bias`, named `name` (or exactly
/// `last_hidden_state` when `is_output`).
fn layer_norm(
    ctx: &mut Ctx,
    name: &str,
    module: &str,
    x: Value,
    eps: f64,
    is_output: bool,
) -> Result<Value, ModelError> {
    let g = ctx.param(&format!("{module}.weight"))?;
    let b = ctx.param(&format!("{module}.bias"))?;
    if is_output {
        ctx.op_exact("last_hidden_state", Op::LayerNorm { eps }, &[x, g, b])
    } else {
        ctx.op(name, Op::LayerNorm { eps }, &[x, g, b])
    }
}

/// One post-LN encoder layer; `l` is its parameter prefix (`bert.encoder.layer.1.`).
fn layer(
    c: &BertConfig,
    ctx: &mut Ctx,
    l: &str,
    h: Value,
    mask: Value,
    is_output: bool,
) -> Result<Value, ModelError> {
    let heads = c.num_attention_heads;
    let d = c.hidden_size / heads;
    let eps = c.layer_norm_eps;
    let w = |name: &str| format!("{l}{name}");
    let attn = ctx.scoped("attention", |ctx| -> Result<Value, ModelError> {
        let mut qkv = Vec::with_capacity(3);
        for (m, role) in [("query", "q"), ("key", "k"), ("value", "v")] {
            let y = ctx.linear(
                m,
                h,
                &w(&format!("attention.self.{m}.weight")),
                Some(&w(&format!("attention.self.{m}.bias"))),
                true,
            )?;
            qkv.push(ctx.split_heads(role, y, heads, d)?);
        }
        let scale = 1.0 / (d as f64).sqrt();
        let context = ctx.attention(qkv[0], qkv[1], qkv[2], Some(mask), &[scale], KeysSeen::All)?;
        let merged = ctx.merge_heads("context", context)?;
        let y = ctx.linear(
            "output.dense",
            merged,
            &w("attention.output.dense.weight"),
            Some(&w("attention.output.dense.bias")),
            true,
        )?;
        let residual = ctx.dropout.residual;
        let y = ctx.dropout("output.dropout", y, residual)?;
        let y = ctx.add("output.residual", y, h)?;
        layer_norm(
            ctx,
            "output.LayerNorm",
            &w("attention.output.LayerNorm"),
            y,
            eps,
            false,
        )
    })?;
    let x = ctx.linear(
        "intermediate.dense",
        attn,
        &w("intermediate.dense.weight"),
        Some(&w("intermediate.dense.bias")),
        true,
    )?;
    let x = ctx.op("intermediate.act", Op::Unary(c.hidden_act.unary()), &[x])?;
    let y = ctx.linear(
        "output.dense",
        x,
        &w("output.dense.weight"),
        Some(&w("output.dense.bias")),
        true,
    )?;
    let residual = ctx.dropout.residual;
    let y = ctx.dropout("output.dropout", y, residual)?;
    let y = ctx.add("output.residual", y, attn)?;
    layer_norm(
        ctx,
        "output.LayerNorm",
        &w("output.LayerNorm"),
        y,
        eps,
        is_output,
    )
}
