//! Unpadded rows (`--unpadded`; `castor train` takes them for token streams): the training
//! graph reads no `attention_mask`, and attention applies the causal mask (and a sliding
//! window) alone. That is the function a mask of ones gives, and it is computed the same way:
//! on every decoder family, with the eager and the fused attention, the loss and every
//! gradient equal the masked graph's under a mask of ones bit for bit (error exactly 0) on
//! the CPU executor. From the command line, a token stream trains an unpadded plan whose
//! losses and gradient norms equal, step by step, those of the padded plan `castor compile`
//! writes without the flag, on the CPU executor and on the emulated CUDA program with castor's
//! attention kernels; the flag is refused for data whose rows may be padded, for encoders and
//! with `--pack`.

use crate::common;
use castor_ir::{DType, Tensor};
use castor_models::{AttentionImpl, Model, Objective};
use castor_passes::{Autodiff, Pass};
use castor_runtime::cpu::CpuExecutor;
use common::*;
use std::collections::HashMap;
use std::path::Path;

const BATCH: usize = 2;
const SEQ: usize = 12;

/// The loss and every gradient of the model's loss graph on `batch`, in output order.
fn loss_and_grads(model: &Model, batch: &HashMap<String, Tensor>) -> Vec<Vec<f32>> {
    let params = model.load_params().unwrap();
    let g = model.build_loss_graph(BATCH, SEQ, Objective::Lm).unwrap();
    let (back, _) = Autodiff::default().run(&g).unwrap();
    CpuExecutor::new()
        .run(&back, &|n| batch.get(n).or_else(|| params.get(n)))
        .unwrap()
        .iter()
        .map(|t| t.as_f32().unwrap().to_vec())
        .collect()
}

#[test]
fn unpadded_rows_compute_what_a_mask_of_ones_does_bit_for_bit() {
    for variant in CAUSAL_LMS {
        for attention in [AttentionImpl::Eager, AttentionImpl::Fused] {
            let mut model = Model::load(common::fixture(variant)).unwrap();
            model.set_attention(attention);
            let vocab = model.vocab_size() as i64;
            let ids: Vec<i64> = (0..(BATCH * SEQ) as i64)
                .map(|i| (i * 37 + 5) % vocab)
                .collect();
            let tensor = |v: Vec<i64>| Tensor::from_i64(DType::I64, [BATCH, SEQ], v);
            let mut batch = HashMap::from([
                ("input_ids".to_string(), tensor(ids.clone())),
                ("labels".to_string(), tensor(ids)),
            ]);
            assert_eq!(model.input_names(), ["input_ids", "attention_mask"]);
            let unpadded = {
                model.set_unpadded(true).unwrap();
                assert_eq!(model.input_names(), ["input_ids"], "{variant}");
                let g = model.build_loss_graph(BATCH, SEQ, Objective::Lm).unwrap();
                assert!(
                    g.inputs().all(|v| g.name(v) != "attention_mask"),
                    "{variant}: the unpadded graph reads a mask"
                );
                loss_and_grads(&model, &batch)
            };
            model.set_unpadded(false).unwrap();
            batch.insert("attention_mask".into(), tensor(vec![1; BATCH * SEQ]));
            let masked = loss_and_grads(&model, &batch);
            assert_eq!(unpadded.len(), masked.len(), "{variant}");
            for (i, (u, m)) in unpadded.iter().zip(&masked).enumerate() {
                let same =
                    u.len() == m.len() && u.iter().zip(m).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{variant} {attention:?}: output {i} differs");
            }
            println!(
                "{variant} {attention:?}: loss {} and {} gradients bit-identical",
                unpadded[0][0],
                unpadded.len() - 1
            );
        }
    }
}

/// Each step's loss and gradient norm from a `--log` file, as written.
fn logged(log: &Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["loss"].as_f64().unwrap(),
                v["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn run_ok(args: &[&str]) -> String {
    let o = castor(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
}

/// `castor train` on a token stream runs the unpadded plan, and trains exactly as the padded
/// plan does: the losses and gradient norms of every step are equal.
#[test]
fn a_token_stream_trains_unpadded_exactly_as_padded() {
    let tmp = tempfile::tempdir().unwrap();
    // nanoGPT's raw u16 token file, every id below the smallest vocabulary (the Mistral
    // fixture's 99).
    let data = tmp.path().join("tokens.bin");
    let tokens: Vec<u8> = (0..4096u32)
        .flat_map(|i| ((i * 7919 + i / 13) % 97).to_le_bytes()[..2].to_vec())
        .collect();
    std::fs::write(&data, tokens).unwrap();
    let tiny = root().join("assets").join("tiny-gpt2.json");
    let mistral = common::fixture("mistral_window");
    let fused = ["--precision", "bf16", "--attention", "fused"];
    let cases: [(&Path, &str, &[&str]); 3] = [
        (&tiny, "cpu", &[]),
        (&mistral, "cpu", &fused),
        (&tiny, "emulate", &fused),
    ];
    for (i, &(model, device, flags)) in cases.iter().enumerate() {
        let dir = tmp.path().join(i.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let (model, data) = (path_str(model), path_str(&data));
        // The padded plan, as `castor compile` writes it without --unpadded.
        let plan = dir.join("padded.json");
        let mut compile = vec!["compile", model, "--train", "--batch", "2", "--seq", "16"];
        compile.extend(["--emit", "plan", "-o", path_str(&plan)]);
        compile.extend(flags);
        run_ok(&compile);
        let text = std::fs::read_to_string(&plan).unwrap();
        assert!(
            !text.contains("\"unpadded\""),
            "the padded plan says unpadded"
        );

        let (log_u, log_p) = (dir.join("unpadded.jsonl"), dir.join("padded.jsonl"));
        let mut unpadded = vec!["train", model, "--data", data, "--device", device];
        unpadded.extend(["--batch", "2", "--seq", "16", "--steps", "4"]);
        unpadded.extend(["--log", path_str(&log_u)]);
        unpadded.extend(flags);
        let out = run_ok(&unpadded);
        let plan_line = out.lines().find(|l| l.starts_with("plan ")).unwrap();
        assert!(
            plan_line.contains("unpadded rows (no attention mask)"),
            "{plan_line}"
        );

        // The plan decides the precision and the attention: only the device is given.
        let mut padded = vec!["train", model, "--data", data, "--device", device];
        padded.extend(["--plan", path_str(&plan), "--steps", "4"]);
        padded.extend(["--log", path_str(&log_p)]);
        let out = run_ok(&padded);
        assert!(!out.contains("unpadded rows"), "{out}");

        let (u, p) = (logged(&log_u), logged(&log_p));
        assert_eq!(u.len(), 4);
        assert_eq!(
            u, p,
            "{model} {device} {flags:?}: unpadded vs padded (loss, grad norm)"
        );
        println!("{model} {device} {flags:?}: {u:?}");
    }
}

#[test]
fn unpadded_rows_are_refused_where_rows_may_be_padded() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = root().join("assets").join("tiny-gpt2.json");
    // A fixed batch carries its own mask.
    let batch = common::fixture("gpt2_lm").join("input.safetensors");
    assert!(batch.is_file(), "{}", batch.display());
    let o = castor(&[
        "train",
        path_str(&tiny),
        "--data",
        path_str(&batch),
        "--unpadded",
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("--unpadded is for windows of a token stream"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");

    // An encoder reads its mask.
    let o = castor(&[
        "compile",
        path_str(&common::fixture("bert_mlm")),
        "--train",
        "--unpadded",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("cannot take unpadded rows"), "{err}");

    // An IR file's graph is fixed: the flag cannot apply to it.
    let ir = root().join("tests").join("ir");
    let file = std::fs::read_dir(&ir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "ir"))
        .unwrap();
    let o = castor(&["compile", path_str(&file), "--unpadded"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("is an IR file") && err.contains("--unpadded"),
        "{err}"
    );

    // Packed rows read positions instead.
    let o = castor(&[
        "compile",
        path_str(&tiny),
        "--train",
        "--pack",
        "--unpadded",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("--pack") && err.contains("--unpadded"),
        "{err}"
    );

    // A plan compiled for unpadded rows refuses data that may pad.
    let plan = tmp.path().join("unpadded.json");
    run_ok(&[
        "compile",
        path_str(&tiny),
        "--train",
        "--unpadded",
        "--batch",
        "2",
        "--seq",
        "7",
        "--emit",
        "plan",
        "-o",
        path_str(&plan),
    ]);
    let o = castor(&[
        "train",
        path_str(&tiny),
        "--plan",
        path_str(&plan),
        "--data",
        path_str(&batch),
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("compiled for unpadded rows"), "{err}");
}

/// The CUDA program of an unpadded plan reads no mask: no `attention_mask` slot, and no
/// sequence lengths computed for cuDNN before its passes.
#[test]
fn the_unpadded_cuda_program_reads_no_mask() {
    let gpt2 = root().join("assets").join("configs").join("gpt2-124m.json");
    let listing = |extra: &[&str]| {
        let mut args = vec![
            "compile",
            path_str(&gpt2),
            "--train",
            "--precision",
            "bf16",
            "--batch",
            "2",
            "--seq",
            "256",
            "--emit",
            "cuda",
        ];
        args.extend(extra);
        run_ok(&args)
    };
    let padded = listing(&[]);
    let unpadded = listing(&["--unpadded"]);
    assert!(padded.contains("attention_mask") && padded.contains("attention_key_lengths"));
    assert!(!unpadded.contains("attention_mask"), "{unpadded}");
    assert!(!unpadded.contains("attention_key_lengths"), "{unpadded}");
    assert!(!unpadded.contains("seq len q"), "{unpadded}");
}
