//! A training plan on the executor `--device` chose.
//!
//! On the CPU the [`PlanRunner`] trains. With CUDA (or the CUDA program on the emulator) the
//! state lives on the device, and a host copy (a [`PlanRunner`] holding it) is made only when
//! something on the host needs the weights (a checkpoint, sampling) and refreshed only then,
//! so training steps never wait for copies and host memory holds no second copy of the state
//! until it is asked for. A data-parallel plan runs as CPU ranks in this process, or, in a
//! process a launcher started, as this process's rank on its GPU with NCCL.

use crate::device::Selected;
use castor_ir::{Tensor, TrainingPlan};
use castor_runtime::cuda::nccl::NcclRank;
use castor_runtime::cuda::profile::KernelProfile;
use castor_runtime::cuda::{CudaPlanRunner, EmulatedPlanRunner, LoweredPlanRunner, Target};
use castor_runtime::ranks::{LaunchedCpuRank, RankRunner, Ranks};
use castor_runtime::rendezvous::Rendezvous;
use castor_runtime::{PlanRunner, RuntimeError, StepReport};
use std::collections::HashMap;

/// What the trainer asks of a lowered plan, whichever target runs it.
trait Lowered {
    fn queue_step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<(), RuntimeError>;
    fn report(&mut self) -> Result<StepReport, RuntimeError>;
    fn validation_loss(&mut self, batches: &[HashMap<String, Tensor>])
        -> Result<f64, RuntimeError>;
    fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError>;
    fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError>;
    fn device_name(&self) -> String;
    /// Device memory the plan holds (none where no device holds it).
    fn allocated_bytes(&self) -> u64 {
        0
    }
    /// Device timing and kernel profiles, where there is a device clock.
    fn set_timing(&mut self, _on: bool) {}
    fn profile_next_step(&mut self) {}
    fn take_kernel_profile(&mut self) -> Option<KernelProfile> {
        None
    }
    /// Each flag set on any rank of a launched group (the flags as given elsewhere).
    fn agree(&mut self, flags: [bool; 2]) -> Result<[bool; 2], RuntimeError> {
        Ok(flags)
    }
    /// A classifier's validation loss and accuracy where the ranks compute them together
    /// (CPU ranks); `None` where the host copy of the weights does.
    fn classification_eval(
        &mut self,
        _batches: &[HashMap<String, Tensor>],
    ) -> Option<anyhow::Result<(f64, f64)>> {
        None
    }
}

impl<T: Target> Lowered for LoweredPlanRunner<T> {
    fn queue_step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<(), RuntimeError> {
        LoweredPlanRunner::queue_step(self, micro_batches, lr)
    }
    fn report(&mut self) -> Result<StepReport, RuntimeError> {
        LoweredPlanRunner::report(self)
    }
    fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        LoweredPlanRunner::validation_loss(self, batches)
    }
    fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        LoweredPlanRunner::restore(self, entries)
    }
    fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        LoweredPlanRunner::state_entries(self)
    }
    fn device_name(&self) -> String {
        LoweredPlanRunner::device_name(self)
    }
    fn allocated_bytes(&self) -> u64 {
        LoweredPlanRunner::allocated_bytes(self)
    }
    fn set_timing(&mut self, on: bool) {
        LoweredPlanRunner::set_timing(self, on)
    }
    fn profile_next_step(&mut self) {
        LoweredPlanRunner::profile_next_step(self)
    }
    fn take_kernel_profile(&mut self) -> Option<KernelProfile> {
        LoweredPlanRunner::take_kernel_profile(self)
    }
}

/// A data-parallel plan's ranks in this process (`--world-size N` on the CPU or the
/// emulator), behind the interface the lowered runners have: the trainer's host copy is their
/// gathered state.
struct InProcessRanks<R: RankRunner> {
    ranks: Ranks<R>,
    last: Option<StepReport>,
}

/// What differs between the runners of an in-process group, for the trainer.
trait GroupRunner: RankRunner {
    /// The group as the device line names it.
    fn describe(world: usize) -> String;
    /// A classifier's validation loss and accuracy, where the ranks compute them together.
    fn classification_eval(
        _ranks: &mut Ranks<Self>,
        _batches: &[HashMap<String, Tensor>],
    ) -> Option<anyhow::Result<(f64, f64)>> {
        None
    }
}

impl GroupRunner for PlanRunner {
    fn describe(world: usize) -> String {
        format!("{world} ranks")
    }
    fn classification_eval(
        ranks: &mut Ranks<Self>,
        batches: &[HashMap<String, Tensor>],
    ) -> Option<anyhow::Result<(f64, f64)>> {
        Some(
            ranks
                .on_rank_zero_with_all(|runner| {
                    crate::train_loop::classification_eval(runner, batches)
                        .map_err(|e| RuntimeError::Plan(format!("{e:#}")))
                })
                .map_err(Into::into),
        )
    }
}

impl GroupRunner for EmulatedPlanRunner {
    fn describe(world: usize) -> String {
        format!("the host emulator, {world} ranks")
    }
}

impl<R: GroupRunner> Lowered for InProcessRanks<R> {
    fn classification_eval(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Option<anyhow::Result<(f64, f64)>> {
        R::classification_eval(&mut self.ranks, batches)
    }
    fn queue_step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<(), RuntimeError> {
        self.last = Some(self.ranks.step(micro_batches, lr)?);
        Ok(())
    }
    fn report(&mut self) -> Result<StepReport, RuntimeError> {
        self.last.ok_or_else(no_runner)
    }
    fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        self.ranks.validation_loss(batches)
    }
    fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        self.ranks.restore(entries)
    }
    fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        self.ranks.state_entries()
    }
    fn device_name(&self) -> String {
        R::describe(self.ranks.world())
    }
}

/// This process's rank of a launched group: its GPU runs the plan, NCCL the collectives; the
/// host connections ([`Rendezvous`]) average the logged loss over the ranks.
struct LaunchedRank {
    runner: CudaPlanRunner,
    group: Rendezvous,
}

impl Lowered for LaunchedRank {
    fn agree(&mut self, flags: [bool; 2]) -> Result<[bool; 2], RuntimeError> {
        let comm = |e: castor_runtime::rendezvous::RendezvousError| {
            RuntimeError::DeviceUnavailable(format!("agreeing on the step's flags: {e}"))
        };
        let mine = [u8::from(flags[0]), u8::from(flags[1])];
        let any = self.group.gather(&mine).map_err(comm)?.map(|all| {
            [0, 1].map(|i| u8::from(all.iter().any(|r| r.get(i).is_some_and(|&b| b != 0))))
        });
        let agreed = self
            .group
            .broadcast(any.as_ref().map(|a| &a[..]))
            .map_err(comm)?;
        Ok([0, 1].map(|i| agreed.get(i).is_some_and(|&b| b != 0)))
    }
    /// Every process reads the whole global batch; this rank runs its own micro-batches (rank
    /// r the r-th run of `grad_accum`), as CPU ranks do.
    fn queue_step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<(), RuntimeError> {
        let (rank, world) = (self.group.rank(), self.group.world());
        let accum = self.runner.plan().settings.grad_accum;
        let mine = castor_runtime::ranks::rank_share(micro_batches, accum, rank, world)?;
        self.runner.queue_step(mine, lr)
    }
    /// The rank's report with the loss averaged over the ranks (every rank calls it at the
    /// same steps: the logging cadence is the same everywhere).
    fn report(&mut self) -> Result<StepReport, RuntimeError> {
        let mut report = self.runner.report()?;
        let comm = |e: castor_runtime::rendezvous::RendezvousError| {
            RuntimeError::DeviceUnavailable(format!("averaging the ranks' losses: {e}"))
        };
        let losses = self
            .group
            .gather(&report.loss.to_le_bytes())
            .map_err(comm)?;
        let mean = losses.map(|all| {
            let losses = all
                .iter()
                .filter_map(|b| b.as_slice().try_into().ok())
                .map(f32::from_le_bytes);
            castor_runtime::ranks::mean_loss(losses, all.len()).to_le_bytes()
        });
        let mean = self
            .group
            .broadcast(mean.as_ref().map(|m| &m[..]))
            .map_err(comm)?;
        if let Ok(bytes) = <[u8; 4]>::try_from(mean.as_slice()) {
            report.loss = f32::from_le_bytes(bytes);
        }
        Ok(report)
    }
    fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        self.runner.validation_loss(batches)
    }
    fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        self.runner.restore(entries)
    }
    fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        self.runner.state_entries()
    }
    fn device_name(&self) -> String {
        format!(
            "{}, rank {} of {} (NCCL)",
            self.runner.device_name(),
            self.group.rank(),
            self.group.world()
        )
    }
    fn allocated_bytes(&self) -> u64 {
        self.runner.allocated_bytes()
    }
    fn set_timing(&mut self, on: bool) {
        self.runner.set_timing(on)
    }
    fn profile_next_step(&mut self) {
        self.runner.profile_next_step()
    }
    fn take_kernel_profile(&mut self) -> Option<KernelProfile> {
        self.runner.take_kernel_profile()
    }
}

/// This process's rank of a launched group on the CPU (collectives over TCP).
struct LaunchedCpu {
    rank: LaunchedCpuRank,
    last: Option<StepReport>,
}

impl Lowered for LaunchedCpu {
    fn agree(&mut self, flags: [bool; 2]) -> Result<[bool; 2], RuntimeError> {
        let all = self
            .rank
            .exchange(flags.iter().map(|&f| f32::from(u8::from(f))).collect())?;
        Ok([0, 1].map(|i| all.iter().any(|r| r.get(i).is_some_and(|&v| v != 0.0))))
    }
    fn classification_eval(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Option<anyhow::Result<(f64, f64)>> {
        Some(crate::train_loop::classification_eval(
            self.rank.runner(),
            batches,
        ))
    }
    fn queue_step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<(), RuntimeError> {
        self.last = Some(self.rank.step(micro_batches, lr)?);
        Ok(())
    }
    fn report(&mut self) -> Result<StepReport, RuntimeError> {
        self.last.ok_or_else(no_runner)
    }
    fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        self.rank.validation_loss(batches)
    }
    fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        self.rank.restore(entries)
    }
    fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        self.rank.state_entries()
    }
    fn device_name(&self) -> String {
        format!(
            "rank {} of {}, collectives over TCP",
            self.rank.rank(),
            self.rank.world()
        )
    }
}

/// A launched group this process has joined: its connections, and on GPUs its NCCL rank.
pub struct Launched {
    pub group: Rendezvous,
    pub nccl: Option<NcclRank>,
}

pub struct Trainer {
    plan: TrainingPlan,
    /// The CPU runner: the trainer on the CPU, the host copy of the device state otherwise.
    host: Option<PlanRunner>,
    /// The lowered plan on CUDA or on the emulator, and how `device()` names it.
    lowered: Option<(Box<dyn Lowered>, &'static str)>,
    /// The device has taken steps the host copy has not seen.
    host_stale: bool,
    /// Whether this process writes files: not a launched group's ranks other than 0.
    writes_files: bool,
}

impl Trainer {
    /// The plan with its state initialized from `checkpoint`, on `device`; in a launched
    /// group (`launched`: its connections and this process's rank), this rank's part of it.
    pub fn new(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        device: &Selected,
        launched: Option<Launched>,
    ) -> Result<Trainer, RuntimeError> {
        let ranked = !plan.settings.parallel.is_single();
        let writes_files = launched.as_ref().is_none_or(|l| l.group.rank() == 0);
        let (host, lowered): (_, Option<(Box<dyn Lowered>, _)>) = match (device, launched) {
            (
                Selected::Cuda(_),
                Some(Launched {
                    group,
                    nccl: Some(rank),
                }),
            ) => (
                None,
                Some((
                    Box::new(LaunchedRank {
                        runner: CudaPlanRunner::for_rank(plan.clone(), checkpoint, &rank)?,
                        group,
                    }),
                    "cuda",
                )),
            ),
            (Selected::Cpu, Some(Launched { group, .. })) => (
                None,
                Some((
                    Box::new(LaunchedCpu {
                        rank: LaunchedCpuRank::new(plan.clone(), checkpoint, group)?,
                        last: None,
                    }),
                    "cpu",
                )),
            ),
            (_, Some(_)) => {
                return Err(RuntimeError::DeviceUnavailable(
                    "a launched group's rank runs on its GPU (--device cuda, with NCCL) or on \
                     the CPU (--device cpu)"
                        .into(),
                ))
            }
            (device, None) => match device {
                Selected::Cpu if ranked => (
                    None,
                    Some((
                        Box::new(InProcessRanks::<PlanRunner> {
                            ranks: Ranks::new(plan.clone(), checkpoint)?,
                            last: None,
                        }),
                        "cpu",
                    )),
                ),
                Selected::Cpu => (Some(PlanRunner::new(plan.clone(), checkpoint)?), None),
                Selected::Cuda(_) => (
                    None,
                    Some((
                        Box::new(CudaPlanRunner::new(plan.clone(), checkpoint)?),
                        "cuda",
                    )),
                ),
                Selected::Emulated if ranked => (
                    None,
                    Some((
                        Box::new(InProcessRanks::<EmulatedPlanRunner> {
                            ranks: Ranks::new(plan.clone(), checkpoint)?,
                            last: None,
                        }),
                        "emulate",
                    )),
                ),
                Selected::Emulated => (
                    None,
                    Some((
                        Box::new(EmulatedPlanRunner::new(plan.clone(), checkpoint)?),
                        "emulate",
                    )),
                ),
            },
        };
        Ok(Trainer {
            plan,
            host,
            lowered,
            host_stale: true,
            writes_files,
        })
    }

    /// Whether this process writes checkpoints, logs and reports: every process but the
    /// ranks other than 0 of a launched group (which still take part in gathering the state).
    pub fn writes_files(&self) -> bool {
        self.writes_files
    }

    pub fn plan(&self) -> &TrainingPlan {
        &self.plan
    }

    /// Device memory the plan holds, where it runs as a lowered program (not CPU ranks).
    pub fn allocated_bytes(&self) -> Option<u64> {
        self.lowered
            .as_ref()
            .filter(|(_, kind)| *kind != "cpu")
            .map(|(c, _)| c.allocated_bytes())
    }

    /// Times each step's runs on the device (GPU only; see `LoweredPlanRunner::set_timing`).
    pub fn set_timing(&mut self, on: bool) {
        if let Some((c, _)) = &mut self.lowered {
            c.set_timing(on);
        }
    }

    /// Profiles the next step command by command (GPU only; see
    /// `LoweredPlanRunner::profile_next_step`).
    pub fn profile_next_step(&mut self) {
        if let Some((c, _)) = &mut self.lowered {
            c.profile_next_step();
        }
    }

    /// The last profiled step's commands and device times, if one was profiled on a GPU.
    pub fn take_kernel_profile(&mut self) -> Option<KernelProfile> {
        self.lowered
            .as_mut()
            .and_then(|(c, _)| c.take_kernel_profile())
    }

    /// `"cpu"`, `"cpu (N ranks)"`, `"cuda (<device>)"` or `"emulate (<the emulator>)"`.
    pub fn device(&self) -> String {
        match &self.lowered {
            Some((c, kind)) => format!("{kind} ({})", c.device_name()),
            None => "cpu".into(),
        }
    }

    /// One step. On CUDA the step is queued and its report read back only when `report` is
    /// true (the logging cadence); on the CPU every step reports.
    pub fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
        report: bool,
    ) -> Result<Option<StepReport>, RuntimeError> {
        match (&mut self.lowered, &mut self.host) {
            (Some((c, _)), _) => {
                self.host_stale = true;
                c.queue_step(micro_batches, lr)?;
                if report {
                    c.report().map(Some)
                } else {
                    Ok(None)
                }
            }
            (None, Some(h)) => h.step(micro_batches, lr).map(Some),
            (None, None) => Err(no_runner()),
        }
    }

    /// The mean micro-step loss on held-out `batches` with the current weights, on the
    /// executor that trains (the device's state is not copied back for it).
    pub fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> anyhow::Result<Option<f64>> {
        if batches.is_empty() {
            return Ok(None);
        }
        match (&mut self.lowered, &self.host) {
            (Some((c, _)), _) => Ok(Some(c.validation_loss(batches)?)),
            (None, Some(h)) => crate::train_loop::validation_loss(h, batches),
            (None, None) => Err(no_runner().into()),
        }
    }

    /// A classifier's validation loss and accuracy on `batches` with the current weights:
    /// computed by the ranks together on CPU ranks, else from the host copy of the weights
    /// (a device's validation run returns no logits).
    pub fn classification_eval(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> anyhow::Result<(f64, f64)> {
        if let Some((c, _)) = &mut self.lowered {
            if let Some(result) = c.classification_eval(batches) {
                return result;
            }
        }
        crate::train_loop::classification_eval(self.host()?, batches)
    }

    /// Each flag set on any rank of a launched group (one exchange between the processes);
    /// elsewhere the flags as given.
    pub fn agree(&mut self, flags: [bool; 2]) -> Result<[bool; 2], RuntimeError> {
        match &mut self.lowered {
            Some((c, _)) => c.agree(flags),
            None => Ok(flags),
        }
    }

    /// Replaces state entries (resuming).
    pub fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        match (&mut self.lowered, &mut self.host) {
            (Some((c, _)), _) => {
                self.host_stale = true;
                c.restore(entries)
            }
            (None, Some(h)) => h.restore(entries),
            (None, None) => Err(no_runner()),
        }
    }

    /// A host runner holding the current state (with CUDA, copied back from the device when
    /// it has changed since the last call).
    pub fn host(&mut self) -> Result<&PlanRunner, RuntimeError> {
        if let (Some((c, _)), true) = (&mut self.lowered, self.host_stale) {
            let entries = c.state_entries()?;
            match &mut self.host {
                Some(h) => h.restore(entries)?,
                None => self.host = Some(PlanRunner::with_state(self.plan.clone(), entries)?),
            }
            self.host_stale = false;
        }
        self.host.as_ref().ok_or_else(no_runner)
    }

    /// The minimum loss scale of a dynamic plan.
    pub fn min_loss_scale(&self) -> Option<f64> {
        match self.plan.settings.loss_scaling {
            castor_ir::LossScaling::Dynamic { min_scale, .. } => Some(min_scale),
            _ => None,
        }
    }
}

fn no_runner() -> RuntimeError {
    RuntimeError::Internal {
        node: "trainer".into(),
        message: "no executor holds the plan".into(),
    }
}
