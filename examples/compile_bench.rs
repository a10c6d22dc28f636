//! Times the whole compile pipeline, config only, on public model configs: building the loss
//! graph, each precision pass, the training plan (autodiff, accumulation, optimizer,
//! rematerialization, fusion), the memory plan, the cost model and the CUDA lowering; then the
//! whole `castor compile --train` command (the release binary beside this example), which
//! also prints the anatomy and lowers the plan for its CUDA line.
//!
//! `cargo build --release --example compile_bench --bin castor && target/release/examples/compile_bench
//! [--remat MODE] [--batch B] [--seq T] [--repeat N]` (defaults: bf16, AdamW, remat none; batch
//! 8 x seq 1024 for GPT-2, 1 x 4096 for LLaMA; best of 3).

use castor_ir::{LossScaling, OptimizerKind, Remat, TrainSettings};
use castor_models::{Model, Objective};
use castor_passes::{
    cost::GpuSpec, cost::StepCost, Autocast, Classify, FoldCasts, Pass, Policy, Precision,
};
use castor_runtime::cuda::{lower::lower_plan, program::Command};
use castor_runtime::ExecutorKind;
use std::path::PathBuf;
use std::time::Instant;

const MODELS: [(&str, &str, usize, usize); 4] = [
    ("GPT-2 124M", "assets/configs/gpt2-124m.json", 8, 1024),
    ("GPT-2 XL", "assets/configs/gpt2-xl.json", 8, 1024),
    ("LLaMA-2-7B", "assets/configs/llama-2-7b.json", 1, 4096),
    ("LLaMA-3-70B", "assets/configs/llama-3-70b.json", 1, 4096),
];

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let remat: Remat = flag("--remat")
        .unwrap_or_else(|| "none".into())
        .parse()
        .map_err(anyhow::Error::msg)?;
    let repeat: usize = flag("--repeat").map_or(Ok(3), |s| s.parse())?;
    let castor: Option<PathBuf> = std::env::current_exe()
        .ok()
        .and_then(|p| Some(p.parent()?.parent()?.join("castor")))
        .filter(|p| p.is_file());
    println!(
        "| model | B x T | nodes (micro/opt) | build | classify | autocast | fold_casts | training plan | memory plan | cost | cuda lowering | total | castor compile --train | arena / lower bound | peak | cuda launches / products / arena |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (label, path, b, t) in MODELS {
        let b = flag("--batch").map_or(Ok(b), |s| s.parse())?;
        let t = flag("--seq").map_or(Ok(t), |s| s.parse())?;
        // Best of `repeat` runs for each stage.
        let mut best = [f64::MAX; 9];
        let mut line = String::new();
        for _ in 0..repeat {
            let start = Instant::now();
            let mut times = [0.0; 9];
            let t0 = Instant::now();
            let model = Model::load(path)?;
            let g = model.build_loss_graph(b, t, Objective::auto(&model))?;
            times[0] = ms(t0);
            let t0 = Instant::now();
            let (g, _) = Classify.run(&g)?;
            times[1] = ms(t0);
            let t0 = Instant::now();
            let (g, _) = Autocast::new(Policy::new(Precision::Bf16)).run(&g)?;
            times[2] = ms(t0);
            let t0 = Instant::now();
            let (g, _) = FoldCasts.run(&g)?;
            times[3] = ms(t0);
            let t0 = Instant::now();
            let settings = TrainSettings {
                precision: Precision::Bf16,
                objective: Objective::auto(&model).to_string(),
                batch: b,
                seq: t,
                grad_accum: 1,
                optimizer: OptimizerKind::AdamW(castor_ir::AdamWHparams {
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.01,
                }),
                max_grad_norm: 1.0,
                loss_scaling: LossScaling::None,
                frozen: vec![],
                no_decay: vec![],
                param_grads_in_compute_dtype: false,
                optimizer_state: castor_ir::DType::F32,
                update_in_backward: false,
                remat,
                classifier: castor_ir::Classifier::Eager,
                epilogues: castor_ir::Epilogues::Eager,
                lora: None,
                parallel: Default::default(),
                packed: false,
                unpadded: false,
                dropout: Default::default(),
            };
            let (plan, _) = castor::memory::pipeline(ExecutorKind::Cuda).build(&g, settings)?;
            times[4] = ms(t0);
            let t0 = Instant::now();
            let anatomy = castor::memory::anatomy(ExecutorKind::Cuda, &plan);
            times[5] = ms(t0);
            let t0 = Instant::now();
            let cost = StepCost::of_plan(&plan, &GpuSpec::default());
            times[6] = ms(t0);
            let t0 = Instant::now();
            let program = lower_plan(&plan)?;
            times[7] = ms(t0);
            times[8] = ms(start);
            let commands = program.runs.iter().flat_map(|r| r.commands.iter());
            let launches = commands
                .clone()
                .filter(|c| matches!(c, Command::Launch(_)))
                .count();
            let gemms = commands.filter(|c| matches!(c, Command::Gemm(_))).count();
            for (x, y) in best.iter_mut().zip(times) {
                *x = x.min(y);
            }
            let m = &anatomy.memory;
            line = format!(
                "{}/{} | {{}} | {:.3} | {:.2} GiB (est. step {:.1} ms, MFU {:.1}%) | {launches} / {gemms} / {:.2} GiB",
                plan.micro_step.num_nodes(),
                plan.optimizer_step.num_nodes(),
                m.ratio(),
                anatomy.total() as f64 / (1u64 << 30) as f64,
                cost.seconds() * 1e3,
                cost.mfu().unwrap_or(0.0) * 100.0,
                program.arena_bytes as f64 / (1u64 << 30) as f64
            );
        }
        // The whole command, as a user runs it.
        let mut command = f64::MAX;
        if let Some(castor) = &castor {
            for _ in 0..repeat {
                let start = Instant::now();
                let out = std::process::Command::new(castor)
                    .args(["compile", path, "--train", "--precision", "bf16"])
                    .args(["--remat", &remat.to_string()])
                    .args(["--batch", &b.to_string(), "--seq", &t.to_string()])
                    .output()?;
                anyhow::ensure!(
                    out.status.success(),
                    "castor compile {path}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                command = command.min(ms(start));
            }
        }
        let command = if command == f64::MAX {
            "n/a (no release castor)".to_string()
        } else {
            format!("{command:.1}")
        };
        let stages: Vec<String> = best[..8].iter().map(|x| format!("{x:.1}")).collect();
        let line = line.replacen(
            "{}",
            &format!("{} | {:.1} | {command}", stages.join(" | "), best[8]),
            1,
        );
        println!("| {label} | {b} x {t} | {line} |");
    }
    println!("(milliseconds, best of {repeat}; remat {remat}; bf16, AdamW)");
    Ok(())
}
