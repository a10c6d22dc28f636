//! Running a [`TrainingPlan`] on the CPU executor: the plan's persistent state and one step.
//!
//! A step zeroes the gradients when they accumulate, runs the micro step once per
//! micro-batch, then the optimizer step, storing each graph's writes into the state. On the
//! CPU a parameter's working copy is re-derived by the micro step's `param_copy` node (the
//! master rounded to the copy's dtype, bit-identical to what the optimizer writes), so the
//! working-copy buffers are not kept here; a device executor keeps them.

use crate::cpu::CpuExecutor;
use crate::RuntimeError;
use castor_ir::{
    ControlState, DType, LossScaling, StateInit, StateRole, Tensor, TensorType, TrainingPlan,
    GRAD_NORM, LEARNING_RATE,
};
use std::collections::HashMap;

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Mean loss over the step's micro-batches (unscaled).
    pub loss: f32,
    /// The loss scale the step's backward used.
    pub loss_scale: f32,
    /// The loss scale for the next step.
    pub next_loss_scale: f32,
    /// True when a gradient was inf or NaN: masters and moments are unchanged.
    pub skipped: bool,
    /// Global L2 norm of the unscaled gradients (before clipping).
    pub grad_norm: f32,
    /// Device time of the step's runs, when it was measured (`--profile` on a GPU).
    pub device_time: Option<DeviceTime>,
}

/// A loss scale as text, exactly: `1073741824`, `0.5`, `2^-30`. An `f32`'s shortest
/// round-trip decimal (`1073741800`) names the same float but not the number the user set or
/// the scaler reached, so the scale is printed whole where it is an integer, as its shortest
/// decimal where that is exact, and as a power of two otherwise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScale(pub f32);

impl std::fmt::Display for LossScale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (s, v) = (self.0, f64::from(self.0));
        if v.is_finite() && v.fract() == 0.0 && v.abs() < 2f64.powi(53) {
            return write!(f, "{}", v as i64);
        }
        let shortest = s.to_string();
        if !v.is_finite() || shortest.parse::<f64>() == Ok(v) {
            return f.write_str(&shortest);
        }
        let bits = s.to_bits();
        let exponent = ((bits >> 23) & 0xff) as i32;
        if s > 0.0 && bits & 0x7f_ffff == 0 && exponent > 0 {
            return write!(f, "2^{}", exponent - 127);
        }
        f.write_str(&shortest)
    }
}

/// How long a step's runs took on the device itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceTime {
    /// Every micro step (forward and backward of each micro-batch), in milliseconds.
    pub micro_steps_ms: f32,
    /// The optimizer step (unscale, clip, update of masters and moments, working copies).
    pub optimizer_step_ms: f32,
}

/// A plan with its state.
pub struct PlanRunner {
    plan: TrainingPlan,
    state: HashMap<String, Tensor>,
    executor: CpuExecutor,
}

impl PlanRunner {
    /// Initializes the state: masters from `checkpoint` (converted to F32), everything else
    /// as the plan says. The plan must keep its contract ([`TrainingPlan::check`]).
    pub fn new(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
    ) -> Result<PlanRunner, RuntimeError> {
        PlanRunner::with_executor(plan, checkpoint, CpuExecutor::new())
    }

    /// One rank of a data-parallel plan (`castor_ir::Parallel`), its collectives exchanged
    /// with the other members of `member`'s group. Sharded entries start as this rank's shard.
    pub fn for_rank(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        member: crate::cpu::collective::Member,
    ) -> Result<PlanRunner, RuntimeError> {
        let world = plan.settings.parallel.world_size;
        if member.world() != world {
            return Err(RuntimeError::Plan(format!(
                "the plan is one rank's of {world}, the group has {}",
                member.world()
            )));
        }
        PlanRunner::with_executor(plan, checkpoint, CpuExecutor::ranked(member))
    }

    fn with_executor(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        executor: CpuExecutor,
    ) -> Result<PlanRunner, RuntimeError> {
        plan.check()?;
        let state = initial_entries(&plan, checkpoint, executor.rank())?
            .into_iter()
            .collect();
        Ok(PlanRunner {
            plan,
            state,
            executor,
        })
    }

    /// A runner whose state is `entries` (another executor's, read back): every entry the
    /// plan initializes must be there, with its type.
    pub fn with_state(
        plan: TrainingPlan,
        entries: Vec<(String, Tensor)>,
    ) -> Result<PlanRunner, RuntimeError> {
        plan.check()?;
        // A single-rank plan's held copies are derived from the masters given.
        let entries = match plan.settings.parallel.is_single() {
            true => rank_entries(&plan, entries, 0)?,
            false => entries,
        };
        let state: HashMap<String, Tensor> = entries.into_iter().collect();
        for spec in &plan.state {
            if spec.role == StateRole::WorkingCopy || matches!(spec.init, StateInit::CopyOf(_)) {
                continue;
            }
            // A sharded entry comes whole (the ranks' shards gathered): the host's copy.
            let whole = spec.shard_of.as_ref().unwrap_or(&spec.ty);
            match state.get(&spec.name) {
                Some(t) if t.ty() == whole => {}
                Some(t) => {
                    return Err(RuntimeError::BindingMismatch {
                        name: spec.name.clone(),
                        expected: whole.clone(),
                        found: t.ty().clone(),
                    })
                }
                None => {
                    return Err(RuntimeError::MissingBinding {
                        name: spec.name.clone(),
                        expected: whole.clone(),
                    })
                }
            }
        }
        Ok(PlanRunner {
            plan,
            state,
            executor: CpuExecutor::new(),
        })
    }

    /// The executor that runs the plan's graphs (a data-parallel rank's, with its group).
    pub fn executor(&self) -> &CpuExecutor {
        &self.executor
    }

    pub fn plan(&self) -> &TrainingPlan {
        &self.plan
    }

    /// The state entry `name` (a master by its checkpoint name, `adamw.m.<name>`, ...).
    pub fn state(&self, name: &str) -> Option<&Tensor> {
        self.state.get(name)
    }

    /// Replaces state entries (resuming from a checkpoint). Each must exist with that type.
    /// The copies this runner holds (FP8 copies) are derived again from restored masters.
    pub fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        let entries = match self.plan.settings.parallel.is_single() {
            true => rank_entries(&self.plan, entries, 0)?,
            false => entries,
        };
        for (name, t) in entries {
            let Some(old) = self.state.get(&name) else {
                return Err(RuntimeError::Internal {
                    node: name,
                    message: "restored state that the plan does not have".into(),
                });
            };
            if old.ty() != t.ty() {
                return Err(RuntimeError::BindingMismatch {
                    name,
                    expected: old.ty().clone(),
                    found: t.ty().clone(),
                });
            }
            self.state.insert(name, t);
        }
        Ok(())
    }

    /// The persistent state this runner holds, in the plan's order.
    pub fn state_entries(&self) -> Vec<(&str, &Tensor)> {
        self.plan
            .state
            .iter()
            .filter_map(|s| self.state.get(&s.name).map(|t| (s.name.as_str(), t)))
            .collect()
    }

    /// The first value of a control entry (the loss scale, the step count).
    pub fn control(&self, c: ControlState) -> Result<f32, RuntimeError> {
        self.state
            .get(c.name())
            .and_then(|t| t.as_f32())
            .and_then(|v| v.first().copied())
            .ok_or_else(|| RuntimeError::Plan(format!("the plan has no control entry `{c}`")))
    }

    /// Optimizer steps taken (skipped steps do not count).
    pub fn steps_taken(&self) -> Result<f32, RuntimeError> {
        self.control(ControlState::Step)
    }

    /// One training step over `micro_batches` (exactly `grad_accum` of them), with learning
    /// rate `lr`.
    pub fn step(
        &mut self,
        micro_batches: &[HashMap<String, Tensor>],
        lr: f32,
    ) -> Result<StepReport, RuntimeError> {
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
        let loss_scale = self.control(ControlState::LossScale)?;
        if accum > 1 {
            for spec in self
                .plan
                .state
                .iter()
                .filter(|s| s.role == StateRole::Gradient)
            {
                self.state.insert(spec.name.clone(), zeros(&spec.ty));
            }
        }
        let mut loss_sum = 0.0f64;
        // The learning rate, for the optimizer step and for a micro step that applies the
        // updates itself (`--update-in-backward`).
        let lr_tensor = Tensor::from_f32(DType::F32, castor_ir::Shape::scalar(), vec![lr]);
        for batch in micro_batches {
            let graph = &self.plan.micro_step;
            let outputs = {
                let state = &self.state;
                let bind = |name: &str| {
                    if name == LEARNING_RATE {
                        return Some(&lr_tensor);
                    }
                    batch.get(name).or_else(|| state.get(name))
                };
                self.executor.run(graph, &bind)?
            };
            let named = name_outputs(graph, outputs);
            loss_sum += f64::from(first_f32(&named, graph.name(graph.outputs()[0])));
            let writes = self.stored_writes(&self.plan.micro_step_writes);
            store(&mut self.state, &writes, named);
        }

        let graph = &self.plan.optimizer_step;
        let outputs = {
            let state = &self.state;
            let bind = |name: &str| {
                if name == LEARNING_RATE {
                    Some(&lr_tensor)
                } else {
                    state.get(name)
                }
            };
            self.executor.run(graph, &bind)?
        };
        let named = name_outputs(graph, outputs);
        let grad_norm = first_f32(&named, GRAD_NORM);
        let writes = self.stored_writes(&self.plan.optimizer_step_writes);
        store(&mut self.state, &writes, named);
        Ok(StepReport {
            loss: (loss_sum / accum as f64) as f32,
            loss_scale,
            next_loss_scale: self.control(ControlState::LossScale)?,
            skipped: !grad_norm.is_finite(),
            grad_norm,
            device_time: None,
        })
    }

    /// The mean loss of the micro step on `batches`, writing nothing (validation). The
    /// micro step's gradients are computed and dropped; a data-parallel plan's collectives
    /// run, so every rank must call this with the same number of batches.
    pub fn micro_step_loss(
        &self,
        batches: &[HashMap<String, Tensor>],
    ) -> Result<f64, RuntimeError> {
        let graph = &self.plan.micro_step;
        let mut sum = 0.0;
        for batch in batches {
            let bind = |name: &str| batch.get(name).or_else(|| self.state.get(name));
            let outputs = self.executor.run(graph, &bind)?;
            let loss = outputs
                .first()
                .and_then(|t| t.as_f32())
                .and_then(|v| v.first().copied())
                .ok_or_else(|| RuntimeError::Plan("the micro step has no loss output".into()))?;
            sum += f64::from(loss);
        }
        Ok(sum / batches.len().max(1) as f64)
    }

    /// The writes this runner keeps: all but the working copies, which the micro step derives
    /// from the masters itself (`param_copy`).
    fn stored_writes(&self, writes: &[castor_ir::Write]) -> Vec<castor_ir::Write> {
        writes
            .iter()
            .filter(|w| {
                self.plan
                    .state_spec(&w.state)
                    .is_some_and(|s| s.role != StateRole::WorkingCopy || holds_copy(&self.plan, s))
            })
            .cloned()
            .collect()
    }

    /// The minimum loss scale of a dynamic plan.
    pub fn min_loss_scale(&self) -> Option<f64> {
        match self.plan.settings.loss_scaling {
            LossScaling::Dynamic { min_scale, .. } => Some(min_scale),
            _ => None,
        }
    }
}

fn name_outputs(graph: &castor_ir::Graph, outputs: Vec<Tensor>) -> Vec<(String, Tensor)> {
    graph
        .outputs()
        .iter()
        .map(|&v| graph.name(v).to_string())
        .zip(outputs)
        .collect()
}

fn first_f32(named: &[(String, Tensor)], name: &str) -> f32 {
    named
        .iter()
        .find(|(n, _)| n == name)
        .and_then(|(_, t)| t.as_f32())
        .and_then(|v| v.first().copied())
        .unwrap_or(f32::NAN)
}

fn store(
    state: &mut HashMap<String, Tensor>,
    writes: &[castor_ir::Write],
    named: Vec<(String, Tensor)>,
) {
    let mut named: HashMap<String, Tensor> = named.into_iter().collect();
    for w in writes {
        if let Some(t) = named.remove(&w.output) {
            state.insert(w.state.clone(), t);
        }
    }
}

/// The state rank `rank` of `plan` starts from (rank 0 of a single-rank plan): masters from
/// `checkpoint`, the rest as the plan says; a sharded entry is this rank's shard of the whole.
/// Working copies are left out (each executor derives them from their masters), except the
/// ones a data-parallel micro step reads as state: those are held, from the whole master
/// rounded (and sharded under ZeRO-3).
pub fn initial_entries(
    plan: &TrainingPlan,
    checkpoint: &dyn Fn(&str) -> Option<Tensor>,
    rank: usize,
) -> Result<Vec<(String, Tensor)>, RuntimeError> {
    let mut state = Vec::new();
    let mut nf4 = Nf4States::default();
    for spec in &plan.state {
        let t = match &spec.init {
            // A copy the micro step reads as state (its master is sharded, or it is an FP8
            // copy) is held, from the whole master; any other is derived by its `param_copy`.
            StateInit::CopyOf(master) | StateInit::Fp8CopyOf { master, .. }
                if holds_copy(plan, spec) || spec.role == StateRole::Frozen =>
            {
                let t = checkpoint(master).ok_or_else(|| RuntimeError::MissingBinding {
                    name: master.clone(),
                    expected: TensorType::new(
                        DType::F32,
                        spec.shard_of.as_ref().unwrap_or(&spec.ty).shape.clone(),
                    ),
                })?;
                held_copy(spec, t, rank)?
            }
            _ if spec.role == StateRole::WorkingCopy => continue,
            StateInit::Checkpoint(name) => {
                let t = checkpoint(name).ok_or_else(|| RuntimeError::MissingBinding {
                    name: name.clone(),
                    expected: spec.ty.clone(),
                })?;
                match &spec.shard_of {
                    // A sharded master: this rank's piece of the whole.
                    Some(whole) => {
                        let t = checkpoint_state(t, &spec.name, whole)?;
                        shard_of(&t, &spec.ty, rank)
                    }
                    None => checkpoint_state(t, &spec.name, &spec.ty)?,
                }
            }
            StateInit::Nf4 { tensor, part } => nf4.entry(checkpoint, tensor, *part, spec)?,
            StateInit::CopyOf(_) | StateInit::Fp8CopyOf { .. } => continue,
            StateInit::Zeros => zeros(&spec.ty),
            StateInit::Values(v) => Tensor::from_f32(
                spec.ty.dtype,
                spec.ty.shape.clone(),
                v.iter().map(|&x| x as f32).collect(),
            ),
        };
        state.push((spec.name.clone(), t));
    }
    Ok(state)
}

/// Held copy `spec` for rank `rank`: its whole master rounded to the copy's dtype, or the
/// part of its FP8 copy (the scale of the master's amax, or the master times that scale cast
/// to FP8, as the `fp8_scale` and `quantize` ops make them); under ZeRO-3 this rank's shard.
fn held_copy(
    spec: &castor_ir::StateSpec,
    master: Tensor,
    rank: usize,
) -> Result<Tensor, RuntimeError> {
    let copy = spec.shard_of.as_ref().unwrap_or(&spec.ty);
    let master_shape = match spec.init {
        StateInit::Fp8CopyOf {
            part: castor_ir::Fp8Part::Scale,
            ..
        } => master.shape().clone(),
        _ => copy.shape.clone(),
    };
    let whole = TensorType::new(castor_ir::DType::F32, master_shape);
    let master = checkpoint_state(master, &spec.name, &whole)?;
    let values = master.as_f32().unwrap_or(&[]);
    let values = match &spec.init {
        StateInit::Fp8CopyOf { format, part, .. } => {
            let format = castor_ir::fp8::Fp8Format::of(*format).ok_or_else(|| {
                RuntimeError::Plan(format!(
                    "state entry `{}`: an FP8 copy in {format}, which is no FP8 format",
                    spec.name
                ))
            })?;
            let scale = crate::cpu::fp8::scale(format, crate::cpu::fp8::amax(values), 0);
            match part {
                castor_ir::Fp8Part::Scale => vec![scale],
                castor_ir::Fp8Part::Values => crate::cpu::fp8::quantize(format, values, scale),
            }
        }
        _ => values.to_vec(),
    };
    let t = Tensor::from_f32(copy.dtype, copy.shape.clone(), values);
    Ok(match spec.shard_of {
        Some(_) => shard_of(&t, &spec.ty, rank),
        None => t,
    })
}

/// State `entries` in the single-rank layout (a checkpoint) as rank `rank` of `plan` holds
/// them: each sharded entry given whole becomes this rank's shard, and each working copy the
/// rank holds is derived again from its master when that is given.
pub fn rank_entries(
    plan: &TrainingPlan,
    entries: Vec<(String, Tensor)>,
    rank: usize,
) -> Result<Vec<(String, Tensor)>, RuntimeError> {
    let mut held = Vec::new();
    for spec in plan.state.iter().filter(|s| holds_copy(plan, s)) {
        if let StateInit::CopyOf(master) | StateInit::Fp8CopyOf { master, .. } = &spec.init {
            if let Some((_, t)) = entries.iter().find(|(n, _)| n == master) {
                held.push((spec.name.clone(), held_copy(spec, t.clone(), rank)?));
            }
        }
    }
    let mut out: Vec<(String, Tensor)> = entries
        .into_iter()
        .map(|(name, t)| {
            let spec = plan.state_spec(&name);
            match spec.and_then(|s| s.shard_of.as_ref().map(|w| (s, w))) {
                Some((spec, whole)) if t.ty() == whole => {
                    let shard = shard_of(&t, &spec.ty, rank);
                    (name, shard)
                }
                _ => (name, t),
            }
        })
        .collect();
    out.extend(held);
    Ok(out)
}

/// Whether the micro step reads working copy `spec` as state (a data-parallel plan whose
/// master is sharded), so the runner holds it instead of deriving it.
pub(crate) fn holds_copy(plan: &TrainingPlan, spec: &castor_ir::StateSpec) -> bool {
    spec.role == StateRole::WorkingCopy
        && plan.micro_step.lookup(&spec.name).is_some_and(|v| {
            plan.micro_step.node(plan.micro_step.value(v).producer).op == castor_ir::Op::State
        })
}

/// Rank `rank`'s flat shard (type `shard`) of the whole tensor `t`, zeros past its end.
pub(crate) fn shard_of(t: &Tensor, shard: &TensorType, rank: usize) -> Tensor {
    let values = t.as_f32().unwrap_or(&[]);
    let len = shard.shape.numel().unwrap_or(0);
    let piece = (rank * len..(rank + 1) * len)
        .map(|i| values.get(i).copied().unwrap_or(0.0))
        .collect();
    Tensor::from_f32(shard.dtype, shard.shape.clone(), piece)
}

pub(crate) fn zeros(ty: &TensorType) -> Tensor {
    let n = ty.shape.numel().unwrap_or(0);
    let shape = ty.shape.clone();
    match ty.dtype {
        d if d.is_float() => Tensor::from_f32(d, shape, vec![0.0; n]),
        d if d.is_int() => Tensor::from_i64(d, shape, vec![0; n]),
        DType::Bool => Tensor::from_bool(shape, vec![false; n]),
        _ => Tensor::from_u8(shape, vec![0; n]),
    }
}

/// The NF4 state entries of a plan, each weight quantized once: its two entries (codes, block
/// maxima) are adjacent in the plan's state, so the last weight quantized is kept for the
/// second.
#[derive(Default)]
pub(crate) struct Nf4States {
    last: Option<(String, castor_ir::nf4::Nf4)>,
}

impl Nf4States {
    /// Part `part` of checkpoint tensor `tensor` in NF4, for state entry `spec`.
    pub(crate) fn entry(
        &mut self,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        tensor: &str,
        part: castor_ir::Nf4Part,
        spec: &castor_ir::StateSpec,
    ) -> Result<Tensor, RuntimeError> {
        if self.last.as_ref().is_none_or(|(n, _)| n != tensor) {
            let t = checkpoint(tensor).ok_or_else(|| RuntimeError::MissingBinding {
                name: tensor.into(),
                expected: spec.ty.clone(),
            })?;
            let numel = t.shape().numel().unwrap_or(0);
            let values = t
                .as_f32()
                .filter(|_| part.ty(numel) == spec.ty)
                .ok_or_else(|| RuntimeError::BindingMismatch {
                    name: spec.name.clone(),
                    expected: spec.ty.clone(),
                    found: t.ty().clone(),
                })?;
            let q = castor_ir::nf4::quantize(values, castor_ir::nf4::NF4_BLOCK);
            self.last = Some((tensor.to_string(), q));
        }
        let (_, q) = self.last.as_ref().ok_or_else(|| RuntimeError::Internal {
            node: spec.name.clone(),
            message: "no quantized weight".into(),
        })?;
        let t = part.of(q);
        if t.ty() != &spec.ty {
            return Err(RuntimeError::BindingMismatch {
                name: spec.name.clone(),
                expected: spec.ty.clone(),
                found: t.ty().clone(),
            });
        }
        Ok(t)
    }
}

/// A checkpoint tensor as the state entry of type `ty`: an F32 master, or a frozen parameter
/// in the dtype the step reads it in.
pub(crate) fn checkpoint_state(
    t: Tensor,
    name: &str,
    ty: &TensorType,
) -> Result<Tensor, RuntimeError> {
    let Some(values) = t.as_f32() else {
        return Err(RuntimeError::BindingMismatch {
            name: name.into(),
            expected: ty.clone(),
            found: t.ty().clone(),
        });
    };
    if t.shape() != &ty.shape {
        return Err(RuntimeError::BindingMismatch {
            name: name.into(),
            expected: ty.clone(),
            found: t.ty().clone(),
        });
    }
    if t.dtype() == ty.dtype {
        return Ok(t);
    }
    // A frozen parameter stored in BF16/F16 is rounded to nearest even here, as a working
    // copy is rounded from its master.
    Ok(Tensor::from_f32(
        ty.dtype,
        ty.shape.clone(),
        values.to_vec(),
    ))
}

#[cfg(test)]
mod tests {
    use super::LossScale;

    #[test]
    fn loss_scales_print_exactly() {
        for (scale, text) in [
            (1073741824.0f32, "1073741824"),
            (536870912.0, "536870912"),
            (65536.0, "65536"),
            (1.0, "1"),
            (0.5, "0.5"),
            (2f32.powi(-30), "2^-30"),
            (2f32.powi(100), "2^100"),
            (f32::INFINITY, "inf"),
        ] {
            assert_eq!(LossScale(scale).to_string(), text);
        }
    }
}
