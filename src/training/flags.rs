//! The training flags `compile --train` and `train` share, and the settings they describe.

use crate::CliError;
use anyhow::Context;
use castor_ir::{
    AdafactorHparams, AdamWHparams, Classifier, Epilogues, LionHparams, LoraBase, LoraSettings,
    LossScaling, OptimizerKind, Remat, SgdHparams, TrainSettings,
};
use castor_models::{Family, Model, Objective};
use castor_passes::Precision;
use serde::{Deserialize, Serialize};

/// GradScaler's growth/backoff factors and DeepSpeed's maximum scale.
const GROWTH_FACTOR: f64 = 2.0;
const BACKOFF_FACTOR: f64 = 0.5;
const MAX_SCALE: f64 = 16_777_216.0; // 2^24

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerChoice {
    /// torch.optim.AdamW (decoupled weight decay).
    Adamw,
    /// bitsandbytes' AdamW8bit: AdamW with both moments in 8-bit block-wise codes (a byte per
    /// value plus an F32 maximum per 256); parameters under 4096 values keep F32 moments.
    Adamw8bit,
    /// torch.optim.SGD with momentum.
    Sgd,
    /// Lion (Chen et al. 2023, as lion-pytorch): the sign of an interpolated momentum as the
    /// update, one moment instead of AdamW's two, decoupled weight decay. Its default rate is
    /// 1e-4 (lion-pytorch's; Lion wants a rate 3-10x below AdamW's).
    Lion,
    /// transformers' Adafactor: factored second moments, no first moment unless --beta1 is
    /// given; without --lr, its relative step.
    Adafactor,
}

impl OptimizerChoice {
    /// The name `--optimizer` takes.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerChoice::Adamw => "adamw",
            OptimizerChoice::Adamw8bit => "adamw8bit",
            OptimizerChoice::Sgd => "sgd",
            OptimizerChoice::Lion => "lion",
            OptimizerChoice::Adafactor => "adafactor",
        }
    }
}

#[derive(clap::Args, Clone, Debug, Serialize, Deserialize)]
#[command(next_help_heading = "Training step")]
pub struct TrainingArgs {
    /// The loss: `lm` (causal LM), `mlm` (masked LM: labels from the batch, or masked token
    /// streams), `sum` (sum of the last hidden state), or `auto` (lm/mlm when the model has
    /// that head; `train` refuses a model without one unless an objective is named).
    #[arg(long, default_value = "auto")]
    pub objective: String,
    /// Pack SFT examples into rows: whole examples end to end, placed best-fit decreasing as
    /// TRL's `packing=True` places them, positions restarting at each example and attention
    /// never crossing from one to another (causal LMs).
    #[arg(long, help_heading = "Data")]
    #[serde(default)]
    pub pack: bool,
    /// Rows keep every key: windows cut from a token stream, never padded. The plan reads no
    /// `attention_mask`, and attention applies the causal mask alone, as transformers' SDPA
    /// path does with a mask of ones (the same function, with no mask to read or test).
    /// `castor train` takes it for token-stream data without being told; give it to `castor
    /// compile --train` to see that plan. Causal LMs only; not with --pack.
    #[arg(long, help_heading = "Data", conflicts_with = "pack")]
    #[serde(default)]
    pub unpadded: bool,
    /// Dropout in training: `off`, `config` (where and as much as config.json says, as
    /// transformers' train() mode applies it: GPT-2's embd/attn/resid_pdrop, BERT's
    /// hidden/attention_probs_dropout_prob, the LLaMA family's attention_dropout) or a
    /// probability for every one of those places. Masks are Philox draws keyed by --seed and
    /// the micro-step; validation runs without.
    #[arg(long, default_value = "off", value_name = "off|config|P")]
    #[serde(default)]
    pub dropout: castor_ir::Dropout,
    #[arg(long, value_enum, default_value_t = OptimizerChoice::Adamw, help_heading = "Optimizer")]
    pub optimizer: OptimizerChoice,
    /// Learning rate (the peak rate when a schedule is used). Default 1e-3 (Lion: 1e-4);
    /// Adafactor without it takes its relative step, min(1e-2, 1/sqrt(step)) times the
    /// parameter's RMS.
    #[arg(long, help_heading = "Optimizer")]
    pub lr: Option<f64>,
    /// AdamW's (and 8-bit AdamW's) first-moment decay (default 0.9); Lion's update
    /// interpolation (default 0.9); Adafactor keeps a first moment only when it is given.
    #[arg(long, help_heading = "Optimizer")]
    pub beta1: Option<f64>,
    /// AdamW's second-moment decay (default 0.999); Lion's moment decay (default 0.99).
    #[arg(long, help_heading = "Optimizer")]
    pub beta2: Option<f64>,
    /// AdamW's epsilon (default 1e-8).
    #[arg(long, help_heading = "Optimizer")]
    pub eps: Option<f64>,
    /// Weight decay (default: 0.01 for AdamW and 8-bit AdamW, as torch and bitsandbytes; 0 for
    /// SGD, Lion and Adafactor). Lion's is decoupled, as AdamW's.
    #[arg(long, help_heading = "Optimizer")]
    pub weight_decay: Option<f64>,
    /// SGD momentum (default 0.9).
    #[arg(long, help_heading = "Optimizer")]
    pub momentum: Option<f64>,
    /// Adafactor: the update is divided by max(1, RMS(update) / this) (default 1).
    #[arg(long, help_heading = "Optimizer")]
    pub clip_threshold: Option<f64>,
    /// Adafactor: the second-moment decay is 1 - step^this (default -0.8).
    #[arg(long, allow_negative_numbers = true, help_heading = "Optimizer")]
    pub decay_rate: Option<f64>,
    /// Adafactor's relative step warm-up: min(1e-6 * step, 1/sqrt(step)) (without --lr only).
    #[arg(long, help_heading = "Optimizer")]
    pub warmup_init: bool,
    /// The dtype optimizer moments are stored in: f32, or bf16 (half the bytes; updated in
    /// F32 and rounded to nearest even when stored).
    #[arg(long, value_enum, default_value_t = StateDtype::F32, help_heading = "Optimizer")]
    pub optimizer_state: StateDtype,
    /// Clip the global gradient norm to this value (torch.nn.utils.clip_grad_norm_).
    #[arg(long, value_name = "MAX_NORM", help_heading = "Optimizer")]
    pub grad_clip: Option<f64>,
    /// Accumulate gradients over N micro-batches per optimizer step (in F32).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub grad_accum: usize,
    /// Do not train parameters whose names match GLOB (repeatable; a glob that matches
    /// nothing is an error).
    #[arg(long, value_name = "GLOB", help_heading = "Optimizer")]
    pub freeze: Vec<String>,
    /// No weight decay for parameters whose names match GLOB (repeatable), e.g. `*bias`.
    #[arg(long = "no-decay", value_name = "GLOB", help_heading = "Optimizer")]
    pub no_decay: Vec<String>,
    /// Loss scaling: `dynamic` (GradScaler rules), `static:N`, or `none`. Default: dynamic
    /// for fp16, none otherwise.
    #[arg(long, value_name = "MODE", help_heading = "Loss scaling")]
    pub loss_scale: Option<String>,
    /// Initial dynamic loss scale.
    #[arg(long, default_value_t = 65536.0, help_heading = "Loss scaling")]
    pub init_scale: f64,
    /// Clean steps before the dynamic scale doubles.
    #[arg(long, default_value_t = 2000, help_heading = "Loss scaling")]
    pub growth_interval: usize,
    /// Overflows tolerated before the scale halves (DeepSpeed's hysteresis; 1 = GradScaler).
    #[arg(long, default_value_t = 1, help_heading = "Loss scaling")]
    pub hysteresis: usize,
    /// Stop with an error when the dynamic scale falls below this.
    #[arg(long, default_value_t = 1.0, help_heading = "Loss scaling")]
    pub min_scale: f64,
    /// Dtype of weight-gradient products: `f32` (written in F32 by the contraction) or
    /// `compute` (the working copy's dtype, then widened, as PyTorch autocast does).
    #[arg(long, value_enum, default_value_t = ParamGrads::F32)]
    pub param_grads: ParamGrads,
    /// Apply each parameter's update in the backward pass, right after its gradient is
    /// complete, so gradients never persist (one micro-batch per step). Without loss scaling
    /// --grad-clip clips each tensor by its own norm and a non-finite gradient skips its own
    /// tensor's update; with loss scaling (fp16) the backward pass runs twice, the first
    /// forming the global norm, so an overflow skips the whole step and clipping is global.
    #[arg(long, help_heading = "Optimizer")]
    pub update_in_backward: bool,
    /// Rematerialization: `none`, `full` (keep each block's input, recompute the block),
    /// `selective` (recompute attention scores/softmax and cheap pointwise ops) or
    /// `budget:<bytes>` (recompute the least that fits the step's peak in the budget).
    #[arg(long, default_value = "none", value_name = "MODE", value_parser = parse_remat)]
    pub remat: Remat,
    /// The LM head and its loss: `fused` (one op over chunks of rows, 32 Mi logits per chunk,
    /// recomputed in the backward; the default), `fused:<rows per chunk>`, or `eager` (the
    /// head's product stores the [rows, vocab] logits). A head the fused op cannot express
    /// (a bias, another loss) stays eager and the plan says why.
    #[arg(long, default_value = "fused", value_name = "MODE", value_parser = parse_classifier)]
    // Flags saved before this one existed ran eager: absent means eager (its serde default).
    #[serde(default)]
    pub classifier: Classifier,
    /// Bias adds after products, the tanh GELU that follows them and their gradients: `fused`
    /// (in the product's accumulator, as cuBLASLt's BIAS, GELU_AUX_BIAS, DGELU and BGRADA/B
    /// epilogues do: one rounding, as PyTorch's addmm, and no pass over memory; the default)
    /// or `eager` (separate kernels, each rounding its result).
    #[arg(long, default_value = "fused", value_name = "MODE", value_parser = parse_epilogues)]
    // As --classifier: flags saved before this one existed ran eager.
    #[serde(default)]
    pub epilogues: Epilogues,
    /// Train low-rank adapters of rank R beside the target products (PEFT's LoRA): only they
    /// are trained; the rest of the model is the frozen base.
    #[arg(long, value_name = "R", help_heading = "LoRA")]
    #[serde(default)]
    pub lora_rank: Option<usize>,
    /// The adapters' alpha: their product is scaled by alpha / R (default: R, a scale of 1).
    #[arg(long, value_name = "ALPHA", help_heading = "LoRA")]
    #[serde(default)]
    pub lora_alpha: Option<f64>,
    /// The modules that get adapters, as PEFT's `target_modules`: comma-separated module-name
    /// suffixes (`q_proj,v_proj` matches every layer's), globs on the whole module name, or
    /// `all-linear`. Default: PEFT's for the family (GPT-2 `c_attn`; BERT `query,value`;
    /// LLaMA, Mistral, Qwen2 and Gemma `q_proj,v_proj`).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        help_heading = "LoRA"
    )]
    #[serde(default)]
    pub lora_targets: Vec<String>,
    /// How the frozen base's linear weights are stored: `compute` (the dtype the step reads
    /// them in) or `nf4` (QLoRA: 4-bit NormalFloat in blocks of 64, as bitsandbytes stores
    /// them, dequantized by each product; the LM head and embeddings stay). Needs --lora-rank.
    #[arg(long, default_value = "compute", value_name = "BASE", value_parser = parse_base, help_heading = "LoRA")]
    #[serde(default)]
    pub base: LoraBase,
    /// Ranks of a data-parallel group: each runs the plan on its own --batch sequences (the
    /// global batch is batch x grad-accum x world size) and the gradients are averaged
    /// across ranks as they complete. The plan, its anatomy and its cost are one rank's.
    #[arg(
        long,
        default_value_t = 1,
        value_name = "N",
        help_heading = "Data parallel"
    )]
    #[serde(default = "one")]
    pub world_size: usize,
    /// ZeRO stage with --world-size: 0 replicates the state (DDP), 1 shards the optimizer
    /// moments and the masters read through working copies, 2 also the gradients
    /// (reduce-scattered as they complete), 3 also every parameter (gathered before each use,
    /// as FSDP).
    #[arg(long, default_value_t = 0, value_name = "STAGE", value_parser = clap::value_parser!(u8).range(0..=3), help_heading = "Data parallel")]
    #[serde(default)]
    pub zero: u8,
}

fn one() -> usize {
    1
}

/// Parses `--base`.
pub fn parse_base(s: &str) -> Result<LoraBase, String> {
    match s {
        "compute" => Ok(LoraBase::Compute),
        "nf4" => Ok(LoraBase::Nf4),
        other => Err(format!("`{other}`: the base is `compute` or `nf4`")),
    }
}

/// Parses `--epilogues`.
pub fn parse_epilogues(s: &str) -> Result<Epilogues, String> {
    s.parse()
}

/// Parses `--classifier`.
pub fn parse_classifier(s: &str) -> Result<Classifier, String> {
    s.parse()
}

/// Parses `--remat`.
pub fn parse_remat(s: &str) -> Result<Remat, String> {
    s.parse()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StateDtype {
    F32,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamGrads {
    F32,
    Compute,
}

/// The learning rate without `--lr`.
const DEFAULT_LR: f64 = 1e-3;
/// Lion's rate without `--lr`: lion-pytorch's default.
const DEFAULT_LION_LR: f64 = 1e-4;

impl TrainingArgs {
    /// The learning rate: `--lr`, else the optimizer's default.
    pub fn lr(&self) -> f64 {
        self.lr.unwrap_or(match self.optimizer {
            OptimizerChoice::Lion => DEFAULT_LION_LR,
            _ => DEFAULT_LR,
        })
    }

    /// The objective, resolving `auto` for the model (IR files use their own loss).
    pub fn objective(&self, model: Option<&Model>) -> anyhow::Result<Objective> {
        match (self.objective.as_str(), model) {
            ("auto", Some(m)) => Ok(Objective::auto(m)),
            ("auto", None) => Ok(Objective::Sum),
            (other, _) => Ok(other.parse().map_err(CliError::InvalidInput)?),
        }
    }

    /// The objective `train` optimizes: as [`TrainingArgs::objective`], but `auto` on a model
    /// without an LM or MLM head is refused (it would optimize the sum of the hidden state
    /// without a word).
    pub fn training_objective(&self, model: &Model) -> anyhow::Result<Objective> {
        let objective = self.objective(Some(model))?;
        if self.objective == "auto" && objective == Objective::Sum {
            // GPT-2 has no sequence classifier in castor: the classifier flags are offered
            // where they apply.
            let classify = match model.family() {
                castor_models::Family::Gpt2 => String::new(),
                _ => "to fine-tune it as a text classifier, give --num-labels N or --labels \
                      a,b,c (a new classification head, as transformers' num_labels makes \
                      one, trained on labelled .jsonl or .csv text); "
                    .to_string(),
            };
            return Err(CliError::InvalidInput(format!(
                "{} has no LM or MLM head, so it has no loss to train by default: {classify}\
                 name one with --objective (sum: the sum of the last hidden state, a \
                 benchmark loss), or use a checkpoint with a head (architectures [\"BertForMaskedLM\"], \
                 [\"GPT2LMHeadModel\"], [\"LlamaForCausalLM\"])",
                model.architecture()
            ))
            .into());
        }
        Ok(objective)
    }

    pub fn loss_scaling(&self, precision: Precision) -> anyhow::Result<LossScaling> {
        let invalid = |m: String| CliError::InvalidInput(m);
        let mode = self.loss_scale.clone().unwrap_or_else(|| {
            if precision == Precision::Fp16 {
                "dynamic".into()
            } else {
                "none".into()
            }
        });
        if self.init_scale <= 0.0 || !self.init_scale.is_finite() {
            return Err(invalid(format!(
                "--init-scale must be a positive number, found {}",
                self.init_scale
            ))
            .into());
        }
        if self.growth_interval == 0 || self.hysteresis == 0 {
            return Err(
                invalid("--growth-interval and --hysteresis must be at least 1".into()).into(),
            );
        }
        Ok(match mode.as_str() {
            "none" => LossScaling::None,
            "dynamic" => LossScaling::Dynamic {
                init_scale: self.init_scale,
                growth_factor: GROWTH_FACTOR,
                backoff_factor: BACKOFF_FACTOR,
                growth_interval: self.growth_interval,
                hysteresis: self.hysteresis,
                max_scale: MAX_SCALE,
                min_scale: self.min_scale,
            },
            other => match other.strip_prefix("static:").map(str::parse::<f64>) {
                Some(Ok(scale)) if scale > 0.0 && scale.is_finite() => {
                    LossScaling::Static { scale }
                }
                _ => {
                    return Err(invalid(format!(
                        "--loss-scale `{other}`: expected dynamic, static:N (N > 0) or none"
                    ))
                    .into())
                }
            },
        })
    }

    /// A flag of another optimizer than the chosen one is an error naming it: it would
    /// change nothing.
    fn check_optimizer_flags(&self) -> anyhow::Result<()> {
        use OptimizerChoice::{Adafactor, Adamw, Adamw8bit, Lion, Sgd};
        let flags: [(&str, bool, &[OptimizerChoice]); 6] = [
            (
                "--beta1",
                self.beta1.is_some(),
                &[Adamw, Adamw8bit, Lion, Adafactor],
            ),
            ("--beta2", self.beta2.is_some(), &[Adamw, Adamw8bit, Lion]),
            ("--eps", self.eps.is_some(), &[Adamw, Adamw8bit]),
            ("--momentum", self.momentum.is_some(), &[Sgd]),
            (
                "--clip-threshold",
                self.clip_threshold.is_some(),
                &[Adafactor],
            ),
            ("--decay-rate", self.decay_rate.is_some(), &[Adafactor]),
        ];
        for (flag, given, applies) in flags {
            if given && !applies.contains(&self.optimizer) {
                let names: Vec<&str> = applies.iter().map(|o| o.name()).collect();
                return Err(CliError::InvalidInput(format!(
                    "{flag} is a setting of --optimizer {}, not of --optimizer {}: leave it out",
                    names.join(" or "),
                    self.optimizer.name()
                ))
                .into());
            }
        }
        Ok(())
    }

    /// `--base nf4` quantizes the base under adapters: refused when the plan has none.
    pub fn check_base(&self, lora: Option<&LoraSettings>) -> anyhow::Result<()> {
        if self.base != LoraBase::Compute && lora.is_none() {
            return Err(CliError::InvalidInput(
                "--base nf4 quantizes the frozen base under LoRA adapters: give --lora-rank R \
                 (or --adapter DIR)"
                    .into(),
            )
            .into());
        }
        Ok(())
    }

    /// The adapters `--lora-rank`, `--lora-alpha` and `--lora-targets` ask for; `family` gives
    /// the default targets (an IR file has none: it must name them).
    pub fn lora(&self, family: Option<Family>) -> anyhow::Result<Option<LoraSettings>> {
        let Some(rank) = self.lora_rank else {
            if self.lora_alpha.is_some() || !self.lora_targets.is_empty() {
                return Err(CliError::InvalidInput(
                    "--lora-alpha and --lora-targets shape the adapters --lora-rank asks for: \
                     give --lora-rank R"
                        .into(),
                )
                .into());
            }
            return Ok(None);
        };
        if rank == 0 {
            return Err(CliError::InvalidInput("--lora-rank must be at least 1".into()).into());
        }
        let alpha = self.lora_alpha.unwrap_or(rank as f64);
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(CliError::InvalidInput(format!(
                "--lora-alpha must be a positive number, found {alpha}"
            ))
            .into());
        }
        let targets: Vec<String> = match (&self.lora_targets[..], family) {
            ([], Some(f)) => f.lora_targets().iter().map(|t| t.to_string()).collect(),
            ([], None) => {
                return Err(CliError::InvalidInput(
                    "--lora-rank on an IR file: name the modules with --lora-targets".into(),
                )
                .into())
            }
            (given, _) => given.iter().map(|t| t.trim().to_string()).collect(),
        };
        if targets.iter().any(String::is_empty) {
            return Err(CliError::InvalidInput(
                "--lora-targets has an empty name: give module names separated by commas".into(),
            )
            .into());
        }
        Ok(Some(LoraSettings {
            rank,
            alpha,
            targets,
            base: self.base,
        }))
    }

    pub fn settings(
        &self,
        precision: Precision,
        objective: Objective,
        batch: usize,
        seq: usize,
    ) -> anyhow::Result<TrainSettings> {
        // torch.optim.AdamW's defaults, but for the weight decay (transformers' 0.01).
        let adamw = AdamWHparams {
            beta1: self.beta1.unwrap_or(0.9),
            beta2: self.beta2.unwrap_or(0.999),
            eps: self.eps.unwrap_or(1e-8),
            weight_decay: self.weight_decay.unwrap_or(0.01),
        };
        let optimizer = match self.optimizer {
            OptimizerChoice::Adamw => OptimizerKind::AdamW(adamw),
            OptimizerChoice::Adamw8bit => OptimizerKind::AdamW8bit(adamw),
            OptimizerChoice::Sgd => OptimizerKind::Sgd(SgdHparams {
                momentum: self.momentum.unwrap_or(0.9),
                weight_decay: self.weight_decay.unwrap_or(0.0),
            }),
            // lion-pytorch's defaults.
            OptimizerChoice::Lion => OptimizerKind::Lion(LionHparams {
                beta1: self.beta1.unwrap_or(0.9),
                beta2: self.beta2.unwrap_or(0.99),
                weight_decay: self.weight_decay.unwrap_or(0.0),
            }),
            // transformers' pairing: the relative step scales by the parameter's RMS, a given
            // rate does not.
            OptimizerChoice::Adafactor => {
                let defaults = AdafactorHparams::defaults(self.lr.is_none());
                OptimizerKind::Adafactor(AdafactorHparams {
                    beta1: self.beta1,
                    decay_rate: self.decay_rate.unwrap_or(defaults.decay_rate),
                    clip_threshold: self.clip_threshold.unwrap_or(defaults.clip_threshold),
                    weight_decay: self.weight_decay.unwrap_or(0.0),
                    warmup_init: self.warmup_init,
                    ..defaults
                })
            }
        };
        self.check_optimizer_flags()?;
        if self.warmup_init
            && !matches!(
                optimizer,
                OptimizerKind::Adafactor(AdafactorHparams {
                    relative_step: true,
                    ..
                })
            )
        {
            return Err(CliError::InvalidInput(
                "--warmup-init is Adafactor's relative-step warm-up: use it with --optimizer \
                 adafactor and no --lr"
                    .into(),
            )
            .into());
        }
        if self.grad_accum == 0 {
            return Err(CliError::InvalidInput("--grad-accum must be at least 1".into()).into());
        }
        if self.world_size == 0 {
            return Err(CliError::InvalidInput("--world-size must be at least 1".into()).into());
        }
        if self.zero > 0 && self.world_size == 1 {
            return Err(CliError::InvalidInput(format!(
                "--zero {} shards state across ranks: give --world-size N (N > 1)",
                self.zero
            ))
            .into());
        }
        if self.optimizer == OptimizerChoice::Adamw8bit && self.optimizer_state != StateDtype::F32 {
            return Err(CliError::InvalidInput(
                "--optimizer-state chooses the dtype of F32 moments; --optimizer adamw8bit \
                 stores them in 8 bits already (and keeps small tensors' in F32): leave it out"
                    .into(),
            )
            .into());
        }
        if precision.is_fp8() && self.param_grads == ParamGrads::Compute {
            crate::errln!(
                "warning: --param-grads compute: the FP8 products' weight gradients are F32 \
                 (--precision fp8 casts each weight from its F32 master, not from a BF16 copy); \
                 the other products' follow the flag"
            );
        }
        Ok(TrainSettings {
            precision,
            objective: objective.to_string(),
            batch,
            seq,
            grad_accum: self.grad_accum,
            optimizer,
            max_grad_norm: self.grad_clip.unwrap_or(0.0),
            loss_scaling: self.loss_scaling(precision)?,
            frozen: self.freeze.clone(),
            no_decay: self.no_decay.clone(),
            param_grads_in_compute_dtype: self.param_grads == ParamGrads::Compute,
            update_in_backward: self.update_in_backward,
            optimizer_state: match self.optimizer_state {
                StateDtype::F32 => castor_ir::DType::F32,
                StateDtype::Bf16 => castor_ir::DType::BF16,
            },
            remat: self.remat,
            classifier: self.classifier,
            epilogues: self.epilogues,
            lora: None,
            parallel: castor_ir::Parallel {
                world_size: self.world_size,
                zero: self.zero,
            },
            packed: self.pack,
            unpadded: self.unpadded,
            dropout: self.dropout,
        })
    }
}

/// `graph` with the adapters `lora` asks for (the `lora` pass, run before the precision
/// passes so the adapters' products are assigned like every other), and the pass's report.
pub fn with_adapters(
    graph: castor_ir::Graph,
    lora: Option<&LoraSettings>,
) -> anyhow::Result<(castor_ir::Graph, Option<castor_passes::PassReport>)> {
    use castor_passes::Pass;
    let Some(config) = lora else {
        return Ok((graph, None));
    };
    let (graph, report) = castor_passes::lora::Lora {
        config: config.clone(),
    }
    .run(&graph)
    .map_err(|e| CliError::InvalidInput(e.to_string()))?;
    castor_ir::verify(&graph).context("the lora pass built an invalid graph")?;
    Ok((graph, Some(report)))
}
