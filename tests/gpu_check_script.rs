//! The GPU check script (`bench/gpu/check.py`) on a machine without a GPU: its preflight must
//! fail, with a clear message and a non-zero exit status, so a GPU run that cannot start is
//! never taken for a passing one.

mod common;

use common::root;
use std::process::Command;

#[test]
fn the_gpu_check_fails_clearly_without_a_gpu() {
    if castor_runtime::cuda_probe::probe().is_ok() {
        println!("skipped: this machine has a GPU");
        return;
    }
    let out = tempfile::tempdir().unwrap();
    for part in [
        &["--part", "tests"][..],
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
