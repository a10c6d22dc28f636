//! A model: config, head, naming prefix and (optionally) the checkpoint that binds it.
//!
//! Loading decides three things the rest of castor relies on, and checks them against the
//! checkpoint when there is one:
//! * the head (`Head`), from `architectures` when present, otherwise from the tensor names;
//! * the naming prefix (`transformer.`, `bert.`, `model.` or none), from the tensor names,
//!   because a base-model checkpoint loads into a model with a head (as in transformers);
//! * the expected parameters, each with its exact checkpoint name and shape. Every missing
//!   tensor, shape mismatch and unreadable dtype is reported in one error; tensors the
//!   architecture does not use are warnings, split into known buffers, tied copies and the
//!   rest, as transformers' "Some weights of the checkpoint were not used".

use crate::build::{AttentionImpl, Ctx};
use crate::checkpoint::{Checkpoint, CONFIG_FILE};
use crate::config::{Config, Family, ModelConfig, MAX_PARAMETERS};
use crate::error::{DtypeProblem, MismatchReport, ModelError, ParamSpec, ShapeMismatch};
use crate::finite::{find_non_finite, NonFinite};
use castor_ir::{DType, Graph, ModelShape, Shape, Tensor, Value};
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::path::Path;

/// What sits on top of the base model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Head {
    /// The bare base model (`GPT2Model`, `LlamaModel`, `BertModel` without a pooler).
    Base,
    /// `BertModel` with its pooler.
    Pooler,
    /// A tied or untied LM head (`GPT2LMHeadModel`, `LlamaForCausalLM`).
    CausalLm,
    /// `BertForMaskedLM`.
    MaskedLm,
    /// `BertForSequenceClassification`, `LlamaForSequenceClassification` (`classify.rs`).
    SequenceClassification,
}

impl fmt::Display for Head {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Head::Base => "base",
            Head::Pooler => "pooler",
            Head::CausalLm => "causal-lm",
            Head::MaskedLm => "masked-lm",
            Head::SequenceClassification => "sequence-classification",
        })
    }
}

/// Checkpoint tensors the architecture does not read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Unknown tensors: not parameters, buffers or tied copies of this architecture (a
    /// warning, like transformers' "Some weights of the checkpoint were not used").
    pub unused: Vec<String>,
    /// Non-parameter buffers (`position_ids`, GPT-2's `attn.bias` causal masks,
    /// `rotary_emb.inv_freq`), which the graph recomputes.
    pub ignored_buffers: Vec<String>,
    /// Stored copies of tied weights (`lm_head.weight` tied to the embeddings, ...).
    pub tied_copies: Vec<String>,
    /// Parameters of a new classification head that the checkpoint lacks, initialized as
    /// transformers initializes them (like its "Some weights ... were newly initialized").
    pub initialized: Vec<String>,
}

/// What each family tells the generic loader.
pub(crate) trait Arch {
    /// `(architectures entry, head)` pairs; the first entry's head is the default with a
    /// head, the second's the base model.
    fn architectures(&self) -> &'static [(&'static str, Head)];
    /// The prefix the base model takes inside a model with a head.
    fn base_prefix(&self) -> &'static str;
    /// A tensor every checkpoint of the family has, without prefix (for prefix detection).
    fn marker(&self) -> &'static str;
    /// The prefix transformers saves for this head.
    fn canonical_prefix(&self, head: Head) -> &'static str;
    /// The head when config.json has no `architectures`, from the tensor names.
    fn guess_head(&self, has: &dyn Fn(&str) -> bool, prefix: &str) -> Head;
    /// The head named by `architectures`, confirmed against the tensor names.
    fn confirm_head(&self, head: Head, _has: &dyn Fn(&str) -> bool, _prefix: &str) -> Head {
        head
    }
    /// Parameters in module order, canonical names.
    fn params(&self, head: Head, prefix: &str) -> Vec<ParamSpec>;
    /// Names under which a tied weight may also be stored.
    fn tied_copies(&self, head: Head, prefix: &str) -> Vec<String>;
    /// True for persistent buffers that are not parameters.
    fn is_buffer(&self, name: &str) -> bool;
    /// The longest sequence the model takes, if it has a learned position table.
    fn max_positions(&self) -> Option<usize>;
    /// Where the config puts dropout, and how much.
    fn dropout(&self) -> crate::config::DropoutRates;
    /// (widest activation row, attention heads), to refuse graphs too large to address.
    fn widths(&self) -> (usize, usize);
    /// The model's shape for graphs of `batch` x `seq` tokens, recorded in the IR.
    fn shape(&self, batch: usize, seq: usize) -> ModelShape;
    /// Builds the forward graph; returns its outputs.
    fn build(&self, head: Head, prefix: &str, ctx: &mut Ctx) -> Result<Vec<Value>, ModelError>;
}

impl ModelConfig {
    pub(crate) fn arch(&self) -> &dyn Arch {
        match self {
            ModelConfig::Gpt2(c) => c,
            ModelConfig::Bert(c) => c,
            ModelConfig::Llama(c) => c,
        }
    }
}

/// A model ready to build graphs and, with a checkpoint, to load weights.
#[derive(Debug)]
pub struct Model {
    config: Config,
    head: Head,
    prefix: String,
    checkpoint: Option<Checkpoint>,
    /// Expected parameters with their checkpoint names.
    params: Vec<ParamSpec>,
    /// Canonical names, parallel to `params` (they differ for `LayerNorm.gamma/beta`).
    canonical: Vec<String>,
    report: LoadReport,
    attention: AttentionImpl,
    /// Training graphs take packed rows ([`Model::set_packed`]).
    packed: bool,
    /// Training graphs take rows that keep every key ([`Model::set_unpadded`]).
    unpadded: bool,
    /// Dropout in the forward and loss graphs ([`Model::set_dropout`]).
    dropout: castor_ir::Dropout,
    /// With a new classification head: the parameters it may initialize when the checkpoint
    /// lacks them (the head's and, for BERT, the pooler's), by checkpoint name.
    new_head_params: BTreeSet<String>,
}

impl Model {
    /// Loads a checkpoint folder (config.json + safetensors) or a bare config.json file
    /// (shapes only, no weights), validating the checkpoint against the architecture.
    pub fn load(path: impl AsRef<Path>) -> Result<Model, ModelError> {
        let path = path.as_ref();
        if path.is_file() {
            if path
                .extension()
                .is_some_and(|e| e == "safetensors" || e == "bin")
            {
                let folder = path
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                return Err(ModelError::NotACheckpoint {
                    path: path.to_path_buf(),
                    message: format!(
                        "it is a weights file; give the checkpoint folder `{}` (config.json + \
                         safetensors) or its config.json",
                        folder.display()
                    ),
                });
            }
            return Model::from_config(Config::read(path)?);
        }
        if !path.is_dir() {
            return Err(ModelError::NotACheckpoint {
                path: path.to_path_buf(),
                message: "no such file or folder".into(),
            });
        }
        let config_path = path.join(CONFIG_FILE);
        if !config_path.is_file() {
            return Err(ModelError::NotACheckpoint {
                path: path.to_path_buf(),
                message: format!("the folder has no `{CONFIG_FILE}`"),
            });
        }
        let config = Config::read(&config_path)?;
        let checkpoint = Checkpoint::open(path)?;
        Model::new(config, Some(checkpoint))
    }

    /// A model from a config alone: graphs and parameter shapes, no weights.
    pub fn from_config(config: Config) -> Result<Model, ModelError> {
        Model::new(config, None)
    }

    /// The model at `path` with a sequence classification head over `labels` (class names;
    /// `LABEL_i` when only a count is known), as `AutoModelForSequenceClassification
    /// .from_pretrained(path, num_labels=...)` builds it: a checkpoint without the head (a
    /// base or language model) gets it initialized, with the BERT pooler when that is missing
    /// too ([`LoadReport::initialized`] lists them), and its other heads' tensors are unused.
    /// A checkpoint that is already such a classifier must have as many labels.
    pub fn load_as_classifier(
        path: impl AsRef<Path>,
        labels: &[String],
    ) -> Result<Model, ModelError> {
        let path = path.as_ref();
        let plain = Model::load(path)?;
        let config = plain.config.with_new_classifier(labels)?;
        if plain.head == Head::SequenceClassification {
            return Ok(plain);
        }
        let checkpoint = plain.checkpoint;
        Model::assemble(config, checkpoint, true)
    }

    /// A model from a parsed config and an opened checkpoint, checked against each other.
    pub fn with_checkpoint(config: Config, checkpoint: Checkpoint) -> Result<Model, ModelError> {
        Model::new(config, Some(checkpoint))
    }

    fn new(config: Config, checkpoint: Option<Checkpoint>) -> Result<Model, ModelError> {
        Model::assemble(config, checkpoint, false)
    }

    fn assemble(
        config: Config,
        checkpoint: Option<Checkpoint>,
        new_head: bool,
    ) -> Result<Model, ModelError> {
        let arch = config.model.arch();
        let has = |n: &str| checkpoint.as_ref().is_some_and(|c| c.contains(n));

        let detected_prefix = checkpoint.as_ref().and_then(|_| {
            let base = arch.base_prefix();
            if has(&format!("{base}{}", arch.marker())) {
                Some(base)
            } else if has(arch.marker()) {
                Some("")
            } else {
                None
            }
        });
        let named = named_head(&config, arch)?;
        let head = match (named, &checkpoint) {
            (Some(h), Some(_)) => arch.confirm_head(h, &has, detected_prefix.unwrap_or("")),
            (Some(h), None) => h,
            (None, Some(_)) => arch.guess_head(&has, detected_prefix.unwrap_or("")),
            // What AutoModel builds: the base model (BERT with its pooler).
            (None, None) => arch.architectures()[1].1,
        };
        let prefix = detected_prefix
            .unwrap_or_else(|| arch.canonical_prefix(head))
            .to_string();

        let mut canonical_specs = arch.params(head, &prefix);
        if head == Head::SequenceClassification {
            let hidden = arch.shape(1, 1).width;
            let family = config.model.family();
            canonical_specs.extend(crate::classify::params(family, &config.labels, hidden));
        }
        let total: u128 = canonical_specs.iter().map(|p| p.numel() as u128).sum();
        if total > MAX_PARAMETERS as u128 {
            return Err(ModelError::Config {
                file: config.file.clone(),
                field: "(sizes)".into(),
                message: format!(
                    "the config describes {total} parameters, more than the limit of \
                     {MAX_PARAMETERS}"
                ),
            });
        }
        let canonical: Vec<String> = canonical_specs.iter().map(|p| p.name.clone()).collect();
        let new_head_params: BTreeSet<String> = if new_head {
            let base: BTreeSet<String> = arch
                .params(Head::Base, &prefix)
                .into_iter()
                .map(|p| p.name)
                .collect();
            canonical
                .iter()
                .filter(|n| !base.contains(*n))
                .cloned()
                .collect()
        } else {
            BTreeSet::new()
        };
        let params: Vec<ParamSpec> = canonical_specs
            .into_iter()
            .map(|p| ParamSpec {
                name: legacy_alias(&p.name, &has).unwrap_or(p.name),
                shape: p.shape,
            })
            .collect();

        let mut model = Model {
            config,
            head,
            prefix,
            checkpoint: None,
            params,
            canonical,
            report: LoadReport::default(),
            attention: AttentionImpl::Eager,
            packed: false,
            unpadded: false,
            dropout: castor_ir::Dropout::Off,
            new_head_params,
        };
        if let Some(ckpt) = checkpoint {
            model.report = model.check_against(&ckpt)?;
            model.checkpoint = Some(ckpt);
        }
        Ok(model)
    }

    /// Checks a checkpoint against the expected parameters: all missing tensors, shape
    /// mismatches and non-float dtypes in one error; otherwise the tensors left unread.
    pub fn check_against(&self, ckpt: &Checkpoint) -> Result<LoadReport, ModelError> {
        let mut problems = MismatchReport {
            checkpoint: ckpt.dir().to_path_buf(),
            architecture: self.architecture().to_string(),
            missing: Vec::new(),
            shape_mismatches: Vec::new(),
            bad_dtypes: Vec::new(),
            unused: Vec::new(),
            extra_params: Vec::new(),
            defaulted: self.config.defaulted.clone(),
        };
        let mut initialized = Vec::new();
        for p in &self.params {
            let Some(info) = ckpt.info(&p.name) else {
                if self.new_head_params.contains(&p.name) {
                    initialized.push(p.name.clone());
                } else {
                    problems.missing.push(p.clone());
                }
                continue;
            };
            if info.shape != p.shape {
                problems.shape_mismatches.push(ShapeMismatch {
                    name: p.name.clone(),
                    expected: p.shape.clone(),
                    found: info.shape.clone(),
                });
            } else if !info.ir_dtype().is_some_and(|d| d.is_float() && !d.is_fp8()) {
                // FP8 checkpoints hold scaled values (with `weight_scale_inv` tensors beside
                // them): read as plain weights they would be wrong.
                problems.bad_dtypes.push(DtypeProblem {
                    name: p.name.clone(),
                    file: ckpt
                        .file_of(&p.name)
                        .map(|f| f.path().to_path_buf())
                        .unwrap_or_default(),
                    found: format!("{:?}", info.dtype),
                });
            }
        }
        let arch = self.config.model.arch();
        let expected: BTreeSet<&str> = self.params.iter().map(|p| p.name.as_str()).collect();
        let tied: BTreeSet<String> = arch
            .tied_copies(self.head, &self.prefix)
            .into_iter()
            .collect();
        // The modules the architecture reads parameters of (`model.layers.0.self_attn.q_proj`).
        let modules: BTreeSet<&str> = self
            .params
            .iter()
            .filter_map(|p| p.name.rsplit_once('.').map(|(m, _)| m))
            .collect();
        let mut report = LoadReport {
            initialized,
            ..LoadReport::default()
        };
        for name in ckpt.names().filter(|n| !expected.contains(n)) {
            let list = if tied.contains(name) {
                &mut report.tied_copies
            } else if arch.is_buffer(name) {
                &mut report.ignored_buffers
            } else if name
                .rsplit_once('.')
                .is_some_and(|(m, _)| modules.contains(m))
            {
                &mut problems.extra_params
            } else {
                &mut report.unused
            };
            list.push(name.to_string());
        }
        if !(problems.missing.is_empty()
            && problems.shape_mismatches.is_empty()
            && problems.bad_dtypes.is_empty()
            && problems.extra_params.is_empty())
        {
            // Unknown names usually explain missing ones (a renamed or mis-prefixed tensor).
            problems.unused = report.unused;
            return Err(ModelError::Mismatch(Box::new(problems)));
        }
        Ok(report)
    }

    pub fn family(&self) -> Family {
        self.config.model.family()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn head(&self) -> Head {
        self.head
    }

    /// The transformers class this model is (`GPT2LMHeadModel`, `BertModel`, ...).
    pub fn architecture(&self) -> &'static str {
        let archs = self.config.model.arch().architectures();
        let head = if self.head == Head::Base && self.family() == Family::Bert {
            Head::Pooler
        } else {
            self.head
        };
        archs
            .iter()
            .find(|(_, h)| *h == head)
            .map_or(archs[0].0, |(n, _)| n)
    }

    /// The prefix of base-model parameter names (`transformer.`, `bert.`, `model.` or ``).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn checkpoint(&self) -> Option<&Checkpoint> {
        self.checkpoint.as_ref()
    }

    /// The parameters, in module order, each with its checkpoint tensor name (the name of
    /// its `param` value in the graph) and shape. Tied weights appear once.
    pub fn expected_params(&self) -> &[ParamSpec] {
        &self.params
    }

    /// Names a user may know from the checkpoint that are no parameter of the graph, each
    /// with the node that plays its part: a stored copy of a tied weight (`lm_head.weight`
    /// in GPT-2, tied to the token embeddings) is the LM head, the node `logits`.
    pub fn name_aliases(&self) -> Vec<(String, String)> {
        if !matches!(self.head, Head::CausalLm | Head::MaskedLm) {
            return Vec::new();
        }
        let arch = self.config.model.arch();
        arch.tied_copies(self.head, &self.prefix)
            .into_iter()
            .map(|copy| (copy, "logits".to_string()))
            .collect()
    }

    /// Tensors in the checkpoint that the architecture does not read (empty without one).
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// Number of parameters, as transformers' `model.num_parameters()` counts them: tied
    /// weights once, buffers not at all.
    pub fn parameter_count(&self) -> u64 {
        self.params.iter().map(ParamSpec::numel).sum()
    }

    /// The float dtype every parameter is stored in, if the checkpoint is uniform.
    pub fn checkpoint_dtype(&self) -> Option<DType> {
        let ckpt = self.checkpoint.as_ref()?;
        let mut dtypes = self
            .params
            .iter()
            .filter_map(|p| ckpt.info(&p.name).and_then(|i| i.ir_dtype()));
        let first = dtypes.next()?;
        dtypes.all(|d| d == first).then_some(first)
    }

    /// Graph inputs a batch provides, in order: `input_ids`, `attention_mask` and, for BERT,
    /// `token_type_ids` (all i64 `[B, T]`); packed, `input_ids` and `position_ids`; unpadded,
    /// `input_ids` alone. A decoder
    /// classifier's graph also reads inputs computed from these ([`Model::derive_inputs`]).
    pub fn input_names(&self) -> &'static [&'static str] {
        match self.family() {
            Family::Bert => &["input_ids", "attention_mask", "token_type_ids"],
            _ if self.packed => &["input_ids", "position_ids"],
            _ if self.unpadded => &["input_ids"],
            _ => &["input_ids", "attention_mask"],
        }
    }

    /// From now on, the forward and loss graphs take *packed* rows: several sequences end to
    /// end in each row, given by `position_ids` (i64 `[B, T]`, each token's position in its
    /// own sequence, restarting at 0 where a sequence starts), as transformers' padding-free
    /// training passes them. Positions are looked up (GPT-2) or rotated (LLaMA) at them and
    /// each token attends only to the tokens before it in its own sequence. Decoding graphs
    /// are never packed. Causal LMs only: an encoder or a classifier is an error.
    pub fn set_packed(&mut self, packed: bool) -> Result<(), ModelError> {
        if packed && (self.family() == Family::Bert || self.head != Head::CausalLm) {
            return Err(ModelError::NotPackable {
                architecture: self.architecture().to_string(),
            });
        }
        if packed && self.unpadded {
            return Err(ModelError::RowsConflict);
        }
        self.packed = packed;
        Ok(())
    }

    pub fn packed(&self) -> bool {
        self.packed
    }

    /// From now on, the training graphs take rows that keep every key, as windows cut from a
    /// token stream are: the graph reads no `attention_mask`, and attention applies the causal
    /// mask (and a sliding window) alone, as transformers' SDPA path does when the mask is all
    /// ones. The function is the one a mask of ones gives. Decoding graphs keep their mask.
    /// Causal LMs only: an encoder or a classifier is an error, as is a packed model.
    pub fn set_unpadded(&mut self, unpadded: bool) -> Result<(), ModelError> {
        if unpadded && !self.unpaddable() {
            return Err(ModelError::NotUnpaddable {
                architecture: self.architecture().to_string(),
            });
        }
        if unpadded && self.packed {
            return Err(ModelError::RowsConflict);
        }
        self.unpadded = unpadded;
        Ok(())
    }

    pub fn unpadded(&self) -> bool {
        self.unpadded
    }

    /// Whether the model can take unpadded rows ([`Model::set_unpadded`]): a causal LM.
    pub fn unpaddable(&self) -> bool {
        self.family() != Family::Bert && self.head == Head::CausalLm
    }

    /// From now on, the forward and loss graphs apply dropout in training mode as `dropout`
    /// says: none, where and as much as the config says (transformers' `train()`), or every
    /// one of the family's dropout sites at one probability. Each `dropout` node reads the
    /// graph input `dropout_key` (i64 `[seed, offset]`; a negative offset is evaluation mode).
    /// Decoding graphs never drop.
    pub fn set_dropout(&mut self, dropout: castor_ir::Dropout) {
        self.dropout = dropout;
    }

    /// The dropout probabilities the forward graph applies at each site.
    pub fn dropout_rates(&self) -> crate::config::DropoutRates {
        let config = self.config.model.arch().dropout();
        match self.dropout {
            castor_ir::Dropout::Off => Default::default(),
            castor_ir::Dropout::Config => config,
            castor_ir::Dropout::P(p) => config.all_at(p),
        }
    }

    /// Graph outputs, in order.
    pub fn output_names(&self) -> &'static [&'static str] {
        match self.head {
            Head::Base => &["last_hidden_state"],
            Head::Pooler => &["last_hidden_state", "pooler_output"],
            Head::CausalLm | Head::MaskedLm | Head::SequenceClassification => &["logits"],
        }
    }

    /// The classification fields of config.json (`num_labels`, `problem_type`, ...).
    pub fn labels(&self) -> &crate::classify::Labels {
        &self.config.labels
    }

    /// Adds the graph inputs computed from a batch's inputs: a decoder classifier's
    /// `last_token_rows` (each row's last non-padding token, from `input_ids` and
    /// `pad_token_id`). Nothing for other models.
    pub fn derive_inputs(&self, inputs: &mut HashMap<String, Tensor>) -> Result<(), ModelError> {
        if self.head != Head::SequenceClassification || self.family() == Family::Bert {
            return Ok(());
        }
        // Without token ids the executor reports the missing `input_ids` itself.
        let Some(ids) = inputs.get("input_ids") else {
            return Ok(());
        };
        let (b, t) = match ids.shape().0.as_slice() {
            &[b, t] => (b, t),
            _ => (0, 0),
        };
        let rows = crate::classify::last_token_rows(
            ids.as_i64().unwrap_or(&[]),
            b,
            t,
            self.config.labels.pad_token_id,
        )?;
        inputs.insert(
            crate::classify::LAST_TOKEN_ROWS.to_string(),
            Tensor::from_i64(DType::I64, [b], rows),
        );
        Ok(())
    }

    /// One parameter as an F32 master tensor (upcast exactly from F16/BF16).
    pub fn load_param(&self, name: &str) -> Result<Tensor, ModelError> {
        if !self.params.iter().any(|p| p.name == name) {
            return Err(ModelError::NotAParameter {
                architecture: self.architecture().to_string(),
                tensor: name.to_string(),
            });
        }
        self.stored_or_initialized(name)
    }

    /// A parameter from the checkpoint, or, for a new head's parameter it lacks, its
    /// initial value (normal with `initializer_range`, zero biases: transformers'
    /// `_init_weights`; seeded by name, so the same on every run).
    fn stored_or_initialized(&self, name: &str) -> Result<Tensor, ModelError> {
        if self.report.initialized.iter().any(|n| n == name) {
            let std = self.config.model.initializer_range() as f32;
            if let Some(p) = self.params.iter().find(|p| p.name == name) {
                return Ok(crate::init::init_param(
                    name,
                    &Shape(p.shape.clone()),
                    std,
                    0,
                ));
            }
        }
        self.weights("load_param")?.tensor_f32(name)
    }

    /// The configured context length; `build_graph` refuses longer sequences for GPT-2 and
    /// BERT (learned position tables).
    pub fn max_positions(&self) -> usize {
        self.config.model.max_positions()
    }

    /// Token vocabulary size (`vocab_size`): input ids must be below it.
    pub fn vocab_size(&self) -> usize {
        self.config.model.vocab_size()
    }

    /// Deterministic initial F32 parameters, as transformers' `_init_weights` (normal with
    /// `initializer_range` for matrices and embeddings, ones for norm scales, zeros for
    /// biases), keyed by graph `param` name; for models built from a config alone. Tensors
    /// are drawn in parallel: each has its own generator (seeded by the seed and its name),
    /// so the values do not depend on the order or the number of threads.
    pub fn init_params(&self, seed: u64) -> HashMap<String, Tensor> {
        use rayon::prelude::*;
        let std = self.config.model.initializer_range() as f32;
        self.params
            .par_iter()
            .map(|p| {
                let shape = castor_ir::Shape(p.shape.clone());
                (
                    p.name.clone(),
                    crate::init::init_param(&p.name, &shape, std, seed),
                )
            })
            .collect()
    }

    /// Every parameter as an F32 master tensor, keyed by its graph `param` name.
    pub fn load_params(&self) -> Result<HashMap<String, Tensor>, ModelError> {
        self.weights("load_params")?;
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), self.stored_or_initialized(&p.name)?)))
            .collect()
    }

    /// The parameters holding NaN or Inf values, sorted by name; with `strict`, any is an
    /// error naming them all.
    pub fn check_finite(
        &self,
        params: &HashMap<String, Tensor>,
        strict: bool,
    ) -> Result<Vec<NonFinite>, ModelError> {
        let found = find_non_finite(params.iter().map(|(n, t)| (n.as_str(), t)));
        self.finite_or_err(found, strict)
    }

    /// Reads every parameter, one at a time, and reports those holding NaN or Inf values as
    /// [`Model::check_finite`] does (what `castor inspect --strict` runs).
    pub fn scan_weights(&self, strict: bool) -> Result<Vec<NonFinite>, ModelError> {
        let ckpt = self.weights("checking weights for NaN and Inf")?;
        let mut found = Vec::new();
        for p in &self.params {
            let t = ckpt.tensor_f32(&p.name)?;
            found.extend(crate::finite::non_finite(&p.name, &t));
        }
        found.sort_by(|a, b| a.tensor.cmp(&b.tensor));
        self.finite_or_err(found, strict)
    }

    fn finite_or_err(
        &self,
        found: Vec<NonFinite>,
        strict: bool,
    ) -> Result<Vec<NonFinite>, ModelError> {
        if strict && !found.is_empty() {
            let checkpoint = self
                .checkpoint
                .as_ref()
                .map_or_else(|| self.config.file.clone(), |c| c.dir().to_path_buf());
            return Err(ModelError::NonFiniteWeights { checkpoint, found });
        }
        Ok(found)
    }

    fn weights(&self, what: &str) -> Result<&Checkpoint, ModelError> {
        self.checkpoint
            .as_ref()
            .ok_or_else(|| ModelError::NoWeights {
                config: self.config.file.clone(),
                what: what.to_string(),
            })
    }

    /// Builds the attention core as `attention` says from now on.
    pub fn set_attention(&mut self, attention: AttentionImpl) {
        self.attention = attention;
    }

    pub fn attention(&self) -> AttentionImpl {
        self.attention
    }

    /// The F32 forward graph (eval mode) for `batch` sequences of `seq` tokens.
    pub fn build_graph(&self, batch: usize, seq: usize) -> Result<Graph, ModelError> {
        self.build(batch, seq, None)
    }

    /// The F32 graph of one step of incremental decoding for a causal LM: `new` tokens per
    /// sequence at positions `past..past + new`, attending to `past` cached positions. Its
    /// inputs are `input_ids` `[batch, new]`, `attention_mask` `[batch, past + new]` and,
    /// when `past > 0`, every layer's cached keys and values `past.N.key` / `past.N.value`
    /// (F32 `[batch, kv heads, past, head dim]`, positions already applied); its outputs are
    /// `logits` `[batch, new, vocab]`, then each layer's `present.N.key` /
    /// `present.N.value`, the cache extended by the new tokens. The logits are those of the
    /// whole sequence's forward graph at the new positions.
    pub fn build_decode_graph(
        &self,
        batch: usize,
        past: usize,
        new: usize,
    ) -> Result<Graph, ModelError> {
        if self.head != Head::CausalLm {
            return Err(ModelError::NotCausal {
                architecture: self.architecture().to_string(),
            });
        }
        if let Some(max) = self.config.model.arch().max_positions() {
            if past + new > max {
                return Err(ModelError::GraphSize {
                    batch,
                    seq: past + new,
                    message: format!("the model has {max} learned positions"),
                });
            }
        }
        self.build(batch, new, Some(past))
    }

    fn build(&self, batch: usize, seq: usize, cache: Option<usize>) -> Result<Graph, ModelError> {
        let arch = self.config.model.arch();
        let size_err = |message: String| ModelError::GraphSize {
            batch,
            seq,
            message,
        };
        if batch == 0 || seq == 0 {
            return Err(size_err("both must be at least 1".into()));
        }
        if let Some(max) = arch.max_positions() {
            if seq > max {
                return Err(size_err(format!("the model has {max} learned positions")));
            }
        }
        let (width, heads) = arch.widths();
        let (b, t) = (batch as u128, seq as u128);
        let largest = (b * t * width as u128).max(b * heads as u128 * t * t);
        if largest > (isize::MAX as u128) / 4 {
            return Err(size_err(format!(
                "the largest activation would have {largest} elements"
            )));
        }
        let params = self
            .canonical
            .iter()
            .zip(&self.params)
            .map(|(c, p)| (c.as_str(), (p.name.as_str(), p.shape.as_slice())))
            .collect();
        let mut ctx = Ctx::new(self.architecture(), params, batch, seq);
        ctx.cache = cache;
        ctx.attention = self.attention;
        ctx.packed = self.packed && cache.is_none();
        ctx.unpadded = self.unpadded && cache.is_none();
        if cache.is_none() {
            ctx.dropout = self.dropout_rates();
        }
        let mut outputs = arch.build(self.head, &self.prefix, &mut ctx)?;
        if self.head == Head::SequenceClassification {
            outputs = crate::classify::build(self.family(), &mut ctx, outputs)?;
        }
        Ok(ctx.finish(outputs, arch.shape(batch, seq)))
    }
}

/// The head `architectures` names, if it names one of this family's supported classes.
fn named_head(config: &Config, arch: &dyn Arch) -> Result<Option<Head>, ModelError> {
    if config.architectures.is_empty() {
        return Ok(None);
    }
    let known = arch.architectures();
    config
        .architectures
        .iter()
        .find_map(|a| known.iter().find(|(n, _)| n == a).map(|&(_, h)| h))
        .map(Some)
        .ok_or_else(|| ModelError::UnsupportedArchitecture {
            file: config.file.clone(),
            model_type: config.model.family().model_type().to_string(),
            found: format!("{:?}", config.architectures),
            supported: known.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
        })
}

/// Old BERT checkpoints store LayerNorm parameters as `gamma`/`beta`; transformers renames
/// them on load. The graph keeps the name actually in the file.
fn legacy_alias(name: &str, has: &dyn Fn(&str) -> bool) -> Option<String> {
    if has(name) {
        return None;
    }
    let alt = if let Some(stem) = name.strip_suffix("LayerNorm.weight") {
        format!("{stem}LayerNorm.gamma")
    } else if let Some(stem) = name.strip_suffix("LayerNorm.bias") {
        format!("{stem}LayerNorm.beta")
    } else {
        return None;
    };
    has(&alt).then_some(alt)
}

/// `prefix + name`.
pub(crate) fn pre(prefix: &str, name: &str) -> String {
    format!("{prefix}{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drawn in parallel, each tensor is what its own generator gives, call after call.
    #[test]
    fn parallel_initialization_is_each_tensors_own_draw() {
        let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/tiny-gpt2.json");
        let model = Model::load(config).unwrap();
        let params = model.init_params(7);
        assert_eq!(params.len(), model.params.len());
        let std = model.config.model.initializer_range() as f32;
        for p in &model.params {
            let shape = castor_ir::Shape(p.shape.clone());
            assert_eq!(
                params[&p.name],
                crate::init::init_param(&p.name, &shape, std, 7)
            );
        }
        assert_eq!(params, model.init_params(7));
    }
}
