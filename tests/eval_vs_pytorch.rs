//! `castor eval` on every fixture, compared with transformers' F32 outputs:
//! relative error ‖a−b‖/‖b‖ below 1e-4 for every output tensor, with the attention core built
//! as eager ops and as the fused `attention` op.

use crate::common;

use castor_ir::relative_error;
use castor_models::SafetensorsFile;
use common::*;

#[test]
fn eval_matches_transformers_on_every_fixture() {
    let out_dir = tempfile::tempdir().unwrap();
    for (variant, attention) in VARIANTS.iter().flat_map(|v| [(*v, "eager"), (*v, "fused")]) {
        let dir = fixture(variant);
        let out = out_dir
            .path()
            .join(format!("{variant}-{attention}.safetensors"));
        let o = eval(
            &dir,
            &dir.join("input.safetensors"),
            &out,
            &["--device", "cpu", "--attention", attention],
        );
        assert!(
            o.status.success(),
            "{variant}: castor eval failed:\n{}",
            stderr(&o)
        );
        let got = SafetensorsFile::open(&out).unwrap();
        let want = SafetensorsFile::open(dir.join("expected.safetensors")).unwrap();
        let keys: Vec<&str> = want
            .names()
            .filter(|k| !k.starts_with("autocast_"))
            .collect();
        assert!(!keys.is_empty());
        for key in keys {
            let (g, w) = (got.read_f32(key).unwrap(), want.read_f32(key).unwrap());
            assert_eq!(
                got.info(key).unwrap().shape,
                want.info(key).unwrap().shape,
                "{variant}.{key}"
            );
            let err = relative_error(&g, &w);
            println!("{variant:12} {attention:5} {key:20} relative error {err:.2e}");
            assert!(
                err < 1e-4,
                "{variant}.{key}: relative error {err:.3e} >= 1e-4"
            );
        }
    }
}
