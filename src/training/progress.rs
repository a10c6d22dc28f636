//! Training progress: a progress bar (step, loss, tokens/s, loss scale, ETA) on stderr when
//! stderr is a terminal, and plain step lines on stdout every `--print-every` steps (the run's
//! record: `castor train ... > run.txt` keeps them and still shows the bar).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

pub struct Progress {
    bar: Option<ProgressBar>,
}

/// What one step's progress shows.
pub struct StepLine {
    /// 1-based step number.
    pub step: u64,
    pub loss: f32,
    pub lr: f64,
    pub loss_scale: f32,
    pub grad_norm: f32,
    pub skipped: bool,
    pub tokens_per_s: f64,
}

impl StepLine {
    /// The plain-text line (also printed above the bar every `--print-every` steps).
    pub fn plain(&self) -> String {
        format!(
            "step {:>6}  loss {:.4}  lr {:.3e}  scale {}  grad norm {:.3}{}  {:.0} tokens/s",
            self.step,
            self.loss,
            self.lr,
            castor_runtime::LossScale(self.loss_scale),
            self.grad_norm,
            if self.skipped { "  (skipped)" } else { "" },
            self.tokens_per_s
        )
    }
}

impl Progress {
    /// A bar over `steps` steps, the first being `first_step + 1`, when stderr is a terminal.
    pub fn new(first_step: u64, steps: u64, prefix: &str) -> Progress {
        if !std::io::stderr().is_terminal() || steps == 0 || crate::out::redirected() {
            return Progress { bar: None };
        }
        let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template(
            "{prefix} [{bar:32.cyan/blue}] {pos}/{len} {msg}  ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        bar.set_style(style);
        bar.set_prefix(prefix.to_string());
        bar.set_message(format!("step {}", first_step + 1));
        Progress { bar: Some(bar) }
    }

    /// Whether a bar is drawn (else plain lines are printed).
    pub fn is_bar(&self) -> bool {
        self.bar.is_some()
    }

    /// Reports a finished step; `print` also writes its plain line.
    pub fn step(&self, line: &StepLine, print: bool) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
            bar.set_message(format!(
                "step {}  loss {:.4}  {:.0} tok/s  scale {}",
                line.step,
                line.loss,
                line.tokens_per_s,
                castor_runtime::LossScale(line.loss_scale)
            ));
        }
        if print {
            self.println(&line.plain());
        }
    }

    /// Counts a step whose report was not read back (a queued device step).
    pub fn tick(&self) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    /// Prints a line to stdout (with the bar out of the way while it does).
    pub fn println(&self, text: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| crate::outln!("{text}")),
            None => crate::outln!("{text}"),
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
