//! The fusion pass on every model family under bf16 and fp16 training plans:
//! - every generated kernel compiles with NVRTC 13.0 to PTX for sm_90 (with no GPU; skipped
//!   with a message when NVRTC is absent, except in CI where it must be present);
//! - running the micro step in fused order (each group's members back to back where the
//!   group's last member stood) gives bit-identical losses and gradients, so the groups are
//!   legal and each fused kernel rounds where the unfused graph stores;
//! - the grouping decisions are snapshots.

mod common;

use castor::precision::PrecisionArgs;
use castor::training::TrainingArgs;
use castor_ir::TrainingPlan;
use castor_models::{Model, Objective};
use castor_passes::fusion::{fused_order, fusion_groups};
use castor_runtime::cpu::CpuExecutor;
use clap::Parser;
use common::*;
use std::fmt::Write;

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    precision: PrecisionArgs,
    #[command(flatten)]
    training: TrainingArgs,
}

const FAMILIES: [&str; 3] = ["gpt2_lm", "bert_mlm", "llama_gqa"];

fn plan(variant: &str, precision: &str) -> (Model, TrainingPlan) {
    let model = Model::load(fixture(variant)).unwrap();
    let flags = Flags::try_parse_from(["castor", "--precision", precision]).unwrap();
    let objective = Objective::auto(&model);
    let graph = model.build_loss_graph(2, 7, objective).unwrap();
    let compiled = flags
        .precision
        .compile(graph, None, None, false)
        .unwrap()
        .graph;
    let settings = flags
        .training
        .settings(flags.precision.precision, objective, 2, 7)
        .unwrap();
    let (plan, _) = castor_passes::build_training_plan(&compiled, settings).unwrap();
    (model, plan)
}

#[test]
fn generated_kernels_compile_to_ptx() {
    let nvrtc = match castor_kernels::Nvrtc::from_env() {
        Ok(Some(n)) => n,
        Ok(None) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI must compile the generated kernels: set CASTOR_NVRTC_DIR (see .ci/run)")
        }
        Ok(None) => {
            eprintln!("skipped: NVRTC not found (set CASTOR_NVRTC_DIR)");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let mut compiled = 0;
    for variant in FAMILIES {
        for precision in ["bf16", "fp16"] {
            let (_, plan) = plan(variant, precision);
            assert!(!plan.fused_kernels.is_empty(), "{variant} {precision}");
            for k in &plan.fused_kernels {
                let ptx = nvrtc
                    .compile_kernel(&k.name, &k.source, castor_kernels::DEFAULT_ARCH)
                    .unwrap_or_else(|e| {
                        panic!("{variant} {precision} {}: {e}\n{}", k.name, k.source)
                    });
                assert!(ptx.contains(&format!(".entry {}", k.name)), "{}", k.name);
                compiled += 1;
            }
        }
    }
    println!("{compiled} generated kernels compiled to PTX for sm_90");
}

#[test]
fn fused_order_is_bit_identical() {
    for variant in FAMILIES {
        for precision in ["bf16", "fp16"] {
            let (model, plan) = plan(variant, precision);
            let g = &plan.micro_step;
            let groups = fusion_groups(g);
            let fused = fused_order(g, &groups).unwrap();
            castor_ir::verify(&fused).unwrap();
            let batch = castor::batch::read_batch(
                &fixture(variant).join("input.safetensors"),
                model.input_names(),
                model.vocab_size(),
            )
            .unwrap();
            let ids = batch.tensors["input_ids"].clone();
            let params = model.load_params().unwrap();
            let scale = castor_ir::Tensor::from_f32(
                castor_ir::DType::F32,
                castor_ir::Shape::scalar(),
                vec![if precision == "fp16" { 1024.0 } else { 1.0 }],
            );
            let loss_scale = castor_ir::ControlState::LossScale.name();
            let bind = |name: &str| match name {
                "labels" => Some(&ids),
                _ if name == loss_scale => Some(&scale),
                _ => batch.tensors.get(name).or_else(|| params.get(name)),
            };
            let a = CpuExecutor::new().run(g, &bind).unwrap();
            let b = CpuExecutor::new().run(&fused, &bind).unwrap();
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x, y, "{variant} {precision}: fused order changed a result");
            }
        }
    }
}

#[test]
fn fusion_decisions() {
    for precision in ["bf16", "fp16"] {
        let mut out = String::new();
        for variant in FAMILIES {
            let (_, plan) = plan(variant, precision);
            let _ = writeln!(out, "== {variant} ({} kernels)", plan.fused_kernels.len());
            for k in &plan.fused_kernels {
                let _ = writeln!(out, "{}: {}", k.name, k.members.join(" + "));
            }
        }
        insta::assert_snapshot!(format!("fusion_{precision}"), out);
    }
}
