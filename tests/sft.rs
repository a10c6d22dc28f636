//! Supervised fine-tuning data against TRL's `SFTTrainer` (tests/fixtures/generate_sft.py):
//! for conversations (the model's chat template with `{% generation %}` blocks),
//! prompt-completion pairs and conversational prompt-completion pairs, with the loss on the
//! completion and on every token, each example's token ids and labels are TRL's exactly,
//! after TRL's truncation to 48 tokens and with the examples TRL drops dropped; packed
//! (`--pack`), the rows are TRL's `packing=True` rows with the ids, labels and positions of its
//! padding-free collator, and best-fit-decreasing packing places 2,500 examples exactly as
//! TRL's `pack_dataset` does (tests/fixtures/generate_sft_packing.py); then a short run trains
//! on each file from the CLI.

use crate::common;

use castor::training::data::sft::LossOn;
use castor::training::data::{Data, DataOptions, DataOrder};
use castor_models::{Model, Objective};
use common::*;

fn sft_dir() -> std::path::PathBuf {
    root().join("tests/fixtures/sft")
}

/// `file` of the SFT fixtures read in order, one example (or packed row) per batch, with the
/// loss on `loss` (`completion` or `all`).
fn one_per_batch(model: &Model, file: &str, loss: &str, seq: usize) -> Data {
    let loss_on = match loss {
        "completion" => LossOn::Completion,
        _ => LossOn::All,
    };
    let options = DataOptions {
        batch: Some(1),
        seq: Some(seq),
        order: DataOrder::Sequential,
        loss_on,
        ..Default::default()
    };
    Data::open(&sft_dir().join(file), model, Objective::Lm, &options).unwrap()
}

#[test]
fn examples_are_trls_token_for_token() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sft_dir().join("expected.json")).unwrap())
            .unwrap();
    let seq = expected["max_length"].as_u64().unwrap() as usize;
    let model = Model::load(sft_dir().join("model/config.json")).unwrap();
    let names = model.input_names();
    let mut compared = 0;
    for (file, by_loss) in expected["files"].as_object().unwrap() {
        for (loss, examples) in by_loss.as_object().unwrap() {
            let mut data = one_per_batch(&model, file, loss, seq);
            let examples = examples.as_array().unwrap();
            // One more than there are: the read wraps to the first, so there are no others.
            for k in 0..=examples.len() {
                let want = &examples[k % examples.len()];
                let what = format!("{file} --loss-on {loss} example {k}");
                let batch = data.next_batch(names).unwrap();
                let ids = batch["input_ids"].as_i64().unwrap().to_vec();
                let labels = batch["labels"].as_i64().unwrap().to_vec();
                let mask = batch["attention_mask"].as_i64().unwrap().to_vec();
                let want_ids: Vec<i64> = want["input_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_i64().unwrap())
                    .collect();
                let want_labels: Vec<i64> = want["labels"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_i64().unwrap())
                    .collect();
                let n = want_ids.len();
                assert_eq!(ids[..n], want_ids[..], "{what}: ids");
                assert_eq!(labels[..n], want_labels[..], "{what}: labels");
                assert!(mask[..n].iter().all(|&m| m == 1), "{what}: mask");
                assert!(
                    mask[n..].iter().all(|&m| m == 0) && labels[n..].iter().all(|&l| l == -100),
                    "{what}: padding"
                );
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 3 + 4 + 4 + 4 + 3 + 3 + 6);
}

fn ints(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn packed_fixture() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(sft_dir().join("packed.json")).unwrap()).unwrap()
}

#[test]
fn best_fit_decreasing_places_examples_as_trl_does() {
    let bfd = &packed_fixture()["bfd"];
    let seq = bfd["seq_length"].as_u64().unwrap() as usize;
    let lengths: Vec<usize> = ints(&bfd["lengths"]).iter().map(|&n| n as usize).collect();
    let want: Vec<Vec<usize>> = bfd["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| ints(r).iter().map(|&i| i as usize).collect())
        .collect();
    let rows = castor::training::data::packing::pack_bfd(&lengths, seq);
    println!("{} examples in {} rows of {seq}", lengths.len(), rows.len());
    assert_eq!(rows, want);
}

#[test]
fn packed_rows_are_trls_token_for_token() {
    let expected = packed_fixture();
    let seq = expected["max_length"].as_u64().unwrap() as usize;
    let mut model = Model::load(sft_dir().join("model/config.json")).unwrap();
    model.set_packed(true).unwrap();
    let names = model.input_names();
    let mut compared = 0;
    for (file, by_loss) in expected["files"].as_object().unwrap() {
        for (loss, rows) in by_loss.as_object().unwrap() {
            let mut data = one_per_batch(&model, file, loss, seq);
            // TRL keeps an example left without a label (a row that adds nothing to the loss);
            // castor drops it before packing, as it does unpacked.
            let rows: Vec<&serde_json::Value> = rows
                .as_array()
                .unwrap()
                .iter()
                .filter(|r| ints(&r["labels"]).iter().any(|&l| l != -100))
                .collect();
            for (k, want) in rows.iter().enumerate() {
                let what = format!("{file} --loss-on {loss} packed row {k}");
                let batch = data.next_batch(names).unwrap();
                let got = |name: &str| batch[name].as_i64().unwrap().to_vec();
                let (ids, labels, positions) =
                    (got("input_ids"), got("labels"), got("position_ids"));
                let want_ids = ints(&want["input_ids"]);
                let n = want_ids.len();
                assert_eq!(ids[..n], want_ids[..], "{what}: ids");
                assert_eq!(labels[..n], ints(&want["labels"])[..], "{what}: labels");
                assert_eq!(
                    positions[..n],
                    ints(&want["position_ids"])[..],
                    "{what}: positions"
                );
                assert!(labels[n..].iter().all(|&l| l == -100), "{what}: padding");
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 3 + 4 + 2 + 2 + 3 + 3);
}

#[test]
fn sft_files_train_from_the_cli_and_bad_lines_are_named() {
    let model = sft_dir().join("model/config.json");
    for file in [
        "messages.jsonl",
        "prompt_completion.jsonl",
        "conversational_prompt_completion.jsonl",
    ] {
        let o = castor(&[
            "train",
            path_str(&model),
            "--data",
            path_str(&sft_dir().join(file)),
            "--steps",
            "2",
            "--batch",
            "2",
            "--device",
            "cpu",
        ]);
        ok(&o);
        assert!(
            stdout(&o).contains("in the loss (--loss-on completion)"),
            "{}",
            stdout(&o)
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"messages\": []}\n",
    )
    .unwrap();
    let run = |data: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            path_str(&model),
            "--data",
            path_str(data),
            "--steps",
            "1",
            "--device",
            "cpu",
        ];
        args.extend_from_slice(extra);
        castor(&args)
    };
    fails(
        &run(&bad, &[]),
        3,
        "bad.jsonl` line 2: every line must be one of prompt-completion pairs",
    );
    std::fs::write(&bad, "{\"prompt\": \"a\", \"completion\": 3}\n").unwrap();
    fails(&run(&bad, &[]), 3, "line 1: `completion` must be a string");
    // Flags that choose nothing for this data are errors, not ignored.
    fails(
        &run(&root().join("assets/corpus.txt"), &["--loss-on", "all"]),
        3,
        "--loss-on chooses the tokens of SFT examples",
    );
    fails(&run(&bad, &["--sample-tokens", "4"]), 2, "--sample-prompts");
    // A template without generation blocks has no assistant tokens to train on.
    let plain = tmp.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(sft_dir().join("model").join(f), plain.join(f)).unwrap();
    }
    std::fs::write(
        plain.join("chat_template.jinja"),
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
    )
    .unwrap();
    let o = castor(&[
        "train",
        path_str(&plain.join("config.json")),
        "--data",
        path_str(&sft_dir().join("messages.jsonl")),
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    fails(&o, 3, "line 1: no assistant tokens");
    assert!(stderr(&o).contains("--loss-on all"), "{}", stderr(&o));
    // inspect says which templates mark the assistant's turns.
    let said = |dir: &std::path::Path| {
        let o = castor(&["inspect", path_str(&dir.join("config.json"))]);
        ok(&o);
        stdout(&o)
    };
    assert!(said(&sft_dir().join("model")).contains("marks the assistant's turns"));
    assert!(said(&plain)
        .contains("no {% generation %} blocks: SFT on conversations needs --loss-on all"));
}

/// `--val-data` with `--sample-prompts`: each evaluation prints and logs the validation
/// perplexity and greedy answers through the chat template, the report shows them, and the
/// last answers are what `generate --chat` says with the saved weights.
#[test]
fn evaluations_report_perplexity_and_sample_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.txt");
    std::fs::write(
        &prompts,
        "Colour of the sky?\n\nWhat is the capital of France?\n",
    )
    .unwrap();
    let (log, report, out) = (
        tmp.path().join("run.jsonl"),
        tmp.path().join("run.html"),
        tmp.path().join("out"),
    );
    let messages = sft_dir().join("messages.jsonl");
    let o = castor(&[
        "train",
        path_str(&sft_dir().join("model/config.json")),
        "--data",
        path_str(&messages),
        "--val-data",
        path_str(&messages),
        "--steps",
        "30",
        "--batch",
        "2",
        "--eval-every",
        "15",
        "--data-order",
        "sequential",
        "--sample-prompts",
        path_str(&prompts),
        "--sample-tokens",
        "6",
        "--log",
        path_str(&log),
        "--report",
        path_str(&report),
        "--save",
        path_str(&out),
        "--device",
        "cpu",
    ]);
    ok(&o);
    let text = stdout(&o);
    assert!(text.contains("eval       15  validation loss"), "{text}");
    assert!(text.contains(", perplexity "), "{text}");
    assert!(
        text.contains("sample     30  \"Colour of the sky?\" -> "),
        "{text}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = lines.last().unwrap();
    // Throughput counts real tokens: 30 steps of 2 read the 3 examples (127 tokens) 20 times.
    assert!(text.contains("3 conversations, 127 tokens"), "{text}");
    assert_eq!(last["tokens"].as_f64().unwrap(), 20.0 * 127.0);
    let val = last["val_loss"].as_f64().unwrap();
    assert!((last["val_perplexity"].as_f64().unwrap() - val.exp()).abs() < 1e-9);
    let samples = last["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 2);
    assert!(std::fs::read_to_string(&report)
        .unwrap()
        .contains("<section id=\"samples\">"));
    // The last evaluation's answers are the saved model's.
    for s in samples {
        let g = castor(&[
            "generate",
            path_str(&out),
            "--chat",
            "--prompt",
            s["prompt"].as_str().unwrap(),
            "--max-new-tokens",
            "6",
        ]);
        ok(&g);
        assert_eq!(
            stdout(&g).trim_end_matches('\n'),
            s["answer"].as_str().unwrap(),
            "{}",
            s["prompt"]
        );
    }
}

/// The README's fine-tuning commands run as written, from the repository's root (in a
/// scratch folder that links `tests` and `assets`).
#[test]
fn the_readme_fine_tuning_commands_run_as_written() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in ["tests", "assets"] {
        std::os::unix::fs::symlink(root().join(dir), tmp.path().join(dir)).unwrap();
    }
    let commands = readme_commands("## Fine-tune an instruct model");
    assert_eq!(commands.len(), 4, "{commands:?}");
    for args in commands {
        let o = std::process::Command::new(castor_bin())
            .args(&args)
            .current_dir(tmp.path())
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "castor {}: {}",
            args.join(" "),
            stderr(&o)
        );
    }
}

/// An SFT run resumed from its checkpoint reads the examples the uninterrupted run reads
/// (shuffled, with a validation split; rows of 2 from 3 training examples, so the resumed run
/// starts in the middle of a pass): the same losses step for step.
#[test]
fn a_resumed_sft_run_continues_the_same_examples() {
    let tmp = tempfile::tempdir().unwrap();
    let model = sft_dir().join("model/config.json");
    let data = sft_dir().join("prompt_completion.jsonl");
    let train = |steps: &str, log: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            path_str(&model),
            "--data",
            path_str(&data),
            "--steps",
            steps,
            "--batch",
            "2",
            "--val-fraction",
            "0.25",
            "--seed",
            "5",
            "--device",
            "cpu",
            "--log",
            path_str(log),
        ];
        args.extend_from_slice(extra);
        ok(&castor(&args));
    };
    let (straight, resumed) = (
        tmp.path().join("straight.jsonl"),
        tmp.path().join("resumed.jsonl"),
    );
    // Packed too: the resumed run takes --pack from the checkpoint.
    for pack in [&[][..], &["--pack"][..]] {
        let ckpt = tmp.path().join(format!("ckpt{}", pack.len()));
        let _ = std::fs::remove_file(&resumed);
        let _ = std::fs::remove_file(&straight);
        train("6", &straight, pack);
        train(
            "3",
            &resumed,
            &[pack, &["--save", path_str(&ckpt)][..]].concat(),
        );
        train("6", &resumed, &["--resume", path_str(&ckpt)]);
        let losses = log_losses(&straight);
        assert_eq!(losses.len(), 6);
        assert_eq!(log_losses(&resumed), losses, "{pack:?}");
    }
}
