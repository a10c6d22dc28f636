//! Whole training runs with `castor train`, against references from
//! tests/fixtures/generate_trained.py:
//! - a checkpoint castor saves loads in transformers and gives castor's logits;
//! - the embedded tiny GPT-2 trained 300 steps on assets/corpus.txt converges in fp32, bf16 and
//!   fp16 (dynamic loss scaling) to within 3% of the fp32 run, which is within 3% of PyTorch;
//! - the same run converges with each optimizer choice (AdamW with BF16 moments, SGD with
//!   momentum, Lion, Adafactor with its relative step and with a given rate): the mean of the last
//!   ten losses under 60% of the first loss, and AdamW's BF16 moments within 3% of F32 ones;
//! - a run resumed from a checkpoint is bit-identical to the uninterrupted run (the ordinary
//!   plan, and Adafactor with the updates inside the backward pass).

use crate::common;

use castor_ir::relative_error;
use castor_models::SafetensorsFile;
use common::*;

fn train(args: &[&str]) -> String {
    let mut all = vec!["train"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--device", "cpu"]);
    let o = castor(&all);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
}

/// The mean of the last ten losses: one step's loss depends on its batch.
fn final_loss(losses: &[f64]) -> f64 {
    let tail = &losses[losses.len() - 10..];
    tail.iter().sum::<f64>() / tail.len() as f64
}

#[test]
fn saved_checkpoints_load_in_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let variants = [
        "gpt2_lm",
        "llama_tied",
        "bert_cls",
        "llama_cls",
        "qwen2_cls",
    ];
    for variant in variants.into_iter().chain(NEW_DECODERS) {
        let dir = fixture(variant);
        let input = dir.join("input.safetensors");
        let saved = tmp.path().join(variant);
        // The classifiers train on their reference labels (the batch the generator used).
        let data = batch_with_labels(variant, "classify", tmp.path());
        train(&[
            path_str(&dir),
            "--data",
            path_str(&data),
            "--steps",
            "3",
            "--save",
            path_str(&saved),
        ]);
        // Same tensor names, shapes and dtype as the checkpoint it started from.
        let before = SafetensorsFile::open(dir.join("model.safetensors")).unwrap();
        let after = SafetensorsFile::open(saved.join("model.safetensors")).unwrap();
        let names = |f: &SafetensorsFile| {
            let mut v: Vec<(String, Vec<usize>)> = f
                .tensors()
                .iter()
                .map(|(n, i)| (n.clone(), i.shape.clone()))
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(&before), names(&after), "{variant}: layout changed");
        // What from_pretrained reads to build the same class: the config as it was.
        let config = |d: &std::path::Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
        };
        let (was, is) = (config(&dir), config(&saved));
        for field in [
            "architectures",
            "id2label",
            "label2id",
            "problem_type",
            "pad_token_id",
        ] {
            assert_eq!(
                was.get(field),
                is.get(field),
                "{variant}: config field {field}"
            );
        }

        let out = tmp.path().join(format!("{variant}-logits.safetensors"));
        let o = eval(&saved, &input, &out, &["--device", "cpu"]);
        assert!(o.status.success(), "{variant}: {}", stderr(&o));
        let ours = SafetensorsFile::open(&out)
            .unwrap()
            .read_f32("logits")
            .unwrap();
        let theirs = SafetensorsFile::open(dir.join("trained_logits.safetensors"))
            .unwrap()
            .read_f32("logits")
            .unwrap();
        let err = relative_error(&ours, &theirs);
        println!("{variant}: logits of the saved checkpoint vs transformers: {err:.2e}");
        assert!(err < 1e-5, "{variant}: {err:.2e}");
    }
}

/// The embedded tiny GPT-2, 300 steps of 8 x 64 bytes of assets/corpus.txt in order, with
/// `flags`; the loss of every step, logged to `log`.
fn convergence_run(log: &std::path::Path, flags: &[&str]) -> Vec<f64> {
    let config = root().join("assets").join("tiny-gpt2.json");
    let corpus = root().join("assets").join("corpus.txt");
    let mut args = vec![
        path_str(&config),
        "--data",
        path_str(&corpus),
        "--steps",
        "300",
        "--batch",
        "8",
        "--seq",
        "64",
        "--data-order",
        "sequential",
        "--log",
        path_str(log),
    ];
    args.extend_from_slice(flags);
    train(&args);
    log_losses(log)
}

/// [`convergence_run`] for each (log file name in `dir`, flags), all at once: each run is a
/// process of its own that keeps about one and a half cores busy, so run one by one they
/// left the machine half idle at the end of the suite. The losses, in the order given.
fn convergence_runs(dir: &std::path::Path, runs: &[(String, Vec<&str>)]) -> Vec<Vec<f64>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .iter()
            .map(|(log, flags)| {
                let log = dir.join(log);
                scope.spawn(move || convergence_run(&log, flags))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

#[test]
fn tiny_gpt2_converges_in_every_precision() {
    let tmp = tempfile::tempdir().unwrap();
    let precisions = ["fp32", "bf16", "fp16"];
    let runs: Vec<(String, Vec<&str>)> = precisions
        .iter()
        .map(|&p| (format!("{p}.jsonl"), vec!["--precision", p]))
        .collect();
    let mut finals = Vec::new();
    for (precision, losses) in precisions.iter().zip(convergence_runs(tmp.path(), &runs)) {
        assert_eq!(losses.len(), 300);
        finals.push((precision, losses[0], final_loss(&losses)));
    }
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("convergence").join("torch_fp32.json")).unwrap(),
    )
    .unwrap();
    let torch: Vec<f64> = reference["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let torch_final = final_loss(&torch);
    let fp32 = finals[0].2;
    for (precision, first, last) in &finals {
        println!("{precision}: loss {first:.4} -> {last:.4} (mean of the last 10 steps)");
    }
    println!("PyTorch fp32: {:.4} -> {torch_final:.4}", torch[0]);
    assert!(
        (fp32 - torch_final).abs() / torch_final < 0.03,
        "fp32 {fp32:.4} vs PyTorch {torch_final:.4}"
    );
    for (precision, first, last) in &finals[1..] {
        assert!(*last < 0.6 * first, "{precision} did not learn");
        assert!(
            (last - fp32).abs() / fp32 < 0.03,
            "{precision} {last:.4} vs fp32 {fp32:.4}"
        );
    }
}

#[test]
fn tiny_gpt2_converges_with_every_optimizer() {
    let tmp = tempfile::tempdir().unwrap();
    let runs: [(&str, &[&str]); 7] = [
        ("adamw", &["--optimizer", "adamw"]),
        ("adamw8bit", &["--optimizer", "adamw8bit"]),
        (
            "adamw, bf16 moments",
            &["--optimizer", "adamw", "--optimizer-state", "bf16"],
        ),
        ("sgd, lr 0.1", &["--optimizer", "sgd", "--lr", "0.1"]),
        // Measured 5.59 -> 3.23 (0.58 of the first loss); AdamW reaches 0.49.
        ("lion, lr 1e-3", &["--optimizer", "lion", "--lr", "1e-3"]),
        ("adafactor, relative step", &["--optimizer", "adafactor"]),
        (
            "adafactor, lr 1e-3",
            &["--optimizer", "adafactor", "--lr", "1e-3"],
        ),
    ];
    let logged: Vec<(String, Vec<&str>)> = runs
        .iter()
        .enumerate()
        .map(|(i, (_, flags))| (format!("{i}.jsonl"), flags.to_vec()))
        .collect();
    let mut finals = Vec::new();
    for ((run, _), losses) in runs.iter().zip(convergence_runs(tmp.path(), &logged)) {
        assert_eq!(losses.len(), 300, "{run}");
        let (first, last) = (losses[0], final_loss(&losses));
        println!("{run:26} loss {first:.4} -> {last:.4} (mean of the last 10 steps)");
        assert!(
            last < 0.6 * first,
            "{run} did not learn: {first:.4} -> {last:.4}"
        );
        finals.push(last);
    }
    let f32_moments = finals[0];
    for (run, last) in [("8-bit", finals[1]), ("bf16", finals[2])] {
        assert!(
            (last - f32_moments).abs() / f32_moments < 0.03,
            "AdamW with {run} moments {last:.4} vs f32 moments {f32_moments:.4}"
        );
    }
}

#[test]
fn resumed_runs_are_bit_identical() {
    // The ordinary plan, Adafactor with the updates inside the backward pass (whose
    // settings, eps 1e-30 included, must read back exactly from the checkpoint), and state
    // stored in other dtypes than F32: 8-bit codes, BF16 moments; and FP8's delayed scales
    // with their amax histories.
    let options: [&[&str]; 5] = [
        &[],
        &["--optimizer", "adafactor", "--update-in-backward"],
        &["--optimizer", "adamw8bit"],
        &["--optimizer-state", "bf16"],
        &["--precision", "fp8:delayed", "--amax-history", "4"],
    ];
    for (k, options) in options.iter().enumerate() {
        resume_matches_straight_run(&format!("{k}"), options);
    }
}

/// Twelve steps straight, and six then six resumed, with `options` (fp16 unless they name a
/// precision): the same losses, weights and optimizer state.
fn resume_matches_straight_run(label: &str, options: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let config = root().join("assets").join("tiny-gpt2.json");
    let corpus = root().join("assets").join("corpus.txt");
    let common = |steps: &str, extra: &[&str]| {
        let mut args = vec![
            path_str(&config),
            "--data",
            path_str(&corpus),
            "--steps",
            steps,
            "--batch",
            "4",
            "--seq",
            "32",
            "--schedule",
            "cosine",
            "--warmup",
            "3",
        ];
        if !options.contains(&"--precision") {
            args.extend_from_slice(&["--precision", "fp16"]);
        }
        args.extend_from_slice(options);
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_string).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        train(&refs);
    };
    let (straight, half, resumed) = (
        tmp.path().join("straight"),
        tmp.path().join("half"),
        tmp.path().join("resumed"),
    );
    let log_a = tmp.path().join("a.jsonl");
    let log_b = tmp.path().join("b.jsonl");
    run(common(
        "12",
        &["--save", path_str(&straight), "--log", path_str(&log_a)],
    ));
    run(common(
        "6",
        &[
            "--save",
            path_str(&half),
            "--log",
            path_str(&log_b),
            "--total-steps",
            "12",
        ],
    ));
    // --steps is the total: the resumed run trains steps 7..12.
    run(common(
        "12",
        &[
            "--resume",
            path_str(&half),
            "--save",
            path_str(&resumed),
            "--log",
            path_str(&log_b),
            "--total-steps",
            "12",
        ],
    ));
    assert_eq!(log_losses(&log_a), log_losses(&log_b));
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let a = SafetensorsFile::open(straight.join(file)).unwrap();
        let b = SafetensorsFile::open(resumed.join(file)).unwrap();
        assert_eq!(a.len(), b.len());
        for name in a.names() {
            assert!(
                a.bytes(name).unwrap() == b.bytes(name).unwrap(),
                "{label} {file}: {name} differs"
            );
        }
    }
}

/// The tiny BERT classifier fixture, with the synthetic set's vocabulary, fine-tuned on
/// tests/fixtures/classify (the label is decided by one key word; chance is 1/3) and judged on
/// held-out examples it never trained on.
#[test]
fn a_classification_fine_tune_beats_chance_on_held_out_examples() {
    let tmp = tempfile::tempdir().unwrap();
    let model = copy_fixture("bert_cls");
    let data = fixture("classify");
    std::fs::copy(data.join("vocab.txt"), model.path().join("vocab.txt")).unwrap();
    let log = tmp.path().join("log.jsonl");
    let saved = tmp.path().join("saved");
    let out = train(&[
        path_str(model.path()),
        "--data",
        path_str(&data.join("train.jsonl")),
        "--validation",
        path_str(&data.join("val.csv")),
        "--steps",
        "40",
        "--batch",
        "16",
        "--lr",
        "3e-3",
        "--eval-every",
        "20",
        "--log",
        path_str(&log),
        "--save",
        path_str(&saved),
    ]);
    assert!(out.contains("objective classify"), "{out}");
    assert!(out.contains("192 labelled examples (3 labels"), "{out}");
    let evals: Vec<(f64, f64)> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| Some((v["val_loss"].as_f64()?, v["val_accuracy"].as_f64()?)))
        .collect();
    assert_eq!(evals.len(), 2, "evaluated at steps 20 and 40: {out}");
    let (loss, accuracy) = evals[1];
    println!("validation after 40 steps: loss {loss:.4}, accuracy {accuracy:.3}");
    assert!(accuracy > 0.8, "accuracy {accuracy} (chance 1/3)");
    assert!(
        loss < (3f64).ln(),
        "validation loss {loss} is no better than uniform"
    );
    assert!(out.contains("accuracy"), "{out}");
    // The saved classifier, with its tokenizer, labels a new text with its key word's label.
    let o = castor(&[
        "eval",
        path_str(&saved),
        "--text",
        "w3 w40 good w17",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let label_line = stdout(&o)
        .lines()
        .find(|l| l.starts_with("label"))
        .unwrap_or_default()
        .to_string();
    assert!(
        label_line.starts_with("label       positive"),
        "{}",
        stdout(&o)
    );
}

/// A masked-LM checkpoint fine-tuned as a classifier with `--labels`, as
/// `AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)` does: the pooler
/// and classifier it lacks are initialized (and said so), its MLM head goes unused, it learns
/// the synthetic set, and the saved checkpoint is a `BertForSequenceClassification` with the
/// label names and the new tensors (transformers loads it with that class: checked with
/// transformers 5.24 when this was written).
#[test]
fn a_masked_lm_checkpoint_becomes_a_classifier_with_a_new_head() {
    let tmp = tempfile::tempdir().unwrap();
    let model = copy_fixture("bert_mlm");
    let data = fixture("classify");
    std::fs::copy(data.join("vocab.txt"), model.path().join("vocab.txt")).unwrap();
    let log = tmp.path().join("log.jsonl");
    let saved = tmp.path().join("saved");
    let (train_set, val_set) = (data.join("train.jsonl"), data.join("val.csv"));
    let args = [
        "train",
        path_str(model.path()),
        "--labels",
        "negative,neutral,positive",
        "--data",
        path_str(&train_set),
        "--validation",
        path_str(&val_set),
        "--steps",
        "40",
        "--batch",
        "16",
        "--lr",
        "3e-3",
        "--eval-every",
        "40",
        "--log",
        path_str(&log),
        "--save",
        path_str(&saved),
        "--device",
        "cpu",
    ];
    let o = castor(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(
            "BertForSequenceClassification is a new head for this checkpoint: 4 initialized"
        ) && err.contains("bert.pooler.dense.weight")
            && err.contains("classifier.weight"),
        "{err}"
    );
    assert!(
        err.contains("not used by BertForSequenceClassification: cls.predictions"),
        "{err}"
    );
    let accuracy = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["val_accuracy"].as_f64())
        .next_back()
        .expect("a validation accuracy");
    assert!(accuracy > 0.8, "accuracy {accuracy} (chance 1/3)");

    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "BertForSequenceClassification");
    assert_eq!(config["id2label"]["2"], "positive");
    assert_eq!(config["label2id"]["neutral"], 1);
    let tensors = castor_models::SafetensorsFile::open(saved.join("model.safetensors")).unwrap();
    let names: Vec<&String> = tensors.tensors().keys().collect();
    for want in [
        "classifier.weight",
        "classifier.bias",
        "bert.pooler.dense.weight",
    ] {
        assert!(
            names.iter().any(|n| *n == want),
            "{want} not saved: {names:?}"
        );
    }
    assert!(!names.iter().any(|n| n.starts_with("cls.")), "{names:?}");
    // The saved classifier loads as one; asking it for another label count is an error.
    let o = castor(&[
        "eval",
        path_str(&saved),
        "--text",
        "w3 good w17",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = castor(&[
        "eval",
        path_str(&saved),
        "--num-labels",
        "4",
        "--text",
        "good",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("with 3 labels, not 4"),
        "{}",
        stderr(&o)
    );
    // A family castor has no classification head for says so.
    let o = castor(&[
        "compile",
        path_str(&fixture("gpt2_lm")),
        "--num-labels",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("no sequence classification head for gpt2"),
        "{}",
        stderr(&o)
    );
}

/// The plan line counts trained parameter buffers (those with a master), whatever the step
/// writes: with the update inside the backward the micro step also writes the new masters and
/// the optimizer state, and under LoRA the base is frozen.
#[test]
fn the_plan_line_counts_trained_parameters() {
    let model = fixture("gpt2_lm");
    let data = model.join("input.safetensors");
    let cases: [(&[&str], &str); 3] = [
        (&[], "28 of 28 parameter buffers trained;"),
        (
            &["--optimizer", "adafactor", "--update-in-backward"],
            "28 of 28 parameter buffers trained;",
        ),
        (
            &["--lora-rank", "4"],
            "4 of 32 parameter buffers trained (28 frozen);",
        ),
    ];
    for (flags, line) in cases {
        let mut args = vec![path_str(&model), "--data", path_str(&data), "--steps", "1"];
        args.extend_from_slice(flags);
        let out = train(&args);
        assert!(out.contains(line), "{flags:?}:\n{out}");
    }
}
