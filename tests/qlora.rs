//! QLoRA (`--base nf4`): the frozen base's linear weights stored in NF4 and dequantized by
//! each product. Checked here:
//! - exactness: an F32 LoRA plan on the NF4 base trains exactly as the plain LoRA plan on a
//!   checkpoint whose weights are the NF4 round trip of the original (`castor_ir::nf4`, which
//!   `tests/nf4.rs` holds bit-identical to bitsandbytes): the same losses, the same adapters,
//!   byte for byte, for each family;
//! - memory: the frozen base shrinks to the NF4 bytes, and the LLaMA-2-7B plan of the issue
//!   (all linear products, r=16, bf16, B=1, T=4096) with it;
//! - the error report, and the flag's refusals.
//!
//! The CUDA program of an NF4 plan is checked against the CPU executor in
//! `tests/emulate_cli.rs` (`lora_trains_on_the_emulator_as_on_the_cpu`).

use crate::common;

use castor_ir::nf4::{self, NF4_BLOCK};
use castor_ir::{StateInit, Tensor, TrainingPlan};
use castor_models::{write_safetensors, Checkpoint};
use common::*;
use std::path::Path;

/// The checkpoint tensors an NF4 plan quantizes.
fn quantized_names(plan: &TrainingPlan) -> Vec<String> {
    let mut names: Vec<String> = plan
        .state
        .iter()
        .filter_map(|s| match &s.init {
            StateInit::Nf4 { tensor, .. } => Some(tensor.clone()),
            _ => None,
        })
        .collect();
    names.dedup();
    names
}

/// `castor train` of `model` with the fixture's PEFT adapter: the logged losses and the saved
/// adapter file.
fn train(model: &Path, adapter: &Path, base: &str, out: &Path) -> (Vec<f64>, Vec<u8>) {
    let data = adapter.parent().unwrap().join("input.safetensors");
    std::fs::create_dir_all(out).unwrap();
    let log = out.join("log.jsonl");
    let save = out.join("adapter");
    let o = castor(&[
        "train",
        path_str(model),
        "--data",
        path_str(&data),
        "--objective",
        "sum",
        "--adapter",
        path_str(adapter),
        "--base",
        base,
        "--steps",
        "3",
        "--precision",
        "fp32",
        "--device",
        "cpu",
        "--log",
        path_str(&log),
        "--save",
        path_str(&save),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let losses = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    (
        losses,
        std::fs::read(save.join("adapter_model.safetensors")).unwrap(),
    )
}

#[test]
fn an_nf4_base_trains_exactly_as_its_dequantized_weights() {
    for family in ["gpt2_lm", "bert_mlm", "llama_gqa", "qwen2_bias"] {
        let tmp = tempfile::tempdir().unwrap();
        let model = fixture(family);
        let adapter = model.join("lora");
        let plan = cuda_cases::plan(
            family,
            &["--lora-rank", "4", "--base", "nf4", "--objective", "sum"],
        );
        let names = quantized_names(&plan);
        assert!(!names.is_empty(), "{family}: nothing quantized");
        // The same model, its quantized weights replaced by their NF4 round trip.
        let round_trip = tmp.path().join("round-trip");
        std::fs::create_dir_all(&round_trip).unwrap();
        std::fs::copy(model.join("config.json"), round_trip.join("config.json")).unwrap();
        // The checkpoint, sharded or not, becomes one file.
        let file = Checkpoint::open(&model).unwrap();
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        let all: Vec<String> = file.names().map(str::to_string).collect();
        for name in all {
            let t = file.tensor(&name).unwrap();
            let t = if names.contains(&name) {
                let values = t.as_f32().unwrap().to_vec();
                let back = nf4::dequantize(&nf4::quantize(&values, NF4_BLOCK), NF4_BLOCK);
                // In F32, where the dequantized values are exact (BERT's checkpoint is BF16).
                Tensor::from_f32(castor_ir::DType::F32, t.shape().clone(), back)
            } else {
                t
            };
            tensors.push((name, t));
        }
        let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        write_safetensors(&round_trip.join("model.safetensors"), &refs).unwrap();

        let (a, b) = (tmp.path().join("nf4"), tmp.path().join("plain"));
        let nf4_run = train(&model, &adapter, "nf4", &a);
        let plain_run = train(&round_trip, &adapter, "compute", &b);
        assert_eq!(nf4_run.0, plain_run.0, "{family}: losses");
        assert!(
            nf4_run.1 == plain_run.1,
            "{family}: the saved adapters differ"
        );
        println!(
            "{family}: {} weights in NF4, losses {:?}",
            names.len(),
            nf4_run.0
        );
    }
}

/// The anatomy's "frozen base weights" row of `compile` with `flags`, and the total.
fn frozen_and_total(model: &Path, flags: &[&str]) -> (u64, u64) {
    let mut args = vec!["compile", path_str(model)];
    args.extend_from_slice(flags);
    let o = castor(&args);
    assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
    let out = stdout(&o);
    (
        anatomy_row(&out, "frozen base weights"),
        anatomy_total(&out),
    )
}

/// `compile` flags of the QLoRA plan: LLaMA-2-7B, LoRA r=16 (alpha 32) on every
/// attention and MLP product, bf16, batch 1 x 4096, with `remat` and the base stored as `base`.
fn qlora_7b_flags<'a>(remat: &'a str, base: &'a str) -> Vec<&'a str> {
    vec![
        "--train",
        "--precision",
        "bf16",
        "--batch",
        "1",
        "--seq",
        "4096",
        "--remat",
        remat,
        "--lora-rank",
        "16",
        "--lora-alpha",
        "32",
        "--lora-targets",
        "all-linear",
        "--base",
        base,
    ]
}

/// LLaMA-2-7B, LoRA r=16 on every attention and MLP product, bf16, B=1, T=4096, selective
/// recomputation: NF4 stores the 224 quantized weights in 3,642,753,024 bytes (4.5 bits a
/// value: 4-bit codes and an F32 maximum per 64) instead of 12,952,010,752 in BF16, and the
/// planned peak falls by exactly the difference (nothing else changes: no dequantized weight
/// outlives its product).
#[test]
fn an_nf4_base_plans_the_7b_fine_tune_in_its_bytes() {
    let config = root().join("assets/configs/llama-2-7b.json");
    let flags = |base| qlora_7b_flags("selective", base);
    let (frozen_bf16, total_bf16) = frozen_and_total(&config, &flags("compute"));
    let (frozen_nf4, total_nf4) = frozen_and_total(&config, &flags("nf4"));
    let saved = 12_952_010_752 - 3_642_753_024;
    assert_eq!(frozen_bf16 - frozen_nf4, saved);
    assert_eq!(total_bf16 - total_nf4, saved);
    println!("LLaMA-2-7B QLoRA r=16: planned peak {total_bf16} (bf16 base), {total_nf4} (NF4)");
}

/// The same QLoRA fine-tune under 16 GB: `--remat selective` cannot get there (it keeps every
/// product's output the backward reads: 15.8 GB of activations beside a 4.4 GB base), but a
/// 15 GB budget can, recomputing less than `--remat full` does.
#[test]
fn the_nf4_7b_fine_tune_fits_16_gb_with_a_recompute_budget() {
    let config = root().join("assets/configs/llama-2-7b.json");
    let plan = |remat: &str| {
        let mut args = vec!["compile", path_str(&config)];
        args.extend(qlora_7b_flags(remat, "nf4"));
        let o = castor(&args);
        assert!(o.status.success(), "{remat}: {}", stderr(&o));
        let out = stdout(&o);
        let gflop: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix("remat       "))
            .and_then(|l| l.split('+').nth(1))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{remat}: no remat line in\n{out}"));
        (anatomy_total(&out), gflop)
    };
    let (budget, budget_gflop) = plan("budget:15000000000");
    let (full, full_gflop) = plan("full");
    let (selective, _) = plan("selective");
    // Within the budget, so under 16 GB.
    assert!(budget <= 15_000_000_000, "{budget}");
    assert!(selective > 16_000_000_000 && full < budget);
    assert!(budget_gflop < full_gflop, "{budget_gflop} vs {full_gflop}");
    println!(
        "QLoRA 7B: selective {selective}, budget:15e9 {budget} (+{budget_gflop} GFLOP), full \
         {full} (+{full_gflop} GFLOP)"
    );
}

#[test]
fn base_nf4_needs_adapters() {
    let model = fixture("gpt2_lm");
    for args in [
        vec!["compile", path_str(&model), "--train", "--base", "nf4"],
        vec![
            "train",
            path_str(&model),
            "--data",
            "unused",
            "--steps",
            "1",
            "--base",
            "nf4",
        ],
    ] {
        let o = castor(&args);
        assert!(!o.status.success(), "{args:?}");
        assert!(
            stderr(&o).contains("--base nf4 quantizes the frozen base under LoRA adapters"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    let o = castor(&["compile", path_str(&model), "--train", "--base", "nf8"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("the base is `compute` or `nf4`"),
        "{}",
        stderr(&o)
    );
}

/// `train --base nf4` reports the quantization error of the base, over all the weights and for
/// the worst one.
#[test]
fn train_reports_the_quantization_error() {
    let model = fixture("gpt2_lm");
    let o = castor(&[
        "train",
        path_str(&model),
        "--data",
        path_str(&model.join("input.safetensors")),
        "--steps",
        "1",
        "--lora-rank",
        "4",
        "--base",
        "nf4",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let line = out
        .lines()
        .find(|l| l.starts_with("nf4 "))
        .unwrap_or_else(|| panic!("no nf4 line in\n{out}"));
    // 8 weights of a random normal checkpoint: NF4's error on normal values is about 9%.
    assert!(
        line.contains("8 base weights quantized: relative error 0.09"),
        "{line}"
    );
}
