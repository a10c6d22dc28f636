//! LoRA adapters against PEFT (tests/fixtures/generate_lora.py: r=4, lora_alpha=8, PEFT's
//! default target_modules per family, a seeded nonzero lora_B), F32 on the CPU executor:
//! - a PEFT adapter loaded with `--adapter`: logits within 1e-5 of PEFT's, the loss within
//!   1e-5, every adapter's gradient within 1e-4;
//! - three AdamW steps of `castor train --adapter` (only the adapters train): each adapter's
//!   update within 1e-2 of torch.optim.AdamW's, as the full-model optimizer tests hold, and
//!   the losses within 1e-5;
//! - what `--save` writes is PEFT's format: the same tensor names, shapes and dtype as PEFT's
//!   own `save_pretrained` of that adapter, the same config fields, and castor reads it back to
//!   the same logits;
//! - `castor merge` folds an adapter into its base: the merged checkpoint gives PEFT's adapted
//!   logits within 1e-5 on every family, and greedy `generate` with `--adapter` writes the
//!   merged model's text;
//! - the frozen base has no master, gradient or moments: it is stored once, in the step's dtype;
//! - `inspect --adapter`, `compile --explain` and `--emit dot` show the adapters and the base;
//! - the embedded tiny GPT-2 fine-tuned with adapters on the embedded corpus lowers its loss.

use crate::common;

use castor_ir::relative_error;
use castor_models::SafetensorsFile;
use common::*;
use std::path::Path;

/// The family fixtures with a PEFT adapter, and each one's default objective.
const VARIANTS: [(&str, &str); 8] = [
    ("gpt2_lm", "lm"),
    ("bert_mlm", "mlm"),
    ("llama_gqa", "lm"),
    ("llama_tied", "lm"),
    ("qwen2_bias", "lm"),
    ("mistral_window", "lm"),
    ("gemma_tiny", "lm"),
    ("llama31_rope", "lm"),
];

fn reference(variant: &str) -> SafetensorsFile {
    SafetensorsFile::open(fixture(variant).join("lora.safetensors")).unwrap()
}

fn adapter_names(dir: &Path) -> Vec<String> {
    let f = SafetensorsFile::open(dir.join("adapter_model.safetensors")).unwrap();
    let mut names: Vec<String> = f.names().map(str::to_string).collect();
    names.sort();
    names
}

#[test]
fn peft_adapters_give_peft_logits_and_gradients() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (variant, objective) in VARIANTS {
        let dir = fixture(variant);
        let batch = batch_with_labels(variant, objective, tmp.path());
        let out = tmp.path().join(format!("{variant}-lora.safetensors"));
        let adapter = dir.join("lora");
        let o = eval(
            &dir,
            &batch,
            &out,
            &[
                "--device",
                "cpu",
                "--adapter",
                path_str(&adapter),
                "--grad",
                "--objective",
                objective,
            ],
        );
        assert!(o.status.success(), "{variant}: {}", stderr(&o));
        let (got, want) = (SafetensorsFile::open(&out).unwrap(), reference(variant));
        let mut check = |what: &str, name: &str, tol: f64| {
            let (g, w) = (got.read_f32(name).unwrap(), want.read_f32(what).unwrap());
            let err = relative_error(&g, &w);
            println!("{variant:14} {what:60} {err:.2e}");
            if err.is_nan() || err >= tol {
                failures.push(format!("{variant} {what}: {err:.2e} (tolerance {tol:e})"));
            }
        };
        check("logits", "logits", 1e-5);
        check("loss", "loss", 1e-5);
        let grads: Vec<String> = want
            .names()
            .filter(|n| n.starts_with("grad."))
            .map(str::to_string)
            .collect();
        assert!(!grads.is_empty(), "{variant}: no adapter gradients");
        for g in &grads {
            check(g, g, 1e-4);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn three_adamw_steps_on_the_adapters_match_torch() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (variant, objective) in VARIANTS {
        let dir = fixture(variant);
        let batch = batch_with_labels(variant, objective, tmp.path());
        let saved = tmp.path().join(variant);
        let log = tmp.path().join(format!("{variant}.jsonl"));
        let o = castor(&[
            "train",
            path_str(&dir),
            "--data",
            path_str(&batch),
            "--objective",
            objective,
            "--adapter",
            path_str(&dir.join("lora")),
            "--steps",
            "3",
            "--lr",
            "1e-3",
            "--device",
            "cpu",
            "--log",
            path_str(&log),
            "--save",
            path_str(&saved),
        ]);
        assert!(o.status.success(), "{variant}: {}", stderr(&o));
        let want = reference(variant);
        let losses = log_losses(&log);
        let expected = want.read_f32("losses").unwrap();
        let got: Vec<f32> = losses.iter().map(|&l| l as f32).collect();
        let err = relative_error(&got, &expected);
        if err >= 1e-5 {
            failures.push(format!("{variant}: losses {got:?} vs {expected:?}"));
        }
        let start = SafetensorsFile::open(dir.join("lora/adapter_model.safetensors")).unwrap();
        let end = SafetensorsFile::open(saved.join("adapter_model.safetensors")).unwrap();
        for name in start.names() {
            let ours = name.strip_prefix("base_model.model.").unwrap();
            let (a, b) = (start.read_f32(name).unwrap(), end.read_f32(name).unwrap());
            let update: Vec<f32> = b.iter().zip(&a).map(|(x, y)| x - y).collect();
            let w = want.read_f32(&format!("update.{ours}")).unwrap();
            let err = relative_error(&update, &w);
            println!("{variant:14} update {ours:56} {err:.2e}");
            if err.is_nan() || err >= 1e-2 {
                failures.push(format!("{variant} update {ours}: {err:.2e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn saved_adapters_are_what_peft_saves_and_load_back() {
    let tmp = tempfile::tempdir().unwrap();
    for (variant, objective) in [("gpt2_lm", "lm"), ("llama_gqa", "lm"), ("bert_mlm", "mlm")] {
        let dir = fixture(variant);
        let batch = batch_with_labels(variant, objective, tmp.path());
        let saved = tmp.path().join(variant);
        // Fresh adapters with the fixture's shape (r=4, alpha=8, the family's targets).
        let o = castor(&[
            "train",
            path_str(&dir),
            "--data",
            path_str(&batch),
            "--objective",
            objective,
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",
            "--steps",
            "2",
            "--device",
            "cpu",
            "--save",
            path_str(&saved),
        ]);
        assert!(o.status.success(), "{variant}: {}", stderr(&o));
        let peft = dir.join("lora");
        assert_eq!(adapter_names(&saved), adapter_names(&peft), "{variant}");
        let (ours, theirs) = (
            SafetensorsFile::open(saved.join("adapter_model.safetensors")).unwrap(),
            SafetensorsFile::open(peft.join("adapter_model.safetensors")).unwrap(),
        );
        for (name, info) in theirs.tensors() {
            let mine = &ours.tensors()[name];
            assert_eq!(
                (mine.dtype, &mine.shape),
                (info.dtype, &info.shape),
                "{name}"
            );
        }
        let config = |d: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(d.join("adapter_config.json")).unwrap())
                .unwrap()
        };
        let (c, p) = (config(&saved), config(&peft));
        for key in ["peft_type", "r", "fan_in_fan_out", "bias"] {
            assert_eq!(c[key], p[key], "{variant}: {key}");
        }
        // PEFT keeps target_modules as a set: its order is not meaningful.
        let set = |v: &serde_json::Value| {
            let mut t: Vec<String> = v
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect();
            t.sort();
            t
        };
        assert_eq!(set(&c["target_modules"]), set(&p["target_modules"]));
        assert_eq!(c["lora_alpha"].as_f64(), p["lora_alpha"].as_f64());
        assert_eq!(c["base_model_name_or_path"], path_str(&dir));
        assert!(
            !saved.join("model.safetensors").exists(),
            "the base is not saved"
        );
        // Read back: the same logits as the training run's own host copy gives.
        let (a, b) = (
            tmp.path().join(format!("{variant}-a.safetensors")),
            tmp.path().join(format!("{variant}-b.safetensors")),
        );
        for (out, adapter) in [(&a, &saved), (&b, &saved)] {
            let o = eval(
                &dir,
                &batch,
                out,
                &["--device", "cpu", "--adapter", path_str(adapter)],
            );
            assert!(o.status.success(), "{}", stderr(&o));
        }
        let logits = |p: &Path| {
            SafetensorsFile::open(p)
                .unwrap()
                .read_f32("logits")
                .unwrap()
        };
        assert_eq!(logits(&a), logits(&b));
        let base = tmp.path().join(format!("{variant}-base.safetensors"));
        assert!(eval(&dir, &batch, &base, &["--device", "cpu"])
            .status
            .success());
        assert_ne!(
            logits(&a),
            logits(&base),
            "{variant}: the adapters change the output"
        );
    }
}

/// The anatomy of a LoRA plan: F32 masters, gradients and moments for the adapters only; the
/// base once, in BF16 under the bf16 policy.
#[test]
fn the_frozen_base_is_stored_once() {
    let o = castor(&[
        "compile",
        path_str(&fixture("llama_gqa")),
        "--lora-rank",
        "4",
        "--lora-targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "--precision",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let bytes = |row: &str| anatomy_row(&out, row);
    let report = out
        .lines()
        .find(|l| l.contains("pass        lora"))
        .unwrap();
    let adapter_params: u64 = report
        .split("; ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .replace(',', "")
        .parse()
        .unwrap();
    assert_eq!(bytes("F32 master weights"), 4 * adapter_params, "{out}");
    assert_eq!(bytes("gradients"), 4 * adapter_params);
    assert_eq!(bytes("optimizer state"), 8 * adapter_params);
    let base_params = castor_models::Model::load(fixture("llama_gqa"))
        .unwrap()
        .parameter_count();
    // Every base weight in BF16, except those the policy keeps in F32 (the norms).
    let frozen = bytes("frozen base weights");
    assert!(
        frozen < 4 * base_params && frozen >= 2 * base_params - 4096,
        "{frozen}"
    );
}

#[test]
fn lora_fine_tuning_lowers_the_loss_of_the_tiny_model() {
    let tmp = tempfile::tempdir().unwrap();
    // On a base in its dtype, and in NF4 (QLoRA).
    for base in ["compute", "nf4"] {
        let log = tmp.path().join(format!("lora-{base}.jsonl"));
        let o = castor(&[
            "train",
            "assets/tiny-gpt2.json",
            "--data",
            "assets/corpus.txt",
            "--lora-rank",
            "8",
            "--lora-alpha",
            "16",
            "--lora-targets",
            "c_attn,c_proj,c_fc",
            "--base",
            base,
            "--batch",
            "8",
            "--seq",
            "64",
            "--steps",
            "40",
            "--lr",
            "3e-3",
            "--device",
            "cpu",
            "--log",
            path_str(&log),
        ]);
        assert!(o.status.success(), "{base}: {}", stderr(&o));
        assert!(stdout(&o).contains("lora        r=8, alpha=16 (scale 2)"));
        // The base is random and frozen (its embeddings too), so the adapters alone move the
        // loss: measured 5.38 -> 5.21 over the first and last five steps (compute base).
        let losses = log_losses(&log);
        let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
        let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
        println!("{base}: loss {first:.3} -> {last:.3}");
        assert!(last < first - 0.1, "{base}: loss {first:.3} -> {last:.3}");
    }
}

#[test]
fn lora_flags_that_cannot_apply_are_refused() {
    let dir = fixture("gpt2_lm");
    let data = dir.join("input.safetensors");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            path_str(&dir),
            "--data",
            path_str(&data),
            "--steps",
            "1",
            "--device",
            "cpu",
        ];
        args.extend_from_slice(extra);
        castor(&args)
    };
    for (extra, message) in [
        (
            &["--lora-alpha", "8"][..],
            "--lora-alpha and --lora-targets shape the adapters --lora-rank asks for",
        ),
        (
            &["--lora-rank", "4", "--lora-targets", "q_proj"][..],
            "--lora-targets `q_proj` matches no product by a weight; the modules with one are \
             transformer.h.0.attn.c_attn",
        ),
        (&["--lora-rank", "0"][..], "--lora-rank must be at least 1"),
    ] {
        let o = run(extra);
        assert_eq!(o.status.code(), Some(3), "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(message), "{extra:?}: {}", stderr(&o));
    }
    let lora = dir.join("lora");
    let o = run(&["--adapter", path_str(&lora), "--lora-rank", "8"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("leave them out to continue the adapter"));
    // A plan decides its adapters: flags that disagree are refused, and a LoRA plan saves a
    // PEFT adapter folder.
    let tmp = tempfile::tempdir().unwrap();
    let emit = |plan: &Path, extra: &[&str]| {
        let mut args = vec![
            "compile",
            path_str(&dir),
            "--train",
            "--batch",
            "2",
            "--seq",
            "7",
            "--emit",
            "plan",
            "-o",
            path_str(plan),
        ];
        args.extend_from_slice(extra);
        assert!(castor(&args).status.success());
    };
    let (full, adapted) = (tmp.path().join("full.json"), tmp.path().join("lora.json"));
    emit(&full, &[]);
    emit(&adapted, &["--lora-rank", "4"]);
    let o = run(&["--plan", path_str(&full), "--adapter", path_str(&lora)]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("its adapters are none, the flags give r=4, alpha=8, targets c_attn"),
        "{}",
        stderr(&o)
    );
    let planned = tmp.path().join("planned");
    let o = run(&["--plan", path_str(&adapted), "--save", path_str(&planned)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(planned.join("adapter_model.safetensors").is_file());
    assert!(!planned.join("model.safetensors").exists());
    // A saved adapter is continued with --adapter, not resumed.
    let saved = tmp.path().join("saved");
    let o = run(&["--lora-rank", "4", "--save", path_str(&saved)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&["--resume", path_str(&saved)]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("a LoRA adapter checkpoint cannot be resumed yet"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn merged_checkpoints_give_the_adapted_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (variant, _) in VARIANTS {
        let dir = fixture(variant);
        let merged = tmp.path().join(variant);
        let o = castor(&[
            "merge",
            path_str(&dir),
            "--adapter",
            path_str(&dir.join("lora")),
            "--out",
            path_str(&merged),
        ]);
        assert!(o.status.success(), "{variant}: {}", stderr(&o));
        // The base's tensors (castor writes F32 masters), by name and shape where the base is
        // one file, by name where it is sharded.
        let ours = SafetensorsFile::open(merged.join("model.safetensors")).unwrap();
        match SafetensorsFile::open(dir.join("model.safetensors")) {
            Ok(base) => {
                for (name, info) in ours.tensors() {
                    let theirs = base.tensors().get(name).map(|i| &i.shape);
                    assert_eq!(Some(&info.shape), theirs, "{name}");
                }
            }
            Err(_) => {
                let index: serde_json::Value = serde_json::from_str(
                    &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
                )
                .unwrap();
                for name in ours.names() {
                    assert!(index["weight_map"].get(name).is_some(), "{variant}: {name}");
                }
            }
        }
        let out = tmp.path().join(format!("{variant}-merged.safetensors"));
        let input = dir.join("input.safetensors");
        let o = eval(&merged, &input, &out, &["--device", "cpu"]);
        assert!(o.status.success(), "{variant}: {}", stderr(&o));
        let got = SafetensorsFile::open(&out)
            .unwrap()
            .read_f32("logits")
            .unwrap();
        let want = reference(variant).read_f32("logits").unwrap();
        let err = relative_error(&got, &want);
        println!("{variant:14} merged logits {err:.2e}");
        if err.is_nan() || err >= 1e-5 {
            failures.push(format!("{variant}: merged logits {err:.2e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Decoding with `--adapter` writes what the merged checkpoint writes (sampled with one seed,
/// so every token depends on the whole distribution).
#[test]
fn generating_with_an_adapter_is_generating_with_the_merged_model() {
    let tmp = tempfile::tempdir().unwrap();
    let demo = tmp.path().join("demo");
    let o = castor(&["demo", "--steps", "20", "--out", path_str(&demo)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let base = demo.join("checkpoint");
    let (adapters, merged) = (tmp.path().join("adapters"), tmp.path().join("merged"));
    let o = castor(&[
        "train",
        path_str(&base),
        "--data",
        "assets/corpus.txt",
        "--lora-rank",
        "8",
        "--lora-targets",
        "c_attn,c_fc",
        "--lr",
        "1e-2",
        "--batch",
        "4",
        "--seq",
        "32",
        "--steps",
        "10",
        "--device",
        "cpu",
        "--save",
        path_str(&adapters),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = castor(&[
        "merge",
        path_str(&base),
        "--adapter",
        path_str(&adapters),
        "--out",
        path_str(&merged),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let generate = |model: &Path, extra: &[&str]| {
        let mut args = vec![
            "generate",
            path_str(model),
            "--prompt",
            "The compiler",
            "--max-new-tokens",
            "24",
            "--temperature",
            "1",
            "--seed",
            "7",
        ];
        args.extend_from_slice(extra);
        let o = castor(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o).lines().next().unwrap_or_default().to_string()
    };
    let with_adapter = generate(&base, &["--adapter", path_str(&adapters)]);
    assert_eq!(with_adapter, generate(&merged, &[]));
    assert_ne!(
        with_adapter,
        generate(&base, &[]),
        "the adapters change the text"
    );
}

/// `inspect --adapter`, `compile --explain` and the DOT picture show the adapters and the
/// frozen base.
#[test]
fn inspect_explain_and_dot_show_the_adapters() {
    let dir = fixture("llama_gqa");
    let o = castor(&[
        "inspect",
        path_str(&dir),
        "--adapter",
        path_str(&dir.join("lora")),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("PEFT LoRA, r=4, lora_alpha=8 (scale 2)") && out.contains("8 tensors"),
        "{out}"
    );
    assert!(
        out.contains(
            "lora        r=4, alpha=8 (scale 2): adapters on 4 product(s) (q_proj x2, v_proj x2)"
        ),
        "{out}"
    );
    let o = castor(&[
        "compile",
        path_str(&dir),
        "--lora-rank",
        "4",
        "--precision",
        "bf16",
        "--explain",
        "layers.0.self_attn.q_proj.lora_a",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("%layers.0.self_attn.q_proj.lora_a = matmul [contraction]")
            && out.contains("model.layers.0.self_attn.q_proj.lora_A.weight"),
        "{out}"
    );
    let o = castor(&[
        "compile",
        path_str(&dir),
        "--lora-rank",
        "4",
        "--emit",
        "dot",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let dot = stdout(&o);
    assert_eq!(
        dot.matches("(LoRA adapter)").count(),
        8,
        "two per adapted product"
    );
    assert!(
        dot.contains("model.layers.0.self_attn.k_proj.weight\\nparam\\nf32[32,64]\\n(frozen base)")
    );
    assert!(dot.contains("legend_adapter") && dot.contains("legend_frozen"));
}

/// Selective recomputation keeps an adapted product's sum (recomputing it would keep both
/// products): LLaMA-2-7B with r=16 adapters on every attention and MLP product saves no more
/// activations than full fine-tuning of the same model does.
#[test]
fn selective_recomputation_keeps_the_adapted_sums() {
    let compile = |extra: &[&str]| {
        let mut args = vec![
            "compile",
            "assets/configs/llama-2-7b.json",
            "--train",
            "--precision",
            "bf16",
            "--batch",
            "1",
            "--seq",
            "4096",
            "--remat",
            "selective",
        ];
        args.extend_from_slice(extra);
        let o = castor(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = stdout(&o);
        let saved = out
            .lines()
            .find_map(|l| l.trim_start().strip_prefix("saved activations"))
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap()
            .replace(',', "");
        (out.clone(), saved.parse::<u64>().unwrap())
    };
    let (lora, lora_saved) = compile(&[
        "--lora-rank",
        "16",
        "--lora-targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    ]);
    let (_, full_saved) = compile(&[]);
    assert!(lora.contains("pass        remat       remat selective"));
    assert!(lora_saved <= full_saved, "{lora_saved} > {full_saved}");
    // In the step itself: the sum is not recomputed, its products' operands are.
    let o = castor(&[
        "compile",
        path_str(&fixture("llama_gqa")),
        "--lora-rank",
        "4",
        "--remat",
        "selective",
        "--emit",
        "ir",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ir = stdout(&o);
    assert!(
        ir.contains("%layers.0.self_attn.q_proj: "),
        "the sum is in the step"
    );
    assert!(!ir.contains("%layers.0.self_attn.q_proj.remat"), "and kept");
    assert!(
        ir.contains(".remat"),
        "selective still recomputes the cheap ops"
    );
}

/// An adapter's work runs in its products' accumulators, not in passes of its own: its
/// product adds into the base product's result (`matmul_add`, cuBLAS's `beta = 1` in place
/// of that result), and in the backward the scale by `lora_alpha / r` joins the two products
/// that read the output gradient (directly, and reshaped to rows for the weight gradient).
/// In F32, where the fixture's scale of 2 is exact, three steps save the adapter the separate
/// ops save, byte for byte, with the same losses.
#[test]
fn the_adapters_add_and_scale_in_their_products_accumulators() {
    let model = fixture("llama_gqa");
    let compile = |emit: &str| {
        let o = castor(&[
            "compile",
            path_str(&model),
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",
            "--train",
            "--precision",
            "bf16",
            "--emit",
            emit,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        (stdout(&o), stderr(&o))
    };
    let (ir, report) = compile("ir");
    let adapted: usize = report
        .lines()
        .find_map(|l| l.split("adapters on ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no lora line: {report}"));
    assert!(adapted > 0);
    assert_eq!(ir.matches("= matmul_add(").count(), adapted, "{ir}");
    assert!(
        report.contains(&format!(
            "{adapted} addition(s) and {} scale(s)",
            2 * adapted
        )),
        "{report}"
    );
    // No scale of an adapter's product or of its gradient, and no add of the adapter's
    // product (`%<proj>.lora`) to the base's, is left.
    for line in ir.lines().filter(|l| l.contains(".lora")) {
        assert!(!line.contains("= scale("), "a scale left: {line}");
        let adds_adapter = line.contains("= add(") && line.contains("_proj.lora)");
        assert!(!adds_adapter, "a sum left: {line}");
    }
    // The adapter's product writes where the base product wrote, reading it as C.
    let (cuda, _) = compile("cuda");
    let gemm_c = |node: &str| {
        let line = cuda
            .lines()
            .find(|l| l.starts_with("  gemm ") && l.ends_with(&format!("# %{node}")))
            .unwrap_or_else(|| panic!("no product for %{node}"));
        let c = line.split(" C=").nth(1).unwrap().split(' ').next().unwrap();
        (c.to_string(), line.contains(" beta=1 "))
    };
    let (base, base_adds) = gemm_c("layers.0.self_attn.q_proj.base");
    let (sum, sum_adds) = gemm_c("layers.0.self_attn.q_proj");
    assert!(!base_adds && sum_adds);
    assert_eq!(
        base, sum,
        "the sum is written in place of the base product's result"
    );

    let tmp = tempfile::tempdir().unwrap();
    let data = model.join("input.safetensors");
    let runs: Vec<(Vec<f64>, Vec<u8>)> = ["eager", "fused"]
        .iter()
        .map(|mode| {
            let (log, save) = (
                tmp.path().join(format!("{mode}.jsonl")),
                tmp.path().join(mode),
            );
            let o = castor(&[
                "train",
                path_str(&model),
                "--data",
                path_str(&data),
                "--adapter",
                path_str(&model.join("lora")),
                "--steps",
                "3",
                "--precision",
                "fp32",
                "--epilogues",
                mode,
                "--log",
                path_str(&log),
                "--save",
                path_str(&save),
            ]);
            assert!(o.status.success(), "{mode}: {}", stderr(&o));
            (
                log_losses(&log),
                std::fs::read(save.join("adapter_model.safetensors")).unwrap(),
            )
        })
        .collect();
    assert_eq!(runs[0].0, runs[1].0, "losses");
    assert!(runs[0].1 == runs[1].1, "the saved adapters differ");
}

/// The 6N + 6LCT rule counts a frozen base at 4N (its products and their input gradients, no
/// weight gradient), as PEFT's and the benchmark's MFU do: LLaMA-2-7B with r=16 adapters on
/// every linear layer claimed 101.3% of the H100's peak when its base counted 6N. An NF4 base
/// counts the weights its codes pack (it counted 3.6 of the 6.7 billion).
#[test]
fn the_mfu_rule_counts_a_frozen_base_at_4n() {
    let compile = |base: &str| {
        let o = castor(&[
            "compile",
            "assets/configs/llama-2-7b.json",
            "--train",
            "--precision",
            "bf16",
            "--batch",
            "1",
            "--seq",
            "4096",
            "--lora-rank",
            "16",
            "--lora-targets",
            "all-linear",
            "--base",
            base,
            "--gpu",
            "h100",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let out = compile("compute");
    let flops_line = |out: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with("FLOPs/token"))
            .unwrap_or_else(|| panic!("no FLOPs line: {out}"))
            .to_string()
    };
    let line = flops_line(&out);
    let rule_of = |l: &str| l.split(" vs ").nth(1).unwrap().to_string();
    assert_eq!(rule_of(&line), rule_of(&flops_line(&compile("nf4"))));
    let number = |after: &str| -> f64 {
        let rest = line.split(after).nth(1).unwrap();
        let digits: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == ',' || *c == '.')
            .filter(|&c| c != ',')
            .collect();
        digits.trim_end_matches('.').parse().unwrap()
    };
    let (n, frozen) = (number("(N "), number("of which "));
    let (l, c, t) = (number(" L "), number(" C "), number(" T "));
    assert!(frozen > 0.99 * n && frozen < n, "{line}");
    let rule = (6.0 * (n - frozen) + 4.0 * frozen + 6.0 * l * c * t) / 1e6;
    let shown = number("vs 6N+6LCT ");
    assert!((shown - rule).abs() < 0.1, "{shown} against {rule}: {line}");
    let mfu = program_mfu(&out);
    assert!(mfu > 50.0 && mfu < 100.0, "program MFU {mfu}%");
}

/// docs/commands.md's figures for `--epilogues`: LLaMA-3.2-1B with r=16 adapters on the seven
/// projections (B=4, T=2048, bf16, H100 SXM) goes from a program roofline of 84.0 ms and 473
/// kernel launches a step (`eager`) to 79.1 ms and 314 (`fused`), at the same planned peak.
#[test]
fn the_adapters_fused_shorten_the_llama_lora_roofline_at_the_same_peak() {
    let compile = |mode: &str| {
        let o = castor(&[
            "compile",
            "assets/configs/llama-3.2-1b.json",
            "--train",
            "--precision",
            "bf16",
            "--batch",
            "4",
            "--seq",
            "2048",
            "--lora-rank",
            "16",
            "--lora-targets",
            "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
            "--gpu",
            "h100",
            "--epilogues",
            mode,
        ]);
        assert!(o.status.success(), "{mode}: {}", stderr(&o));
        let out = stdout(&o);
        let cuda = out
            .lines()
            .find(|l| l.starts_with("cuda "))
            .unwrap()
            .to_string();
        let launches: usize = cuda.split_whitespace().nth(1).unwrap().parse().unwrap();
        let roofline: f64 = cuda
            .split("program roofline ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|ms| ms.parse().ok())
            .unwrap_or_else(|| panic!("no roofline: {cuda}"));
        (format!("{roofline:.1}"), launches, anatomy_total(&out))
    };
    let (eager, fused) = (compile("eager"), compile("fused"));
    assert_eq!((eager.0.as_str(), eager.1), ("84.0", 473), "eager");
    assert_eq!((fused.0.as_str(), fused.1), ("79.1", 314), "fused");
    assert_eq!(eager.2, fused.2, "planned peak");
}
