//! Two plans' settings compared field by field: each setting that differs, named by its typed
//! [`Setting`] and shown as people read it. The checks that bind a run to a checkpoint or to
//! a plan file say from it what disagrees.

use super::settings::TrainSettings;
use serde::Serialize;
use serde_json::Value;

/// One setting on which two plans differ, with both values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    pub setting: Setting,
    /// The value of the settings `differences` was called on, and of the other settings.
    pub ours: String,
    pub theirs: String,
}

/// Declares [`Setting`] (one variant per field of [`TrainSettings`]) and
/// [`TrainSettings::differences`].
macro_rules! settings {
    ($($field:ident => $variant:ident),* $(,)?) => {
        /// A field of [`TrainSettings`].
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Setting {
            $($variant),*
        }

        impl Setting {
            pub const ALL: &'static [Setting] = &[$(Setting::$variant),*];

            /// The field's name, as plan files and checkpoints record it.
            pub fn name(self) -> &'static str {
                match self {
                    $(Setting::$variant => stringify!($field)),*
                }
            }
        }

        impl TrainSettings {
            /// The settings on which `self` and `other` differ, in field order.
            pub fn differences(&self, other: &TrainSettings) -> Vec<Difference> {
                // Every field is named (no `..`): a new field does not compile until it is
                // compared here.
                let TrainSettings { $($field),* } = self;
                let mut out = Vec::new();
                $(
                    if *$field != other.$field {
                        out.push(Difference {
                            setting: Setting::$variant,
                            ours: show($field),
                            theirs: show(&other.$field),
                        });
                    }
                )*
                out
            }
        }
    };
}

settings!(
    precision => Precision,
    objective => Objective,
    batch => Batch,
    seq => Seq,
    grad_accum => GradAccum,
    optimizer => Optimizer,
    max_grad_norm => MaxGradNorm,
    loss_scaling => LossScaling,
    frozen => Frozen,
    no_decay => NoDecay,
    param_grads_in_compute_dtype => ParamGradsInComputeDtype,
    optimizer_state => OptimizerState,
    update_in_backward => UpdateInBackward,
    remat => Remat,
    classifier => Classifier,
    epilogues => Epilogues,
    lora => Lora,
    parallel => Parallel,
    packed => Packed,
    unpadded => Unpadded,
    dropout => Dropout,
);

/// A setting's value for people (see [`show_value`]).
fn show(value: &impl Serialize) -> String {
    show_value(&serde_json::to_value(value).unwrap_or(Value::Null))
}

/// A setting or flag value for people: strings bare, lists comma-separated, structures as
/// JSON.
pub fn show_value(v: &Value) -> String {
    match v {
        Value::Null => "(not set)".into(),
        Value::String(s) => s.clone(),
        Value::Array(a) if a.is_empty() => "(none)".into(),
        Value::Array(a) => a.iter().map(show_value).collect::<Vec<_>>().join(", "),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LossScaling, OptimizerKind, Precision, Remat, SgdHparams};

    #[test]
    fn every_field_is_a_setting_named_as_serialized() {
        let s = TrainSettings {
            precision: Precision::Bf16,
            objective: "lm".into(),
            batch: 2,
            seq: 8,
            grad_accum: 1,
            optimizer: OptimizerKind::Sgd(SgdHparams {
                momentum: 0.9,
                weight_decay: 0.0,
            }),
            max_grad_norm: 1.0,
            loss_scaling: LossScaling::None,
            frozen: Vec::new(),
            no_decay: Vec::new(),
            param_grads_in_compute_dtype: false,
            optimizer_state: crate::DType::F32,
            update_in_backward: false,
            remat: Remat::None,
            classifier: Default::default(),
            epilogues: Default::default(),
            lora: None,
            parallel: Default::default(),
            packed: false,
            unpadded: false,
            dropout: Default::default(),
        };
        let Value::Object(fields) = serde_json::to_value(&s).unwrap() else {
            panic!("settings serialize as an object");
        };
        // Fields skipped when at their default are settings too.
        for key in fields.keys() {
            assert!(Setting::ALL.iter().any(|s| s.name() == key), "{key}");
        }
        assert!(s.differences(&s).is_empty());
        let mut other = s.clone();
        other.precision = Precision::Fp32;
        other.remat = Remat::Full;
        other.frozen = vec!["a.*".into(), "b".into()];
        let d = s.differences(&other);
        let named: Vec<(Setting, &str)> =
            d.iter().map(|d| (d.setting, d.theirs.as_str())).collect();
        assert_eq!(
            named,
            [
                (Setting::Precision, "fp32"),
                (Setting::Frozen, "a.*, b"),
                (Setting::Remat, "full"),
            ]
        );
    }
}
