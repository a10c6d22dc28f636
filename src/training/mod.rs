//! The training home: everything between a `train` call's flags and the executor, called by
//! the CLI (`castor train`, `castor demo`) and the Python package alike.
//!
//! | module | what it holds |
//! |---|---|
//! | [`args`] | the `train` flags, and the checks that need only the flags |
//! | `flags` (re-exported here) | the training flags `compile --train` shares: optimizer, loss scaling, LoRA, parallelism; the [`TrainSettings`](castor_ir::TrainSettings) they make |
//! | [`data`] | token streams, text, labelled examples, SFT examples, batch files: micro-batches and their position |
//! | [`plan`] | the plan compiled (or read and checked), the data opened for its shape, the fit verdict |
//! | [`fit`] | the planned peak against a device's memory, and the changes that would fit |
//! | [`weights`] | the starting weights and adapters, and what is wrong with them |
//! | [`trainer`] | the plan on one executor (CPU, CUDA, emulator; ranks in this process or launched) |
//! | [`launcher`] | a process a launcher started: its rank and its group |
//! | [`step_loop`] | the loop: schedule, progress, log, validation, saves, Ctrl-C |
//! | [`samples`] | answers to `--sample-prompts` at each evaluation |
//! | [`checkpoint`], [`resume`] | what a checkpoint holds, and a resumed run's flags against it |
//! | [`run`] | one run as named phases, from the flags to its outcome |

pub mod args;
pub mod checkpoint;
pub mod data;
pub mod fit;
mod flags;
pub mod launcher;
pub mod plan;
pub mod progress;
pub mod resume;
pub mod run;
pub mod samples;
pub mod step_loop;
pub mod trainer;
pub mod weights;

pub use args::{Args, RunArgs};
pub use flags::*;
pub use plan::{compile_plan, CompiledPlan};
pub use run::{train, TrainOutcome};
pub use step_loop::Hooks;
