//! Data-parallel plans (`--world-size`, `--zero`) run by CPU ranks against one rank training
//! on the same global batch.
//!
//! - For every family fixture whose loss is a mean (every one but the `sum` objective of the
//!   headless GPT-2 and BERT, where averaging over ranks is not the global batch's sum), ZeRO
//!   stages 0 to 3, 2 and 4 ranks: three F32 AdamW steps give the single rank's losses
//!   within 1e-5 relative error, the whole model's parameter update within 1e-4 (measured
//!   3.9e-5) and each tensor's within 5e-3 (measured 1.6e-3, Qwen2's key bias: under rotary
//!   embeddings its gradient is nearly zero, and AdamW scales rounding noise to full steps;
//!   the slices exactly zero in exact arithmetic, GPT-2's and BERT's key biases, are left
//!   out as in `train_vs_pytorch.rs`). The difference is summation order only (a rank sums its
//!   rows' gradient contributions, the group then averages the ranks' sums; one rank sums all
//!   rows at once): a few F32 ulps per gradient, which three steps carry into the updates.
//! - The ZeRO stages are the same arithmetic: stages 1, 2 and 3 give stage 0's state bit for
//!   bit (every element is the ranks' rank-ordered sum divided by the world size, whichever
//!   collective computes it; ZeRO-3's gathers reassemble the same parameters), with loss
//!   scaling skips and clipping off.
//! - The state saved from sharded ranks (gathered) has the single rank's names and shapes, and
//!   `castor train --world-size 2` on the CPU logs one rank's losses on the global batch,
//!   saves a whole checkpoint and resumes from it.
//! - Under dynamic loss scaling every rank skips the same steps and keeps the same scale.
//! - The per-rank planned state falls with the stage as the ZeRO paper's formulas say, and
//!   docs/commands.md's 7B example plans what it says.
//! - A launcher's group of processes (one rank each, as torchrun starts them) trains on the
//!   CPU exactly as one process running the ranks as threads, and rank 0 alone writes.

use crate::common;

use castor::precision::PrecisionArgs;
use castor::training::TrainingArgs;
use castor_ir::{DType, StateRole, Tensor, TrainingPlan};
use castor_models::{Model, Objective, ProblemType};
use castor_runtime::ranks::RankRunners;
use castor_runtime::PlanRunner;
use clap::Parser;
use common::*;
use std::collections::HashMap;

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    precision: PrecisionArgs,
    #[command(flatten)]
    training: TrainingArgs,
}

/// The headless fixtures, whose loss (`sum`) is not a mean over the batch.
const SUM_LOSS: [&str; 2] = ["gpt2_base", "bert_base"];

const SEQ: usize = 8;
/// Relative error of the ranks' parameter updates against the single rank's (see the module
/// docs).
const UPDATE_BOUND: f64 = 5e-3;
/// The same over the whole model's update as one vector.
const MODEL_BOUND: f64 = 1e-4;
const STEPS: usize = 3;

/// The training plan of `model` at `batch` x `SEQ` for these flags (all of them: precision
/// too), or the pass error that refuses it.
fn build(
    model: &Model,
    batch: usize,
    flags: &[&str],
) -> Result<TrainingPlan, castor_passes::PassError> {
    let mut argv = vec!["castor"];
    argv.extend_from_slice(flags);
    let flags = Flags::try_parse_from(argv).unwrap();
    let objective = Objective::auto(model);
    let graph = model.build_loss_graph(batch, SEQ, objective).unwrap();
    let lora = flags.training.lora(Some(model.family())).unwrap();
    let (graph, _) = castor::training::with_adapters(graph, lora.as_ref()).unwrap();
    let compiled = flags
        .precision
        .compile(graph, Some(model), None, false)
        .unwrap()
        .graph;
    let mut settings = flags
        .training
        .settings(flags.precision.precision, objective, batch, SEQ)
        .unwrap();
    settings.lora = lora;
    Ok(castor_passes::build_training_plan(&compiled, settings)?.0)
}

/// An F32 plan with `flags`.
fn plan(model: &Model, batch: usize, flags: &[&str]) -> TrainingPlan {
    let mut all = vec!["--precision", "fp32"];
    all.extend_from_slice(flags);
    build(model, batch, &all).unwrap()
}

/// A global batch of `rows` sequences, step `step`: seeded ids, no padding, every label
/// counted (so every rank's mean is over as many terms). The derived inputs (a decoder
/// classifier's last-token positions) are the runner's batch's to add: they index its rows.
fn global_batch(model: &Model, rows: usize, step: usize) -> Vec<HashMap<String, Tensor>> {
    let vocab = model.vocab_size() as u64;
    let mut seed = 0x5eed_0000 + step as u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seed >> 33
    };
    (0..rows)
        .map(|_| {
            let ids: Vec<i64> = (0..SEQ).map(|_| (next() % vocab) as i64).collect();
            let mut t = HashMap::new();
            for &name in model.input_names() {
                let values = match name {
                    "input_ids" => ids.clone(),
                    "attention_mask" => vec![1; SEQ],
                    _ => vec![0; SEQ],
                };
                t.insert(
                    name.to_string(),
                    Tensor::from_i64(DType::I64, [1, SEQ], values),
                );
            }
            let labels = match Objective::auto(model) {
                Objective::Classify => match model.labels().problem() {
                    ProblemType::Regression => {
                        let n = model.labels().num_labels;
                        let v = (0..n).map(|_| (next() % 1000) as f32 / 500.0 - 1.0);
                        Tensor::from_f32(DType::F32, [1, n], v.collect())
                    }
                    _ => {
                        let n = model.labels().num_labels as u64;
                        Tensor::from_i64(DType::I64, [1], vec![(next() % n) as i64])
                    }
                },
                _ => Tensor::from_i64(DType::I64, [1, SEQ], ids),
            };
            t.insert("labels".into(), labels);
            t
        })
        .collect()
}

/// Rows `rows` of single-row batches as one batch (concatenated along the batch axis).
fn stack(rows: &[HashMap<String, Tensor>]) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    for name in rows[0].keys() {
        let first = &rows[0][name];
        let mut shape = first.shape().dims().to_vec();
        shape[0] = rows.len();
        let t = match first.as_i64() {
            Some(_) => Tensor::from_i64(
                first.dtype(),
                shape,
                rows.iter()
                    .flat_map(|r| r[name].as_i64().unwrap().to_vec())
                    .collect(),
            ),
            None => Tensor::from_f32(
                first.dtype(),
                shape,
                rows.iter()
                    .flat_map(|r| r[name].as_f32().unwrap().to_vec())
                    .collect(),
            ),
        };
        out.insert(name.clone(), t);
    }
    out
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        d += (f64::from(*x) - f64::from(*y)).powi(2);
        n += f64::from(*y).powi(2);
    }
    d.sqrt() / n.sqrt().max(1e-30)
}

/// (losses, the state in the single-rank layout) after `STEPS` steps.
type Run = (Vec<f32>, HashMap<String, Tensor>);

fn single_rank(model: &Model, world: usize) -> Run {
    let plan = plan(model, world, &[]);
    let mut runner = PlanRunner::new(plan, &|n| model.load_param(n).ok()).unwrap();
    let losses = (0..STEPS)
        .map(|s| {
            let mut batch = stack(&global_batch(model, world, s));
            model.derive_inputs(&mut batch).unwrap();
            runner.step(&[batch], 1e-3).unwrap().loss
        })
        .collect();
    let state = runner
        .state_entries()
        .into_iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    (losses, state)
}

/// `STEPS` steps of `ranks` on global batches of `rows` rows: the losses, and the state in
/// the single-rank layout.
fn train_ranks(model: &Model, ranks: &mut RankRunners, rows: usize) -> Run {
    let losses = (0..STEPS)
        .map(|s| {
            let mut batch = global_batch(model, rows, s);
            for row in &mut batch {
                model.derive_inputs(row).unwrap();
            }
            ranks.step(&batch, 1e-3).unwrap().loss
        })
        .collect();
    (losses, ranks.state_entries().unwrap().into_iter().collect())
}

fn ranks(model: &Model, world: usize, zero: u8) -> Run {
    let (w, z) = (world.to_string(), zero.to_string());
    let plan = plan(model, 1, &["--world-size", &w, "--zero", &z]);
    let mut runners = RankRunners::new(plan, &|n| model.load_param(n).ok()).unwrap();
    train_ranks(model, &mut runners, world)
}

#[test]
fn ranks_train_as_one_rank_on_the_global_batch() {
    // The worst tensor's update error, and the worst model's (all updates as one vector).
    let mut worst = (0.0f64, String::new());
    let mut whole = (0.0f64, String::new());
    for variant in VARIANTS.into_iter().filter(|v| !SUM_LOSS.contains(v)) {
        let model = Model::load(fixture(variant)).unwrap();
        let info: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(variant).join("training.json")).unwrap(),
        )
        .unwrap();
        let noise = &info["zero_in_exact_arithmetic"];
        for world in [2, 4] {
            let (want_losses, want) = single_rank(&model, world);
            let initial: HashMap<String, Vec<f32>> = want
                .keys()
                .filter_map(|n| {
                    model
                        .load_param(n)
                        .ok()
                        .map(|t| (n.clone(), t.as_f32().unwrap().to_vec()))
                })
                .collect();
            let mut stage0: Option<HashMap<String, Tensor>> = None;
            for zero in [0u8, 1, 2, 3] {
                let (losses, got) = ranks(&model, world, zero);
                for (s, (a, b)) in losses.iter().zip(&want_losses).enumerate() {
                    let err = (f64::from(*a) - f64::from(*b)).abs() / f64::from(*b).abs();
                    assert!(
                        err < 1e-5,
                        "{variant} world {world} zero {zero} step {}: loss {a} vs {b}",
                        s + 1
                    );
                }
                let (mut all_got, mut all_want) = (Vec::new(), Vec::new());
                // Same names and shapes as the single rank's state.
                let mut names: Vec<&String> = got.keys().collect();
                let mut want_names: Vec<&String> = want.keys().collect();
                names.sort();
                want_names.sort();
                assert_eq!(names, want_names, "{variant} world {world} zero {zero}");
                for (name, w) in &want {
                    let g = &got[name];
                    assert_eq!(g.ty(), w.ty(), "{variant} {name}");
                    if let Some(init) = initial.get(name) {
                        // A master: compare the updates, without the slices whose gradient
                        // is zero in exact arithmetic (a key bias under softmax): theirs is
                        // rounding noise, which AdamW scales up to full-size steps.
                        let update = |t: &Tensor| -> Vec<f32> {
                            let mut u: Vec<f32> = t
                                .as_f32()
                                .unwrap()
                                .iter()
                                .zip(init)
                                .map(|(a, b)| a - b)
                                .collect();
                            if let Some(r) = noise[name].as_array() {
                                let (lo, hi) = (r[0].as_u64().unwrap(), r[1].as_u64().unwrap());
                                u[lo as usize..hi as usize].fill(0.0);
                            }
                            u
                        };
                        let (du, dw) = (update(g), update(w));
                        all_got.extend(&du);
                        all_want.extend(&dw);
                        let err = rel_err(&du, &dw);
                        if err > worst.0 {
                            worst = (err, format!("{variant} world {world} zero {zero} `{name}`"));
                        }
                    }
                }
                let err = rel_err(&all_got, &all_want);
                if err > whole.0 {
                    whole = (err, format!("{variant} world {world} zero {zero}"));
                }
                // The stages differ in what they keep, not in what they compute.
                match &stage0 {
                    None => stage0 = Some(got),
                    Some(s0) => {
                        for (name, t) in s0 {
                            assert_eq!(
                                t.as_f32(),
                                got[name].as_f32(),
                                "{variant} world {world}: ZeRO-{zero} `{name}` differs from ZeRO-0"
                            );
                        }
                    }
                }
            }
        }
    }
    println!("worst tensor update error {:.2e}: {}", worst.0, worst.1);
    println!("worst model update error {:.2e}: {}", whole.0, whole.1);
    assert!(
        worst.0 < UPDATE_BOUND,
        "update error {:.2e}: {}",
        worst.0,
        worst.1
    );
    assert!(
        whole.0 < MODEL_BOUND,
        "update error {:.2e}: {}",
        whole.0,
        whole.1
    );
}

/// The per-rank state of a plan by role.
fn per_rank(model: &Model, flags: &[&str]) -> HashMap<StateRole, u64> {
    let plan = plan(model, 1, flags);
    [
        StateRole::Master,
        StateRole::Gradient,
        StateRole::OptimizerState,
    ]
    .into_iter()
    .map(|r| (r, plan.state_bytes(r)))
    .collect()
}

/// ZeRO's memory formulas, per rank (Rajbhandari et al. 2020), for an F32 plan, whose micro
/// step reads the masters themselves, so they stay replicated up to stage 2 (the paper's F32
/// case): stage 0 keeps masters, gradients and AdamW's two moments whole; stage 1 keeps 1/N of
/// the moments; stage 2 also 1/N of the gradients; stage 3 also 1/N of the masters (each
/// shard rounded up to whole elements). Under bf16 stage 1 keeps 1/N of the masters the micro
/// step reads only through working copies, and stage 3 1/N of every master and working copy.
#[test]
fn per_rank_state_falls_with_the_stage_as_the_formulas_say() {
    let model = Model::load(fixture("llama_gqa")).unwrap();
    let single = per_rank(&model, &[]);
    for world in [2usize, 4, 8] {
        let w = world.to_string();
        let plan = plan(&model, 1, &["--world-size", &w]);
        // Every trained buffer's shard, rounded up as the plan rounds it.
        let shard_bytes = |role: StateRole| -> u64 {
            plan.state
                .iter()
                .filter(|s| s.role == role)
                .map(|s| 4 * s.ty.shape.numel().unwrap().div_ceil(world) as u64)
                .sum()
        };
        let grads = shard_bytes(StateRole::Gradient);
        let moments = shard_bytes(StateRole::OptimizerState);
        let masters = shard_bytes(StateRole::Master);
        for (zero, want) in [
            (
                0,
                [
                    single[&StateRole::Master],
                    single[&StateRole::Gradient],
                    single[&StateRole::OptimizerState],
                ],
            ),
            (
                1,
                [
                    single[&StateRole::Master],
                    single[&StateRole::Gradient],
                    moments,
                ],
            ),
            (2, [single[&StateRole::Master], grads, moments]),
            (3, [masters, grads, moments]),
        ] {
            let z = zero.to_string();
            let got = per_rank(&model, &["--world-size", &w, "--zero", &z]);
            assert_eq!(
                [
                    got[&StateRole::Master],
                    got[&StateRole::Gradient],
                    got[&StateRole::OptimizerState]
                ],
                want,
                "world {world} zero {zero}"
            );
        }
        // Under bf16, stage 1 shards the copied masters (all but the norm weights here).
        let bf16 = |zero: &str| {
            build(
                &model,
                1,
                &["--precision", "bf16", "--world-size", &w, "--zero", zero],
            )
            .unwrap()
            .state_bytes(StateRole::Master)
        };
        let (replicated, sharded) = (bf16("0"), bf16("1"));
        assert_eq!(replicated, single[&StateRole::Master]);
        assert!(
            sharded < replicated / world as u64 + replicated / 8,
            "{sharded} of {replicated}"
        );
        // Stage 3: every master and every BF16 copy, 1/N rounded up.
        let stage3 = build(
            &model,
            1,
            &["--precision", "bf16", "--world-size", &w, "--zero", "3"],
        )
        .unwrap();
        for (role, bytes) in [(StateRole::Master, 4), (StateRole::WorkingCopy, 2)] {
            let whole = |s: &castor_ir::StateSpec| s.shard_of.clone().unwrap_or(s.ty.clone());
            let want: u64 = stage3
                .state
                .iter()
                .filter(|s| s.role == role)
                .map(|s| bytes * whole(s).shape.numel().unwrap().div_ceil(world) as u64)
                .sum();
            assert!(want > 0, "{role:?}");
            assert_eq!(stage3.state_bytes(role), want, "world {world} {role:?}");
        }
        // Within a few bytes of rounding, 1/N.
        let n = world as f64;
        let moments_whole = single[&StateRole::OptimizerState] as f64;
        assert!((moments as f64 - moments_whole / n).abs() <= 4.0 * 2.0 * plan.state.len() as f64);
    }
}

#[test]
fn unsupported_combinations_are_refused() {
    let model = Model::load(fixture("gpt2_lm")).unwrap();
    for (flags, words) in [
        (
            &[
                "--world-size",
                "2",
                "--zero",
                "1",
                "--optimizer",
                "adafactor",
            ][..],
            "Adafactor",
        ),
        (
            &["--world-size", "2", "--update-in-backward"][..],
            "--update-in-backward",
        ),
    ] {
        let e = build(&model, 1, flags).unwrap_err();
        assert!(e.to_string().contains(words), "{flags:?}: {e}");
    }
}

/// `castor train --world-size 2` on the CPU: the ranks take consecutive windows of a
/// sequential stream, so two ranks of batch 4 see what one rank of batch 8 sees, and log its
/// losses (1e-5); the checkpoint they save is a whole one, which a resumed run shards again.
#[test]
fn train_runs_cpu_ranks_from_the_command_line() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, flags: &[&str]| {
        let log = tmp.path().join(format!("{name}.jsonl"));
        let config = root().join("assets").join("tiny-gpt2.json");
        let corpus = root().join("assets").join("corpus.txt");
        let mut args = vec![
            "train",
            path_str(&config),
            "--data",
            path_str(&corpus),
            "--seq",
            "32",
            "--data-order",
            "sequential",
            "--device",
            "cpu",
            "--log",
            path_str(&log),
        ];
        args.extend_from_slice(flags);
        let o = castor(&args);
        assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
        (log_losses(&log), stdout(&o))
    };
    let (one, _) = run("one", &["--steps", "6", "--batch", "8"]);
    let save = tmp.path().join("ranks");
    let (ranks, out) = run(
        "ranks",
        &[
            "--steps",
            "6",
            "--batch",
            "4",
            "--world-size",
            "2",
            "--zero",
            "2",
            "--save",
            path_str(&save),
        ],
    );
    assert!(out.contains("on each of 2 ranks (ZeRO-2)"), "{out}");
    assert_eq!(one.len(), ranks.len());
    for (a, b) in ranks.iter().zip(&one) {
        assert!((a - b).abs() / b.abs() < 1e-5, "{ranks:?} vs {one:?}");
    }
    // The saved moments are whole tensors, as one rank would save them.
    let optimizer =
        castor_models::SafetensorsFile::open(save.join("optimizer.safetensors")).unwrap();
    let m = optimizer
        .info("adamw.m.transformer.h.0.attn.c_attn.weight")
        .unwrap();
    assert_eq!(m.shape, [64, 192]);
    let (resumed, _) = run("resumed", &["--steps", "8", "--resume", path_str(&save)]);
    assert_eq!(resumed.len(), 2);
}

/// docs/commands.md's data-parallel example: LLaMA-2-7B, batch 1 x 4096, full recomputation, 8 H100s
/// with ZeRO-2 plan 28.3 GiB a GPU (115.5 GiB on one) and 79 ms of collectives a step.
/// Every ZeRO stage counts the whole model's parameters (the N of the 6N + 6LCT rule and of
/// the memory anatomy's bytes per parameter), though a stage-3 rank's micro step reads only
/// its shards: GPT-2 under stage 3 on two ranks counted 104.7M of 124.4M parameters.
#[test]
fn every_stage_counts_the_whole_models_parameters() {
    let model = Model::load(fixture("gpt2_lm")).unwrap();
    for precision in ["fp32", "bf16"] {
        let count = |zero: &str| {
            let flags = [
                "--precision",
                precision,
                "--world-size",
                "2",
                "--zero",
                zero,
            ];
            castor_passes::cost::param_count(&build(&model, 1, &flags).unwrap())
        };
        let whole = count("0");
        for zero in ["1", "2", "3"] {
            assert_eq!(count(zero), whole, "{precision}, stage {zero}");
        }
    }
}

#[test]
fn the_readme_7b_example_plans_what_it_says() {
    let config = root().join("assets/configs/llama-2-7b.json");
    let plan = |flags: &[&str]| {
        let mut args = vec![
            "compile",
            path_str(&config),
            "--train",
            "--precision",
            "bf16",
            "--batch",
            "1",
            "--seq",
            "4096",
            "--remat",
            "full",
            "--gpu",
            "h100",
        ];
        args.extend_from_slice(flags);
        let o = castor(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let gib = |out: &str| anatomy_total(out) as f64 / (1u64 << 30) as f64;
    let ranks = plan(&["--world-size", "8", "--zero", "2"]);
    assert_eq!(format!("{:.1}", gib(&ranks)), "29.3");
    assert_eq!(format!("{:.1}", gib(&plan(&[]))), "116.5");
    let network: f64 = ranks
        .lines()
        .find_map(|l| l.strip_prefix("  network      "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|ms| ms.parse().ok())
        .expect("a network line");
    assert_eq!(format!("{network:.0}"), "79", "{ranks}");
    // On their own stream the collectives hide behind compute, up to the optimizer's gathers.
    let ms = |line: &str, key: &str| -> f64 {
        let at = line
            .find(key)
            .unwrap_or_else(|| panic!("`{key}` in {line}"))
            + key.len();
        line[at..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let cost = |key: &str| {
        ranks
            .lines()
            .find(|l| l.contains(key))
            .map(|l| ms(l, key))
            .unwrap()
    };
    let (serial, overlapped) = (
        cost("step time    "),
        cost("overlapping compute, the step is "),
    );
    assert!(
        overlapped < serial && overlapped > serial - network,
        "{ranks}"
    );
    assert!(ranks.contains("NCCL collectives (one process per GPU under a launcher)"));
}

/// Dynamic loss scaling under ZeRO-2: an overflow on any rank (in any rank's shard) makes the
/// global norm non-finite on every rank, so every rank skips the same steps and every rank's
/// scaler moves alike. (Whether a step overflows can differ from one rank on the global batch:
/// each rank's gradient is the mean over fewer rows, as with PyTorch's DDP.)
#[test]
fn every_rank_skips_the_same_steps() {
    let model = Model::load(root().join("assets").join("tiny-gpt2.json")).unwrap();
    let init = model.init_params(0);
    let flags = ["--precision", "fp16", "--init-scale", "1048576"];
    let plan = build(
        &model,
        1,
        &[&flags[..], &["--world-size", "4", "--zero", "2"]].concat(),
    )
    .unwrap();
    let mut ranks = RankRunners::new(plan, &|n| init.get(n).cloned()).unwrap();
    let mut skipped = Vec::new();
    for s in 0..12 {
        let mut rows = global_batch(&model, 4, s);
        for row in &mut rows {
            model.derive_inputs(row).unwrap();
        }
        let report = ranks.step(&rows, 1e-3).unwrap();
        let control = |r: usize, c| ranks.rank(r).unwrap().control(c).unwrap();
        for r in 0..4 {
            use castor_ir::ControlState::{LossScale, Step};
            assert_eq!(control(r, LossScale), report.next_loss_scale, "rank {r}");
            assert_eq!(control(r, Step), control(0, Step), "rank {r}");
        }
        skipped.push(report.skipped);
    }
    // The large initial scale overflows first; the scale backs off until steps run.
    assert!(skipped[0] && skipped.contains(&false), "{skipped:?}");
    let steps = ranks.rank(0).unwrap().steps_taken().unwrap();
    assert_eq!(steps as usize, skipped.iter().filter(|s| !**s).count());
}

/// `torchrun --nproc-per-node 2 --no-python castor train ... --device cuda` starts two
/// processes, each one rank of the plan on its GPU with NCCL. On a machine without a GPU (this
/// one) a rank stops with exit code 5 before joining; the emulator, which runs one program
/// alone, is refused under a launcher. Running a GPU group needs GPUs and NCCL, which no test
/// here has: `cuda::nccl`'s unit tests check how each collective becomes NCCL calls.
#[test]
fn a_launched_group_on_gpus_needs_them() {
    let config = root().join("assets").join("tiny-gpt2.json");
    let corpus = root().join("assets").join("corpus.txt");
    let run = |device: &str| {
        std::process::Command::new(castor_bin())
            .args([
                "train",
                path_str(&config),
                "--data",
                path_str(&corpus),
                "--steps",
                "1",
                "--device",
                device,
            ])
            .envs([
                ("WORLD_SIZE", "2"),
                ("RANK", "1"),
                ("LOCAL_RANK", "1"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("CASTOR_RENDEZVOUS_TIMEOUT", "1"),
            ])
            .output()
            .unwrap()
    };
    let o = run("emulate");
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("rank 1 of 2") && e.contains("emulator"), "{e}");
    if castor_runtime::cuda_probe::probe().is_err() {
        let o = run("cuda");
        assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
        assert!(stderr(&o).contains("CUDA"), "{}", stderr(&o));
    }
}

/// A launcher's group of processes (`WORLD_SIZE`, `RANK`, ... as torchrun sets them) on the
/// CPU: each process trains its rank, the collectives going over TCP, and the group trains
/// exactly as one process running the same ranks as threads (`--world-size 2`): the same
/// logged losses, and rank 0 alone writes a checkpoint equal byte for byte, optimizer state
/// included. Resuming the group from it continues as the one process does. This is the path
/// a GPU group takes, with NCCL instead of TCP. A rank that never arrives is named, with exit
/// code 5.
#[test]
fn a_launched_group_of_processes_trains_as_cpu_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let config = root().join("assets").join("tiny-gpt2.json");
    let corpus = root().join("assets").join("corpus.txt");
    let args = |dir: &str, steps: &str, resume: bool| -> Vec<String> {
        let mut a: Vec<String> = [
            "train",
            path_str(&config),
            "--data",
            path_str(&corpus),
            "--seq",
            "32",
            "--batch",
            "4",
            "--precision",
            "bf16",
            "--zero",
            "3",
            "--device",
            "cpu",
            "--steps",
            steps,
        ]
        .map(String::from)
        .to_vec();
        let d = tmp.path().join(dir);
        a.extend(["--save".into(), d.display().to_string()]);
        a.extend([
            "--log".into(),
            tmp.path()
                .join(format!("{dir}.jsonl"))
                .display()
                .to_string(),
        ]);
        if resume {
            a.extend(["--resume".into(), d.display().to_string()]);
        }
        a
    };
    let group = |dir: &str, steps: &str, resume: bool| {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string();
        let ranks: Vec<_> = ["0", "1"]
            .into_iter()
            .map(|rank| {
                let mut a = args(dir, steps, resume);
                if rank == "1" {
                    // Only rank 0 writes: rank 1's log and checkpoint paths stay unwritten.
                    let log = a.iter().position(|x| x == "--log").unwrap();
                    a[log + 1] = tmp.path().join("rank1.jsonl").display().to_string();
                }
                std::process::Command::new(castor_bin())
                    .args(&a)
                    .envs([
                        ("WORLD_SIZE", "2"),
                        ("RANK", rank),
                        ("LOCAL_RANK", rank),
                        ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", port.as_str()),
                        ("CASTOR_RENDEZVOUS_TIMEOUT", "60"),
                    ])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for child in ranks {
            let o = child.wait_with_output().unwrap();
            assert!(o.status.success(), "{}", stderr(&o));
        }
    };
    let threads = |dir: &str, steps: &str, resume: bool| {
        let mut a = args(dir, steps, resume);
        a.extend(["--world-size".into(), "2".into()]);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let o = castor(&a);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    group("group", "3", false);
    threads("threads", "3", false);
    group("group", "5", true);
    threads("threads", "5", true);
    let losses = |name: &str| log_losses(&tmp.path().join(format!("{name}.jsonl")));
    assert_eq!(losses("group").len(), 5);
    assert_eq!(losses("group"), losses("threads"));
    assert!(!tmp.path().join("rank1.jsonl").exists());
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let read = |dir: &str| std::fs::read(tmp.path().join(dir).join(file)).unwrap();
        assert!(read("group") == read("threads"), "{file} differs");
    }

    // Rank 1 never starts: rank 0 names it and stops.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let a = args("alone", "1", false);
    let o = std::process::Command::new(castor_bin())
        .args(&a)
        .envs([
            ("WORLD_SIZE", "2"),
            ("RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
            ("CASTOR_RENDEZVOUS_TIMEOUT", "1"),
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("rank(s) [1] of 2 did not join"), "{e}");
    assert!(!tmp.path().join("alone").join("model.safetensors").exists());
}

/// A classifier's validation under CPU ranks: the ranks compute the loss and the accuracy
/// together (the micro step's collectives need every rank), and match one rank on the same
/// global batch: the same accuracy, the loss within 1e-4 (summation order, as above).
#[test]
fn a_classifier_is_evaluated_by_its_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let data = fixture("classify");
    let model = tmp.path().join("bert_cls");
    std::fs::create_dir(&model).unwrap();
    for f in std::fs::read_dir(fixture("bert_cls")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, model.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::copy(data.join("vocab.txt"), model.join("vocab.txt")).unwrap();
    let run = |name: &str, flags: &[&str]| {
        let log = tmp.path().join(format!("{name}.jsonl"));
        let train = data.join("train.jsonl");
        let val = data.join("val.csv");
        let mut args = vec![
            "train",
            path_str(&model),
            "--data",
            path_str(&train),
            "--validation",
            path_str(&val),
            "--steps",
            "4",
            "--lr",
            "3e-3",
            "--eval-every",
            "2",
            "--device",
            "cpu",
            "--log",
            path_str(&log),
        ];
        args.extend_from_slice(flags);
        let o = castor(&args);
        assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter_map(|v| Some((v["val_loss"].as_f64()?, v["val_accuracy"].as_f64()?)))
            .collect::<Vec<_>>()
    };
    let one = run("one", &["--batch", "16"]);
    let ranks = run(
        "ranks",
        &["--batch", "8", "--world-size", "2", "--zero", "2"],
    );
    assert_eq!(one.len(), 2);
    assert_eq!(ranks.len(), 2);
    for ((l1, a1), (l2, a2)) in one.iter().zip(&ranks) {
        assert_eq!(a1, a2, "{one:?} vs {ranks:?}");
        assert!((l1 - l2).abs() / l1.abs() < 1e-4, "{one:?} vs {ranks:?}");
    }
}

/// Gradient accumulation (each micro-batch's gradient reduced before it is added to the
/// entry, a shard under ZeRO-2 and 3) and LoRA adapters (the trained masters; the frozen base
/// stays whole on every rank) under every stage: the same state as ZeRO-0, bit for bit.
#[test]
fn accumulation_and_adapters_shard_as_any_state() {
    for variant in ["gpt2_lm", "llama_gqa"] {
        let model = Model::load(fixture(variant)).unwrap();
        for flags in [
            &["--grad-accum", "2", "--precision", "fp16"][..],
            &["--lora-rank", "4", "--precision", "bf16"],
        ] {
            let run = |zero: &str| {
                let all = [flags, &["--world-size", "2", "--zero", zero]].concat();
                let plan = build(&model, 1, &all).unwrap();
                // Adapters start from seeded values, whole (the ranks shard them).
                let mut seed = 7u64;
                let adapters: HashMap<String, Tensor> = plan
                    .state
                    .iter()
                    .filter(|s| s.role == StateRole::Master && model.load_param(&s.name).is_err())
                    .map(|s| {
                        let ty = s.shard_of.clone().unwrap_or(s.ty.clone());
                        let n = ty.shape.numel().unwrap();
                        let values = (0..n)
                            .map(|_| {
                                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
                            })
                            .collect();
                        (
                            s.name.clone(),
                            Tensor::from_f32(DType::F32, ty.shape, values),
                        )
                    })
                    .collect();
                assert_eq!(adapters.is_empty(), flags[0] != "--lora-rank", "{variant}");
                let rows = 2 * plan.settings.grad_accum;
                let mut ranks = RankRunners::new(plan, &|n| {
                    model
                        .load_param(n)
                        .ok()
                        .or_else(|| adapters.get(n).cloned())
                })
                .unwrap();
                train_ranks(&model, &mut ranks, rows).1
            };
            let stage0 = run("0");
            for zero in ["1", "2", "3"] {
                let got = run(zero);
                for (name, t) in &stage0 {
                    let g = got
                        .get(name)
                        .unwrap_or_else(|| panic!("{variant}: `{name}`"));
                    assert_eq!(
                        g.as_f32(),
                        t.as_f32(),
                        "{variant} {flags:?}: ZeRO-{zero} `{name}` differs from ZeRO-0"
                    );
                }
            }
        }
    }
}

/// The same from the command line: `train` starts a rank's adapters whole and shards them,
/// and accumulates sharded gradients.
#[test]
fn train_shards_adapters_and_accumulated_gradients_from_the_command_line() {
    let config = root().join("assets").join("tiny-gpt2.json");
    let corpus = root().join("assets").join("corpus.txt");
    for flags in [
        &["--lora-rank", "4", "--precision", "bf16", "--zero", "3"][..],
        &["--grad-accum", "2", "--precision", "fp16", "--zero", "2"],
    ] {
        let mut args = vec![
            "train",
            path_str(&config),
            "--data",
            path_str(&corpus),
            "--steps",
            "2",
            "--seq",
            "16",
            "--batch",
            "2",
            "--world-size",
            "2",
            "--device",
            "cpu",
        ];
        args.extend_from_slice(flags);
        let o = castor(&args);
        assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
    }
}

/// Ctrl-C to one process of a launched group: the ranks agree on the stop at every step, so
/// both finish the same step, gather the state together, and rank 0 saves it; both exit
/// with 130, as an interrupted run does.
#[test]
fn an_interrupt_on_one_rank_stops_the_whole_group() {
    use std::io::{BufRead, BufReader};
    let tmp = tempfile::tempdir().unwrap();
    let config = root().join("assets").join("tiny-gpt2.json");
    let corpus = root().join("assets").join("corpus.txt");
    let save = tmp.path().join("run");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let mut ranks: Vec<std::process::Child> = ["0", "1"]
        .into_iter()
        .map(|rank| {
            std::process::Command::new(castor_bin())
                .args([
                    "train",
                    path_str(&config),
                    "--data",
                    path_str(&corpus),
                    "--steps",
                    "100000",
                    "--seq",
                    "16",
                    "--batch",
                    "2",
                    "--device",
                    "cpu",
                    "--print-every",
                    "1",
                    "--save",
                    path_str(&save),
                ])
                .envs([
                    ("WORLD_SIZE", "2"),
                    ("RANK", rank),
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", port.as_str()),
                    ("CASTOR_RENDEZVOUS_TIMEOUT", "60"),
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Rank 1 has trained a few steps: interrupt it alone.
    let mut lines = BufReader::new(ranks[1].stdout.take().unwrap()).lines();
    let mut seen = 0;
    for line in lines.by_ref() {
        if line.unwrap().starts_with("step ") {
            seen += 1;
            if seen == 3 {
                break;
            }
        }
    }
    let kill = std::process::Command::new("kill")
        .args(["-INT", &ranks[1].id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    let interrupted_at = |text: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix("interrupted after step "))
            .and_then(|l| l.split(':').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no interruption in {text}"))
    };
    let one = interrupted_at(&rest.join("\n"));
    let r1 = ranks.pop().unwrap().wait_with_output().unwrap();
    assert_eq!(r1.status.code(), Some(130), "{}", stderr(&r1));
    let r0 = ranks.pop().unwrap().wait_with_output().unwrap();
    assert_eq!(r0.status.code(), Some(130), "{}", stderr(&r0));
    assert_eq!(interrupted_at(&stdout(&r0)), one);
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(save.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"].as_u64(), Some(one), "{state}");
}

/// The CUDA program of a data-parallel rank: each gradient reduction of the micro step runs on
/// the side stream, one at a time, and the compute stream joins every one before the run ends;
/// the gathers stay on the compute stream. (That the joins come early enough is checked by
/// the emulated ranks, `tests/emulate_cli.rs`.)
#[test]
fn gradient_reductions_overlap_the_backward_on_a_side_stream() {
    let config = root().join("assets").join("tiny-gpt2.json");
    for zero in ["0", "2", "3"] {
        let o = castor(&[
            "compile",
            path_str(&config),
            "--train",
            "--precision",
            "bf16",
            "--world-size",
            "2",
            "--zero",
            zero,
            "--emit",
            "cuda",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let text = stdout(&o);
        let mut runs = text.split("\nrun ").skip(1);
        let micro = runs.next().unwrap();
        assert!(micro.starts_with("micro_step"), "{micro}");
        let (mut in_flight, mut issued) = (None::<usize>, 0);
        for line in micro.lines() {
            if let Some(at) = line.find("on the side stream, event ") {
                assert!(line.contains("reduce"), "{line}");
                assert_eq!(in_flight, None, "two reductions in flight: {line}");
                let k: usize = line[at + 26..]
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert_eq!(k, issued, "{line}");
                in_flight = Some(k);
                issued += 1;
            } else if let Some(list) = line.trim().strip_prefix("join side events ") {
                assert_eq!(list, format!("[{}]", in_flight.take().unwrap()), "{line}");
            } else if line.contains("nccl all_gather") {
                assert!(!line.contains("side stream"), "{line}");
            }
        }
        assert!(issued > 0, "ZeRO-{zero}: no reduction on the side stream");
        assert_eq!(in_flight, None, "ZeRO-{zero}: a reduction is never joined");
        for run in runs {
            assert!(!run.contains("side stream"), "{run}");
        }
    }
}

/// Under bf16 the micro step reads working copies, so ZeRO-1 and 2 shard those masters too:
/// the micro step reads the copies as state, each rank updates its masters' shards and the
/// ranks gather only the BF16 copies. The stages still compute the same bits: every state
/// entry (gathered) equals ZeRO-0's, and the copies equal their masters rounded.
#[test]
fn sharded_masters_train_as_replicated_ones() {
    for variant in ["gpt2_lm", "llama_gqa", "bert_cls"] {
        let model = Model::load(fixture(variant)).unwrap();
        // Where one rank's forward part ends (before the fused classifier's chunks, or at
        // the loss).
        let single = build(&model, 1, &["--precision", "bf16", "--remat", "full"]).unwrap();
        let g = &single.micro_step;
        let (_, last) = g.nodes().nth(single.forward_nodes - 1).unwrap();
        let forward_end = g.name(last.outputs[0]).to_string();
        for world in [2usize, 4] {
            let w = world.to_string();
            let run = |zero: &str| {
                // Full recomputation too: it reads where the forward part ends.
                let plan = build(
                    &model,
                    1,
                    &[
                        "--precision",
                        "bf16",
                        "--remat",
                        "full",
                        "--world-size",
                        &w,
                        "--zero",
                        zero,
                    ],
                )
                .unwrap();
                // The forward part still ends where one rank's does.
                let g = &plan.micro_step;
                let (_, last) = g.nodes().nth(plan.forward_nodes - 1).unwrap();
                assert_eq!(g.name(last.outputs[0]), forward_end, "{variant}");
                if zero != "0" {
                    let masters = plan
                        .state
                        .iter()
                        .filter(|s| s.role == StateRole::Master && s.shard_of.is_some())
                        .count();
                    assert!(masters > 0, "{variant}: no master sharded");
                }
                let mut ranks = RankRunners::new(plan, &|n| model.load_param(n).ok()).unwrap();
                train_ranks(&model, &mut ranks, world).1
            };
            let stage0 = run("0");
            for zero in ["1", "2", "3"] {
                let got = run(zero);
                for (name, t) in &stage0 {
                    if let Some(g) = got.get(name) {
                        assert_eq!(
                            g.as_f32(),
                            t.as_f32(),
                            "{variant} world {world}: ZeRO-{zero} `{name}` differs from ZeRO-0"
                        );
                    }
                }
                let masters = stage0.keys().filter(|n| got.contains_key(*n)).count();
                assert!(
                    masters >= stage0.len() - 1,
                    "{variant}: state entries missing"
                );
            }
        }
    }
}
