//! Labelled text for sequence classification: one example per JSON line (`{"text": ...,
//! "label": ...}`) or CSV record (a header naming `text` and `label` columns), tokenized with
//! the model's tokenizer (framed as it frames a text: `[CLS] ... [SEP]` for BERT, `<s> ...`
//! for LLaMA), cut to `--seq` tokens as transformers' `truncation=True` cuts (the text's tail
//! goes, the framing stays) and right-padded with `pad_token_id` (0 without one),
//! with an attention mask of 1 on the tokens. Right padding is what BERT expects; a decoder
//! classifier reads each row's last token that is not `pad_token_id`, which right padding
//! leaves in place.
//!
//! Labels: a class id in `0..num_labels`, or a label name mapped through the config's
//! `label2id` (names are refused without one); for regression a number (or a list of
//! `num_labels` numbers). Every bad example is an error naming the file, its line and the
//! field.
//!
//! Examples are read in a seeded shuffled order (a new permutation every pass) or in order,
//! as token windows are; the count read is the checkpointed position. A validation set (its
//! own file, or the last `--val-fraction` of the examples) is cut into fixed micro-batches;
//! the rows that fill the last one out are repeats whose labels are ignored.

use crate::tokenizer::TextTokenizer;
use crate::training::data::{hold_out, read_index, row_inputs, validation_rows, DataOrder};
use crate::CliError;
use castor_ir::{DType, Tensor};
use castor_models::{Model, ProblemType, IGNORE_INDEX};
use std::collections::HashMap;
use std::path::Path;

/// One example's label.
#[derive(Clone, Debug, PartialEq)]
enum Label {
    Class(i64),
    Targets(Vec<f32>),
}

#[derive(Clone, Debug)]
struct Example {
    ids: Vec<i64>,
    /// How many of `ids` the tokenizer's framing puts before and after the text's own tokens
    /// (`[CLS]` and `[SEP]` for BERT, `<s>` for LLaMA), which truncation keeps.
    frame: (usize, usize),
    label: Label,
}

impl Example {
    /// Cuts the example to `seq` tokens as transformers' `truncation=True` does: the text's
    /// own tokens lose their tail, the framing stays (`[CLS] ... [SEP]`). A `seq` too short
    /// for the framing and one text token keeps the first `seq` tokens.
    fn truncate(&mut self, seq: usize) {
        let (before, after) = self.frame;
        if self.ids.len() <= seq {
            return;
        }
        if seq <= before + after {
            self.ids.truncate(seq);
            return;
        }
        let tail = self.ids.split_off(self.ids.len() - after);
        self.ids.truncate(seq - after);
        self.ids.extend(tail);
    }
}

/// Labelled examples, tokenized, with their batch shape and read position.
pub struct Labelled {
    train: Vec<Example>,
    validation: Vec<Example>,
    batch: usize,
    seq: usize,
    pad: i64,
    /// A decoder classifier's padding token for `last_token_rows` (`Some(pad_token_id)`);
    /// `None` for BERT, which pools the first token.
    last_token: Option<Option<i64>>,
    num_labels: usize,
    problem: ProblemType,
    order: DataOrder,
    seed: u64,
    read: u64,
    permutation: Option<(u64, Vec<u32>)>,
    source: String,
}

/// True for the files this module reads (`.jsonl`, `.csv`).
pub fn is_labelled_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "jsonl" || e == "csv")
}

/// How labelled data is opened.
pub struct LabelledOptions<'a> {
    pub batch: Option<usize>,
    pub seq: Option<usize>,
    /// A validation file; without one, the last `val_fraction` of the examples.
    pub validation: Option<&'a Path>,
    pub val_fraction: f64,
    pub order: DataOrder,
    pub seed: u64,
}

impl Labelled {
    pub fn open(path: &Path, model: &Model, o: &LabelledOptions) -> anyhow::Result<Labelled> {
        let tokenizer = TextTokenizer::for_model(model)?;
        let labels = model.labels();
        let problem = labels.problem();
        if problem == ProblemType::MultiLabel {
            return Err(CliError::InvalidInput(format!(
                "`{}`: config field `problem_type` is `multi_label_classification`, which castor \
                 does not train (single_label_classification and regression train)",
                model.config().file.display()
            ))
            .into());
        }
        let mut train = read_examples(path, model, &tokenizer)?;
        if train.is_empty() {
            return Err(invalid(path, "holds no examples".into()));
        }
        let validation = match o.validation {
            Some(v) => read_examples(v, model, &tokenizer)?,
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
        let last_token =
            (model.family() != castor_models::Family::Bert).then_some(labels.pad_token_id);
        if let Some(None) = last_token {
            // Checked now rather than at the first step: transformers' own refusal.
            castor_models::classify::last_token_rows(&[], batch, seq, None)?;
        }
        let mut out = Labelled {
            train,
            validation,
            batch,
            seq,
            pad: labels.pad_token_id.unwrap_or(0),
            last_token,
            num_labels: labels.num_labels,
            problem,
            order: o.order,
            seed: o.seed,
            read: 0,
            permutation: None,
            source: format!("`{}` ({})", path.display(), tokenizer.describe()),
        };
        for e in out.train.iter_mut().chain(out.validation.iter_mut()) {
            e.truncate(seq);
        }
        Ok(out)
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

    /// Whether accuracy means anything (class labels, not regression targets).
    pub fn has_classes(&self) -> bool {
        self.problem != ProblemType::Regression
    }

    pub fn describe(&self) -> String {
        let mut out = format!(
            "{}: {} labelled examples ({} labels, {})",
            self.source,
            self.train.len(),
            self.num_labels,
            self.problem
        );
        if !self.validation.is_empty() {
            out.push_str(&format!(
                ", {} held out for validation",
                self.validation.len()
            ));
        }
        out.push_str(&format!(
            "; rows of {} tokens, right-padded, {}",
            self.seq,
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
            let i = self.example(self.read) as usize;
            rows.push((self.train[i].clone(), false));
            self.read += 1;
        }
        self.make_batch(&rows, input_names)
    }

    /// Up to `max_batches` micro-batches covering the validation examples in order; the last
    /// is filled out with repeated rows whose labels are ignored (regression: repeated rows
    /// count, as there is no ignored target).
    pub fn validation_batches(
        &self,
        input_names: &[&str],
        max_batches: usize,
    ) -> anyhow::Result<Vec<HashMap<String, Tensor>>> {
        validation_rows(self.validation.len(), self.batch, max_batches)
            .into_iter()
            .map(|rows| {
                let rows: Vec<(Example, bool)> = rows
                    .into_iter()
                    .map(|(i, filler)| (self.validation[i].clone(), filler))
                    .collect();
                self.make_batch(&rows, input_names)
            })
            .collect()
    }

    /// The `k`-th example read.
    fn example(&mut self, k: u64) -> u64 {
        let n = self.train.len() as u64;
        read_index(self.order, self.seed, &mut self.permutation, n, k)
    }

    /// Rows `(example, filler)` as graph inputs; a filler row's class label is ignored.
    fn make_batch(
        &self,
        rows: &[(Example, bool)],
        input_names: &[&str],
    ) -> anyhow::Result<HashMap<String, Tensor>> {
        let (b, t) = (rows.len(), self.seq);
        let mut ids = vec![self.pad; b * t];
        let mut mask = vec![0i64; b * t];
        let mut classes = Vec::with_capacity(b);
        let mut targets = Vec::with_capacity(b * self.num_labels);
        for (r, (e, filler)) in rows.iter().enumerate() {
            ids[r * t..r * t + e.ids.len()].copy_from_slice(&e.ids);
            mask[r * t..r * t + e.ids.len()].fill(1);
            match &e.label {
                Label::Class(c) => classes.push(if *filler { IGNORE_INDEX } else { *c }),
                Label::Targets(v) => targets.extend_from_slice(v),
            }
        }
        let mut out = HashMap::new();
        if let Some(pad) = self.last_token {
            let last = castor_models::classify::last_token_rows(&ids, b, t, pad)?;
            out.insert(
                castor_models::classify::LAST_TOKEN_ROWS.to_string(),
                Tensor::from_i64(DType::I64, [b], last),
            );
        }
        out.extend(row_inputs(&ids, &mask, b, t, input_names));
        let labels = if self.problem == ProblemType::Regression {
            Tensor::from_f32(DType::F32, [b, self.num_labels], targets)
        } else {
            Tensor::from_i64(DType::I64, [b], classes)
        };
        out.insert("labels".into(), labels);
        Ok(out)
    }
}

fn invalid(path: &Path, what: String) -> anyhow::Error {
    CliError::InvalidInput(format!("`{}`: {what}", path.display())).into()
}

/// The examples of a `.jsonl` or `.csv` file, tokenized (not yet cut to length).
fn read_examples(
    path: &Path,
    model: &Model,
    tokenizer: &TextTokenizer,
) -> anyhow::Result<Vec<Example>> {
    let mut raw = Vec::new();
    let at = |line: u64, what: String| invalid(path, format!("line {line}: {what}"));
    if path.extension().is_some_and(|e| e == "csv") {
        let mut reader =
            csv::Reader::from_path(path).map_err(|e| invalid(path, format!("cannot read: {e}")))?;
        let headers = reader
            .headers()
            .map_err(|e| invalid(path, format!("cannot read the header: {e}")))?
            .clone();
        let column = |name: &str| {
            headers
                .iter()
                .position(|h| h.trim() == name)
                .ok_or_else(|| {
                    at(
                        1,
                        format!(
                        "the header has no `{name}` column (expected `text` and `label`, found \
                         {:?})",
                        headers.iter().collect::<Vec<_>>()
                    ),
                    )
                })
        };
        let (text, label) = (column("text")?, column("label")?);
        for record in reader.records() {
            let record = record.map_err(|e| invalid(path, format!("{e}")))?;
            let line = record.position().map_or(0, |p| p.line());
            let field = |i: usize, name: &str| {
                record
                    .get(i)
                    .map(str::to_string)
                    .ok_or_else(|| at(line, format!("no `{name}` field")))
            };
            let label = field(label, "label")?;
            // A CSV field is text: a number in it is read as a number.
            let value = match serde_json::from_str::<serde_json::Value>(&label) {
                Ok(v @ serde_json::Value::Number(_)) => v,
                _ => serde_json::Value::String(label),
            };
            raw.push((line, field(text, "text")?, value));
        }
    } else {
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid(path, format!("cannot read as UTF-8 text: {e}")))?;
        for (i, line) in text.lines().enumerate() {
            let n = i as u64 + 1;
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| at(n, format!("not JSON: {e}")))?;
            let text = v
                .get("text")
                .and_then(|t| t.as_str())
                .ok_or_else(|| at(n, "expected a string field `text`".into()))?;
            let label = v
                .get("label")
                .filter(|l| !l.is_null())
                .ok_or_else(|| at(n, "expected a field `label`".into()))?;
            raw.push((n, text.to_string(), label.clone()));
        }
    }
    raw.into_iter()
        .map(|(line, text, label)| {
            let label =
                parse_label(&label, model).map_err(|m| at(line, format!("field `label`: {m}")))?;
            let encode = |special: bool| {
                tokenizer
                    .encode(&text, special)
                    .map_err(|e| at(line, format!("field `text`: {e}")))
            };
            let (ids, own) = (encode(true)?, encode(false)?);
            if ids.is_empty() {
                return Err(at(line, "field `text` has no tokens".into()));
            }
            Ok(Example {
                frame: framing(&ids, &own),
                ids: ids.into_iter().map(i64::from).collect(),
                label,
            })
        })
        .collect()
}

/// One label, checked against the model's labels.
fn parse_label(v: &serde_json::Value, model: &Model) -> Result<Label, String> {
    let labels = model.labels();
    let n = labels.num_labels;
    if labels.problem() == ProblemType::Regression {
        let number = |x: &serde_json::Value| {
            x.as_f64()
                .map(|f| f as f32)
                .ok_or_else(|| format!("expected a number (regression target), found {x}"))
        };
        let targets = match v {
            serde_json::Value::Array(a) => a.iter().map(number).collect::<Result<Vec<_>, _>>()?,
            x => vec![number(x)?],
        };
        if targets.len() != n {
            return Err(format!(
                "expected {n} regression target(s), found {}",
                targets.len()
            ));
        }
        return Ok(Label::Targets(targets));
    }
    let id = match v {
        serde_json::Value::String(s) => match labels.label2id.get(s) {
            Some(&id) => id,
            None if labels.label2id.is_empty() => {
                return Err(format!(
                    "`{s}` is a name, but config.json has no `label2id` to map names to ids; \
                     use ids 0..{n}"
                ))
            }
            None => {
                return Err(format!(
                    "unknown label `{s}` (config.json's label2id has: {})",
                    labels
                        .label2id
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            }
        },
        x => x
            .as_i64()
            .ok_or_else(|| format!("expected a class id or a label name, found {x}"))?,
    };
    if id < 0 || id as u64 >= n as u64 {
        return Err(format!(
            "class {id} is outside the model's {n} labels (0..{n})"
        ));
    }
    Ok(Label::Class(id))
}

/// Where a text's own tokens `own` sit inside its framed encoding `ids`: the framing tokens
/// before and after them ((0, 0) when they cannot be found as one run, so nothing is kept).
fn framing(ids: &[u32], own: &[u32]) -> (usize, usize) {
    if own.is_empty() || own.len() > ids.len() {
        return (0, 0);
    }
    match ids.windows(own.len()).position(|w| w == own) {
        Some(before) => (before, ids.len() - before - own.len()),
        None => (0, 0),
    }
}

#[cfg(test)]
mod truncation_tests {
    use super::{framing, Example, Label};

    #[test]
    fn truncation_keeps_the_framing_as_transformers_does() {
        // [CLS]=101 a b c d e [SEP]=102, cut to 5: [CLS] a b c [SEP].
        let ids = [101, 1, 2, 3, 4, 5, 102];
        let frame = framing(&ids, &[1, 2, 3, 4, 5]);
        assert_eq!(frame, (1, 1));
        let mut e = Example {
            ids: ids.iter().map(|&i| i64::from(i)).collect(),
            frame,
            label: Label::Class(0),
        };
        e.truncate(5);
        assert_eq!(e.ids, vec![101, 1, 2, 3, 102]);
        // LLaMA's <s> before the text only.
        let mut e = Example {
            ids: vec![1, 7, 8, 9],
            frame: framing(&[1, 7, 8, 9], &[7, 8, 9]),
            label: Label::Class(0),
        };
        e.truncate(3);
        assert_eq!(e.ids, vec![1, 7, 8]);
        // Too short for the framing and a token: the first tokens.
        let mut e = Example {
            ids: ids.iter().map(|&i| i64::from(i)).collect(),
            frame,
            label: Label::Class(0),
        };
        e.truncate(2);
        assert_eq!(e.ids, vec![101, 1]);
    }
}
