//! The training loop `castor train` and `castor demo` share: the learning-rate schedule,
//! progress, the JSON-lines log, validation, the loss-curve picture and the report page,
//! periodic checkpoints, the loss-scale floor and Ctrl-C. Steps are numbered from 1 in
//! everything it writes.

use crate::html::Report;
use crate::plot::{self, LossHistory};
use crate::training::checkpoint::{self, CheckpointFiles, TrainerState};
use crate::training::data::Data;
use crate::training::progress::{Progress, StepLine};
use crate::training::trainer::Trainer;
use anyhow::Context;
use castor_ir::{Tensor, TrainSettings};
use castor_runtime::{LossScale, PlanRunner, RuntimeError, StepReport};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// The same learning rate every step (after warmup).
    Constant,
    /// Cosine decay from --lr to --min-lr over the run (after warmup).
    Cosine,
}

/// Set by Ctrl-C: the loop finishes its step, saves and stops.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// A hook that sees each logged step's JSON log line.
pub type StepHook = Box<dyn FnMut(&serde_json::Value)>;

/// What a caller of the loop sees and decides besides its outputs (the Python API's callback
/// and its KeyboardInterrupt).
#[derive(Default)]
pub struct Hooks {
    /// Called with every logged step's JSON log line; with it, every step is logged.
    pub on_step: Option<StepHook>,
    /// Asked before every step: true makes it the run's last, as Ctrl-C does (the step
    /// finishes, the run saves and stops).
    pub stop: Option<Box<dyn FnMut() -> bool>>,
}

/// One step's line of the JSON log: the step's report, the learning rate and throughput, the
/// validation figures when the step evaluated, and the device time of its runs when it was
/// measured (`--profile` on a GPU).
fn log_line(
    done: u64,
    report: &StepReport,
    lr: f64,
    tokens_per_s: f64,
    val_loss: Option<f64>,
    val_accuracy: Option<f64>,
    objective: &str,
) -> serde_json::Value {
    let mut line = serde_json::json!({
        "step": done,
        "loss": report.loss,
        // As f64, so the log holds the scale exactly (serde writes an f32's shortest decimal).
        "loss_scale": f64::from(report.loss_scale),
        "skipped": report.skipped,
        "grad_norm": if report.grad_norm.is_finite() { Some(report.grad_norm) } else { None },
        "lr": lr,
        "tokens_per_s": tokens_per_s,
    });
    if let Some(v) = val_loss {
        line["val_loss"] = serde_json::json!(v);
    }
    if let Some(a) = val_accuracy {
        line["val_accuracy"] = serde_json::json!(a);
    }
    if let Some(p) = val_loss.and_then(|v| perplexity(objective, v)) {
        line["val_perplexity"] = serde_json::json!(p);
    }
    if let Some(t) = report.device_time {
        line["micro_steps_ms"] = serde_json::json!(t.micro_steps_ms);
        line["optimizer_step_ms"] = serde_json::json!(t.optimizer_step_ms);
    }
    line
}

/// The perplexity of a language model's mean token loss (`exp(loss)`, as transformers'
/// examples report it); other objectives have none.
pub fn perplexity(objective: &str, loss: f64) -> Option<f64> {
    matches!(objective, "lm" | "mlm").then(|| loss.exp())
}

/// Installs the Ctrl-C handler (once per process).
pub fn catch_interrupts() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Without a handler Ctrl-C simply kills the process, as before.
        let _ = ctrlc::set_handler(|| {
            if INTERRUPTED.swap(true, Ordering::SeqCst) {
                // A second Ctrl-C: stop now.
                std::process::exit(130);
            }
        });
    });
}

/// The learning-rate schedule: linear warmup, then constant or cosine decay.
#[derive(Clone, Debug)]
pub struct LrSchedule {
    pub peak: f64,
    pub warmup: u64,
    pub schedule: Schedule,
    pub min_lr: f64,
    /// The schedule's length in steps.
    pub total: u64,
}

impl LrSchedule {
    /// The learning rate of loop step `step` (0-based: the step numbered `step + 1`).
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        match self.schedule {
            Schedule::Constant => self.peak,
            Schedule::Cosine => {
                let span = self.total.saturating_sub(self.warmup).max(1) as f64;
                let progress = ((step - self.warmup) as f64 / span).min(1.0);
                self.min_lr
                    + 0.5
                        * (self.peak - self.min_lr)
                        * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// Periodic checkpoints.
pub struct Saves {
    pub root: PathBuf,
    pub every: u64,
    pub keep: usize,
}

/// What the training loop does besides stepping.
pub struct LoopOptions {
    /// Steps already done (resumed runs).
    pub first_step: u64,
    /// Steps this run takes.
    pub steps: u64,
    pub lr: LrSchedule,
    pub print_every: u64,
    /// Evaluate every N steps (0 = only at the end); only with validation data.
    pub eval_every: u64,
    pub eval_batches: usize,
    pub log: Option<std::fs::File>,
    /// The loss-curve picture and its title.
    pub plot: Option<(PathBuf, String)>,
    /// The report page, rewritten with the curves where the picture is.
    pub report: Option<Report>,
    pub saves: Option<Saves>,
    pub files: CheckpointFiles,
    /// What every checkpoint's trainer state records besides the step and data position.
    pub state: StateTemplate,
    pub input_names: &'static [&'static str],
    /// The seed of dropout's masks (`--seed`): micro-batch `i` of step `s` (0-based) draws with
    /// the key `[seed, s * micro_batches + i]`, so a resumed run continues the same stream.
    pub dropout_seed: u64,
    /// The progress bar's prefix.
    pub label: String,
    /// Profile the last step command by command (`--profile-kernels`).
    pub profile_last_step: bool,
    /// Prompts answered at each evaluation (`--sample-prompts`).
    pub samples: Option<super::samples::Samples>,
    pub hooks: Hooks,
}

/// The parts of a [`TrainerState`] fixed for a run.
#[derive(Clone, Debug)]
pub struct StateTemplate {
    pub settings: TrainSettings,
    pub flags: serde_json::Value,
    pub data_tokens: usize,
}

impl StateTemplate {
    pub fn at(&self, step: u64, data: &Data) -> TrainerState {
        TrainerState {
            step,
            data_position: data.position(),
            settings: self.settings.clone(),
            flags: self.flags.clone(),
            data_tokens: self.data_tokens,
        }
    }
}

/// What a run of the loop did.
pub struct LoopOutcome {
    pub steps_done: u64,
    pub history: LossHistory,
    pub last: Option<StepReport>,
    pub skipped: u64,
    pub seconds: f64,
    pub tokens: f64,
    pub interrupted: bool,
    /// Steps whose validation loss was computed (1-based step numbers).
    pub evaluated_at: Option<u64>,
    /// The last validation accuracy of a classifier (a fraction).
    pub accuracy: Option<f64>,
}

/// A classifier's validation loss and accuracy: the micro step with its `logits` as a second
/// output, run on each held-out batch with the runner's state. The loss is the mean over the
/// counted rows (batches weighted by them), the accuracy the fraction of counted rows whose
/// most likely class is the label (labels of -100, the rows that fill out the last batch,
/// are not counted).
pub fn classification_eval(
    runner: &PlanRunner,
    batches: &[HashMap<String, Tensor>],
) -> anyhow::Result<(f64, f64)> {
    let mut graph = runner.plan().micro_step.clone();
    let loss = *graph
        .outputs()
        .first()
        .context("the micro step has no loss output")?;
    let logits = graph
        .lookup("logits")
        .context("the micro step has no `logits`")?;
    graph.set_outputs(vec![loss, logits]);
    // The runner's executor: a data-parallel rank's runs the micro step's collectives with
    // the other ranks (which run this at the same time).
    let executor = runner.executor();
    let (mut loss_sum, mut correct, mut counted) = (0.0, 0usize, 0usize);
    for batch in batches {
        let bind = |name: &str| batch.get(name).or_else(|| runner.state(name));
        let outputs = executor.run(&graph, &bind)?;
        let (Some(l), Some(z), Some(labels)) = (
            outputs.first().and_then(|t| t.as_f32()),
            outputs.get(1).and_then(|t| t.as_f32()),
            batch.get("labels").and_then(|t| t.as_i64()),
        ) else {
            anyhow::bail!("a classification batch without loss, logits or class labels");
        };
        let classes = z.len() / labels.len().max(1);
        let mut n = 0;
        for (row, &label) in z.chunks(classes).zip(labels) {
            if label == castor_models::IGNORE_INDEX {
                continue;
            }
            let best = (0..classes).fold(0, |b, c| if row[c] > row[b] { c } else { b });
            correct += usize::from(best as i64 == label);
            n += 1;
        }
        loss_sum += f64::from(l[0]) * n as f64;
        counted += n;
    }
    let counted = counted.max(1) as f64;
    Ok((loss_sum / counted, correct as f64 / counted))
}

/// Redraws the picture and the report. A failed write is a warning: the paths were checked
/// writable before the run, and losing a picture must not lose the run.
pub fn redraw(opts: &LoopOptions, history: &LossHistory) {
    if let Some((path, title)) = &opts.plot {
        if let Err(e) = plot::write_loss_curve(path, title, history) {
            errln!("warning: {}", crate::error_message(&e));
        }
    }
    if let Some(report) = &opts.report {
        if let Err(e) = report.write(Some(history)) {
            errln!("warning: {}", crate::error_message(&e));
        }
    }
}

/// The graph input dropout nodes read their key from.
pub const DROPOUT_KEY: &str = "dropout_key";

/// Dropout's key `[seed, offset]` (a negative offset: evaluation mode, no dropout).
pub fn dropout_key(seed: u64, offset: i64) -> Tensor {
    Tensor::from_i64(castor_ir::DType::I64, [2], vec![seed as i64, offset])
}

/// Runs `opts.steps` steps of `runner` on `data`, continuing `history`.
pub fn train_loop(
    runner: &mut Trainer,
    data: &mut Data,
    opts: &mut LoopOptions,
    mut history: LossHistory,
) -> anyhow::Result<LoopOutcome> {
    let settings = runner.plan().settings.clone();
    let (batch, seq) = (settings.batch, settings.seq);
    // A data-parallel step takes a micro-batch per rank and micro step.
    let micro_batches = settings.grad_accum * settings.parallel.world_size.max(1);
    // Throughput counts the tokens under the attention mask: padding is not trained on.
    let real_tokens = |batch_inputs: &HashMap<String, Tensor>| -> f64 {
        match batch_inputs.get("attention_mask").and_then(|m| m.as_i64()) {
            Some(mask) => mask.iter().filter(|&&m| m != 0).count() as f64,
            None => (batch * seq) as f64,
        }
    };
    let mut total_tokens = 0.0;
    let mut tokens_since_report = 0.0;
    let mut val_batches = data.validation_batches(opts.input_names, opts.eval_batches)?;
    // Validation is evaluation mode: a negative offset turns dropout off.
    for b in &mut val_batches {
        b.insert(DROPOUT_KEY.into(), dropout_key(opts.dropout_seed, -1));
    }
    let accuracy = data.has_classes();
    let progress = Progress::new(opts.first_step, opts.steps, &opts.label);
    let start = Instant::now();
    let mut out = LoopOutcome {
        steps_done: 0,
        history: LossHistory::default(),
        last: None,
        skipped: 0,
        seconds: 0.0,
        tokens: 0.0,
        interrupted: false,
        evaluated_at: None,
        accuracy: None,
    };
    let end = opts.first_step + opts.steps;
    let mut last_report = Instant::now();
    for step in opts.first_step..end {
        let lr = opts.lr.at(step);
        let mut micro: Vec<HashMap<String, Tensor>> = (0..micro_batches)
            .map(|_| data.next_batch(opts.input_names))
            .collect::<anyhow::Result<_>>()?;
        // Read only by plans with dropout; every micro-batch of every step its own offset.
        for (i, b) in micro.iter_mut().enumerate() {
            let offset = step as i64 * micro_batches as i64 + i as i64;
            b.insert(DROPOUT_KEY.into(), dropout_key(opts.dropout_seed, offset));
        }
        let step_tokens: f64 = micro.iter().map(real_tokens).sum();
        total_tokens += step_tokens;
        tokens_since_report += step_tokens;
        // Steps are numbered from 1 everywhere people and files see them.
        let done = step + 1;
        let last_step = done == end;
        let eval_now = !val_batches.is_empty()
            && ((opts.eval_every > 0 && done.is_multiple_of(opts.eval_every)) || last_step);
        let print = (done - opts.first_step).is_multiple_of(opts.print_every) || last_step;
        let stop =
            INTERRUPTED.load(Ordering::SeqCst) || opts.hooks.stop.as_mut().is_some_and(|f| f());
        let logged = opts.log.is_some() || opts.hooks.on_step.is_some();
        // The ranks of a launched group stop at the same step, and read their reports back at
        // the same steps (only rank 0 logs): each is what any rank wants.
        let [stop, shown] =
            runner.agree([stop, print || eval_now || logged || opts.report.is_some()])?;
        let save_now = opts
            .saves
            .as_ref()
            .is_some_and(|s| s.every > 0 && (done.is_multiple_of(s.every) || last_step || stop));
        // A device step's report is read back only when something shows or keeps it.
        let wanted = shown || save_now || stop;
        if last_step && opts.profile_last_step {
            runner.profile_next_step();
        }
        let stepped = runner.step(&micro, lr as f32, wanted)?;
        out.steps_done += 1;
        let Some(report) = stepped else {
            progress.tick();
            continue;
        };
        // Throughput over the steps since the last report (queued device steps included).
        let tokens_per_s = tokens_since_report / last_report.elapsed().as_secs_f64().max(1e-9);
        tokens_since_report = 0.0;
        last_report = Instant::now();
        out.skipped += u64::from(report.skipped);
        history.train.push((done, f64::from(report.loss)));
        history.lr.push((done, lr));
        history
            .loss_scale
            .push((done, f64::from(report.loss_scale)));

        let (val_loss, val_accuracy) = if eval_now && accuracy {
            // Accuracy needs the logits, which the device's validation run does not return:
            // the host copy of the weights runs the forward.
            let (v, a) = runner.classification_eval(&val_batches)?;
            history.validation.push((done, v));
            out.evaluated_at = Some(done);
            out.accuracy = Some(a);
            progress.println(&format!(
                "eval   {done:>6}  validation loss {v:.4}, accuracy {:.1}%",
                a * 100.0
            ));
            (Some(v), Some(a))
        } else if eval_now {
            let v = runner.validation_loss(&val_batches)?;
            if let Some(v) = v {
                history.validation.push((done, v));
                out.evaluated_at = Some(done);
                let ppl = perplexity(&settings.objective, v)
                    .map(|p| format!(", perplexity {p:.2}"))
                    .unwrap_or_default();
                progress.println(&format!("eval   {done:>6}  validation loss {v:.4}{ppl}"));
            }
            (v, None)
        } else {
            (None, None)
        };
        // Samples at each evaluation, and at the end of a run without validation data.
        let sampled = match &opts.samples {
            Some(samples) if eval_now || (val_batches.is_empty() && last_step) => {
                let answers = samples.answer(runner.host()?)?;
                for a in &answers {
                    progress.println(&format!(
                        "sample {done:>6}  {:?} -> {:?}",
                        a.prompt, a.answer
                    ));
                }
                Some(answers)
            }
            _ => None,
        };
        if logged {
            let mut line = log_line(
                done,
                &report,
                lr,
                tokens_per_s,
                val_loss,
                val_accuracy,
                &settings.objective,
            );
            // The tokens trained on so far by this run (padding left out).
            line["tokens"] = serde_json::json!(total_tokens);
            if let Some(answers) = &sampled {
                line["samples"] = answers
                    .iter()
                    .map(|a| serde_json::json!({"prompt": a.prompt, "answer": a.answer}))
                    .collect();
            }
            if let Some(f) = opts.log.as_mut() {
                writeln!(f, "{line}").context("cannot write the training log")?;
            }
            if let Some(on_step) = opts.hooks.on_step.as_mut() {
                on_step(&line);
            }
        }
        progress.step(
            &StepLine {
                step: done,
                loss: report.loss,
                lr,
                loss_scale: report.loss_scale,
                grad_norm: report.grad_norm,
                skipped: report.skipped,
                tokens_per_s,
            },
            print,
        );
        if let (Some(answers), Some(report)) = (sampled, opts.report.as_mut()) {
            report.samples.push((done, answers));
        }
        if print || eval_now {
            redraw(opts, &history);
        }
        check_loss_scale(runner.min_loss_scale(), &report, done)?;
        out.last = Some(report);
        // A hook that asks to stop after seeing this step (a callback that raised, a Ctrl-C
        // Python saw during the step) stops here, at the step it saw: no later step runs or
        // reaches the callback, and this one is saved.
        let stop = stop
            || (opts.hooks.stop.is_some() && {
                let asked = opts.hooks.stop.as_mut().is_some_and(|f| f());
                runner.agree([asked, false])?[0]
            });
        let save_now = save_now || (stop && opts.saves.as_ref().is_some_and(|s| s.every > 0));
        if let (Some(saves), true) = (&opts.saves, save_now) {
            let state = opts.state.at(done, data);
            // Every rank of a launched group gathers the state; rank 0 writes it.
            let writes = runner.writes_files();
            let host = runner.host()?;
            if writes {
                checkpoint::save_step(&saves.root, saves.keep, &opts.files, host, &state)?;
            }
        }
        if stop {
            out.interrupted = true;
            break;
        }
    }
    progress.finish();
    out.seconds = start.elapsed().as_secs_f64();
    out.tokens = total_tokens;
    out.history = history;
    Ok(out)
}

/// Reads the curves of steps up to `until` from a JSON-lines log, so a resumed run's picture
/// and report show the whole run.
pub fn history_from_log(path: &Path, until: u64) -> LossHistory {
    let mut h = LossHistory::default();
    let Ok(text) = std::fs::read_to_string(path) else {
        return h;
    };
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(step) = v["step"].as_u64() else {
            continue;
        };
        if step > until {
            continue;
        }
        if let Some(l) = v["loss"].as_f64() {
            h.train.push((step, l));
        }
        if let Some(l) = v["val_loss"].as_f64() {
            h.validation.push((step, l));
        }
        if let Some(l) = v["lr"].as_f64() {
            h.lr.push((step, l));
        }
        if let Some(l) = v["loss_scale"].as_f64() {
            h.loss_scale.push((step, l));
        }
    }
    h
}

/// Stops the run when a dynamic loss scale fell below its minimum.
fn check_loss_scale(min_scale: Option<f64>, report: &StepReport, step: u64) -> anyhow::Result<()> {
    match min_scale {
        Some(min) if f64::from(report.next_loss_scale) < min => {
            Err(RuntimeError::LossScaleUnderflow {
                step,
                scale: LossScale(report.next_loss_scale),
                min: LossScale(min as f32),
            }
            .into())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use castor_runtime::DeviceTime;

    /// `--profile` promises the device time of each logged step in the JSON log; the first
    /// GPU benchmark found it missing (the runner measured it, the log line dropped it).
    #[test]
    fn the_log_line_carries_the_measured_device_time() {
        let mut report = StepReport {
            loss: 2.5,
            loss_scale: 1.0,
            next_loss_scale: 1.0,
            skipped: false,
            grad_norm: 0.5,
            device_time: None,
        };
        let plain = log_line(3, &report, 1e-3, 100.0, None, None, "lm");
        assert!(plain.get("micro_steps_ms").is_none() && plain.get("optimizer_step_ms").is_none());
        report.device_time = Some(DeviceTime {
            micro_steps_ms: 12.5,
            optimizer_step_ms: 1.25,
        });
        let timed = log_line(3, &report, 1e-3, 100.0, Some(2.0), None, "lm");
        assert_eq!(timed["val_perplexity"], serde_json::json!(2f64.exp()));
        let classifier = log_line(3, &report, 1e-3, 100.0, Some(2.0), None, "classify");
        assert!(classifier.get("val_perplexity").is_none());
        assert_eq!(timed["micro_steps_ms"], serde_json::json!(12.5));
        assert_eq!(timed["optimizer_step_ms"], serde_json::json!(1.25));
        assert_eq!(timed["val_loss"], serde_json::json!(2.0));
        assert_eq!(timed["step"], serde_json::json!(3));
    }
}
