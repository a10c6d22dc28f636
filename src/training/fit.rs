//! Will a training step fit? The planned peak of a plan against a device's memory, and, when
//! it does not fit, the cheapest changes that would make it fit, each with its planned peak.
//!
//! The memory comes from the GPU itself when one is present (`cuDeviceTotalMem`), else from
//! `--gpu NAME` (the built-in table, `castor_passes::gpus`) or `--gpu FILE` (a spec with
//! `memory_bytes`); training on the CPU is checked against the host's memory. The changes
//! tried are the ones that trade time for memory without changing what is learnt: a
//! recomputation mode (`--remat selective`, `full`, or a budget of the device's memory), a
//! smaller micro-batch with gradient accumulation over the same tokens per step, SGD with
//! momentum instead of AdamW (one moment instead of two), 8-bit AdamW (AdamW's moments in a
//! byte each), Adafactor (factored second moments, nearly no state), and the fused classifier
//! (the LM head's logits a chunk at a time), BF16 moments and the update in the backward
//! (gradients freed as they are made). Each is planned for real (the memory planner's peak,
//! not an estimate) and ranked by the cost model's step time; when no single change fits,
//! changes are combined greedily (each round adds the one that lowers the peak most) until
//! some combination fits. Beside them the verdict says what LoRA, QLoRA and ZeRO-3 over 2, 4
//! or 8 devices would plan, which train otherwise or elsewhere. When the persistent state
//! without optimizer state and gradients already exceeds the memory, no change of full
//! training is planned.

use crate::report::counted_bytes;
use crate::CliError;
use castor_ir::{Classifier, OptimizerKind, Remat, TrainSettings, TrainingPlan};
use castor_passes::cost::{GpuSpec, StepCost};
use castor_passes::memory::Anatomy;
use castor_runtime::ExecutorKind;
use std::path::Path;

/// The cost model's GPU for `--gpu`: a name from the built-in table, a spec file, or (none
/// given) the H100 SXM.
pub fn gpu_spec(arg: Option<&str>) -> anyhow::Result<GpuSpec> {
    let Some(arg) = arg else {
        return Ok(GpuSpec::default());
    };
    let path = Path::new(arg);
    if path.is_file() {
        let text = std::fs::read_to_string(path).map_err(|e| {
            CliError::InvalidInput(format!("--gpu: cannot read `{}`: {e}", path.display()))
        })?;
        return Ok(GpuSpec::parse(&text, &format!("`{}`", path.display()))?);
    }
    castor_passes::gpus::find(arg).ok_or_else(|| {
        CliError::InvalidInput(format!(
            "--gpu `{arg}`: no such file, and not a GPU castor knows ({}); give a spec file \
             (JSON or TOML: name, low_precision_flops, tf32_flops, f32_flops, \
             memory_bandwidth, memory_bytes)",
            castor_passes::gpus::names().join(", ")
        ))
        .into()
    })
}

/// The memory a step is checked against.
#[derive(Clone, Debug)]
pub struct MemoryTarget {
    /// The device, for people: `H100 SXM 80 GB (--gpu)`, `NVIDIA H100 ... (this machine's
    /// GPU)`, `host memory`.
    pub name: String,
    pub bytes: u64,
    /// The executor whose memory model lays the step out on it.
    pub executor: ExecutorKind,
}

impl MemoryTarget {
    /// The GPU of this machine, if the driver reports one.
    pub fn this_gpu() -> Option<MemoryTarget> {
        castor_runtime::cuda_probe::probe()
            .ok()
            .map(|d| MemoryTarget {
                name: format!("{} (this machine's GPU)", d.name),
                bytes: d.total_memory,
                executor: ExecutorKind::Cuda,
            })
    }

    /// A GPU spec's memory, if the spec gives it; `how` says where the spec came from.
    pub fn of_spec(gpu: &GpuSpec, how: &str) -> Option<MemoryTarget> {
        gpu.memory_bytes.map(|bytes| MemoryTarget {
            name: format!("{} ({how})", gpu.name),
            bytes,
            executor: ExecutorKind::Cuda,
        })
    }

    /// The host's physical memory (`MemTotal` of /proc/meminfo; Linux only).
    pub fn host() -> Option<MemoryTarget> {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let kib: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(MemoryTarget {
            name: "host memory (training on the CPU)".into(),
            bytes: kib * 1024,
            executor: ExecutorKind::Cpu,
        })
    }
}

/// One change and what it plans to.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The flags, as typed: `--remat selective`, `--batch 4 --grad-accum 2`.
    pub change: String,
    pub peak: u64,
    /// The cost model's estimated step time.
    pub seconds: f64,
}

impl Candidate {
    /// What a user should know before taking the change: it asks for a mode whose plans have
    /// not passed the GPU tests yet (FP8: on the 2026-11-29 H200 run cuBLASLt refused its
    /// products), so the verdict offers it with this said.
    pub fn caveat(&self) -> Option<&'static str> {
        let words: Vec<&str> = self.change.split_whitespace().collect();
        let fp8 = words
            .windows(2)
            .any(|w| w[0] == "--precision" && w[1].starts_with("fp8"));
        fp8.then_some("FP8 plans have not passed the GPU tests yet")
    }
}

#[derive(Clone, Debug)]
pub struct Verdict {
    pub peak: u64,
    pub target: MemoryTarget,
    /// Changes to full training on one device that fit, cheapest first (empty when the plan
    /// fits).
    pub candidates: Vec<Candidate>,
    /// Other ways to fit: adapters, a quantized base, ZeRO-3 over several devices.
    pub alternatives: Vec<Candidate>,
    /// When nothing tried fits: why.
    pub note: Option<String>,
}

impl Verdict {
    pub fn fits(&self) -> bool {
        self.peak <= self.target.bytes
    }

    /// `fits, 12.3 GiB to spare` or `does not fit by 4.5 GiB`.
    pub fn headline(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        if self.fits() {
            format!(
                "fits, {:.2} GiB to spare",
                gib(self.target.bytes - self.peak)
            )
        } else {
            format!(
                "does not fit by {:.2} GiB",
                gib(self.peak - self.target.bytes)
            )
        }
    }

    /// The verdict as report lines.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec![format!(
            "fit         planned peak {} on {}, {}: {}",
            counted_bytes(self.peak),
            self.target.name,
            counted_bytes(self.target.bytes),
            self.headline()
        )];
        // One row per suggestion, the label on the first (the columns as they have always
        // been printed: the change padded to 44 after `would fit:`, 42 after `other ways:`).
        let rows = |label: &str, width: usize, list: &[Candidate], out: &mut Vec<String>| {
            for (i, c) in list.iter().enumerate() {
                let label = if i == 0 {
                    label.to_string()
                } else {
                    " ".repeat(label.len())
                };
                let caveat = c.caveat().map(|w| format!(" ({w})")).unwrap_or_default();
                out.push(format!(
                    "  {label} {:<width$} planned peak {}, step {:.1} ms estimated{caveat}",
                    c.change,
                    counted_bytes(c.peak),
                    c.seconds * 1e3
                ));
            }
        };
        rows("would fit:", 44, &self.candidates, &mut out);
        if let Some(note) = &self.note {
            out.push(format!("  {note}"));
        }
        rows("other ways:", 42, &self.alternatives, &mut out);
        out
    }
}

/// The planned peak of a training step on `executor`: persistent state and everything else
/// it allocates.
pub fn planned_peak(plan: &TrainingPlan, executor: ExecutorKind) -> u64 {
    crate::memory::anatomy(executor, plan).total()
}

/// Builds the plan of other settings (the command's own compile path; the settings carry the
/// micro-batch shape).
pub type Replan<'a> = dyn Fn(TrainSettings) -> anyhow::Result<TrainingPlan> + 'a;

/// The verdict of `plan` (its `anatomy` under `target`'s executor) on `target`; when it does
/// not fit, the changes that would.
pub fn verdict(
    plan: &TrainingPlan,
    anatomy: &Anatomy,
    target: MemoryTarget,
    gpu: &GpuSpec,
    family: Option<castor_models::Family>,
    replan: &Replan,
) -> Verdict {
    let executor = target.executor;
    let peak = anatomy.total();
    let mut v = Verdict {
        peak,
        target,
        candidates: Vec::new(),
        alternatives: Vec::new(),
        note: None,
    };
    if v.fits() {
        return v;
    }
    let s = &plan.settings;
    let memory = v.target.bytes;
    let try_plan = |settings: TrainSettings| -> Option<(u64, f64)> {
        let p = replan(settings).ok()?;
        // A change the executor cannot run is no remedy.
        if executor.runs_cuda_program() && castor_runtime::cuda::lower::lower_plan(&p).is_err() {
            return None;
        }
        Some((
            planned_peak(&p, executor),
            StepCost::of_plan(&p, gpu).seconds(),
        ))
    };
    // What fits without training the same parameters the same way: adapters, a quantized
    // base, or the state sharded over several devices; said whatever else fits.
    v.alternatives = alternatives(s, family, memory, &try_plan);
    // The persistent state is a floor no recomputation or micro-batch lowers; the most any
    // change of one device's full training saves of it are the optimizer state (Adafactor's
    // factored moments are nearly none) and the gradients (updated in the backward, they are
    // transient). Above that floor nothing else is worth planning (a 70B model's candidates
    // would take minutes).
    let floor = anatomy.persistent() - anatomy.optimizer_state - anatomy.gradients;
    if floor > memory {
        v.note = Some(format!(
            "no change of full training on one device fits: the persistent state alone \
             (weights, master weights, gradients, optimizer state) is {}, and more than {} \
             even with no optimizer state and the gradients freed as the backward makes them.",
            counted_bytes(anatomy.persistent()),
            counted_bytes(floor)
        ));
        return v;
    }
    // Each change alone, cheapest first.
    let levers = levers(s, memory, gpu);
    let mut found: Vec<Candidate> = Vec::new();
    for lever in levers.iter().filter(|l| l.kind != LeverKind::Batch) {
        let mut t = s.clone();
        (lever.apply)(&mut t);
        if let Some((peak, seconds)) = try_plan(t) {
            if peak <= memory {
                found.push(Candidate {
                    change: lever.flags.clone(),
                    peak,
                    seconds,
                });
            }
        }
    }
    // The largest smaller micro-batch that fits, with the accumulation that keeps the tokens
    // per step.
    if let Some(c) = smaller_batch(s, memory, &try_plan) {
        found.push(c);
    }
    if found.is_empty() {
        found = combined(s, memory, &levers, &try_plan);
    }
    found.sort_by(|a, b| a.seconds.total_cmp(&b.seconds).then(a.peak.cmp(&b.peak)));
    v.candidates = found;
    if v.candidates.is_empty() {
        v.note = Some(format!(
            "no combination of changes castor makes to full training on one device fits; the \
             persistent state alone (weights, master weights, gradients, optimizer state) is \
             {}.",
            counted_bytes(anatomy.persistent())
        ));
    }
    v
}

/// A planned step's peak and estimated time, or none when it cannot be planned or run.
type TryPlan<'a> = dyn Fn(TrainSettings) -> Option<(u64, f64)> + 'a;

/// One change of the settings that trades time (or a little precision of the optimizer
/// state) for memory, as the flags that ask for it.
struct Lever {
    flags: String,
    /// Changes of one kind exclude each other (two optimizers, two remat modes).
    kind: LeverKind,
    apply: Box<dyn Fn(&mut TrainSettings)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum LeverKind {
    Remat,
    Optimizer,
    MomentDtype,
    Classifier,
    UpdateInBackward,
    /// The layers' products on FP8 operands: their weights' BF16 copies dropped (each is cast
    /// from its master in the step) and their inputs saved for the backward in one byte.
    Fp8,
    /// One sequence per micro-batch, accumulated to the same tokens per step (alone, the
    /// largest micro-batch that fits is searched instead: [`smaller_batch`]).
    Batch,
}

/// The changes that apply to `s` on `gpu`.
fn levers(s: &TrainSettings, memory: u64, gpu: &GpuSpec) -> Vec<Lever> {
    let mut out: Vec<Lever> = Vec::new();
    // FP8 products where the GPU has FP8 tensor cores: less memory and a faster step, at
    // FP8's precision (the fp8 tests bound it).
    if s.precision == castor_ir::Precision::Bf16 && gpu.fp8_flops.is_some() {
        out.push(Lever {
            flags: "--precision fp8".into(),
            kind: LeverKind::Fp8,
            apply: Box::new(|t| t.precision = castor_ir::Precision::Fp8),
        });
    }
    for remat in [Remat::Selective, Remat::Full, Remat::Budget(memory)] {
        if s.remat != remat {
            let flags = match remat {
                Remat::Budget(_) => format!("--remat budget:{}", budget_text(memory)),
                other => format!("--remat {other}"),
            };
            out.push(Lever {
                flags,
                kind: LeverKind::Remat,
                apply: Box::new(move |t| t.remat = remat),
            });
        }
    }
    // The LM head's logits in chunks: the same training, a bounded head.
    if s.classifier.is_eager() {
        out.push(Lever {
            flags: "--classifier fused".into(),
            kind: LeverKind::Classifier,
            apply: Box::new(|t| t.classifier = Classifier::Fused { chunk_rows: None }),
        });
    }
    if let OptimizerKind::AdamW(hp) = s.optimizer {
        out.push(Lever {
            flags: "--optimizer adamw8bit".into(),
            kind: LeverKind::Optimizer,
            apply: Box::new(move |t| t.optimizer = OptimizerKind::AdamW8bit(hp)),
        });
        out.push(Lever {
            flags: "--optimizer sgd".into(),
            kind: LeverKind::Optimizer,
            apply: Box::new(move |t| {
                t.optimizer = OptimizerKind::Sgd(castor_ir::SgdHparams {
                    momentum: 0.9,
                    weight_decay: hp.weight_decay,
                })
            }),
        });
    }
    if !matches!(s.optimizer, OptimizerKind::Adafactor(_)) {
        out.push(Lever {
            flags: "--optimizer adafactor".into(),
            kind: LeverKind::Optimizer,
            apply: Box::new(|t| t.optimizer = OptimizerKind::adafactor(true)),
        });
    }
    if s.optimizer_state == castor_ir::DType::F32 {
        out.push(Lever {
            flags: "--optimizer-state bf16".into(),
            kind: LeverKind::MomentDtype,
            apply: Box::new(|t| t.optimizer_state = castor_ir::DType::BF16),
        });
    }
    if s.batch > 1 {
        let accum = s.grad_accum * s.batch;
        out.push(Lever {
            flags: format!("--batch 1 --grad-accum {accum}"),
            kind: LeverKind::Batch,
            apply: Box::new(move |t| {
                t.batch = 1;
                t.grad_accum = accum;
            }),
        });
    }
    // One micro-batch per step: the gradients need not outlive the backward.
    if !s.update_in_backward && s.grad_accum == 1 {
        out.push(Lever {
            flags: "--update-in-backward".into(),
            kind: LeverKind::UpdateInBackward,
            apply: Box::new(|t| t.update_in_backward = true),
        });
    }
    out
}

/// The largest smaller micro-batch of `s` that fits, with the accumulation that keeps the
/// tokens per step.
fn smaller_batch(s: &TrainSettings, memory: u64, try_plan: &TryPlan) -> Option<Candidate> {
    let mut b = s.batch;
    while b > 1 {
        b /= 2;
        if !s.batch.is_multiple_of(b) || s.update_in_backward {
            continue;
        }
        let mut t = s.clone();
        t.batch = b;
        t.grad_accum = s.grad_accum * (s.batch / b);
        if let Some((peak, seconds)) = try_plan(t.clone()) {
            if peak <= memory {
                return Some(Candidate {
                    change: format!("--batch {b} --grad-accum {}", t.grad_accum),
                    peak,
                    seconds,
                });
            }
        }
    }
    None
}

/// When no change fits alone: changes combined, greedily. Each round adds, of the changes
/// not yet taken (one of each kind), the one that lowers the planned peak the most; the
/// first round in which some combination fits gives every combination of that round that
/// fits. The recomputation levers come first among equals, as they change nothing learnt.
fn combined(
    s: &TrainSettings,
    memory: u64,
    levers: &[Lever],
    try_plan: &TryPlan,
) -> Vec<Candidate> {
    let mut taken: Vec<usize> = Vec::new();
    let mut base = s.clone();
    for _round in 0..6 {
        let mut best: Option<(usize, u64)> = None;
        let mut fits: Vec<Candidate> = Vec::new();
        for (i, lever) in levers.iter().enumerate() {
            // One change of each kind; accumulation and the update in the backward exclude
            // each other.
            let excludes = |a: LeverKind, b: LeverKind| {
                a == b
                    || matches!(
                        (a, b),
                        (LeverKind::Batch, LeverKind::UpdateInBackward)
                            | (LeverKind::UpdateInBackward, LeverKind::Batch)
                    )
            };
            if taken
                .iter()
                .any(|&j| j == i || excludes(levers[j].kind, lever.kind))
            {
                continue;
            }
            let mut t = base.clone();
            (lever.apply)(&mut t);
            let Some((peak, seconds)) = try_plan(t) else {
                continue;
            };
            if peak <= memory {
                let flags: Vec<&str> = taken
                    .iter()
                    .map(|&j| levers[j].flags.as_str())
                    .chain([lever.flags.as_str()])
                    .collect();
                fits.push(Candidate {
                    change: flags.join(" "),
                    peak,
                    seconds,
                });
            }
            if best.is_none_or(|(_, p)| peak < p) {
                best = Some((i, peak));
            }
        }
        if !fits.is_empty() {
            return fits;
        }
        let Some((i, _)) = best else {
            return Vec::new();
        };
        (levers[i].apply)(&mut base);
        taken.push(i);
    }
    Vec::new()
}

/// LoRA (rank 16 on PEFT's default modules), QLoRA (the same over an NF4 base) and ZeRO-3 over
/// the fewest devices (2, 4 or 8) that fit, when they fit, cheapest first. Not tried for a plan
/// that already uses them.
fn alternatives(
    s: &TrainSettings,
    family: Option<castor_models::Family>,
    memory: u64,
    try_plan: &TryPlan,
) -> Vec<Candidate> {
    let mut out = Vec::new();
    let mut push = |change: String, t: TrainSettings| {
        if let Some((peak, seconds)) = try_plan(t) {
            if peak <= memory {
                out.push(Candidate {
                    change,
                    peak,
                    seconds,
                });
                return true;
            }
        }
        false
    };
    // An IR file names no family, so no default adapter targets.
    if let (None, true, Some(family)) = (&s.lora, s.parallel.is_single(), family) {
        for (base, flags) in [
            (castor_ir::LoraBase::Compute, "--lora-rank 16"),
            (castor_ir::LoraBase::Nf4, "--lora-rank 16 --base nf4"),
        ] {
            let mut t = s.clone();
            t.lora = Some(castor_ir::LoraSettings {
                rank: 16,
                alpha: 16.0,
                targets: family
                    .lora_targets()
                    .iter()
                    .map(|t| t.to_string())
                    .collect(),
                base,
            });
            push(flags.into(), t);
        }
    }
    if s.parallel.is_single() && s.lora.is_none() {
        for world in [2usize, 4, 8] {
            let mut t = s.clone();
            t.parallel = castor_ir::Parallel {
                world_size: world,
                zero: 3,
            };
            if push(
                format!("--world-size {world} --zero 3 ({world} devices)"),
                t,
            ) {
                break;
            }
        }
    }
    out.sort_by(|a, b| a.seconds.total_cmp(&b.seconds).then(a.peak.cmp(&b.peak)));
    out
}

/// A budget as people write it: whole GiB when it is, else bytes.
fn budget_text(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        format!("{}GiB", bytes >> 30)
    } else {
        bytes.to_string()
    }
}
