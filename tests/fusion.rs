//! The fusion pass on every model family under bf16, fp16, fp8 and fp8:delayed training plans:
//! - the plan's kernel units are what runs: the CUDA lowering prints one generated kernel per
//!   pointwise unit with outputs (each distinct body once), and every one compiles with NVRTC
//!   13.0 to PTX for sm_90 (with no GPU; skipped with a message when NVRTC is absent, except
//!   in CI where it must be present);
//! - a plan file whose unit does not say what its members compute is refused by name;
//! - running the micro step in fused order (each unit's members back to back where the
//!   unit's last member stood) gives bit-identical losses and gradients, so the groups are
//!   legal and each fused kernel rounds where the unfused graph stores;
//! - the grouping decisions are snapshots.

use crate::common;

use castor::precision::PrecisionArgs;
use castor::training::TrainingArgs;
use castor_ir::{Step, TrainingPlan, UnitKind};
use castor_models::{Model, Objective};
use castor_passes::fusion::{fused_order, schedule};
use castor_runtime::cpu::CpuExecutor;
use castor_runtime::cuda::lower::{lower_plan, GENERATED_MODULE};
use castor_runtime::cuda::program::Command;
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
    plan_at(variant, precision, 7)
}

/// [`plan`] at 2 x `seq` tokens.
fn plan_at(variant: &str, precision: &str, seq: usize) -> (Model, TrainingPlan) {
    let model = Model::load(fixture(variant)).unwrap();
    let flags = Flags::try_parse_from(["castor", "--precision", precision]).unwrap();
    let objective = Objective::auto(&model);
    let graph = model.build_loss_graph(2, seq, objective).unwrap();
    let compiled = flags
        .precision
        .compile(graph, None, None, false)
        .unwrap()
        .graph;
    let settings = flags
        .training
        .settings(flags.precision.precision, objective, 2, seq)
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
            let program = lower_plan(&plan).unwrap();
            let module = program
                .modules
                .iter()
                .find(|m| m.name == GENERATED_MODULE)
                .unwrap_or_else(|| panic!("{variant} {precision}: no generated module"));
            // Every pointwise unit with a result is launched, by an entry of the module.
            let entries: Vec<&str> = module.generated.iter().map(|k| k.entry.as_str()).collect();
            let launched: std::collections::HashSet<&str> = program
                .runs
                .iter()
                .flat_map(|r| &r.commands)
                .filter_map(|c| match c {
                    Command::Launch(l) if entries.contains(&l.entry.as_str()) => {
                        Some(l.entry.as_str())
                    }
                    _ => None,
                })
                .collect();
            let with_results = plan
                .kernel_units
                .iter()
                .filter(|u| matches!(&u.kind, UnitKind::Pointwise(b) if !b.outputs.is_empty()))
                .count();
            assert!(launched.len() <= with_results, "{variant} {precision}");
            assert_eq!(launched.len(), entries.len(), "{variant} {precision}");
            let ptx = nvrtc
                .compile_kernel(
                    GENERATED_MODULE,
                    &module.source,
                    castor_kernels::DEFAULT_ARCH,
                )
                .unwrap_or_else(|e| panic!("{variant} {precision}: {e}\n{}", module.source));
            for entry in &entries {
                assert!(ptx.contains(&format!(".entry {entry}")), "{entry}");
                compiled += 1;
            }
        }
    }
    println!("{compiled} generated kernels compiled to PTX for sm_90");
}

#[test]
fn a_unit_that_misstates_its_body_is_refused() {
    let (_, mut plan) = plan("llama_gqa", "bf16");
    let unit = plan
        .kernel_units
        .iter_mut()
        .find(|u| u.name.starts_with("fused_"))
        .unwrap();
    let name = unit.name.clone();
    let UnitKind::Pointwise(body) = &mut unit.kind else {
        panic!("{name} is not pointwise")
    };
    let last = body.steps.len() - 1;
    if let Step::Round { to, .. } = &mut body.steps[last] {
        *to = castor_ir::DType::F16;
    } else {
        panic!("{name} does not end with a round");
    }
    let json = plan.to_json();
    let plan = TrainingPlan::from_json(&json).unwrap();
    let e = lower_plan(&plan).unwrap_err().to_string();
    assert!(
        e.contains(&format!("kernel unit `{name}`")) && e.contains("not what its members compute"),
        "{e}"
    );
}

#[test]
fn fused_order_is_bit_identical() {
    for variant in FAMILIES {
        for precision in ["bf16", "fp16", "fp8", "fp8:delayed"] {
            let (model, plan) = plan(variant, precision);
            let g = &plan.micro_step;
            // Every unit of the plan (pointwise, norm), its members run back to back.
            let units = schedule(g, plan.units_of("micro_step")).unwrap();
            let fused = fused_order(g, &units.members).unwrap();
            castor_ir::verify(&fused).unwrap();
            let input =
                castor_models::SafetensorsFile::open(fixture(variant).join("input.safetensors"))
                    .unwrap();
            let batch =
                castor::batch::read_batch(&input, model.input_names(), model.vocab_size()).unwrap();
            let ids = batch.tensors["input_ids"].clone();
            let params = model.load_params().unwrap();
            let scale = castor_ir::Tensor::from_f32(
                castor_ir::DType::F32,
                castor_ir::Shape::scalar(),
                vec![if precision == "fp16" { 1024.0 } else { 1.0 }],
            );
            // The plan's state as a run starts it (FP8 weight copies, delayed scales).
            let runner =
                castor_runtime::PlanRunner::new(plan.clone(), &|n| params.get(n).cloned()).unwrap();
            let loss_scale = castor_ir::ControlState::LossScale.name();
            let bind = |name: &str| match name {
                "labels" => Some(&ids),
                _ if name == loss_scale => Some(&scale),
                _ => batch
                    .tensors
                    .get(name)
                    .or_else(|| params.get(name))
                    .or_else(|| runner.state(name)),
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
    for precision in ["bf16", "fp16", "fp8", "fp8:delayed"] {
        let mut out = String::new();
        for variant in FAMILIES {
            let (_, plan) = plan(variant, precision);
            let fused: Vec<_> = plan
                .kernel_units
                .iter()
                .filter(|u| u.members.len() > 1)
                .collect();
            let _ = writeln!(
                out,
                "== {variant} ({} units, {} of several nodes)",
                plan.kernel_units.len(),
                fused.len()
            );
            for u in fused {
                let _ = writeln!(
                    out,
                    "{} {} {}: {}",
                    u.graph,
                    u.kind.name(),
                    u.name,
                    u.members.join(" + ")
                );
            }
        }
        insta::assert_snapshot!(format!("fusion_{}", precision.replace(':', "_")), out);
    }
}

/// Under `fp8:delayed` a cast to FP8 whose scale is state ends the pointwise unit that makes
/// its operand: LLaMA's `silu(gate) * up` is cast for the down projection in the kernel that
/// computes it, which stores the FP8 values (and not the BF16 product nobody else reads) and
/// the amax, reduced by `fp8_amax_finalize`; the gradients' E5M2 casts end their units the
/// same way. Under `fp8` (current scaling) the scale is the amax of the operand itself, which
/// exists only once the whole operand does: no cast joins a unit, but the scale does (the unit
/// stores the operand and its partial maxima, `fp8_scale_finalize` makes the scale). The
/// generated kernels compile with NVRTC (the emulated plans of `tests/cuda_emulated.rs` check
/// their values).
#[test]
fn delayed_fp8_casts_end_the_units_that_make_their_operands() {
    // FP8 products on CUDA need the tokens of a micro-batch to be a multiple of 16.
    let plan_of = |variant: &str, precision: &str| plan_at(variant, precision, 8).1;
    let tails = |plan: &TrainingPlan| -> Vec<(String, castor_ir::PointwiseBody)> {
        plan.kernel_units
            .iter()
            .filter_map(|u| match &u.kind {
                UnitKind::Pointwise(b)
                    if b.steps.iter().any(|s| matches!(s, Step::Quantize { .. })) =>
                {
                    Some((u.members.join(" + "), b.clone()))
                }
                _ => None,
            })
            .collect()
    };
    let nvrtc = castor_kernels::Nvrtc::from_env().ok().flatten();
    let compile = |variant: &str, plan: &TrainingPlan| {
        let program = lower_plan(plan).unwrap();
        let module = program
            .modules
            .into_iter()
            .find(|m| m.name == GENERATED_MODULE)
            .unwrap();
        assert!(module.generated.iter().any(|k| k.partials), "{variant}");
        if let Some(nvrtc) = &nvrtc {
            nvrtc
                .compile_kernel(
                    GENERATED_MODULE,
                    &module.source,
                    castor_kernels::DEFAULT_ARCH,
                )
                .unwrap_or_else(|e| panic!("{variant}: {e}\n{}", module.source));
        }
        module.source
    };
    for variant in ["llama_gqa", "gpt2_lm"] {
        let want_backward = if variant == "llama_gqa" { 4 } else { 0 };
        // Current scaling: the casts stay separate, but the scales end the units that make
        // their operands (the same operands as the delayed casts below).
        let plan = plan_of(variant, "fp8");
        assert!(
            tails(&plan).is_empty(),
            "{variant}: a current-scaling cast joined a unit"
        );
        let scales: Vec<String> = plan
            .kernel_units
            .iter()
            .filter_map(|u| match &u.kind {
                UnitKind::Pointwise(b) if b.amax.as_ref().is_some_and(|a| a.scale.is_some()) => {
                    Some(u.members.join(" + "))
                }
                _ => None,
            })
            .collect();
        let forward = scales.iter().filter(|m| m.ends_with(".x_scale")).count();
        let backward = scales.iter().filter(|m| m.ends_with(".dy_scale")).count();
        assert!(
            forward == 2 && backward == want_backward,
            "{variant}: {forward} forward and {backward} backward scales fused: {scales:?}"
        );
        compile(variant, &plan);

        let plan = plan_of(variant, "fp8:delayed");
        let fused = tails(&plan);
        for (members, body) in &fused {
            println!("{variant}: {members}");
            let amax = body.amax.as_ref().expect("the amax the history reads");
            assert!(
                members.ends_with(".x_fp8") || members.contains(".dy_fp8"),
                "{members}"
            );
            assert!(body.outputs.iter().any(|o| o.dtype.is_fp8()), "{members}");
            assert!(amax.value.ends_with("_amax"), "{members}");
        }
        // Forward: the down projection's (LLaMA) or the MLP projection's (GPT-2, eager GELU)
        // input, one per layer; backward: LLaMA's gate and up gradients. GPT-2's MLP gradient
        // is read by its bias gradient before the cast, so its unit cannot run at the cast.
        let forward = fused.iter().filter(|(m, _)| m.ends_with(".x_fp8")).count();
        let backward = fused.iter().filter(|(m, _)| m.contains(".dy_fp8")).count();
        assert!(
            forward == 2 && backward == want_backward,
            "{variant}: {forward} forward, {backward} backward"
        );
        if variant == "llama_gqa" {
            // The gated product is not stored, only its FP8 cast (and `silu(gate)`, which the
            // backward reads).
            let (members, body) = fused
                .iter()
                .find(|(m, _)| m.contains("down_proj.x_fp8"))
                .expect("the down projection's input cast is fused");
            let stored: Vec<&str> = body.outputs.iter().map(|o| o.value.as_str()).collect();
            assert!(
                stored.iter().all(|v| !v.ends_with("mlp.gated"))
                    && stored.iter().any(|v| v.ends_with("down_proj.x_fp8")),
                "{members}: {stored:?}"
            );
        }
        let source = compile(variant, &plan);
        assert!(source.contains("E4M3::encode"), "{variant}");
        assert_eq!(
            source.contains("E5M2::encode"),
            want_backward > 0,
            "{variant}"
        );
    }
}

/// The FP8 cast of a norm's output ends the norm's unit (`norm_fp8`), with the residual add
/// in front where the norm has one: under `fp8:delayed` the norm kernel writes the E4M3 values
/// and their amax (reduced by `fp8_amax_finalize`) and does not store the 16-bit output, which
/// only the cast read; under `fp8` it stores the output and its partial maxima, and
/// `fp8_scale_finalize` makes the scale the separate cast reads. Every layer's two norms (the
/// attention's and the MLP's input) do so in LLaMA (RMSNorm) and GPT-2 (LayerNorm); the final
/// norm, which the BF16 LM head reads, does not. The emulated plans of
/// `tests/cuda_emulated.rs` check the values.
#[test]
fn fp8_casts_of_norm_outputs_end_the_norm_units() {
    use castor_runtime::cuda::program::Arg;
    for variant in ["llama_gqa", "gpt2_lm"] {
        for (precision, tail) in [("fp8:delayed", ".x_fp8"), ("fp8", ".x_scale")] {
            let case = format!("{variant} {precision}");
            let plan = plan_at(variant, precision, 8).1;
            let units: Vec<&castor_ir::KernelUnit> = plan
                .kernel_units
                .iter()
                .filter(|u| u.kind == UnitKind::NormFp8)
                .collect();
            assert_eq!(units.len(), 4, "{case}: {units:?}");
            for u in &units {
                let last = u.members.last().unwrap();
                assert!(last.ends_with(tail), "{case}: {u}");
            }
            let norms: Vec<&str> = units
                .iter()
                .map(|u| u.members[u.members.len() - 2].as_str())
                .collect();
            let program = lower_plan(&plan).unwrap();
            let launches: Vec<_> = program
                .runs
                .iter()
                .flat_map(|r| &r.commands)
                .filter_map(|c| match c {
                    Command::Launch(l) => Some(l),
                    _ => None,
                })
                .collect();
            let fused: Vec<_> = launches
                .iter()
                .filter(|l| l.entry.contains("_fwd_fp8_"))
                .collect();
            assert_eq!(fused.len(), 4, "{case}");
            for l in &fused {
                assert!(norms.contains(&l.node.as_str()), "{case}: {}", l.node);
                let names = castor_runtime::cuda::families::signature(&l.entry)
                    .unwrap()
                    .names();
                let arg = |name: &str| &l.args[names.iter().position(|n| *n == name).unwrap()];
                let delayed = precision == "fp8:delayed";
                assert_eq!(
                    matches!(arg("y"), Arg::Null),
                    delayed,
                    "{case}: {} stores its 16-bit output",
                    l.node
                );
                assert_eq!(
                    matches!(arg("q"), Arg::Null),
                    !delayed,
                    "{case}: {}",
                    l.node
                );
            }
            // Each unit's tail runs in the norm kernel (no cast or amax kernel of its own), and
            // one finalizing kernel reduces the partial maxima: into the cast's amax (which
            // the history reads) or the scale.
            let (separate, finalize) = if precision == "fp8:delayed" {
                ("fp8_quantize_", "fp8_amax_finalize")
            } else {
                ("fp8_amax_", "fp8_scale_finalize")
            };
            if case == "llama_gqa fp8:delayed" {
                // A plan file whose norm unit ends with a cast of another value is refused.
                let mut bad = plan.clone();
                let unit = bad
                    .kernel_units
                    .iter_mut()
                    .find(|u| u.kind == UnitKind::NormFp8)
                    .unwrap();
                *unit.members.last_mut().unwrap() = "layers.0.self_attn.o_proj.x_fp8".into();
                let name = unit.name.clone();
                let e = lower_plan(&TrainingPlan::from_json(&bad.to_json()).unwrap())
                    .unwrap_err()
                    .to_string();
                assert!(
                    e.contains(&format!("kernel unit `{name}`"))
                        && e.contains("cannot run as one norm_fp8 unit"),
                    "{e}"
                );
            }
            for u in &units {
                let tail = u.members.last().unwrap();
                let reduced = tail.replace(".x_fp8", ".x_amax");
                assert!(
                    !launches
                        .iter()
                        .any(|l| l.entry.starts_with(separate) && &l.node == tail),
                    "{case}: {tail} has a kernel of its own"
                );
                assert_eq!(
                    launches
                        .iter()
                        .filter(|l| l.entry == finalize && l.node == reduced)
                        .count(),
                    1,
                    "{case}: {reduced}"
                );
            }
        }
    }
}

/// cuBLASLt's FP8 products take both operands with the inner dim last, so the lowering copies
/// an operand stored the other way; products that read the same elements share one copy
/// (LLaMA's q, k and v weight gradients read their input once, as the gate and up
/// projections' do): 18 copies a layer where each product copying its own made 21 (7 weights
/// for the input gradients, 7 output gradients and 4 inputs for the weight gradients). The
/// program roofline counts each copy's read and write, on top of its product's time.
#[test]
fn fp8_products_share_their_operand_copies_and_the_roofline_counts_them() {
    use castor_runtime::cuda::roofline::roofline_of;
    let plan = plan_at("llama_gqa", "fp8:delayed", 8).1;
    let program = lower_plan(&plan).unwrap();
    let micro = program.run("micro_step").unwrap();
    let copies: Vec<(String, i64)> = program.runs[micro]
        .commands
        .iter()
        .filter_map(|c| match c {
            Command::Launch(l) if l.entry.starts_with("strided_copy") => Some(l),
            _ => None,
        })
        .filter(|l| {
            let v = plan.micro_step.lookup(&l.node).unwrap();
            let node = plan.micro_step.node(plan.micro_step.value(v).producer);
            matches!(node.op, castor_ir::Op::Fp8MatMul { .. })
        })
        .map(|l| {
            let names = castor_runtime::cuda::families::signature(&l.entry)
                .unwrap()
                .names();
            let n = names.iter().position(|p| *p == "n").unwrap();
            let castor_runtime::cuda::program::Arg::I64(n) = l.args[n] else {
                panic!("{}: n is not an i64", l.entry)
            };
            (l.node.clone(), n)
        })
        .collect();
    assert_eq!(copies.len(), 2 * 18, "{copies:?}");
    let qkv = copies
        .iter()
        .filter(|(node, _)| node.starts_with("grad.model.layers.0.self_attn."))
        .filter(|(node, _)| {
            ["q_proj", "k_proj", "v_proj"]
                .iter()
                .any(|p| node.contains(p))
        })
        .count();
    // Each of q, k and v copies its output gradient; q alone copies the shared input.
    assert_eq!(qkv, 4, "{copies:?}");
    let copied: f64 = copies.iter().map(|(_, n)| 2.0 * *n as f64).sum();
    let with = roofline_of(&plan, &program, &castor_passes::cost::GpuSpec::h100_sxm()).unwrap();
    let mut without = program.clone();
    without.runs[micro]
        .commands
        .retain(|c| !matches!(c, Command::Launch(l) if l.entry.starts_with("strided_copy")));
    let base = roofline_of(&plan, &without, &castor_passes::cost::GpuSpec::h100_sxm()).unwrap();
    assert!(
        (with.micro_step.bytes - base.micro_step.bytes - copied).abs() < 0.5,
        "{} - {} != {copied}",
        with.micro_step.bytes,
        base.micro_step.bytes
    );
}
