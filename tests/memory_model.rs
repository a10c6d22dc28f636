//! One memory model: the planned peak `castor compile` reports (the anatomy's total, which the
//! remat budget and the fit verdict read too) is what the CUDA executor allocates for the plan
//! (its program's allocation: arena, cuBLAS workspace, state and every other buffer), byte for
//! byte, for every plan family under every remat mode and optimizer choice (Adafactor, 8-bit
//! AdamW, BF16 moments, updates inside the backward pass); a budget plan stays within its
//! budget.

use crate::common;

use castor_runtime::cuda::lower::lower_plan;
use common::cuda_cases::{midway_budget, plan, planned_peak, PLAN_FAMILIES};

#[test]
fn the_planned_peak_is_what_the_device_allocates() {
    let mut checked = 0;
    for family in PLAN_FAMILIES {
        for precision in ["bf16", "fp32"] {
            let base = format!("--precision {precision}");
            let budget = midway_budget(family, &base);
            for remat in [
                "none".to_string(),
                "full".into(),
                "selective".into(),
                format!("budget:{budget}"),
                "none --optimizer adafactor".into(),
                "selective --optimizer-state bf16".into(),
                "selective --optimizer adafactor --update-in-backward".into(),
                "none --optimizer adamw8bit --update-in-backward".into(),
            ] {
                let flags = format!("{base} --remat {remat}");
                let peak = planned_peak(family, &flags);
                let mut args: Vec<&str> = flags.split_whitespace().collect();
                args.push("--train");
                let program = lower_plan(&plan(family, &args)).unwrap();
                let allocation = program.allocation();
                assert_eq!(
                    peak,
                    allocation.total(),
                    "{family} {flags}: planned {peak}, the device allocates {allocation:?}"
                );
                if remat.starts_with("budget") {
                    assert!(peak <= budget, "{family} {flags}: {peak} over {budget}");
                }
                checked += 1;
            }
        }
    }
    println!("{checked} plans: planned peak = device allocation");
}
