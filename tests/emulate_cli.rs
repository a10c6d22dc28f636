//! `--device emulate` from the command line: `train` and `eval` run the CUDA program that
//! `--device cuda` would run, on the host emulator, and give what `--device cpu` gives. On
//! these fixtures the emulated programs are bit-identical to the CPU executor (see
//! `tests/cuda_emulated.rs`), so the logged losses and the saved weights must be equal, byte
//! for byte, under every precision and remat mode; with `--world-size`, every rank's program
//! on the emulator gives what CPU ranks give, at every ZeRO stage. The runs build the
//! attention eagerly: the fused attention kernel agrees with the CPU executor to a bound, not
//! bit for bit (`tests/attention.rs`).

use crate::common;

use common::cuda_cases::midway_budget;
use common::{castor, eval, fixture, path_str, stderr};

fn losses(log: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            format!("{} {}", v["step"], v["loss"])
        })
        .collect()
}

#[test]
fn train_on_the_emulator_logs_and_saves_what_the_cpu_does() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let mut runs = 0;
    for family in ["gpt2_lm", "bert_mlm", "llama_gqa"] {
        let model = fixture(family);
        let data = model.join("input.safetensors");
        let objective = if family == "bert_mlm" { "sum" } else { "auto" };
        for precision in ["fp32", "tf32", "bf16", "fp16"] {
            let budget = format!(
                "budget:{}",
                midway_budget(
                    family,
                    &format!("--precision {precision} --attention eager")
                )
            );
            for remat in ["none", "full", "selective", budget.as_str()] {
                let mut saved = Vec::new();
                let mut logged = Vec::new();
                for device in ["cpu", "emulate"] {
                    let tag = format!("{family}-{precision}-{}-{device}", remat.replace(':', "_"));
                    let (log, save) = (
                        tmp.path().join(format!("{tag}.jsonl")),
                        tmp.path().join(&tag),
                    );
                    let o = castor(&[
                        "train",
                        path_str(&model),
                        "--data",
                        path_str(&data),
                        "--objective",
                        objective,
                        "--steps",
                        "3",
                        "--precision",
                        precision,
                        "--remat",
                        remat,
                        "--device",
                        device,
                        "--attention",
                        "eager",
                        "--log",
                        path_str(&log),
                        "--save",
                        path_str(&save),
                    ]);
                    if !o.status.success() {
                        failures.push(format!("{tag}: {}", stderr(&o)));
                        continue;
                    }
                    runs += 1;
                    logged.push(losses(&log));
                    saved.push(std::fs::read(save.join("model.safetensors")).unwrap());
                }
                let case = format!("{family} {precision} --remat {remat}");
                if logged.len() == 2 && logged[0] != logged[1] {
                    failures.push(format!(
                        "{case}: losses differ\n  cpu     {:?}\n  emulate {:?}",
                        logged[0], logged[1]
                    ));
                }
                if saved.len() == 2 && saved[0] != saved[1] {
                    failures.push(format!("{case}: the saved weights differ"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("{runs} training runs, the emulator's equal to the CPU's");
}

#[test]
fn eval_on_the_emulator_writes_what_the_cpu_does() {
    let tmp = tempfile::tempdir().unwrap();
    for family in ["gpt2_lm", "bert_mlm", "llama_gqa"] {
        let model = fixture(family);
        let input = model.join("input.safetensors");
        for precision in ["fp32", "bf16", "fp16"] {
            let mut outs = Vec::new();
            for device in ["cpu", "emulate"] {
                let out = tmp
                    .path()
                    .join(format!("{family}-{precision}-{device}.safetensors"));
                let o = eval(
                    &model,
                    &input,
                    &out,
                    &[
                        "--precision",
                        precision,
                        "--device",
                        device,
                        "--attention",
                        "eager",
                        "--grad",
                        "--objective",
                        "sum",
                    ],
                );
                assert!(
                    o.status.success(),
                    "{family} {precision} {device}: {}",
                    stderr(&o)
                );
                outs.push(std::fs::read(&out).unwrap());
            }
            assert!(
                outs[0] == outs[1],
                "{family} {precision}: eval --grad on the emulator differs from the CPU"
            );
        }
    }
}

/// `train` says what runs the fused attention where a library may: with `--attention auto`
/// castor's kernels (the emulator has no cuDNN), with `--attention cudnn` the CPU twin; an
/// eager plan has no such pass and no line.
#[test]
fn train_says_what_runs_the_attention() {
    let model = fixture("gpt2_lm");
    let data = model.join("input.safetensors");
    for (attention, line) in [
        (
            "auto",
            Some("attention   castor's kernels for 4, the CPU twin for 0 cuDNN-only passes"),
        ),
        (
            "cudnn",
            Some("attention   castor's kernels for 0, the CPU twin for 4 cuDNN-only passes"),
        ),
        ("eager", None),
    ] {
        let o = castor(&[
            "train",
            path_str(&model),
            "--data",
            path_str(&data),
            "--steps",
            "1",
            "--precision",
            "bf16",
            "--device",
            "emulate",
            "--attention",
            attention,
        ]);
        assert!(o.status.success(), "{attention}: {}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        match line {
            Some(line) => assert!(out.contains(line), "{attention}:\n{out}"),
            None => assert!(!out.contains("\nattention "), "{attention}:\n{out}"),
        }
    }
}

/// A kernel profile reads the GPU's clock: on the emulator or the CPU the run is refused
/// before any work, with the device exit code, and no profile file appears.
#[test]
fn a_kernel_profile_needs_a_gpu() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("gpt2_lm");
    let data = model.join("input.safetensors");
    let csv = tmp.path().join("kernels.csv");
    for device in ["emulate", "cpu"] {
        let o = castor(&[
            "train",
            path_str(&model),
            "--data",
            path_str(&data),
            "--steps",
            "1",
            "--device",
            device,
            "--attention",
            "eager",
            "--profile-kernels",
            path_str(&csv),
        ]);
        assert_eq!(o.status.code(), Some(5), "{device}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("--profile-kernels times each command on the GPU's clock"),
            "{}",
            stderr(&o)
        );
        assert!(!csv.exists());
    }
}

/// A LoRA plan (adapters beside the products, the base frozen in the step's dtype or in NF4)
/// trains on the emulator as on the CPU: the same losses and the same saved adapter, byte for
/// byte; also with the forward recomputed (whose adapter products add into recomputed base
/// results, in place).
#[test]
fn lora_trains_on_the_emulator_as_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, objective) in [
        ("gpt2_lm", "auto"),
        ("bert_mlm", "sum"),
        ("llama_gqa", "auto"),
    ] {
        let model = fixture(family);
        let data = model.join("input.safetensors");
        for (precision, base, remat) in [
            ("fp32", "compute", "none"),
            ("bf16", "compute", "none"),
            ("fp16", "compute", "none"),
            ("fp32", "nf4", "none"),
            ("tf32", "nf4", "none"),
            ("bf16", "nf4", "none"),
            ("bf16", "compute", "full"),
            ("bf16", "compute", "selective"),
        ] {
            let mut runs = Vec::new();
            for device in ["cpu", "emulate"] {
                let tag = format!("lora-{family}-{precision}-{base}-{remat}-{device}");
                let (log, save) = (
                    tmp.path().join(format!("{tag}.jsonl")),
                    tmp.path().join(&tag),
                );
                let o = castor(&[
                    "train",
                    path_str(&model),
                    "--data",
                    path_str(&data),
                    "--objective",
                    objective,
                    "--adapter",
                    path_str(&model.join("lora")),
                    "--steps",
                    "3",
                    "--precision",
                    precision,
                    "--base",
                    base,
                    "--remat",
                    remat,
                    "--device",
                    device,
                    "--attention",
                    "eager",
                    "--log",
                    path_str(&log),
                    "--save",
                    path_str(&save),
                ]);
                assert!(o.status.success(), "{tag}: {}", stderr(&o));
                runs.push((
                    losses(&log),
                    std::fs::read(save.join("adapter_model.safetensors")).unwrap(),
                ));
            }
            assert_eq!(
                runs[0].0, runs[1].0,
                "{family} {precision} {base} remat {remat}: losses"
            );
            assert!(
                runs[0].1 == runs[1].1,
                "{family} {precision} {base} remat {remat}: saved adapters differ"
            );
        }
    }
}

/// `--world-size 2 --device emulate`: each rank's CUDA program (the one a GPU of a launched
/// group runs, collectives included) on the emulator, the ranks' collectives computed as CPU
/// ranks compute them. Every ZeRO stage logs and saves what the CPU ranks do, byte for byte:
/// the check of the lowering of sharded state, gathers, reduce-scatters and held copies that
/// no GPU group has run.
#[test]
fn emulated_ranks_train_as_cpu_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for family in ["gpt2_lm", "bert_mlm", "llama_gqa"] {
        let model = fixture(family);
        let data = model.join("input.safetensors");
        let objective = if family == "bert_mlm" { "sum" } else { "auto" };
        // Every precision at every stage; gradient accumulation (the reduced gradient read
        // by the accumulation, as the side stream's join must allow) on top.
        let cases = ["bf16", "fp16", "fp32"]
            .into_iter()
            .flat_map(|p| ["0", "1", "2", "3"].map(|z| (p, z, "1")))
            .chain([("fp16", "2", "2"), ("bf16", "3", "2")]);
        for (precision, zero, accum) in cases {
            let mut saved = Vec::new();
            let mut logged = Vec::new();
            for device in ["cpu", "emulate"] {
                let tag = format!("{family}-{precision}-zero{zero}-accum{accum}-{device}");
                let (log, save) = (
                    tmp.path().join(format!("{tag}.jsonl")),
                    tmp.path().join(&tag),
                );
                let o = castor(&[
                    "train",
                    path_str(&model),
                    "--data",
                    path_str(&data),
                    "--objective",
                    objective,
                    "--steps",
                    "3",
                    "--precision",
                    precision,
                    "--world-size",
                    "2",
                    "--zero",
                    zero,
                    "--grad-accum",
                    accum,
                    "--device",
                    device,
                    "--attention",
                    "eager",
                    "--log",
                    path_str(&log),
                    "--save",
                    path_str(&save),
                ]);
                if !o.status.success() {
                    failures.push(format!("{tag}: {}", stderr(&o)));
                    continue;
                }
                logged.push(losses(&log));
                saved.push(std::fs::read(save.join("model.safetensors")).unwrap());
            }
            let case = format!("{family} {precision} ZeRO-{zero} accumulating {accum}");
            if logged.len() == 2 && logged[0] != logged[1] {
                failures.push(format!(
                    "{case}: losses differ\n  cpu     {:?}\n  emulate {:?}",
                    logged[0], logged[1]
                ));
            }
            if saved.len() == 2 && saved[0] != saved[1] {
                failures.push(format!("{case}: the saved weights differ"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
