//! No surprises on the user's path, from the command line, each with the exact message words:
//! streams (a result alone on stdout, a closed pipe ends castor quietly and a training run
//! still saves), outputs checked before any work, nothing silent (globs that match nothing,
//! --seq beyond the positions, flags against a plan or a resumed run, unused tensors, a
//! checkpoint that is another architecture), bookkeeping (1-based steps, --steps the total, a
//! resumed run keeps its schedule), precision names and grouped help.

use crate::common;

use common::*;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn tiny() -> PathBuf {
    root().join("assets").join("tiny-gpt2.json")
}

fn corpus() -> PathBuf {
    root().join("assets").join("corpus.txt")
}

// ---- streams ---------------------------------------------------------------------------------

#[test]
fn a_closed_pipe_ends_inspect_quietly() {
    // `castor inspect gpt2-xl.json --ir | head -1`: thousands of lines into a pipe read once.
    let mut child = Command::new(castor_bin())
        .args([
            "inspect",
            path_str(&root().join("assets/configs/gpt2-xl.json")),
            "--ir",
            "--seq",
            "8",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader is gone (dropped above).
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(first, "graph GPT2LMHeadModel {\n");
    assert!(status.success(), "{status:?}: {err}");
    assert!(!err.contains("panicked") && !err.contains("error"), "{err}");
}

#[test]
fn a_training_run_piped_into_a_closed_reader_still_saves() {
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("run");
    let mut child = Command::new(castor_bin())
        .args([
            "train",
            path_str(&tiny()),
            "--data",
            path_str(&corpus()),
            "--steps",
            "30",
            "--batch",
            "2",
            "--seq",
            "16",
            "--print-every",
            "1",
            "--device",
            "cpu",
            "--save",
            path_str(&save),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(save.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 30);
    assert!(save.join("model.safetensors").is_file());
}

#[test]
fn emitted_results_go_to_stdout_alone() {
    let gpt2 = fixture("gpt2_lm");
    let run = |emit: &str| {
        let o = castor(&[
            "compile",
            path_str(&gpt2),
            "--train",
            "--precision",
            "bf16",
            "--seq",
            "7",
            "--emit",
            emit,
        ]);
        ok(&o);
        assert!(
            stderr(&o).contains("model       "),
            "the report goes to stderr"
        );
        stdout(&o)
    };
    let plan: serde_json::Value = serde_json::from_str(&run("plan")).expect("stdout is JSON");
    assert_eq!(plan["settings"]["precision"], "bf16");
    assert!(run("dot").starts_with("digraph "));
    let ir = run("ir");
    assert!(ir.starts_with("# micro step"), "{ir}");
    assert!(!ir.contains("memory anatomy"));
    let cuda = run("cuda");
    assert!(
        !cuda.contains("model       ") && cuda.starts_with("# "),
        "{cuda}"
    );
    // Without an emitted result the report is the result.
    let o = castor(&["compile", path_str(&gpt2), "--seq", "7"]);
    ok(&o);
    assert!(stdout(&o).contains("converted 0/"), "{}", stdout(&o));
}

// ---- outputs checked before work -------------------------------------------------------------

#[test]
fn output_paths_are_checked_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let missing = tmp.path().join("no-such-folder");
    let train = |flag: &str, path: &Path| {
        castor(&[
            "train",
            path_str(&tiny()),
            "--data",
            path_str(&corpus()),
            "--steps",
            "5",
            "--device",
            "cpu",
            flag,
            path_str(path),
        ])
    };
    let cases = [
        (
            train("--save", &file.join("run")),
            format!(
                "--save `{}`: `{}` is a file, not a folder",
                file.join("run").display(),
                file.display()
            ),
        ),
        (
            train("--log", &missing.join("run.jsonl")),
            format!(
                "--log `{}`: the folder `{}` does not exist",
                missing.join("run.jsonl").display(),
                missing.display()
            ),
        ),
        (
            train("--plot", &missing.join("loss.svg")),
            format!(
                "--plot `{}`: the folder",
                missing.join("loss.svg").display()
            ),
        ),
        (
            train("--report", &missing.join("r.html")),
            format!(
                "--report `{}`: the folder",
                missing.join("r.html").display()
            ),
        ),
        (
            castor(&[
                "eval",
                path_str(&fixture("gpt2_lm")),
                "--input",
                path_str(&fixture("gpt2_lm").join("input.safetensors")),
                "--out",
                path_str(&missing.join("o.safetensors")),
            ]),
            "--out `".to_string(),
        ),
        (
            castor(&[
                "compile",
                path_str(&fixture("gpt2_lm")),
                "--emit",
                "ir",
                "-o",
                path_str(tmp.path()),
            ]),
            format!(
                "-o `{}` is a folder; give a file name",
                tmp.path().display()
            ),
        ),
    ];
    for (o, words) in cases {
        // Exit code 1 (README: an output that cannot be written), nothing computed.
        fails(&o, 1, &words);
        assert_eq!(stdout(&o), "", "no work before the check");
    }
    // The OS error, once.
    if cfg!(target_os = "linux") {
        let o = train("--log", Path::new("/sys/castor.jsonl"));
        fails(
            &o,
            1,
            "--log `/sys/castor.jsonl`: cannot write into `/sys`: Permission denied (os error 13)",
        );
        assert_eq!(stderr(&o).matches("os error").count(), 1, "{}", stderr(&o));
    }
    // A report path must be a page.
    let o = train("--report", &tmp.path().join("r.txt"));
    fails(
        &o,
        3,
        "the report is an HTML page; give a path ending in .html",
    );
}

#[test]
fn a_weights_file_given_as_the_model_says_to_give_its_folder() {
    let file = fixture("gpt2_lm").join("model.safetensors");
    let o = castor(&["inspect", path_str(&file)]);
    fails(
        &o,
        3,
        &format!(
            "is not a checkpoint: it is a weights file; give the checkpoint folder `{}`",
            fixture("gpt2_lm").display()
        ),
    );
    assert!(!stderr(&o).contains("UTF-8"), "{}", stderr(&o));
}

// ---- nothing silent --------------------------------------------------------------------------

#[test]
fn globs_that_match_nothing_are_errors_with_suggestions() {
    let gpt2 = fixture("gpt2_lm");
    let o = castor(&[
        "compile",
        path_str(&gpt2),
        "--precision",
        "bf16",
        "--seq",
        "7",
        "--keep-f32",
        "lm_head*",
    ]);
    fails(
        &o,
        3,
        "--keep-f32 'lm_head*' matches no node or parameter name; did you mean `logits` (this \
         model stores `lm_head.weight` as a tied copy; the node is `logits`)?",
    );
    let o = castor(&[
        "compile",
        path_str(&gpt2),
        "--precision",
        "bf16",
        "--seq",
        "7",
        "--force-low",
        "*attn.c_atn*",
    ]);
    fails(
        &o,
        3,
        "--force-low '*attn.c_atn*' matches no node or parameter name; did you mean \
         `transformer.h.0.attn.c_attn.bias`",
    );
    let o = castor(&[
        "train",
        path_str(&gpt2),
        "--data",
        path_str(&gpt2.join("input.safetensors")),
        "--steps",
        "1",
        "--device",
        "cpu",
        "--freeze",
        "h.0.*",
    ]);
    fails(
        &o,
        3,
        "--freeze `h.0.*` matches no parameter; did you mean `transformer.h.0.*`",
    );
}

#[test]
fn a_sequence_longer_than_the_positions_is_an_error() {
    let o = castor(&[
        "train",
        path_str(&tiny()),
        "--data",
        path_str(&corpus()),
        "--steps",
        "1",
        "--seq",
        "512",
        "--device",
        "cpu",
    ]);
    fails(
        &o,
        3,
        "--seq 512 is longer than the 128 positions of the model (max_position_embeddings / \
         n_positions in config.json)",
    );
}

#[test]
fn flags_against_a_plan_name_the_setting_and_both_values() {
    let tmp = tempfile::tempdir().unwrap();
    let gpt2 = fixture("gpt2_lm");
    let plan = tmp.path().join("plan.json");
    ok(&castor(&[
        "compile",
        path_str(&gpt2),
        "--precision",
        "fp16",
        "--batch",
        "2",
        "--seq",
        "7",
        "--emit",
        "plan",
        "-o",
        path_str(&plan),
    ]));
    let input = gpt2.join("input.safetensors");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            path_str(&gpt2),
            "--data",
            path_str(&input),
            "--steps",
            "1",
            "--device",
            "cpu",
            "--plan",
            path_str(&plan),
        ];
        args.extend_from_slice(extra);
        castor(&args)
    };
    fails(
        &run(&["--precision", "bf16"]),
        3,
        &format!(
            "--precision disagrees with the plan `{}`: its precision is fp16, the flags give bf16",
            plan.display()
        ),
    );
    fails(
        &run(&["--grad-accum", "2"]),
        3,
        "--grad-accum disagrees with the plan",
    );
    // Every setting is compared, the data-parallel group too.
    fails(
        &run(&["--world-size", "2"]),
        3,
        "--world-size disagrees with the plan",
    );
    fails(
        &run(&["--keep-f32", "logits"]),
        3,
        "--keep-f32 cannot change the plan",
    );
    fails(
        &run(&["--attention", "fused"]),
        3,
        "--attention cannot change the plan",
    );
    fails(
        &run(&["--residual", "low"]),
        3,
        "--residual cannot change the plan",
    );
    // Flags that agree, and flags the plan does not fix (the learning rate), are fine.
    ok(&run(&["--precision", "FP16", "--lr", "0.01"]));
}

#[test]
fn a_resumed_run_keeps_its_flags_and_names_any_that_differ() {
    let tmp = tempfile::tempdir().unwrap();
    let run_a = tmp.path().join("a");
    let base = |steps: &str| -> Vec<String> {
        [
            path_str(&tiny()),
            "--data",
            path_str(&corpus()),
            "--steps",
            steps,
            "--device",
            "cpu",
            "--batch",
            "2",
            "--seq",
            "16",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let train = |args: Vec<String>| {
        let mut all = vec!["train".to_string()];
        all.extend(args);
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        castor(&refs)
    };
    let straight_log = tmp.path().join("straight.jsonl");
    let mut straight = base("8");
    straight.extend(
        [
            "--precision",
            "fp16",
            "--schedule",
            "cosine",
            "--warmup",
            "2",
            "--log",
            path_str(&straight_log),
        ]
        .map(String::from),
    );
    ok(&train(straight));
    // Half the run, with its schedule as long as the whole run...
    let log = tmp.path().join("a.jsonl");
    let mut first = base("4");
    first.extend(
        [
            "--precision",
            "fp16",
            "--schedule",
            "cosine",
            "--warmup",
            "2",
            "--total-steps",
            "8",
            "--save",
            path_str(&run_a),
            "--log",
            path_str(&log),
        ]
        .map(String::from),
    );
    ok(&train(first));
    // ... then resumed with none of those flags: precision, schedule, shapes come back.
    let mut second = vec![
        path_str(&tiny()).to_string(),
        "--data".into(),
        path_str(&corpus()).into(),
        "--steps".into(),
        "8".into(),
        "--device".into(),
        "cpu".into(),
    ];
    second.extend(
        [
            "--resume",
            path_str(&run_a),
            "--save",
            path_str(&run_a),
            "--log",
            path_str(&log),
        ]
        .map(String::from),
    );
    let o = train(second);
    ok(&o);
    assert!(
        stdout(&o).contains("training    steps 5..8 of 1 x [2, 16] tokens, fp16"),
        "{}",
        stdout(&o)
    );
    // The whole run, as the straight run: 1-based steps, the same learning rates and losses.
    let lines = |p: &Path| -> Vec<(u64, f64, f64)> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (
                    v["step"].as_u64().unwrap(),
                    v["lr"].as_f64().unwrap(),
                    v["loss"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let resumed = lines(&log);
    assert_eq!(
        resumed.iter().map(|l| l.0).collect::<Vec<_>>(),
        (1..=8).collect::<Vec<_>>()
    );
    assert_eq!(resumed, lines(&straight_log));
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_a.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 8);

    // A flag that differs names itself and both values; --steps no further than the
    // checkpoint says it is the total.
    let mut differ = base("12");
    differ.extend(["--resume", path_str(&run_a), "--precision", "bf16"].map(String::from));
    fails(
        &train(differ),
        3,
        &format!(
            "--precision bf16 disagrees with the run being resumed: `{}` was trained with \
             --precision fp16",
            run_a.display()
        ),
    );
    // A plan compiled with other settings than the checkpoint's names each of them.
    let plan = tmp.path().join("bf16.json");
    ok(&castor(&[
        "compile",
        path_str(&tiny()),
        "--precision",
        "bf16",
        "--batch",
        "2",
        "--seq",
        "16",
        "--emit",
        "plan",
        "-o",
        path_str(&plan),
    ]));
    let mut other_plan = base("12");
    other_plan.extend(["--resume", path_str(&run_a), "--plan", path_str(&plan)].map(String::from));
    let o = train(other_plan);
    fails(&o, 3, "the checkpoint was trained with other settings (precision: fp16 in the checkpoint, bf16 now; loss_scaling: ");
    let mut done = base("8");
    done.extend(["--resume", path_str(&run_a)].map(String::from));
    fails(
        &train(done),
        3,
        "--steps 8: the checkpoint is at step 8 already; --steps is the total",
    );
    // Another model than the checkpoint's.
    let other = tmp.path().join("other.json");
    std::fs::write(
        &other,
        std::fs::read_to_string(tiny())
            .unwrap()
            .replace("\"n_layer\": 4", "\"n_layer\": 2"),
    )
    .unwrap();
    let mut wrong = vec![path_str(&other).to_string()];
    wrong.extend(base("12").into_iter().skip(1));
    wrong.extend(["--resume", path_str(&run_a)].map(String::from));
    fails(
        &train(wrong),
        3,
        &format!(
            "--resume `{}` holds another model than MODEL `{}` (n_layer: 4 in the checkpoint, \
             2 in MODEL)",
            run_a.display(),
            other.display()
        ),
    );
}

/// A copy of a fixture with extra tensors in its weights file.
fn with_extra_tensors(variant: &str, extra: &[(&str, Vec<usize>)]) -> tempfile::TempDir {
    let dir = copy_fixture(variant);
    let path = dir.path().join("model.safetensors");
    let file = castor_models::SafetensorsFile::open(&path).unwrap();
    let mut tensors: Vec<(String, castor_ir::Tensor)> = file
        .names()
        .map(|n| (n.to_string(), file.tensor(n).unwrap()))
        .collect();
    drop(file);
    for (name, shape) in extra {
        let n = shape.iter().product();
        tensors.push((
            name.to_string(),
            castor_ir::Tensor::from_f32(castor_ir::DType::F32, shape.clone(), vec![0.5; n]),
        ));
    }
    let refs: Vec<(&str, &castor_ir::Tensor)> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    castor_models::write_safetensors(&path, &refs).unwrap();
    dir
}

#[test]
fn unused_tensors_warn_on_every_command_and_another_architecture_is_an_error() {
    let dir = with_extra_tensors("gpt2_lm", &[("score.weight", vec![2, 32])]);
    let model = path_str(dir.path());
    let input = fixture("gpt2_lm").join("input.safetensors");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o.safetensors");
    let warning = "warning: 1 checkpoint tensor(s) not used by GPT2LMHeadModel: score.weight";
    for args in [
        vec!["inspect", model],
        vec!["compile", model, "--seq", "7"],
        vec![
            "eval",
            model,
            "--input",
            path_str(&input),
            "--out",
            path_str(&out),
        ],
        vec![
            "train",
            model,
            "--data",
            path_str(&input),
            "--steps",
            "1",
            "--device",
            "cpu",
        ],
    ] {
        let o = castor(&args);
        ok(&o);
        assert!(stderr(&o).contains(warning), "{args:?}: {}", stderr(&o));
        assert!(
            !stdout(&o).contains("score.weight"),
            "warnings go to stderr"
        );
    }
    // A Qwen2 checkpoint under model_type llama: attention biases LLaMA does not read.
    let mut extra = Vec::new();
    for layer in 0..2 {
        for (proj, n) in [("q_proj", 32), ("k_proj", 8), ("v_proj", 8)] {
            extra.push((
                format!("model.layers.{layer}.self_attn.{proj}.bias"),
                vec![n],
            ));
        }
    }
    let extra: Vec<(&str, Vec<usize>)> =
        extra.iter().map(|(n, s)| (n.as_str(), s.clone())).collect();
    let qwen = with_extra_tensors("llama_tied", &extra);
    for args in [
        vec!["inspect", path_str(qwen.path())],
        vec![
            "eval",
            path_str(qwen.path()),
            "--input",
            path_str(&fixture("llama_tied").join("input.safetensors")),
        ],
    ] {
        let o = castor(&args);
        fails(
            &o,
            3,
            "6 tensor(s) of modules LlamaForCausalLM has, which it does not read: the \
             checkpoint holds parameters this config turns off (e.g. attention biases: a Qwen2 \
             checkpoint under model_type `llama`)",
        );
        assert!(
            stderr(&o).contains("`model.layers.0.self_attn.q_proj.bias`"),
            "{}",
            stderr(&o)
        );
    }
}

// ---- precision names and help ----------------------------------------------------------------

#[test]
fn precision_names_as_users_write_them() {
    let gpt2 = fixture("gpt2_lm");
    for (name, canonical) in [
        ("bf16", "bf16"),
        ("BF16", "bf16"),
        ("bfloat16", "bf16"),
        ("fp16", "fp16"),
        ("float16", "fp16"),
        ("half", "fp16"),
        ("fp32", "fp32"),
        ("float32", "fp32"),
        ("FP8", "fp8"),
        ("fp8:tensorwise", "fp8"),
    ] {
        let o = castor(&[
            "compile",
            path_str(&gpt2),
            "--seq",
            "7",
            "--precision",
            name,
        ]);
        ok(&o);
        assert!(
            stdout(&o).contains(&format!("precision   {canonical}\n")),
            "{name}: {}",
            stdout(&o)
        );
    }
    let o = castor(&["compile", path_str(&gpt2), "--precision", "fp4"]);
    fails(
        &o,
        2,
        "unknown precision `fp4` (expected fp32/float32, tf32, bf16/bfloat16, fp16/float16/half, fp8/fp8:tensorwise or fp8:delayed)",
    );
    // Policy files take the same names.
    let tmp = tempfile::tempdir().unwrap();
    let policy = tmp.path().join("p.toml");
    std::fs::write(
        &policy,
        "[[rules]]\nmatch = \"logits\"\ndtype = \"float32\"\n[[rules]]\nmatch = \"h.0.mlp.*\"\ndtype = \"BFloat16\"\n",
    )
    .unwrap();
    let o = castor(&[
        "compile",
        path_str(&gpt2),
        "--seq",
        "7",
        "--precision",
        "bfloat16",
        "--policy",
        path_str(&policy),
        "--explain",
        "logits",
    ]);
    ok(&o);
    assert!(
        stdout(&o).contains("rule        rule 1 'logits' -> f32"),
        "{}",
        stdout(&o)
    );
    assert!(
        stdout(&o).contains("rule        rule 2 'h.0.mlp.*' -> bf16"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn help_is_grouped_by_topic_and_lists_every_choice() {
    let o = castor(&["compile", "--help"]);
    ok(&o);
    let h = stdout(&o);
    for heading in [
        "Precision policy:",
        "Output:",
        "Shape:",
        "Training step:",
        "Optimizer:",
        "Loss scaling:",
        "Device:",
    ] {
        assert!(
            h.contains(heading),
            "compile --help lacks `{heading}`:\n{h}"
        );
    }
    // --emit names every choice, in its own words and in clap's list.
    for choice in ["summary", "ir", "dot", "plan", "cuda"] {
        assert!(h.contains(&format!("`{choice}`")), "{choice}:\n{h}");
        assert!(h.contains(&format!("- {choice}:")), "{choice}:\n{h}");
    }
    let o = castor(&["train", "--help"]);
    ok(&o);
    let h = stdout(&o);
    for heading in [
        "Data:",
        "Run:",
        "Learning-rate schedule:",
        "Precision policy:",
        "Optimizer:",
        "Outputs:",
        "Device:",
    ] {
        assert!(h.contains(heading), "train --help lacks `{heading}`:\n{h}");
    }
    assert!(h.contains("as transformers' max_steps"), "{h}");
}

// ---- labelled data -----------------------------------------------------------------------------

/// Bad examples for a classifier are refused before training, naming the file, the line and
/// the field: a class outside num_labels, a missing `text` or `label`, an unknown label name,
/// a CSV without a `label` column.
#[test]
fn bad_labelled_examples_name_file_line_and_field() {
    let model = copy_fixture("bert_cls");
    let classify = fixture("classify");
    std::fs::copy(classify.join("vocab.txt"), model.path().join("vocab.txt")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let good = r#"{"text": "w1 good", "label": "positive"}"#;
    for (name, body, words) in [
        (
            "range.jsonl",
            format!("{good}\n{{\"text\": \"w2 bad\", \"label\": 3}}\n"),
            "range.jsonl`: line 2: field `label`: class 3 is outside the model's 3 labels",
        ),
        (
            "no_text.jsonl",
            format!("{good}\n{good}\n{{\"label\": 1}}\n"),
            "no_text.jsonl`: line 3: expected a string field `text`",
        ),
        (
            "no_label.jsonl",
            format!("{{\"text\": \"w1\"}}\n{good}\n"),
            "no_label.jsonl`: line 1: expected a field `label`",
        ),
        (
            "unknown.jsonl",
            format!("{good}\n{{\"text\": \"w2\", \"label\": \"great\"}}\n"),
            "unknown.jsonl`: line 2: field `label`: unknown label `great` (config.json's \
             label2id has: negative, neutral, positive)",
        ),
        (
            "columns.csv",
            "text,class\nw1 good,2\n".to_string(),
            "columns.csv`: line 1: the header has no `label` column",
        ),
        (
            "range.csv",
            "text,label\nw1 good,2\nw2 bad,-1\n".to_string(),
            "range.csv`: line 3: field `label`: class -1 is outside the model's 3 labels",
        ),
    ] {
        let path = tmp.path().join(name);
        std::fs::write(&path, body).unwrap();
        let o = castor(&[
            "train",
            path_str(model.path()),
            "--data",
            path_str(&path),
            "--steps",
            "1",
            "--device",
            "cpu",
        ]);
        fails(&o, 3, words);
    }
}

// ---- round two: what a new user tripped on ---------------------------------------------------

/// Loss scales are printed as the numbers they are: `1073741824`, not the f32's shortest
/// decimal `1073741800`, in the step lines, the error, and the JSON log.
#[test]
fn loss_scales_are_printed_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("run.jsonl");
    let o = castor(&[
        "train",
        path_str(&tiny()),
        "--data",
        path_str(&corpus()),
        "--steps",
        "3",
        "--device",
        "cpu",
        "--precision",
        "fp16",
        "--init-scale",
        "1073741824",
        "--min-scale",
        "1073741824",
        "--log",
        path_str(&log),
    ]);
    fails(
        &o,
        4,
        "the loss scale fell to 536870912, below the minimum 1073741824",
    );
    assert!(stdout(&o).contains("scale 1073741824 "), "{}", stdout(&o));
    assert!(!stdout(&o).contains("1073741800"), "{}", stdout(&o));
    let first = std::fs::read_to_string(&log).unwrap();
    assert!(first.contains("\"loss_scale\":1073741824.0"), "{first}");
}

/// A plan compiled without --batch/--seq (1 x 32) meets a [2, 7] batch file: the error names
/// both shapes and the recompile that fixes it, not flags nobody gave.
#[test]
fn a_plan_of_another_shape_names_both_shapes_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let gpt2 = fixture("gpt2_lm");
    let plan = tmp.path().join("plan.json");
    ok(&castor(&[
        "compile",
        path_str(&gpt2),
        "--emit",
        "plan",
        "-o",
        path_str(&plan),
    ]));
    let input = gpt2.join("input.safetensors");
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            path_str(&gpt2),
            "--data",
            path_str(&input),
            "--steps",
            "1",
            "--device",
            "cpu",
        ];
        args.extend_from_slice(extra);
        castor(&args)
    };
    fails(
        &train(&["--plan", path_str(&plan)]),
        3,
        &format!(
            "holds a [2, 7] batch (batch x seq), but the plan `{}` was compiled for [1, 32]; \
             recompile it with `castor compile ... --train --batch 2 --seq 7`, or train without \
             --plan",
            plan.display()
        ),
    );
    fails(
        &train(&["--batch", "4"]),
        3,
        "holds a [2, 7] batch (batch x seq), but --batch/--seq ask for [4, 7]; leave them out \
         (a fixed batch sets the shape) or give --batch 2 --seq 7",
    );
}

/// One rule for every output: castor creates the output (a file, or the folder `--save` and
/// `merge --out` name) but not a missing parent chain; a folder where a file goes is the same
/// output error, exit 1.
#[test]
fn every_output_follows_one_folder_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let chain = tmp.path().join("a").join("b");
    let missing = |flag: &str, out: &Path| {
        format!(
            "{flag} `{}`: the folder `{}` does not exist (castor creates the output folder, not \
             its parents)",
            out.display(),
            chain.display()
        )
    };
    let train = |flag: &str, path: &Path| {
        castor(&[
            "train",
            path_str(&tiny()),
            "--data",
            path_str(&corpus()),
            "--steps",
            "1",
            "--device",
            "cpu",
            flag,
            path_str(path),
        ])
    };
    let save = chain.join("out");
    fails(&train("--save", &save), 1, &missing("--save", &save));
    assert!(!tmp.path().join("a").exists(), "a parent was created");
    let gpt2 = fixture("gpt2_lm");
    let merged = chain.join("merged");
    fails(
        &castor(&[
            "merge",
            path_str(&gpt2),
            "--adapter",
            path_str(&gpt2.join("lora")),
            "--out",
            path_str(&merged),
        ]),
        1,
        &missing("--out", &merged),
    );
    // A folder given where a file goes: the same exit code as any output that cannot be
    // written, before the page's kind is judged.
    fails(
        &train("--report", tmp.path()),
        1,
        &format!(
            "--report `{}` is a folder; give a file name",
            tmp.path().display()
        ),
    );
    // The output folder itself is created, in a folder that exists.
    let fresh = tmp.path().join("run");
    ok(&train("--save", &fresh));
    assert!(fresh.join("model.safetensors").is_file());
}

/// `--explain` with a glob that matches nothing is an error with the nearest names, as a
/// `--keep-f32` glob is.
#[test]
fn an_explain_glob_that_matches_nothing_suggests_names() {
    let o = castor(&[
        "compile",
        path_str(&fixture("gpt2_lm")),
        "--precision",
        "bf16",
        "--explain",
        "ln_1*",
    ]);
    fails(
        &o,
        3,
        "--explain 'ln_1*' matches no node name; did you mean `transformer.h.0.ln_1*` or \
         `h.0.ln_1`",
    );
    let o = castor(&[
        "compile",
        path_str(&fixture("gpt2_lm")),
        "--precision",
        "bf16",
        "--explain",
        "nothing*",
    ]);
    fails(
        &o,
        3,
        "--explain 'nothing*' matches no node name; did you mean",
    );
}

/// Compiling an IR file already compiled to bf16 with --precision fp16 rounds its values a
/// second time: castor says so.
#[test]
fn compiling_compiled_ir_to_another_precision_warns() {
    let tmp = tempfile::tempdir().unwrap();
    let ir = tmp.path().join("bf16.ir");
    ok(&castor(&[
        "compile",
        path_str(&fixture("gpt2_lm")),
        "--precision",
        "bf16",
        "--emit",
        "ir",
        "-o",
        path_str(&ir),
    ]));
    let o = castor(&["compile", path_str(&ir), "--precision", "fp16"]);
    ok(&o);
    assert!(
        stderr(&o).contains(&format!(
            "warning: `{}` is already compiled: ",
            ir.display()
        )) && stderr(&o).contains(
            "value(s) are bf16, and compiling to f16 rounds them again; compile the F32 \
             source IR instead"
        ),
        "{}",
        stderr(&o)
    );
    let o = castor(&["compile", path_str(&ir), "--precision", "bf16"]);
    ok(&o);
    assert!(!stderr(&o).contains("already compiled"), "{}", stderr(&o));
}

/// A bare BertModel without --objective is refused, pointing at the classifier flags.
#[test]
fn a_bare_encoder_refusal_points_at_the_classifier_flags() {
    let o = castor(&[
        "train",
        path_str(&fixture("bert_base")),
        "--data",
        path_str(&corpus()),
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    fails(
        &o,
        3,
        "to fine-tune it as a text classifier, give --num-labels N or --labels a,b,c",
    );
}

/// The plan line counts the model's parameter buffers under every ZeRO stage (sharded masters
/// are state reads, not parameters, in a rank's micro step).
#[test]
fn the_plan_line_counts_parameters_under_zero() {
    for zero in ["0", "1", "2", "3"] {
        let o = castor(&[
            "train",
            path_str(&tiny()),
            "--data",
            path_str(&corpus()),
            "--steps",
            "1",
            "--precision",
            "bf16",
            "--world-size",
            "2",
            "--zero",
            zero,
            "--device",
            "cpu",
            "--batch",
            "4",
            "--seq",
            "16",
        ]);
        ok(&o);
        assert!(
            stdout(&o).contains("training plan: 52 of 52 parameter buffers trained;"),
            "--zero {zero}: {}",
            stdout(&o)
        );
    }
}

/// `dir` with its config.json lacking `field`.
fn without_field(dir: &Path, field: &str, into: &Path) -> PathBuf {
    let out = into.join(dir.file_name().unwrap());
    std::fs::create_dir_all(&out).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, out.join(path.file_name().unwrap())).unwrap();
        }
    }
    let config = out.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove(field).unwrap();
    std::fs::write(&config, json.to_string()).unwrap();
    out
}

/// A shape-deciding field missing from config.json is named first, with the default
/// transformers would use; when the weights disagree, one short message names the field
/// instead of a list of every tensor.
#[test]
fn a_missing_config_field_is_named_not_hundreds_of_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let llama = without_field(&fixture("llama_gqa"), "num_hidden_layers", tmp.path());
    let o = castor(&["inspect", path_str(&llama)]);
    fails(
        &o,
        3,
        "config.json has no `num_hidden_layers` (LlamaConfig's default 32 was used), as \
         transformers would default it, and the weights disagree (",
    );
    assert!(
        stderr(&o).contains("set `num_hidden_layers` in config.json"),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).lines().count() <= 2, "{}", stderr(&o));
    let gpt2 = without_field(&fixture("gpt2_lm"), "n_embd", &tmp.path().join("g"));
    let o = castor(&["inspect", path_str(&gpt2)]);
    fails(
        &o,
        3,
        "config.json has no `n_embd` (GPT2Config's default 768 was used), as transformers \
         would default it, and the weights disagree (0 missing tensor(s), ",
    );
    assert!(stderr(&o).lines().count() <= 2, "{}", stderr(&o));
    // A bare config builds the default's size, and says so.
    let bare = tmp.path().join("bare.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny()).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("n_layer").unwrap();
    std::fs::write(&bare, json.to_string()).unwrap();
    let o = castor(&["inspect", path_str(&bare)]);
    ok(&o);
    assert!(
        stderr(&o).contains(
            "warning: config.json has no `n_layer`: GPT2Config's default 12 is used, as \
             transformers does"
        ),
        "{}",
        stderr(&o)
    );
}
