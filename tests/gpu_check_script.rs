//! The GPU scripts on a machine without a GPU. The check (`bench/gpu/check.py`): its preflight
//! must fail, with a clear message and a non-zero exit status, so a GPU run that cannot start
//! is never taken for a passing one. The benchmark (`bench/gpu/bench.py --dry-run`): it writes
//! a record of the format `bench/record.py` validates, with every configuration's row, castor's
//! measured; and BENCHMARKS.md's generated section is what the committed records render to.

use crate::common;

use common::{castor_bin, root};
use std::process::Command;

#[test]
fn the_gpu_check_fails_clearly_without_a_gpu() {
    if castor_runtime::cuda_probe::probe().is_ok() {
        println!("skipped: this machine has a GPU");
        return;
    }
    let out = tempfile::tempdir().unwrap();
    for part in [
        &["--part", "all"][..],
        &["--part", "tests"],
        &["--part", "bench"],
        &["--preflight"],
    ] {
        let o = Command::new("python3")
            .arg(root().join("bench/gpu/check.py"))
            .arg(out.path())
            .args(part)
            .env("CASTOR_REQUIRE_GPU", "1")
            .output()
            .expect("python3 runs");
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{part:?}: {stderr}");
        assert!(
            stderr.contains("preflight FAILED: no CUDA driver: libcuda.so.1 cannot be loaded"),
            "{part:?}: {stderr}"
        );
        let label = part.last().unwrap().trim_start_matches("--");
        let summary =
            std::fs::read_to_string(out.path().join(format!("summary-{label}.txt"))).unwrap();
        assert!(summary.contains("preflight FAILED"), "{summary}");
    }
}

fn python(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new("python3")
        .args(args)
        .current_dir(root())
        .output()
        .expect("python3 runs")
}

#[test]
fn the_benchmark_dry_run_writes_a_record_of_the_format() {
    let out = tempfile::tempdir().unwrap();
    let bench = root().join("bench/gpu/bench.py");
    let o = python(&[
        bench.as_os_str(),
        "--out".as_ref(),
        out.path().as_os_str(),
        "--dry-run".as_ref(),
        "--castor".as_ref(),
        castor_bin().as_os_str(),
        "--require-castor".as_ref(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let records: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    assert_eq!(records.len(), 1, "{records:?}");
    let name = records[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    assert!(
        name.ends_with("-dry-run-cpu.json") && name.starts_with("20"),
        "{name}"
    );
    let v = python(&[
        root().join("bench/record.py").as_os_str(),
        "validate".as_ref(),
        records[0].as_os_str(),
    ]);
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stderr));

    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&records[0]).unwrap()).unwrap();
    assert_eq!(record["dry_run"], true);
    for field in ["torch", "cuda", "cublas", "cudnn"] {
        assert!(record["versions"][field].is_string(), "{field}: {record}");
    }
    let rows = record["rows"].as_array().unwrap();
    let row = |model: &str, system: &str, flags: &str| {
        rows.iter()
            .find(|r| r["model"] == model && r["system"] == system && r["flags"] == flags)
            .unwrap_or_else(|| panic!("no {model} {system} {flags:?} row: {record}"))
    };
    // castor's side runs on the CPU: its default plans are measured, with an MFU from the
    // plan's model FLOPs.
    let lora =
        "--lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    for (model, flags) in [
        ("GPT-2 (tiny)", ""),
        ("LLaMA (tiny)", ""),
        ("LLaMA (tiny) LoRA r16", lora),
        ("GPT-2 (tiny)", "--attention eager"),
    ] {
        let r = row(model, "castor", flags);
        let (ms, rate, mfu) = (
            r["ms_per_step"].as_f64().unwrap(),
            r["tokens_per_s"].as_f64().unwrap(),
            r["mfu"].as_f64().unwrap(),
        );
        assert!(ms > 0.0 && mfu > 0.0, "{r}");
        assert!((rate * ms / 1e3 - 128.0).abs() < 1e-6, "B2xT64 tokens: {r}");
        assert!(
            r["x_roofline"].is_null(),
            "a CPU step against the card's roofline: {r}"
        );
        assert!(r["roofline_ms"].as_f64().unwrap() > 0.0, "{r}");
    }
    // Each peer has its row: measured where torch is installed, else saying why not.
    for (model, system) in [
        ("GPT-2 (tiny)", "torch.compile"),
        ("GPT-2 (tiny)", "torch eager"),
        ("LLaMA (tiny)", "torch.compile"),
        ("LLaMA (tiny) LoRA r16", "peft"),
    ] {
        let r = row(model, system, "");
        assert!(
            r["tokens_per_s"].as_f64().is_some() || r["note"].is_string(),
            "{r}"
        );
    }
    let recipe = row(
        "LLaMA-2-7B recipe",
        "castor",
        "--remat selective --update-in-backward",
    );
    assert!(
        recipe["note"].as_str().unwrap().contains("dry run"),
        "{recipe}"
    );
    assert!(record["profile"]["note"].is_string(), "{record}");
    let table = std::fs::read_to_string(out.path().join("table.txt")).unwrap();
    assert!(
        table.contains("Targets:") && table.contains("(target 1.15x): not measured"),
        "{table}"
    );
}

#[test]
fn benchmarks_md_shows_the_committed_records() {
    let o = python(&[root().join("bench/record.py").as_os_str(), "check".as_ref()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_record_renders_its_rows_and_judges_the_targets() {
    let row = |model: &str, system: &str, flags: &str, tokens: f64, x_roofline: Option<f64>| {
        serde_json::json!({
            "model": model, "shape": "B8xT1024", "precision": "bf16", "optimizer": "adamw",
            "system": system, "flags": flags, "ms_per_step": 8192e3 / tokens,
            "tokens_per_s": tokens, "mfu": 0.3, "x_roofline": x_roofline,
            "roofline_ms": x_roofline.map(|_| 20.0),
        })
    };
    let lora = "--lora-rank 16 --lora-targets q_proj,v_proj";
    let mut gpt2 = row("GPT-2 124M", "castor", "", 400_000.0, Some(1.4));
    gpt2["attention"] = "cuDNN 9.19.0 (libcudnn.so.9) runs 24 of 24 passes".into();
    let record = serde_json::json!({
        "date": "2026-12-01", "device": "NVIDIA H100 80GB HBM3", "castor_commit": "abc",
        "versions": {"torch": "2.11", "cuda": "13.0", "cublas": "13.0.0", "cudnn": "91000"},
        "torch_compile_sdpa": "FlashAttention-2", "dry_run": false,
        "rows": [
            gpt2,
            row("GPT-2 124M", "torch.compile", "", 320_000.0, None),
            row("GPT-2 124M", "castor", "--attention auto", 300_000.0, Some(2.0)),
            row("LLaMA-3.2-1B", "castor", "", 100_000.0, Some(1.6)),
            row("LLaMA-3.2-1B", "torch.compile", "", 95_000.0, None),
            row("LLaMA-3.2-1B LoRA r16", "castor", lora, 150_000.0, None),
            row("LLaMA-3.2-1B LoRA r16", "peft", "", 90_000.0, None),
        ],
        "profile": {"plan": "GPT-2 124M", "total_ms": 30.0, "roofline_ms": 20.0, "kinds": [
            {"kind": "layer_norm_fwd", "calls": 25, "ms": 1.5, "roofline_ms": 1.0, "ratio": 1.5}
        ]},
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("2026-12-01-h100.json");
    std::fs::write(&path, record.to_string()).unwrap();
    let script = format!(
        "import json, sys, pathlib; sys.path.insert(0, 'bench'); import record\n\
         p = pathlib.Path({:?}); r = json.loads(p.read_text())\n\
         assert not record.validate(r), record.validate(r)\n\
         print(record.card_slug(r['device']))\n\
         print(record.render_record(p, r))",
        path.display().to_string()
    );
    let o = python(&["-c".as_ref(), script.as_ref()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.starts_with("h100\n"), "{text}");
    for line in [
        "castor's default plan on GPT-2 124M: 1.25x torch.compile's tokens/s (target 1.15x): met",
        "castor's default plan on LLaMA-3.2-1B: 1.05x torch.compile's tokens/s (target 1.10x): NOT MET",
        "castor's default plan on LLaMA-3.2-1B LoRA r16: 1.67x peft's tokens/s (target 1.50x): met",
        "castor's default plan on GPT-2 124M B8xT1024: measured step 1.40x castor's roofline (20.00 ms; target at most 1.5x): met",
        "castor's default plan on LLaMA-3.2-1B B8xT1024: measured step 1.60x castor's roofline (20.00 ms; target at most 1.5x): NOT MET",
        "| GPT-2 124M | B8xT1024 | bf16 | adamw | castor | `--attention auto` | 27.31 | 300,000 | 30.0% | 0.94x | 2.00x |",
        "| layer_norm_fwd | 25 | 1.500 | 1.000 | 1.50 |",
        // What ran castor's attention, for the rows whose run said.
        "- GPT-2 124M B8xT1024 (defaults): cuDNN 9.19.0 (libcudnn.so.9) runs 24 of 24 passes",
    ] {
        assert!(text.contains(line), "{line}\nnot in\n{text}");
    }
    // The variant's roofline is in its row, not among the targets (they hold the defaults).
    assert!(!text.contains("--attention auto: measured step"), "{text}");
}

#[test]
fn a_second_run_completes_the_rows_a_first_run_could_not_measure() {
    let row = |system: &str, tokens: Option<f64>| {
        serde_json::json!({
            "model": "GPT-2 124M", "shape": "B8xT1024", "precision": "bf16", "optimizer": "adamw",
            "system": system, "flags": "", "ms_per_step": tokens.map(|t| 8192e3 / t),
            "tokens_per_s": tokens, "mfu": tokens.map(|_| 0.3),
            "note": if tokens.is_none() { Some("not run: the benchmark's time budget ran out") } else { None },
        })
    };
    let record = |commit: &str, rows: Vec<serde_json::Value>| {
        serde_json::json!({
            "date": "2026-12-01", "device": "NVIDIA H100 80GB HBM3", "castor_commit": commit,
            "versions": {"torch": "2.11", "cuda": "13.0", "cublas": "13.0.0", "cudnn": "91000"},
            "torch_compile_sdpa": "cuDNN attention", "dry_run": false, "rows": rows,
            "profile": {"note": "not run", "kinds": []},
        })
    };
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, r: serde_json::Value| {
        let p = dir.path().join(name);
        std::fs::write(&p, r.to_string()).unwrap();
        p
    };
    let first = write(
        "first.json",
        record(
            "abc",
            vec![row("castor", Some(300_000.0)), row("torch.compile", None)],
        ),
    );
    let second = write(
        "second.json",
        record(
            "abc",
            vec![
                row("torch.compile", Some(250_000.0)),
                row("torch eager", Some(100_000.0)),
            ],
        ),
    );
    let other = write(
        "other.json",
        record("def", vec![row("torch eager", Some(1.0))]),
    );
    let merged = dir.path().join("merged.json");
    let script = root().join("bench/record.py");
    let o = python(&[
        script.as_os_str(),
        "merge".as_ref(),
        first.as_os_str(),
        second.as_os_str(),
        merged.as_os_str(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&merged).unwrap()).unwrap();
    let rows: Vec<(String, f64)> = m["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["system"].as_str().unwrap().to_string(),
                r["tokens_per_s"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("castor".to_string(), 300_000.0),
            ("torch.compile".to_string(), 250_000.0),
            ("torch eager".to_string(), 100_000.0)
        ]
    );
    assert_eq!(
        m["completed_by"]["rows"].as_array().unwrap().len(),
        2,
        "{m}"
    );
    // Runs of another castor build are not one record.
    let o = python(&[
        script.as_os_str(),
        "merge".as_ref(),
        first.as_os_str(),
        other.as_os_str(),
        merged.as_os_str(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("the records differ in `castor_commit`"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The check's step runner, on plain commands: steps run at once (the training plans' shares)
/// fail together when any one fails or outlives its limit, and a background step (the
/// benchmark's compile warm-up) is waited for, or killed at its limit, as a row that is never
/// a failure.
#[test]
fn the_gpu_checks_steps_run_at_once_and_in_the_background() {
    let script = "import sys, tempfile, time; from pathlib import Path\n\
         sys.path.insert(0, 'bench/gpu'); import check\n\
         logs = Path(tempfile.mkdtemp())\n\
         s = check.Steps(logs, {'PATH': '/usr/bin:/bin'}, time.monotonic() + 60)\n\
         share = lambda k, x: {'CASTOR_GPU_PLAN_SHARE': f'{k}/2', 'X': x}\n\
         cmd = ['sh', '-c', 'echo share $CASTOR_GPU_PLAN_SHARE; exit $X']\n\
         print(s.run_together('both', cmd, 20, [share(0, '0'), share(1, '0')]), s.failed)\n\
         print(s.run_together('one', cmd, 20, [share(0, '0'), share(1, '3')]))\n\
         print(s.run_together('slow', ['sleep', '30'], 1, [{}]))\n\
         w = s.start('bg', ['sh', '-c', 'echo warm'])\n\
         s.finish(w, 20)\n\
         w = s.start('bg_slow', ['sleep', '30'])\n\
         s.finish(w, 1)\n\
         w = s.start('bg_bad', ['sh', '-c', 'exit 2'])\n\
         s.finish(w, 20)\n\
         print((logs / 'both-1.log').read_text().splitlines()[-1])\n\
         print((logs / 'bg.log').read_text().splitlines()[-1])\n\
         print('\\n'.join(s.rows))";
    let t0 = std::time::Instant::now();
    let o = python(&["-c".as_ref(), script.as_ref()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(t0.elapsed().as_secs() < 20, "a limit was not kept: {text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        &lines[..5],
        ["True False", "False", "False", "share 1/2", "warm"]
    );
    let rows = lines[5..].join("\n");
    for row in [
        "both                         ok (exits 0, 0, ",
        "one                          FAILED (exits 0, 3, ",
        "slow                         FAILED (exits timeout, ",
        "bg                           ok (exit 0, ",
        "bg_slow                      did not finish (exit timeout, ",
        "bg_bad                       failed (exit 2, ",
    ] {
        assert!(rows.contains(row), "{row}\nnot in\n{rows}");
    }
}
