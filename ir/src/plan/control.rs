//! The plan's control contract: the state entries and graph interface that executors read and
//! write by name, each named once here.
//!
//! The plan builder creates these entries, the optimizer graph reads and updates them, and
//! every executor reads them back (the loss scale a step used, the steps taken). A plan is
//! checked against this table ([`super::TrainingPlan::check`]), so a renamed or missing
//! entry is an error when the plan is built or loaded, never a silent default.

use crate::{DType, LossScaling, Shape, TensorType};

/// A control entry of the persistent state (role [`super::StateRole::Control`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ControlState {
    /// Optimizer steps taken; skipped steps do not count.
    Step,
    /// The loss scale the next backward pass is seeded with (1 without loss scaling).
    LossScale,
    /// Dynamic loss scaling's counters: clean steps since the last change of the scale, and
    /// overflows still tolerated before it backs off (hysteresis).
    LossScaleCounters,
}

impl ControlState {
    pub const ALL: [ControlState; 3] = [
        ControlState::Step,
        ControlState::LossScale,
        ControlState::LossScaleCounters,
    ];

    /// The entry's name in the state table and the graphs.
    pub fn name(self) -> &'static str {
        match self {
            ControlState::Step => "optimizer.step",
            ControlState::LossScale => "loss_scale",
            ControlState::LossScaleCounters => "loss_scale.counters",
        }
    }

    pub fn from_name(name: &str) -> Option<ControlState> {
        ControlState::ALL.into_iter().find(|c| c.name() == name)
    }

    /// F32 scalars, and two F32 counters.
    pub fn ty(self) -> TensorType {
        match self {
            ControlState::Step | ControlState::LossScale => {
                TensorType::new(DType::F32, Shape::scalar())
            }
            ControlState::LossScaleCounters => TensorType::new(DType::F32, [2]),
        }
    }

    /// Whether a plan with this loss scaling has the entry: the step and the scale always (the
    /// backward seed reads the scale), the counters only under dynamic scaling.
    pub fn required(self, scaling: &LossScaling) -> bool {
        match self {
            ControlState::Step | ControlState::LossScale => true,
            ControlState::LossScaleCounters => matches!(scaling, LossScaling::Dynamic { .. }),
        }
    }

    /// The entry's values before the first step.
    pub fn initial(self, scaling: &LossScaling) -> Vec<f64> {
        match (self, scaling) {
            (ControlState::Step, _) => vec![0.0],
            (ControlState::LossScale, LossScaling::None) => vec![1.0],
            (ControlState::LossScale, LossScaling::Static { scale }) => vec![*scale],
            (ControlState::LossScale, LossScaling::Dynamic { init_scale, .. }) => {
                vec![*init_scale]
            }
            (ControlState::LossScaleCounters, LossScaling::Dynamic { hysteresis, .. }) => {
                vec![0.0, *hysteresis as f64]
            }
            (ControlState::LossScaleCounters, _) => vec![0.0, 1.0],
        }
    }
}

impl std::fmt::Display for ControlState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The optimizer step's learning-rate input (an F32 scalar the host supplies every step).
pub const LEARNING_RATE: &str = "lr";

/// The optimizer step's output holding the global gradient norm of the unscaled gradients;
/// not finite when the step was skipped.
pub const GRAD_NORM: &str = "grad_norm";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_round_trip() {
        for c in ControlState::ALL {
            assert_eq!(ControlState::from_name(c.name()), Some(c));
            assert_eq!(
                Some(c.initial(&LossScaling::None).len()),
                c.ty().shape.numel()
            );
        }
        assert_eq!(ControlState::from_name("loss-scale"), None);
    }
}
