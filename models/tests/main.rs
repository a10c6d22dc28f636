//! castor-models' integration tests, one binary: each file in this folder is a module of it;
//! `common/` and `exec/` are their shared helpers.

mod common;
mod exec;

mod checkpoints;
mod config_only;
mod fixtures;
mod semantics;
mod streaming_save;
