//! A training plan on the executor `--device` chose.
//!
//! The CPU [`PlanRunner`] is always there: on the CPU it trains; with CUDA it is the host
//! mirror of the device state, refreshed only when something on the host needs the weights
//! (a checkpoint, a validation pass, sampling), so training steps never wait for copies.

use crate::device::Selected;
use castor_ir::{Tensor, TrainingPlan};
use castor_runtime::cuda::CudaPlanRunner;
use castor_runtime::{PlanRunner, RuntimeError, StepReport};
use std::collections::HashMap;

pub struct Trainer {
    host: PlanRunner,
    cuda: Option<CudaPlanRunner>,
    /// The device has taken steps the host mirror has not seen.
    host_stale: bool,
}

impl Trainer {
    /// The plan with its state initialized from `checkpoint`, on `device`.
    pub fn new(
        plan: TrainingPlan,
        checkpoint: &dyn Fn(&str) -> Option<Tensor>,
        device: &Selected,
    ) -> Result<Trainer, RuntimeError> {
        let cuda = match device {
            Selected::Cpu => None,
            Selected::Cuda(_) => Some(CudaPlanRunner::new(plan.clone(), checkpoint)?),
        };
        Ok(Trainer {
            host: PlanRunner::new(plan, checkpoint)?,
            cuda,
            host_stale: false,
        })
    }

    pub fn plan(&self) -> &TrainingPlan {
        self.host.plan()
    }

    /// `"cpu"` or `"cuda (<device>)"`.
    pub fn device(&self) -> String {
        match &self.cuda {
            Some(c) => format!("cuda ({})", c.device_name()),
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
        match &mut self.cuda {
            None => self.host.step(micro_batches, lr).map(Some),
            Some(c) => {
                self.host_stale = true;
                c.queue_step(micro_batches, lr)?;
                if report {
                    c.report().map(Some)
                } else {
                    Ok(None)
                }
            }
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
        match &mut self.cuda {
            Some(c) => Ok(Some(c.validation_loss(batches)?)),
            None => crate::commands::train::validation_loss(&self.host, batches),
        }
    }

    /// Replaces state entries (resuming) on every executor.
    pub fn restore(&mut self, entries: Vec<(String, Tensor)>) -> Result<(), RuntimeError> {
        if let Some(c) = &mut self.cuda {
            c.restore(entries.clone())?;
        }
        self.host.restore(entries)
    }

    /// The host runner with the current state (copied back from the device if needed).
    pub fn host(&mut self) -> Result<&PlanRunner, RuntimeError> {
        if let (Some(c), true) = (&self.cuda, self.host_stale) {
            self.host.restore(c.state_entries()?)?;
            self.host_stale = false;
        }
        Ok(&self.host)
    }

    /// The minimum loss scale of a dynamic plan.
    pub fn min_loss_scale(&self) -> Option<f64> {
        self.host.min_loss_scale()
    }
}
