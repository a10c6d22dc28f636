//! `castor train` on every kind of token stream: text through a tokenizer.json, llm.c's and
//! nanoGPT's `.bin` token files, with a validation split, periodic checkpoints and pictures.
//! A run of N steps and a run of N/2 steps resumed for N/2 more are bit-identical.

use crate::common;

use castor_models::SafetensorsFile;
use common::*;
use std::path::{Path, PathBuf};

fn corpus() -> Vec<u8> {
    std::fs::read(root().join("assets").join("corpus.txt")).unwrap()
}

fn tiny_config() -> PathBuf {
    root().join("assets").join("tiny-gpt2.json")
}

/// llm.c's token file: 256 int32 header (magic, version, count), then u16 or u32 tokens.
fn llmc_file(path: &Path, tokens: &[u32], version: i32) {
    let mut bytes = Vec::new();
    let mut header = [0i32; 256];
    header[0] = 20240520;
    header[1] = version;
    header[2] = tokens.len() as i32;
    for h in header {
        bytes.extend_from_slice(&h.to_le_bytes());
    }
    for &t in tokens {
        if version == 1 {
            bytes.extend_from_slice(&(t as u16).to_le_bytes());
        } else {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
    }
    std::fs::write(path, bytes).unwrap();
}

/// GPT-2's byte-to-unicode table, as a tokenizer.json's byte-level vocabulary spells bytes.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

/// A model folder (the tiny GPT-2 with a 300-token vocabulary, no weights) with a byte-level
/// BPE tokenizer.json: the 256 bytes plus a few merges.
fn tokenizer_model(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let config = std::fs::read_to_string(tiny_config())
        .unwrap()
        .replace("\"vocab_size\": 256", "\"vocab_size\": 300");
    std::fs::write(dir.join("config.json"), config).unwrap();
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(byte_char(b).to_string(), serde_json::json!(b));
    }
    let space = byte_char(b' ');
    let merges = [
        ("t".to_string(), "h".to_string()),
        ("e".into(), "r".into()),
        ("i".into(), "n".into()),
        (space.to_string(), "th".into()),
        (space.to_string(), "a".into()),
        ("o".into(), "n".into()),
    ];
    for (i, (a, b)) in merges.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), serde_json::json!(256 + i));
    }
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "vocab": vocab,
            "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>(),
        }
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
}

fn train(args: &[String]) -> String {
    let mut all: Vec<&str> = vec!["train"];
    all.extend(args.iter().map(String::as_str));
    all.extend_from_slice(&["--device", "cpu"]);
    let o = castor(&all);
    assert!(o.status.success(), "{all:?}: {}", stderr(&o));
    stdout(&o)
}

fn log_lines(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The log without timings.
fn log_values(log: &Path) -> Vec<(u64, f64, Option<f64>)> {
    log_lines(log)
        .iter()
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap(),
                v["val_loss"].as_f64(),
            )
        })
        .collect()
}

fn assert_same_checkpoint(a: &Path, b: &Path) {
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let x = SafetensorsFile::open(a.join(file)).unwrap();
        let y = SafetensorsFile::open(b.join(file)).unwrap();
        assert_eq!(x.len(), y.len());
        for name in x.names() {
            assert_eq!(
                x.read_f32(name).unwrap(),
                y.read_f32(name).unwrap(),
                "{file}: {name}"
            );
        }
    }
    let state = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("trainer_state.json")).unwrap())
            .unwrap()
    };
    assert_eq!(state(a), state(b));
}

/// N steps straight vs N/2, then --resume for N/2: the same losses, validation losses,
/// weights, optimizer state and data position.
fn resume_is_bit_identical(model: &Path, data: &Path, tmp: &Path, extra: &[&str]) {
    let common = |steps: &str, more: &[String]| -> Vec<String> {
        let mut v: Vec<String> = [
            path_str(model),
            "--data",
            path_str(data),
            "--steps",
            steps,
            "--batch",
            "2",
            "--seq",
            "16",
            "--schedule",
            "cosine",
            "--warmup",
            "2",
            "--total-steps",
            "8",
            "--val-fraction",
            "0.1",
            "--eval-every",
            "2",
            "--eval-batches",
            "2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v.extend_from_slice(more);
        v
    };
    let p = |x: &Path| path_str(x).to_string();
    let (straight, split) = (tmp.join("straight"), tmp.join("split"));
    let (log_a, log_b) = (tmp.join("a.jsonl"), tmp.join("b.jsonl"));
    let plot = tmp.join("loss.svg");
    let out = train(&common(
        "8",
        &[
            "--save".into(),
            p(&straight),
            "--log".into(),
            p(&log_a),
            "--plot".into(),
            p(&plot),
        ],
    ));
    assert!(out.contains("validation  loss"), "{out}");
    train(&common(
        "4",
        &[
            "--save".into(),
            p(&split),
            "--save-every".into(),
            "2".into(),
            "--log".into(),
            p(&log_b),
        ],
    ));
    assert!(split
        .join("step-000002")
        .join("model.safetensors")
        .is_file());
    assert!(split
        .join("step-000004")
        .join("trainer_state.json")
        .is_file());
    // --steps is the total: the resumed run trains steps 5..8.
    train(&common(
        "8",
        &[
            "--resume".into(),
            p(&split),
            "--save".into(),
            p(&split),
            "--save-every".into(),
            "2".into(),
            "--log".into(),
            p(&log_b),
        ],
    ));
    let (a, b) = (log_values(&log_a), log_values(&log_b));
    assert_eq!(a.len(), 8);
    assert_eq!(a, b);
    assert!(a.iter().filter(|x| x.2.is_some()).count() == 4, "{a:?}");
    assert_same_checkpoint(&straight, &split);
    assert_same_checkpoint(&straight, &split.join("step-000008"));
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("validation loss"));
}

#[test]
fn text_bytes_resume_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("assets").join("corpus.txt");
    resume_is_bit_identical(&tiny_config(), &data, tmp.path(), &["--precision", "fp16"]);
}

#[test]
fn llmc_token_files_resume_bit_identically() {
    let tokens: Vec<u32> = corpus().iter().map(|&b| u32::from(b)).collect();
    for version in [1, 2] {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("tokens.bin");
        llmc_file(&data, &tokens, version);
        resume_is_bit_identical(&tiny_config(), &data, tmp.path(), &["--precision", "bf16"]);
    }
}

#[test]
fn tokenizer_json_text_resumes_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().join("model");
    tokenizer_model(&folder);
    // A bare config.json: its tokenizer.json is the one beside it.
    let model = folder.join("config.json");
    let data = root().join("assets").join("corpus.txt");
    resume_is_bit_identical(&model, &data, tmp.path(), &[]);
    // The tokenizer merged bytes: fewer tokens than bytes, and it travels with checkpoints.
    let out = train(&[
        path_str(&model).into(),
        "--data".into(),
        path_str(&data).into(),
        "--steps".into(),
        "1".into(),
        "--batch".into(),
        "2".into(),
        "--seq".into(),
        "16".into(),
    ]);
    let line = out.lines().find(|l| l.starts_with("data ")).unwrap();
    assert!(line.contains("(tokenizer.json)"), "{line}");
    let count: usize = line
        .split(": ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .replace(',', "")
        .parse()
        .unwrap();
    assert!(count < corpus().len() * 95 / 100, "{count} tokens");
    assert!(tmp.path().join("split").join("tokenizer.json").is_file());
}

#[test]
fn nanogpt_raw_token_files_train() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("train.bin");
    let bytes: Vec<u8> = corpus()
        .iter()
        .flat_map(|&b| u16::from(b).to_le_bytes())
        .collect();
    std::fs::write(&data, bytes).unwrap();
    let out = train(&[
        path_str(&tiny_config()).into(),
        "--data".into(),
        path_str(&data).into(),
        "--steps".into(),
        "2".into(),
        "--batch".into(),
        "2".into(),
        "--seq".into(),
        "16".into(),
    ]);
    assert!(out.contains("(raw u16 tokens)"), "{out}");
}

#[test]
fn bad_token_files_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = {
        let out_of_range = {
            let p = tmp.path().join("big.bin");
            let mut t: Vec<u32> = vec![1; 100];
            t[37] = 5000;
            llmc_file(&p, &t, 2);
            std::fs::read(&p).unwrap()
        };
        let bad_version = {
            let p = tmp.path().join("v9.bin");
            llmc_file(&p, &[1; 100], 9);
            std::fs::read(&p).unwrap()
        };
        let short = {
            let p = tmp.path().join("short.bin");
            llmc_file(&p, &[1; 100], 1);
            let mut b = std::fs::read(&p).unwrap();
            b.truncate(b.len() - 2);
            b
        };
        vec![
            (
                "range.bin",
                out_of_range,
                "token 37 is id 5000, outside the model's vocabulary of 256",
            ),
            ("version.bin", bad_version, "version 9"),
            ("short.bin", short, "llm.c header says 100 tokens"),
            (
                "odd.bin",
                vec![1, 2, 3],
                "not a whole number of raw u16 tokens",
            ),
        ]
    };
    for (name, bytes, message) in cases {
        let path = tmp.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let o = castor(&[
            "train",
            path_str(&tiny_config()),
            "--data",
            path_str(&path),
            "--steps",
            "1",
            "--device",
            "cpu",
        ]);
        assert_eq!(o.status.code(), Some(3), "{name}: {}", stderr(&o));
        assert!(stderr(&o).contains(message), "{name}: {}", stderr(&o));
    }
}

#[test]
fn a_tokenizer_larger_than_the_vocabulary_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().join("model");
    tokenizer_model(&folder);
    // 262 tokens in the tokenizer, 260 rows in the embedding.
    let config = std::fs::read_to_string(folder.join("config.json"))
        .unwrap()
        .replace("\"vocab_size\": 300", "\"vocab_size\": 260");
    std::fs::write(folder.join("config.json"), config).unwrap();
    let model = folder.join("config.json");
    let o = castor(&["inspect", path_str(&model)]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("tokenizer.json"), "{err}");
    assert!(err.contains("262 tokens") && err.contains("260"), "{err}");
    let data = root().join("assets").join("corpus.txt");
    let o = castor(&[
        "train",
        path_str(&model),
        "--data",
        path_str(&data),
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("262 tokens"), "{}", stderr(&o));
}

/// A token file is mapped and widened a window at a time: training on 64 million u16 tokens
/// (128 MB on disk, 512 MB as i64) peaks far below the widened size. The file's pages count
/// in the process's resident set as it is checked and read, so the bound is the file plus
/// room for the model: 320 MB, where reading it whole and widening it took 640 MB.
#[test]
fn token_files_are_mapped_not_read_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("large.bin");
    let tokens: usize = 64 << 20;
    let bytes: Vec<u8> = (0..tokens)
        .flat_map(|i| ((i % 251) as u16).to_le_bytes())
        .collect();
    std::fs::write(&data, &bytes).unwrap();
    drop(bytes);
    let (o, peak_kib) = castor_peak_rss(&[
        "train",
        path_str(&tiny_config()),
        "--data",
        path_str(&data),
        "--steps",
        "1",
        "--batch",
        "1",
        "--seq",
        "8",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("67,108,864 training tokens"),
        "{}",
        stdout(&o)
    );
    assert!(
        peak_kib < 320 * 1024,
        "training on a 128 MB token file peaked at {peak_kib} KiB"
    );
}
