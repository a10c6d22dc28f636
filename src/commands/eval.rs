//! `castor eval`: one forward pass on a batch from a safetensors file; the interface by which
//! castor is compared with PyTorch, tensor by tensor.

use crate::batch::{read_batch, read_labels};
use crate::device::Selected;
use crate::precision::PrecisionArgs;
use crate::CliError;
use anyhow::Context;
use castor_ir::Tensor;
use castor_models::{write_safetensors, Model, Objective};
use castor_passes::{Autodiff, Pass};
use castor_runtime::cpu::CpuExecutor;
use castor_runtime::cuda::{CudaGraphRunner, EmulatedGraphRunner};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// CUDA when a device is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
    /// The CUDA program `cuda` would run, executed on the host by the program emulator:
    /// slow, for checking a plan (and the executor) on a machine without a GPU.
    Emulate,
}

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder (config.json + safetensors).
    pub model: PathBuf,
    /// Safetensors file with `input_ids` [B, T] (I64 or I32) and optionally `attention_mask`
    /// and `token_type_ids`.
    #[arg(long)]
    pub input: PathBuf,
    /// Where to write the outputs (F32): `logits` for models with an LM head, else
    /// `last_hidden_state` (and `pooler_output` for BERT with a pooler).
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Also compute the loss and the gradient of every parameter, written as `loss` (F32
    /// scalar) and `grad.<checkpoint tensor name>` (F32).
    #[arg(long)]
    pub grad: bool,
    /// The loss for --grad: `lm` (causal LM), `mlm` (masked LM; needs `labels` in the input),
    /// `sum` (sum of the last hidden state), or `auto` (lm/mlm when the model has the head).
    #[arg(long, default_value = "auto")]
    pub objective: String,
    /// Rematerialization of the gradient graph (--grad): `none`, `full`, `selective` or
    /// `budget:<bytes>` (the graph's planned arena plus parameters within the budget).
    #[arg(long, default_value = "none", value_name = "MODE", value_parser = crate::training::parse_remat)]
    pub remat: castor_ir::Remat,
    /// Run the forward this many times and report the median time (for benchmarks).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Refuse weights holding NaN or Inf values (without it, they are a warning).
    #[arg(long)]
    pub strict: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let device = crate::device::select(args.device)?;

    let model = Model::load(&args.model)?;
    let batch = read_batch(&args.input, model.input_names(), model.vocab_size())?;
    let graph = model.build_graph(batch.batch, batch.seq)?;
    castor_ir::verify(&graph).context("the front end built an invalid graph")?;
    let compiled = args.precision.compile(graph, None, false)?;
    let graph = compiled.graph;
    if let Some((_, report)) = compiled.reports.iter().find(|(p, _)| *p == "autocast") {
        eprintln!(
            "precision: {} ({})",
            args.precision.precision, report.summary
        );
    }
    let params = model.load_params()?;
    let non_finite = model.check_finite(&params, args.strict)?;
    if !non_finite.is_empty() {
        eprintln!(
            "warning: NaN or Inf in {} (--strict refuses them)",
            castor_models::finite::describe_non_finite(&non_finite)
        );
    }
    let bind = |name: &str| batch.tensors.get(name).or_else(|| params.get(name));

    let mut times = Vec::with_capacity(args.repeat.max(1));
    let mut outputs = Vec::new();
    let on = match &device {
        Selected::Cpu => {
            let executor = CpuExecutor::new();
            for _ in 0..args.repeat.max(1) {
                let start = Instant::now();
                outputs = executor.run(&graph, &bind)?;
                times.push(start.elapsed().as_secs_f64());
            }
            "cpu"
        }
        Selected::Cuda(_) => {
            // Compiling kernels and uploading weights happen once, outside the timing.
            let mut runner = CudaGraphRunner::new(&graph, &|name| params.get(name).cloned())?;
            for _ in 0..args.repeat.max(1) {
                let start = Instant::now();
                outputs = runner.run(&batch.tensors)?;
                times.push(start.elapsed().as_secs_f64());
            }
            "cuda"
        }
        Selected::Emulated => {
            let mut runner = EmulatedGraphRunner::new(&graph, &|name| params.get(name).cloned())?;
            for _ in 0..args.repeat.max(1) {
                let start = Instant::now();
                outputs = runner.run(&batch.tensors)?;
                times.push(start.elapsed().as_secs_f64());
            }
            "the CUDA program on the emulator"
        }
    };
    times.sort_by(f64::total_cmp);
    let median_ms = times[times.len() / 2] * 1e3;

    let mut named: Vec<(String, Tensor)> = graph
        .outputs()
        .iter()
        .zip(outputs)
        .map(|(&v, t)| (graph.name(v).to_string(), to_f32(t)))
        .collect();
    if args.grad {
        named.extend(gradients(&args, &model, &batch, &params, &device)?);
    }
    let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_safetensors(&args.out, &refs)?;
    let grads = named.iter().filter(|(n, _)| n.starts_with("grad.")).count();
    for (name, t) in named.iter().filter(|(n, _)| !n.starts_with("grad.")) {
        if t.shape().rank() == 0 {
            println!("{name}: {:.6}", t.as_f32().map_or(f32::NAN, |v| v[0]));
        } else {
            println!("{name}: f32{}", t.shape());
        }
    }
    if grads > 0 {
        println!("grad.*: {grads} parameter gradients (f32)");
    }
    println!(
        "forward on {on}, {}, batch {} x seq {}: {median_ms:.2} ms (median of {})",
        args.precision.precision,
        batch.batch,
        batch.seq,
        times.len()
    );
    println!("wrote {}", args.out.display());
    Ok(())
}

/// The loss and every parameter's gradient under the objective, by the autodiff pass.
fn gradients(
    args: &Args,
    model: &Model,
    batch: &crate::batch::Batch,
    params: &std::collections::HashMap<String, Tensor>,
    device: &Selected,
) -> anyhow::Result<Vec<(String, Tensor)>> {
    let objective = match args.objective.as_str() {
        "auto" => Objective::auto(model),
        other => other.parse().map_err(CliError::InvalidInput)?,
    };
    let loss_graph = model.build_loss_graph(batch.batch, batch.seq, objective)?;
    let compiled = args.precision.compile(loss_graph, None, false)?.graph;
    let (train, report) = Autodiff::default().run(&compiled)?;
    eprintln!("objective: {objective}; {}", report.summary);
    let train = if args.remat.is_none() {
        train
    } else {
        // Parameters are the persistent bytes; the gradients are outputs, live to the end.
        let ctx = castor_passes::remat::RematContext {
            forward_nodes: compiled.num_nodes(),
            persistent_bytes: compiled
                .params()
                .map(|p| compiled.ty(p).size_bytes().unwrap_or(0) as u64)
                .sum(),
            stored_outputs: Default::default(),
            after: Vec::new(),
            gpu: Default::default(),
        };
        let out = castor_passes::remat::rematerialize(&train, args.remat, &ctx)?;
        eprintln!("{}", out.summary);
        out.graph
    };
    let labels = if objective.needs_labels() {
        Some(read_labels(
            &args.input,
            batch,
            objective,
            model.vocab_size(),
        )?)
    } else {
        None
    };
    let outputs = match device {
        Selected::Cpu => {
            let bind = |name: &str| {
                if name == "labels" {
                    return labels.as_ref();
                }
                batch.tensors.get(name).or_else(|| params.get(name))
            };
            CpuExecutor::new().run(&train, &bind)?
        }
        Selected::Cuda(_) | Selected::Emulated => {
            let mut inputs = batch.tensors.clone();
            if let Some(l) = &labels {
                inputs.insert("labels".into(), l.clone());
            }
            let bind = |name: &str| params.get(name).cloned();
            if matches!(device, Selected::Emulated) {
                EmulatedGraphRunner::new(&train, &bind)?.run(&inputs)?
            } else {
                CudaGraphRunner::new(&train, &bind)?.run(&inputs)?
            }
        }
    };
    Ok(train
        .outputs()
        .iter()
        .zip(outputs)
        .map(|(&v, t)| (train.name(v).to_string(), to_f32(t)))
        .collect())
}

/// Outputs are written as F32 whatever dtype the graph computed them in.
fn to_f32(t: Tensor) -> Tensor {
    match t.as_f32() {
        Some(v) if t.dtype() != castor_ir::DType::F32 => {
            Tensor::from_f32(castor_ir::DType::F32, t.shape().clone(), v.to_vec())
        }
        _ => t,
    }
}
