//! Supervised fine-tuning examples, prepared as TRL's `SFTTrainer` prepares them: one example
//! per JSON line, in one of TRL's dataset formats (every line the same):
//!
//! - `{"messages": [{"role": ..., "content": ...}, ...]}`: a conversation, rendered with the
//!   model's chat template (`crate::chat`) and tokenized without added framing. With
//!   `--loss-on completion` (the default) the loss is taken on what the assistant says: the
//!   tokens the template's `{% generation %}` blocks wrote, as TRL's `assistant_only_loss`
//!   selects them (a token counts when it holds a character of a block, transformers'
//!   `char_to_token`). A template without those blocks is refused by name, as TRL refuses it.
//! - `{"prompt": "...", "completion": "..."}`: the completion ended with the tokenizer's
//!   end-of-sequence token unless it ends with it already; the prompt and the prompt plus
//!   completion tokenized as the tokenizer frames a text, and the completion is what follows
//!   their common prefix (TRL's `completion_only_loss`).
//! - `{"prompt": [messages], "completion": [messages]}`: the prompt rendered with the
//!   generation prompt, the whole conversation without it, the completion after their common
//!   prefix.
//!
//! `--loss-on all` takes the loss on every token. Labels are the token ids where the loss is
//! taken and -100 elsewhere (the model shifts them, as transformers does). Examples longer
//! than `--seq` lose their end (TRL's `truncation_mode="keep_start"`), and those left without
//! a label are dropped, both counted in the data line. Rows are right-padded with the pad
//! token under an attention mask. Order, validation split and resume position are as for
//! labelled examples.

use super::{hold_out, packing, read_index, row_inputs, validation_rows, DataOrder};
use crate::chat::ChatTemplate;
use crate::tokenizer::TextTokenizer;
use crate::CliError;
use castor_ir::{DType, Tensor};
use castor_models::{Model, IGNORE_INDEX};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// Which tokens of an SFT example the loss is taken on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossOn {
    /// The completion, or what the assistant says in a conversation.
    #[default]
    Completion,
    /// Every token.
    All,
}

/// The dataset formats of TRL's SFTTrainer that castor reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Messages,
    PromptCompletion,
    ConversationalPromptCompletion,
}

impl Format {
    fn of(v: &Value) -> Option<Format> {
        if v.get("messages").is_some() {
            return Some(Format::Messages);
        }
        match (v.get("prompt"), v.get("completion")) {
            (Some(Value::Array(_)), _) => Some(Format::ConversationalPromptCompletion),
            (Some(_), _) | (None, Some(_)) => Some(Format::PromptCompletion),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Format::Messages => "conversations",
            Format::PromptCompletion => "prompt-completion pairs",
            Format::ConversationalPromptCompletion => "conversational prompt-completion pairs",
        }
    }
}

/// The format of a `.jsonl` file, by its first line: `None` for other files (and for lines
/// of `text`, which train as a token stream).
pub fn format_of(path: &Path) -> Option<Format> {
    use std::io::BufRead;
    if path.extension().is_none_or(|e| e != "jsonl") {
        return None;
    }
    let file = std::io::BufReader::new(std::fs::File::open(path).ok()?);
    let line = file
        .lines()
        .map_while(Result::ok)
        .find(|l| !l.trim().is_empty())?;
    Format::of(&serde_json::from_str(&line).ok()?)
}

#[derive(Clone, Debug, PartialEq)]
struct Example {
    ids: Vec<i64>,
    labels: Vec<i64>,
    /// Where each example of a packed row starts (`[0]` for one example).
    starts: Vec<usize>,
}

impl Example {
    fn new(ids: Vec<i64>, labels: Vec<i64>) -> Example {
        Example {
            ids,
            labels,
            starts: vec![0],
        }
    }

    /// Examples `rows` name, end to end: each one's first label ignored, as TRL's padding-free
    /// collator ignores it (the token before it belongs to another example).
    fn packed(examples: &[Example], rows: Vec<Vec<usize>>) -> Vec<Example> {
        rows.into_iter()
            .map(|row| {
                let mut out = Example::new(Vec::new(), Vec::new());
                out.starts.clear();
                for i in row {
                    let e = &examples[i];
                    out.starts.push(out.ids.len());
                    out.ids.extend(&e.ids);
                    out.labels.push(IGNORE_INDEX);
                    out.labels.extend(&e.labels[1..]);
                }
                out
            })
            .collect()
    }

    /// Each token's position in its own example.
    fn positions(&self) -> impl Iterator<Item = i64> + '_ {
        let ends = self.starts[1..].iter().copied().chain([self.ids.len()]);
        self.starts
            .iter()
            .zip(ends)
            .flat_map(|(&start, end)| 0..(end - start) as i64)
    }
}

/// SFT examples, tokenized and labelled, with their batch shape and read position.
pub struct Sft {
    train: Vec<Example>,
    validation: Vec<Example>,
    batch: usize,
    seq: usize,
    pad: i64,
    format: Format,
    loss_on: LossOn,
    /// Examples cut to `seq`, and examples dropped for having no label left.
    truncated: usize,
    dropped: usize,
    /// With packing: the training examples, and the padding they would have had one per row.
    packed: Option<(usize, f64)>,
    order: DataOrder,
    seed: u64,
    read: u64,
    permutation: Option<(u64, Vec<u32>)>,
    source: String,
}

/// How SFT data is opened.
pub struct SftOptions<'a> {
    pub batch: Option<usize>,
    pub seq: Option<usize>,
    /// A validation file; without one, the last `val_fraction` of the examples.
    pub validation: Option<&'a Path>,
    pub val_fraction: f64,
    pub order: DataOrder,
    pub seed: u64,
    pub loss_on: LossOn,
}

/// What the examples are read with.
struct Readers<'a> {
    tokenizer: &'a TextTokenizer,
    template: Option<&'a ChatTemplate>,
    eos: Option<String>,
    loss_on: LossOn,
}

impl Sft {
    pub fn open(path: &Path, model: &Model, o: &SftOptions) -> anyhow::Result<Sft> {
        let format = format_of(path).ok_or_else(|| invalid(path, 1, "not SFT data".into()))?;
        let tokenizer = TextTokenizer::for_model(model)?;
        let dir = model
            .config()
            .file
            .parent()
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let template = match format {
            Format::PromptCompletion => None,
            _ => Some(ChatTemplate::find(&dir)?.ok_or_else(|| {
                invalid(
                    path,
                    1,
                    format!(
                        "{} need the model's chat template, and `{}` has none \
                         (chat_template.jinja, or chat_template in tokenizer_config.json)",
                        format.name(),
                        dir.display()
                    ),
                )
            })?),
        };
        let readers = Readers {
            tokenizer: &tokenizer,
            template: template.as_ref(),
            eos: tokenizer.end_of_text().map(|id| tokenizer.token(id)),
            loss_on: o.loss_on,
        };
        let mut train = read_examples(path, format, &readers)?;
        let validation = match o.validation {
            Some(v) => {
                let f = format_of(v);
                if f != Some(format) {
                    return Err(invalid(
                        v,
                        1,
                        format!(
                            "the validation data must be {} as the training data",
                            format.name()
                        ),
                    ));
                }
                read_examples(v, format, &readers)?
            }
            None => hold_out(path, &mut train, o.val_fraction)?,
        };
        let positions = model.max_positions();
        let longest = train.iter().map(|e| e.ids.len()).max().unwrap_or(1);
        // By default every training example fits whole (up to the model's positions).
        let seq = o.seq.unwrap_or(longest.min(positions)).max(1);
        let batch = o.batch.unwrap_or(8);
        if batch == 0 {
            return Err(CliError::InvalidInput("--batch must be at least 1".into()).into());
        }
        let truncated = train.iter().filter(|e| e.ids.len() > seq).count();
        let before = train.len();
        let keep = |examples: Vec<Example>| -> Vec<Example> {
            examples
                .into_iter()
                .filter_map(|mut e| {
                    e.ids.truncate(seq);
                    e.labels.truncate(seq);
                    e.labels.iter().any(|&l| l != IGNORE_INDEX).then_some(e)
                })
                .collect()
        };
        let mut train = keep(train);
        let mut validation = keep(validation);
        let dropped = before - train.len();
        if train.is_empty() {
            return Err(invalid(
                path,
                1,
                format!(
                    "no example has a token to train on within --seq {seq} (each is cut to \
                     its first {seq} tokens, and the loss is on the {})",
                    match o.loss_on {
                        LossOn::Completion => "completions (--loss-on completion)",
                        LossOn::All => "whole example",
                    }
                ),
            ));
        }
        let packed = model.packed().then(|| {
            let examples = train.len();
            let unpacked = padding_fraction(&train, seq);
            let pack = |examples: Vec<Example>| {
                let lengths: Vec<usize> = examples.iter().map(|e| e.ids.len()).collect();
                Example::packed(&examples, packing::pack_bfd(&lengths, seq))
            };
            train = pack(std::mem::take(&mut train));
            validation = pack(std::mem::take(&mut validation));
            (examples, unpacked)
        });
        // The padding's id only fills rows (masked out, no loss): the config's, else the end
        // of text.
        let pad = model
            .labels()
            .pad_token_id
            .or(tokenizer.end_of_text().map(i64::from))
            .unwrap_or(0);
        Ok(Sft {
            train,
            validation,
            batch,
            seq,
            pad,
            format,
            loss_on: o.loss_on,
            truncated,
            dropped,
            packed,
            order: o.order,
            seed: o.seed,
            read: 0,
            permutation: None,
            source: format!("`{}` ({})", path.display(), tokenizer.describe()),
        })
    }

    pub fn shape(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }

    /// Training tokens (after truncation): what a resumed run checks it reads the same data by.
    pub fn training_tokens(&self) -> usize {
        self.train.iter().map(|e| e.ids.len()).sum()
    }

    pub fn position(&self) -> usize {
        self.read as usize
    }

    pub fn seek(&mut self, examples: usize) {
        self.read = examples as u64;
    }

    pub fn has_validation(&self) -> bool {
        !self.validation.is_empty()
    }

    pub fn describe(&self) -> String {
        let labelled: usize = self
            .train
            .iter()
            .map(|e| e.labels.iter().filter(|&&l| l != IGNORE_INDEX).count())
            .sum();
        let tokens = self.training_tokens();
        let examples = self.packed.map_or(self.train.len(), |(n, _)| n);
        let mut out = format!(
            "{}: {} {}, {} tokens of which {} in the loss ({})",
            self.source,
            examples,
            self.format.name(),
            crate::report::thousands(tokens as u64),
            crate::report::thousands(labelled as u64),
            match self.loss_on {
                LossOn::Completion => "--loss-on completion",
                LossOn::All => "--loss-on all",
            }
        );
        if !self.validation.is_empty() {
            out.push_str(&format!(
                ", {} held out for validation",
                self.validation.len()
            ));
        }
        if self.truncated > 0 || self.dropped > 0 {
            out.push_str(&format!(
                "; {} longer than {} tokens cut to their start, {} left without a label \
                 dropped",
                self.truncated, self.seq, self.dropped
            ));
        }
        let padding = 100.0 * padding_fraction(&self.train, self.seq);
        let rows = match self.packed {
            Some((_, unpacked)) => format!(
                "; packed into {} rows of {} tokens ({padding:.1}% padding, {:.1}% one example \
                 per row)",
                self.train.len(),
                self.seq,
                100.0 * unpacked
            ),
            None => format!(
                "; rows of {} tokens, right-padded ({padding:.0}% padding)",
                self.seq
            ),
        };
        out.push_str(&format!(
            "{rows}, {}",
            match self.order {
                DataOrder::Shuffle => format!("shuffled (seed {})", self.seed),
                DataOrder::Sequential => "in order".to_string(),
            }
        ));
        out
    }

    pub fn next_batch(&mut self, input_names: &[&str]) -> anyhow::Result<HashMap<String, Tensor>> {
        let mut rows = Vec::with_capacity(self.batch);
        for _ in 0..self.batch {
            let n = self.train.len() as u64;
            let i = read_index(self.order, self.seed, &mut self.permutation, n, self.read);
            rows.push((&self.train[i as usize], false));
            self.read += 1;
        }
        Ok(self.make_batch(&rows, input_names))
    }

    /// Up to `max_batches` micro-batches covering the validation examples in order; the last
    /// is filled out with repeated rows whose labels are all ignored.
    pub fn validation_batches(
        &self,
        input_names: &[&str],
        max_batches: usize,
    ) -> anyhow::Result<Vec<HashMap<String, Tensor>>> {
        Ok(
            validation_rows(self.validation.len(), self.batch, max_batches)
                .into_iter()
                .map(|rows| {
                    let rows: Vec<(&Example, bool)> = rows
                        .into_iter()
                        .map(|(i, filler)| (&self.validation[i], filler))
                        .collect();
                    self.make_batch(&rows, input_names)
                })
                .collect(),
        )
    }

    /// Rows `(example, filler)` as graph inputs; a filler row's labels are all ignored.
    fn make_batch(
        &self,
        rows: &[(&Example, bool)],
        input_names: &[&str],
    ) -> HashMap<String, Tensor> {
        let (b, t) = (rows.len(), self.seq);
        let mut ids = vec![self.pad; b * t];
        let mut mask = vec![0i64; b * t];
        let mut labels = vec![IGNORE_INDEX; b * t];
        let mut positions = vec![0i64; b * t];
        for (r, (e, filler)) in rows.iter().enumerate() {
            let n = e.ids.len();
            let row = r * t..(r + 1) * t;
            ids[r * t..r * t + n].copy_from_slice(&e.ids);
            mask[r * t..r * t + n].fill(1);
            if !filler {
                labels[r * t..r * t + n].copy_from_slice(&e.labels);
            }
            // The padding after the examples is one more sequence of its own.
            let padding = 0..(t - n) as i64;
            for (p, v) in positions[row].iter_mut().zip(e.positions().chain(padding)) {
                *p = v;
            }
        }
        let mut out = row_inputs(&ids, &mask, b, t, input_names);
        out.insert(
            "labels".into(),
            Tensor::from_i64(DType::I64, [b, t], labels),
        );
        if input_names.contains(&"position_ids") {
            out.insert(
                "position_ids".into(),
                Tensor::from_i64(DType::I64, [b, t], positions),
            );
            // Not a graph input of a packed plan: what throughput counts as real tokens.
            out.insert(
                "attention_mask".into(),
                Tensor::from_i64(DType::I64, [b, t], mask),
            );
        }
        out
    }
}

/// The fraction of `rows` rows of `seq` tokens that is padding.
fn padding_fraction(rows: &[Example], seq: usize) -> f64 {
    let tokens: usize = rows.iter().map(|e| e.ids.len()).sum();
    let slots = (rows.len() * seq).max(1);
    (slots - tokens) as f64 / slots as f64
}

fn invalid(path: &Path, line: usize, what: String) -> anyhow::Error {
    CliError::InvalidInput(format!("`{}` line {line}: {what}", path.display())).into()
}

/// The examples of a `.jsonl` file in `format`, tokenized and labelled (not yet cut), in
/// parallel; the first bad line (in file order) is the error.
fn read_examples(path: &Path, format: Format, r: &Readers) -> anyhow::Result<Vec<Example>> {
    use rayon::prelude::*;
    use std::io::BufRead;
    let cannot = |e: std::io::Error| {
        CliError::InvalidInput(format!("cannot read data `{}`: {e}", path.display()))
    };
    let file = std::io::BufReader::new(std::fs::File::open(path).map_err(cannot)?);
    let mut lines = Vec::new();
    for (i, line) in file.lines().enumerate() {
        let line = line.map_err(cannot)?;
        if !line.trim().is_empty() {
            lines.push((i + 1, line));
        }
    }
    if lines.is_empty() {
        return Err(invalid(path, 1, "holds no examples".into()));
    }
    let examples: Vec<anyhow::Result<Example>> = lines
        .par_iter()
        .map(|(number, line)| {
            let at = |what: String| invalid(path, *number, what);
            let v: Value = serde_json::from_str(line).map_err(|e| at(e.to_string()))?;
            if Format::of(&v) != Some(format) {
                return Err(at(format!(
                    "every line must be one of {} as the first is (`messages`, or `prompt` \
                     and `completion`)",
                    format.name()
                )));
            }
            let example = match format {
                Format::Messages => messages_example(&v, r),
                Format::PromptCompletion => prompt_completion(&v, r),
                Format::ConversationalPromptCompletion => conversational_prompt_completion(&v, r),
            };
            example.map_err(|e| at(format!("{e:#}")))
        })
        .collect();
    examples.into_iter().collect()
}

/// A field that must be a list of messages (`{"role": string, "content": ...}`).
fn messages<'v>(v: &'v Value, field: &str) -> anyhow::Result<&'v Vec<Value>> {
    let list = v.get(field).unwrap_or(&Value::Null);
    Ok(crate::chat::as_messages(list)
        .map_err(|e| CliError::InvalidInput(format!("`{field}` {e}")))?)
}

fn text_field<'v>(v: &'v Value, field: &str) -> anyhow::Result<&'v str> {
    v.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| CliError::InvalidInput(format!("`{field}` must be a string")).into())
}

fn ids(tokens: Vec<u32>) -> Vec<i64> {
    tokens.into_iter().map(i64::from).collect()
}

/// The example of prompt tokens `prompt` and prompt-plus-completion tokens `whole`: the loss
/// on what follows their common prefix (TRL's `common_prefix_length`), or on everything.
fn after_prefix(prompt: &[i64], whole: Vec<i64>, loss_on: LossOn) -> Example {
    let shared = prompt
        .iter()
        .zip(&whole)
        .take_while(|(a, b)| a == b)
        .count();
    let labels = whole
        .iter()
        .enumerate()
        .map(|(k, &id)| match loss_on {
            LossOn::Completion if k < shared => IGNORE_INDEX,
            _ => id,
        })
        .collect();
    Example::new(whole, labels)
}

fn prompt_completion(v: &Value, r: &Readers) -> anyhow::Result<Example> {
    let prompt = text_field(v, "prompt")?;
    let mut completion = text_field(v, "completion")?.to_string();
    if let Some(eos) = &r.eos {
        if !completion.ends_with(eos.as_str()) {
            completion.push_str(eos);
        }
    }
    let p = ids(r.tokenizer.encode(prompt, true)?);
    let whole = ids(r.tokenizer.encode(&format!("{prompt}{completion}"), true)?);
    Ok(after_prefix(&p, whole, r.loss_on))
}

fn conversational_prompt_completion(v: &Value, r: &Readers) -> anyhow::Result<Example> {
    let template = r
        .template
        .ok_or_else(|| anyhow::anyhow!("no chat template"))?;
    let prompt = messages(v, "prompt")?;
    let completion = messages(v, "completion")?;
    let both: Vec<Value> = prompt.iter().chain(completion).cloned().collect();
    let p = template.render(&Value::Array(prompt.clone()), true)?;
    let whole = template.render(&Value::Array(both), false)?;
    let p = ids(r.tokenizer.encode(&p.text, false)?);
    let whole = ids(r.tokenizer.encode(&whole.text, false)?);
    Ok(after_prefix(&p, whole, r.loss_on))
}

fn messages_example(v: &Value, r: &Readers) -> anyhow::Result<Example> {
    let template = r
        .template
        .ok_or_else(|| anyhow::anyhow!("no chat template"))?;
    let list = messages(v, "messages")?;
    let rendered = template.render(&Value::Array(list.clone()), false)?;
    let tokens = r.tokenizer.encode_with_offsets(&rendered.text, false)?;
    let ids: Vec<i64> = tokens.iter().map(|(id, _)| i64::from(*id)).collect();
    if r.loss_on == LossOn::All {
        return Ok(Example::new(ids.clone(), ids));
    }
    // transformers' assistant mask: from the token holding a block's first character to the
    // token holding its last.
    let holding = |byte: usize| tokens.iter().position(|(_, range)| range.contains(&byte));
    let mut keep = vec![false; ids.len()];
    for block in &rendered.generation {
        if block.is_empty() {
            continue;
        }
        let (Some(first), last) = (holding(block.start), holding(block.end - 1)) else {
            continue;
        };
        let last = last.unwrap_or(ids.len() - 1);
        keep[first..=last].fill(true);
    }
    if !keep.contains(&true) {
        return Err(CliError::InvalidInput(format!(
            "no assistant tokens: the chat template of `{}` marks none with {{% generation %}} \
             (TRL's assistant-only loss needs those blocks); train on every token with \
             --loss-on all, or give the model a template that marks the assistant's turns",
            template.origin().display()
        ))
        .into());
    }
    let labels = ids
        .iter()
        .zip(&keep)
        .map(|(&id, &k)| if k { id } else { IGNORE_INDEX })
        .collect();
    Ok(Example::new(ids, labels))
}
