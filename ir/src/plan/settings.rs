//! The settings a plan was built with: precision, objective, shapes, optimizer, loss
//! scaling, recomputation.

use crate::optim::{AdafactorHparams, AdamWHparams, LionHparams, SgdHparams};
use crate::Precision;
use serde::{Deserialize, Serialize};

/// The settings a plan was built with: recorded for logs and checkpoints; the graphs hold
/// everything the step computes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSettings {
    pub precision: Precision,
    pub objective: String,
    pub batch: usize,
    pub seq: usize,
    pub grad_accum: usize,
    pub optimizer: OptimizerKind,
    /// Global-norm clipping threshold; 0 = none.
    pub max_grad_norm: f64,
    pub loss_scaling: LossScaling,
    /// Parameters that are not trained.
    pub frozen: Vec<String>,
    /// Parameters trained without weight decay.
    pub no_decay: Vec<String>,
    /// Weight gradients computed in the working copy's dtype (then widened to F32), as
    /// PyTorch autocast does, rather than written in F32 by their contractions.
    #[serde(default)]
    pub param_grads_in_compute_dtype: bool,
    /// The dtype optimizer moments are stored in: F32, or BF16 (updated in F32, rounded to
    /// nearest even when stored).
    #[serde(default = "f32_state", skip_serializing_if = "is_f32")]
    pub optimizer_state: crate::DType,
    /// Each parameter's update runs in the micro step as soon as its gradient is complete, so
    /// gradients are transient values rather than persistent state (one micro-batch per
    /// step; no loss scaling; clipping and the found-inf skip per tensor).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub update_in_backward: bool,
    /// What the micro step recomputes in its backward part instead of keeping.
    #[serde(default, skip_serializing_if = "Remat::is_none")]
    pub remat: Remat,
    /// Whether the LM head's product and the cross-entropy run as one chunked op.
    #[serde(default, skip_serializing_if = "Classifier::is_eager")]
    pub classifier: Classifier,
    /// Whether bias adds, GELUs and bias gradients run in their products' epilogues.
    #[serde(default, skip_serializing_if = "Epilogues::is_eager")]
    pub epilogues: Epilogues,
    /// Low-rank adapters (`lora` pass): only they are trained; every other parameter is the
    /// frozen base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSettings>,
    /// Data parallelism: the ranks that run the plan, and what they shard.
    #[serde(default, skip_serializing_if = "Parallel::is_single")]
    pub parallel: Parallel,
    /// Rows hold several examples packed end to end (`position_ids` instead of
    /// `attention_mask`; each example attends only to itself).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub packed: bool,
    /// Rows keep every key (windows of a token stream): the micro step reads no
    /// `attention_mask`, and attention applies only the causal mask and window. Never with
    /// `packed`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unpadded: bool,
    /// Dropout in the micro step's forward (`dropout` nodes keyed by the graph input
    /// `dropout_key`): none, where the model's config puts it, or at one probability there.
    #[serde(default, skip_serializing_if = "Dropout::is_off")]
    pub dropout: Dropout,
}

/// Which dropout a training plan applies (`--dropout off|config|P`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dropout {
    /// None: the forward is the model's eval-mode forward.
    #[default]
    Off,
    /// Where the config puts it, at its probabilities (transformers' `train()` mode).
    Config,
    /// Where the config puts it, every site at this probability.
    P(f64),
}

impl Dropout {
    pub fn is_off(&self) -> bool {
        *self == Dropout::Off
    }
}

impl std::str::FromStr for Dropout {
    type Err = String;

    fn from_str(s: &str) -> Result<Dropout, String> {
        match s {
            "off" => Ok(Dropout::Off),
            "config" => Ok(Dropout::Config),
            _ => match s.parse::<f64>() {
                Ok(p) if (0.0..1.0).contains(&p) => Ok(Dropout::P(p)),
                _ => Err(format!(
                    "expected `off`, `config` or a probability in [0, 1), found `{s}`"
                )),
            },
        }
    }
}

impl std::fmt::Display for Dropout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dropout::Off => f.write_str("off"),
            Dropout::Config => f.write_str("config"),
            Dropout::P(p) => write!(f, "{p}"),
        }
    }
}

/// How a plan runs on a data-parallel group (`--world-size`, `--zero`): every rank runs the
/// same graphs on its own `batch` of the global batch, and the plan's state table is one
/// rank's (sharded entries hold that rank's shard).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parallel {
    /// Ranks in the group (1: one device, no collectives).
    pub world_size: usize,
    /// ZeRO stage: 0 replicates everything and averages the gradients (DDP); 1 also shards
    /// the optimizer moments and the masters the micro step reads through working copies
    /// (each rank updates its shard and the ranks gather the updated parameters); 2 also
    /// shards the gradients (reduce-scattered as they complete).
    pub zero: u8,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel {
            world_size: 1,
            zero: 0,
        }
    }
}

impl Parallel {
    pub fn is_single(&self) -> bool {
        self.world_size <= 1
    }
}

/// The adapters a plan trains: PEFT's `r`, `lora_alpha` and `target_modules` (given as a
/// list: module-name suffixes, globs on the whole name, or `all-linear`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraSettings {
    pub rank: usize,
    pub alpha: f64,
    pub targets: Vec<String>,
    /// How the frozen base is stored (`--base`).
    #[serde(default, skip_serializing_if = "LoraBase::is_compute")]
    pub base: LoraBase,
}

/// How a LoRA plan stores its frozen base's linear weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraBase {
    /// In the dtype the step reads them in (the compute dtype under a 16-bit policy).
    #[default]
    Compute,
    /// In NF4 ([`crate::nf4`]), dequantized by each product (QLoRA).
    Nf4,
}

impl LoraBase {
    pub fn is_compute(&self) -> bool {
        *self == LoraBase::Compute
    }
}

impl LoraSettings {
    /// `alpha / r`, PEFT's `scaling`.
    pub fn scaling(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether `module` (a weight's name without `.weight`) is a target: it equals a target
    /// or ends with `.` and the target, as PEFT matches a list; a target with `*` or `?` is a
    /// glob on the whole name.
    pub fn targets_module(&self, module: &str) -> bool {
        self.targets.iter().any(|t| {
            if t.contains(['*', '?']) {
                wildmatch::WildMatch::new(t).matches(module)
            } else {
                module == t || module.ends_with(&format!(".{t}"))
            }
        })
    }

    /// `all-linear`: every product by a weight but the output layer.
    pub fn all_linear(&self) -> bool {
        self.targets.iter().any(|t| t == "all-linear")
    }

    /// An adapter parameter's name: `<module>.lora_A.weight` or `<module>.lora_B.weight`
    /// (PEFT's, without its `base_model.model.` prefix).
    pub fn adapter_name(module: &str, which: char) -> String {
        format!("{module}.lora_{which}.weight")
    }

    /// True for a tensor name of a PEFT adapter file (`<module>.lora_A.weight` or
    /// `<module>.lora_B.weight`, without PEFT's prefix). In a graph the adapters are the
    /// parameters marked `origin=adapter` ([`crate::Origin::Adapter`]).
    pub fn is_adapter_tensor(param: &str) -> bool {
        param.ends_with(".lora_A.weight") || param.ends_with(".lora_B.weight")
    }
}

/// Where the work that follows a product by a weight runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Epilogues {
    /// Bias adds, GELUs and bias gradients as their own kernels (each rounds its result).
    #[default]
    Eager,
    /// In the product's accumulator, as cuBLASLt's epilogues: one rounding, no pass over
    /// memory.
    Fused,
}

impl Epilogues {
    pub fn is_eager(&self) -> bool {
        *self == Epilogues::Eager
    }
}

impl std::str::FromStr for Epilogues {
    type Err = String;

    fn from_str(s: &str) -> Result<Epilogues, String> {
        match s.trim() {
            "eager" => Ok(Epilogues::Eager),
            "fused" => Ok(Epilogues::Fused),
            other => Err(format!("`{other}`: expected eager or fused")),
        }
    }
}

impl std::fmt::Display for Epilogues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Epilogues::Eager => "eager",
            Epilogues::Fused => "fused",
        })
    }
}

/// How the LM head's product and its cross-entropy run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Classifier {
    /// A product that stores the `[rows, vocab]` logits, then the loss.
    #[default]
    Eager,
    /// One `linear_cross_entropy` op over chunks of rows (`None`: 32 Mi logits per chunk).
    Fused { chunk_rows: Option<usize> },
}

impl Classifier {
    pub fn is_eager(&self) -> bool {
        *self == Classifier::Eager
    }
}

impl std::fmt::Display for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Classifier::Eager => f.write_str("eager"),
            Classifier::Fused { chunk_rows: None } => f.write_str("fused"),
            Classifier::Fused {
                chunk_rows: Some(r),
            } => write!(f, "fused:{r}"),
        }
    }
}

impl std::str::FromStr for Classifier {
    type Err = String;

    /// `eager`, `fused`, or `fused:<rows per chunk>`.
    fn from_str(s: &str) -> Result<Classifier, String> {
        match s.trim() {
            "eager" => Ok(Classifier::Eager),
            "fused" => Ok(Classifier::Fused { chunk_rows: None }),
            other => match other.strip_prefix("fused:").map(str::parse::<usize>) {
                Some(Ok(r)) if r > 0 => Ok(Classifier::Fused {
                    chunk_rows: Some(r),
                }),
                _ => Err(format!(
                    "`{other}`: expected eager, fused or fused:<rows per chunk, at least 1>"
                )),
            },
        }
    }
}

impl Serialize for Classifier {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Classifier {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Classifier, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

fn f32_state() -> crate::DType {
    crate::DType::F32
}

fn is_f32(d: &crate::DType) -> bool {
    *d == crate::DType::F32
}

/// Rematerialization: which forward values the backward part recomputes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Remat {
    /// Keep every forward value the backward part reads.
    #[default]
    None,
    /// Keep each transformer block's input; recompute the rest of the block.
    Full,
    /// Recompute the attention scores and softmax and cheap pointwise and layout ops; keep
    /// contraction and normalization outputs.
    Selective,
    /// Keep what fits: the step's simulated peak stays within this many bytes.
    Budget(u64),
}

impl Remat {
    pub fn is_none(&self) -> bool {
        *self == Remat::None
    }
}

impl std::fmt::Display for Remat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Remat::None => f.write_str("none"),
            Remat::Full => f.write_str("full"),
            Remat::Selective => f.write_str("selective"),
            Remat::Budget(b) => write!(f, "budget:{b}"),
        }
    }
}

impl std::str::FromStr for Remat {
    type Err = String;

    /// `none`, `full`, `selective` or `budget:<bytes>`, the bytes a number with an optional
    /// unit (`B`, `KB`/`MB`/`GB`/`TB` = powers of 1000, `KiB`/`MiB`/`GiB`/`TiB` = of 1024).
    fn from_str(s: &str) -> Result<Remat, String> {
        match s.trim() {
            "none" => Ok(Remat::None),
            "full" => Ok(Remat::Full),
            "selective" => Ok(Remat::Selective),
            other => match other.strip_prefix("budget:") {
                Some(b) => crate::parse_bytes(b).map(Remat::Budget).ok_or_else(|| {
                    format!(
                        "`{other}`: the budget must be a byte count such as 20GiB, 1.5GB or 123456"
                    )
                }),
                None => Err(format!(
                    "`{other}`: expected none, full, selective or budget:<bytes>"
                )),
            },
        }
    }
}

impl Serialize for Remat {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Remat {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Remat, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The optimizer and its hyperparameters ([`crate::optim`]). In the settings JSON the
/// hyperparameters sit beside `kind`, as fields of the variant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum OptimizerKind {
    AdamW(AdamWHparams),
    /// bitsandbytes' `AdamW8bit`: AdamW with both moments quantized block-wise to 8 bits
    /// ([`crate::quant`]); parameters of fewer than [`crate::quant::MIN_QUANTIZED_NUMEL`]
    /// values keep F32 moments.
    AdamW8bit(AdamWHparams),
    Sgd(SgdHparams),
    /// Lion: one moment, the sign of an interpolation as the update.
    Lion(LionHparams),
    /// transformers' `Adafactor`; `relative_step` is its relative step (with parameter
    /// scaling), else a fixed rate from the learning-rate input (without).
    Adafactor(AdafactorHparams),
}

impl OptimizerKind {
    /// transformers' `Adafactor` defaults ([`AdafactorHparams::defaults`]).
    pub fn adafactor(relative_step: bool) -> OptimizerKind {
        OptimizerKind::Adafactor(AdafactorHparams::defaults(relative_step))
    }

    /// The optimizer's name as `--optimizer` takes it.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerKind::AdamW(_) => "adamw",
            OptimizerKind::AdamW8bit(_) => "adamw8bit",
            OptimizerKind::Sgd(_) => "sgd",
            OptimizerKind::Lion(_) => "lion",
            OptimizerKind::Adafactor(_) => "adafactor",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LossScaling {
    None,
    Static {
        scale: f64,
    },
    Dynamic {
        init_scale: f64,
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: usize,
        hysteresis: usize,
        max_scale: f64,
        /// Training stops with an error when the scale falls below this.
        min_scale: f64,
    },
}
