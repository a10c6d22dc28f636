//! One module per subcommand: its arguments (clap) and its `run`.

pub mod compile;
pub mod demo;
pub mod eval;
pub mod generate;
pub mod inspect;
pub mod merge;
pub mod train;
