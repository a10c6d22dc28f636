//! The training plan's typed contract: control entries are named once (`ControlState`), a
//! renamed or missing one is an error when a plan is checked, loaded or run (never a silent
//! scale of 1.0); the precision is stored typed, and the plan's settings are its one carrier
//! (the policy is built from them); the forward extent travels with the plan, so `train
//! --plan` reports the planned memory of a plan file.

use crate::common;

use castor_ir::{
    text, verify, ControlState, LossScaling, OptimizerKind, Precision, Remat, TrainSettings,
    TrainingPlan,
};
use castor_passes::{build_training_plan, precision_pipeline, Policy};
use castor_runtime::{PlanRunner, RuntimeError};
use common::*;

fn settings(precision: Precision, loss_scaling: LossScaling) -> TrainSettings {
    TrainSettings {
        precision,
        objective: "first-output".into(),
        batch: 1,
        seq: 6,
        grad_accum: 1,
        optimizer: OptimizerKind::AdamW(castor_ir::AdamWHparams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }),
        max_grad_norm: 1.0,
        loss_scaling,
        frozen: vec![],
        no_decay: vec![],
        param_grads_in_compute_dtype: false,
        optimizer_state: castor_ir::DType::F32,
        update_in_backward: false,
        remat: Remat::None,
        classifier: castor_ir::Classifier::Eager,
        epilogues: castor_ir::Epilogues::Eager,
        lora: None,
        parallel: Default::default(),
        packed: false,
        unpadded: false,
        dropout: Default::default(),
    }
}

/// The plan of `tests/ir/training_step.ir` under fp16 with dynamic loss scaling.
fn fp16_plan() -> TrainingPlan {
    let src = std::fs::read_to_string(root().join("tests/ir/training_step.ir")).unwrap();
    let g = text::parse(&src).unwrap();
    verify(&g).unwrap();
    let g = precision_pipeline(Policy::new(Precision::Fp16))
        .run(g)
        .unwrap()
        .graph;
    let scaling = LossScaling::Dynamic {
        init_scale: 65536.0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 2000,
        hysteresis: 1,
        max_scale: 16777216.0,
        min_scale: 1.0,
    };
    build_training_plan(&g, settings(Precision::Fp16, scaling))
        .unwrap()
        .0
}

/// Renames the control entry `c` in the state table, the graphs that read it and the writes.
fn rename_control(plan: &mut TrainingPlan, c: ControlState, to: &str) {
    for s in plan.state.iter_mut().filter(|s| s.name == c.name()) {
        s.name = to.into();
    }
    for g in [&mut plan.micro_step, &mut plan.optimizer_step] {
        if let Some(v) = g.lookup(c.name()) {
            g.rename(v, to).unwrap();
        }
    }
    for w in plan
        .micro_step_writes
        .iter_mut()
        .chain(plan.optimizer_step_writes.iter_mut())
        .filter(|w| w.state == c.name())
    {
        w.state = to.into();
    }
}

/// `compile_plan` builds the policy from the settings' precision: flags that said another
/// precision give their rules, never the plan's dtypes, so the plan's graphs and its recorded
/// precision cannot disagree.
#[test]
fn a_plans_precision_is_its_settings() {
    use castor::precision::{Attention, PrecisionArgs, Residual};
    let model = castor_models::Model::load(root().join("assets").join("tiny-gpt2.json")).unwrap();
    let flags = PrecisionArgs {
        precision: Precision::Fp32,
        policy: None,
        keep_f32: vec!["logits".into()],
        force_low: Vec::new(),
        keep_bf16: Vec::new(),
        fp8_skip_first_last: false,
        amax_history: None,
        attention: Attention::Eager,
        residual: Residual::F32,
    };
    let mut settings = settings(Precision::Bf16, LossScaling::None);
    settings.objective = "lm".into();
    settings.seq = 8;
    let planned = castor::training::compile_plan(
        &flags,
        &model,
        settings,
        false,
        castor_runtime::ExecutorKind::Cpu,
    )
    .unwrap();
    assert_eq!(planned.plan.settings.precision, Precision::Bf16);
    let g = &planned.plan.micro_step;
    let bf16 = g
        .values()
        .filter(|(_, v)| v.ty.dtype == castor_ir::DType::BF16)
        .count();
    assert!(bf16 > 0, "the bf16 plan has no bf16 values");
    // The flags' rule still applies: the head's product stays F32.
    let logits = g.lookup("logits").unwrap();
    assert_eq!(g.ty(logits).dtype, castor_ir::DType::F32);
}

#[test]
fn the_plan_records_precision_and_forward_extent() {
    let plan = fp16_plan();
    assert_eq!(plan.settings.precision, Precision::Fp16);
    let json = plan.to_json();
    assert!(json.contains("\"precision\": \"fp16\""), "{json}");
    let back = TrainingPlan::from_json(&json).unwrap();
    assert_eq!(back, plan);
    // The forward part is the loss graph: its last node computes the loss, the first output.
    let loss = plan.micro_step.outputs()[0];
    assert_eq!(
        plan.micro_step.value(loss).producer.index() + 1,
        plan.forward_nodes
    );
    for c in ControlState::ALL {
        let spec = plan.control(c).unwrap();
        assert_eq!(spec.ty, c.ty());
    }
}

#[test]
fn a_renamed_control_entry_is_an_error_everywhere() {
    for c in ControlState::ALL {
        let mut plan = fp16_plan();
        rename_control(&mut plan, c, "scaler.renamed");
        let err = plan.check().unwrap_err().to_string();
        assert!(
            err.contains("`scaler.renamed` has role control but is no control entry"),
            "{c}: {err}"
        );
        let err = TrainingPlan::from_json(&plan.to_json())
            .unwrap_err()
            .to_string();
        assert!(err.contains("scaler.renamed"), "{c}: {err}");
        let err = PlanRunner::new(plan, &|_| None).err().unwrap();
        assert!(
            matches!(&err, RuntimeError::Plan(m) if m.contains("scaler.renamed")),
            "{c}: {err}"
        );
    }
}

#[test]
fn a_missing_control_entry_is_an_error() {
    let mut plan = fp16_plan();
    plan.state
        .retain(|s| s.name != ControlState::LossScale.name());
    let err = plan.check().unwrap_err().to_string();
    assert!(err.contains("`loss_scale`"), "{err}");
    assert!(plan.control(ControlState::LossScale).is_err());
    // The counters may be left out only where no dynamic scaling reads them.
    let mut plan = fp16_plan();
    plan.state
        .retain(|s| s.name != ControlState::LossScaleCounters.name());
    let err = plan.check().unwrap_err().to_string();
    assert!(
        err.contains("no control entry `loss_scale.counters`"),
        "{err}"
    );
}

#[test]
fn an_unknown_precision_or_old_format_is_refused() {
    let json = fp16_plan().to_json();
    let err = TrainingPlan::from_json(&json.replace("\"fp16\"", "\"fp12\""))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown precision `fp12`"), "{err}");
    let err =
        TrainingPlan::from_json(&json.replace(castor_ir::PLAN_FORMAT, "castor-training-plan/1"))
            .unwrap_err()
            .to_string();
    assert!(err.contains("castor-training-plan/1"), "{err}");
}

#[test]
fn train_with_a_plan_file_reports_its_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("gpt2_lm");
    let plan = tmp.path().join("plan.json");
    let o = castor(&[
        "compile",
        path_str(&dir),
        "--precision",
        "bf16",
        "--batch",
        "2",
        "--seq",
        "7",
        "--emit",
        "plan",
        "-o",
        path_str(&plan),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = castor(&[
        "train",
        path_str(&dir),
        "--data",
        path_str(&dir.join("input.safetensors")),
        "--plan",
        path_str(&plan),
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let line = out
        .lines()
        .find(|l| l.starts_with("memory "))
        .unwrap_or_else(|| panic!("no memory line in:\n{out}"));
    let p = TrainingPlan::from_json(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let a = castor::memory::anatomy(castor_runtime::ExecutorKind::Cpu, &p);
    assert!(
        line.contains(&format!(
            "{} planned per step",
            castor_ir::human_bytes(a.total())
        )),
        "{line}"
    );
    assert!(a.saved_activations > 0);
}
