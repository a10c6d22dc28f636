//! config.json: the family (`model_type`), the architectures list and the family's sizes.
//!
//! Fields are read one at a time from the parsed JSON (serde_json) rather than through derived
//! structs so that an error names the field and shows what was found. Missing or `null`
//! fields take the defaults of the transformers config classes (`GPT2Config`, `BertConfig`,
//! `LlamaConfig`, `Qwen2Config`, `MistralConfig`, `GemmaConfig`). A field castor does not
//! implement (another rope scaling, soft-capping, a sliding window where the family has none)
//! is an error naming it, never a silent approximation. Sizes are checked here, before anything is allocated from them: positive,
//! heads dividing the hidden size, kv heads dividing heads, and no absurd values (each size
//! below 2^31, at most [`MAX_LAYERS`] layers), so later arithmetic cannot overflow.

use crate::error::ModelError;
use castor_ir::{RopeScaling, UnaryOp};
use serde_json::{Map, Value};
use std::fmt;
use std::path::{Path, PathBuf};

/// Layer counts above this are refused as absurd.
pub const MAX_LAYERS: usize = 10_000;
/// Any single size above this is refused as absurd (keeps products of two sizes in `u64`).
pub const MAX_DIM: usize = 1 << 31;
/// Parameter counts above this are refused as absurd.
pub const MAX_PARAMETERS: u64 = 10_000_000_000_000;

/// A supported model family, named by config.json's `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Gpt2,
    Bert,
    Llama,
    /// Qwen2 / Qwen2.5: LLaMA's layers with biases on q, k and v.
    Qwen2,
    /// Mistral: LLaMA's layers with an optional sliding attention window.
    Mistral,
    /// Gemma (1): GeGLU MLP, RMSNorm scaled by `1 + weight`, embeddings scaled by √hidden.
    Gemma,
}

impl Family {
    pub const ALL: [Family; 6] = [
        Family::Gpt2,
        Family::Bert,
        Family::Llama,
        Family::Qwen2,
        Family::Mistral,
        Family::Gemma,
    ];

    /// The `model_type` string.
    /// The transformers config class, whose defaults fill absent fields.
    pub fn config_class(self) -> &'static str {
        match self {
            Family::Gpt2 => "GPT2Config",
            Family::Bert => "BertConfig",
            Family::Llama => "LlamaConfig",
            Family::Qwen2 => "Qwen2Config",
            Family::Mistral => "MistralConfig",
            Family::Gemma => "GemmaConfig",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Bert => "bert",
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Mistral => "mistral",
            Family::Gemma => "gemma",
        }
    }

    /// The modules PEFT gives adapters when `target_modules` is not set (its
    /// `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
    pub fn lora_targets(self) -> &'static [&'static str] {
        match self {
            Family::Gpt2 => &["c_attn"],
            Family::Bert => &["query", "value"],
            Family::Llama | Family::Qwen2 | Family::Mistral | Family::Gemma => {
                &["q_proj", "v_proj"]
            }
        }
    }

    pub fn from_model_type(s: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.model_type() == s)
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.model_type())
    }
}

/// A feed-forward activation (`activation_function` / `hidden_act`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`: GELU, tanh approximation.
    GeluTanh,
    /// `gelu`, `gelu_python`: exact GELU with erf.
    GeluErf,
    /// `silu`, `swish`.
    Silu,
    Tanh,
}

impl Activation {
    const NAMES: [(&'static str, Activation); 8] = [
        ("gelu_new", Activation::GeluTanh),
        ("gelu_pytorch_tanh", Activation::GeluTanh),
        ("gelu_fast", Activation::GeluTanh),
        ("gelu", Activation::GeluErf),
        ("gelu_python", Activation::GeluErf),
        ("silu", Activation::Silu),
        ("swish", Activation::Silu),
        ("tanh", Activation::Tanh),
    ];

    pub fn from_hf_name(s: &str) -> Option<Activation> {
        Self::NAMES.iter().find(|(n, _)| *n == s).map(|&(_, a)| a)
    }

    pub fn unary(self) -> UnaryOp {
        match self {
            Activation::GeluTanh => UnaryOp::GeluTanh,
            Activation::GeluErf => UnaryOp::GeluErf,
            Activation::Silu => UnaryOp::Silu,
            Activation::Tanh => UnaryOp::Tanh,
        }
    }

    /// The IR op's name (`gelu_tanh`, `gelu_erf`, `silu`, `tanh`).
    pub fn name(self) -> &'static str {
        self.unary().name()
    }

    fn supported() -> String {
        Self::NAMES.map(|(n, _)| n).join(", ")
    }
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `GPT2Config`, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// `n_inner`, or `4 * n_embd` when null.
    pub n_inner: usize,
    pub activation: Activation,
    pub layer_norm_epsilon: f64,
    pub scale_attn_weights: bool,
    pub scale_attn_by_inverse_layer_idx: bool,
    pub tie_word_embeddings: bool,
    /// Standard deviation of the initial weights (`init_params`); not used when loading.
    pub initializer_range: f64,
    /// Where training applies dropout: `embd_pdrop`, `attn_pdrop`, `resid_pdrop`.
    pub dropout: DropoutRates,
}

/// Dropout probabilities at the places transformers' modules apply it in training: the
/// embeddings (GPT-2's `embd_pdrop` on their sum; BERT's `hidden_dropout_prob` after their
/// norm), the attention probabilities, each sublayer's output before its residual add, and a
/// sequence classifier's input (BERT's `classifier_dropout`, else `hidden_dropout_prob`).
/// `None`: the family has no dropout there.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DropoutRates {
    pub embeddings: Option<f64>,
    pub attention: Option<f64>,
    pub residual: Option<f64>,
    pub classifier: Option<f64>,
}

impl DropoutRates {
    /// Every site the family has at `p` (`--dropout P`).
    pub fn all_at(self, p: f64) -> DropoutRates {
        let at = |site: Option<f64>| site.map(|_| p);
        DropoutRates {
            embeddings: at(self.embeddings),
            attention: at(self.attention),
            residual: at(self.residual),
            classifier: at(self.classifier),
        }
    }

    /// No dropout anywhere.
    pub fn is_off(&self) -> bool {
        [
            self.embeddings,
            self.attention,
            self.residual,
            self.classifier,
        ]
        .iter()
        .all(|p| p.unwrap_or(0.0) == 0.0)
    }
}

/// `BertConfig`, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: Activation,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub initializer_range: f64,
    /// The word embeddings' `padding_idx` (`pad_token_id`, 0 by default): no gradient.
    pub pad_token_id: Option<usize>,
    /// `hidden_dropout_prob` (embeddings, sublayer outputs), `attention_probs_dropout_prob`.
    pub dropout: DropoutRates,
}

/// A LLaMA-style decoder's config, resolved: `LlamaConfig`, and the families built from the
/// same layers (`Qwen2Config`, `MistralConfig`, `GemmaConfig`), which differ in the fields
/// after `initializer_range`.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Which decoder family (`llama`, `qwen2`, `mistral`, `gemma`).
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Defaults to `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: usize,
    pub hidden_act: Activation,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    /// Biases on all four attention projections (LLaMA's `attention_bias`).
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub initializer_range: f64,
    /// Biases on q, k and v only (Qwen2).
    pub qkv_bias: bool,
    /// `rope_scaling`: how the rotary frequencies are rescaled.
    pub rope_scaling: RopeScaling,
    /// The sliding attention window, and the first layer that uses it (Mistral: every layer;
    /// Qwen2: layers from `max_window_layers` on, when `use_sliding_window`).
    pub sliding_window: Option<SlidingWindow>,
    /// Gemma: RMSNorm multiplies by `1 + weight` and the embeddings by `√hidden_size`.
    pub gemma_norm_and_embed: bool,
    /// The token embeddings' `padding_idx` (`pad_token_id`; 0 by default for Gemma, none for
    /// the others): that row gets no gradient.
    pub pad_token_id: Option<usize>,
    /// `attention_dropout`, on the attention probabilities only.
    pub dropout: DropoutRates,
}

/// A sliding attention window over the layers from `first_layer` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingWindow {
    pub size: usize,
    pub first_layer: usize,
}

/// A family's resolved config.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelConfig {
    Gpt2(Gpt2Config),
    Bert(BertConfig),
    Llama(LlamaConfig),
}

impl ModelConfig {
    pub fn family(&self) -> Family {
        match self {
            ModelConfig::Gpt2(_) => Family::Gpt2,
            ModelConfig::Bert(_) => Family::Bert,
            ModelConfig::Llama(c) => c.family,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Bert(c) => c.vocab_size,
            ModelConfig::Llama(c) => c.vocab_size,
        }
    }

    /// The configured context length (`n_positions` / `max_position_embeddings`). GPT-2 and
    /// BERT cannot go past it; LLaMA's rotary positions could, but this is its trained length.
    pub fn max_positions(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.n_positions,
            ModelConfig::Bert(c) => c.max_position_embeddings,
            ModelConfig::Llama(c) => c.max_position_embeddings,
        }
    }

    /// `initializer_range`: the standard deviation of initial weights.
    pub fn initializer_range(&self) -> f64 {
        match self {
            ModelConfig::Gpt2(c) => c.initializer_range,
            ModelConfig::Bert(c) => c.initializer_range,
            ModelConfig::Llama(c) => c.initializer_range,
        }
    }
}

/// A parsed config.json.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Where it was read from (for messages).
    pub file: PathBuf,
    /// `architectures`, empty when absent.
    pub architectures: Vec<String>,
    pub model: ModelConfig,
    /// The classification fields (`num_labels`, `id2label`, `problem_type`, `pad_token_id`).
    pub labels: crate::classify::Labels,
    /// Fields that decide tensor shapes which config.json leaves out: their values are the
    /// transformers config class's defaults, which a checkpoint may well disagree with.
    pub defaulted: Vec<DefaultedField>,
}

/// A shape-deciding config field that is absent, and the default used for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DefaultedField {
    pub field: String,
    pub value: usize,
    /// The transformers config class the default is from (`LlamaConfig`).
    pub class: &'static str,
}

impl std::fmt::Display for DefaultedField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "config.json has no `{}`: {}'s default {} is used, as transformers does",
            self.field, self.class, self.value
        )
    }
}

impl Config {
    /// This config as a sequence classifier over `labels` (class names, at least one): the
    /// family's `*ForSequenceClassification` architecture, `id2label`/`label2id` from the
    /// names, the problem type left to the head (one label: regression), the padding token
    /// kept. A config that already is such a classifier must name as many labels.
    pub fn with_new_classifier(&self, labels: &[String]) -> Result<Config, ModelError> {
        let err = |message: String| ModelError::Config {
            file: self.file.clone(),
            field: "architectures".into(),
            message,
        };
        if labels.is_empty() || labels.len() > crate::classify::MAX_LABELS {
            return Err(err(format!(
                "a classifier needs 1 to {} labels, found {}",
                crate::classify::MAX_LABELS,
                labels.len()
            )));
        }
        let class = self
            .model
            .arch()
            .architectures()
            .iter()
            .find(|(_, h)| *h == crate::Head::SequenceClassification)
            .map(|(n, _)| *n)
            .ok_or_else(|| {
                err(format!(
                    "castor has no sequence classification head for {}",
                    self.model.family()
                ))
            })?;
        let mut out = self.clone();
        if self.architectures.iter().any(|a| a == class) {
            if self.labels.num_labels != labels.len() {
                return Err(err(format!(
                    "the checkpoint is a {class} with {} labels, not {}",
                    self.labels.num_labels,
                    labels.len()
                )));
            }
            return Ok(out);
        }
        out.architectures = vec![class.to_string()];
        out.labels = crate::classify::Labels {
            num_labels: labels.len(),
            problem_type: None,
            pad_token_id: self.labels.pad_token_id,
            id2label: labels.to_vec(),
            label2id: labels
                .iter()
                .enumerate()
                .map(|(i, n)| (n.clone(), i as i64))
                .collect(),
        };
        Ok(out)
    }

    /// config.json `text` rewritten for [`Config::with_new_classifier`]'s classifier:
    /// `architectures`, `id2label` and `label2id` replaced (`num_labels` follows them, as
    /// transformers reads it), `problem_type` dropped; every other field kept as written.
    pub fn classifier_json(text: &str, class: &str, labels: &[String]) -> Result<String, String> {
        let mut value: Value =
            serde_json::from_str(text).map_err(|e| format!("config.json is not JSON: {e}"))?;
        let obj = value
            .as_object_mut()
            .ok_or("config.json is not a JSON object")?;
        obj.insert("architectures".into(), Value::from(vec![class.to_string()]));
        let id2label: Map<String, Value> = labels
            .iter()
            .enumerate()
            .map(|(i, n)| (i.to_string(), Value::from(n.clone())))
            .collect();
        let label2id: Map<String, Value> = labels
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), Value::from(i)))
            .collect();
        obj.insert("id2label".into(), Value::Object(id2label));
        obj.insert("label2id".into(), Value::Object(label2id));
        obj.remove("num_labels");
        obj.remove("problem_type");
        serde_json::to_string_pretty(&value).map_err(|e| e.to_string())
    }

    /// Reads and parses a config.json file.
    pub fn read(path: impl AsRef<Path>) -> Result<Config, ModelError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// Parses config.json text; `file` is only used in messages.
    pub fn parse(text: &str, file: impl AsRef<Path>) -> Result<Config, ModelError> {
        let file = file.as_ref();
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Config {
            file: file.to_path_buf(),
            field: "(whole file)".into(),
            message: format!("not valid JSON: {e}"),
        })?;
        let obj = value.as_object().ok_or_else(|| ModelError::Config {
            file: file.to_path_buf(),
            field: "(whole file)".into(),
            message: format!("expected a JSON object, found {}", kind(&value)),
        })?;
        // serde_json keeps the last of repeated keys; a config that says two things is refused.
        if let Ok(entries) = serde_json::from_str::<crate::safetensors::Entries>(text) {
            let mut seen = std::collections::BTreeSet::new();
            if let Some((key, _)) = entries.0.iter().find(|(k, _)| !seen.insert(k.as_str())) {
                return Err(ModelError::Config {
                    file: file.to_path_buf(),
                    field: key.clone(),
                    message: "the field appears twice (expected each field once)".into(),
                });
            }
        }
        let f = Fields {
            file,
            obj,
            defaulted: Default::default(),
        };
        let supported = Family::ALL.map(|f| f.model_type()).join(", ");
        let model_type = match obj.get("model_type") {
            None | Some(Value::Null) => {
                return Err(ModelError::UnsupportedModelType {
                    file: file.to_path_buf(),
                    found: "(missing)".into(),
                    supported,
                })
            }
            Some(_) => f.string("model_type", "")?,
        };
        let family =
            Family::from_model_type(&model_type).ok_or(ModelError::UnsupportedModelType {
                file: file.to_path_buf(),
                found: model_type,
                supported,
            })?;
        let architectures = match obj.get("architectures") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| f.bad("architectures", "a list of strings", v))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => return Err(f.bad("architectures", "a list of strings", v)),
        };
        let model = match family {
            Family::Gpt2 => ModelConfig::Gpt2(gpt2(&f)?),
            Family::Bert => ModelConfig::Bert(bert(&f)?),
            Family::Llama | Family::Qwen2 | Family::Mistral | Family::Gemma => {
                ModelConfig::Llama(llama(&f, family)?)
            }
        };
        let class = family.config_class();
        let defaulted = f
            .defaulted
            .into_inner()
            .into_iter()
            .map(|(field, value)| DefaultedField {
                field,
                value,
                class,
            })
            .collect();
        Ok(Config {
            file: file.to_path_buf(),
            architectures,
            model,
            labels: crate::classify::Labels::read(obj, file)?,
            defaulted,
        })
    }
}

fn gpt2(f: &Fields) -> Result<Gpt2Config, ModelError> {
    f.forbid_true("add_cross_attention", "cross-attention")?;
    let n_embd = f.size("n_embd", 768)?;
    let n_head = f.size("n_head", 12)?;
    f.divides("n_head", n_head, "n_embd", n_embd)?;
    let n_inner = match f.opt_size("n_inner")? {
        Some(n) => n,
        None => f.dim_product("n_inner", n_embd, 4)?,
    };
    Ok(Gpt2Config {
        vocab_size: f.size("vocab_size", 50257)?,
        n_positions: f.size("n_positions", 1024)?,
        n_embd,
        n_layer: f.layers("n_layer", 12)?,
        n_head,
        n_inner,
        activation: f.activation("activation_function", "gelu_new")?,
        layer_norm_epsilon: f.eps("layer_norm_epsilon", 1e-5)?,
        scale_attn_weights: f.boolean("scale_attn_weights", true)?,
        scale_attn_by_inverse_layer_idx: f.boolean("scale_attn_by_inverse_layer_idx", false)?,
        tie_word_embeddings: f.boolean("tie_word_embeddings", true)?,
        initializer_range: f.eps("initializer_range", 0.02)?,
        dropout: DropoutRates {
            embeddings: Some(f.probability("embd_pdrop", 0.1)?),
            attention: Some(f.probability("attn_pdrop", 0.1)?),
            residual: Some(f.probability("resid_pdrop", 0.1)?),
            classifier: None,
        },
    })
}

fn bert(f: &Fields) -> Result<BertConfig, ModelError> {
    f.forbid_true("is_decoder", "BERT as a decoder")?;
    f.forbid_true("add_cross_attention", "cross-attention")?;
    let pet = f.string("position_embedding_type", "absolute")?;
    if pet != "absolute" {
        return Err(ModelError::UnsupportedFeature {
            file: f.file.to_path_buf(),
            field: "position_embedding_type".into(),
            what: format!("`{pet}` (only `absolute`)"),
        });
    }
    let hidden_size = f.size("hidden_size", 768)?;
    let heads = f.size("num_attention_heads", 12)?;
    f.divides("num_attention_heads", heads, "hidden_size", hidden_size)?;
    Ok(BertConfig {
        vocab_size: f.size("vocab_size", 30522)?,
        hidden_size,
        num_hidden_layers: f.layers("num_hidden_layers", 12)?,
        num_attention_heads: heads,
        intermediate_size: f.size("intermediate_size", 3072)?,
        hidden_act: f.activation("hidden_act", "gelu")?,
        max_position_embeddings: f.size("max_position_embeddings", 512)?,
        type_vocab_size: f.size("type_vocab_size", 2)?,
        layer_norm_eps: f.eps("layer_norm_eps", 1e-12)?,
        tie_word_embeddings: f.boolean("tie_word_embeddings", true)?,
        initializer_range: f.eps("initializer_range", 0.02)?,
        pad_token_id: f.padding_index(Some(0)),
        dropout: {
            let hidden = f.probability("hidden_dropout_prob", 0.1)?;
            let classifier = match f.obj.get("classifier_dropout") {
                None | Some(serde_json::Value::Null) => hidden,
                Some(_) => f.probability("classifier_dropout", hidden)?,
            };
            DropoutRates {
                embeddings: Some(hidden),
                attention: Some(f.probability("attention_probs_dropout_prob", 0.1)?),
                residual: Some(hidden),
                classifier: Some(classifier),
            }
        },
    })
}

/// The defaults of one decoder family's transformers config class.
struct DecoderDefaults {
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    /// `None`: as many as `heads`.
    kv_heads: Option<usize>,
    /// `None`: `hidden / heads`.
    head_dim: Option<usize>,
    vocab: usize,
    act: &'static str,
    positions: usize,
    tie: bool,
}

impl DecoderDefaults {
    fn of(family: Family) -> DecoderDefaults {
        let llama = DecoderDefaults {
            hidden: 4096,
            intermediate: 11008,
            layers: 32,
            heads: 32,
            kv_heads: None,
            head_dim: None,
            vocab: 32000,
            act: "silu",
            positions: 2048,
            tie: false,
        };
        match family {
            Family::Qwen2 => DecoderDefaults {
                intermediate: 22016,
                kv_heads: Some(32),
                vocab: 151936,
                positions: 32768,
                ..llama
            },
            Family::Mistral => DecoderDefaults {
                intermediate: 14336,
                kv_heads: Some(8),
                positions: 4096 * 32,
                ..llama
            },
            Family::Gemma => DecoderDefaults {
                hidden: 3072,
                intermediate: 24576,
                layers: 28,
                heads: 16,
                kv_heads: Some(16),
                head_dim: Some(256),
                vocab: 256000,
                act: "gelu_pytorch_tanh",
                positions: 8192,
                tie: true,
            },
            _ => llama,
        }
    }
}

fn llama(f: &Fields, family: Family) -> Result<LlamaConfig, ModelError> {
    let def = DecoderDefaults::of(family);
    let hidden_size = f.size("hidden_size", def.hidden)?;
    let heads = f.size("num_attention_heads", def.heads)?;
    let kv = match f.opt_size("num_key_value_heads")? {
        Some(kv) => kv,
        None => def.kv_heads.unwrap_or(heads),
    };
    f.divides("num_key_value_heads", kv, "num_attention_heads", heads)?;
    let head_dim = match f.opt_size("head_dim")?.or(def.head_dim) {
        Some(d) => d,
        None => {
            f.divides("num_attention_heads", heads, "hidden_size", hidden_size)?;
            hidden_size / heads
        }
    };
    if head_dim % 2 != 0 {
        return Err(f.field_err(
            "head_dim",
            format!("rotary embeddings need an even head size, found {head_dim}"),
        ));
    }
    f.dim_product("num_attention_heads", heads, head_dim)?;
    let (rope_theta, rope_scaling) = rope(f)?;
    for field in [
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
    ] {
        if let Some(v) = f.get(field) {
            return Err(ModelError::UnsupportedFeature {
                file: f.file.to_path_buf(),
                field: field.into(),
                what: format!(
                    "{field} = {} (Gemma 2's soft-capping and query scaling)",
                    short(v)
                ),
            });
        }
    }
    let num_hidden_layers = f.layers("num_hidden_layers", def.layers)?;
    let mut hidden_act = f.activation("hidden_act", def.act)?;
    if family == Family::Gemma {
        // GemmaConfig reads the released checkpoints' `gelu` as the tanh approximation.
        if hidden_act == Activation::GeluErf {
            hidden_act = Activation::GeluTanh;
        }
        f.forbid_true("use_bidirectional_attention", "bidirectional attention")?;
    }
    Ok(LlamaConfig {
        family,
        vocab_size: f.size("vocab_size", def.vocab)?,
        hidden_size,
        intermediate_size: f.size("intermediate_size", def.intermediate)?,
        num_hidden_layers,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim,
        hidden_act,
        // RoPE has no table: the positions decide no tensor's shape (not recorded).
        max_position_embeddings: f
            .opt_size("max_position_embeddings")?
            .unwrap_or(def.positions),
        rms_norm_eps: f.eps("rms_norm_eps", 1e-6)?,
        rope_theta,
        tie_word_embeddings: f.boolean("tie_word_embeddings", def.tie)?,
        attention_bias: f.boolean("attention_bias", false)?,
        mlp_bias: f.boolean("mlp_bias", false)?,
        initializer_range: f.eps("initializer_range", 0.02)?,
        qkv_bias: family == Family::Qwen2,
        rope_scaling,
        sliding_window: sliding_window(f, family, num_hidden_layers)?,
        gemma_norm_and_embed: family == Family::Gemma,
        pad_token_id: f.padding_index((family == Family::Gemma).then_some(0)),
        dropout: DropoutRates {
            attention: Some(f.probability("attention_dropout", 0.0)?),
            ..Default::default()
        },
    })
}

/// The sliding window as each family declares it: Mistral's `sliding_window` on every layer;
/// Qwen2's, when `use_sliding_window`, on the layers from `max_window_layers` on. transformers
/// 4.53+ also writes `layer_types`, which must agree. Other families have none, and a config
/// that sets one is refused.
fn sliding_window(
    f: &Fields,
    family: Family,
    layers: usize,
) -> Result<Option<SlidingWindow>, ModelError> {
    let window = match family {
        // MistralConfig's default is 4096 when the field is absent; `null` turns it off.
        Family::Mistral => match f.obj.get("sliding_window") {
            None => Some(4096),
            Some(_) => f.opt_size("sliding_window")?,
        }
        .map(|size| SlidingWindow {
            size,
            first_layer: 0,
        }),
        Family::Qwen2 => {
            if f.boolean("use_sliding_window", false)? {
                // Neither decides a tensor's shape: not recorded as defaulted.
                let size = f.opt_size("sliding_window")?.unwrap_or(4096);
                let first_layer = f.size_or_zero("max_window_layers", 28)?.min(layers);
                (first_layer < layers).then_some(SlidingWindow { size, first_layer })
            } else {
                None
            }
        }
        _ => {
            if let Some(v) = f.get("sliding_window") {
                return Err(ModelError::UnsupportedFeature {
                    file: f.file.to_path_buf(),
                    field: "sliding_window".into(),
                    what: format!(
                        "a sliding window ({}) on {family}, which declares none",
                        short(v)
                    ),
                });
            }
            None
        }
    };
    if let Some(v) = f.get("layer_types") {
        let types = v
            .as_array()
            .filter(|a| a.len() == layers)
            .ok_or_else(|| f.bad("layer_types", &format!("a list of {layers} names"), v))?;
        let expected: Vec<&str> = (0..layers)
            .map(|i| match window {
                Some(w) if i >= w.first_layer => "sliding_attention",
                _ => "full_attention",
            })
            .collect();
        let found: Vec<Option<&str>> = types.iter().map(Value::as_str).collect();
        if found.iter().zip(&expected).any(|(f, e)| *f != Some(*e)) {
            return Err(f.field_err(
                "layer_types",
                format!(
                    "{} disagrees with the sliding window the other fields give ({})",
                    short(v),
                    match window {
                        Some(w) => format!("{} keys from layer {}", w.size, w.first_layer),
                        None => "none".into(),
                    }
                ),
            ));
        }
    }
    Ok(window)
}

/// The rotary base and scaling. transformers 4 writes `rope_theta` and `rope_scaling` (null
/// for plain rope); transformers 5 writes `rope_parameters: {"rope_type": "default",
/// "rope_theta": ...}`. Types `default`, `linear` and `llama3` are implemented; any other
/// (`dynamic`, `yarn`, `longrope`, ...) is refused by name.
fn rope(f: &Fields) -> Result<(f64, RopeScaling), ModelError> {
    let mut theta = f.number("rope_theta", 10000.0)?;
    let mut scaling = RopeScaling::None;
    for field in ["rope_scaling", "rope_parameters"] {
        let Some(v) = f.get(field) else { continue };
        let unsupported = |what: String| ModelError::UnsupportedFeature {
            file: f.file.to_path_buf(),
            field: field.to_string(),
            what,
        };
        let obj = v
            .as_object()
            .ok_or_else(|| f.bad(field, "an object or null", v))?;
        let kind = obj
            .get("rope_type")
            .or_else(|| obj.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let number = |key: &str| -> Result<f64, ModelError> {
            let x = obj.get(key).ok_or_else(|| {
                f.field_err(
                    &format!("{field}.{key}"),
                    format!("rope scaling `{kind}` needs `{key}`"),
                )
            })?;
            x.as_f64()
                .ok_or_else(|| f.bad(&format!("{field}.{key}"), "a number", x))
        };
        let found = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: number("factor")?,
            },
            "llama3" => {
                let original = number("original_max_position_embeddings")?;
                RopeScaling::from_numbers(&[
                    number("factor")?,
                    number("low_freq_factor")?,
                    number("high_freq_factor")?,
                    original,
                ])
                .map_err(|e| f.field_err(field, e))?
            }
            other => {
                return Err(unsupported(format!(
                    "rope scaling `{other}` ({}; castor implements default, linear and llama3)",
                    short(v)
                )))
            }
        };
        if let RopeScaling::Linear { factor } = found {
            RopeScaling::from_numbers(&[factor]).map_err(|e| f.field_err(field, e))?;
        }
        if found != RopeScaling::None {
            scaling = found;
        }
        if let Some(a) = obj.get("attention_factor").filter(|a| !a.is_null()) {
            if a.as_f64() != Some(1.0) {
                return Err(unsupported(format!(
                    "rope attention_factor {} (castor scales attention by 1)",
                    short(a)
                )));
            }
        }
        if let Some(t) = obj.get("rope_theta") {
            theta = t
                .as_f64()
                .ok_or_else(|| f.bad(&format!("{field}.rope_theta"), "a number", t))?;
        }
        if let Some(p) = obj.get("partial_rotary_factor") {
            if p.as_f64() != Some(1.0) {
                return Err(unsupported(format!(
                    "partial rotary embeddings (partial_rotary_factor {})",
                    short(p)
                )));
            }
        }
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(f.field_err(
            "rope_theta",
            format!("expected a positive number, found {theta}"),
        ));
    }
    Ok((theta, scaling))
}

/// Typed access to config.json fields with defaults and field-naming errors.
struct Fields<'a> {
    file: &'a Path,
    obj: &'a Map<String, Value>,
    /// The sizes and layer counts read as defaults (absent fields), in reading order.
    defaulted: std::cell::RefCell<Vec<(String, usize)>>,
}

impl Fields<'_> {
    /// The field's value unless it is absent or null.
    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn field_err(&self, field: &str, message: String) -> ModelError {
        ModelError::Config {
            file: self.file.to_path_buf(),
            field: field.to_string(),
            message,
        }
    }

    fn bad(&self, field: &str, expected: &str, found: &Value) -> ModelError {
        self.field_err(
            field,
            format!("expected {expected}, found {}", short(found)),
        )
    }

    fn opt_size(&self, key: &str) -> Result<Option<usize>, ModelError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = v
            .as_u64()
            .ok_or_else(|| self.bad(key, "a positive integer", v))?;
        if n == 0 {
            return Err(self.field_err(key, "expected a positive integer, found 0".into()));
        }
        if n > MAX_DIM as u64 {
            return Err(self.field_err(key, format!("{n} is absurd (the limit is {MAX_DIM})")));
        }
        Ok(Some(n as usize))
    }

    fn size(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        Ok(match self.opt_size(key)? {
            Some(n) => n,
            None => self.defaulted_to(key, default),
        })
    }

    /// `default` for the absent field `key`, recorded.
    fn defaulted_to(&self, key: &str, default: usize) -> usize {
        let mut seen = self.defaulted.borrow_mut();
        if !seen.iter().any(|(k, _)| k == key) {
            seen.push((key.to_string(), default));
        }
        default
    }

    /// `pad_token_id` as an embedding's `padding_idx`: `default` when the field is absent,
    /// none when it is null or not a row index (a negative id pads nothing).
    fn padding_index(&self, default: Option<usize>) -> Option<usize> {
        match self.obj.get("pad_token_id") {
            None => default,
            Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()),
        }
    }

    /// A count that may be 0 (`max_window_layers`).
    fn size_or_zero(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        match self.get(key) {
            Some(v) if v.as_u64() == Some(0) => Ok(0),
            _ => Ok(self.opt_size(key)?.unwrap_or(default)),
        }
    }

    fn layers(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        let Some(v) = self.get(key) else {
            return Ok(self.defaulted_to(key, default));
        };
        let n = v
            .as_u64()
            .ok_or_else(|| self.bad(key, "a positive integer", v))?;
        if n == 0 || n > MAX_LAYERS as u64 {
            return Err(
                self.field_err(key, format!("expected 1 to {MAX_LAYERS} layers, found {n}"))
            );
        }
        Ok(n as usize)
    }

    /// `a * b` as a size, refused when absurd.
    fn dim_product(&self, key: &str, a: usize, b: usize) -> Result<usize, ModelError> {
        match a.checked_mul(b) {
            Some(p) if p <= MAX_DIM => Ok(p),
            _ => Err(self.field_err(key, format!("{a} * {b} is absurd (the limit is {MAX_DIM})"))),
        }
    }

    fn divides(
        &self,
        key: &str,
        divisor: usize,
        of_key: &str,
        of: usize,
    ) -> Result<(), ModelError> {
        // (Not `is_multiple_of`: the workspace MSRV is 1.80.)
        if (of / divisor) * divisor != of {
            return Err(self.field_err(
                key,
                format!("{key} = {divisor} does not divide {of_key} = {of}"),
            ));
        }
        Ok(())
    }

    fn number(&self, key: &str, default: f64) -> Result<f64, ModelError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.bad(key, "a number", v)),
        }
    }

    fn eps(&self, key: &str, default: f64) -> Result<f64, ModelError> {
        let x = self.number(key, default)?;
        if !(x.is_finite() && x >= 0.0) {
            return Err(self.field_err(
                key,
                format!("expected a small non-negative number, found {x}"),
            ));
        }
        Ok(x)
    }

    /// A probability in [0, 1) (a dropout rate).
    fn probability(&self, key: &str, default: f64) -> Result<f64, ModelError> {
        let x = self.number(key, default)?;
        if !(0.0..1.0).contains(&x) {
            return Err(self.field_err(key, format!("expected a probability in [0, 1), found {x}")));
        }
        Ok(x)
    }

    fn boolean(&self, key: &str, default: bool) -> Result<bool, ModelError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.bad(key, "true or false", v)),
        }
    }

    fn string(&self, key: &str, default: &str) -> Result<String, ModelError> {
        match self.get(key) {
            None => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| self.bad(key, "a string", v)),
        }
    }

    fn activation(&self, key: &str, default: &str) -> Result<Activation, ModelError> {
        let name = self.string(key, default)?;
        Activation::from_hf_name(&name).ok_or_else(|| ModelError::UnsupportedActivation {
            file: self.file.to_path_buf(),
            field: key.to_string(),
            found: name,
            supported: Activation::supported(),
        })
    }

    fn forbid_true(&self, key: &str, what: &str) -> Result<(), ModelError> {
        if self.boolean(key, false)? {
            return Err(ModelError::UnsupportedFeature {
                file: self.file.to_path_buf(),
                field: key.to_string(),
                what: what.to_string(),
            });
        }
        Ok(())
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A value as JSON, cut short for messages.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        let cut = (0..=77).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        format!("{}...", &s[..cut])
    } else {
        s
    }
}
