//! The command line end to end: the demo, inspect, and the errors a user sees, with their exit
//! codes (README: 3 invalid input, 5 device unavailable).

mod common;

use common::*;
use std::fs;

#[test]
fn demo_runs_without_files() {
    let o = castor(&["demo"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("family      gpt2 (GPT2LMHeadModel"), "{s}");
    assert!(s.contains("forward "), "{s}");
    assert!(s.contains("next-byte cross-entropy"), "{s}");
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
    let s = stdout(&o);
    let ir = &s[s.find("\n\ngraph ").expect("IR printed")..];
    castor_ir::verify(&castor_ir::text::parse(ir).unwrap()).unwrap();
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
fn eval_on_cuda_without_a_cuda_executor_is_a_clear_error() {
    let dir = fixture("gpt2_lm");
    let out = tempfile::tempdir().unwrap();
    let o = castor(&[
        "eval",
        path_str(&dir),
        "--input",
        path_str(&dir.join("input.safetensors")),
        "--out",
        path_str(&out.path().join("o.safetensors")),
        "--device",
        "cuda",
    ]);
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
    let o = castor(&[
        "eval",
        path_str(&dir),
        "--input",
        path_str(&input),
        "--out",
        path_str(&tmp.path().join("o.safetensors")),
        "--device",
        "cpu",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains("`input_ids`[0, 2] = 99 is outside the vocabulary [0, 99)"),
        "{}",
        stderr(&o)
    );
}
