//! `castor demo` end to end: it trains the embedded model, writes its pictures, log and
//! checkpoint, and (as a benchmark, `cargo test --release --test integration demo:: -- --ignored
//! --nocapture`) runs in under a minute.

use crate::common;

use castor_models::{Model, SafetensorsFile};
use common::*;
use std::path::Path;
use std::time::Instant;

fn check_outputs(out: &Path, steps: usize) {
    for picture in ["loss.svg", "memory.svg"] {
        let svg = std::fs::read_to_string(out.join(picture)).unwrap();
        assert!(svg.starts_with("<svg"), "{picture}");
        assert!(svg.contains("</svg>"), "{picture}");
    }
    let loss_svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
    assert!(loss_svg.contains("training loss (smoothed)"));
    assert!(loss_svg.contains("validation loss"));
    let memory_svg = std::fs::read_to_string(out.join("memory.svg")).unwrap();
    for row in ["F32 master weights", "optimizer state", "bf16", "fp16"] {
        assert!(memory_svg.contains(row), "memory.svg lacks {row}");
    }
    // The report page: curves, memory, fit, precision, cost, standing alone.
    let report = std::fs::read_to_string(out.join("report.html")).unwrap();
    for section in ["run", "curves", "memory", "fit", "precision", "cost"] {
        assert!(
            report.contains(&format!("<section id=\"{section}\">")),
            "report.html lacks {section}"
        );
    }
    assert!(!report.contains("<script") && !report.contains("http"));
    let ckpt = out.join("checkpoint");
    for file in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(ckpt.join(file).is_file(), "checkpoint lacks {file}");
    }
    let model = Model::load(&ckpt).unwrap();
    assert_eq!(model.architecture(), "GPT2LMHeadModel");
    let weights = SafetensorsFile::open(ckpt.join("model.safetensors")).unwrap();
    assert!(!weights.is_empty());
    let losses = log_losses(&out.join("train.jsonl"));
    assert_eq!(losses.len(), steps);
    let head: f64 = losses[..3].iter().sum::<f64>() / 3.0;
    let tail: f64 = losses[steps - 3..].iter().sum::<f64>() / 3.0;
    assert!(
        tail < head - 0.3,
        "loss did not fall: {head:.3} -> {tail:.3}"
    );
}

#[test]
fn demo_trains_and_writes_pictures_and_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("demo-out");
    let o = castor(&["demo", "--steps", "30", "--out", path_str(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    for line in [
        "device      cpu",
        "compile     bf16 training step: converted",
        "compile     fp16 training step: converted",
        "loss scale  dynamic",
        "remat       none",
        "low-precision weights",
        "sample      before training: \"The compiler ",
        "sample      after training:  \"The compiler ",
        "validation  loss",
    ] {
        assert!(s.contains(line), "no `{line}` in\n{s}");
    }
    // The device is said once, with the run's other facts.
    assert_eq!(s.matches("device ").count(), 1, "{s}");
    assert!(!stderr(&o).contains("device:"), "{}", stderr(&o));
    check_outputs(&out, 30);
    // The LoRA fine-tuning it suggests runs on its checkpoint and writes a PEFT adapter.
    let next = s
        .lines()
        .find_map(|l| {
            l.split_once("castor train ")
                .map(|(_, cmd)| cmd.to_string())
        })
        .unwrap_or_else(|| panic!("no LoRA suggestion in\n{s}"));
    // And with the base in NF4, as the line after it says.
    assert!(s.contains("as QLoRA: add --base nf4"), "{s}");
    for (tag, extra) in [("adapters", &[][..]), ("qlora", &["--base", "nf4"][..])] {
        let adapters = tmp.path().join(tag);
        let cmd = next
            .replace("TEXT", "assets/corpus.txt")
            .replace("DIR", path_str(&adapters));
        let mut args = vec!["train"];
        args.extend(cmd.split_whitespace());
        args.extend(["--steps", "3", "--batch", "2", "--seq", "32"]);
        args.extend_from_slice(extra);
        let o = castor(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        assert!(adapters.join("adapter_config.json").is_file());
        assert!(adapters.join("adapter_model.safetensors").is_file());
    }
    // Deterministic: the same command writes the same log.
    let again = tmp.path().join("again");
    let o = castor(&["demo", "--steps", "30", "--out", path_str(&again)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        log_losses(&out.join("train.jsonl")),
        log_losses(&again.join("train.jsonl"))
    );
}

/// The README's first command, timed. Run in release:
/// `cargo test --release --test integration demo:: -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark: the full demo (about 10 s in release)"]
fn demo_benchmark() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("castor-demo");
    let start = Instant::now();
    let o = castor(&["demo", "--out", path_str(&out)]);
    let seconds = start.elapsed().as_secs_f64();
    assert!(o.status.success(), "{}", stderr(&o));
    println!("{}", stdout(&o));
    println!("castor demo: {seconds:.1} s wall time");
    check_outputs(&out, 300);
    if !cfg!(debug_assertions) {
        assert!(seconds < 60.0, "the demo took {seconds:.1} s");
    }
}

/// The README's quickstart runs as written on the demo's checkpoint: each command of its
/// block, with `./gpt2` the demo's checkpoint and the data files made from the corpus (and,
/// to stay quick, a few steps where it trains thousands).
#[test]
fn the_quickstart_runs_on_the_demo_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let demo = tmp.path().join("castor-demo");
    let o = castor(&["demo", "--steps", "5", "--out", path_str(&demo)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt = demo.join("checkpoint");
    let corpus = root().join("assets").join("corpus.txt");
    let tokens: Vec<u8> = std::fs::read(&corpus)
        .unwrap()
        .iter()
        .flat_map(|&b| u16::from(b).to_le_bytes())
        .collect();
    std::fs::write(tmp.path().join("train.bin"), tokens).unwrap();
    std::fs::copy(
        fixture("gpt2_lm").join("input.safetensors"),
        tmp.path().join("batch.safetensors"),
    )
    .unwrap();
    std::fs::copy(&corpus, tmp.path().join("notes.txt")).unwrap();
    // `assets/configs/...` as from the repository's root.
    std::os::unix::fs::symlink(root().join("assets"), tmp.path().join("assets")).unwrap();
    let commands = readme_commands("## Quickstart");
    assert!(commands.len() >= 10, "{commands:?}");
    for words in commands {
        let mut args: Vec<String> = Vec::new();
        let mut words = words.into_iter();
        while let Some(w) = words.next() {
            args.push(match w.as_str() {
                "./gpt2" => path_str(&ckpt).to_string(),
                _ => w,
            });
            // Thousands of steps (and their cadences) are a few here.
            if ["--steps", "--save-every", "--eval-every"].contains(&args.last().unwrap().as_str())
            {
                words.next();
                args.push("2".into());
            }
        }
        let o = std::process::Command::new(castor_bin())
            .args(&args)
            .current_dir(tmp.path())
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "castor {}: {}",
            args.join(" "),
            stderr(&o)
        );
    }
}
