//! Each optimizer's hyperparameters, declared once: the run's settings
//! ([`crate::OptimizerKind`]) hold them, each parameter's update op ([`crate::Op::AdamW`] and
//! the others) carries them (with that parameter's weight decay), and the executors read them
//! from the op. In the IR text and in the settings JSON each field is its own attribute, as if
//! the struct were not there.

use crate::op::{Attr, AttrFields, AttrReader};
use serde::{Deserialize, Serialize};

/// A struct of hyperparameters whose fields are op attributes of their own names.
macro_rules! hyperparameters {
    ($(#[$m:meta])* $S:ident { $( $(#[$fm:meta])* $f:ident : $t:ty ),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
        pub struct $S {
            $( $(#[$fm])* pub $f: $t ),*
        }

        impl AttrFields for $S {
            fn push_attrs(&self, _key: &'static str, out: &mut Vec<(&'static str, Attr)>) {
                $( self.$f.push_attrs(stringify!($f), out); )*
            }
            fn take_attrs(reader: &mut AttrReader<'_>, _key: &str) -> Result<Self, String> {
                Ok($S { $( $f: AttrFields::take_attrs(reader, stringify!($f))? ),* })
            }
        }
    };
}

hyperparameters! {
    /// AdamW (torch.optim.AdamW, decoupled weight decay), and bitsandbytes' `AdamW8bit`, which
    /// takes the same.
    AdamWHparams {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    }
}

hyperparameters! {
    /// SGD with momentum (torch.optim.SGD, dampening 0, coupled weight decay).
    SgdHparams {
        momentum: f64,
        weight_decay: f64,
    }
}

hyperparameters! {
    /// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the update is
    /// the sign of `beta1 m + (1 - beta1) g`, the one moment is `beta2 m + (1 - beta2) g`, and
    /// the weight decay is decoupled (`p *= 1 - lr wd`), as `lion-pytorch` and optax apply it.
    LionHparams {
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
    }
}

hyperparameters! {
    /// transformers' `Adafactor` (Shazeer & Stern 2018): `beta1` `None` keeps no first
    /// moment; `relative_step` replaces the learning rate by `min(1e-2, 1/sqrt(t))` (or `1e-6
    /// t` with `warmup_init`); `scale_parameter` multiplies the step by `max(eps2,
    /// rms(param))`; the update is divided by `max(1, rms(update) / clip_threshold)`; the
    /// second-moment decay is `1 - t^decay_rate`.
    AdafactorHparams {
        beta1: Option<f64>,
        decay_rate: f64,
        eps1: f64,
        eps2: f64,
        clip_threshold: f64,
        weight_decay: f64,
        relative_step: bool,
        scale_parameter: bool,
        warmup_init: bool,
    }
}

impl AdafactorHparams {
    /// transformers' defaults: eps (1e-30, 1e-3), clip threshold 1, decay rate -0.8, no first
    /// moment, no weight decay; the relative step with parameter scaling, or (`relative_step`
    /// false) the learning-rate input without it.
    pub fn defaults(relative_step: bool) -> AdafactorHparams {
        AdafactorHparams {
            beta1: None,
            decay_rate: -0.8,
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            weight_decay: 0.0,
            relative_step,
            scale_parameter: relative_step,
            warmup_init: false,
        }
    }
}

/// The weight decay a parameter gets: the run's, or none for a parameter excluded from decay
/// (biases and norm weights).
pub trait WeightDecay: Sized {
    fn with_decay(self, decays: bool) -> Self;
}

macro_rules! weight_decay {
    ($($S:ident),*) => {$(
        impl WeightDecay for $S {
            fn with_decay(self, decays: bool) -> Self {
                $S { weight_decay: if decays { self.weight_decay } else { 0.0 }, ..self }
            }
        }
    )*};
}
weight_decay!(AdamWHparams, SgdHparams, LionHparams, AdafactorHparams);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Op, OptimizerKind};

    fn adamw() -> AdamWHparams {
        AdamWHparams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    /// The struct adds nothing to the IR text: each field is its own attribute, in order,
    /// and the text reads back to the same op.
    #[test]
    fn hyperparameters_print_as_flat_attributes() {
        let op = Op::AdamW {
            hp: adamw().with_decay(false),
            max_grad_norm: 1.0,
            copy: None,
        };
        let attrs: Vec<String> = op.attrs().iter().map(|(k, a)| format!("{k}={a}")).collect();
        assert_eq!(
            attrs.join(", "),
            "beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=1.0, copy=none"
        );
        let parts = op
            .attrs()
            .into_iter()
            .map(|(k, a)| (k.to_string(), a))
            .collect();
        assert_eq!(Op::from_parts("adamw", parts), Ok(op));
        let mut missing: Vec<(String, Attr)> = Op::AdamW {
            hp: adamw(),
            max_grad_norm: 0.0,
            copy: None,
        }
        .attrs()
        .into_iter()
        .map(|(k, a)| (k.to_string(), a))
        .collect();
        missing.retain(|(k, _)| k != "eps");
        let e = Op::from_parts("adamw", missing).unwrap_err();
        assert!(e.contains("`eps`"), "{e}");
    }

    /// The settings JSON keeps the hyperparameters beside `kind`.
    #[test]
    fn settings_json_is_flat() {
        let json = serde_json::to_value(OptimizerKind::AdamW(adamw())).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"kind": "adam_w", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                               "weight_decay": 0.01})
        );
        let back: OptimizerKind = serde_json::from_value(json).unwrap();
        assert_eq!(back, OptimizerKind::AdamW(adamw()));
        let sgd = SgdHparams {
            momentum: 0.9,
            weight_decay: 0.1,
        };
        assert_eq!(sgd.with_decay(true), sgd);
        assert_eq!(sgd.with_decay(false).weight_decay, 0.0);
    }
}
