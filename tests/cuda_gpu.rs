//! The CUDA executor against the CPU executor, its oracle.
//!
//! Kernels: one small graph per op family and dtype, at sizes that are not multiples of the
//! block or vector width, run on both executors; every output must agree (relative error
//! below 1e-5 in F32, 2e-2 in F16/BF16). Training: three steps of every family fixture's plan
//! under fp32 (TF32 off), bf16 and fp16 (dynamic loss scaling) on both executors; the losses,
//! the updated masters and moments must agree (F32 < 1e-4, low precision < 2e-2) and the
//! loss-scale sequences must be equal.
//!
//! Without a GPU the graphs are still parsed, run on the CPU and lowered (so the cases stay
//! valid), and the GPU comparison is skipped with the probe's reason; with
//! `CASTOR_REQUIRE_GPU=1` a missing GPU fails the test instead.

mod common;

use castor_ir::{relative_error, Tensor};
use castor_runtime::cpu::CpuExecutor;
use castor_runtime::cuda::lower::{lower_graph, lower_plan};
use castor_runtime::cuda::{CudaGraphRunner, CudaPlanRunner};
use castor_runtime::{cuda_probe, PlanRunner};
use common::cuda_cases::{as_f32, batch, case_graph, inputs, load_params, plan, CASES};
use std::collections::HashMap;

/// True when a GPU is present; prints why not and fails under `CASTOR_REQUIRE_GPU=1`.
fn gpu() -> bool {
    match cuda_probe::probe() {
        Ok(d) => {
            println!("GPU: {d}");
            true
        }
        Err(e) => {
            assert!(
                std::env::var("CASTOR_REQUIRE_GPU").as_deref() != Ok("1"),
                "CASTOR_REQUIRE_GPU=1 but {e}"
            );
            println!("skipped on the GPU: {e}");
            false
        }
    }
}

#[test]
fn every_kernel_family_matches_the_cpu_executor() {
    let on_gpu = gpu();
    let mut rows = Vec::new();
    let mut checked = 0;
    for (name, body) in CASES {
        for t in ["f32", "bf16", "f16"] {
            let g = case_graph(name, body, t);
            let data = inputs(&g, 37, 0x5eed + rows.len() as u64);
            let bind = |n: &str| data.get(n);
            let want = CpuExecutor::new()
                .run(&g, &bind)
                .unwrap_or_else(|e| panic!("{name} {t} on the CPU: {e}"));
            lower_graph(&g).unwrap_or_else(|e| panic!("{name} {t} does not lower: {e}"));
            checked += 1;
            if !on_gpu {
                continue;
            }
            let mut runner = CudaGraphRunner::new(&g, &|n| data.get(n).cloned())
                .unwrap_or_else(|e| panic!("{name} {t}: {e}"));
            let got = runner
                .run(&data)
                .unwrap_or_else(|e| panic!("{name} {t} on CUDA: {e}"));
            let tol = if t == "f32" { 1e-5 } else { 2e-2 };
            for ((v, w), gt) in g.outputs().iter().zip(&want).zip(&got) {
                let err = relative_error(&as_f32(gt), &as_f32(w));
                rows.push(format!("{name:<18} {t:<5} %{:<6} {err:.2e}", g.name(*v)));
                assert!(
                    err < tol,
                    "{name} {t} %{}: relative error {err:.3e}",
                    g.name(*v)
                );
            }
        }
    }
    println!("{checked} graphs run on the CPU and lowered for CUDA");
    for r in rows {
        println!("{r}");
    }
}

#[test]
fn training_steps_match_the_cpu_executor() {
    let on_gpu = gpu();
    for variant in ["gpt2_lm", "bert_mlm", "llama_gqa"] {
        for precision in ["fp32", "bf16", "fp16"] {
            let p = plan(variant, &["--precision", precision]);
            lower_plan(&p).unwrap_or_else(|e| panic!("{variant} {precision}: {e}"));
            if !on_gpu {
                continue;
            }
            let params = load_params(variant);
            let mut cpu = PlanRunner::new(p.clone(), &|n| params.get(n).cloned()).unwrap();
            let mut gpu = CudaPlanRunner::new(p.clone(), &|n| params.get(n).cloned())
                .unwrap_or_else(|e| panic!("{variant} {precision}: {e}"));
            let tol = if precision == "fp32" { 1e-4 } else { 2e-2 };
            for step in 0..3u64 {
                let batch = batch(&p.micro_step, 77 + step);
                let a = cpu.step(std::slice::from_ref(&batch), 1e-3).unwrap();
                let b = gpu
                    .step(std::slice::from_ref(&batch), 1e-3)
                    .unwrap_or_else(|e| panic!("{variant} {precision} step {step}: {e}"));
                let loss_err = ((a.loss - b.loss) / a.loss).abs();
                println!(
                    "{variant} {precision} step {step}: loss cpu {:.6} cuda {:.6} scale {} / {}",
                    a.loss, b.loss, a.loss_scale, b.loss_scale
                );
                assert!(
                    loss_err < tol as f32,
                    "{variant} {precision}: loss {loss_err}"
                );
                assert_eq!(
                    a.loss_scale, b.loss_scale,
                    "{variant} {precision}: loss scale"
                );
                assert_eq!(a.skipped, b.skipped, "{variant} {precision}: skipped");
            }
            let device_state: HashMap<String, Tensor> =
                gpu.state_entries().unwrap().into_iter().collect();
            for (name, t) in cpu.state_entries() {
                let d = &device_state[name];
                let (x, y) = (as_f32(d), as_f32(t));
                if y.iter().all(|&v| v == 0.0) {
                    continue;
                }
                let err = relative_error(&x, &y);
                assert!(
                    err < tol,
                    "{variant} {precision}: state {name} error {err:.3e}"
                );
            }
        }
    }
}
