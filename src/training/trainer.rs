//! A training plan on the executor `--device` chose: one [`PlanExecutor`].
//!
//! On the CPU the [`PlanRunner`] trains. With CUDA (or the CUDA program on the emulator) the
//! state lives on the device, and a host copy (a [`PlanRunner`] holding it) is made only when
//! something on the host needs the weights (a checkpoint, sampling) and refreshed only then,
//! so training steps never wait for copies and host memory holds no second copy of the state
//! until it is asked for. A data-parallel plan runs as ranks in this process
//! ([`castor_runtime::ranks::Ranks`]), or, in a process a launcher started, as this process's
//! rank: on its GPU with NCCL ([`LaunchedRank`]) or on the CPU over TCP ([`LaunchedCpu`]).

use castor_ir::{Tensor, TrainingPlan};
use castor_runtime::cuda::nccl::NcclRank;
use castor_runtime::cuda::profile::KernelProfile;
use castor_runtime::cuda::{CudaPlanRunner, EmulatedPlanRunner};
use castor_runtime::ranks::{LaunchedCpuRank, Ranks};
use castor_runtime::rendezvous::Rendezvous;
use castor_runtime::{
    CpuStateFn, ExecutorKind, PlanExecutor, PlanRunner, RuntimeError, StepReport,
};
use std::collections::HashMap;

/// This process's rank of a launched group: its GPU runs the plan, NCCL the collectives; the
/// host connections ([`Rendezvous`]) average the logged loss over the ranks.
struct LaunchedRank {
    runner: CudaPlanRunner,
    group: Rendezvous,
}

impl PlanExecutor for LaunchedRank {
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
    fn plan(&self) -> &TrainingPlan {
        self.runner.plan()
    }
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Cuda
    }
    /// Every process reads the whole global batch; this rank runs its own micro-batches (rank
    /// r the r-th run of `grad_accum`), as CPU ranks do. The report's loss is averaged over
    /// the ranks (every rank asks for it at the same steps: the logging cadence is the same
    /// everywhere).
    fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
        report: bool,
    ) -> Result<Option<StepReport>, RuntimeError> {
        let (rank, world) = (self.group.rank(), self.group.world());
        let accum = self.runner.plan().settings.grad_accum;
        let mine = castor_runtime::ranks::rank_share(micro_batches, accum, rank, world)?;
        self.runner.queue_step(mine, lr)?;
        if !report {
            return Ok(None);
        }
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
        Ok(Some(report))
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
    fn device(&self) -> String {
        format!(
            "cuda ({}, rank {} of {} (NCCL))",
            self.runner.device_name(),
            self.group.rank(),
            self.group.world()
        )
    }
    fn allocated_bytes(&self) -> Option<u64> {
        Some(self.runner.allocated_bytes())
    }
    fn attention(&self) -> Option<String> {
        self.runner.attention()
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
}

impl PlanExecutor for LaunchedCpu {
    fn agree(&mut self, flags: [bool; 2]) -> Result<[bool; 2], RuntimeError> {
        let all = self
            .rank
            .exchange(flags.iter().map(|&f| f32::from(u8::from(f))).collect())?;
        Ok([0, 1].map(|i| all.iter().any(|r| r.get(i).is_some_and(|&v| v != 0.0))))
    }
    fn on_cpu_state(&mut self, f: &CpuStateFn) -> Option<Result<Vec<f64>, RuntimeError>> {
        Some(f(self.rank.runner()))
    }
    fn plan(&self) -> &TrainingPlan {
        self.rank.runner().plan()
    }
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Cpu
    }
    fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
        _report: bool,
    ) -> Result<Option<StepReport>, RuntimeError> {
        self.rank.step(micro_batches, lr).map(Some)
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
    fn device(&self) -> String {
        format!(
            "cpu (rank {} of {}, collectives over TCP)",
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
    executor: Box<dyn PlanExecutor>,
    /// The host copy of the state where the executor keeps it elsewhere (a device, ranks).
    host: Option<PlanRunner>,
    /// The executor has taken steps the host copy has not seen.
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
        device: ExecutorKind,
        launched: Option<Launched>,
    ) -> Result<Trainer, RuntimeError> {
        let ranked = !plan.settings.parallel.is_single();
        let writes_files = launched.as_ref().is_none_or(|l| l.group.rank() == 0);
        let executor: Box<dyn PlanExecutor> = match (device, launched) {
            (
                ExecutorKind::Cuda,
                Some(Launched {
                    group,
                    nccl: Some(rank),
                }),
            ) => Box::new(LaunchedRank {
                runner: CudaPlanRunner::for_rank(plan, checkpoint, &rank)?,
                group,
            }),
            (ExecutorKind::Cpu, Some(Launched { group, .. })) => Box::new(LaunchedCpu {
                rank: LaunchedCpuRank::new(plan, checkpoint, group)?,
            }),
            (_, Some(_)) => {
                return Err(RuntimeError::DeviceUnavailable(
                    "a launched group's rank runs on its GPU (--device cuda, with NCCL) or on \
                     the CPU (--device cpu)"
                        .into(),
                ))
            }
            (ExecutorKind::Cpu, None) if ranked => {
                Box::new(Ranks::<PlanRunner>::new(plan, checkpoint)?)
            }
            (ExecutorKind::Cpu, None) => Box::new(PlanRunner::new(plan, checkpoint)?),
            (ExecutorKind::Cuda, None) => Box::new(CudaPlanRunner::new(plan, checkpoint)?),
            (ExecutorKind::Emulate, None) if ranked => {
                Box::new(Ranks::<EmulatedPlanRunner>::new(plan, checkpoint)?)
            }
            (ExecutorKind::Emulate, None) => Box::new(EmulatedPlanRunner::new(plan, checkpoint)?),
        };
        Ok(Trainer {
            executor,
            host: None,
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
        self.executor.plan()
    }

    /// What runs the plan's fused attention ([`PlanExecutor::attention`]).
    pub fn attention(&self) -> Option<String> {
        self.executor.attention()
    }

    /// Device memory the plan holds, where one device program holds it.
    pub fn allocated_bytes(&self) -> Option<u64> {
        self.executor.allocated_bytes()
    }

    /// Times each step's runs on the device (GPU only; see `LoweredPlanRunner::set_timing`).
    pub fn set_timing(&mut self, on: bool) {
        self.executor.set_timing(on);
    }

    /// Profiles the next step command by command (GPU only; see
    /// `LoweredPlanRunner::profile_next_step`).
    pub fn profile_next_step(&mut self) {
        self.executor.profile_next_step();
    }

    /// The last profiled step's commands and device times, if one was profiled on a GPU.
    pub fn take_kernel_profile(&mut self) -> Option<KernelProfile> {
        self.executor.take_kernel_profile()
    }

    /// `"cpu"`, `"cpu (N ranks)"`, `"cuda (<device>)"` or `"emulate (<the emulator>)"`.
    pub fn device(&self) -> String {
        self.executor.device()
    }

    /// One step. On CUDA the step is queued and its report read back only when `report` is
    /// true (the logging cadence); on the CPU every step reports.
    pub fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
        report: bool,
    ) -> Result<Option<StepReport>, RuntimeError> {
        self.host_stale = true;
        self.executor.step(micro_batches, lr, report)
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
        Ok(Some(self.executor.validation_loss(batches)?))
    }

    /// A classifier's validation loss and accuracy on `batches` with the current weights:
    /// computed where CPU runners hold the state (by the ranks together in a group), else
    /// from the host copy of the weights (a device's validation run returns no logits).
    pub fn classification_eval(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> anyhow::Result<(f64, f64)> {
        let eval = |runner: &PlanRunner| {
            crate::training::step_loop::classification_eval(runner, batches)
                .map(|(loss, accuracy)| vec![loss, accuracy])
                .map_err(|e| RuntimeError::Plan(format!("{e:#}")))
        };
        let values = match self.executor.on_cpu_state(&eval) {
            Some(values) => values?,
            None => eval(self.host()?)?,
        };
        match values[..] {
            [loss, accuracy] => Ok((loss, accuracy)),
            _ => Err(anyhow::anyhow!(
                "the classifier evaluation gave {} values, not a loss and an accuracy",
                values.len()
            )),
        }
    }

    /// Each flag set on any rank of a launched group (one exchange between the processes);
    /// elsewhere the flags as given.
    pub fn agree(&mut self, flags: [bool; 2]) -> Result<[bool; 2], RuntimeError> {
        self.executor.agree(flags)
    }

    /// Replaces state entries (resuming).
    pub fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        self.host_stale = true;
        self.executor.restore(entries)
    }

    /// A host runner holding the current state: the executor itself on the CPU, else a copy
    /// (refreshed from the executor when it has changed since the last call).
    pub fn host(&mut self) -> Result<&PlanRunner, RuntimeError> {
        if self.executor.cpu_runner().is_some() {
            return self.executor.cpu_runner().ok_or_else(no_runner);
        }
        if self.host_stale {
            let entries = self.executor.state_entries()?;
            match &mut self.host {
                Some(h) => h.restore(entries)?,
                None => {
                    let plan = self.executor.plan().clone();
                    self.host = Some(PlanRunner::with_state(plan, entries)?)
                }
            }
            self.host_stale = false;
        }
        self.host.as_ref().ok_or_else(no_runner)
    }

    /// The minimum loss scale of a dynamic plan.
    pub fn min_loss_scale(&self) -> Option<f64> {
        match self.plan().settings.loss_scaling {
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
