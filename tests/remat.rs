//! Rematerialization and memory planning:
//! - every family trains (and `eval --grad` differentiates) bit-identically under `--remat
//!   none|full|selective|budget`;
//! - snapshots of what each mode keeps and recomputes for a GPT-2 and a LLaMA fixture;
//! - blocks and the model shape come from the IR, not from value names;
//! - on GPT-2 124M (config only, B=8, T=1024, bf16, AdamW), under the CUDA executor's memory
//!   model: the arena stays within 5% of its lower bound in every mode; saved activations per layer beside Megatron-LM's counts; a
//!   sweep of budgets where every planned peak fits, recompute time never rises with the
//!   budget, and the minimum cut never recomputes more (in estimated time) than the former
//!   greedy sequence at the same budget.

use crate::common;

use castor_ir::{LossScaling, OptimizerKind, Remat, TrainSettings, TrainingPlan};
use castor_models::{Model, Objective, SafetensorsFile};
use castor_passes::{
    cost::{GpuSpec, StepCost},
    memory::{saved_activations, saved_per_block},
    precision_pipeline,
    remat::{self, BudgetSearch},
    Policy, Precision,
};
use castor_runtime::cuda::memory::CudaMemory;
use common::*;
use std::path::Path;

const FAMILIES: [&str; 6] = [
    "gpt2_lm",
    "gpt2_base",
    "bert_base",
    "bert_mlm",
    "llama_gqa",
    "llama_tied",
];

/// The bf16 AdamW training plan of a model folder or config at `batch` x `seq`.
fn plan(model: &Path, batch: usize, seq: usize, remat: Remat) -> TrainingPlan {
    try_plan(model, batch, seq, remat).unwrap()
}

fn try_plan(
    model: &Path,
    batch: usize,
    seq: usize,
    remat: Remat,
) -> Result<TrainingPlan, castor_passes::PassError> {
    let model = Model::load(model).unwrap();
    let objective = Objective::auto(&model);
    let g = model.build_loss_graph(batch, seq, objective).unwrap();
    let g = precision_pipeline(Policy::new(Precision::Bf16))
        .run(g)
        .unwrap()
        .graph;
    let settings = TrainSettings {
        precision: Precision::Bf16,
        objective: objective.to_string(),
        batch,
        seq,
        grad_accum: 1,
        optimizer: OptimizerKind::AdamW(castor_ir::AdamWHparams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }),
        max_grad_norm: 0.0,
        loss_scaling: LossScaling::None,
        frozen: vec![],
        no_decay: vec![],
        param_grads_in_compute_dtype: false,
        optimizer_state: castor_ir::DType::F32,
        update_in_backward: false,
        remat,
        classifier: castor_ir::Classifier::Eager,
        epilogues: castor_ir::Epilogues::Eager,
        lora: None,
        parallel: Default::default(),
        packed: false,
        unpadded: false,
        dropout: Default::default(),
    };
    castor::memory::pipeline(castor_runtime::ExecutorKind::Cuda)
        .build(&g, settings)
        .map(|(p, _)| p)
}

fn peak(p: &TrainingPlan) -> u64 {
    castor::memory::anatomy(castor_runtime::ExecutorKind::Cuda, p).total()
}

/// A budget halfway between the `none` and `full` peaks of a fixture.
fn midway_budget(variant: &str, batch: usize, seq: usize) -> u64 {
    let dir = fixture(variant);
    let none = plan(&dir, batch, seq, Remat::None);
    let full = plan(&dir, batch, seq, Remat::Full);
    (peak(&none) + peak(&full)) / 2
}

#[test]
fn every_mode_is_bit_identical_on_every_family() {
    let tmp = tempfile::tempdir().unwrap();
    for variant in FAMILIES {
        let dir = fixture(variant);
        // A model without a head trains only a named objective.
        let objective = match variant {
            "bert_mlm" => "mlm",
            v if v.ends_with("_base") => "sum",
            _ => "auto",
        };
        let input = if variant == "bert_mlm" {
            batch_with_labels(variant, "mlm", tmp.path())
        } else {
            dir.join("input.safetensors")
        };
        let shape = SafetensorsFile::open(&input).unwrap().tensors()["input_ids"]
            .shape
            .clone();
        let budget = format!("budget:{}", midway_budget(variant, shape[0], shape[1]));
        let mut reference: Option<(Vec<u8>, Vec<u8>)> = None;
        for mode in ["none", "full", "selective", budget.as_str()] {
            let saved = tmp
                .path()
                .join(format!("{variant}-{}", mode.replace(':', "_")));
            let o = castor(&[
                "train",
                path_str(&dir),
                "--data",
                path_str(&input),
                "--objective",
                objective,
                "--precision",
                "bf16",
                "--steps",
                "2",
                "--save",
                path_str(&saved),
                "--remat",
                mode,
                "--device",
                "cpu",
            ]);
            assert!(o.status.success(), "{variant} {mode}: {}", stderr(&o));
            let weights = std::fs::read(saved.join("model.safetensors")).unwrap();
            let grads_out = tmp
                .path()
                .join(format!("{variant}-{}-grads", mode.replace(':', "_")));
            let o = eval(
                &dir,
                &input,
                &grads_out,
                &[
                    "--grad",
                    "--objective",
                    objective,
                    "--precision",
                    "bf16",
                    "--remat",
                    mode,
                    "--device",
                    "cpu",
                ],
            );
            assert!(o.status.success(), "{variant} {mode} eval: {}", stderr(&o));
            let grads = std::fs::read(&grads_out).unwrap();
            match &reference {
                None => reference = Some((weights, grads)),
                Some((w, g)) => {
                    assert!(
                        *w == weights,
                        "{variant}: --remat {mode} trains different weights"
                    );
                    assert!(
                        *g == grads,
                        "{variant}: --remat {mode} gives other gradients"
                    );
                }
            }
        }
    }
}

/// What a mode keeps (saved activations) and recomputes, by name pattern across blocks.
fn decisions(variant: &str, mode: Remat) -> String {
    let p = plan(&fixture(variant), 2, 7, mode);
    let g = &p.micro_step;
    let (recomputed, cost) = remat::recomputed(g, &GpuSpec::default());
    let kept: Vec<castor_ir::Value> = saved_activations(g, p.forward_nodes)
        .iter()
        .map(|(v, _)| *v)
        .collect();
    let mut out = format!(
        "remat {mode}: peak {} bytes, recompute {} FLOP\nrecomputed:\n",
        peak(&p),
        cost.flops
    );
    for (k, c) in remat::group_counts(g, &recomputed) {
        out.push_str(&format!("  {k} x{c}\n"));
    }
    out.push_str("kept (read by the backward part):\n");
    for (k, c) in remat::group_counts(g, &kept) {
        out.push_str(&format!("  {k} x{c}\n"));
    }
    out
}

#[test]
fn remat_decisions() {
    for variant in ["gpt2_lm", "llama_gqa"] {
        let budget = Remat::Budget(midway_budget(variant, 2, 7));
        for (label, mode) in [
            ("none", Remat::None),
            ("full", Remat::Full),
            ("selective", Remat::Selective),
            ("budget", budget),
        ] {
            insta::assert_snapshot!(format!("remat_{variant}_{label}"), decisions(variant, mode));
        }
    }
}

/// The lines of `castor compile --train` that state what recomputation and the plan cost:
/// the remat line, the anatomy total and the FLOPs-per-token rule.
fn plan_facts(args: &[&str]) -> Vec<String> {
    let o = castor(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
        .lines()
        .filter(|l| {
            l.starts_with("remat ") || l.starts_with("  total ") || l.contains("FLOPs/token")
        })
        .map(str::to_string)
        .collect()
}

/// Structure comes from the model, not from names: a fixture's loss graph with every computed
/// value renamed to an opaque name (sources keep their binding names), written as an IR file,
/// recomputes as many values under `--remat full` and plans the same memory and FLOPs as the
/// model itself (the blocks and the model shape travel in the IR text).
#[test]
fn recomputation_and_cost_read_structure_not_names() {
    let tmp = tempfile::tempdir().unwrap();
    for variant in ["gpt2_lm", "llama_gqa"] {
        let dir = fixture(variant);
        let model = Model::load(&dir).unwrap();
        let mut g = model.build_loss_graph(2, 7, Objective::Lm).unwrap();
        let computed: Vec<castor_ir::Value> = g
            .nodes()
            .filter(|(_, d)| !d.op.is_source())
            .flat_map(|(_, d)| d.outputs.clone())
            .collect();
        for v in computed {
            g.rename(v, &format!("t{}", v.index())).unwrap();
        }
        let text = castor_ir::text::print(&g);
        assert!(
            !text.contains("%h.0.") && !text.contains("%layers.0."),
            "{text}"
        );
        assert!(text.contains("block=1}") && text.contains("  model {layers="));
        let ir = tmp.path().join(format!("{variant}.ir"));
        std::fs::write(&ir, text).unwrap();
        let common = ["--train", "--precision", "bf16", "--remat", "full"];
        // The library builds the attention eagerly; the CLI is told to as well.
        let mut by_model = vec![
            "compile",
            path_str(&dir),
            "--batch",
            "2",
            "--seq",
            "7",
            "--attention",
            "eager",
        ];
        by_model.extend(common);
        let mut by_file = vec!["compile", path_str(&ir)];
        by_file.extend(common);
        let (a, b) = (plan_facts(&by_model), plan_facts(&by_file));
        assert_eq!(a.len(), 3, "{a:?}");
        assert_eq!(a, b, "{variant}: the renamed IR file plans differently");
        assert!(!a[0].contains(": 0 value(s)"), "{a:?}");
    }
}

#[test]
fn recomputed_nodes_carry_notes_and_an_impossible_budget_names_the_smallest() {
    let p = plan(&fixture("gpt2_lm"), 2, 7, Remat::Selective);
    let text = castor_ir::text::print(&p.micro_step);
    assert!(text.contains("%h.0.attn.probs.remat: bf16[2,4,7,7] = softmax("));
    assert!(text.contains("# remat: recomputes %h.0.attn.probs for %"));
    let err = try_plan(&fixture("gpt2_lm"), 2, 7, Remat::Budget(1000))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("smallest simulated peak"), "{err}");
    let smallest: u64 = err
        .rsplit("budget:")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    let p = plan(&fixture("gpt2_lm"), 2, 7, Remat::Budget(smallest));
    assert!(peak(&p) <= smallest);
}

const GPT2_124M: &str = "assets/configs/gpt2-124m.json";

#[test]
fn gpt2_124m_arena_activations_and_budget_sweep() {
    let config = root().join(GPT2_124M);
    let (b, t, h) = (8usize, 1024usize, 768usize);
    let sbh = (b * t * h) as f64;
    println!("GPT-2 124M, B={b}, T={t}, bf16, AdamW");
    println!(
        "| remat | arena | lower bound | arena/bound | peak | saved/layer (block 5) | x s·b·h | Megatron-LM |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut none_peak = 0;
    for (mode, megatron) in [
        (Remat::None, "34 + 5·a·s/h = 114"),
        (Remat::Selective, "34"),
        (Remat::Full, "2"),
    ] {
        let p = plan(&config, b, t, mode);
        let a = castor::memory::anatomy(castor_runtime::ExecutorKind::Cuda, &p);
        let m = &a.memory;
        assert!(
            m.arena_bytes as f64 <= 1.05 * m.lower_bound as f64,
            "{mode}: arena {} vs lower bound {}",
            m.arena_bytes,
            m.lower_bound
        );
        let (per, _) = saved_per_block(&p.micro_step, p.forward_nodes);
        let block5 = per.iter().find(|(i, _)| *i == 5).map_or(0, |(_, b)| *b);
        if mode == Remat::None {
            none_peak = a.total();
        }
        println!(
            "| {mode} | {} | {} | {:.4} | {} | {} | {:.1} | {megatron} |",
            m.arena_bytes,
            m.lower_bound,
            m.ratio(),
            a.total(),
            block5,
            block5 as f64 / sbh
        );
    }

    // The smallest feasible budget, from the error of an impossible one.
    let err = try_plan(&config, b, t, Remat::Budget(1))
        .err()
        .unwrap()
        .to_string();
    let smallest: u64 = err
        .rsplit("budget:")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(smallest < none_peak);
    // The same sweep under the former greedy sequence, from the plan without recomputation.
    let none = plan(&config, b, t, Remat::None);
    let gpu = GpuSpec::default();
    let ctx = remat::RematContext::of_plan(&none, gpu.clone(), &CudaMemory);
    println!();
    println!(
        "| budget | min-cut peak | recomputed values | recompute FLOP | recompute ms (est.) | candidates planned | greedy peak | greedy ms (est.) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut last_secs = f64::INFINITY;
    for i in 0..10 {
        let budget = smallest + (none_peak - smallest) * i / 9;
        let p = plan(&config, b, t, Remat::Budget(budget));
        let a = castor::memory::anatomy(castor_runtime::ExecutorKind::Cuda, &p);
        assert!(a.total() <= budget, "budget {budget}: peak {}", a.total());
        let cost = StepCost::of_plan(&p, &gpu);
        let secs = cost.recompute_seconds();
        assert!(
            secs <= last_secs,
            "recompute time rose from {last_secs} to {secs} at budget {budget}"
        );
        last_secs = secs;
        let mincut =
            remat::fit_budget(&none.micro_step, &ctx, budget, BudgetSearch::MinCut).unwrap();
        assert_eq!(
            mincut.graph, p.micro_step,
            "the pass runs the min-cut search"
        );
        let greedy = remat::fit_budget(&none.micro_step, &ctx, budget, BudgetSearch::Greedy);
        let (greedy_peak, greedy_secs) = match &greedy {
            Ok(o) => (o.peak.unwrap_or(0).to_string(), o.cost.seconds),
            Err(_) => ("does not fit".into(), f64::INFINITY),
        };
        assert!(
            mincut.cost.seconds <= greedy_secs,
            "budget {budget}: the min-cut recomputes {} s, the greedy sequence {greedy_secs} s",
            mincut.cost.seconds
        );
        println!(
            "| {budget} | {} | {} | {:.3e} | {:.3} | {} | {greedy_peak} | {:.3} |",
            a.total(),
            mincut.recomputed.len(),
            mincut.cost.flops,
            secs * 1e3,
            mincut.evaluated,
            greedy_secs * 1e3
        );
    }
}
