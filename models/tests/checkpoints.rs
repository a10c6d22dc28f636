//! Checkpoint folders written here with the `safetensors` serializer: loading, head and prefix
//! detection, the load report, parameter values, sharding, and every validation error.

use crate::common;

use castor_ir::DType;
use castor_models::safetensors::Dtype;
use castor_models::{Checkpoint, Head, Model, ModelError, SafetensorsFile};
use common::*;
use half::{bf16, f16};
use std::path::Path;

fn check_graph(m: &Model) {
    let g = m.build_graph(2, 5).expect("graph builds");
    castor_ir::verify(&g).expect("graph verifies");
    let names: std::collections::BTreeSet<&str> = g.params().map(|v| g.name(v)).collect();
    let expected: std::collections::BTreeSet<&str> = m
        .expected_params()
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(names, expected);
    for p in m.expected_params() {
        assert!(
            m.checkpoint().unwrap().contains(&p.name),
            "`{}` not in file",
            p.name
        );
    }
}

#[test]
fn tiny_gpt2_loads_with_values() {
    let tensors = params_for(TINY_GPT2, Dtype::F32);
    let dir = write_checkpoint(TINY_GPT2, tensors.clone());
    let m = Model::load(dir.path()).unwrap();
    assert_eq!(m.head(), Head::CausalLm);
    assert_eq!(m.prefix(), "transformer.");
    assert_eq!(m.report(), &Default::default());
    assert_eq!(m.checkpoint_dtype(), Some(DType::F32));
    let total: usize = tensors
        .iter()
        .map(|(_, t)| t.shape.iter().product::<usize>())
        .sum();
    assert_eq!(m.parameter_count(), total as u64);
    check_graph(&m);
    let params = m.load_params().unwrap();
    assert_eq!(params.len(), tensors.len());
    for (name, t) in &tensors {
        let want: Vec<f32> = t
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let got = &params[name];
        assert_eq!(got.dtype(), DType::F32);
        assert_eq!(got.shape().0, t.shape);
        assert_eq!(got.as_f32().unwrap(), want.as_slice(), "{name}");
    }
    assert_eq!(
        m.load_param("transformer.wte.weight").unwrap().shape().0,
        vec![50, 8]
    );
    assert!(matches!(
        m.load_param("lm_head.weight"),
        Err(ModelError::NotAParameter { .. })
    ));
}

#[test]
fn base_checkpoint_into_lm_head_and_report_categories() {
    // Like the original `gpt2` upload: GPT2LMHeadModel config, unprefixed names, causal-mask
    // buffers, a stored copy of the tied head, and something unknown.
    let mut tensors: Vec<(String, Owned)> = params_for(TINY_GPT2, Dtype::F32)
        .into_iter()
        .map(|(n, t)| (n.trim_start_matches("transformer.").to_string(), t))
        .collect();
    tensors.push((
        "h.0.attn.bias".into(),
        floats(Dtype::F32, &[1, 1, 16, 16], 1),
    ));
    tensors.push(("h.1.attn.masked_bias".into(), floats(Dtype::F32, &[], 2)));
    tensors.push(("lm_head.weight".into(), floats(Dtype::F32, &[50, 8], 3)));
    tensors.push(("score.weight".into(), floats(Dtype::F32, &[2, 8], 4)));
    let dir = write_checkpoint(TINY_GPT2, tensors);
    let m = Model::load(dir.path()).unwrap();
    assert_eq!(m.head(), Head::CausalLm);
    assert_eq!(m.prefix(), "");
    assert_eq!(m.report().unused, vec!["score.weight"]);
    assert_eq!(m.report().tied_copies, vec!["lm_head.weight"]);
    assert_eq!(
        m.report().ignored_buffers,
        vec!["h.0.attn.bias", "h.1.attn.masked_bias"]
    );
    check_graph(&m);
    let g = m.build_graph(1, 3).unwrap();
    let logits = g.node(g.value(g.lookup("logits").unwrap()).producer);
    assert_eq!(g.name(logits.inputs[1]), "wte.weight");
}

#[test]
fn head_guessed_from_names_without_architectures() {
    let config = TINY_GPT2.replace(r#""architectures": ["GPT2LMHeadModel"],"#, "");
    let dir = write_checkpoint(&config, params_for(TINY_GPT2, Dtype::F32));
    assert_eq!(Model::load(dir.path()).unwrap().head(), Head::CausalLm);
    let base = TINY_GPT2.replace("GPT2LMHeadModel", "GPT2Model");
    let dir = write_checkpoint(&config, params_for(&base, Dtype::F32));
    let m = Model::load(dir.path()).unwrap();
    assert_eq!((m.head(), m.prefix()), (Head::Base, ""));
    assert_eq!(m.output_names(), ["last_hidden_state"]);
}

#[test]
fn missing_and_mismatched_tensors_are_all_reported() {
    let mut tensors = params_for(TINY_GPT2, Dtype::F32);
    tensors.retain(|(n, _)| n != "transformer.h.1.mlp.c_fc.bias" && n != "transformer.ln_f.weight");
    for (n, t) in tensors.iter_mut() {
        if n == "transformer.wpe.weight" {
            *t = floats(Dtype::F32, &[8, 8], 0);
        }
        if n == "transformer.h.0.attn.c_attn.weight" {
            *t = floats(Dtype::F32, &[24, 8], 0);
        }
        if n == "transformer.h.0.ln_1.bias" {
            *t = Owned {
                dtype: Dtype::I64,
                shape: vec![8],
                data: vec![0; 64],
            };
        }
    }
    let dir = write_checkpoint(TINY_GPT2, tensors);
    let err = Model::load(dir.path()).unwrap_err();
    let ModelError::Mismatch(report) = &err else {
        panic!("expected a mismatch, got {err}");
    };
    assert_eq!(report.missing.len(), 2);
    assert_eq!(report.shape_mismatches.len(), 2);
    assert_eq!(report.bad_dtypes.len(), 1);
    assert_contains(
        &err.to_string(),
        &[
            "does not match GPT2LMHeadModel",
            "2 missing tensor(s)",
            "`transformer.h.1.mlp.c_fc.bias` (expected shape [32])",
            "`transformer.ln_f.weight` (expected shape [8])",
            "2 shape mismatch(es)",
            "`transformer.wpe.weight`: expected [16,8], found [8,8]",
            "`transformer.h.0.attn.c_attn.weight`: expected [8,24], found [24,8]",
            "`transformer.h.0.ln_1.bias` in",
            "stored as I64",
        ],
    );
}

#[test]
fn bert_mlm_bf16_with_buffers_tied_copies_and_legacy_names() {
    let mut tensors: Vec<(String, Owned)> = params_for(TINY_BERT_MLM, Dtype::BF16)
        .into_iter()
        .map(|(n, t)| {
            let n = n
                .replace("embeddings.LayerNorm.weight", "embeddings.LayerNorm.gamma")
                .replace("embeddings.LayerNorm.bias", "embeddings.LayerNorm.beta");
            (n, t)
        })
        .collect();
    tensors.push((
        "bert.embeddings.position_ids".into(),
        Owned {
            dtype: Dtype::I64,
            shape: vec![1, 16],
            data: (0..16i64).flat_map(i64::to_le_bytes).collect(),
        },
    ));
    tensors.push((
        "cls.predictions.decoder.bias".into(),
        floats(Dtype::BF16, &[40], 9),
    ));
    tensors.push((
        "cls.predictions.decoder.weight".into(),
        floats(Dtype::BF16, &[40, 8], 9),
    ));
    tensors.push((
        "bert.pooler.dense.weight".into(),
        floats(Dtype::BF16, &[8, 8], 9),
    ));
    let dir = write_checkpoint(TINY_BERT_MLM, tensors.clone());
    let m = Model::load(dir.path()).unwrap();
    assert_eq!((m.head(), m.prefix()), (Head::MaskedLm, "bert."));
    assert_eq!(m.checkpoint_dtype(), Some(DType::BF16));
    assert_eq!(
        m.report().ignored_buffers,
        vec!["bert.embeddings.position_ids"]
    );
    assert_eq!(
        m.report().tied_copies,
        vec![
            "cls.predictions.decoder.bias",
            "cls.predictions.decoder.weight"
        ]
    );
    assert_eq!(m.report().unused, vec!["bert.pooler.dense.weight"]);
    assert!(m
        .expected_params()
        .iter()
        .any(|p| p.name == "bert.embeddings.LayerNorm.gamma"));
    check_graph(&m);
    // BF16 values widen exactly.
    let (_, src) = tensors
        .iter()
        .find(|(n, _)| n == "cls.predictions.bias")
        .unwrap();
    let want: Vec<f32> = src
        .data
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    let got = m.load_param("cls.predictions.bias").unwrap();
    assert_eq!(got.as_f32().unwrap(), want.as_slice());
    // The stored-dtype view keeps BF16; the buffer reads as i64.
    let ckpt = m.checkpoint().unwrap();
    assert_eq!(
        ckpt.tensor("cls.predictions.bias").unwrap().dtype(),
        DType::BF16
    );
    let ids = ckpt.tensor("bert.embeddings.position_ids").unwrap();
    assert_eq!(
        ids.as_i64().unwrap(),
        (0..16).collect::<Vec<i64>>().as_slice()
    );
}

#[test]
fn f16_reads_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    let vals = [0.1f32, -65504.0, 6.1e-5, 1.0e-7, f32::INFINITY];
    let data = vals
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    write_file(
        &path,
        vec![(
            "x".to_string(),
            Owned {
                dtype: Dtype::F16,
                shape: vec![5],
                data,
            },
        )],
    );
    let f = SafetensorsFile::open(&path).unwrap();
    let got = f.read_f32("x").unwrap();
    let want: Vec<f32> = vals.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    assert_eq!(got, want);
    assert_contains(&err_text(f.read_i64("x")), &["`x`", "stored as F16", "I64"]);
    assert_contains(&err_text(f.read_f32("y")), &["tensor `y` is not in"]);
}

/// A LLaMA checkpoint split over two shards with an index; `edit` may change the index map.
fn sharded_llama(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), TINY_LLAMA).unwrap();
    let tensors = params_for(TINY_LLAMA, Dtype::BF16);
    let half = tensors.len() / 2;
    let names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let mut map = serde_json::Map::new();
    for (i, chunk) in [&tensors[..half], &tensors[half..]].into_iter().enumerate() {
        for (n, _) in chunk {
            map.insert(n.clone(), names[i].into());
        }
        write_file(&dir.path().join(names[i]), chunk.to_vec());
    }
    edit(&mut map);
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
    dir
}

#[test]
fn sharded_llama_loads() {
    let dir = sharded_llama(|_| {});
    let m = Model::load(dir.path()).unwrap();
    let ckpt = m.checkpoint().unwrap();
    assert!(ckpt.is_sharded());
    assert_eq!(ckpt.files().len(), 2);
    assert_eq!((m.head(), m.prefix()), (Head::CausalLm, "model."));
    check_graph(&m);
    assert_eq!(m.load_params().unwrap().len(), m.expected_params().len());
}

#[test]
fn index_errors() {
    let dir = sharded_llama(|m| {
        m.insert(
            "model.norm.weight".into(),
            "../model-00002-of-00002.safetensors".into(),
        );
    });
    let e = Model::load(dir.path()).unwrap_err();
    assert!(matches!(e, ModelError::UnsafeShardPath { .. }), "{e}");
    assert_contains(
        &e.to_string(),
        &[
            "model.safetensors.index.json",
            "`../model-00002-of-00002.safetensors`",
            "model.norm.weight",
            "not a plain file name",
        ],
    );
    for bad in ["/etc/passwd", "sub/model.safetensors", "a\\b.safetensors"] {
        let dir = sharded_llama(|m| {
            m.insert("model.norm.weight".into(), bad.into());
        });
        assert!(matches!(
            Model::load(dir.path()),
            Err(ModelError::UnsafeShardPath { .. })
        ));
    }

    let dir = sharded_llama(|m| {
        m.insert(
            "model.norm.weight".into(),
            "model-00001-of-00002.safetensors".into(),
        );
    });
    assert_contains(
        &err_text(Model::load(dir.path())),
        &[
            "puts tensor `model.norm.weight` in `model-00001-of-00002.safetensors`",
            "but it is in",
        ],
    );

    let dir = sharded_llama(|m| {
        m.insert(
            "model.ghost".into(),
            "model-00001-of-00002.safetensors".into(),
        );
    });
    assert_contains(
        &err_text(Model::load(dir.path())),
        &["`model.ghost`", "does not contain it"],
    );

    let dir = sharded_llama(|m| {
        m.remove("model.norm.weight");
    });
    assert_contains(
        &err_text(Model::load(dir.path())),
        &["holds tensor `model.norm.weight`, which `weight_map` does not list"],
    );

    let dir = sharded_llama(|m| {
        m.insert(
            "model.norm.weight".into(),
            "model-00003-of-00002.safetensors".into(),
        );
    });
    assert_contains(
        &err_text(Model::load(dir.path())),
        &["shard `model-00003-of-00002.safetensors` is listed but"],
    );

    // The same tensor in both shards.
    let dir = sharded_llama(|_| {});
    let second = dir.path().join("model-00002-of-00002.safetensors");
    let first = SafetensorsFile::open(dir.path().join("model-00001-of-00002.safetensors")).unwrap();
    let dup = first.names().next().unwrap().to_string();
    let f2 = SafetensorsFile::open(&second).unwrap();
    let mut t: Vec<(String, Owned)> = f2
        .names()
        .map(|n| {
            let i = f2.info(n).unwrap();
            (
                n.to_string(),
                Owned {
                    dtype: i.dtype,
                    shape: i.shape.clone(),
                    data: f2.bytes(n).unwrap().to_vec(),
                },
            )
        })
        .collect();
    let i = first.info(&dup).unwrap();
    t.push((
        dup.clone(),
        Owned {
            dtype: i.dtype,
            shape: i.shape.clone(),
            data: first.bytes(&dup).unwrap().to_vec(),
        },
    ));
    drop(f2);
    write_file(&second, t);
    let e = Model::load(dir.path()).unwrap_err();
    assert!(matches!(e, ModelError::DuplicateTensor { .. }), "{e}");
    assert_contains(
        &e.to_string(),
        &[
            &format!("`{dup}` is stored twice"),
            "model-00001-of-00002",
            "model-00002-of-00002",
        ],
    );

    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"metadata": {}}"#,
    )
    .unwrap();
    assert_contains(&err_text(Model::load(dir.path())), &["has no `weight_map`"]);
}

#[test]
fn folder_without_weights() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), TINY_GPT2).unwrap();
    std::fs::write(dir.path().join("pytorch_model.bin"), b"").unwrap();
    assert_contains(
        &err_text(Model::load(dir.path())),
        &[
            "neither `model.safetensors` nor `model.safetensors.index.json`",
            "PyTorch pickle",
        ],
    );
    assert_contains(
        &err_text(Checkpoint::open(dir.path().join("config.json"))),
        &["not a folder"],
    );
}

/// A safetensors file from a literal header and `data_len` zero bytes; `declared` overrides
/// the 8-byte header length.
fn raw_file(
    dir: &Path,
    header: &str,
    data_len: usize,
    declared: Option<u64>,
) -> std::path::PathBuf {
    let path = dir.join("model.safetensors");
    let mut bytes = declared
        .unwrap_or(header.len() as u64)
        .to_le_bytes()
        .to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data_len, 0);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn open_raw(header: &str, data_len: usize, declared: Option<u64>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = raw_file(dir.path(), header, data_len, declared);
    err_text(SafetensorsFile::open(path))
}

#[test]
fn malformed_safetensors_files() {
    let ok = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    {
        let dir = tempfile::tempdir().unwrap();
        let f = SafetensorsFile::open(raw_file(dir.path(), ok, 8, None)).unwrap();
        assert_eq!(f.read_f32("a").unwrap(), vec![0.0, 0.0]);
    }
    assert_contains(
        &open_raw(ok, 8, Some(1 << 40)),
        &[
            "model.safetensors",
            "header length 1099511627776",
            "exceeds",
        ],
    );
    {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        std::fs::write(&path, [1, 2, 3]).unwrap();
        assert_contains(
            &err_text(SafetensorsFile::open(path)),
            &["3 bytes long, shorter than the 8-byte"],
        );
    }
    assert_contains(
        &open_raw(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}}"#,
            8,
            None,
        ),
        &[
            "tensor `a`",
            "data_offsets [0, 16] reach past the end of the data region (8 bytes)",
        ],
    );
    assert_contains(
        &open_raw(
            r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            8,
            None,
        ),
        &["tensor `a`", "hold 8 bytes, but F32 [3] needs 12"],
    );
    assert_contains(
        &open_raw(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F16","shape":[2],"data_offsets":[6,10]}}"#,
            10,
            None,
        ),
        &["tensor `b`", "overlap tensor `a` at [0, 8]"],
    );
    assert_contains(
        &open_raw(
            r#"{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}"#,
            16,
            None,
        ),
        &[
            "tensor `a`",
            "`dtype`: expected a safetensors dtype",
            "found \"F128\"",
        ],
    );
    assert_contains(
        &open_raw(
            r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,8]}}"#,
            8,
            None,
        ),
        &["tensor `a`", "overflows a 64-bit byte count"],
    );
    assert_contains(
        &open_raw(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#,
            8,
            None,
        ),
        &["end before they start"],
    );
    assert_contains(
        &open_raw("[1,2]", 0, None),
        &["not a JSON object of tensors"],
    );
    assert_contains(
        &open_raw("{\"a\": ", 0, None),
        &["malformed safetensors header"],
    );
    assert_contains(
        &open_raw(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
            None,
        ),
        &["tensor `a`", "the header lists this name twice"],
    );
    assert_contains(
        &open_raw(
            r#"{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#,
            8,
            None,
        ),
        &[
            "tensor `a`",
            "`shape`: expected a list of non-negative integers, found [-2]",
        ],
    );
    assert_contains(
        &open_raw(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}}"#,
            8,
            None,
        ),
        &[
            "tensor `a`",
            "`data_offsets`: expected [start, end]",
            "found [0,8,9]",
        ],
    );
    assert_contains(
        &open_raw(r#"{"__metadata__":{"format":1}}"#, 0, None),
        &["`__metadata__` must map strings to strings"],
    );
    // Unsupported dtypes are valid entries, refused only when read.
    let dir = tempfile::tempdir().unwrap();
    let f = SafetensorsFile::open(raw_file(
        dir.path(),
        r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#,
        8,
        None,
    ))
    .unwrap();
    assert_eq!(f.metadata()["format"], "pt");
    assert_contains(&err_text(f.read_f32("a")), &["stored as F64"]);
    assert_contains(&err_text(f.tensor("a")), &["stored as F64"]);
}

#[test]
fn malformed_file_inside_a_checkpoint_names_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), TINY_GPT2).unwrap();
    raw_file(
        dir.path(),
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,9]}}"#,
        8,
        None,
    );
    let e = err_text(Model::load(dir.path()));
    assert_contains(&e, &["model.safetensors`: tensor `a`: data_offsets [0, 9]"]);
}

#[test]
fn writer_round_trips_through_the_reader() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.safetensors");
    let a = castor_ir::Tensor::from_f32(DType::BF16, [2, 2], vec![1.0, -0.5, 3.0, 0.1]);
    let b = castor_ir::Tensor::from_i64(DType::I64, [3], vec![1, -2, 3]);
    let c = castor_ir::Tensor::from_bool([2], vec![true, false]);
    castor_models::write_safetensors(&path, &[("a", &a), ("b", &b), ("c", &c)]).unwrap();
    let f = SafetensorsFile::open(&path).unwrap();
    assert_eq!(f.metadata()["format"], "pt");
    assert_eq!(f.tensor("a").unwrap(), a);
    assert_eq!(f.tensor("b").unwrap(), b);
    assert_eq!(f.tensor("c").unwrap(), c);
}

/// FP8 tensors (`F8_E4M3`, `F8_E5M2`) write one byte per value and read back as they were:
/// every byte of each format (NaNs written as `0x7F | sign`), the values the `safetensors`
/// crate reads, and an FP8 tensor made from F32 values (rounded saturating).
#[test]
fn fp8_tensors_round_trip_through_the_writer_and_reader() {
    use castor_ir::fp8::Fp8Format;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fp8.safetensors");
    let every: Vec<u8> = (0..=255).collect();
    let e4m3 = castor_ir::Tensor::from_fp8_bytes(DType::F8E4M3, [16, 16], &every);
    let e5m2 = castor_ir::Tensor::from_fp8_bytes(DType::F8E5M2, [2, 128], &every);
    let rounded =
        castor_ir::Tensor::from_f32(DType::F8E5M2, [4], vec![0.3, -1e6, f32::INFINITY, 1e-9]);
    castor_models::write_safetensors(
        &path,
        &[("e4m3", &e4m3), ("e5m2", &e5m2), ("rounded", &rounded)],
    )
    .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(parsed.tensor("e4m3").unwrap().dtype(), Dtype::F8_E4M3);
    assert_eq!(parsed.tensor("e5m2").unwrap().dtype(), Dtype::F8_E5M2);
    let f = SafetensorsFile::open(&path).unwrap();
    for (name, format, t) in [
        ("e4m3", Fp8Format::E4M3, &e4m3),
        ("e5m2", Fp8Format::E5M2, &e5m2),
    ] {
        let stored = f.bytes(name).unwrap();
        assert_eq!(stored, parsed.tensor(name).unwrap().data());
        for (&b, &s) in every.iter().zip(stored) {
            let want = if format.is_nan_byte(b) { b | 0x7F } else { b };
            assert_eq!(s, want, "{name} {b:#04x}");
        }
        let back = f.tensor(name).unwrap();
        assert_eq!(back.ty(), t.ty());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let values = f.read_f32(name).unwrap();
        assert_eq!(bits(back.as_f32().unwrap()), bits(&values), "{name}");
        for (&b, &v) in every.iter().zip(&values) {
            let want = format.decode(b);
            assert!(v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()));
        }
    }
    assert_eq!(f.tensor("rounded").unwrap(), rounded);
    assert_eq!(
        f.read_f32("rounded").unwrap(),
        [0.3125, -57344.0, 57344.0, 0.0]
    );
}

/// FP8 checkpoints store scaled weights (with scale tensors beside them): an FP8 parameter is
/// an unsupported dtype, not weights read as they are.
#[test]
fn fp8_parameters_are_unsupported_dtypes() {
    let mut tensors = params_for(TINY_GPT2, Dtype::F32);
    for (n, t) in tensors.iter_mut() {
        if n == "transformer.h.0.ln_1.bias" {
            *t = Owned {
                dtype: Dtype::F8_E4M3,
                shape: vec![8],
                data: vec![0x38; 8],
            };
        }
    }
    let dir = write_checkpoint(TINY_GPT2, tensors);
    let e = err_text(Model::load(dir.path()));
    assert_contains(
        &e,
        &[
            "1 unsupported dtype(s)",
            "`transformer.h.0.ln_1.bias` in",
            "stored as F8_E4M3, expected F32, F16 or BF16",
        ],
    );
}

/// The streamed writer's files are valid safetensors for the reference implementation too,
/// across every dtype and over several write chunks.
#[test]
fn streamed_files_parse_with_the_safetensors_crate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.safetensors");
    let n = 200_003; // several chunks, and an odd length
    let big: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let tensors = [
        (
            "w.f32",
            castor_ir::Tensor::from_f32(DType::F32, [n], big.clone()),
        ),
        (
            "w.f16",
            castor_ir::Tensor::from_f32(DType::F16, [n], big.clone()),
        ),
        ("w.bf16", castor_ir::Tensor::from_f32(DType::BF16, [n], big)),
        (
            "ids.i32",
            castor_ir::Tensor::from_i64(DType::I32, [3], vec![1, -2, 3]),
        ),
        (
            "ids.i64",
            castor_ir::Tensor::from_i64(DType::I64, [2], vec![1 << 40, -7]),
        ),
        (
            "mask",
            castor_ir::Tensor::from_bool([3], vec![true, false, true]),
        ),
        (
            "empty",
            castor_ir::Tensor::from_f32(DType::F32, [0, 4], vec![]),
        ),
    ];
    let refs: Vec<(&str, &castor_ir::Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    castor_models::write_safetensors(&path, &refs).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(parsed.len(), tensors.len());
    let f = SafetensorsFile::open(&path).unwrap();
    for (name, t) in &tensors {
        assert_eq!(parsed.tensor(name).unwrap().shape(), t.shape().dims());
        assert_eq!(&f.tensor(name).unwrap(), t, "{name}");
    }
    // A name given twice is refused, and the old file is left as it was.
    let e = castor_models::write_safetensors(&path, &[refs[0], refs[0]]).unwrap_err();
    assert!(
        e.to_string().contains("tensor `w.f32` is given twice"),
        "{e}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

/// Bytes built in memory are checked and read exactly as the same bytes in a file.
#[test]
fn in_memory_safetensors_read_as_files_do() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ids.safetensors");
    let ids: Vec<u8> = [3i64, -1, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(Dtype::I64, vec![1, 3], &ids).unwrap();
    let bytes = safetensors::serialize([("input_ids", view)], None).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let file = SafetensorsFile::open(&path).unwrap();
    let memory = SafetensorsFile::from_bytes("the arrays", bytes.clone()).unwrap();
    assert_eq!(memory.path(), Path::new("the arrays"));
    assert_eq!(memory.read_i64("input_ids").unwrap(), vec![3, -1, 7]);
    assert_eq!(
        memory.read_i64("input_ids").unwrap(),
        file.read_i64("input_ids").unwrap()
    );
    // Broken bytes are refused, naming the stand-in for the path.
    match SafetensorsFile::from_bytes("the arrays", bytes[..5].to_vec()) {
        Err(ModelError::Header { file, .. }) => assert_eq!(file, Path::new("the arrays")),
        other => panic!("expected a header error, got {other:?}"),
    }
    match SafetensorsFile::from_bytes("the arrays", bytes[..bytes.len() - 1].to_vec()) {
        Err(ModelError::TensorEntry { file, tensor, .. }) => {
            assert_eq!(
                (file.as_path(), tensor.as_str()),
                (Path::new("the arrays"), "input_ids")
            )
        }
        other => panic!("expected a tensor entry error, got {other:?}"),
    }
}
