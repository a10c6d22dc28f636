//! Snapshot tests of training plans: the micro step (forward, backward, gradient
//! accumulation) and the optimizer step (gradient norm, fused updates, step count, loss-scale
//! update) that `castor compile --train` builds from a hand-written IR file, with the
//! persistent-state table, for the fp32, fp16 and fp8 policies, for a plan that uses every
//! optimizer option, and for data-parallel plans under ZeRO-2 and ZeRO-3.

use crate::common;

use common::*;

fn plan_snapshot(name: &str, flags: &[&str]) {
    let mut args = vec![
        "compile",
        "tests/ir/training_step.ir",
        "--train",
        "--emit",
        "ir",
    ];
    args.extend_from_slice(flags);
    let o = castor(&args);
    assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
    insta::assert_snapshot!(name, stdout(&o), &flags.join(" "));
}

#[test]
fn fp32_adamw_plan() {
    plan_snapshot("train_fp32_adamw", &["--precision", "fp32"]);
}

#[test]
fn fp16_dynamic_loss_scaling_plan() {
    plan_snapshot("train_fp16_dynamic", &["--precision", "fp16"]);
}

/// FP8 products: E4M3 operands in the forward, the output gradients cast to E5M2 in the
/// backward, both gradient products on FP8 operands; the weights cast from their F32 masters.
#[test]
fn fp8_plan() {
    let args = [
        "compile",
        "tests/ir/fp8_products.ir",
        "--train",
        "--emit",
        "ir",
        "--precision",
        "fp8",
    ];
    let o = castor(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    insta::assert_snapshot!("train_fp8", stdout(&o), "fp8_products.ir --precision fp8");
}

/// Delayed scaling: the activations' and gradients' casts read their scales from state, and
/// each `amax_history` result is written back after every micro-batch.
#[test]
fn fp8_delayed_plan() {
    let args = [
        "compile",
        "tests/ir/fp8_products.ir",
        "--train",
        "--emit",
        "ir",
        "--precision",
        "fp8:delayed",
        "--amax-history",
        "4",
    ];
    let o = castor(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    insta::assert_snapshot!(
        "train_fp8_delayed",
        stdout(&o),
        "fp8_products.ir --precision fp8:delayed --amax-history 4"
    );
}

/// Bias add, GELU and their gradients in the products' epilogues (one rounding each).
#[test]
fn bf16_epilogues_plan() {
    plan_snapshot(
        "train_bf16_epilogues",
        &["--precision", "bf16", "--epilogues", "fused"],
    );
}

#[test]
fn every_optimizer_option() {
    plan_snapshot(
        "train_bf16_sgd_options",
        &[
            "--precision",
            "bf16",
            "--optimizer",
            "sgd",
            "--grad-accum",
            "2",
            "--grad-clip",
            "1.0",
            "--freeze",
            "ln.*",
            "--no-decay",
            "*bias",
            "--weight-decay",
            "0.1",
            "--loss-scale",
            "static:1024",
        ],
    );
}

/// Lion: one moment per parameter (`lion.exp_avg`), decoupled decay on the decayed
/// parameters only, BF16 moments.
#[test]
fn lion_plan() {
    plan_snapshot(
        "train_bf16_lion",
        &[
            "--precision",
            "bf16",
            "--optimizer",
            "lion",
            "--weight-decay",
            "0.1",
            "--no-decay",
            "*bias",
            "--optimizer-state",
            "bf16",
        ],
    );
}

/// ZeRO-2 on 4 ranks: each gradient reduce-scattered right after the backward completes it,
/// moments and the copied masters kept as shards, the global norm combined across ranks, the
/// updated BF16 copies gathered.
#[test]
fn zero2_plan() {
    plan_snapshot(
        "train_bf16_zero2",
        &["--precision", "bf16", "--world-size", "4", "--zero", "2"],
    );
}

/// ZeRO-3 on 4 ranks: every master and copy a shard, gathered right before the forward's
/// first use of it and gathered again (`.regathered`) before the backward's; the optimizer
/// step updates shards and gathers nothing.
#[test]
fn zero3_plan() {
    plan_snapshot(
        "train_bf16_zero3",
        &["--precision", "bf16", "--world-size", "4", "--zero", "3"],
    );
}

/// Dropout in a training plan (tests/ir/dropout.ir, bf16): the forward's dropout follows its
/// producer's dtype, and the backward applies the same dropout (same key, same stream) to the
/// gradient instead of saving a mask.
#[test]
fn dropout_plan() {
    let o = castor(&[
        "compile",
        "tests/ir/dropout.ir",
        "--train",
        "--emit",
        "ir",
        "--precision",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let plan = stdout(&o);
    let dropouts: Vec<&str> = plan.lines().filter(|l| l.contains("= dropout(")).collect();
    assert_eq!(dropouts.len(), 2, "{plan}");
    assert!(
        dropouts
            .iter()
            .all(|l| l.contains("%key) {p=0.1, stream=0}")),
        "{plan}"
    );
    insta::assert_snapshot!("train_bf16_dropout", plan);
}

/// Attention dropout inside the fused op (tests/ir/attention_dropout.ir, bf16): the forward's
/// `attention` and the backward's `attention_grad` carry the same `dropout=0.1, stream=0` and
/// read the same key last, so the backward regenerates the forward's mask.
#[test]
fn attention_dropout_plan() {
    let o = castor(&[
        "compile",
        "tests/ir/attention_dropout.ir",
        "--train",
        "--emit",
        "ir",
        "--precision",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let plan = stdout(&o);
    let ops: Vec<&str> = plan
        .lines()
        .filter(|l| l.contains("= attention(") || l.contains("= attention_grad("))
        .collect();
    assert_eq!(ops.len(), 2, "{plan}");
    assert!(
        ops.iter()
            .all(|l| l.contains("%key) {causal=true, scale=0.5, dropout=0.1, stream=0")),
        "{plan}"
    );
    insta::assert_snapshot!("train_bf16_attention_dropout", plan);
}
