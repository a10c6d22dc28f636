//! castor's optimizer ops against the libraries users trust for them, op by op on the CPU
//! executor, with references from tests/fixtures/optimizers/generate_optimizers.py:
//! - `adafactor`: three steps of transformers' `Adafactor` (F32, PyTorch CPU) on a matrix, a
//!   rank-3 tensor (factored second moments) and a vector (full ones), in four
//!   configurations (a given rate; the relative step; its warm-up; a first moment with weight
//!   decay and a lower clip threshold). The updates (after - before) and every state tensor
//!   agree within 1e-5 relative. The bound is not 0 because torch sums its means and norms in
//!   F32 and castor in F64;
//! - `--update-in-backward` trains the same weights and optimizer state as the ordinary plan,
//!   bit for bit, fp16 steps skipped on overflow included, and refuses accumulation.

mod common;

use castor_ir::{
    adafactor_moments, relative_error, DType, GraphBuilder, Op, Shape, Tensor, TensorType,
};
use castor_models::SafetensorsFile;
use castor_runtime::cpu::CpuExecutor;
use common::*;
use std::collections::HashMap;

const PARAMS: [&str; 3] = ["w", "e", "b"];

fn reference() -> (SafetensorsFile, serde_json::Value) {
    let dir = root().join("tests/fixtures/optimizers");
    let file = SafetensorsFile::open(dir.join("adafactor.safetensors")).unwrap();
    let text = std::fs::read_to_string(dir.join("adafactor.json")).unwrap();
    (file, serde_json::from_str(&text).unwrap())
}

/// The op for one of the reference's parameter groups.
fn adafactor_op(group: &serde_json::Value) -> Op {
    let f = |k: &str| group[k].as_f64().unwrap();
    let b = |k: &str| group[k].as_bool().unwrap();
    Op::Adafactor {
        beta1: group["beta1"].as_f64(),
        decay_rate: f("decay_rate"),
        eps1: group["eps"][0].as_f64().unwrap(),
        eps2: group["eps"][1].as_f64().unwrap(),
        clip_threshold: f("clip_threshold"),
        weight_decay: f("weight_decay"),
        relative_step: b("relative_step"),
        scale_parameter: b("scale_parameter"),
        warmup_init: b("warmup_init"),
        max_grad_norm: 0.0,
        copy: None,
    }
}

/// transformers' state names for a parameter of this shape, in the op's operand order.
fn state_names(shape: &Shape, first_moment: bool) -> Vec<&'static str> {
    let mut names = if first_moment {
        vec!["exp_avg"]
    } else {
        vec![]
    };
    if adafactor_moments(shape).len() == 2 {
        names.extend(["exp_avg_sq_row", "exp_avg_sq_col"]);
    } else {
        names.push("exp_avg_sq");
    }
    names
}

#[test]
fn adafactor_matches_transformers() {
    let (file, info) = reference();
    let steps = info["steps"].as_u64().unwrap() as usize;
    let scalar = TensorType::new(DType::F32, Shape::scalar());
    for (case, group) in info["cases"].as_object().unwrap() {
        let op = adafactor_op(group);
        let first_moment = group["beta1"].is_number();
        // One graph: every parameter's update from its master, gradient and state.
        let mut b = GraphBuilder::new("adafactor");
        let mut outputs = Vec::new();
        let mut shapes = HashMap::new();
        let controls: Vec<_> = ["lr", "step", "scale", "grad_norm"]
            .iter()
            .map(|n| b.input(n, scalar.clone()).unwrap())
            .collect();
        for p in PARAMS {
            let shape = Shape::from(
                info["shapes"][p]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize)
                    .collect::<Vec<_>>(),
            );
            let ty = TensorType::new(DType::F32, shape.clone());
            let mut ins = vec![
                b.input(p, ty.clone()).unwrap(),
                b.input(&format!("grad.{p}"), ty.clone()).unwrap(),
            ];
            let mut moment_shapes = if first_moment {
                vec![shape.clone()]
            } else {
                vec![]
            };
            moment_shapes.extend(adafactor_moments(&shape));
            for (s, ms) in state_names(&shape, first_moment).iter().zip(moment_shapes) {
                ins.push(
                    b.input(&format!("{s}.{p}"), TensorType::new(DType::F32, ms))
                        .unwrap(),
                );
            }
            ins.extend(&controls);
            outputs.extend(b.op_multi(&format!("{p}.next"), op.clone(), &ins).unwrap());
            shapes.insert(p, shape);
        }
        b.set_outputs(outputs);
        let g = b.finish();

        // Three steps, each feeding the last one's results back.
        let mut values: HashMap<String, Tensor> = HashMap::new();
        for p in PARAMS {
            let shape = &shapes[p];
            values.insert(
                p.into(),
                Tensor::from_f32(
                    DType::F32,
                    shape.clone(),
                    file.read_f32(&format!("init.{p}")).unwrap(),
                ),
            );
            let mut ms = if first_moment {
                vec![shape.clone()]
            } else {
                vec![]
            };
            ms.extend(adafactor_moments(shape));
            for (s, m) in state_names(shape, first_moment).iter().zip(ms) {
                let n = m.numel().unwrap();
                values.insert(
                    format!("{s}.{p}"),
                    Tensor::from_f32(DType::F32, m, vec![0.0; n]),
                );
            }
        }
        let lr = group["lr"].as_f64().unwrap_or(0.0) as f32;
        for step in 0..steps {
            for (n, v) in [
                ("lr", lr),
                ("step", step as f32),
                ("scale", 1.0),
                ("grad_norm", 1.0),
            ] {
                values.insert(
                    n.into(),
                    Tensor::from_f32(DType::F32, Shape::scalar(), vec![v]),
                );
            }
            for p in PARAMS {
                let grad = file.read_f32(&format!("grad.{step}.{p}")).unwrap();
                values.insert(
                    format!("grad.{p}"),
                    Tensor::from_f32(DType::F32, shapes[p].clone(), grad),
                );
            }
            let outs = CpuExecutor::new().run(&g, &|n| values.get(n)).unwrap();
            let mut outs = outs.into_iter();
            for p in PARAMS {
                values.insert(p.into(), outs.next().unwrap());
                for s in state_names(&shapes[p], first_moment) {
                    values.insert(format!("{s}.{p}"), outs.next().unwrap());
                }
            }
        }

        for p in PARAMS {
            let init = file.read_f32(&format!("init.{p}")).unwrap();
            let update = |after: &[f32]| -> Vec<f32> {
                after.iter().zip(&init).map(|(a, b)| a - b).collect()
            };
            let ours = update(values[p].as_f32().unwrap());
            let theirs = update(&file.read_f32(&format!("{case}.after.{p}")).unwrap());
            let err = relative_error(&ours, &theirs);
            println!("{case:12} {p}: update error {err:.2e}");
            assert!(
                err <= 1e-5,
                "{case} {p}: update relative error {err:.2e} > 1e-5"
            );
            for s in state_names(&shapes[p], first_moment) {
                let theirs = file.read_f32(&format!("{case}.{s}.{p}")).unwrap();
                let ours = values[&format!("{s}.{p}")].as_f32().unwrap();
                let err = relative_error(ours, &theirs);
                assert!(
                    err <= 1e-5,
                    "{case} {p}: {s} relative error {err:.2e} > 1e-5"
                );
            }
        }
    }
}

/// `castor train` on the embedded tiny GPT-2 for a few steps, saved to `save`.
fn train_tiny(save: &std::path::Path, flags: &[&str]) {
    let config = root().join("assets").join("tiny-gpt2.json");
    let corpus = root().join("assets").join("corpus.txt");
    let mut args = vec![
        "train",
        path_str(&config),
        "--data",
        path_str(&corpus),
        "--steps",
        "4",
        "--batch",
        "4",
        "--seq",
        "32",
        "--data-order",
        "sequential",
        "--device",
        "cpu",
        "--save",
        path_str(save),
    ];
    args.extend_from_slice(flags);
    let o = castor(&args);
    assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
}

/// Every tensor of `file` in both checkpoints, bit for bit (the per-tensor norm entry the
/// update-in-backward plan adds is its own).
fn same_tensors(a: &std::path::Path, b: &std::path::Path, file: &str, what: &str) -> usize {
    let (fa, fb) = (
        SafetensorsFile::open(a.join(file)).unwrap(),
        SafetensorsFile::open(b.join(file)).unwrap(),
    );
    let mut compared = 0;
    for name in fa.names() {
        if name.starts_with("update_in_backward.") {
            continue;
        }
        let (x, y) = (fa.read_f32(name).unwrap(), fb.read_f32(name).unwrap());
        let same = x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(
            same && x.len() == y.len(),
            "{what}: `{name}` in {file} differs"
        );
        compared += 1;
    }
    compared
}

/// With every gradient finite and no clipping, applying the updates inside the backward pass
/// trains exactly the weights and optimizer state of the ordinary plan (error 0): the update
/// ops are the same, and the per-tensor norms they read only decide clipping and the skip.
#[test]
fn updates_in_the_backward_equal_the_ordinary_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let runs: [&[&str]; 5] = [
        &["--precision", "fp32"],
        // Overflows from a scale of 2^40: the whole step is skipped in both plans, and the
        // scale backs off the same way (the loss-scale state is compared too).
        &["--precision", "fp16", "--init-scale", "1099511627776"],
        &["--precision", "bf16"],
        &["--precision", "bf16", "--optimizer", "adafactor"],
        &[
            "--precision",
            "bf16",
            "--optimizer",
            "sgd",
            "--optimizer-state",
            "bf16",
            "--remat",
            "full",
        ],
    ];
    for (i, flags) in runs.iter().enumerate() {
        let (plain, fused) = (
            tmp.path().join(format!("{i}a")),
            tmp.path().join(format!("{i}b")),
        );
        train_tiny(&plain, flags);
        let mut in_backward = flags.to_vec();
        in_backward.push("--update-in-backward");
        train_tiny(&fused, &in_backward);
        let what = format!("{flags:?}");
        let weights = same_tensors(&plain, &fused, "model.safetensors", &what);
        let state = same_tensors(&plain, &fused, "optimizer.safetensors", &what);
        println!("{what}: {weights} weights and {state} optimizer-state tensors bit-identical");
        assert!(weights > 0 && state > 0);
    }
}

/// What the option rules out is refused, naming why; with loss scaling the micro step forms
/// the global norm in a first backward pass.
#[test]
fn update_in_backward_refuses_accumulation_and_reruns_the_backward_for_loss_scaling() {
    let config = root().join("assets").join("tiny-gpt2.json");
    let compile = |extra: &[&str]| {
        let mut args = vec![
            "compile",
            path_str(&config),
            "--train",
            "--update-in-backward",
        ];
        args.extend_from_slice(extra);
        castor(&args)
    };
    let o = compile(&["--grad-accum", "2"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("cannot accumulate gradients over 2 micro-batches"),
        "{}",
        stderr(&o)
    );
    let o = compile(&["--precision", "bf16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("per-tensor norms for clipping and the found-inf skip"));
    let o = compile(&["--precision", "fp16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("a first backward pass forms the global norm"));
}

/// A flag of another optimizer than the chosen one would change nothing: an error naming it.
#[test]
fn flags_of_another_optimizer_are_refused() {
    let config = root().join("assets").join("tiny-gpt2.json");
    for (optimizer, flag, value, want) in [
        (
            "adafactor",
            "--momentum",
            "0.5",
            "--momentum is a setting of --optimizer sgd, not of --optimizer adafactor",
        ),
        (
            "adamw",
            "--decay-rate",
            "-0.5",
            "--decay-rate is a setting of --optimizer adafactor, not of --optimizer adamw",
        ),
        (
            "sgd",
            "--beta1",
            "0.8",
            "--beta1 is a setting of --optimizer adamw or adafactor, not of --optimizer sgd",
        ),
        (
            "adafactor",
            "--eps",
            "1e-6",
            "--eps is a setting of --optimizer adamw, not of --optimizer adafactor",
        ),
    ] {
        let o = castor(&[
            "compile",
            path_str(&config),
            "--train",
            "--optimizer",
            optimizer,
            flag,
            value,
        ]);
        assert!(!o.status.success(), "{optimizer} {flag}");
        assert!(stderr(&o).contains(want), "{}", stderr(&o));
    }
}

/// The README's recipe: full fine-tuning of LLaMA-2-7B (config only; every parameter
/// trained, F32 masters, batch 1 x 4096, bf16, selective recomputation) plans at most 76 GB
/// with Adafactor and the updates inside the backward pass, on the CUDA executor's memory
/// model. (Measured: 59,738,227,712 bytes.)
#[test]
fn llama_2_7b_full_fine_tuning_plans_within_76_gb() {
    let config = root().join("assets/configs/llama-2-7b.json");
    let o = castor(&[
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
        "selective",
        "--optimizer",
        "adafactor",
        "--update-in-backward",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("CUDA executor: kernel units"), "{out}");
    let total: u64 = out
        .lines()
        .find(|l| l.trim_start().starts_with("total "))
        .and_then(|l| l.split_whitespace().nth(1))
        .map(|b| b.replace(',', "").parse().unwrap())
        .unwrap_or_else(|| panic!("no anatomy total in\n{out}"));
    let gradients = out
        .lines()
        .find(|l| l.trim_start().starts_with("gradients "))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?");
    println!("LLaMA-2-7B planned peak {total} bytes; persistent gradients {gradients}");
    assert_eq!(gradients, "0", "{out}");
    assert!(total <= 76_000_000_000, "planned {total} bytes\n{out}");
}
