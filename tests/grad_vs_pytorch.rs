//! `castor eval --grad` against PyTorch autograd on every fixture, F32: the loss within a
//! relative error of 1e-5 (for `sum`, relative to the sum of the magnitudes it adds up) and
//! every parameter's gradient within 1e-3, for the variant's own objective (lm, mlm or sum) and
//! for `sum`; the variant's own objective also with the attention core as the fused
//! `attention` op. References come from
//! tests/fixtures/generate_training.py (`training.safetensors`).

use crate::common;

use castor_ir::relative_error;
use castor_models::SafetensorsFile;
use common::*;

fn check(
    variant: &str,
    objective: &str,
    attention: &str,
    reference: &SafetensorsFile,
    info: &serde_json::Value,
    out_dir: &std::path::Path,
) {
    let dir = fixture(variant);
    let batch = batch_with_labels(variant, objective, out_dir);

    let out = out_dir.join(format!("{variant}-{objective}-{attention}-out.safetensors"));
    let o = eval(
        &dir,
        &batch,
        &out,
        &[
            "--device",
            "cpu",
            "--grad",
            "--objective",
            objective,
            "--attention",
            attention,
        ],
    );
    assert!(o.status.success(), "{variant} {objective}: {}", stderr(&o));
    let got = SafetensorsFile::open(&out).unwrap();

    let loss = got.read_f32("loss").unwrap();
    let want = reference.read_f32(&format!("{objective}.loss")).unwrap();
    // `sum` adds hundreds of terms of both signs; its error is measured against the sum of
    // their magnitudes (where the reference output is at hand), not the cancelled total.
    let expected = SafetensorsFile::open(dir.join("expected.safetensors")).unwrap();
    let err = match expected.read_f32("last_hidden_state") {
        Ok(h) if objective == "sum" => {
            let magnitude: f64 = h.iter().map(|&x| (x as f64).abs()).sum();
            (loss[0] as f64 - want[0] as f64).abs() / magnitude.max(want[0].abs() as f64)
        }
        _ => relative_error(&loss, &want),
    };
    println!(
        "{variant:12} {objective:4} {attention:5} loss {:.6} vs {:.6}: {err:.2e}",
        loss[0], want[0]
    );
    assert!(
        err < 1e-5,
        "{variant} {objective}: loss relative error {err:.2e}"
    );

    let prefix = format!("{objective}.grad.");
    let mut worst = (0.0f64, String::new());
    let mut count = 0;
    for key in reference.names().filter(|k| k.starts_with(&prefix)) {
        let name = &key[prefix.len()..];
        let ours: Vec<f32> = got
            .read_f32(&format!("grad.{name}"))
            .unwrap_or_else(|e| panic!("{variant} {objective}: no gradient for {name}: {e}"));
        let mut theirs = reference.read_f32(key).unwrap();
        let mut ours = ours;
        // Slices that are exactly zero in exact arithmetic (a key bias shifts every score of a
        // row equally, and softmax cancels it) hold rounding noise in both: both must be tiny,
        // and the rest is compared.
        if let Some(range) = info["zero_in_exact_arithmetic"][name].as_array() {
            let (lo, hi) = (
                range[0].as_u64().unwrap() as usize,
                range[1].as_u64().unwrap() as usize,
            );
            for i in lo..hi {
                assert!(
                    ours[i].abs() < 1e-5,
                    "{variant} {objective}: {name}[{i}] = {} should vanish",
                    ours[i]
                );
                ours[i] = 0.0;
                theirs[i] = 0.0;
            }
        }
        // An embedding's `padding_idx` row (listed by the generator when the batch reads it)
        // gets no gradient, exactly, from torch and from castor.
        if let Some(row) = info["padding_rows"][name].as_u64() {
            let width = ours.len() / reference.info(key).unwrap().shape[0];
            let row = row as usize * width..(row as usize + 1) * width;
            assert!(
                theirs[row.clone()].iter().all(|&x| x == 0.0)
                    && ours[row].iter().all(|&x| x == 0.0),
                "{variant} {objective}: {name}'s padding row has a gradient"
            );
        }
        let err = if theirs.iter().all(|&x| x == 0.0) {
            ours.iter().map(|&x| x.abs() as f64).fold(0.0, f64::max)
        } else {
            relative_error(&ours, &theirs)
        };
        if err > worst.0 {
            worst = (err, name.to_string());
        }
        assert!(
            err < 1e-3,
            "{variant} {objective}: gradient of {name}: relative error {err:.2e}"
        );
        count += 1;
    }
    assert!(count > 0, "{variant} {objective}: no reference gradients");
    println!(
        "{variant:12} {objective:4} {count} gradients, worst {:.2e} ({})",
        worst.0, worst.1
    );
}

#[test]
fn f32_gradients_match_pytorch_on_every_fixture() {
    let out_dir = tempfile::tempdir().unwrap();
    for variant in VARIANTS {
        let reference =
            SafetensorsFile::open(fixture(variant).join("training.safetensors")).unwrap();
        let info: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(variant).join("training.json")).unwrap(),
        )
        .unwrap();
        let default = info["default_objective"]
            .as_str()
            .unwrap_or("sum")
            .to_string();
        check(
            variant,
            &default,
            "eager",
            &reference,
            &info,
            out_dir.path(),
        );
        check(
            variant,
            &default,
            "fused",
            &reference,
            &info,
            out_dir.path(),
        );
        if default != "sum" && reference.contains("sum.loss") {
            check(variant, "sum", "eager", &reference, &info, out_dir.path());
        }
    }
}
