//! Models from config.json alone: parameter counts against transformers' `num_parameters()`,
//! graphs that verify, names that trace back to the model, and config errors.

use crate::common;

use castor_ir::{DType, Graph, Op};
use castor_models::{Config, Family, Head, Model};
use common::{assert_contains, err_text};
use std::collections::BTreeMap;

fn model(json: &str) -> Model {
    Model::from_config(Config::parse(json, "inline/config.json").expect("config parses"))
        .expect("model builds")
}

fn model_err(json: &str) -> String {
    err_text(Config::parse(json, "inline/config.json").and_then(Model::from_config))
}

/// Verifies the graph and checks that its parameters are exactly the expected ones (names
/// and shapes), its inputs and outputs are the documented ones, and every param is used.
pub fn check_graph(m: &Model, g: &Graph, batch: usize, seq: usize) {
    castor_ir::verify(g).expect("graph verifies");
    let params: BTreeMap<String, Vec<usize>> = g
        .params()
        .map(|v| (g.name(v).to_string(), g.ty(v).shape.0.clone()))
        .collect();
    let expected: BTreeMap<String, Vec<usize>> = m
        .expected_params()
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    assert_eq!(params, expected, "graph params differ from expected_params");
    assert!(g.params().all(|v| g.ty(v).dtype == DType::F32));
    let inputs: Vec<&str> = g.inputs().map(|v| g.name(v)).collect();
    assert_eq!(inputs, m.input_names());
    for v in g.inputs() {
        assert_eq!(g.ty(v).dtype, DType::I64);
        assert_eq!(g.ty(v).shape.0, vec![batch, seq]);
    }
    let outputs: Vec<&str> = g.outputs().iter().map(|&v| g.name(v)).collect();
    assert_eq!(outputs, m.output_names());
    let users = g.users();
    for v in g.params().chain(g.inputs()) {
        assert!(!users[v.index()].is_empty(), "`{}` is unused", g.name(v));
    }
}

fn has(g: &Graph, names: &[&str]) {
    for n in names {
        assert!(g.lookup(n).is_some(), "graph has no value `{n}`");
    }
}

fn op_of<'g>(g: &'g Graph, name: &str) -> &'g Op {
    let v = g
        .lookup(name)
        .unwrap_or_else(|| panic!("no value `{name}`"));
    &g.node(g.value(v).producer).op
}

const GPT2_124M: &str = r#"{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
  "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}"#;

#[test]
fn gpt2_124m_count_and_graph() {
    let m = model(GPT2_124M);
    assert_eq!(m.family(), Family::Gpt2);
    assert_eq!(m.head(), Head::CausalLm);
    assert_eq!(m.architecture(), "GPT2LMHeadModel");
    assert_eq!(m.prefix(), "transformer.");
    assert_eq!(m.parameter_count(), 124_439_808);
    assert_eq!(m.expected_params().len(), 2 + 12 * 12 + 2);
    let g = m.build_graph(2, 7).expect("graph");
    check_graph(&m, &g, 2, 7);
    has(
        &g,
        &[
            "wte",
            "embeddings",
            "h.3.attn.qkv",
            "h.3.attn.q",
            "h.3.attn.scores",
            "h.3.attn.probs",
            "h.11.mlp_residual",
            "ln_f",
            "logits",
            "transformer.h.3.attn.c_attn.weight",
        ],
    );
    assert_eq!(g.ty(g.lookup("logits").unwrap()).shape.0, vec![2, 7, 50257]);
    assert_eq!(
        g.ty(g.lookup("h.3.attn.q").unwrap()).shape.0,
        vec![2, 12, 7, 64]
    );
    assert_eq!(
        op_of(&g, "h.0.attn.probs"),
        &Op::Softmax {
            causal: true,
            window: None
        }
    );
    assert_eq!(
        op_of(&g, "h.0.mlp.act"),
        &Op::Unary(castor_ir::UnaryOp::GeluTanh)
    );
    // Tied head: the logits read the token table.
    let logits = g.node(g.value(g.lookup("logits").unwrap()).producer);
    assert_eq!(g.name(logits.inputs[1]), "transformer.wte.weight");
    // Text round trip of a real model graph.
    let text = castor_ir::text::print(&g);
    let back = castor_ir::text::parse(&text).expect("parses");
    castor_ir::verify(&back).expect("parsed graph verifies");
    assert_eq!(castor_ir::text::print(&back), text);
}

#[test]
fn gpt2_base_model_has_no_prefix_and_same_count() {
    let m = model(r#"{"model_type": "gpt2", "architectures": ["GPT2Model"], "n_layer": 12}"#);
    assert_eq!(m.head(), Head::Base);
    assert_eq!(m.prefix(), "");
    assert_eq!(m.parameter_count(), 124_439_808);
    let g = m.build_graph(1, 4).unwrap();
    check_graph(&m, &g, 1, 4);
    has(&g, &["last_hidden_state", "wte.weight", "h.0.ln_1"]);
}

#[test]
fn gpt2_defaults_and_untied_head() {
    // Every field defaulted except the family: GPT-2 small.
    let m = model(r#"{"model_type": "gpt2"}"#);
    assert_eq!(
        m.head(),
        Head::Base,
        "no architectures: what AutoModel builds"
    );
    assert_eq!(m.parameter_count(), 124_439_808);
    let m = model(
        r#"{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "tie_word_embeddings": false, "n_layer": 1, "n_embd": 8, "n_head": 2,
            "vocab_size": 10, "n_positions": 4, "n_inner": null}"#,
    );
    assert!(m
        .expected_params()
        .iter()
        .any(|p| p.name == "lm_head.weight"));
    let g = m.build_graph(1, 4).unwrap();
    check_graph(&m, &g, 1, 4);
}

const LLAMA_7B: &str = r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"],
  "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
  "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "tie_word_embeddings": false, "torch_dtype": "float16"}"#;

#[test]
fn llama2_7b_count_and_graph() {
    let m = model(LLAMA_7B);
    assert_eq!(m.parameter_count(), 6_738_415_616);
    assert_eq!(m.prefix(), "model.");
    let g = m.build_graph(1, 5).unwrap();
    check_graph(&m, &g, 1, 5);
    has(
        &g,
        &[
            "embed_tokens",
            "layers.0.self_attn.q",
            "layers.0.self_attn.q.rope",
            "layers.0.self_attn.q.groups",
            "layers.31.mlp.gated",
            "norm",
            "logits",
            "lm_head.weight",
        ],
    );
    assert_eq!(
        g.ty(g.lookup("layers.0.self_attn.q.groups").unwrap())
            .shape
            .0,
        vec![1, 32, 1, 5, 128]
    );
}

#[test]
fn llama_gqa_shapes_and_tied_count() {
    let json = r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"],
      "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40,
      "rope_theta": 500000, "tie_word_embeddings": true}"#;
    let m = model(json);
    // embed 640 + 2 * (norms 32 + q 256 + k 128 + v 128 + o 256 + mlp 3*384) + norm 16
    assert_eq!(
        m.parameter_count(),
        640 + 2 * (32 + 256 + 128 + 128 + 256 + 1152) + 16
    );
    let g = m.build_graph(2, 3).unwrap();
    check_graph(&m, &g, 2, 3);
    let shape = |n: &str| g.ty(g.lookup(n).unwrap()).shape.0.clone();
    assert_eq!(shape("layers.1.self_attn.q.groups"), vec![2, 2, 2, 3, 4]);
    assert_eq!(shape("layers.1.self_attn.k.groups"), vec![2, 2, 1, 3, 4]);
    assert_eq!(shape("layers.1.self_attn.scores"), vec![2, 2, 2, 3, 3]);
    assert_eq!(shape("layers.1.self_attn.context.merged"), vec![2, 3, 16]);
    assert_eq!(shape("attention_mask.keys"), vec![2, 1, 1, 1, 3]);
    assert_eq!(
        op_of(&g, "layers.0.self_attn.q.rope"),
        &Op::Rope {
            theta: 500000.0,
            scaling: castor_ir::RopeScaling::None
        }
    );
    let logits = g.node(g.value(g.lookup("logits").unwrap()).producer);
    assert_eq!(g.name(logits.inputs[1]), "model.embed_tokens.weight");
    // MQA and an explicit head_dim that is not hidden / heads.
    let m = model(
        r#"{"model_type": "llama", "hidden_size": 12, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 1,
            "head_dim": 6, "vocab_size": 7, "attention_bias": true, "mlp_bias": true}"#,
    );
    assert_eq!(m.head(), Head::Base);
    let g = m.build_graph(1, 2).unwrap();
    check_graph(&m, &g, 1, 2);
    assert!(m
        .expected_params()
        .iter()
        .any(|p| p.name == "layers.0.self_attn.q_proj.bias" && p.shape == vec![18]));
}

const BERT_BASE: &str = r#"{"model_type": "bert", "architectures": ["BertModel"],
  "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
  "intermediate_size": 3072, "vocab_size": 30522, "max_position_embeddings": 512,
  "type_vocab_size": 2, "hidden_act": "gelu"}"#;

#[test]
fn bert_base_counts_and_graph() {
    let m = model(BERT_BASE);
    assert_eq!(m.head(), Head::Pooler);
    // bert-base-uncased as BertModel (with pooler).
    assert_eq!(m.parameter_count(), 109_482_240);
    let g = m.build_graph(2, 6).unwrap();
    check_graph(&m, &g, 2, 6);
    has(
        &g,
        &[
            "embeddings.LayerNorm",
            "encoder.layer.1.attention.scores",
            "encoder.layer.1.attention.output.LayerNorm",
            "encoder.layer.10.output.LayerNorm",
            "last_hidden_state",
            "pooler_output",
            "token_type_ids",
        ],
    );
    assert_eq!(
        op_of(&g, "encoder.layer.0.attention.probs"),
        &Op::Softmax {
            causal: false,
            window: None
        }
    );
    assert_eq!(
        g.ty(g.lookup("pooler_output").unwrap()).shape.0,
        vec![2, 768]
    );

    let mlm = model(&BERT_BASE.replace("\"BertModel\"", "\"BertForMaskedLM\""));
    assert_eq!(mlm.head(), Head::MaskedLm);
    assert_eq!(mlm.prefix(), "bert.");
    // bert-base-uncased as BertForMaskedLM: no pooler, tied decoder.
    assert_eq!(mlm.parameter_count(), 109_514_298);
    let g = mlm.build_graph(1, 3).unwrap();
    check_graph(&mlm, &g, 1, 3);
    assert_eq!(g.ty(g.lookup("logits").unwrap()).shape.0, vec![1, 3, 30522]);
    has(
        &g,
        &[
            "cls.predictions.transform.LayerNorm",
            "bert.encoder.layer.0.attention.self.query.weight",
        ],
    );
}

#[test]
fn graph_size_errors() {
    let m = model(GPT2_124M);
    assert_contains(
        &err_text(m.build_graph(1, 1025)),
        &["sequence length 1025", "1024 learned positions"],
    );
    assert_contains(&err_text(m.build_graph(0, 3)), &["batch 0"]);
    assert_contains(
        &err_text(m.build_graph(usize::MAX / 2, 1024)),
        &["largest activation"],
    );
}

#[test]
fn config_errors() {
    assert_contains(
        &model_err(r#"{"model_type": "t5"}"#),
        &[
            "unsupported model_type `t5`",
            "gpt2, bert, llama",
            "inline/config.json",
        ],
    );
    assert_contains(&model_err(r#"{"n_embd": 3}"#), &["model_type", "(missing)"]);
    assert_contains(
        &model_err(r#"{"model_type": "gpt2", "n_embd": 768, "n_head": 5}"#),
        &["`n_head`", "n_head = 5 does not divide n_embd = 768"],
    );
    assert_contains(
        &model_err(r#"{"model_type": "bert", "hidden_size": 100, "num_attention_heads": 12}"#),
        &["num_attention_heads = 12 does not divide hidden_size = 100"],
    );
    assert_contains(
        &model_err(
            r#"{"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 5}"#,
        ),
        &["num_key_value_heads = 5 does not divide num_attention_heads = 32"],
    );
    assert_contains(
        &model_err(
            r#"{"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}}"#,
        ),
        &[
            "`rope_scaling`",
            "not supported",
            "dynamic",
            "default, linear and llama3",
        ],
    );
    assert_contains(
        &model_err(r#"{"model_type": "gpt2", "activation_function": "relu"}"#),
        &[
            "`activation_function`",
            "unsupported activation `relu`",
            "gelu_new",
        ],
    );
    assert_contains(
        &model_err(r#"{"model_type": "bert", "architectures": ["BertForTokenClassification"]}"#),
        &[
            "BertForTokenClassification",
            "BertForMaskedLM, BertModel, BertForSequenceClassification",
        ],
    );
    assert_contains(
        &model_err(r#"{"model_type": "gpt2", "n_layer": 1000000000}"#),
        &["`n_layer`", "1 to 10000 layers", "1000000000"],
    );
    assert_contains(
        &model_err(r#"{"model_type": "gpt2", "n_embd": 0}"#),
        &["`n_embd`", "positive integer, found 0"],
    );
    assert_contains(
        &model_err(r#"{"model_type": "gpt2", "n_embd": "768"}"#),
        &["`n_embd`", "expected a positive integer, found \"768\""],
    );
    assert_contains(
        &model_err(r#"{"model_type": "gpt2", "n_embd": 99999999999}"#),
        &["`n_embd`", "absurd"],
    );
    assert_contains(
        &model_err(
            r#"{"model_type": "llama", "hidden_size": 2000000000, "vocab_size": 2000000000,
                "num_attention_heads": 1, "num_hidden_layers": 10000}"#,
        ),
        &["parameters, more than the limit"],
    );
    assert_contains(
        &model_err(r#"{"model_type": "llama", "head_dim": 7}"#),
        &["`head_dim`", "even head size, found 7"],
    );
    assert_contains(&model_err("{not json"), &["not valid JSON"]);
    assert_contains(
        &model_err(r#"{"model_type": "gpt2", "add_cross_attention": true}"#),
        &["cross-attention is not supported"],
    );
    assert_contains(
        &model_err(r#"{"model_type": "bert", "position_embedding_type": "relative_key"}"#),
        &["position_embedding_type", "relative_key"],
    );
}

#[test]
fn rope_parameters_of_transformers_5() {
    let theta = |json: &str| match model(json).config().model.clone() {
        castor_models::ModelConfig::Llama(c) => c.rope_theta,
        other => panic!("{other:?}"),
    };
    let base = r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 9"#;
    assert_eq!(theta(&format!("{base}}}")), 10000.0);
    assert_eq!(theta(&format!("{base}, \"rope_theta\": 5e5}}")), 500000.0);
    assert_eq!(
        theta(&format!(
            "{base}, \"rope_parameters\": {{\"rope_type\": \"default\", \"rope_theta\": 500000.0}}}}"
        )),
        500000.0
    );
    assert_eq!(
        theta(&format!(
            "{base}, \"rope_scaling\": {{\"type\": \"default\"}}}}"
        )),
        10000.0
    );
    assert_contains(
        &model_err(&format!(
            "{base}, \"rope_parameters\": {{\"rope_type\": \"llama3\", \"factor\": 8.0}}}}"
        )),
        &[
            "`rope_parameters.original_max_position_embeddings`",
            "rope scaling `llama3` needs",
        ],
    );
}

/// Every unimplemented field is refused by name, with its value.
#[test]
fn decoder_family_features_castor_lacks_are_errors() {
    for (json, words) in [
        (
            r#"{"model_type": "llama", "sliding_window": 4096}"#,
            &["`sliding_window`", "4096", "llama, which declares none"][..],
        ),
        (
            r#"{"model_type": "gemma", "attn_logit_softcapping": 50.0}"#,
            &["`attn_logit_softcapping`", "50.0", "soft-capping"][..],
        ),
        (
            r#"{"model_type": "gemma", "use_bidirectional_attention": true}"#,
            &["`use_bidirectional_attention`", "bidirectional"][..],
        ),
        (
            r#"{"model_type": "mistral", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}"#,
            &["`rope_parameters`", "rope scaling `yarn`", "not supported"][..],
        ),
        (
            r#"{"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}}"#,
            &["`rope_scaling`", "low_freq_factor < high_freq_factor"][..],
        ),
        (
            r#"{"model_type": "qwen2", "num_hidden_layers": 2, "use_sliding_window": true,
                "max_window_layers": 1,
                "layer_types": ["full_attention", "full_attention"]}"#,
            &["`layer_types`", "disagrees", "from layer 1"][..],
        ),
        (
            r#"{"model_type": "mistral", "num_hidden_layers": 2, "hidden_act": "relu"}"#,
            &["`hidden_act`", "unsupported activation `relu`"][..],
        ),
    ] {
        assert_contains(&model_err(json), words);
    }
}

/// Each family's defaults are its transformers config class's, and the windows land on the
/// layers the family puts them on.
#[test]
fn decoder_family_defaults_and_windows() {
    let config = |json: &str| match model(json).config().model.clone() {
        castor_models::ModelConfig::Llama(c) => c,
        other => panic!("{other:?}"),
    };
    let gemma = config(r#"{"model_type": "gemma", "hidden_act": "gelu"}"#);
    assert_eq!(
        (gemma.head_dim, gemma.vocab_size, gemma.tie_word_embeddings),
        (256, 256000, true)
    );
    assert_eq!(gemma.hidden_act, castor_models::Activation::GeluTanh);
    assert!(gemma.gemma_norm_and_embed);
    let mistral = config(r#"{"model_type": "mistral"}"#);
    assert_eq!(mistral.num_key_value_heads, 8);
    assert_eq!(
        mistral.sliding_window,
        Some(castor_models::SlidingWindow {
            size: 4096,
            first_layer: 0
        })
    );
    assert_eq!(
        config(r#"{"model_type": "mistral", "sliding_window": null}"#).sliding_window,
        None
    );
    let qwen = config(r#"{"model_type": "qwen2", "sliding_window": 4096}"#);
    assert!(qwen.qkv_bias && !qwen.attention_bias);
    assert_eq!(
        qwen.sliding_window, None,
        "use_sliding_window defaults to false"
    );
    let qwen = config(
        r#"{"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": true,
            "sliding_window": 64, "max_window_layers": 2,
            "layer_types": ["full_attention", "full_attention", "sliding_attention",
                            "sliding_attention"]}"#,
    );
    assert_eq!(
        qwen.sliding_window,
        Some(castor_models::SlidingWindow {
            size: 64,
            first_layer: 2
        })
    );
    let g = model(
        r#"{"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 8,
            "vocab_size": 9, "use_sliding_window": true, "sliding_window": 3,
            "max_window_layers": 2}"#,
    )
    .build_graph(1, 8)
    .unwrap();
    assert_eq!(
        op_of(&g, "layers.1.self_attn.probs"),
        &Op::Softmax {
            causal: true,
            window: None
        }
    );
    assert_eq!(
        op_of(&g, "layers.2.self_attn.probs"),
        &Op::Softmax {
            causal: true,
            window: Some(3)
        }
    );
    let llama31 = config(
        r#"{"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}}"#,
    );
    assert_eq!(
        llama31.rope_scaling,
        castor_ir::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original: 8192
        }
    );
}

#[test]
fn config_only_has_no_weights() {
    let m = model(GPT2_124M);
    assert_contains(
        &err_text(m.load_params()),
        &["without a checkpoint", "load_params"],
    );
    assert!(m.checkpoint().is_none());
    assert_eq!(m.report(), &Default::default());
}

#[test]
fn load_accepts_a_bare_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("my-config.json");
    std::fs::write(&path, GPT2_124M).unwrap();
    let m = Model::load(&path).unwrap();
    assert_eq!(m.parameter_count(), 124_439_808);
    assert_contains(
        &err_text(Model::load(dir.path())),
        &["has no `config.json`"],
    );
    assert_contains(
        &err_text(Model::load(dir.path().join("nope"))),
        &["no such file or folder"],
    );
}

/// The shipped configs of the families people fine-tune now, counted as transformers'
/// `num_parameters()` counts them (measured with each `*ForCausalLM` on the meta device).
#[test]
fn new_family_configs_count_as_transformers() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/configs");
    for (file, count) in [
        ("qwen2.5-7b.json", 7_615_616_512u64),
        ("mistral-7b.json", 7_241_732_096),
        ("gemma-7b.json", 8_537_680_896),
        ("llama-3.1-8b.json", 8_030_261_248),
    ] {
        let m = Model::load(root.join(file)).unwrap();
        assert_eq!(m.parameter_count(), count, "{file}");
        let g = m.build_graph(1, 8).unwrap();
        check_graph(&m, &g, 1, 8);
    }
}
