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
//! (the LM head's logits a chunk at a time). Each is planned for real (the memory planner's peak, not an
//! estimate) and ranked by the cost model's step time; when no single change fits, all of
//! them together are tried, and when even that does not fit the verdict says how much the
//! persistent state alone needs. When the persistent state without any optimizer state
//! already exceeds the memory, nothing is planned: no change can fit.

use crate::memory::Executor;
use crate::report::counted_bytes;
use crate::CliError;
use castor_ir::{Classifier, OptimizerKind, Remat, TrainSettings, TrainingPlan};
use castor_passes::cost::{GpuSpec, StepCost};
use castor_passes::memory::Anatomy;
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
    pub executor: Executor,
}

impl MemoryTarget {
    /// The GPU of this machine, if the driver reports one.
    pub fn this_gpu() -> Option<MemoryTarget> {
        castor_runtime::cuda_probe::probe()
            .ok()
            .map(|d| MemoryTarget {
                name: format!("{} (this machine's GPU)", d.name),
                bytes: d.total_memory,
                executor: Executor::Cuda,
            })
    }

    /// A GPU spec's memory, if the spec gives it; `how` says where the spec came from.
    pub fn of_spec(gpu: &GpuSpec, how: &str) -> Option<MemoryTarget> {
        gpu.memory_bytes.map(|bytes| MemoryTarget {
            name: format!("{} ({how})", gpu.name),
            bytes,
            executor: Executor::Cuda,
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
            executor: Executor::Cpu,
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

#[derive(Clone, Debug)]
pub struct Verdict {
    pub peak: u64,
    pub target: MemoryTarget,
    /// Changes that fit, cheapest first (empty when the plan fits).
    pub candidates: Vec<Candidate>,
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
        for (i, c) in self.candidates.iter().enumerate() {
            out.push(format!(
                "  {} {:<44} planned peak {}, step {:.1} ms estimated",
                if i == 0 { "would fit:" } else { "          " },
                c.change,
                counted_bytes(c.peak),
                c.seconds * 1e3
            ));
        }
        if let Some(note) = &self.note {
            out.push(format!("  {note}"));
        }
        out
    }
}

/// The planned peak of a training step on `executor`: persistent state and everything else
/// it allocates.
pub fn planned_peak(plan: &TrainingPlan, executor: Executor) -> u64 {
    executor.anatomy(plan).total()
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
    replan: &Replan,
) -> Verdict {
    let executor = target.executor;
    let peak = anatomy.total();
    let mut v = Verdict {
        peak,
        target,
        candidates: Vec::new(),
        note: None,
    };
    if v.fits() {
        return v;
    }
    let s = &plan.settings;
    let memory = v.target.bytes;
    // The persistent state is a floor no recomputation or micro-batch lowers; Adafactor's
    // factored moments (a row and a column per matrix) are the most any change saves of it.
    // Above that floor nothing is worth planning (a 70B model's candidates would take
    // minutes).
    let floor = anatomy.persistent() - anatomy.optimizer_state;
    if floor > memory {
        v.note = Some(format!(
            "no change castor makes fits: the persistent state alone (weights, master weights, \
             gradients, optimizer state) is {}, and more than {} even with Adafactor's factored \
             moments; this model needs more memory than one such device.",
            counted_bytes(anatomy.persistent()),
            counted_bytes(floor)
        ));
        return v;
    }
    let try_plan = |settings: TrainSettings| -> Option<(u64, f64)> {
        let p = replan(settings).ok()?;
        // A change the executor cannot run is no remedy.
        if matches!(executor, Executor::Cuda)
            && castor_runtime::cuda::lower::lower_plan(&p).is_err()
        {
            return None;
        }
        Some((
            planned_peak(&p, executor),
            StepCost::of_plan(&p, gpu).seconds(),
        ))
    };
    let mut tried: Vec<(String, TrainSettings)> = Vec::new();
    for remat in [Remat::Selective, Remat::Full, Remat::Budget(memory)] {
        if s.remat != remat {
            let mut t = s.clone();
            t.remat = remat;
            let flag = match remat {
                Remat::Budget(_) => format!("--remat budget:{}", budget_text(memory)),
                other => format!("--remat {other}"),
            };
            tried.push((flag, t));
        }
    }
    // The LM head's logits in chunks: the same training, a bounded head.
    if s.classifier.is_eager() {
        let mut t = s.clone();
        t.classifier = Classifier::Fused { chunk_rows: None };
        tried.push(("--classifier fused".into(), t));
    }
    // The largest smaller micro-batch that fits, with the accumulation that keeps the tokens
    // per step.
    let mut found: Vec<Candidate> = Vec::new();
    let mut b = s.batch;
    while b > 1 {
        b /= 2;
        if !s.batch.is_multiple_of(b) {
            continue;
        }
        let mut t = s.clone();
        t.batch = b;
        t.grad_accum = s.grad_accum * (s.batch / b);
        let change = format!("--batch {b} --grad-accum {}", t.grad_accum);
        if let Some((peak, seconds)) = try_plan(t) {
            if peak <= memory {
                found.push(Candidate {
                    change,
                    peak,
                    seconds,
                });
                break;
            }
        }
    }
    let sgd = |t: &mut TrainSettings| {
        if let OptimizerKind::AdamW { weight_decay, .. } = t.optimizer {
            t.optimizer = OptimizerKind::Sgd {
                momentum: 0.9,
                weight_decay,
            };
        }
    };
    if let OptimizerKind::AdamW {
        beta1,
        beta2,
        eps,
        weight_decay,
    } = s.optimizer
    {
        let mut t = s.clone();
        sgd(&mut t);
        tried.push(("--optimizer sgd".into(), t));
        let mut t = s.clone();
        t.optimizer = OptimizerKind::AdamW8bit {
            beta1,
            beta2,
            eps,
            weight_decay,
        };
        tried.push(("--optimizer adamw8bit".into(), t));
    }
    if !matches!(s.optimizer, OptimizerKind::Adafactor { .. }) {
        let mut t = s.clone();
        t.optimizer = OptimizerKind::adafactor(true);
        tried.push(("--optimizer adafactor".into(), t));
    }
    v.candidates = found;
    for (change, t) in tried {
        if let Some((peak, seconds)) = try_plan(t) {
            if peak <= memory {
                v.candidates.push(Candidate {
                    change,
                    peak,
                    seconds,
                });
            }
        }
    }
    v.candidates
        .sort_by(|a, b| a.seconds.total_cmp(&b.seconds).then(a.peak.cmp(&b.peak)));
    if !v.candidates.is_empty() {
        return v;
    }
    // Nothing alone: everything together.
    let mut t = s.clone();
    t.remat = Remat::Full;
    t.grad_accum = s.grad_accum * s.batch;
    t.batch = 1;
    t.classifier = Classifier::Fused { chunk_rows: None };
    sgd(&mut t);
    let change = format!(
        "--remat full --batch 1 --grad-accum {}{}{}",
        t.grad_accum,
        if t.optimizer != s.optimizer {
            " --optimizer sgd"
        } else {
            ""
        },
        if s.classifier.is_eager() {
            " --classifier fused"
        } else {
            ""
        }
    );
    match try_plan(t) {
        Some((peak, seconds)) if peak <= memory => v.candidates.push(Candidate {
            change,
            peak,
            seconds,
        }),
        Some((peak, _)) => {
            v.note = Some(format!(
                "no change castor makes fits: with {change} the step still needs {}; the \
                 persistent state alone (weights, master weights, gradients, optimizer \
                 state) is {}.",
                counted_bytes(peak),
                counted_bytes(anatomy.persistent())
            ));
        }
        None => {
            v.note = Some("no change castor makes was found to fit".into());
        }
    }
    v
}

/// A budget as people write it: whole GiB when it is, else bytes.
fn budget_text(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        format!("{}GiB", bytes >> 30)
    } else {
        bytes.to_string()
    }
}
