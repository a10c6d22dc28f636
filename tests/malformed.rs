//! The malformed-input corpus: every case in `tests/malformed/cases.toml` runs the real
//! `castor` binary and must exit with its documented code, say what was expected, what was
//! found and where (file, tensor, field or line:column), and never panic.
//!
//! Text inputs (config.json files, IR, policies) are checked in as written. Checkpoint
//! folders hold binary safetensors files, so they are made by [`checkpoint_corpus`] below;
//! `corpus_files_match_the_generator` keeps the files on disk equal to it. To rewrite them
//! after changing the generator:
//!
//! ```text
//! REGENERATE_MALFORMED=1 cargo test --test integration malformed::corpus_files_match_the_generator
//! ```

use crate::common;

use castor_models::{Config, Model};
use common::*;
use serde::Deserialize;
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn corpus_dir() -> PathBuf {
    root().join("tests").join("malformed")
}

// ---------------------------------------------------------------------------------------------
// The manifest.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    case: Vec<Case>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    /// Command-line arguments; `{cases}` is tests/malformed, `{root}` the repository root and
    /// `{out}` a fresh temporary folder.
    args: Vec<String>,
    /// The expected exit code (README, "Exit codes").
    exit: i32,
    /// Fragments that must all appear in stderr.
    #[serde(default)]
    stderr: Vec<String>,
    /// Fragments that must all appear in stdout.
    #[serde(default)]
    stdout: Vec<String>,
    /// Fragments that must not appear in stderr.
    #[serde(default)]
    not_stderr: Vec<String>,
    /// The command must finish within this many seconds (absurd configs are refused quickly).
    max_seconds: Option<f64>,
}

fn manifest() -> Manifest {
    let text = fs::read_to_string(corpus_dir().join("cases.toml")).expect("cases.toml is readable");
    toml::from_str(&text).expect("cases.toml parses")
}

#[test]
fn every_malformed_input_fails_cleanly_with_a_precise_message() {
    let m = manifest();
    let cases = corpus_dir();
    let mut failures = Vec::new();
    for case in &m.case {
        let out = tempfile::tempdir().expect("temp dir");
        let args: Vec<String> = case
            .args
            .iter()
            .map(|a| {
                a.replace("{cases}", path_str(&cases))
                    .replace("{root}", path_str(&root()))
                    .replace("{out}", path_str(out.path()))
            })
            .collect();
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let start = Instant::now();
        let o = castor(&refs);
        let took = start.elapsed();
        let (so, se) = (stdout(&o), stderr(&o));
        let mut problems = Vec::new();
        if o.status.code() != Some(case.exit) {
            problems.push(format!(
                "exit code {:?}, expected {}",
                o.status.code(),
                case.exit
            ));
        }
        if se.contains("panicked") || o.status.code() == Some(101) {
            problems.push("panicked".to_string());
        }
        for f in &case.stderr {
            if !se.contains(f.as_str()) {
                problems.push(format!("stderr lacks `{f}`"));
            }
        }
        for f in &case.stdout {
            if !so.contains(f.as_str()) {
                problems.push(format!("stdout lacks `{f}`"));
            }
        }
        for f in &case.not_stderr {
            if se.contains(f.as_str()) {
                problems.push(format!("stderr has `{f}`"));
            }
        }
        if let Some(max) = case.max_seconds {
            if took > Duration::from_secs_f64(max) {
                problems.push(format!("took {took:?}, more than {max} s"));
            }
        }
        if !problems.is_empty() {
            failures.push(format!(
                "case `{}` (castor {}): {}\n--- stdout\n{so}--- stderr\n{se}",
                case.name,
                args.join(" "),
                problems.join("; ")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n\n{}",
        failures.len(),
        m.case.len(),
        failures.join("\n")
    );
}

#[test]
fn the_corpus_is_large_and_every_input_is_used() {
    let m = manifest();
    assert!(m.case.len() >= 30, "only {} cases", m.case.len());
    let mut names = BTreeSet::new();
    for c in &m.case {
        assert!(names.insert(c.name.as_str()), "case `{}` twice", c.name);
        assert!(
            !c.stderr.is_empty() || !c.stdout.is_empty(),
            "case `{}` checks no words",
            c.name
        );
    }
    // Every input file or checkpoint folder is named by some case.
    let all_args: String = m
        .case
        .iter()
        .flat_map(|c| c.args.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("\n");
    for group in ["config", "ir", "policy", "checkpoints"] {
        for entry in fs::read_dir(corpus_dir().join(group)).expect("corpus group") {
            let name = entry.expect("entry").file_name();
            let rel = format!("{{cases}}/{group}/{}", name.to_string_lossy());
            assert!(all_args.contains(&rel), "`{rel}` is used by no case");
        }
    }
}

#[test]
fn corpus_files_match_the_generator() {
    let regenerate = std::env::var_os("REGENERATE_MALFORMED").is_some();
    let dir = corpus_dir().join("checkpoints");
    let corpus = checkpoint_corpus();
    if regenerate {
        let _ = fs::remove_dir_all(&dir);
    }
    let mut expected_dirs = BTreeSet::new();
    for (rel, bytes) in &corpus {
        let path = dir.join(rel);
        if let Some(first) = Path::new(rel).components().next() {
            expected_dirs.insert(first.as_os_str().to_string_lossy().into_owned());
        }
        if regenerate {
            fs::create_dir_all(path.parent().expect("has a parent")).expect("mkdir");
            fs::write(&path, bytes).expect("write corpus file");
        }
        let on_disk = fs::read(&path).unwrap_or_else(|e| {
            panic!("{}: {e} (run with REGENERATE_MALFORMED=1)", path.display())
        });
        assert!(
            &on_disk == bytes,
            "{} differs from the generator (run with REGENERATE_MALFORMED=1)",
            path.display()
        );
    }
    let on_disk: BTreeSet<String> = fs::read_dir(&dir)
        .expect("checkpoints folder")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        on_disk, expected_dirs,
        "stray or missing checkpoint folders"
    );
}

// ---------------------------------------------------------------------------------------------
// The checkpoint generator: small, deterministic safetensors files, most of them broken.

/// A tiny GPT-2: 4-wide, one layer, two heads, 8 tokens, 4 positions.
const TINY: &str = r#"{
  "model_type": "gpt2",
  "architectures": ["GPT2LMHeadModel"],
  "n_embd": 4,
  "n_layer": 1,
  "n_head": 2,
  "vocab_size": 8,
  "n_positions": 4
}
"#;

/// One tensor entry: name, dtype, shape, data bytes.
type Entry = (String, &'static str, Vec<usize>, Vec<u8>);

/// A header JSON text with correct offsets for `entries`, in order, and the data bytes.
fn layout(entries: &[Entry]) -> (String, Vec<u8>) {
    let mut fields = Vec::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in entries {
        let start = data.len();
        data.extend_from_slice(bytes);
        fields.push(format!(
            "{}:{{\"dtype\":\"{dtype}\",\"shape\":{},\"data_offsets\":[{start},{}]}}",
            serde_json::Value::String(name.clone()),
            serde_json::to_string(shape).expect("shape"),
            data.len()
        ));
    }
    (format!("{{{}}}", fields.join(",")), data)
}

/// A safetensors file: the 8-byte length, the header and the data, as given.
fn raw(len: u64, header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A well-formed file with this header text and `data_len` zero bytes of data.
fn with_header(header: &str, data_len: usize) -> Vec<u8> {
    raw(header.len() as u64, header, &vec![0u8; data_len])
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// Every parameter of a model with this config, F32, deterministic small values.
fn params_of(config: &str) -> Vec<Entry> {
    let cfg = Config::parse(config, "config.json").expect("generator config parses");
    let model = Model::from_config(cfg).expect("generator config builds");
    model
        .expected_params()
        .iter()
        .map(|p| {
            let n: usize = p.shape.iter().product();
            let values = (0..n).map(|i| ((i % 7) as f32 - 3.0) / 16.0);
            (p.name.clone(), "F32", p.shape.clone(), f32_bytes(values))
        })
        .collect()
}

fn file(entries: &[Entry]) -> Vec<u8> {
    let (header, data) = layout(entries);
    raw(header.len() as u64, &header, &data)
}

/// (path under tests/malformed/checkpoints, contents), sorted by path.
fn checkpoint_corpus() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let mut folder = |name: &str, files: Vec<(&str, Vec<u8>)>| {
        out.push((format!("{name}/config.json"), TINY.as_bytes().to_vec()));
        for (f, bytes) in files {
            out.push((format!("{name}/{f}"), bytes));
        }
    };
    let single = |bytes: Vec<u8>| vec![("model.safetensors", bytes)];
    let ok_header = r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;

    // The 8-byte length and the header.
    folder("st_shorter_than_length", single(vec![1, 2, 3, 4, 5]));
    folder(
        "st_header_length_past_end",
        single(raw(1000, ok_header, &[0u8; 16])),
    );
    folder(
        "st_header_not_json",
        single(with_header("{\"a\": this is not json", 0)),
    );
    folder("st_header_not_object", single(with_header("[1, 2, 3]", 0)));
    folder(
        "st_header_not_utf8",
        single(raw(4, "", &[0x7b, 0xff, 0xfe, 0x7d])),
    );
    // Entries.
    folder(
        "st_dims_overflow",
        single(with_header(
            r#"{"huge":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#,
            0,
        )),
    );
    folder(
        "st_negative_dim",
        single(with_header(
            r#"{"neg":{"dtype":"F32","shape":[-4,2],"data_offsets":[0,32]}}"#,
            32,
        )),
    );
    folder(
        "st_offsets_past_end",
        single(with_header(
            r#"{"far":{"dtype":"F32","shape":[16],"data_offsets":[0,64]}}"#,
            16,
        )),
    );
    folder(
        "st_offsets_reversed",
        single(with_header(
            r#"{"rev":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}}"#,
            16,
        )),
    );
    folder(
        "st_offsets_overlap",
        single(with_header(
            r#"{"first":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"second":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#,
            24,
        )),
    );
    folder(
        "st_dtype_length_mismatch",
        single(with_header(
            r#"{"short":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}"#,
            8,
        )),
    );
    folder(
        "st_duplicate_name",
        single(with_header(
            r#"{"twice":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"twice":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
        )),
    );
    folder(
        "st_unknown_dtype",
        single(with_header(
            r#"{"odd":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}"#,
            4,
        )),
    );
    folder(
        "st_missing_offsets",
        single(with_header(r#"{"bare":{"dtype":"F32","shape":[1]}}"#, 4)),
    );
    folder(
        "st_metadata_not_strings",
        single(with_header(r#"{"__metadata__":{"format":1}}"#, 0)),
    );
    // A whole checkpoint cut short in the middle of its data.
    let mut truncated = file(&params_of(TINY));
    truncated.truncate(truncated.len() - 100);
    folder("st_truncated", single(truncated));

    // Checkpoints whose headers are fine but disagree with config.json.
    let mut params = params_of(TINY);
    params.retain(|(n, ..)| n != "transformer.h.0.mlp.c_fc.weight");
    folder("ckpt_missing_tensor", single(file(&params)));
    let mut params = params_of(TINY);
    for (name, _, shape, bytes) in params.iter_mut() {
        if name == "transformer.wte.weight" {
            *shape = vec![0, 4];
            bytes.clear();
        }
    }
    folder("ckpt_zero_dim", single(file(&params)));
    let mut params = params_of(TINY);
    for (name, dtype, ..) in params.iter_mut() {
        if name == "transformer.ln_f.weight" {
            *dtype = "I32";
        }
    }
    folder("ckpt_integer_weights", single(file(&params)));
    // FP8 weights (a quantized checkpoint's values, scaled by tensors castor does not read)
    // are not read as plain weights.
    let mut params = params_of(TINY);
    for (name, dtype, _, bytes) in params.iter_mut() {
        if name == "transformer.ln_f.weight" {
            *dtype = "F8_E4M3";
            *bytes = vec![0x38; bytes.len() / 4];
        }
    }
    folder("ckpt_fp8_weights", single(file(&params)));
    // The config says 8 wide; the tensors are 4 wide (a config from another model).
    let wide = TINY.replace("\"n_embd\": 4", "\"n_embd\": 8");
    out.push((
        "ckpt_config_disagrees/config.json".into(),
        wide.into_bytes(),
    ));
    out.push((
        "ckpt_config_disagrees/model.safetensors".into(),
        file(&params_of(TINY)),
    ));
    // NaN and Inf in two weights: headers are fine, data is not.
    let mut params = params_of(TINY);
    for (name, _, _, bytes) in params.iter_mut() {
        if name == "transformer.h.0.attn.c_attn.weight" {
            bytes[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        }
        if name == "transformer.wpe.weight" {
            bytes[4..8].copy_from_slice(&f32::INFINITY.to_le_bytes());
        }
    }
    let ids = castor_ids(&[1, 2, 3]);
    out.push((
        "ckpt_nan_weights/config.json".into(),
        TINY.as_bytes().into(),
    ));
    out.push(("ckpt_nan_weights/input.safetensors".into(), ids));
    out.push(("ckpt_nan_weights/model.safetensors".into(), file(&params)));

    // Sharded checkpoints: the index.
    let index = |map: &[(&str, &str)]| {
        let entries: Vec<String> = map
            .iter()
            .map(|(t, s)| format!("    \"{t}\": \"{s}\""))
            .collect();
        format!(
            "{{\n  \"metadata\": {{\"total_size\": 16}},\n  \"weight_map\": {{\n{}\n  }}\n}}\n",
            entries.join(",\n")
        )
        .into_bytes()
    };
    let shard_a = with_header(ok_header, 16);
    let mut sharded = |name: &str, files: Vec<(&str, Vec<u8>)>| {
        out.push((format!("{name}/config.json"), TINY.as_bytes().to_vec()));
        for (f, bytes) in files {
            out.push((format!("{name}/{f}"), bytes));
        }
    };
    const INDEX: &str = "model.safetensors.index.json";
    sharded(
        "index_missing_shard",
        vec![
            (
                INDEX,
                index(&[
                    ("a", "model-00001-of-00002.safetensors"),
                    ("b", "model-00002-of-00002.safetensors"),
                ]),
            ),
            ("model-00001-of-00002.safetensors", shard_a.clone()),
        ],
    );
    sharded(
        "index_path_traversal",
        vec![(INDEX, index(&[("a", "../x.safetensors")]))],
    );
    sharded(
        "index_absolute_path",
        vec![(INDEX, index(&[("a", "/etc/model.safetensors")]))],
    );
    sharded(
        "index_not_json",
        vec![(INDEX, b"{\"weight_map\": {\"a\": }".to_vec())],
    );
    sharded(
        "index_no_weight_map",
        vec![(INDEX, b"{\"metadata\": {}}\n".to_vec())],
    );
    sharded(
        "index_wrong_shard",
        vec![
            (
                INDEX,
                index(&[
                    ("a", "model-00002-of-00002.safetensors"),
                    ("b", "model-00001-of-00002.safetensors"),
                ]),
            ),
            ("model-00001-of-00002.safetensors", shard_a.clone()),
            (
                "model-00002-of-00002.safetensors",
                with_header(
                    r#"{"b":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#,
                    16,
                ),
            ),
        ],
    );
    sharded(
        "index_duplicate_across_shards",
        vec![
            (
                INDEX,
                index(&[
                    ("a", "model-00001-of-00002.safetensors"),
                    ("b", "model-00002-of-00002.safetensors"),
                ]),
            ),
            ("model-00001-of-00002.safetensors", shard_a.clone()),
            (
                "model-00002-of-00002.safetensors",
                with_header(
                    r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2,2],"data_offsets":[16,32]}}"#,
                    32,
                ),
            ),
        ],
    );
    out.sort();
    out
}

/// An input batch file: `input_ids` I64 [1, n].
fn castor_ids(ids: &[i64]) -> Vec<u8> {
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    file(&[("input_ids".into(), "I64", vec![1, ids.len()], bytes)])
}
