//! Training plans and single graphs on a lowered program's [`Target`]: the GPU, or the host
//! emulator that runs the same program.
//!
//! [`LoweredPlanRunner`] keeps a plan's whole state on the target: masters, working copies,
//! gradients, moments, the step count and the loss scale never leave it during training. A
//! step uploads the micro-batches (asynchronously, through pinned staging on the GPU), replays
//! the captured runs, and records each micro-step's loss into a device log; nothing is read
//! back until [`LoweredPlanRunner::report`] (the logging cadence), so steps queue on the
//! device without host synchronization. [`LoweredGraphRunner`] runs one graph (a forward
//! pass, a gradient graph, a single op in the GPU tests). [`CudaPlanRunner`] and
//! [`EmulatedPlanRunner`] (and the graph runners) name the two targets.

use super::device::CudaError;
use super::emulate::Emulator;
use super::lower::{self, LowerError, MICRO_STEP, OPTIMIZER_STEP, ZERO_GRADS};
use super::nccl::NcclRank;
use super::profile::{CommandTime, KernelProfile};
use super::program::{Command, ErrorFlag, FlagKind, Place, Program, SlotKind};
use super::target::{Gpu, Target};
use crate::{DeviceTime, RuntimeError, StepReport};
use castor_ir::{
    ControlState, DType, Graph, LossScaling, StateRole, Tensor, TensorData, TensorType,
    TrainingPlan, GRAD_NORM, LEARNING_RATE,
};
use std::collections::HashMap;

impl From<LowerError> for RuntimeError {
    fn from(e: LowerError) -> Self {
        RuntimeError::Cuda(format!("cannot run on CUDA: {e}"))
    }
}

impl From<CudaError> for RuntimeError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::OutOfMemory { .. } => RuntimeError::OutOfMemory(e.to_string()),
            CudaError::NoCuda(_)
            | CudaError::NoCublas
            | CudaError::NoNccl(_)
            | CudaError::NoCudnn(_)
            | CudaError::Nvrtc(_) => RuntimeError::DeviceUnavailable(e.to_string()),
            other => RuntimeError::Cuda(other.to_string()),
        }
    }
}

/// The device log of micro-step losses (one F32 per micro-batch of the last step).
const LOSS_LOG: &str = "report.losses";
/// The loss scale the last step's backward used.
const USED_SCALE: &str = "report.loss_scale";

/// A training plan with its state on a CUDA device.
pub type CudaPlanRunner = LoweredPlanRunner<Gpu>;
/// A training plan's CUDA program run by the host emulator (`--device emulate`).
pub type EmulatedPlanRunner = LoweredPlanRunner<Emulator>;
/// One graph on a CUDA device.
pub type CudaGraphRunner = LoweredGraphRunner<Gpu>;
/// One graph's CUDA program run by the host emulator.
pub type EmulatedGraphRunner = LoweredGraphRunner<Emulator>;

/// A training plan with its state on a target.
pub struct LoweredPlanRunner<T: Target> {
    plan: TrainingPlan,
    program: Program,
    target: T,
    zero_grads: Option<usize>,
    micro: usize,
    optimizer: usize,
    steps_queued: u64,
    /// Time each step's runs on the device (see [`Self::set_timing`]).
    timing: bool,
    /// The kernel profile of the step being queued, when one was asked for
    /// ([`Self::profile_next_step`]), and of the last profiled step.
    profiling: Option<KernelProfile>,
    profiled: Option<KernelProfile>,
    /// This rank's place in a data-parallel plan (0 for a single rank).
    rank: usize,
}

impl LoweredPlanRunner<Gpu> {
    /// One rank of a data-parallel `plan` (`castor_ir::Parallel`) on its GPU (`rank`'s local
    /// rank), its collectives run by NCCL in the group `rank.id` names. Every rank of the
    /// group must call it at about the same time: joining the group waits for all of them.
    pub fn for_rank(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        rank: &NcclRank,
    ) -> Result<Self, RuntimeError> {
        plan.check()?;
        let world = plan.settings.parallel.world_size;
        if world != rank.world {
            return Err(RuntimeError::Plan(format!(
                "the plan is one rank's of {world}, the launched group has {}",
                rank.world
            )));
        }
        let program = lower::lower_plan(&plan)?;
        Self::assemble(plan, program, checkpoint, rank.rank, |p| {
            Gpu::load_rank(p, rank)
        })
    }
}

impl LoweredPlanRunner<Emulator> {
    /// One rank of a data-parallel `plan` as the emulator runs its CUDA program, its
    /// collectives computed with the other members of `member`'s group (see
    /// `crate::ranks::EmulatedRanks`).
    pub fn emulated_rank(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        member: crate::cpu::collective::Member,
    ) -> Result<Self, RuntimeError> {
        plan.check()?;
        let world = plan.settings.parallel.world_size;
        if world != member.world() {
            return Err(RuntimeError::Plan(format!(
                "the plan is one rank's of {world}, the group has {}",
                member.world()
            )));
        }
        let program = lower::lower_plan(&plan)?;
        let rank = member.rank();
        Self::assemble(plan, program, checkpoint, rank, |p| {
            let mut emulator = Emulator::load(p)?;
            emulator.join_group(member);
            Ok(emulator)
        })
    }
}

/// The timing marks of a step: before the micro steps, after them, after the optimizer step.
const MARK_START: usize = 0;
const MARK_MICRO: usize = 1;
const MARK_OPTIMIZER: usize = 2;

impl<T: Target> LoweredPlanRunner<T> {
    /// Lowers `plan`, checks that it fits in free device memory, compiles its kernels (PTX
    /// cache), uploads the state (masters from `checkpoint`, the rest as the plan says) and
    /// derives the working copies on the device.
    pub fn new(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
    ) -> Result<Self, RuntimeError> {
        plan.check()?;
        if !plan.settings.parallel.is_single() {
            return Err(RuntimeError::DeviceUnavailable(format!(
                "a plan of {} data-parallel ranks runs as one process per GPU: launch it \
                 with `torchrun --nproc-per-node {} --no-python -- castor train ...` (NCCL), or \
                 run its ranks on the CPU (--device cpu)",
                plan.settings.parallel.world_size, plan.settings.parallel.world_size
            )));
        }
        let program = lower::lower_plan(&plan)?;
        Self::with_program(plan, program, checkpoint)
    }

    /// As [`Self::new`], with `program` already lowered from `plan` (tests run programs
    /// they have altered on purpose).
    pub fn with_program(
        plan: TrainingPlan,
        program: Program,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
    ) -> Result<Self, RuntimeError> {
        Self::assemble(plan, program, checkpoint, 0, T::load)
    }

    /// Loads `program` (lowered from `plan`) with `load`, and uploads rank `rank`'s initial
    /// state.
    fn assemble(
        plan: TrainingPlan,
        mut program: Program,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        rank: usize,
        load: impl FnOnce(&Program) -> Result<T, RuntimeError>,
    ) -> Result<Self, RuntimeError> {
        let accum = plan.settings.grad_accum.max(1) as u64;
        program.slots.push(super::program::Slot {
            name: LOSS_LOG.into(),
            bytes: 4 * accum,
            kind: SlotKind::Internal,
        });
        program.slots.push(super::program::Slot {
            name: USED_SCALE.into(),
            bytes: 4,
            kind: SlotKind::Internal,
        });
        let target = load(&program)?;
        let run = |name: &str| {
            program
                .run(name)
                .ok_or_else(|| RuntimeError::Cuda(format!("the lowered plan has no `{name}` run")))
        };
        let mut runner = LoweredPlanRunner {
            zero_grads: program.run(ZERO_GRADS),
            micro: run(MICRO_STEP)?,
            optimizer: run(OPTIMIZER_STEP)?,
            plan,
            program,
            target,
            steps_queued: 0,
            timing: false,
            profiling: None,
            profiled: None,
            rank,
        };
        let state = crate::plan::initial_entries(&runner.plan, checkpoint, rank)?;
        runner.upload(state)?;
        Ok(runner)
    }

    pub fn plan(&self) -> &TrainingPlan {
        &self.plan
    }

    /// What runs its cuDNN attention passes, when it has any ([`Target::attention`]).
    pub fn attention(&self) -> Option<String> {
        self.target.attention()
    }

    /// The machine it runs on, for people, with what runs its cuDNN attention passes.
    pub fn device_name(&self) -> String {
        match self.target.attention() {
            Some(attention) => format!("{}; attention: {attention}", self.target.describe()),
            None => self.target.describe(),
        }
    }

    /// Device memory the plan's program holds (arena, state, inputs, tables, workspace).
    pub fn allocated_bytes(&self) -> u64 {
        self.target.allocated_bytes()
    }

    /// Times every step's runs on the device (events around the micro steps and the
    /// optimizer step; on the GPU only), reported in [`StepReport::device_time`].
    pub fn set_timing(&mut self, on: bool) {
        self.timing = on;
    }

    /// Issues the next step command by command with each command's device time recorded
    /// (GPU only: the emulator has no device clock), for [`Self::take_kernel_profile`]. That
    /// step waits for the device; its results are those of any other step.
    pub fn profile_next_step(&mut self) {
        self.profiling = Some(KernelProfile::default());
    }

    /// The last profiled step's commands and their device times, if a step was profiled.
    pub fn take_kernel_profile(&mut self) -> Option<KernelProfile> {
        self.profiled.take()
    }

    /// Issues run `run`: timed command by command while a step is profiled.
    fn issue_run(&mut self, run: usize) -> Result<(), RuntimeError> {
        if self.profiling.is_none() {
            return self.target.run(run);
        }
        match self.target.run_timed(run)? {
            Some(times) => {
                let r = &self.program.runs[run];
                if let Some(p) = self.profiling.as_mut() {
                    let target = &self.target;
                    p.commands
                        .extend(r.commands.iter().zip(times).enumerate().map(
                        |(i, (c, ms))| {
                            let on_cudnn =
                                matches!(c, Command::Sdpa(call) if target.runs_on_cudnn(call));
                            CommandTime::of(&r.name, i, c, on_cudnn, ms)
                        },
                    ));
                }
            }
            // No device clock: nothing to profile.
            None => self.profiling = None,
        }
        Ok(())
    }

    /// The lowered program (for `--emit`-style inspection and the tests).
    pub fn program(&self) -> &Program {
        &self.program
    }

    fn upload(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        for (slot, bytes) in state_bytes(&self.program, entries)? {
            self.target.write_slot(slot, &bytes)?;
        }
        self.target.run_prologue()
    }

    /// Replaces state entries (resuming), then re-derives the working copies. Entries come
    /// in the single-rank layout (a checkpoint): a rank of a data-parallel plan keeps its
    /// shard of each sharded one, and the copies a runner holds (FP8 copies; a rank's copies
    /// of sharded masters) are derived again from their masters.
    pub fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        let mine = crate::plan::rank_entries(&self.plan, entries, self.rank)?;
        self.upload(mine)
    }

    /// The persistent state, read back from the device, in the plan's order (working copies
    /// the micro step derives from their masters are left out, as on the CPU; held copies,
    /// which the optimizer step writes, are read). A rank of a data-parallel
    /// plan gathers each sharded entry from every rank (all ranks must call it together), so
    /// the result is the single-rank layout.
    pub fn state_entries(&self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        let mut out = Vec::new();
        for spec in &self.plan.state {
            if spec.role == StateRole::WorkingCopy && !crate::plan::holds_copy(&self.plan, spec) {
                continue;
            }
            let t = match &spec.shard_of {
                None => self.read_state(&spec.name, &spec.ty)?,
                Some(whole) => {
                    let bytes = whole.size_bytes().unwrap_or(0) as u64;
                    let gathered =
                        self.target
                            .gather_slot(self.slot(&spec.name)?, whole.dtype, bytes)?;
                    from_bytes(whole, &gathered)?
                }
            };
            out.push((spec.name.clone(), t));
        }
        Ok(out)
    }

    fn read_state(&self, name: &str, ty: &TensorType) -> Result<Tensor, RuntimeError> {
        let slot = self
            .program
            .slot(name)
            .ok_or_else(|| RuntimeError::Cuda(format!("no device slot for `{name}`")))?;
        let bytes = self.target.read_slot(slot)?;
        from_bytes(ty, &bytes)
    }

    fn scalar(&self, name: &str) -> Result<f32, RuntimeError> {
        let b = self.target.read_slot(self.slot(name)?)?;
        Ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Queues one training step: the micro-batches' inputs are copied in, the runs replayed.
    /// Nothing is read back; call [`Self::report`] to see what the step did.
    pub fn queue_step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<(), RuntimeError> {
        let accum = self.plan.settings.grad_accum;
        if micro_batches.len() != accum {
            return Err(RuntimeError::Internal {
                node: "micro_step".into(),
                message: format!(
                    "a step takes {accum} micro-batches, given {}",
                    micro_batches.len()
                ),
            });
        }
        let log = self.slot_place(LOSS_LOG)?;
        if let (Some(scale), Ok(used)) = (
            self.program.slot(ControlState::LossScale.name()),
            self.slot_place(USED_SCALE),
        ) {
            self.target.copy(
                used,
                Place::Slot {
                    slot: scale,
                    offset: 0,
                },
                4,
            )?;
        }
        if self.timing {
            self.target.mark(MARK_START)?;
        }
        if let Some(z) = self.zero_grads {
            self.issue_run(z)?;
        }
        let loss_place = self.program.runs[self.micro]
            .outputs
            .first()
            .map(|o| o.place)
            .ok_or_else(|| RuntimeError::Cuda("the micro step has no loss output".into()))?;
        let lr_tensor = Tensor::from_f32(DType::F32, castor_ir::Shape::scalar(), vec![lr]);
        // A micro step that applies the updates itself (`--update-in-backward`) reads the
        // learning rate too.
        let micro_reads_lr = self.plan.micro_step.lookup(LEARNING_RATE).is_some();
        for (i, batch) in micro_batches.iter().enumerate() {
            if micro_reads_lr {
                let mut with_lr = batch.clone();
                with_lr.insert(LEARNING_RATE.to_string(), lr_tensor.clone());
                self.write_inputs(self.micro, &with_lr)?;
            } else {
                self.write_inputs(self.micro, batch)?;
            }
            self.issue_run(self.micro)?;
            self.target.copy(log.plus(4 * i as u64), loss_place, 4)?;
        }
        let mut inputs = HashMap::new();
        inputs.insert(LEARNING_RATE.to_string(), lr_tensor);
        if self.timing {
            self.target.mark(MARK_MICRO)?;
        }
        self.write_inputs(self.optimizer, &inputs)?;
        self.issue_run(self.optimizer)?;
        if self.timing {
            self.target.mark(MARK_OPTIMIZER)?;
        }
        if let Some(p) = self.profiling.take() {
            self.profiled = Some(p);
        }
        self.steps_queued += 1;
        Ok(())
    }

    /// What the last queued step did: waits for the device, reads the loss log, the scale and
    /// the gradient norm, and checks the kernels' error flags (an out-of-range token id or
    /// label since the last report).
    pub fn report(&self) -> Result<StepReport, RuntimeError> {
        self.target.synchronize()?;
        for run in &self.program.runs {
            for f in &run.error_flags {
                self.check_flag(f)?;
            }
        }
        let accum = self.plan.settings.grad_accum.max(1);
        let log = self.target.read_slot(self.slot(LOSS_LOG)?)?;
        let losses: Vec<f32> = log
            .chunks_exact(4)
            .take(accum)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let loss = losses.iter().map(|&x| f64::from(x)).sum::<f64>() / accum as f64;
        let grad_norm = self.output_scalar(self.optimizer, GRAD_NORM)?;
        let loss_scale = match self.plan.settings.loss_scaling {
            LossScaling::None => 1.0,
            _ => self.scalar(USED_SCALE)?,
        };
        let device_time = if self.timing {
            match (
                self.target.elapsed_ms(MARK_START, MARK_MICRO)?,
                self.target.elapsed_ms(MARK_MICRO, MARK_OPTIMIZER)?,
            ) {
                (Some(micro_steps_ms), Some(optimizer_step_ms)) => Some(DeviceTime {
                    micro_steps_ms,
                    optimizer_step_ms,
                }),
                _ => None,
            }
        } else {
            None
        };
        Ok(StepReport {
            loss: loss as f32,
            loss_scale,
            next_loss_scale: self.scalar(ControlState::LossScale.name())?,
            skipped: !grad_norm.is_finite(),
            grad_norm,
            device_time,
        })
    }

    /// One step, then its report (a host synchronization per step).
    pub fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<StepReport, RuntimeError> {
        self.queue_step(micro_batches, lr)?;
        self.report()
    }

    /// The mean loss of the micro step on `batches`, with the current weights, on the
    /// device. The micro step also writes gradients, which is harmless between steps: the
    /// next step overwrites them (or zeroes them first when it accumulates).
    pub fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        let loss = self.program.runs[self.micro]
            .outputs
            .first()
            .map(|o| o.place)
            .ok_or_else(|| RuntimeError::Cuda("the micro step has no loss output".into()))?;
        let mut sum = 0.0;
        for batch in batches {
            self.write_inputs(self.micro, batch)?;
            self.target.run(self.micro)?;
            let b = self.target.read(loss, 4)?;
            sum += f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        }
        for f in &self.program.runs[self.micro].error_flags {
            self.check_flag(f)?;
        }
        Ok(sum / batches.len().max(1) as f64)
    }

    /// Optimizer steps taken (skipped steps do not count).
    pub fn steps_taken(&self) -> Result<f32, RuntimeError> {
        self.scalar(ControlState::Step.name())
    }

    /// The minimum loss scale of a dynamic plan.
    pub fn min_loss_scale(&self) -> Option<f64> {
        match self.plan.settings.loss_scaling {
            LossScaling::Dynamic { min_scale, .. } => Some(min_scale),
            _ => None,
        }
    }

    fn slot(&self, name: &str) -> Result<usize, RuntimeError> {
        self.program
            .slot(name)
            .ok_or_else(|| RuntimeError::Cuda(format!("no device slot `{name}`")))
    }

    fn slot_place(&self, name: &str) -> Result<Place, RuntimeError> {
        Ok(Place::Slot {
            slot: self.slot(name)?,
            offset: 0,
        })
    }

    fn output_scalar(&self, run: usize, name: &str) -> Result<f32, RuntimeError> {
        let o = self.program.runs[run]
            .outputs
            .iter()
            .find(|o| o.name == name)
            .ok_or_else(|| {
                RuntimeError::Cuda(format!("the optimizer step has no `{name}` output"))
            })?;
        let b = self.target.read(o.place, 4)?;
        Ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn write_inputs(
        &mut self,
        run: usize,
        batch: &HashMap<String, Tensor>,
    ) -> Result<(), RuntimeError> {
        write_inputs(&self.program, &mut self.target, run, batch)
    }

    fn check_flag(&self, f: &ErrorFlag) -> Result<(), RuntimeError> {
        check_flag(&self.target, f)
    }
}

impl<T: Target> crate::PlanExecutor for LoweredPlanRunner<T> {
    fn plan(&self) -> &TrainingPlan {
        &self.plan
    }
    fn kind(&self) -> crate::ExecutorKind {
        T::KIND
    }
    fn device(&self) -> String {
        format!("{} ({})", T::KIND, self.device_name())
    }
    fn attention(&self) -> Option<String> {
        LoweredPlanRunner::attention(self)
    }
    fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
        report: bool,
    ) -> Result<Option<StepReport>, RuntimeError> {
        self.queue_step(micro_batches, lr)?;
        report.then(|| self.report()).transpose()
    }
    fn validation_loss(
        &mut self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        LoweredPlanRunner::validation_loss(self, batches)
    }
    fn state_entries(&mut self) -> Result<Vec<(String, Tensor)>, RuntimeError> {
        LoweredPlanRunner::state_entries(self)
    }
    fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        LoweredPlanRunner::restore(self, entries)
    }
    fn allocated_bytes(&self) -> Option<u64> {
        Some(LoweredPlanRunner::allocated_bytes(self))
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

/// Uploads the tensors a run's input slots name into them.
fn write_inputs<T: Target>(
    program: &Program,
    target: &mut T,
    run: usize,
    batch: &HashMap<String, Tensor>,
) -> Result<(), RuntimeError> {
    for (slot, bytes) in input_bytes(program, run, batch)? {
        target.write_input(slot, &bytes)?;
    }
    Ok(())
}

/// State `entries` as (slot, bytes) to write, each checked against its slot's type.
pub fn state_bytes(
    program: &Program,
    entries: Vec<(String, Tensor)>,
) -> Result<Vec<(usize, Vec<u8>)>, RuntimeError> {
    let mut out = Vec::with_capacity(entries.len());
    for (name, t) in entries {
        let slot = program.slot(&name).ok_or_else(|| RuntimeError::Internal {
            node: name.clone(),
            message: "state that the plan does not have".into(),
        })?;
        if let SlotKind::Bound(ty) = &program.slots[slot].kind {
            if ty != t.ty() {
                return Err(RuntimeError::BindingMismatch {
                    name,
                    expected: ty.clone(),
                    found: t.ty().clone(),
                });
            }
        }
        out.push((slot, to_bytes(&t)));
    }
    Ok(out)
}

/// The (slot, bytes) of every input slot run `run` reads, from `batch`: an int tensor is
/// converted to its slot's int dtype, token ids and labels are checked.
pub fn input_bytes(
    program: &Program,
    run: usize,
    batch: &HashMap<String, Tensor>,
) -> Result<Vec<(usize, Vec<u8>)>, RuntimeError> {
    let mut out = Vec::new();
    for (slot, s) in program.slots.iter().enumerate() {
        let SlotKind::Input(ty) = &s.kind else {
            continue;
        };
        if !run_reads_slot(program, run, slot) {
            continue;
        }
        let t = batch
            .get(&s.name)
            .ok_or_else(|| RuntimeError::MissingBinding {
                name: s.name.clone(),
                expected: ty.clone(),
            })?;
        if t.ty() != ty && !(t.shape() == &ty.shape && t.dtype().is_int() && ty.dtype.is_int()) {
            return Err(RuntimeError::BindingMismatch {
                name: s.name.clone(),
                expected: ty.clone(),
                found: t.ty().clone(),
            });
        }
        let t = if t.dtype() != ty.dtype {
            Tensor::from_i64(
                ty.dtype,
                ty.shape.clone(),
                t.as_i64().unwrap_or(&[]).to_vec(),
            )
        } else {
            t.clone()
        };
        check_indices(program, run, slot, &t)?;
        out.push((slot, to_bytes(&t)));
    }
    Ok(out)
}

/// Token ids and labels are checked on the host before they are uploaded, against the range
/// each kernel that reads them needs, so a bad batch is an exact error before anything runs
/// (the kernels' own flags stay as a backstop).
fn check_indices(
    program: &Program,
    run: usize,
    slot: usize,
    t: &Tensor,
) -> Result<(), RuntimeError> {
    let Some(values) = t.as_i64() else {
        return Ok(());
    };
    for f in &program.runs[run].error_flags {
        if f.kind != FlagKind::Range
            || !matches!(f.indices, Place::Slot { slot: s, offset: 0 } if s == slot)
        {
            continue;
        }
        let bad = values
            .iter()
            .position(|&x| (x < 0 || x as u64 >= f.limit as u64) && Some(x) != f.ignore);
        if let Some(position) = bad {
            return Err(RuntimeError::IndexOutOfRange {
                node: f.node.clone(),
                what: f.what,
                index: values[position],
                position,
                limit: f.limit,
            });
        }
    }
    Ok(())
}

/// True when a run's commands mention `slot`.
fn run_reads_slot(program: &Program, run: usize, slot: usize) -> bool {
    use super::program::{Arg, Command};
    let hit = |p: &Place| matches!(p, Place::Slot { slot: s, .. } if *s == slot);
    fn reads(c: &Command, hit: &dyn Fn(&Place) -> bool) -> bool {
        match c {
            Command::Launch(l) => l.args.iter().any(|a| matches!(a, Arg::Ptr(p) if hit(p))),
            Command::Gemm(g) => {
                hit(&g.a)
                    || hit(&g.b)
                    || (g.accumulate && hit(&g.c))
                    || g.epilogue
                        .buffers(g.c_dtype)
                        .iter()
                        .any(|(_, p, _, _, written)| !written && hit(p))
                    || g.fp8
                        .iter()
                        .any(|s| s.buffers().iter().any(|(_, p)| hit(p)))
            }
            Command::Copy { src, .. } | Command::Collective { src, .. } => hit(src),
            Command::Memset { .. } | Command::Join { .. } => false,
            Command::Sdpa(call) => {
                call.places().iter().any(|(_, p)| hit(p)) || call.nested().any(|f| reads(f, hit))
            }
        }
    }
    program.runs[run].commands.iter().any(|c| reads(c, &hit))
        || program
            .tables
            .iter()
            .flat_map(|t| t.fields())
            .any(|f| matches!(f, super::program::Field::Ptr(p) if hit(p)))
}

/// An error flag lowered by a kernel: the first bad position, with the index there.
fn check_flag<T: Target>(target: &T, f: &ErrorFlag) -> Result<(), RuntimeError> {
    let b = target.read(f.place, 4)?;
    let pos = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    if pos == i32::MAX || pos < 0 {
        return Ok(());
    }
    if f.kind == FlagKind::RightPadded {
        return Err(mask_not_right_padded(f, pos as usize));
    }
    let idx = target.read(f.indices.plus(8 * pos as u64), 8)?;
    let index = i64::from_le_bytes([
        idx[0], idx[1], idx[2], idx[3], idx[4], idx[5], idx[6], idx[7],
    ]);
    Err(RuntimeError::IndexOutOfRange {
        node: f.node.clone(),
        what: f.what,
        index,
        position: f.first + pos as usize,
        limit: f.limit,
    })
}

/// The error of a [`FlagKind::RightPadded`] flag that reported `position`.
pub(crate) fn mask_not_right_padded(f: &ErrorFlag, position: usize) -> RuntimeError {
    let keys = f.limit.max(1);
    let (row, key) = (position / keys, position % keys);
    let problem = if key == 0 {
        "keeps no key".to_string()
    } else {
        format!("keeps key {key} after dropping an earlier one")
    };
    RuntimeError::MaskNotRightPadded {
        node: f.node.clone(),
        row,
        problem,
    }
}

/// One graph on a target: bound tensors uploaded once, inputs per run.
pub struct LoweredGraphRunner<T: Target> {
    program: Program,
    target: T,
}

impl<T: Target> LoweredGraphRunner<T> {
    /// Lowers `graph` and uploads its params and state (`bindings` by name).
    pub fn new(
        graph: &Graph,
        bindings: &dyn Fn(&str) -> Option<Tensor>,
    ) -> Result<Self, RuntimeError> {
        let program = lower::lower_graph(graph)?;
        let mut target = T::load(&program)?;
        for (slot, s) in program.slots.iter().enumerate() {
            let SlotKind::Bound(ty) = &s.kind else {
                continue;
            };
            // Param copies are derived by the prologue.
            if program.all_commands().count() > 0 && is_prologue_target(&program, slot) {
                continue;
            }
            let t = bindings(&s.name).ok_or_else(|| RuntimeError::MissingBinding {
                name: s.name.clone(),
                expected: ty.clone(),
            })?;
            if t.ty() != ty {
                return Err(RuntimeError::BindingMismatch {
                    name: s.name.clone(),
                    expected: ty.clone(),
                    found: t.ty().clone(),
                });
            }
            target.write_slot(slot, &to_bytes(&t))?;
        }
        target.run_prologue()?;
        Ok(LoweredGraphRunner { program, target })
    }

    /// The machine it runs on, for people, with what runs its cuDNN attention passes.
    pub fn device_name(&self) -> String {
        match self.target.attention() {
            Some(attention) => format!("{}; attention: {attention}", self.target.describe()),
            None => self.target.describe(),
        }
    }

    /// Runs the graph on `inputs` and reads every output back.
    pub fn run(&mut self, inputs: &HashMap<String, Tensor>) -> Result<Vec<Tensor>, RuntimeError> {
        write_inputs(&self.program, &mut self.target, 0, inputs)?;
        self.target.run(0)?;
        self.target.synchronize()?;
        let run = &self.program.runs[0];
        for f in &run.error_flags {
            check_flag(&self.target, f)?;
        }
        run.outputs
            .iter()
            .map(|o| {
                let bytes = o.ty.size_bytes().unwrap_or(0) as u64;
                from_bytes(&o.ty, &self.target.read(o.place, bytes)?)
            })
            .collect()
    }
}

/// True when the prologue writes `slot` (a working copy derived from its master).
fn is_prologue_target(program: &Program, slot: usize) -> bool {
    use super::program::{Arg, Command};
    program.prologue.iter().any(|c| match c {
        Command::Launch(l) => {
            matches!(l.args.get(1), Some(Arg::Ptr(Place::Slot { slot: s, .. })) if *s == slot)
        }
        Command::Copy {
            dst: Place::Slot { slot: s, .. },
            ..
        } => *s == slot,
        _ => false,
    })
}

/// A host tensor as the device stores it.
pub fn to_bytes(t: &Tensor) -> Vec<u8> {
    match (t.data(), t.dtype()) {
        (TensorData::F32(v), DType::F32) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (TensorData::F32(v), DType::F16) => v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
        (TensorData::F32(v), DType::BF16) => v
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
        (TensorData::F32(_), DType::F8E4M3 | DType::F8E5M2) => t.fp8_bytes().unwrap_or_default(),
        (TensorData::I64(v), DType::I32) => {
            v.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect()
        }
        (TensorData::I64(v), _) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (TensorData::Bool(v), _) => v.iter().map(|&b| u8::from(b)).collect(),
        (TensorData::U8(v), _) => v.clone(),
        (TensorData::F32(v), _) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// A device buffer of type `ty` as a host tensor.
pub fn from_bytes(ty: &TensorType, b: &[u8]) -> Result<Tensor, RuntimeError> {
    let want = ty.size_bytes().unwrap_or(0);
    if b.len() != want {
        return Err(RuntimeError::Cuda(format!(
            "read {} bytes for a {ty} ({want} bytes)",
            b.len()
        )));
    }
    let shape = ty.shape.clone();
    Ok(match ty.dtype {
        DType::F32 => Tensor::from_f32(
            DType::F32,
            shape,
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        DType::F16 => Tensor::from_f32(
            DType::F16,
            shape,
            b.chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        ),
        DType::BF16 => Tensor::from_f32(
            DType::BF16,
            shape,
            b.chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        ),
        DType::I64 => Tensor::from_i64(
            DType::I64,
            shape,
            b.chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
        ),
        DType::I32 => Tensor::from_i64(
            DType::I32,
            shape,
            b.chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
        ),
        DType::Bool => Tensor::from_bool(shape, b.iter().map(|&x| x != 0).collect()),
        DType::U8 => Tensor::from_u8(shape, b.to_vec()),
        DType::F8E4M3 | DType::F8E5M2 => Tensor::from_fp8_bytes(ty.dtype, shape, b),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_token_ids_and_labels_are_found_on_the_host() {
        use super::super::program::Run;
        let flag = |what, ignore| ErrorFlag {
            node: "n".into(),
            kind: FlagKind::Range,
            what,
            place: Place::Slot { slot: 1, offset: 0 },
            indices: Place::Slot { slot: 0, offset: 0 },
            limit: 10,
            ignore,
            first: 0,
        };
        let mut program = Program::default();
        program.runs.push(Run {
            error_flags: vec![flag("label", Some(-100))],
            ..Run::default()
        });
        let labels = Tensor::from_i64(DType::I64, vec![3], vec![9, -100, 0]);
        assert!(check_indices(&program, 0, 0, &labels).is_ok());
        let bad = Tensor::from_i64(DType::I64, vec![3], vec![9, -100, 10]);
        let e = check_indices(&program, 0, 0, &bad).unwrap_err();
        assert!(
            matches!(
                e,
                RuntimeError::IndexOutOfRange {
                    index: 10,
                    position: 2,
                    ..
                }
            ),
            "{e}"
        );
        program.runs[0].error_flags = vec![flag("token id", None)];
        assert!(check_indices(&program, 0, 0, &labels).is_err());
        // Another slot's flags do not apply.
        assert!(check_indices(&program, 0, 5, &bad).is_ok());
    }

    #[test]
    fn device_bytes_round_trip_every_dtype() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let t = Tensor::from_f32(dtype, vec![3], vec![1.5, -2.25, 1e-3]);
            assert_eq!(from_bytes(t.ty(), &to_bytes(&t)).unwrap(), t);
        }
        // FP8: one byte each, every byte back as it was (E5M2's infinities included).
        for dtype in [DType::F8E4M3, DType::F8E5M2] {
            let bytes = [0x00, 0x80, 0x01, 0x7B, 0xFB, 0x7C, 0xFC, 0x38];
            let t = Tensor::from_fp8_bytes(dtype, vec![8], &bytes);
            assert_eq!(to_bytes(&t), bytes);
            assert_eq!(from_bytes(t.ty(), &bytes).unwrap(), t);
        }
        for dtype in [DType::I64, DType::I32] {
            let t = Tensor::from_i64(dtype, vec![2], vec![-7, 1 << 20]);
            assert_eq!(from_bytes(t.ty(), &to_bytes(&t)).unwrap(), t);
        }
        let t = Tensor::from_bool(vec![3], vec![true, false, true]);
        assert_eq!(from_bytes(t.ty(), &to_bytes(&t)).unwrap(), t);
        assert!(from_bytes(t.ty(), &[0u8; 2]).is_err());
    }
}
