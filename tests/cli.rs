//! The command line end to end: the demo, inspect, and the errors a user sees, with their exit
//! codes (README: 3 invalid input, 5 device unavailable).

use crate::common;

use common::*;
use std::fs;

#[test]
fn demo_runs_without_files() {
    let out = tempfile::tempdir().unwrap();
    let o = castor(&["demo", "--steps", "3", "--out", path_str(out.path())]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("family      gpt2 (GPT2LMHeadModel"), "{s}");
    assert!(s.contains("converted "), "{s}");
    assert!(s.contains("sample      after training"), "{s}");
}

#[test]
fn inspect_summarizes_every_fixture_with_exact_parameter_counts() {
    let manifest: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(root().join("tests/fixtures/MANIFEST.json")).unwrap(),
    )
    .unwrap();
    for variant in VARIANTS {
        let o = castor(&["inspect", path_str(&fixture(variant))]);
        assert!(o.status.success(), "{variant}: {}", stderr(&o));
        let s = stdout(&o);
        let n = manifest["variants"][variant]["num_parameters"]
            .as_u64()
            .unwrap();
        let expected = castor::report::thousands(n);
        assert!(
            s.contains(&format!("parameters  {expected} ")),
            "{variant}: expected {expected} parameters in\n{s}"
        );
        assert!(s.contains("contraction"), "{s}");
    }
}

#[test]
fn inspect_reports_ignored_buffers() {
    let o = castor(&["inspect", path_str(&fixture("bert_mlm"))]);
    assert!(
        stdout(&o).contains("bert.embeddings.position_ids"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn inspect_works_from_a_bare_config() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    fs::write(
        &cfg,
        r#"{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_layer": 12,
            "n_head": 12, "vocab_size": 50257, "n_positions": 1024}"#,
    )
    .unwrap();
    let o = castor(&["inspect", path_str(&cfg), "--seq", "64"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("parameters  124,439,808 "), "{s}");
    assert!(s.contains("config only"), "{s}");
}

#[test]
fn inspect_ir_prints_parseable_text() {
    let o = castor(&[
        "inspect",
        path_str(&fixture("llama_tied")),
        "--ir",
        "--seq",
        "5",
    ]);
    assert!(o.status.success());
    // The IR is the result: stdout holds it alone, the summary went to stderr.
    castor_ir::verify(&castor_ir::text::parse(&stdout(&o)).unwrap()).unwrap();
    assert!(stderr(&o).contains("family      llama"), "{}", stderr(&o));
}

#[test]
fn unsupported_model_type_is_invalid_input() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    fs::write(&cfg, r#"{"model_type": "mamba", "hidden_size": 8}"#).unwrap();
    let o = castor(&["inspect", path_str(&cfg)]);
    assert_eq!(o.status.code(), Some(3));
    let e = stderr(&o);
    assert!(
        e.contains("unsupported model_type `mamba`") && e.contains("gpt2"),
        "{e}"
    );
}

#[test]
fn missing_and_mismatched_tensors_are_named() {
    let dir = copy_fixture("gpt2_lm");
    let path = dir.path().join("model.safetensors");
    let file = castor_models::SafetensorsFile::open(&path).unwrap();
    let mut kept = Vec::new();
    for name in file.names() {
        if name == "transformer.h.1.mlp.c_fc.weight" || name == "transformer.ln_f.bias" {
            continue; // missing
        }
        let t = file.tensor(name).unwrap();
        let t = if name == "transformer.h.0.attn.c_proj.bias" {
            castor_ir::Tensor::from_f32(
                castor_ir::DType::F32,
                [31],
                t.as_f32().unwrap()[..31].to_vec(),
            )
        } else {
            t
        };
        kept.push((name.to_string(), t));
    }
    kept.push((
        "transformer.extra.weight".into(),
        castor_ir::Tensor::from_f32(castor_ir::DType::F32, [2], vec![1.0, 2.0]),
    ));
    drop(file);
    let refs: Vec<(&str, &castor_ir::Tensor)> = kept.iter().map(|(n, t)| (n.as_str(), t)).collect();
    castor_models::write_safetensors(&path, &refs).unwrap();
    let o = castor(&["inspect", path_str(dir.path())]);
    assert_eq!(o.status.code(), Some(3), "{}", stdout(&o));
    let e = stderr(&o);
    for needle in [
        "transformer.h.1.mlp.c_fc.weight",
        "transformer.ln_f.bias",
        "transformer.h.0.attn.c_proj.bias",
        "[32]",
        "[31]",
        "transformer.extra.weight",
    ] {
        assert!(e.contains(needle), "missing `{needle}` in:\n{e}");
    }
}

#[test]
fn eval_on_cuda_runs_there_or_says_why_not() {
    let dir = fixture("gpt2_lm");
    let out = tempfile::tempdir().unwrap();
    let o = eval(
        &dir,
        &dir.join("input.safetensors"),
        &out.path().join("o.safetensors"),
        &["--device", "cuda"],
    );
    if castor_runtime::cuda_probe::probe().is_ok() {
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stdout(&o).contains("forward on cuda"), "{}", stdout(&o));
        return;
    }
    assert_eq!(o.status.code(), Some(5));
    assert!(stderr(&o).contains("--device cuda"), "{}", stderr(&o));
    assert!(!out.path().join("o.safetensors").exists());
}

#[test]
fn eval_rejects_out_of_vocabulary_tokens() {
    let dir = fixture("gpt2_lm");
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.safetensors");
    let ids = castor_ir::Tensor::from_i64(castor_ir::DType::I64, [1, 3], vec![1, 2, 99]);
    castor_models::write_safetensors(&input, &[("input_ids", &ids)]).unwrap();
    let o = eval(
        &dir,
        &input,
        &tmp.path().join("o.safetensors"),
        &["--device", "cpu"],
    );
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains("`input_ids`[0, 2] = 99 is outside the vocabulary [0, 99)"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn compile_works_from_a_bare_config_with_overrides_and_explanations() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    fs::write(
        &cfg,
        r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
            "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128}"#,
    )
    .unwrap();
    let o = castor(&[
        "compile",
        path_str(&cfg),
        "--precision",
        "bf16",
        "--keep-f32",
        "logits",
        "--attention",
        "eager",
        "--explain",
        "layers.0.self_attn.probs",
        "--verify",
        "--seq",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(
        s.contains("converted ") && s.contains(" nodes to bf16 with "),
        "{s}"
    );
    assert!(
        s.contains("rule        rule 1 'logits' -> f32 (--keep-f32)"),
        "{s}"
    );
    assert!(
        s.contains("%layers.0.self_attn.probs = softmax [normalization]"),
        "{s}"
    );
    assert!(s.contains("accumulates f32"), "{s}");
}

#[test]
fn compile_emits_ir_and_dot_and_dumps_after_a_pass() {
    let dir = tempfile::tempdir().unwrap();
    let ir = dir.path().join("g.ir");
    let o = castor(&[
        "compile",
        path_str(&fixture("gpt2_lm")),
        "--precision",
        "fp16",
        "--seq",
        "4",
        "--emit",
        "ir",
        "-o",
        path_str(&ir),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let g = castor_ir::text::parse(&fs::read_to_string(&ir).unwrap()).unwrap();
    castor_ir::verify(&g).unwrap();
    assert!(g
        .nodes()
        .any(|(_, n)| matches!(n.op, castor_ir::Op::ParamCopy { .. })));

    // A compiled IR file compiles again (fp32 leaves it alone apart from accumulation).
    let o = castor(&[
        "compile",
        path_str(&ir),
        "--precision",
        "fp32",
        "--emit",
        "dot",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(
        s.contains("digraph") && s.contains("shape=diamond") && s.contains("#fb6a4a"),
        "casts and f16 nodes are drawn"
    );

    let o = castor(&[
        "compile",
        path_str(&root().join("tests/ir/mlp.ir")),
        "--precision",
        "bf16",
        "--dump-after",
        "autocast",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("# IR after autocast\ngraph mlp {"),
        "{}",
        stdout(&o)
    );

    let o = castor(&[
        "compile",
        path_str(&root().join("tests/ir/mlp.ir")),
        "--dump-after",
        "nosuch",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o)
            .contains("no pass named `nosuch` (passes: input, classify, autocast, fold_casts)"),
        "{}",
        stderr(&o)
    );

    // A training step's build is a pipeline too: each of its passes can be dumped.
    let o = castor(&[
        "compile",
        path_str(&root().join("tests/ir/training_step.ir")),
        "--train",
        "--dump-after",
        "optimizer",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for line in [
        "pass        autodiff    differentiated `%loss`",
        "pass        accumulate  6 gradient(s) written to state",
        "pass        optimizer   AdamW update(s) of 6 parameter buffer(s)",
        "pass        remat       remat none",
        "pass        fusion      ",
        "# IR after optimizer\ngraph micro_step {",
        "graph optimizer_step {",
    ] {
        assert!(out.contains(line), "{line}: {out}");
    }
    let o = castor(&[
        "compile",
        path_str(&root().join("tests/ir/training_step.ir")),
        "--train",
        "--dump-after",
        "nosuch",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains(
            "(passes: input, classify, autocast, fold_casts; training: classifier, autodiff, \
             classifier_step, epilogue, accumulate, optimizer, fp8_scaling, fp8_weights, nf4, \
             parallel, remat, fusion)"
        ),
        "{}",
        stderr(&o)
    );
}

#[test]
fn conflicting_overrides_and_bad_policy_files_are_invalid_input() {
    let o = castor(&[
        "compile",
        path_str(&fixture("gpt2_lm")),
        "--precision",
        "bf16",
        "--keep-f32",
        "*.ln_*",
        "--force-low",
        "h.0.*",
    ]);
    assert_eq!(o.status.code(), Some(3));
    let e = stderr(&o);
    assert!(
        e.contains("conflicting precision rules for node `%h.0.ln_1`"),
        "{e}"
    );
    assert!(
        e.contains("rule 1 '*.ln_*' -> f32 (--keep-f32)")
            && e.contains("rule 2 'h.0.*' -> bf16 (--force-low)"),
        "{e}"
    );

    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("p.toml");
    fs::write(&policy, "[lists]\ndeny_add = [\"softmax\"\n").unwrap();
    let o = castor(&[
        "compile",
        path_str(&fixture("gpt2_lm")),
        "--precision",
        "bf16",
        "--policy",
        path_str(&policy),
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert!(stderr(&o).contains("p.toml"), "{}", stderr(&o));

    let o = castor(&[
        "compile",
        path_str(&root().join("tests/ir/mlp.ir")),
        "--precision",
        "fp32",
        "--force-low",
        "fc",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains("no low-precision dtype"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn train_on_cuda_without_a_gpu_is_a_clear_error() {
    if castor_runtime::cuda_probe::probe().is_ok() {
        return; // the GPU tests (tests/cuda_gpu.rs) train there
    }
    let dir = fixture("gpt2_lm");
    let out = tempfile::tempdir().unwrap();
    let save = out.path().join("saved");
    let o = castor(&[
        "train",
        path_str(&dir),
        "--data",
        path_str(&dir.join("input.safetensors")),
        "--steps",
        "1",
        "--device",
        "cuda",
        "--save",
        path_str(&save),
    ]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("--device cuda"), "{err}");
    assert!(
        err.contains("no CUDA driver") || err.contains("no device") || err.contains("driver"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(!save.exists(), "nothing is written");
}

#[test]
fn compile_with_remat_plans_a_training_step_from_a_config_alone() {
    let config = root().join("assets").join("configs").join("gpt2-124m.json");
    let o = castor(&[
        "compile",
        path_str(&config),
        "--precision",
        "bf16",
        "--batch",
        "1",
        "--seq",
        "64",
        "--remat",
        "selective",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("memory anatomy"), "{s}");
    assert!(s.contains("recompute"), "{s}");
    assert!(s.contains("MFU"), "{s}");
}
