//! A data-parallel plan run by its ranks in this process: one thread and one runner per rank
//! ([`Ranks`], over the CPU executor or the emulated CUDA program: [`RankRunner`]), their
//! collectives exchanged through one [`RankGroup`] (castor's stand-in for NCCL, which checks
//! every sharding mode without GPUs); or, in a process a launcher started, that process's
//! rank ([`LaunchedCpuRank`]), exchanging with the other processes over TCP.
//!
//! A step takes `grad_accum x world` micro-batches: rank r gets the r-th run of `grad_accum`.
//! The state as a whole ([`Ranks::state_entries`]) is the single-rank layout: each
//! sharded entry gathered from the ranks' shards, so a checkpoint saved from sharded state is
//! the one a single rank would save, and [`Ranks::restore`] shards it again.

use crate::cpu::collective::{Member, RankGroup, PEER_FAILED};
use crate::rendezvous::Rendezvous;
use crate::{CpuStateFn, ExecutorKind, PlanExecutor, PlanRunner, RuntimeError, StepReport};
use castor_ir::{Tensor, TensorType, TrainingPlan};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What one rank of an in-process group runs: the CPU executor's [`PlanRunner`], or the CUDA
/// program on the host emulator. [`Ranks`] runs either the same way, one thread per rank.
pub trait RankRunner: Send + Sized {
    /// The executor each rank is.
    const KIND: ExecutorKind;
    /// A group of `world` such ranks, as the device line names it after the executor.
    fn describe_group(world: usize) -> String;
    /// The rank's CPU runner, where the rank is one.
    fn as_cpu(&self) -> Option<&PlanRunner> {
        None
    }
    /// Rank `member` of `plan`, its state from `checkpoint` (sharded).
    fn for_rank(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        member: Member,
    ) -> Result<Self, RuntimeError>;
    fn plan(&self) -> &TrainingPlan;
    /// One step over this rank's micro-batches.
    fn rank_step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<StepReport, RuntimeError>;
    /// The mean loss of `batches`, the state unchanged.
    fn rank_loss(&mut self, batches: &[HashMap<String, Tensor>]) -> Result<f64, RuntimeError>;
    /// The group's state in the single-rank layout: sharded entries gathered, rank order.
    fn gathered(
        ranks: &mut [Self],
        members: &[Member],
    ) -> Result<Vec<(String, Tensor)>, RuntimeError>;
    /// Replaces state entries given in the single-rank layout: rank `rank` keeps its shards.
    fn restore_whole(
        &mut self,
        entries: Vec<(String, Tensor)>,
        rank: usize,
    ) -> Result<(), RuntimeError>;
}

/// A data-parallel plan's ranks in this process, one thread each, their collectives through
/// one [`RankGroup`].
pub struct Ranks<R: RankRunner> {
    runners: Vec<R>,
    members: Vec<Member>,
}

/// The CPU executor's ranks (`--world-size N --device cpu`).
pub type RankRunners = Ranks<PlanRunner>;

/// A data-parallel plan's ranks as the CUDA programs a GPU group would run, each executed by
/// the host emulator, their collectives computed as CPU ranks compute them (`--world-size N
/// --device emulate`): the check of a data-parallel program before a GPU group runs it.
pub type EmulatedRanks = Ranks<crate::cuda::EmulatedPlanRunner>;

impl<R: RankRunner> Ranks<R> {
    /// Every rank of `plan` (its `settings.parallel.world_size` of them), state initialized
    /// from `checkpoint` and sharded.
    pub fn new(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
    ) -> Result<Ranks<R>, RuntimeError> {
        let world = plan.settings.parallel.world_size.max(1);
        let members = RankGroup::members(world);
        let runners = members
            .iter()
            .map(|m| R::for_rank(plan.clone(), checkpoint, m.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Ranks { runners, members })
    }

    pub fn world(&self) -> usize {
        self.runners.len()
    }

    pub fn plan(&self) -> &TrainingPlan {
        self.runners[0].plan()
    }

    /// Rank `rank`'s runner (its own shards).
    pub fn rank(&self, rank: usize) -> Option<&R> {
        self.runners.get(rank)
    }

    /// Runs `f` on every rank at once (see [`on_every_rank`]).
    fn on_every_rank<T: Send>(
        &mut self,
        f: impl Fn(usize, &mut R) -> Result<T, RuntimeError> + Sync,
    ) -> Result<Vec<T>, RuntimeError> {
        on_every_rank(&mut self.runners, &self.members, f)
    }

    /// `f` on every rank's runner at once (a computation whose collectives need every rank);
    /// rank 0's result.
    pub fn on_rank_zero_with_all<T: Send>(
        &mut self,
        f: impl Fn(&R) -> Result<T, RuntimeError> + Sync,
    ) -> Result<T, RuntimeError> {
        let mut all = self.on_every_rank(|_, runner| f(runner))?;
        if all.is_empty() {
            return Err(RuntimeError::Plan("a group of no ranks".into()));
        }
        Ok(all.swap_remove(0))
    }

    /// One training step over `grad_accum x world` micro-batches. The loss is the mean of
    /// the ranks' (each rank's mean over its micro-batches); the gradient norm, the loss
    /// scale and the skip are the same on every rank.
    pub fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<StepReport, RuntimeError> {
        let world = self.world();
        let accum = self.plan().settings.grad_accum;
        rank_share(micro_batches, accum, 0, world)?;
        let reports = self.on_every_rank(|rank, runner| {
            runner.rank_step(rank_share(micro_batches, accum, rank, world)?, lr)
        })?;
        let mut report = reports[0];
        report.loss = mean_loss(reports.iter().map(|r| r.loss), world);
        Ok(report)
    }

    /// The mean loss of `batches` on every rank (each rank runs them all; the micro step's
    /// collectives need every rank), none updating its state.
    pub fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        let losses = self.on_every_rank(|_, runner| runner.rank_loss(batches))?;
        Ok(losses[0])
    }

    /// The whole state in the single-rank layout: sharded entries gathered, rank order.
    pub fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        R::gathered(&mut self.runners, &self.members)
    }

    /// Replaces state entries given in the single-rank layout (a checkpoint): each rank
    /// keeps its shard of a sharded entry.
    pub fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        self.on_every_rank(|rank, runner| runner.restore_whole(entries.clone(), rank))?;
        Ok(())
    }
}

/// A group in this process trains as one executor: each step's report is read at once.
impl<R: RankRunner> PlanExecutor for Ranks<R> {
    fn plan(&self) -> &TrainingPlan {
        Ranks::plan(self)
    }
    fn kind(&self) -> ExecutorKind {
        R::KIND
    }
    fn device(&self) -> String {
        format!("{} ({})", R::KIND, R::describe_group(self.world()))
    }
    fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
        _report: bool,
    ) -> Result<Option<StepReport>, RuntimeError> {
        Ranks::step(self, micro_batches, lr).map(Some)
    }
    fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        Ranks::validation_loss(self, batches)
    }
    fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        Ranks::state_entries(self)
    }
    fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        Ranks::restore(self, entries)
    }
    fn on_cpu_state(&mut self, f: &CpuStateFn) -> Option<Result<Vec<f64>, RuntimeError>> {
        self.runners.first()?.as_cpu()?;
        Some(self.on_rank_zero_with_all(|rank| {
            rank.as_cpu()
                .ok_or_else(|| {
                    RuntimeError::Plan("a rank of a CPU group is not a CPU runner".into())
                })
                .and_then(f)
        }))
    }
}

impl RankRunner for PlanRunner {
    const KIND: ExecutorKind = ExecutorKind::Cpu;
    fn describe_group(world: usize) -> String {
        format!("{world} ranks")
    }
    fn as_cpu(&self) -> Option<&PlanRunner> {
        Some(self)
    }
    fn for_rank(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        member: Member,
    ) -> Result<Self, RuntimeError> {
        PlanRunner::for_rank(plan, checkpoint, member)
    }
    fn plan(&self) -> &TrainingPlan {
        PlanRunner::plan(self)
    }
    fn rank_step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<StepReport, RuntimeError> {
        self.step(micro_batches, lr)
    }
    fn rank_loss(&mut self, batches: &[HashMap<String, Tensor>]) -> Result<f64, RuntimeError> {
        self.micro_step_loss(batches)
    }
    /// The ranks' state is in this process: each sharded entry joined from their shards.
    fn gathered(
        ranks: &mut [Self],
        _members: &[Member],
    ) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        let Some(first) = ranks.first() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for spec in &first.plan().state {
            let Some(mine) = first.state(&spec.name) else {
                continue;
            };
            let t = match &spec.shard_of {
                None => mine.clone(),
                Some(whole) => joined(
                    whole,
                    ranks
                        .iter()
                        .map(|r| r.state(&spec.name).and_then(|t| t.as_f32()).unwrap_or(&[])),
                ),
            };
            out.push((spec.name.clone(), t));
        }
        Ok(out)
    }
    fn restore_whole(
        &mut self,
        entries: Vec<(String, Tensor)>,
        rank: usize,
    ) -> Result<(), RuntimeError> {
        let mine = crate::plan::rank_entries(self.plan(), entries, rank)?;
        self.restore(mine)
    }
}

impl RankRunner for crate::cuda::EmulatedPlanRunner {
    const KIND: ExecutorKind = ExecutorKind::Emulate;
    fn describe_group(world: usize) -> String {
        format!("the host emulator, {world} ranks")
    }
    fn for_rank(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        member: Member,
    ) -> Result<Self, RuntimeError> {
        crate::cuda::EmulatedPlanRunner::emulated_rank(plan, checkpoint, member)
    }
    fn plan(&self) -> &TrainingPlan {
        crate::cuda::EmulatedPlanRunner::plan(self)
    }
    fn rank_step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<StepReport, RuntimeError> {
        self.step(micro_batches, lr)
    }
    fn rank_loss(&mut self, batches: &[HashMap<String, Tensor>]) -> Result<f64, RuntimeError> {
        self.validation_loss(batches)
    }
    /// Each rank's program gathers its sharded entries with the others' (collectives).
    fn gathered(
        ranks: &mut [Self],
        members: &[Member],
    ) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        let mut all = on_every_rank(ranks, members, |_, r| r.state_entries())?;
        if all.is_empty() {
            return Ok(Vec::new());
        }
        Ok(all.swap_remove(0))
    }
    /// The program shards what it is given itself.
    fn restore_whole(
        &mut self,
        entries: Vec<(String, Tensor)>,
        _rank: usize,
    ) -> Result<(), RuntimeError> {
        self.restore(entries)
    }
}

/// The whole value of type `whole` from its ranks' flat shards, in rank order.
fn joined<'a>(whole: &TensorType, shards: impl Iterator<Item = &'a [f32]>) -> Tensor {
    let n = whole.shape.numel().unwrap_or(0);
    let values: Vec<f32> = shards.flatten().copied().take(n).collect();
    Tensor::from_f32(whole.dtype, whole.shape.clone(), values)
}

/// This process's rank of a data-parallel plan that a launcher started one process per rank
/// of, on the CPU: its collectives, the logged loss and the gathered state go through the
/// group's connections ([`Rendezvous`]). Every rank must make the same calls in the same
/// order.
pub struct LaunchedCpuRank {
    runner: PlanRunner,
    member: Member,
}

impl LaunchedCpuRank {
    /// This rank of `plan`, its state from `checkpoint` (sharded), in the joined `group`.
    pub fn new(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        group: Rendezvous,
    ) -> Result<LaunchedCpuRank, RuntimeError> {
        let member = Member::of_launched_group(Arc::new(Mutex::new(group)))?;
        let runner = PlanRunner::for_rank(plan, checkpoint, member.clone())?;
        Ok(LaunchedCpuRank { runner, member })
    }

    pub fn rank(&self) -> usize {
        self.member.rank()
    }

    pub fn world(&self) -> usize {
        self.member.world()
    }

    /// One step over the global batch's `grad_accum x world` micro-batches (this rank runs
    /// the r-th run of `grad_accum`); the loss is the mean of the ranks', as
    /// [`Ranks::step`] reports it.
    pub fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<StepReport, RuntimeError> {
        let (rank, world) = (self.rank(), self.world());
        let accum = self.runner.plan().settings.grad_accum;
        let mut report = self
            .runner
            .step(rank_share(micro_batches, accum, rank, world)?, lr)?;
        let losses = self.member.exchange(vec![report.loss])?;
        report.loss = mean_loss(
            losses.iter().map(|l| l.first().copied().unwrap_or(0.0)),
            world,
        );
        Ok(report)
    }

    /// The mean loss of `batches` (every rank runs them all), none updating its state.
    pub fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        self.runner.micro_step_loss(batches)
    }

    /// Every rank's `values`, in rank order (every rank calls it together).
    pub fn exchange(&self, values: Vec<f32>) -> Result<Vec<Vec<f32>>, RuntimeError> {
        self.member.exchange(values)
    }

    /// This rank's runner (its shards), for computations every rank runs together.
    pub fn runner(&self) -> &PlanRunner {
        &self.runner
    }

    /// The whole state in the single-rank layout, on every rank (sharded entries gathered).
    pub fn state_entries(&self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        let mut out = Vec::new();
        for spec in &self.runner.plan().state {
            let Some(mine) = self.runner.state(&spec.name) else {
                continue;
            };
            let t = match &spec.shard_of {
                None => mine.clone(),
                Some(whole) => {
                    let shards = self
                        .member
                        .exchange(mine.as_f32().map(<[f32]>::to_vec).unwrap_or_default())?;
                    joined(whole, shards.iter().map(Vec::as_slice))
                }
            };
            out.push((spec.name.clone(), t));
        }
        Ok(out)
    }

    /// Replaces state entries given in the single-rank layout (a checkpoint): this rank
    /// keeps its shard of each sharded one.
    pub fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        let mine = crate::plan::rank_entries(self.runner.plan(), entries, self.rank())?;
        self.runner.restore(mine)
    }
}

/// Runs `f` on every rank's runner at once, one thread each; the first error (in rank order)
/// wins, and a failing rank breaks the group so no other waits for it.
fn on_every_rank<R: Send, T: Send>(
    runners: &mut [R],
    members: &[Member],
    f: impl Fn(usize, &mut R) -> Result<T, RuntimeError> + Sync,
) -> Result<Vec<T>, RuntimeError> {
    let results: Vec<Result<T, RuntimeError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = runners
            .iter_mut()
            .enumerate()
            .map(|(rank, runner)| {
                let f = &f;
                scope.spawn(move || {
                    let r = f(rank, runner);
                    if r.is_err() {
                        members[rank].abort();
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(RuntimeError::Plan("a rank's thread panicked".into())))
            })
            .collect()
    });
    // The rank that failed first is the one to report, not those it stopped.
    let failed = results.iter().position(
        |r| matches!(r, Err(e) if !matches!(e, RuntimeError::Plan(m) if m == PEER_FAILED)),
    );
    let mut out = Vec::with_capacity(results.len());
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => out.push(v),
            Err(e) if failed.is_none_or(|f| f == i) => return Err(e),
            Err(_) => {}
        }
    }
    Ok(out)
}

/// Rank `rank`'s micro-batches of a step over `grad_accum x world` of them: the r-th run of
/// `grad_accum`. A step that holds another number is an error.
pub fn rank_share(
    micro_batches: &[HashMap<String, Tensor>],
    accum: usize,
    rank: usize,
    world: usize,
) -> Result<&[HashMap<String, Tensor>], RuntimeError> {
    if micro_batches.len() != accum * world || rank >= world {
        return Err(RuntimeError::Plan(format!(
            "a step of {world} ranks takes {} micro-batches ({accum} per rank), given {}",
            accum * world,
            micro_batches.len()
        )));
    }
    Ok(&micro_batches[rank * accum..(rank + 1) * accum])
}

/// The step's loss: the mean of the ranks' losses, summed in F64 in rank order.
pub fn mean_loss(losses: impl Iterator<Item = f32>, world: usize) -> f32 {
    (losses.map(f64::from).sum::<f64>() / world.max(1) as f64) as f32
}
