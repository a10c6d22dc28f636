//! Mixed precision against PyTorch CPU autocast: for every fixture under bf16 and fp16,
//! castor's relative error against the F32 reference must not exceed 1.5x autocast's own
//! error on the same inputs. Both errors are printed (`cargo test -- --nocapture`).

mod common;

use castor_ir::relative_error;
use castor_models::SafetensorsFile;
use common::*;

#[test]
fn mixed_precision_error_is_within_autocast_bound() {
    let out_dir = tempfile::tempdir().unwrap();
    println!(
        "{:<12} {:<6} {:<20} {:>12} {:>12} {:>7}",
        "variant", "policy", "output", "castor err", "torch err", "ratio"
    );
    for variant in VARIANTS {
        let dir = fixture(variant);
        let want = SafetensorsFile::open(dir.join("expected.safetensors")).unwrap();
        for (precision, tag) in [("bf16", "autocast_bf16"), ("fp16", "autocast_fp16")] {
            let out = out_dir
                .path()
                .join(format!("{variant}-{precision}.safetensors"));
            let input = dir.join("input.safetensors");
            let o = eval(
                &dir,
                &input,
                &out,
                &["--device", "cpu", "--precision", precision],
            );
            assert!(o.status.success(), "{variant} {precision}: {}", stderr(&o));
            let got = SafetensorsFile::open(&out).unwrap();
            for key in want.names().filter(|k| !k.starts_with("autocast_")) {
                let reference = want.read_f32(key).unwrap();
                let torch = want.read_f32(&format!("{tag}.{key}")).unwrap();
                let ours = got.read_f32(key).unwrap();
                let (e_ours, e_torch) = (
                    relative_error(&ours, &reference),
                    relative_error(&torch, &reference),
                );
                println!(
                    "{variant:<12} {precision:<6} {key:<20} {e_ours:>12.3e} {e_torch:>12.3e} {:>7.2}",
                    e_ours / e_torch
                );
                assert!(
                    e_ours <= 1.5 * e_torch,
                    "{variant} {precision} {key}: castor error {e_ours:.3e} > 1.5 x autocast error {e_torch:.3e}"
                );
            }
        }
    }
}
