//! Training data: where `castor train` gets its micro-batches.
//!
//! - A safetensors batch file (`input_ids` [B, T], optional `attention_mask`, `labels`): the
//!   same batch every step, the way the reference fixtures train.
//! - A token stream cut into windows of T tokens (the tail that fills no window is unused).
//!   Windows are read in a shuffled order (a new permutation every pass over the data, from
//!   `--seed`), or in order with `--data-order sequential`. The number of windows read is part
//!   of a checkpoint, so a resumed run reads what the uninterrupted run would have read. A
//!   stream comes from
//!   - text, tokenized with the model's tokenizer ([`TextTokenizer`]: never truncated or
//!     padded): a text file is one document, a folder holds one document per file (in name
//!     order), a `.jsonl` file one document per line's `text`; each document is framed as
//!     the tokenizer frames a text and ended with its end-of-text (or separator) token;
//!   - a pre-tokenized `.bin` file: llm.c's format (a header of 256 little-endian int32, magic
//!     20240520, version 1 = u16 tokens, version 2 = u32 tokens, then the token count) or, when
//!     the magic is absent, nanoGPT's raw little-endian u16 tokens; mapped, not read
//!     (`crate::training::data::tokens`).
//! - For masked-LM training (`--objective mlm` on a stream) each window is masked as
//!   transformers' `DataCollatorForLanguageModeling` masks: 15% of the tokens that are not
//!   special are chosen (their labels are the tokens, every other label -100); of those, 80%
//!   become the mask token, 10% a random token, 10% stay. The draws of window k come from
//!   (`--seed`, k), so resuming needs no saved generator.
//!
//! With a validation fraction the stream's last tokens are held out: training never reads
//! them, and [`Data::validation_batches`] cuts them into fixed windows (masked with fixed
//! draws for mlm).

pub mod labelled;
pub mod packing;
pub mod sft;
pub mod tokens;

use crate::batch::{read_batch, read_labels};
use crate::rng::Rng;
use crate::tokenizer::TextTokenizer;
use crate::CliError;
use castor_ir::{DType, Tensor};
use castor_models::{Model, Objective, IGNORE_INDEX};
use labelled::{is_labelled_file, Labelled, LabelledOptions};
use serde::{Deserialize, Serialize};
use sft::{LossOn, Sft, SftOptions};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use tokens::{map_token_file, Tokens};
pub use tokens::{LLMC_HEADER_INTS, LLMC_MAGIC};

/// The order windows are read in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataOrder {
    /// A seeded permutation of the windows, a new one every pass over the data.
    #[default]
    Shuffle,
    /// Consecutive windows from the start, wrapping at the end.
    Sequential,
}

/// Purposes of derived random streams.
const SHUFFLE: u64 = 1;
const MASKING: u64 = 2;
const VALIDATION_MASKING: u64 = 3;

/// Masked-LM masking, as `DataCollatorForLanguageModeling` with its defaults.
#[derive(Clone, Debug)]
pub struct Masking {
    pub mask: i64,
    /// Random replacements are drawn from `0..vocab` (the tokenizer's size, as transformers
    /// draws from `len(tokenizer)`).
    pub vocab: u64,
    /// Never masked (`[CLS]`, `[SEP]`, `[PAD]`, ...).
    pub special: BTreeSet<i64>,
}

/// transformers' `mlm_probability`.
const MLM_PROBABILITY: f64 = 0.15;

impl Masking {
    /// The tokenizer's masking, or why it cannot mask.
    pub fn of(tokenizer: &TextTokenizer) -> anyhow::Result<Masking> {
        let mask = tokenizer.mask().ok_or_else(|| {
            CliError::InvalidInput(format!(
                "the mlm objective masks tokens, but the tokenizer ({}) has no mask token",
                tokenizer.describe()
            ))
        })?;
        Ok(Masking {
            mask: i64::from(mask),
            vocab: tokenizer.len() as u64,
            special: tokenizer.special_ids().into_iter().map(i64::from).collect(),
        })
    }

    /// Masks `ids` in place and returns the labels.
    pub fn apply(&self, ids: &mut [i64], rng: &mut Rng) -> Vec<i64> {
        let mut labels = vec![IGNORE_INDEX; ids.len()];
        for (id, label) in ids.iter_mut().zip(labels.iter_mut()) {
            if self.special.contains(id) || rng.next_f64() >= MLM_PROBABILITY {
                continue;
            }
            *label = *id;
            let r = rng.next_f64();
            if r < 0.8 {
                *id = self.mask;
            } else if r < 0.9 {
                *id = rng.below(self.vocab) as i64;
            }
        }
        labels
    }
}

pub enum Data {
    /// One fixed batch.
    Fixed {
        tensors: HashMap<String, Tensor>,
        batch: usize,
        seq: usize,
    },
    /// A token stream cut into windows.
    Stream(Box<Stream>),
    /// Labelled examples for a sequence classifier (`labelled.rs`).
    Labelled(Box<Labelled>),
    /// Conversations or prompt-completion pairs for supervised fine-tuning (`sft.rs`).
    Sft(Box<Sft>),
}

pub struct Stream {
    tokens: Tokens,
    /// Held-out tokens (the stream's tail), empty without a validation split.
    validation: Tokens,
    batch: usize,
    seq: usize,
    order: DataOrder,
    seed: u64,
    masking: Option<Masking>,
    /// Windows read so far (the checkpointed position).
    read: u64,
    /// The permutation of the current pass: (pass, window order).
    permutation: Option<(u64, Vec<u32>)>,
    /// Where the tokens came from, for people.
    source: String,
}

/// How a data file is opened.
#[derive(Clone, Debug, Default)]
pub struct DataOptions {
    /// Sequences per micro-batch (streams; default 8).
    pub batch: Option<usize>,
    /// Tokens per sequence (streams; default 64 or the model's positions if fewer).
    pub seq: Option<usize>,
    /// The fraction of the stream held out for validation (0 = none).
    pub val_fraction: f64,
    pub order: DataOrder,
    pub seed: u64,
    /// A validation file (labelled data), instead of `val_fraction`.
    pub validation: Option<std::path::PathBuf>,
    /// The plan file `batch` and `seq` come from (`train --plan`), to name in a shape error.
    pub plan: Option<std::path::PathBuf>,
    /// Which tokens of SFT examples the loss is on.
    pub loss_on: LossOn,
}

impl Data {
    /// Opens `path` for `model`: `.safetensors` files are fixed batches, `.bin` files token
    /// files, anything else text (a file, a folder of files, or `.jsonl`).
    pub fn open(
        path: &Path,
        model: &Model,
        objective: Objective,
        options: &DataOptions,
    ) -> anyhow::Result<Data> {
        let (batch, seq) = (options.batch, options.seq);
        let positions = model.max_positions();
        if let Some(s) = seq.filter(|&s| s > positions) {
            return Err(CliError::InvalidInput(format!(
                "--seq {s} is longer than the {positions} positions of the model \
                 (max_position_embeddings / n_positions in config.json)"
            ))
            .into());
        }
        let classifier = model.head() == castor_models::Head::SequenceClassification;
        let safetensors = path.extension().is_some_and(|e| e == "safetensors");
        if objective == Objective::Classify && !safetensors {
            if !is_labelled_file(path) {
                return Err(invalid(
                    path,
                    "objective `classify` trains on labelled text: a .jsonl file (one \
                     {\"text\": ..., \"label\": ...} per line) or a .csv file with `text` and \
                     `label` columns, or a safetensors batch with `labels`"
                        .into(),
                ));
            }
            let o = LabelledOptions {
                batch,
                seq,
                validation: options.validation.as_deref(),
                val_fraction: options.val_fraction,
                order: options.order,
                seed: options.seed,
            };
            return Ok(Data::Labelled(Box::new(Labelled::open(path, model, &o)?)));
        }
        if objective == Objective::Lm && !classifier && sft::format_of(path).is_some() {
            let o = SftOptions {
                batch,
                seq,
                validation: options.validation.as_deref(),
                val_fraction: options.val_fraction,
                order: options.order,
                seed: options.seed,
                loss_on: options.loss_on,
            };
            return Ok(Data::Sft(Box::new(Sft::open(path, model, &o)?)));
        }
        if model.packed() {
            return Err(invalid(
                path,
                "--pack packs SFT examples (a .jsonl of `messages` or `prompt`/`completion` \
                 lines, objective `lm`); this data is not such examples"
                    .into(),
            ));
        }
        if options.validation.is_some() {
            return Err(CliError::InvalidInput(
                "--validation FILE is for labelled data (objective `classify`) and SFT examples \
                 (conversations, prompt-completion pairs); token streams hold out \
                 --val-fraction"
                    .into(),
            )
            .into());
        }
        if classifier && !safetensors {
            return Err(invalid(
                path,
                format!(
                    "{} reads labelled examples; objective `{objective}` would train it on a \
                     token stream, which castor does not do for a classifier",
                    model.architecture()
                ),
            ));
        }
        if safetensors {
            if options.val_fraction > 0.0 {
                return Err(CliError::InvalidInput(
                    "--val-fraction needs a token stream (text or .bin), not a fixed batch".into(),
                )
                .into());
            }
            let file = castor_models::SafetensorsFile::open(path)?;
            let b = read_batch(&file, model.input_names(), model.vocab_size())?;
            if batch.is_some_and(|x| x != b.batch) || seq.is_some_and(|x| x != b.seq) {
                let (want_batch, want_seq) = (batch.unwrap_or(b.batch), seq.unwrap_or(b.seq));
                let fix = match &options.plan {
                    Some(plan) => format!(
                        "the plan `{}` was compiled for [{want_batch}, {want_seq}]; recompile \
                         it with `castor compile ... --train --batch {} --seq {}`, or train \
                         without --plan",
                        plan.display(),
                        b.batch,
                        b.seq
                    ),
                    None => format!(
                        "--batch/--seq ask for [{want_batch}, {want_seq}]; leave them out (a \
                         fixed batch sets the shape) or give --batch {} --seq {}",
                        b.batch, b.seq
                    ),
                };
                return Err(CliError::InvalidInput(format!(
                    "`{}` holds a [{}, {}] batch (batch x seq), but {fix}",
                    path.display(),
                    b.batch,
                    b.seq
                ))
                .into());
            }
            let mut tensors = b.tensors.clone();
            model.derive_inputs(&mut tensors)?;
            if objective.needs_labels() {
                tensors.insert("labels".into(), read_labels(&file, &b, objective, model)?);
            }
            return Ok(Data::Fixed {
                tensors,
                batch: b.batch,
                seq: b.seq,
            });
        }
        let is_bin = path.extension().is_some_and(|e| e == "bin");
        let tokenizer = if is_bin && objective != Objective::Mlm {
            None
        } else {
            Some(TextTokenizer::for_model(model)?)
        };
        let (tokens, source) = match &tokenizer {
            Some(tok) if !is_bin => (
                Tokens::owned(read_text(path, tok)?),
                tok.describe().to_string(),
            ),
            _ => map_token_file(path)?,
        };
        check_range(path, &tokens, model.vocab_size())?;
        let masking = match (&tokenizer, objective) {
            (Some(tok), Objective::Mlm) => Some(Masking::of(tok)?),
            _ => None,
        };
        let seq = seq.unwrap_or(64).min(positions);
        let batch = batch.unwrap_or(8);
        let mut data = Data::stream(
            tokens,
            batch,
            seq,
            options.val_fraction,
            format!("`{}` ({source})", path.display()),
        )?;
        if let Data::Stream(s) = &mut data {
            s.order = options.order;
            s.seed = options.seed;
            s.masking = masking;
        }
        Ok(data)
    }

    /// A stream over `tokens` with the last `val_fraction` of them held out, read in order
    /// (see [`Data::with_order`]).
    pub fn from_tokens(
        tokens: Vec<i64>,
        batch: usize,
        seq: usize,
        val_fraction: f64,
        source: String,
    ) -> anyhow::Result<Data> {
        Data::stream(Tokens::owned(tokens), batch, seq, val_fraction, source)
    }

    fn stream(
        tokens: Tokens,
        batch: usize,
        seq: usize,
        val_fraction: f64,
        source: String,
    ) -> anyhow::Result<Data> {
        if batch == 0 || seq == 0 {
            return Err(
                CliError::InvalidInput("--batch and --seq must be at least 1".into()).into(),
            );
        }
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(CliError::InvalidInput(format!(
                "--val-fraction must be in [0, 1), found {val_fraction}"
            ))
            .into());
        }
        let held = (tokens.len() as f64 * val_fraction).ceil() as usize;
        let (tokens, validation) = tokens.split_at(tokens.len() - held);
        if tokens.len() < seq {
            return Err(CliError::InvalidInput(format!(
                "{source} has {} training tokens, fewer than one sequence of {seq}",
                tokens.len()
            ))
            .into());
        }
        if held > 0 && validation.len() < seq {
            return Err(CliError::InvalidInput(format!(
                "{source}: --val-fraction {val_fraction} holds out {} tokens, fewer than one \
                 sequence of {seq}",
                validation.len()
            ))
            .into());
        }
        Ok(Data::Stream(Box::new(Stream {
            tokens,
            validation,
            batch,
            seq,
            order: DataOrder::Sequential,
            seed: 0,
            masking: None,
            read: 0,
            permutation: None,
            source,
        })))
    }

    /// The same data read in `order` with `seed` (streams; a fixed batch is unchanged).
    pub fn with_order(mut self, order: DataOrder, seed: u64) -> Data {
        if let Data::Stream(s) = &mut self {
            s.order = order;
            s.seed = seed;
            s.permutation = None;
        }
        self
    }

    pub fn shape(&self) -> (usize, usize) {
        match self {
            Data::Fixed { batch, seq, .. } => (*batch, *seq),
            Data::Stream(s) => (s.batch, s.seq),
            Data::Labelled(l) => l.shape(),
            Data::Sft(d) => d.shape(),
        }
    }

    /// Training tokens (0 for a fixed batch): what a resumed run checks it reads the same
    /// data by.
    pub fn training_tokens(&self) -> usize {
        match self {
            Data::Fixed { .. } => 0,
            Data::Stream(s) => s.tokens.len(),
            Data::Labelled(l) => l.training_tokens(),
            Data::Sft(d) => d.training_tokens(),
        }
    }

    /// One line for people: where the tokens come from, how many there are, in what order.
    pub fn describe(&self) -> String {
        match self {
            Data::Fixed { batch, seq, .. } => format!("a fixed [{batch}, {seq}] batch"),
            Data::Labelled(l) => l.describe(),
            Data::Sft(d) => d.describe(),
            Data::Stream(s) => {
                let mut out = format!(
                    "{}: {} training tokens",
                    s.source,
                    crate::report::thousands(s.tokens.len() as u64)
                );
                if !s.validation.is_empty() {
                    out.push_str(&format!(
                        ", {} held out for validation",
                        crate::report::thousands(s.validation.len() as u64)
                    ));
                }
                out.push_str(&format!(
                    "; {} windows of {}, {}",
                    crate::report::thousands(s.windows()),
                    s.seq,
                    match s.order {
                        DataOrder::Shuffle => format!("shuffled (seed {})", s.seed),
                        DataOrder::Sequential => "in order".to_string(),
                    }
                ));
                if s.masking.is_some() {
                    out.push_str("; masked for mlm (15%: 80% mask, 10% random, 10% kept)");
                }
                out
            }
        }
    }

    /// Windows read so far (0 for a fixed batch).
    pub fn position(&self) -> usize {
        match self {
            Data::Fixed { .. } => 0,
            Data::Stream(s) => s.read as usize,
            Data::Labelled(l) => l.position(),
            Data::Sft(d) => d.position(),
        }
    }

    /// Continues after `windows` windows.
    pub fn seek(&mut self, windows: usize) {
        match self {
            Data::Stream(s) => s.read = windows as u64,
            Data::Labelled(l) => l.seek(windows),
            Data::Sft(d) => d.seek(windows),
            Data::Fixed { .. } => {}
        }
    }

    /// Whether the data is windows of a token stream, whose rows keep every key.
    pub fn is_token_stream(&self) -> bool {
        matches!(self, Data::Stream(_))
    }

    /// The next micro-batch: graph inputs by name (`input_ids`, `attention_mask`, `labels`).
    pub fn next_batch(&mut self, input_names: &[&str]) -> anyhow::Result<HashMap<String, Tensor>> {
        Ok(match self {
            Data::Fixed { tensors, .. } => tensors.clone(),
            Data::Labelled(l) => l.next_batch(input_names)?,
            Data::Sft(d) => d.next_batch(input_names)?,
            Data::Stream(s) => {
                let (b, t) = (s.batch, s.seq);
                let mut ids = Vec::with_capacity(b * t);
                let mut labels = Vec::with_capacity(b * t);
                for _ in 0..b {
                    let k = s.read;
                    let w = s.window(k) as usize;
                    let mut row = s.tokens.to_vec(w * t, (w + 1) * t);
                    let row_labels = match &s.masking {
                        Some(m) => m.apply(&mut row, &mut Rng::derive(s.seed, MASKING, k)),
                        None => row.clone(),
                    };
                    ids.extend(row);
                    labels.extend(row_labels);
                    s.read += 1;
                }
                window_batch(ids, labels, b, t, input_names)
            }
        })
    }

    /// Whether there is held-out data to evaluate on.
    pub fn has_validation(&self) -> bool {
        match self {
            Data::Stream(s) => !s.validation.is_empty(),
            Data::Labelled(l) => l.has_validation(),
            Data::Sft(d) => d.has_validation(),
            Data::Fixed { .. } => false,
        }
    }

    /// Whether validation reports an accuracy (labelled classes, not regression targets).
    pub fn has_classes(&self) -> bool {
        matches!(self, Data::Labelled(l) if l.has_classes())
    }

    /// Up to `max_batches` micro-batches of consecutive held-out windows (at least one; rows
    /// wrap around a short validation split). Always the same batches.
    pub fn validation_batches(
        &self,
        input_names: &[&str],
        max_batches: usize,
    ) -> anyhow::Result<Vec<HashMap<String, Tensor>>> {
        let s = match self {
            Data::Stream(s) => s,
            Data::Labelled(l) => return l.validation_batches(input_names, max_batches),
            Data::Sft(d) => return d.validation_batches(input_names, max_batches),
            Data::Fixed { .. } => return Ok(Vec::new()),
        };
        let (b, t) = (s.batch, s.seq);
        if s.validation.len() < t {
            return Ok(Vec::new());
        }
        let windows = s.validation.len() / t;
        let count = (windows / b).clamp(1, max_batches.max(1));
        Ok((0..count)
            .map(|i| {
                let mut ids = Vec::with_capacity(b * t);
                let mut labels = Vec::with_capacity(b * t);
                for row in 0..b {
                    let w = (i * b + row) % windows;
                    let mut r = s.validation.to_vec(w * t, (w + 1) * t);
                    let l = match &s.masking {
                        Some(m) => m.apply(
                            &mut r,
                            &mut Rng::derive(s.seed, VALIDATION_MASKING, (i * b + row) as u64),
                        ),
                        None => r.clone(),
                    };
                    ids.extend(r);
                    labels.extend(l);
                }
                window_batch(ids, labels, b, t, input_names)
            })
            .collect())
    }
}

impl Stream {
    /// Whole windows in the training tokens.
    fn windows(&self) -> u64 {
        (self.tokens.len() / self.seq) as u64
    }

    /// The window the `k`-th read takes.
    fn window(&mut self, k: u64) -> u64 {
        let n = self.windows();
        read_index(self.order, self.seed, &mut self.permutation, n, k)
    }
}

/// Which of `n` items the `k`-th read takes: in turn, or through a permutation that is new
/// every pass over them (Fisher-Yates from `(seed, pass)`), kept in `permutation` while its
/// pass lasts. Token windows and labelled examples are read this way.
pub(crate) fn read_index(
    order: DataOrder,
    seed: u64,
    permutation: &mut Option<(u64, Vec<u32>)>,
    n: u64,
    k: u64,
) -> u64 {
    let (pass, i) = (k / n, k % n);
    match order {
        DataOrder::Sequential => i,
        DataOrder::Shuffle => {
            if permutation.as_ref().is_none_or(|(p, _)| *p != pass) {
                let mut rng = Rng::derive(seed, SHUFFLE, pass);
                let mut items: Vec<u32> = (0..n as u32).collect();
                for j in (1..items.len()).rev() {
                    items.swap(j, rng.below(j as u64 + 1) as usize);
                }
                *permutation = Some((pass, items));
            }
            permutation
                .as_ref()
                .map_or(i, |(_, items)| u64::from(items[i as usize]))
        }
    }
}

/// A [b, t] batch of token windows: the ids, a full attention mask, zero token types, and the
/// labels (the ids themselves for causal LM, which the loss shifts; the masked tokens for mlm).
fn window_batch(
    ids: Vec<i64>,
    labels: Vec<i64>,
    b: usize,
    t: usize,
    input_names: &[&str],
) -> HashMap<String, Tensor> {
    let mut out = row_inputs(&ids, &vec![1; b * t], b, t, input_names);
    out.insert(
        "labels".into(),
        Tensor::from_i64(DType::I64, [b, t], labels),
    );
    out
}

/// A [b, t] batch's graph inputs by name: the ids, the attention mask, zero token types.
pub(crate) fn row_inputs(
    ids: &[i64],
    mask: &[i64],
    b: usize,
    t: usize,
    input_names: &[&str],
) -> HashMap<String, Tensor> {
    input_names
        .iter()
        .map(|&name| {
            let values = match name {
                "input_ids" => ids.to_vec(),
                "attention_mask" => mask.to_vec(),
                _ => vec![0; b * t],
            };
            (
                name.to_string(),
                Tensor::from_i64(DType::I64, [b, t], values),
            )
        })
        .collect()
}

/// The last `fraction` of `examples` (labelled or SFT), held out for validation; an error when
/// it would hold out every one.
pub(crate) fn hold_out<T>(
    path: &Path,
    examples: &mut Vec<T>,
    fraction: f64,
) -> anyhow::Result<Vec<T>> {
    if !(0.0..1.0).contains(&fraction) {
        return Err(CliError::InvalidInput(format!(
            "--val-fraction must be in [0, 1), found {fraction}"
        ))
        .into());
    }
    let held = (examples.len() as f64 * fraction).ceil() as usize;
    if held >= examples.len() && held > 0 {
        return Err(invalid(
            path,
            format!(
                "--val-fraction {fraction} holds out every one of its {} examples",
                examples.len()
            ),
        ));
    }
    Ok(examples.split_off(examples.len() - held))
}

/// The validation examples of each of up to `max_batches` micro-batches of `batch` rows, in
/// order: `(index, filler)`, the last batch filled out with repeats flagged as fillers.
pub(crate) fn validation_rows(
    n: usize,
    batch: usize,
    max_batches: usize,
) -> Vec<Vec<(usize, bool)>> {
    if n == 0 {
        return Vec::new();
    }
    let count = n.div_ceil(batch).clamp(1, max_batches.max(1));
    (0..count)
        .map(|k| {
            (0..batch)
                .map(|r| {
                    let i = k * batch + r;
                    (i % n, i >= n)
                })
                .collect()
        })
        .collect()
}

fn invalid(path: &Path, what: String) -> anyhow::Error {
    CliError::InvalidInput(format!("`{}`: {what}", path.display())).into()
}

/// The documents of a text source: a folder's files (name order, hidden files skipped), a
/// `.jsonl` file's `text` fields, or one file.
fn documents(path: &Path) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let read = |p: &Path| {
        std::fs::read(p)
            .map_err(|e| CliError::InvalidInput(format!("cannot read data `{}`: {e}", p.display())))
    };
    if path.is_dir() {
        let mut files: Vec<_> = std::fs::read_dir(path)
            .map_err(|e| invalid(path, format!("cannot list the folder: {e}")))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.is_file()
                    && !p
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            })
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(invalid(path, "the folder holds no text files".into()));
        }
        return files
            .into_iter()
            .map(|p| Ok((p.display().to_string(), read(&p)?)))
            .collect();
    }
    let bytes = read(path)?;
    if path.extension().is_none_or(|e| e != "jsonl") {
        return Ok(vec![(path.display().to_string(), bytes)]);
    }
    let text = std::str::from_utf8(&bytes)
        .map_err(|e| invalid(path, format!("a .jsonl file must be UTF-8 ({e})")))?;
    let mut docs = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| invalid(path, format!("line {}: {e}", i + 1)))?;
        let t = v["text"].as_str().ok_or_else(|| {
            invalid(
                path,
                format!("line {}: expected an object with a string `text`", i + 1),
            )
        })?;
        docs.push((
            format!("{}:{}", path.display(), i + 1),
            t.as_bytes().to_vec(),
        ));
    }
    Ok(docs)
}

/// Text as one token stream: each document tokenized whole and ended with the end-of-text
/// token (bytes: the documents' bytes, one after another).
fn read_text(path: &Path, tokenizer: &TextTokenizer) -> anyhow::Result<Vec<i64>> {
    let mut tokens = Vec::new();
    for (name, bytes) in documents(path)? {
        if tokenizer.is_bytes() {
            tokens.extend(bytes.into_iter().map(i64::from));
            continue;
        }
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            CliError::InvalidInput(format!(
                "`{name}`: the tokenizer reads text, but this file is not UTF-8 ({e})"
            ))
        })?;
        let ids = tokenizer
            .encode_document(text)
            .map_err(|e| CliError::InvalidInput(format!("`{name}`: {e}")))?;
        tokens.extend(ids.into_iter().map(i64::from));
    }
    Ok(tokens)
}

/// Every token must be a row of the embedding.
fn check_range(path: &Path, tokens: &Tokens, vocab: usize) -> anyhow::Result<()> {
    if let Some((i, t)) = tokens.first_outside(vocab) {
        return Err(invalid(
            path,
            format!(
                "token {i} is id {t}, outside the model's vocabulary of {vocab} tokens (ids \
                 0..{}); was the data tokenized for another model?",
                vocab.saturating_sub(1)
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' DataCollatorForLanguageModeling: 15% of the non-special tokens are
    /// chosen (labels: the token; every other label -100); of those 80% become the mask
    /// token, 10% a random token, 10% stay.
    #[test]
    fn masking_follows_the_collator() {
        let masking = Masking {
            mask: 4,
            vocab: 1000,
            special: [0, 2, 3].into_iter().collect(),
        };
        let n = 200_000;
        // Token 2 and 3 ([CLS], [SEP]) are special; the rest are words 100..999.
        let original: Vec<i64> = (0..n)
            .map(|i| match i % 50 {
                0 => 2,
                49 => 3,
                _ => 100 + (i % 900) as i64,
            })
            .collect();
        let mut ids = original.clone();
        let labels = masking.apply(&mut ids, &mut Rng::new(0));
        let (mut chosen, mut masked, mut random, mut kept) = (0, 0, 0, 0);
        for ((&o, &id), &l) in original.iter().zip(&ids).zip(&labels) {
            if masking.special.contains(&o) {
                assert_eq!(
                    (id, l),
                    (o, IGNORE_INDEX),
                    "special tokens are never chosen"
                );
                continue;
            }
            if l == IGNORE_INDEX {
                assert_eq!(id, o, "tokens not chosen stay");
                continue;
            }
            assert_eq!(l, o, "the label of a chosen token is the token");
            chosen += 1;
            match id {
                4 => masked += 1,
                x if x == o => kept += 1,
                _ => random += 1,
            }
        }
        let eligible = original
            .iter()
            .filter(|t| !masking.special.contains(t))
            .count() as f64;
        let share = |k: usize| k as f64 / chosen as f64;
        assert!(
            ((chosen as f64 / eligible) - 0.15).abs() < 0.005,
            "{chosen}"
        );
        assert!((share(masked) - 0.8).abs() < 0.01, "{masked}");
        // A random replacement may draw the token itself (1 in 1000).
        assert!((share(random) - 0.1).abs() < 0.01, "{random}");
        assert!((share(kept) - 0.1).abs() < 0.01, "{kept}");
        // The same draws give the same masks: resuming needs no saved state.
        let mut again = original.clone();
        assert_eq!(masking.apply(&mut again, &mut Rng::new(0)), labels);
        assert_eq!(again, ids);
    }

    #[test]
    fn shuffled_windows_are_a_permutation_per_pass() {
        let tokens: Vec<i64> = (0..100).collect();
        let mut data = Data::from_tokens(tokens, 1, 10, 0.0, "t".into())
            .unwrap()
            .with_order(DataOrder::Shuffle, 3);
        let first_ids = |b: &HashMap<String, Tensor>| b["input_ids"].as_i64().unwrap()[0];
        let pass = |d: &mut Data| -> Vec<i64> {
            (0..10)
                .map(|_| first_ids(&d.next_batch(&["input_ids"]).unwrap()) / 10)
                .collect()
        };
        let a = pass(&mut data);
        let b = pass(&mut data);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_ne!(a, (0..10).collect::<Vec<_>>(), "shuffled");
        assert_ne!(a, b, "a new order every pass");
        // Seeking to a position reads what the run would have read there.
        data.seek(10);
        assert_eq!(pass(&mut data), b);
        let mut sequential = Data::from_tokens((0..100).collect(), 1, 10, 0.0, "t".into()).unwrap();
        assert_eq!(pass(&mut sequential), (0..10).collect::<Vec<_>>());
    }
}
