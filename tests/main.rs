//! castor's integration tests, one binary: each file in this folder is a module of it, and
//! `common/` holds their shared helpers. One binary links once, where one per file linked the
//! whole dependency graph again. Run one file's tests with a module filter:
//! `cargo test --test integration passes_snapshots::`.
//!
//! `cuda_gpu.rs` is the exception, a binary of its own: it is the test the GPU machine runs
//! (bench/gpu/pack.sh builds it in release without the rest).

mod common;

mod attention;
mod autocast_vs_pytorch;
mod autodiff_gradcheck;
mod chat;
mod classifier;
mod cli;
mod crash_safety;
mod cuda_emulated;
mod cuda_lowering;
mod data_parallel;
mod demo;
mod dropout;
mod emulate_cli;
mod epilogues;
mod eval_vs_pytorch;
mod fp8;
mod fp8_training;
mod fusion;
mod generate;
mod gpu_check_script;
mod grad_vs_pytorch;
mod ir_files;
mod lora;
mod malformed;
mod memory_model;
mod nf4;
mod optimizers;
mod packing;
mod passes_snapshots;
mod plan_contract;
mod qlora;
mod remat;
mod report;
mod sft;
mod text_data;
mod train_data;
mod train_runs;
mod train_vs_pytorch;
mod training_snapshots;
mod unpadded;
mod user_path;
