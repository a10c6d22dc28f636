//! The checkpoints in `tests/fixtures/<variant>/` (written by transformers): each loads with
//! the expected head, prefix, dtype and layout, its graph verifies with the parameters named
//! exactly as in the file, its parameter count matches transformers', and its inputs and
//! expected outputs match the graph's inputs and outputs.

use crate::common;
use crate::exec;

use castor_ir::{DType, Op};
use castor_models::{Head, Model, SafetensorsFile};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

struct Variant {
    name: &'static str,
    architecture: &'static str,
    head: Head,
    prefix: &'static str,
    dtype: DType,
    sharded: bool,
    /// The rotary base the graph must use (LLaMA).
    rope_theta: Option<f64>,
}

const VARIANTS: [Variant; 6] = [
    Variant {
        name: "gpt2_lm",
        architecture: "GPT2LMHeadModel",
        head: Head::CausalLm,
        prefix: "transformer.",
        dtype: DType::F32,
        sharded: false,
        rope_theta: None,
    },
    Variant {
        name: "gpt2_base",
        architecture: "GPT2Model",
        head: Head::Base,
        prefix: "",
        dtype: DType::F16,
        sharded: false,
        rope_theta: None,
    },
    Variant {
        name: "bert_base",
        architecture: "BertModel",
        head: Head::Pooler,
        prefix: "",
        dtype: DType::F32,
        sharded: false,
        rope_theta: None,
    },
    Variant {
        name: "bert_mlm",
        architecture: "BertForMaskedLM",
        head: Head::MaskedLm,
        prefix: "bert.",
        dtype: DType::BF16,
        sharded: false,
        rope_theta: None,
    },
    Variant {
        name: "llama_gqa",
        architecture: "LlamaForCausalLM",
        head: Head::CausalLm,
        prefix: "model.",
        dtype: DType::BF16,
        sharded: true,
        rope_theta: Some(500000.0),
    },
    Variant {
        name: "llama_tied",
        architecture: "LlamaForCausalLM",
        head: Head::CausalLm,
        prefix: "model.",
        dtype: DType::F32,
        sharded: false,
        rope_theta: Some(10000.0),
    },
];

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// `variants.<variant>.num_parameters` in MANIFEST.json: transformers' `num_parameters()`.
fn manifest_count(dir: &Path, variant: &str) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("MANIFEST.json")).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json["variants"][variant]["num_parameters"].as_u64()
}

#[test]
fn fixtures_load_and_build() {
    let dir = fixtures_dir();
    if !dir.join("MANIFEST.json").is_file() {
        eprintln!("no fixtures at {}; skipping", dir.display());
        return;
    }
    let mut checked = 0;
    for v in &VARIANTS {
        let path = dir.join(v.name);
        assert!(path.is_dir(), "fixture {} is missing", v.name);
        let m = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", v.name));
        assert_eq!(m.architecture(), v.architecture, "{}", v.name);
        assert_eq!(m.head(), v.head, "{}", v.name);
        assert_eq!(m.prefix(), v.prefix, "{}", v.name);
        assert_eq!(m.checkpoint_dtype(), Some(v.dtype), "{}", v.name);
        let ckpt = m.checkpoint().unwrap();
        assert_eq!(ckpt.is_sharded(), v.sharded, "{}", v.name);
        if v.sharded {
            assert!(ckpt.files().len() >= 2, "{}", v.name);
        }
        let report = m.report();
        assert!(
            report.unused.is_empty(),
            "{}: unused {:?}",
            v.name,
            report.unused
        );

        // Parameter count: the manifest's, else every stored tensor that is a parameter.
        let stored: u64 = ckpt
            .names()
            .filter(|n| !report.ignored_buffers.iter().any(|b| b == n))
            .filter(|n| !report.tied_copies.iter().any(|b| b == n))
            .map(|n| ckpt.info(n).unwrap().numel() as u64)
            .sum();
        assert_eq!(m.parameter_count(), stored, "{}", v.name);
        let count = manifest_count(&dir, v.name).expect("MANIFEST.json records num_parameters");
        assert_eq!(m.parameter_count(), count, "{}: MANIFEST.json", v.name);

        // Graph for the fixture's input shape.
        let inputs = SafetensorsFile::open(path.join("input.safetensors"))
            .unwrap_or_else(|e| panic!("{}: {e}", v.name));
        let ids = inputs
            .info("input_ids")
            .expect("input_ids in input.safetensors");
        let (b, t) = (ids.shape[0], ids.shape[1]);
        let g = m
            .build_graph(b, t)
            .unwrap_or_else(|e| panic!("{}: {e}", v.name));
        castor_ir::verify(&g).unwrap_or_else(|e| panic!("{}: {e}", v.name));
        let params: BTreeSet<&str> = g.params().map(|p| g.name(p)).collect();
        for p in &params {
            assert!(
                ckpt.contains(p),
                "{}: graph param `{p}` not in the checkpoint",
                v.name
            );
        }
        assert_eq!(params.len(), m.expected_params().len(), "{}", v.name);
        if let Some(theta) = v.rope_theta {
            let ropes: Vec<&Op> = g
                .nodes()
                .map(|(_, n)| &n.op)
                .filter(|op| matches!(op, Op::Rope { .. }))
                .collect();
            assert!(!ropes.is_empty());
            assert!(
                ropes.iter().all(|op| **op
                    == Op::Rope {
                        theta,
                        scaling: castor_ir::RopeScaling::None
                    }),
                "{}",
                v.name
            );
        }
        let mut feeds: HashMap<String, castor_ir::Tensor> = m.load_params().unwrap();
        for name in m.input_names() {
            let info = inputs
                .info(name)
                .unwrap_or_else(|| panic!("{}: no `{name}`", v.name));
            assert_eq!(info.shape, vec![b, t], "{}: input `{name}`", v.name);
            feeds.insert(name.to_string(), inputs.tensor(name).unwrap());
        }
        let expected = SafetensorsFile::open(path.join("expected.safetensors"))
            .unwrap_or_else(|e| panic!("{}: {e}", v.name));
        for &out in g.outputs() {
            let name = g.name(out);
            let info = expected
                .info(name)
                .unwrap_or_else(|| panic!("{}: expected.safetensors lacks `{name}`", v.name));
            assert_eq!(info.shape, g.ty(out).shape.0, "{}: output `{name}`", v.name);
        }

        // The graph computes what transformers computed (F32 from the stored weights).
        let got = exec::run(&g, &feeds);
        for (name, t) in &got {
            let want = expected.read_f32(name).unwrap();
            let err = castor_ir::relative_error(t.as_f32().unwrap(), &want);
            eprintln!("{}: `{name}` relative error {err:.2e}", v.name);
            assert!(err < 1e-5, "{}: `{name}` relative error {err:.2e}", v.name);
        }
        checked += 1;
    }
    eprintln!("checked {checked} fixture(s)");
}

/// Copies a fixture's checkpoint files (not inputs or outputs) into a temporary folder.
fn temp_copy(variant: &str) -> Option<tempfile::TempDir> {
    let src = fixtures_dir().join(variant);
    if !src.is_dir() {
        return None;
    }
    let dst = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if name == "config.json" || name.starts_with("model") {
            std::fs::copy(&path, dst.path().join(&name)).unwrap();
        }
    }
    Some(dst)
}

/// Rewrites `file` keeping each tensor's stored bytes, after `edit` changes the list.
fn rewrite(file: &Path, edit: impl FnOnce(&mut Vec<(String, common::Owned)>)) {
    let f = SafetensorsFile::open(file).unwrap();
    let mut tensors: Vec<(String, common::Owned)> = f
        .names()
        .map(|n| {
            let i = f.info(n).unwrap();
            let owned = common::Owned {
                dtype: i.dtype,
                shape: i.shape.clone(),
                data: f.bytes(n).unwrap().to_vec(),
            };
            (n.to_string(), owned)
        })
        .collect();
    drop(f);
    edit(&mut tensors);
    common::write_file(file, tensors);
}

#[test]
fn edited_fixture_copies_are_reported() {
    let Some(dir) = temp_copy("gpt2_lm") else {
        return;
    };
    let file = dir.path().join("model.safetensors");
    rewrite(&file, |t| {
        t.retain(|(n, _)| {
            n != "transformer.h.0.ln_1.weight" && n != "transformer.h.1.attn.c_proj.bias"
        });
        for (n, o) in t.iter_mut() {
            if n == "transformer.wpe.weight" {
                o.shape = vec![16, 64];
            }
        }
        t.push((
            "transformer.extra.weight".into(),
            common::floats(castor_models::safetensors::Dtype::F32, &[3], 0),
        ));
    });
    let e = Model::load(dir.path()).unwrap_err().to_string();
    common::assert_contains(
        &e,
        &[
            "does not match GPT2LMHeadModel",
            "2 missing tensor(s)",
            "`transformer.h.0.ln_1.weight` (expected shape [32])",
            "`transformer.h.1.attn.c_proj.bias` (expected shape [32])",
            "`transformer.wpe.weight`: expected [32,32], found [16,64]",
        ],
    );

    // An unknown tensor alone is a warning, not an error.
    let dir = temp_copy("gpt2_lm").unwrap();
    rewrite(&dir.path().join("model.safetensors"), |t| {
        t.push((
            "transformer.extra.weight".into(),
            common::floats(castor_models::safetensors::Dtype::F32, &[3], 0),
        ));
    });
    let m = Model::load(dir.path()).unwrap();
    assert_eq!(m.report().unused, vec!["transformer.extra.weight"]);

    // A bare config.json builds the same parameters without weights.
    let m = Model::load(fixtures_dir().join("llama_gqa/config.json")).unwrap();
    assert_eq!(
        Some(m.parameter_count()),
        manifest_count(&fixtures_dir(), "llama_gqa")
    );
    assert!(m.checkpoint().is_none());
}

#[test]
fn edited_sharded_fixture_copies_are_refused() {
    let Some(dir) = temp_copy("llama_gqa") else {
        return;
    };
    let index = dir.path().join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    std::fs::write(
        &index,
        text.replace(
            "\"model.norm.weight\": \"model-00007-of-00007.safetensors\"",
            "\"model.norm.weight\": \"../model-00007-of-00007.safetensors\"",
        ),
    )
    .unwrap();
    common::assert_contains(
        &Model::load(dir.path()).unwrap_err().to_string(),
        &[
            "shard file name `../model-00007-of-00007.safetensors`",
            "model.norm.weight",
        ],
    );

    // A truncated shard: its header length now exceeds the file.
    let dir = temp_copy("llama_gqa").unwrap();
    let shard = dir.path().join("model-00003-of-00007.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..40]).unwrap();
    common::assert_contains(
        &Model::load(dir.path()).unwrap_err().to_string(),
        &[
            "model-00003-of-00007.safetensors",
            "header length",
            "exceeds",
        ],
    );
}
