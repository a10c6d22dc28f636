//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod cuda_cases;
pub mod tokenizer_files;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Every fixture variant made by tests/fixtures/generate.py.
pub const VARIANTS: [&str; 14] = [
    "gpt2_lm",
    "gpt2_base",
    "bert_base",
    "bert_mlm",
    "llama_gqa",
    "llama_tied",
    "qwen2_bias",
    "mistral_window",
    "gemma_tiny",
    "llama31_rope",
    "bert_cls",
    "bert_reg",
    "llama_cls",
    "qwen2_cls",
];

/// The causal language-model fixtures (every decoder with an LM head).
pub const CAUSAL_LMS: [&str; 7] = [
    "gpt2_lm",
    "llama_gqa",
    "llama_tied",
    "qwen2_bias",
    "mistral_window",
    "gemma_tiny",
    "llama31_rope",
];

/// The decoder families beyond LLaMA itself (tests/fixtures/generate.py): Qwen2 with linear
/// rope scaling, Mistral with a window shorter than the sequence, Gemma, LLaMA 3.1 rope scaling
/// past the original context.
pub const NEW_DECODERS: [&str; 4] = ["qwen2_bias", "mistral_window", "gemma_tiny", "llama31_rope"];

/// The repository: where the tests were built, or (test binaries copied to another machine,
/// such as a GPU machine without Rust) the current folder when that is a checkout.
pub fn root() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if built.join("tests").join("fixtures").is_dir() {
        return built;
    }
    std::env::current_dir().unwrap_or(built)
}

/// The `castor` binary: `CASTOR_BIN` when set (test binaries copied to another machine,
/// see bench/gpu/pack.sh), the one built with the tests, or `target/release/castor` under
/// [`root`].
pub fn castor_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("CASTOR_BIN") {
        return PathBuf::from(bin);
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_castor"));
    if built.is_file() {
        return built;
    }
    root().join("target").join("release").join("castor")
}

pub fn fixture(variant: &str) -> PathBuf {
    root().join("tests").join("fixtures").join(variant)
}

/// Runs the `castor` binary built for these tests.
pub fn castor(args: &[&str]) -> Output {
    Command::new(castor_bin())
        .args(args)
        .output()
        .expect("the castor binary runs")
}

/// `castor compile` of GPT-2 124M's training plan at batch 8 x 1024 in bf16 (the benchmark's
/// shape, from its bare config) with `flags`; asserts that it succeeds and returns its report.
pub fn compile_gpt2_124m(flags: &[&str]) -> String {
    let config = root().join("assets/configs/gpt2-124m.json");
    let mut args = vec![
        "compile",
        path_str(&config),
        "--train",
        "--precision",
        "bf16",
        "--batch",
        "8",
        "--seq",
        "1024",
    ];
    args.extend_from_slice(flags);
    let o = castor(&args);
    assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
    stdout(&o)
}

/// Runs `castor eval MODEL --input IN --out OUT` with `extra` flags.
pub fn eval(model: &Path, input: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "eval",
        path_str(model),
        "--input",
        path_str(input),
        "--out",
        path_str(out),
    ];
    args.extend_from_slice(extra);
    castor(&args)
}

/// The `castor` commands of the first `sh` block after `heading` in README.md, as argument
/// lists: continued lines joined, comments, pipes and redirections left out, quoted words kept
/// whole.
pub fn readme_commands(heading: &str) -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let section = &readme[readme.find(heading).unwrap()..];
    let block = &section[section.find("```sh\n").unwrap() + 6..];
    let block = &block[..block.find("```").unwrap()];
    let mut commands: Vec<String> = Vec::new();
    let mut continued = false;
    for line in block.lines() {
        let code = line.split("  #").next().unwrap().trim();
        if continued {
            let last = commands.last_mut().unwrap();
            last.push(' ');
            last.push_str(code.trim_end_matches('\\'));
        } else if let Some(rest) = code.strip_prefix("castor ") {
            commands.push(rest.trim_end_matches('\\').to_string());
        }
        continued = code.ends_with('\\');
    }
    commands
        .iter()
        .map(|c| {
            let c = c.split(" | ").next().unwrap().split(" > ").next().unwrap();
            let mut args = Vec::new();
            let mut words = c.split_whitespace();
            while let Some(w) = words.next() {
                if let Some(quoted) = w.strip_prefix('"') {
                    let mut s = quoted.to_string();
                    while !s.ends_with('"') {
                        s.push(' ');
                        s.push_str(words.next().unwrap());
                    }
                    args.push(s.trim_end_matches('"').to_string());
                } else {
                    args.push(w.to_string());
                }
            }
            args
        })
        .collect()
}

/// Asserts that a run succeeded, showing its output if not.
pub fn ok(o: &Output) {
    assert!(o.status.success(), "{}\n{}", stdout(o), stderr(o));
}

/// Asserts that a run failed with exit code `code`, its stderr saying `words`, without a panic.
pub fn fails(o: &Output, code: i32, words: &str) {
    assert_eq!(o.status.code(), Some(code), "{}\n{}", stdout(o), stderr(o));
    assert!(
        stderr(o).contains(words),
        "expected `{words}` in:\n{}",
        stderr(o)
    );
    assert!(!stderr(o).contains("panicked"), "{}", stderr(o));
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Copies a fixture checkpoint's files (not its subfolders, such as its LoRA adapter) into
/// a fresh temporary folder tests may damage.
pub fn copy_fixture(variant: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for entry in std::fs::read_dir(fixture(variant)).expect("fixture exists") {
        let entry = entry.expect("dir entry");
        if entry.path().is_file() {
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
        }
    }
    dir
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The fixture's input batch plus the reference labels of `objective` (if it has any),
/// written to `out_dir`: the batch every PyTorch reference run trained on.
pub fn batch_with_labels(variant: &str, objective: &str, out_dir: &Path) -> PathBuf {
    use castor_models::{write_safetensors, SafetensorsFile};
    let dir = fixture(variant);
    let input = SafetensorsFile::open(dir.join("input.safetensors")).expect("fixture input");
    let reference =
        SafetensorsFile::open(dir.join("training.safetensors")).expect("fixture references");
    let mut tensors: Vec<(String, castor_ir::Tensor)> = input
        .names()
        .map(|n| (n.to_string(), input.tensor(n).expect("input tensor")))
        .collect();
    let labels_key = format!("labels.{objective}");
    if reference.contains(&labels_key) {
        tensors.push((
            "labels".into(),
            reference.tensor(&labels_key).expect("labels"),
        ));
    }
    let batch = out_dir.join(format!("{variant}-{objective}-in.safetensors"));
    let refs: Vec<(&str, &castor_ir::Tensor)> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_safetensors(&batch, &refs).expect("write batch");
    batch
}

/// The `loss` of every line of a `castor train --log` file, in order.
pub fn log_losses(log: &Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .expect("training log")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            v["loss"].as_f64().expect("a loss")
        })
        .collect()
}

/// Runs `castor` with `args`: its output, and its own peak resident memory in KiB.
///
/// The peak is the child's `VmHWM` (its address space's high-water mark), read from
/// `/proc/<pid>/status` every millisecond until it exits. Not the rusage of `wait4`: a child
/// spawned with `posix_spawn` (or fork) takes the parent's high-water mark into its
/// `ru_maxrss` when it execs, so a busy test process would count as the child's.
pub fn castor_peak_rss(args: &[&str]) -> (Output, u64) {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = Command::new(castor_bin())
        .args(args)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        let hwm = std::fs::read_to_string(&status_file)
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .unwrap_or(0);
        peak_kib = peak_kib.max(hwm);
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    assert!(
        peak_kib > 0,
        "no VmHWM read for `castor {}`",
        args.join(" ")
    );
    let output = Output {
        status,
        stdout: std::fs::read(&out).unwrap(),
        stderr: std::fs::read(&err).unwrap(),
    };
    (output, peak_kib)
}

/// The anatomy's `total` row of a `compile --train` report: the planned peak in bytes.
pub fn anatomy_total(report: &str) -> u64 {
    anatomy_row(report, "total")
}

/// The bytes of the anatomy row `label` (`frozen base weights`, `gradients`, ...) of a
/// `compile --train` report.
pub fn anatomy_row(report: &str, label: &str) -> u64 {
    report
        .lines()
        .find_map(|l| {
            let rest = l.trim_start().strip_prefix(label)?;
            rest.split_whitespace()
                .next()?
                .replace(',', "")
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no anatomy row `{label}` in\n{report}"))
}

/// The program roofline's MFU, in percent, from the `cuda` line of a `compile --train` report.
pub fn program_mfu(report: &str) -> f64 {
    let cuda = report
        .lines()
        .find(|l| l.starts_with("cuda "))
        .unwrap_or_else(|| panic!("no cuda line in:\n{report}"));
    cuda.split("program roofline ")
        .nth(1)
        .and_then(|r| r.split("MFU ").nth(1))
        .and_then(|m| m.split('%').next())
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("no program roofline MFU in: {cuda}"))
}

/// The embedded tiny GPT-2 trained `steps` bf16 steps on the CPU (batch 2 x 16 tokens of the
/// embedded corpus), saved to `save`, with `extra` flags.
pub fn train_tiny_gpt2(steps: u32, save: &Path, extra: &[&str]) -> Output {
    let (config, corpus) = (
        root().join("assets/tiny-gpt2.json"),
        root().join("assets/corpus.txt"),
    );
    let steps = steps.to_string();
    let mut args = vec![
        "train",
        path_str(&config),
        "--data",
        path_str(&corpus),
        "--steps",
        &steps,
        "--batch",
        "2",
        "--seq",
        "16",
        "--precision",
        "bf16",
        "--device",
        "cpu",
        "--save",
        path_str(save),
    ];
    args.extend_from_slice(extra);
    castor(&args)
}
