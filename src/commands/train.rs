//! `castor train`: a training run ([`crate::training::train`]) with Ctrl-C caught, its
//! outcome turned into the exit code.

use crate::given::Given;
pub use crate::training::{train, Args, Hooks, TrainOutcome};

pub fn run(args: Args, given: &Given) -> anyhow::Result<()> {
    // Ctrl-C finishes the step, saves and stops (a second one stops at once).
    crate::training::step_loop::catch_interrupts();
    match train(args, given, Hooks::default())?.interrupted {
        true => Err(crate::Interrupted.into()),
        false => Ok(()),
    }
}
