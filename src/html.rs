//! The report page a person opens: one self-contained HTML file (inline CSS and SVG, no
//! scripts, no network) with what `train`, `compile --train` and `demo` know about a run:
//! the loss and validation curves, the learning rate and the loss scale, the memory anatomy
//! (one bar across the page's whole width, and its table), the fit verdict, what the
//! precision passes decided (the per-class table), the plan's settings and the cost model's
//! estimate.
//!
//! Pictures are drawn here as SVG with a `viewBox` and `width: 100%`, so they scale with the
//! page; text in them stays text.

use crate::plot::{smooth, unit_for, LossHistory};
use crate::report::counted_bytes;
use crate::report::thousands;
use crate::training::fit::Verdict;
use crate::CliError;
use castor_ir::{StateRole, TrainingPlan};
use castor_passes::cost::{GpuSpec, StepCost};
use castor_passes::PrecisionSummary;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// Checks that a report path is an HTML file name.
pub fn check_report_path(path: &Path) -> anyhow::Result<()> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("html" | "htm") => Ok(()),
        _ => Err(CliError::InvalidInput(format!(
            "--report `{}`: the report is an HTML page; give a path ending in .html",
            path.display()
        ))
        .into()),
    }
}

/// The memory of one step, as drawn: persistent state by role, then the arena's parts.
#[derive(Clone, Debug)]
struct Memory {
    /// (what, bytes, bytes/param of the usual mixed-precision AdamW rule, if it has one).
    rows: Vec<(String, u64, Option<u32>)>,
    params: u64,
    lower_bound: u64,
}

/// A report under construction; [`Report::write`] renders it.
#[derive(Clone, Debug)]
pub struct Report {
    path: PathBuf,
    title: String,
    facts: Vec<(String, String)>,
    precision: Option<PrecisionSummary>,
    memory: Option<Memory>,
    pub verdict: Option<Verdict>,
    cost: Vec<String>,
    /// What the run did (its closing lines).
    pub outcome: Vec<String>,
    /// The answers to `--sample-prompts` at each evaluation (1-based step).
    pub samples: Vec<(u64, Vec<crate::training::samples::Sample>)>,
    /// Under `--precision fp8:delayed`: each cast's scale and amax history at the end.
    pub delayed_casts: Vec<crate::report::DelayedCast>,
}

impl Report {
    pub fn new(path: PathBuf, title: &str) -> Report {
        Report {
            path,
            title: title.to_string(),
            facts: Vec::new(),
            precision: None,
            memory: None,
            verdict: None,
            cost: Vec::new(),
            outcome: Vec::new(),
            samples: Vec::new(),
            delayed_casts: Vec::new(),
        }
    }

    /// A line of the run's table.
    pub fn fact(&mut self, what: &str, value: &str) {
        self.facts.push((what.to_string(), value.to_string()));
    }

    /// The plan's settings and memory, and what the precision passes decided (when known).
    pub fn training_plan(
        &mut self,
        plan: &TrainingPlan,
        summary: Option<&PrecisionSummary>,
        anatomy: &castor_passes::memory::Anatomy,
        executor: castor_runtime::ExecutorKind,
    ) {
        let s = &plan.settings;
        self.fact("precision", s.precision.name());
        self.fact(
            "shape",
            &format!(
                "{} x [{}, {}] tokens per step",
                s.grad_accum, s.batch, s.seq
            ),
        );
        self.fact("optimizer", &crate::report::optimizer_text(s));
        self.fact("loss scale", &crate::report::loss_scaling_text(s));
        self.fact("remat", &s.remat.to_string());
        self.precision = summary.cloned();
        // The usual bytes per parameter of mixed-precision AdamW, beside the state's rows.
        let rule = |what: &str| {
            [
                (StateRole::WorkingCopy, 2),
                (StateRole::Master, 4),
                (StateRole::Gradient, 4),
                (StateRole::OptimizerState, 8),
            ]
            .into_iter()
            .find(|(r, _)| r.describe() == what)
            .map(|(_, b)| b)
        };
        self.memory = Some(Memory {
            rows: crate::anatomy::rows(plan, anatomy, executor)
                .into_iter()
                .map(|r| {
                    let b = rule(&r.what);
                    (r.what, r.bytes, b)
                })
                .collect(),
            params: anatomy.params,
            lower_bound: anatomy.memory.lower_bound,
        });
    }

    /// The cost model's estimate of the step on `gpu`.
    pub fn cost(&mut self, plan: &TrainingPlan, gpu: &GpuSpec) {
        self.cost = crate::report::cost_lines(&StepCost::of_plan(plan, gpu))
            .into_iter()
            .map(|l| l.trim().to_string())
            .collect();
    }

    /// Writes the page (atomically), with the curves of `history` when there is one.
    pub fn write(&self, history: Option<&LossHistory>) -> anyhow::Result<()> {
        castor_models::write_atomically(&self.path, self.render(history).as_bytes())?;
        Ok(())
    }

    /// The page.
    pub fn render(&self, history: Option<&LossHistory>) -> String {
        let mut h = String::new();
        let _ = write!(
            h,
            "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
             <title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<main>\n\
             <h1>{}</h1>\n<p class=\"sub\">castor {} report</p>\n",
            esc(&self.title),
            esc(&self.title),
            env!("CARGO_PKG_VERSION")
        );
        self.run_section(&mut h);
        if let Some(history) = history.filter(|h| !h.train.is_empty()) {
            curves_section(&mut h, history);
        }
        if !self.samples.is_empty() {
            samples_section(&mut h, &self.samples);
        }
        if let Some(m) = &self.memory {
            memory_section(&mut h, m);
        }
        if let Some(v) = &self.verdict {
            verdict_section(&mut h, v);
        }
        if let Some(p) = &self.precision {
            precision_section(&mut h, p);
        }
        if !self.delayed_casts.is_empty() {
            delayed_scaling_section(&mut h, &self.delayed_casts);
        }
        if !self.cost.is_empty() {
            h.push_str("<section id=\"cost\">\n<h2>Cost model</h2>\n<pre>");
            for line in &self.cost {
                let _ = writeln!(h, "{}", esc(line));
            }
            h.push_str("</pre>\n</section>\n");
        }
        h.push_str("</main>\n</body>\n</html>\n");
        h
    }

    fn run_section(&self, h: &mut String) {
        h.push_str("<section id=\"run\">\n<h2>Run</h2>\n<table class=\"facts\">\n");
        for (k, v) in &self.facts {
            let _ = writeln!(h, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(v));
        }
        h.push_str("</table>\n");
        if !self.outcome.is_empty() {
            h.push_str("<pre class=\"outcome\">");
            for line in &self.outcome {
                let _ = writeln!(h, "{}", esc(line));
            }
            h.push_str("</pre>\n");
        }
        h.push_str("</section>\n");
    }
}

/// The delayed scales: each cast's scale for the next step and its amax history, newest
/// first.
fn delayed_scaling_section(h: &mut String, casts: &[crate::report::DelayedCast]) {
    h.push_str(
        "<section id=\"fp8-scaling\">\n<h2>FP8 delayed scaling</h2>\n<p>Each cast's scale is \
         the FP8 maximum over the largest amax of its history (Transformer Engine's max \
         algorithm); the histories are listed newest first.</p>\n<table>\n<tr><th>cast</th>\
         <th>scale</th><th>largest amax</th><th>amax history</th></tr>\n",
    );
    for c in casts {
        let history: Vec<String> = c.history.iter().map(|a| format!("{a:.3e}")).collect();
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{:.4e}</td><td>{:.3e}</td><td class=\"history\">{}</td></tr>",
            esc(&c.cast),
            c.scale,
            crate::report::largest(&c.history),
            esc(&history.join(" "))
        );
    }
    h.push_str("</table>\n</section>\n");
}

const STYLE: &str = "
:root { color-scheme: light; --ink: #1d2430; --muted: #5b6575; --rule: #d9dee7; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.45 system-ui, -apple-system, 'Segoe UI', sans-serif;
  color: var(--ink); background: #f6f7f9; }
main { max-width: 1120px; margin: 0 auto; padding: 24px 28px 48px; background: #fff;
  min-height: 100vh; }
h1 { font-size: 24px; margin: 0 0 2px; }
h2 { font-size: 18px; margin: 28px 0 10px; padding-bottom: 4px; border-bottom: 1px solid var(--rule); }
.sub { color: var(--muted); margin: 0 0 8px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 4px 10px 4px 0; border-bottom: 1px solid var(--rule);
  vertical-align: top; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
table.facts th { width: 9em; color: var(--muted); font-weight: 500; }
pre { background: #f3f5f8; padding: 10px 12px; overflow-x: auto; font-size: 13px; margin: 8px 0; }
svg { display: block; width: 100%; height: auto; }
svg text { font: 13px system-ui, sans-serif; fill: var(--ink); }
svg .axis { stroke: #9aa3b1; stroke-width: 1; }
svg .grid { stroke: #eceff3; stroke-width: 1; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; margin: 6px 0 0; padding: 0;
  list-style: none; color: var(--muted); font-size: 13px; }
.legend span { display: inline-block; width: 12px; height: 12px; margin-right: 6px;
  vertical-align: -1px; border-radius: 2px; }
.fits { color: #17803d; font-weight: 600; }
.nofit { color: #b42318; font-weight: 600; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 24px; }
@media (max-width: 760px) { .pair { grid-template-columns: 1fr; } }
";

/// Colours of series and memory segments (matplotlib's tab10, as the SVG pictures use).
const COLOURS: [&str; 8] = [
    "#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd", "#7f7f7f", "#d62728", "#8c564b", "#17becf",
];

/// The answers to the sample prompts, newest evaluation first.
fn samples_section(h: &mut String, samples: &[(u64, Vec<crate::training::samples::Sample>)]) {
    h.push_str("<section id=\"samples\">\n<h2>Samples</h2>\n<table>\n");
    h.push_str("<tr><th class=\"num\">step</th><th>prompt</th><th>answer</th></tr>\n");
    for (step, answers) in samples.iter().rev() {
        for a in answers {
            let _ = writeln!(
                h,
                "<tr><td class=\"num\">{step}</td><td>{}</td><td>{}</td></tr>",
                esc(&a.prompt),
                esc(&a.answer)
            );
        }
    }
    h.push_str("</table>\n</section>\n");
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// One line of a chart.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    colour: &'static str,
    width: f64,
    opacity: f64,
    dots: bool,
}

/// About `n` round tick values covering `lo..hi`.
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    // Also true for NaN bounds.
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
        return vec![lo];
    }
    let raw = (hi - lo) / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil();
    (0..)
        .map(|i| (first + f64::from(i)) * step)
        .take_while(|&t| t <= hi + step * 1e-9)
        .map(|t| if t.abs() < step * 1e-9 { 0.0 } else { t })
        .collect()
}

fn tick_label(v: f64) -> String {
    // Ticks are sums of steps: snap rounding noise (and -0) to zero.
    let v = if v.abs() < 1e-12 { 0.0 } else { v };
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// A line chart over steps, `width` x `height` view units (text is 13 units high, so a
/// narrower view draws larger text in a narrower column); `log` draws the y axis in powers
/// of two (loss scales).
fn chart(
    id: &str,
    series: &[Series],
    y_label: &str,
    log: bool,
    (width, height): (f64, f64),
) -> String {
    let (left, right, top, bottom) = (78.0, 16.0, 14.0, 44.0);
    let ty = |y: f64| {
        if log {
            y.max(f64::MIN_POSITIVE).log2()
        } else {
            y
        }
    };
    let all = || {
        series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|p| p.1.is_finite())
    };
    let x_lo = all().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let x_hi = all().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
    let y_lo = all().map(|p| ty(p.1)).fold(f64::INFINITY, f64::min);
    let y_hi = all().map(|p| ty(p.1)).fold(f64::NEG_INFINITY, f64::max);
    if !x_lo.is_finite() {
        return String::new();
    }
    let (x_lo, x_hi) = if x_hi > x_lo {
        (x_lo, x_hi)
    } else {
        (x_lo - 1.0, x_hi + 1.0)
    };
    let pad = ((y_hi - y_lo) * 0.06).max(if log { 0.5 } else { 1e-3 });
    let (y_lo, y_hi) = (y_lo - pad, y_hi + pad);
    let sx = |x: f64| left + (x - x_lo) / (x_hi - x_lo) * (width - left - right);
    let sy = |y: f64| top + (1.0 - (ty(y) - y_lo) / (y_hi - y_lo)) * (height - top - bottom);
    let mut s = String::new();
    let _ = write!(
        s,
        "<svg id=\"{id}\" viewBox=\"0 0 {width} {height}\" role=\"img\" aria-label=\"{}\">",
        esc(y_label)
    );
    let y_ticks: Vec<f64> = if log {
        // Whole powers of two.
        ticks(y_lo, y_hi, 5)
            .into_iter()
            .map(|e| e.round() as i32)
            .collect::<std::collections::BTreeSet<i32>>()
            .into_iter()
            .map(|e| f64::from(e).exp2())
            .collect()
    } else {
        ticks(y_lo, y_hi, 5)
    };
    for y in y_ticks {
        let py = sy(y);
        if !(top - 0.5..=height - bottom + 0.5).contains(&py) {
            continue;
        }
        let _ = write!(
            s,
            "<line class=\"grid\" x1=\"{left}\" x2=\"{}\" y1=\"{py:.1}\" y2=\"{py:.1}\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            width - right,
            left - 8.0,
            py + 4.0,
            tick_label(y)
        );
    }
    for x in ticks(x_lo, x_hi, 8) {
        let px = sx(x);
        let _ = write!(
            s,
            "<line class=\"axis\" x1=\"{px:.1}\" x2=\"{px:.1}\" y1=\"{}\" y2=\"{}\"/>\
             <text x=\"{px:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            height - bottom,
            height - bottom + 5.0,
            height - bottom + 20.0,
            tick_label(x)
        );
    }
    let _ = write!(
        s,
        "<line class=\"axis\" x1=\"{left}\" x2=\"{}\" y1=\"{b}\" y2=\"{b}\"/>\
         <line class=\"axis\" x1=\"{left}\" x2=\"{left}\" y1=\"{top}\" y2=\"{b}\"/>\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\
         <text transform=\"translate(16 {}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
        width - right,
        (left + width - right) / 2.0,
        height - 6.0,
        (top + height - bottom) / 2.0,
        esc(y_label),
        b = height - bottom,
    );
    for se in series {
        let pts: Vec<String> = se
            .points
            .iter()
            .filter(|p| p.1.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        if pts.len() > 1 {
            let _ = write!(
                s,
                "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"{}\" stroke-opacity=\"{}\" \
                 points=\"{}\"><title>{}</title></polyline>",
                se.colour,
                se.width,
                se.opacity,
                pts.join(" "),
                esc(&se.name)
            );
        }
        if se.dots || pts.len() == 1 {
            for p in &pts {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = write!(
                    s,
                    "<circle cx=\"{x}\" cy=\"{y}\" r=\"4\" fill=\"{}\"/>",
                    se.colour
                );
            }
        }
    }
    s.push_str("</svg>");
    s.push_str("<ul class=\"legend\">");
    for se in series {
        let _ = write!(
            s,
            "<li><span style=\"background:{}\"></span>{}</li>",
            se.colour,
            esc(&se.name)
        );
    }
    s.push_str("</ul>\n");
    s
}

fn floats(points: &[(u64, f64)]) -> Vec<(f64, f64)> {
    points.iter().map(|&(s, y)| (s as f64, y)).collect()
}

fn curves_section(h: &mut String, history: &LossHistory) {
    h.push_str("<section id=\"curves\">\n<h2>Loss</h2>\n");
    let mut loss = vec![
        Series {
            name: "training loss (each step)".into(),
            points: floats(&history.train),
            colour: COLOURS[1],
            width: 1.0,
            opacity: 0.35,
            dots: false,
        },
        Series {
            name: "training loss (smoothed)".into(),
            points: smooth(&history.train, 0.9),
            colour: COLOURS[1],
            width: 2.5,
            opacity: 1.0,
            dots: false,
        },
    ];
    if !history.validation.is_empty() {
        loss.push(Series {
            name: "validation loss".into(),
            points: floats(&history.validation),
            colour: COLOURS[5],
            width: 2.0,
            opacity: 1.0,
            dots: true,
        });
    }
    h.push_str(&chart(
        "loss-chart",
        &loss,
        "loss (nats per token)",
        false,
        (1000.0, 340.0),
    ));
    h.push_str("<div class=\"pair\">\n<div>\n<h2>Learning rate</h2>\n");
    h.push_str(&chart(
        "lr-chart",
        &[Series {
            name: "learning rate".into(),
            points: floats(&history.lr),
            colour: COLOURS[2],
            width: 2.0,
            opacity: 1.0,
            dots: false,
        }],
        "learning rate",
        false,
        (540.0, 300.0),
    ));
    h.push_str("</div>\n<div>\n<h2>Loss scale</h2>\n");
    h.push_str(&chart(
        "scale-chart",
        &[Series {
            name: "loss scale (log scale)".into(),
            points: floats(&history.loss_scale),
            colour: COLOURS[0],
            width: 2.0,
            opacity: 1.0,
            dots: false,
        }],
        "loss scale",
        true,
        (540.0, 300.0),
    ));
    h.push_str("</div>\n</div>\n</section>\n");
}

fn memory_section(h: &mut String, m: &Memory) {
    let total: u64 = m.rows.iter().map(|r| r.1).sum();
    let (unit, unit_name) = unit_for(total.max(1));
    h.push_str("<section id=\"memory\">\n<h2>Memory of one step</h2>\n");
    let _ = writeln!(
        h,
        "<p>Planned peak: <b>{}</b>: the persistent state from the training plan, then the \
         executor's arena (saved activations and the other temporaries live at the peak; \
         lower bound {}) and, on CUDA, its cuBLAS workspace and other buffers.</p>",
        esc(&counted_bytes(total)),
        esc(&counted_bytes(m.lower_bound))
    );
    // One bar across the whole width; segments in proportion.
    const W: f64 = 1000.0;
    const H: f64 = 56.0;
    let _ = write!(
        h,
        "<svg id=\"memory-bar\" viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"memory \
         anatomy\">"
    );
    let mut x = 0.0;
    for (i, (what, bytes, _)) in m.rows.iter().enumerate() {
        let w = *bytes as f64 / total.max(1) as f64 * W;
        if w <= 0.0 {
            continue;
        }
        let _ = write!(
            h,
            "<rect x=\"{x:.2}\" y=\"0\" width=\"{w:.2}\" height=\"{H}\" fill=\"{}\"><title>{}: \
             {}</title></rect>",
            COLOURS[i % COLOURS.len()],
            esc(what),
            esc(&counted_bytes(*bytes))
        );
        if w > 70.0 {
            let _ = write!(
                h,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" style=\"fill:#fff\">{:.2} \
                 {unit_name}</text>",
                x + w / 2.0,
                H / 2.0 + 5.0,
                *bytes as f64 / unit
            );
        }
        x += w;
    }
    h.push_str("</svg>\n<ul class=\"legend\">");
    for (i, (what, bytes, _)) in m.rows.iter().enumerate() {
        if *bytes > 0 {
            let _ = write!(
                h,
                "<li><span style=\"background:{}\"></span>{}</li>",
                COLOURS[i % COLOURS.len()],
                esc(what)
            );
        }
    }
    h.push_str("</ul>\n");
    let _ = write!(
        h,
        "<table id=\"memory-table\">\n<tr><th>what</th><th class=\"num\">bytes</th>\
         <th class=\"num\">{unit_name}</th><th class=\"num\">bytes/param</th>\
         <th class=\"num\">usual rule</th></tr>\n"
    );
    for (what, bytes, rule) in
        m.rows
            .iter()
            .chain(std::iter::once(&("total".to_string(), total, Some(18))))
    {
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{:.2}</td>\
             <td class=\"num\">{:.2}</td><td class=\"num\">{}</td></tr>",
            esc(what),
            thousands(*bytes),
            *bytes as f64 / unit,
            *bytes as f64 / m.params.max(1) as f64,
            rule.map_or(String::new(), |r| r.to_string())
        );
    }
    h.push_str("</table>\n</section>\n");
}

fn verdict_section(h: &mut String, v: &Verdict) {
    h.push_str("<section id=\"fit\">\n<h2>Will it fit?</h2>\n");
    let _ = writeln!(
        h,
        "<p>Planned peak {} on {} ({}): <span class=\"{}\">{}</span>.</p>",
        esc(&counted_bytes(v.peak)),
        esc(&v.target.name),
        esc(&counted_bytes(v.target.bytes)),
        if v.fits() { "fits" } else { "nofit" },
        esc(&v.headline())
    );
    let table = |h: &mut String, id: &str, what: &str, rows: &[crate::training::fit::Candidate]| {
        if rows.is_empty() {
            return;
        }
        let _ = writeln!(
            h,
            "<table id=\"{id}\">\n<tr><th>{what}</th>\
             <th class=\"num\">planned peak</th><th class=\"num\">step (estimated)</th></tr>"
        );
        for c in rows {
            let caveat = c
                .caveat()
                .map(|w| format!(" ({})", esc(w)))
                .unwrap_or_default();
            let _ = writeln!(
                h,
                "<tr><td><code>{}</code>{caveat}</td><td class=\"num\">{}</td>\
                 <td class=\"num\">{:.1} ms</td></tr>",
                esc(&c.change),
                esc(&counted_bytes(c.peak)),
                c.seconds * 1e3
            );
        }
        h.push_str("</table>\n");
    };
    table(h, "fit-table", "change that would fit", &v.candidates);
    if let Some(note) = &v.note {
        let _ = writeln!(h, "<p>{}</p>", esc(note));
    }
    table(
        h,
        "fit-other",
        "other ways to fit (adapters, a quantized base, more devices)",
        &v.alternatives,
    );
    h.push_str("</section>\n");
}

fn precision_section(h: &mut String, p: &PrecisionSummary) {
    h.push_str("<section id=\"precision\">\n<h2>Precision</h2>\n");
    let _ = writeln!(h, "<p>{}</p>", esc(&p.headline()));
    let mut dtypes: Vec<castor_ir::DType> = p
        .by_class
        .values()
        .flat_map(|m| m.keys().copied())
        .collect();
    dtypes.sort();
    dtypes.dedup();
    h.push_str("<table id=\"precision-table\">\n<tr><th>class</th>");
    for d in &dtypes {
        let _ = write!(h, "<th class=\"num\">{}</th>", d.name());
    }
    h.push_str("</tr>\n");
    for class in p.shown_classes() {
        let _ = write!(h, "<tr><td>{}</td>", class.name());
        for d in &dtypes {
            let n = p
                .by_class
                .get(&class)
                .and_then(|r| r.get(d))
                .copied()
                .unwrap_or(0);
            let _ = write!(h, "<td class=\"num\">{n}</td>");
        }
        h.push_str("</tr>\n");
    }
    h.push_str("</table>\n");
    let casts: Vec<String> = p.casts.iter().map(|(d, n)| format!("{n} to {d}")).collect();
    let copies: Vec<String> = p
        .param_copies
        .iter()
        .map(|(d, n)| format!("{n} {d}"))
        .collect();
    let _ = writeln!(
        h,
        "<p>Contractions counted by operand dtype, other ops by stored dtype; all accumulate \
         in f32. Casts: {}. Persistent parameter copies: {}.</p>",
        if casts.is_empty() {
            "none".to_string()
        } else {
            casts.join(", ")
        },
        if copies.is_empty() {
            "none".to_string()
        } else {
            copies.join(", ")
        }
    );
    h.push_str("</section>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(2.31, 5.97, 5);
        assert_eq!(t, vec![3.0, 4.0, 5.0]);
        assert_eq!(tick_label(0.001), "0.001");
        assert_eq!(tick_label(65536.0), "65536");
        assert_eq!(esc("<a & \"b\">"), "&lt;a &amp; &quot;b&quot;&gt;");
    }
}
