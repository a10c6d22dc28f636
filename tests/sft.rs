//! Supervised fine-tuning data against TRL's `SFTTrainer` (tests/fixtures/generate_sft.py):
//! for conversations (the model's chat template with `{% generation %}` blocks),
//! prompt-completion pairs and conversational prompt-completion pairs, with the loss on the
//! completion and on every token, each example's token ids and labels are TRL's exactly,
//! after TRL's truncation to 48 tokens and with the examples TRL drops dropped; then a short
//! run trains on each file from the CLI.

use crate::common;

use castor::training::data::sft::LossOn;
use castor::training::data::{Data, DataOptions, DataOrder};
use castor_models::{Model, Objective};
use common::*;

fn sft_dir() -> std::path::PathBuf {
    root().join("tests/fixtures/sft")
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
            let loss_on = match loss.as_str() {
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
            let mut data =
                Data::open(&sft_dir().join(file), &model, Objective::Lm, &options).unwrap();
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
}
