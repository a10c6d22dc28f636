//! The front end's error type.
//!
//! Checkpoints and configs come from outside, so every failure is a value, never a panic, and
//! every message says what went wrong, where (file, tensor, config field) and, where it
//! applies, what was expected and what was found.

use castor_ir::IrError;
use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong between a checkpoint folder and a graph.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read `{path}`: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The path is neither a checkpoint folder nor a config.json file.
    #[error("`{path}` is not a checkpoint: {message}")]
    NotACheckpoint { path: PathBuf, message: String },

    /// The 8-byte length or the JSON header of a safetensors file is malformed.
    #[error("`{file}`: malformed safetensors header: {message}")]
    Header { file: PathBuf, message: String },

    /// One header entry is malformed (dtype, shape, offsets, length, overlap).
    #[error("`{file}`: tensor `{tensor}`: {message}")]
    TensorEntry {
        file: PathBuf,
        tensor: String,
        message: String,
    },

    /// The same tensor name occurs in two shards (or twice in one header).
    #[error("tensor `{tensor}` is stored twice: in `{first}` and in `{second}`")]
    DuplicateTensor {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },

    /// `model.safetensors.index.json` is malformed or disagrees with its shards.
    #[error("`{file}`: {message}")]
    Index { file: PathBuf, message: String },

    /// A shard named by the index would resolve outside the checkpoint folder.
    #[error(
        "`{index}`: shard file name `{shard}` (for tensor `{tensor}`) is not a plain file name \
         inside the checkpoint folder"
    )]
    UnsafeShardPath {
        index: PathBuf,
        shard: String,
        tensor: String,
    },

    /// A config.json field is malformed or out of range.
    #[error("`{file}`: config field `{field}`: {message}")]
    Config {
        file: PathBuf,
        field: String,
        message: String,
    },

    #[error("`{file}`: unsupported model_type `{found}` (supported: {supported})")]
    UnsupportedModelType {
        file: PathBuf,
        found: String,
        supported: String,
    },

    #[error(
        "`{file}`: unsupported architecture {found} for model_type `{model_type}` \
         (supported: {supported})"
    )]
    UnsupportedArchitecture {
        file: PathBuf,
        model_type: String,
        found: String,
        supported: String,
    },

    #[error("`{file}`: config field `{field}`: unsupported activation `{found}` (supported: {supported})")]
    UnsupportedActivation {
        file: PathBuf,
        field: String,
        found: String,
        supported: String,
    },

    /// A config feature castor does not implement (rope scaling, cross-attention, ...).
    #[error("`{file}`: config field `{field}`: {what} is not supported")]
    UnsupportedFeature {
        file: PathBuf,
        field: String,
        what: String,
    },

    /// The checkpoint does not hold what the architecture needs: every missing tensor, every
    /// shape mismatch and every unreadable dtype at once.
    #[error(transparent)]
    Mismatch(Box<MismatchReport>),

    /// A training objective that does not fit the model or the batch.
    #[error("objective `{objective}` for {architecture}: {message}")]
    Objective {
        objective: String,
        architecture: String,
        message: String,
    },

    /// Writing a file failed (encoding, or I/O: the OS error is in `message`).
    #[error("cannot write `{path}`: {message}")]
    Write { path: PathBuf, message: String },

    #[error("tensor `{tensor}` is not in `{path}`")]
    TensorNotFound { path: PathBuf, tensor: String },

    /// A tensor's stored dtype cannot be converted to what the caller asked for.
    #[error("`{file}`: tensor `{tensor}` is stored as {found}, which cannot be read as {wanted}")]
    UnsupportedDtype {
        file: PathBuf,
        tensor: String,
        found: String,
        wanted: String,
    },

    /// Weights were asked of a model loaded from a config alone.
    #[error(
        "the model was loaded from `{config}` alone, without a checkpoint: {what} needs weights"
    )]
    NoWeights { config: PathBuf, what: String },

    /// Loaded weights hold NaN or Inf values (an error under `--strict`, else a warning).
    #[error(
        "`{checkpoint}`: expected finite weights, found NaN or Inf in {}",
        crate::finite::describe_non_finite(found)
    )]
    NonFiniteWeights {
        checkpoint: PathBuf,
        found: Vec<crate::finite::NonFinite>,
    },

    /// A tensor named by the caller is not a parameter of the architecture.
    #[error("`{tensor}` is not a parameter of {architecture}")]
    NotAParameter {
        architecture: String,
        tensor: String,
    },

    /// `build_graph` was called with sizes the model cannot take.
    #[error("cannot build a graph for batch {batch}, sequence length {seq}: {message}")]
    GraphSize {
        batch: usize,
        seq: usize,
        message: String,
    },

    /// Incremental decoding asked of a model that does not predict the next token.
    #[error(
        "{architecture} is not a causal language model: decoding with a KV cache needs \
         GPT2LMHeadModel or LlamaForCausalLM"
    )]
    NotCausal { architecture: String },

    /// Packed rows are for causal LMs.
    #[error(
        "{architecture} cannot take packed sequences: packing (--pack) trains a causal LM \
         (GPT2LMHeadModel, LlamaForCausalLM and its family), whose rows can hold several \
         examples each attending only to itself"
    )]
    NotPackable { architecture: String },

    /// Unpadded rows are for causal LMs.
    #[error(
        "{architecture} cannot take unpadded rows: --unpadded trains a causal LM \
         (GPT2LMHeadModel, LlamaForCausalLM and its family) on windows of a token stream, \
         whose rows keep every key; an encoder or a classifier reads the attention mask"
    )]
    NotUnpaddable { architecture: String },

    /// Packed rows read positions, unpadded rows nothing: a model takes one or the other.
    #[error(
        "packed rows (--pack: SFT examples end to end, read through `position_ids`) and \
         unpadded rows (--unpadded: token windows, no mask) exclude each other"
    )]
    RowsConflict,

    /// A decoder classifier without `pad_token_id` cannot tell which token ends each row.
    #[error(
        "the config has no `pad_token_id`, so the classifier cannot find the last token of \
         each of {batch} sequences (transformers allows a batch of one only): set \
         `pad_token_id` in config.json"
    )]
    NoPadToken { batch: usize },

    /// The IR builder rejected a node: a bug in this crate, reported rather than panicking.
    #[error("building the {architecture} graph failed: {source}")]
    Graph {
        architecture: String,
        #[source]
        source: IrError,
    },
}

/// A parameter the architecture needs: its checkpoint tensor name and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl ParamSpec {
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.into(),
        }
    }

    /// Number of elements; shapes are validated to fit in `u64` before specs are made.
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// A parameter whose checkpoint tensor has the wrong shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeMismatch {
    pub name: String,
    pub expected: Vec<usize>,
    pub found: Vec<usize>,
}

/// A parameter whose checkpoint tensor has a dtype castor cannot read as float.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DtypeProblem {
    pub name: String,
    pub file: PathBuf,
    pub found: String,
}

/// Every way a checkpoint failed to match its architecture, reported together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MismatchReport {
    pub checkpoint: PathBuf,
    pub architecture: String,
    pub missing: Vec<ParamSpec>,
    pub shape_mismatches: Vec<ShapeMismatch>,
    pub bad_dtypes: Vec<DtypeProblem>,
    /// Checkpoint tensors the architecture does not know (often the missing ones, misnamed).
    pub unused: Vec<String>,
    /// Tensors of modules the architecture has, which it does not read (a bias of a
    /// projection that this config builds without one): the checkpoint was made by another
    /// architecture than the one config.json names, and running without them would compute
    /// something else.
    pub extra_params: Vec<String>,
    /// Shape-deciding fields config.json leaves out: when any is, the weights disagreeing
    /// with its default is the likely cause, and the report says that instead of listing
    /// every tensor it touches.
    pub defaulted: Vec<crate::config::DefaultedField>,
}

impl std::error::Error for MismatchReport {}

impl MismatchReport {
    /// The defaulted fields as the cause, in one short message: `config.json has no
    /// `num_hidden_layers`, so LlamaConfig's default 32 was used ...`.
    fn fmt_defaulted(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fields: Vec<String> = self
            .defaulted
            .iter()
            .map(|d| format!("`{}` ({}'s default {} was used)", d.field, d.class, d.value))
            .collect();
        let example = self
            .missing
            .first()
            .map(|p| format!("`{}` is missing", p.name))
            .or_else(|| {
                self.shape_mismatches.first().map(|m| {
                    format!(
                        "`{}` is {}, not {}",
                        m.name,
                        dims(&m.found),
                        dims(&m.expected)
                    )
                })
            })
            .unwrap_or_default();
        write!(
            f,
            "checkpoint `{}` does not match {}: config.json has no {}, as transformers \
             would default it, and the weights disagree ({} missing tensor(s), {} shape \
             mismatch(es); {example}): set {} in config.json",
            self.checkpoint.display(),
            self.architecture,
            fields.join(" and no "),
            self.missing.len(),
            self.shape_mismatches.len(),
            self.defaulted
                .iter()
                .map(|d| format!("`{}`", d.field))
                .collect::<Vec<_>>()
                .join(" and ")
        )
    }
}

impl fmt::Display for MismatchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shapes = !self.missing.is_empty() || !self.shape_mismatches.is_empty();
        if shapes && !self.defaulted.is_empty() {
            return self.fmt_defaulted(f);
        }
        write!(
            f,
            "checkpoint `{}` does not match {}:",
            self.checkpoint.display(),
            self.architecture
        )?;
        if !self.missing.is_empty() {
            write!(f, "\n  {} missing tensor(s):", self.missing.len())?;
            for p in &self.missing {
                write!(f, "\n    `{}` (expected shape {})", p.name, dims(&p.shape))?;
            }
        }
        if !self.shape_mismatches.is_empty() {
            write!(f, "\n  {} shape mismatch(es):", self.shape_mismatches.len())?;
            for m in &self.shape_mismatches {
                write!(
                    f,
                    "\n    `{}`: expected {}, found {}",
                    m.name,
                    dims(&m.expected),
                    dims(&m.found)
                )?;
            }
        }
        if !self.bad_dtypes.is_empty() {
            write!(f, "\n  {} unsupported dtype(s):", self.bad_dtypes.len())?;
            for d in &self.bad_dtypes {
                write!(
                    f,
                    "\n    `{}` in `{}`: stored as {}, expected F32, F16 or BF16",
                    d.name,
                    d.file.display(),
                    d.found
                )?;
            }
        }
        if !self.extra_params.is_empty() {
            write!(
                f,
                "\n  {} tensor(s) of modules {} has, which it does not read: the checkpoint \
                 holds parameters this config turns off (e.g. attention biases: a Qwen2 \
                 checkpoint under model_type `llama`), so it is not the architecture config.json \
                 describes:",
                self.extra_params.len(),
                self.architecture
            )?;
            const SHOWN: usize = 8;
            for name in self.extra_params.iter().take(SHOWN) {
                write!(f, "\n    `{name}`")?;
            }
            if self.extra_params.len() > SHOWN {
                write!(f, "\n    ... and {} more", self.extra_params.len() - SHOWN)?;
            }
        }
        if !self.unused.is_empty() {
            write!(
                f,
                "\n  {} unknown tensor(s) in the checkpoint:",
                self.unused.len()
            )?;
            for name in &self.unused {
                write!(f, "\n    `{name}`")?;
            }
        }
        Ok(())
    }
}

/// `[768,2304]`, as the IR prints shapes.
pub(crate) fn dims(shape: &[usize]) -> String {
    castor_ir::Shape(shape.to_vec()).to_string()
}
