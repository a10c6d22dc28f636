//! `castor eval`: one forward pass on a batch from a safetensors file; the interface by which
//! castor is compared with PyTorch, tensor by tensor.

use crate::batch::{read_batch, read_labels, Batch};
use crate::precision::PrecisionArgs;
use crate::tokenizer::TextTokenizer;
use crate::CliError;
use anyhow::Context;
use castor_ir::{DType, Tensor};
use castor_models::{write_safetensors, Model, Objective, SafetensorsFile};
use castor_passes::{Autodiff, Pass};
use castor_runtime::cpu::CpuExecutor;
use castor_runtime::cuda::{CudaGraphRunner, EmulatedGraphRunner};
use castor_runtime::ExecutorKind;
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
    #[arg(long, required_unless_present = "text", conflicts_with = "text")]
    pub input: Option<PathBuf>,
    /// Text to run instead of a batch file, tokenized with the model's tokenizer (framed as
    /// it frames a text: `[CLS] ... [SEP]` for BERT). Prints the loss and the next-token
    /// predictions of a causal LM, or the predictions at each mask token of a masked LM.
    #[arg(long)]
    pub text: Option<String>,
    /// Where to write the outputs (F32): `logits` for models with an LM head, else
    /// `last_hidden_state` (and `pooler_output` for BERT with a pooler).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    #[command(flatten)]
    pub classifier: crate::classifier::ClassifierArgs,
    /// A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) to run
    /// the model with: its adapters are added beside their target products, as
    /// `PeftModel.from_pretrained` does (with --grad, their gradients are written too).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
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

/// The batch of `--text`: the tokens as one row.
fn text_batch(model: &Model, tokenizer: &TextTokenizer, text: &str) -> anyhow::Result<Batch> {
    let ids: Vec<i64> = tokenizer
        .encode(text, true)?
        .into_iter()
        .map(i64::from)
        .collect();
    let t = ids.len();
    if t == 0 {
        return Err(CliError::InvalidInput("--text: the text has no tokens".into()).into());
    }
    if t > model.max_positions() {
        return Err(CliError::InvalidInput(format!(
            "--text is {t} tokens, more than the model's {} positions",
            model.max_positions()
        ))
        .into());
    }
    let tensors = model
        .input_names()
        .iter()
        .map(|&name| {
            let values = match name {
                "input_ids" => ids.clone(),
                "attention_mask" => vec![1; t],
                _ => vec![0; t],
            };
            (
                name.to_string(),
                Tensor::from_i64(DType::I64, [1, t], values),
            )
        })
        .collect();
    Ok(Batch {
        batch: 1,
        seq: t,
        tensors,
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(out) = &args.out {
        crate::outputs::check_file("--out", out)?;
    }
    let input = match &args.input {
        Some(path) => Some(SafetensorsFile::open(path)?),
        None => None,
    };
    let e = evaluate(&args, input.as_ref())?;
    if let Some(out) = &args.out {
        let refs: Vec<(&str, &Tensor)> = e.outputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
        write_safetensors(out, &refs)?;
    }
    let grads = e
        .outputs
        .iter()
        .filter(|(n, _)| n.starts_with("grad."))
        .count();
    for (name, t) in e.outputs.iter().filter(|(n, _)| !n.starts_with("grad.")) {
        if t.shape().rank() == 0 {
            outln!("{name}: {:.6}", t.as_f32().map_or(f32::NAN, |v| v[0]));
        } else {
            outln!("{name}: f32{}", t.shape());
        }
    }
    if grads > 0 {
        outln!("grad.*: {grads} parameter gradients (f32)");
    }
    outln!(
        "forward on {}, {}, batch {} x seq {}: {:.2} ms (median of {})",
        e.device,
        args.precision.precision,
        e.batch,
        e.seq,
        e.median_ms,
        e.runs
    );
    if let Some(out) = &args.out {
        outln!("wrote {}", out.display());
    }
    Ok(())
}

/// What one evaluation produced.
pub struct Evaluation {
    /// The graph's outputs, then (with `--grad`) `loss` and `grad.<name>`, all F32.
    pub outputs: Vec<(String, Tensor)>,
    /// Where the forward ran, for people.
    pub device: &'static str,
    pub batch: usize,
    pub seq: usize,
    /// The median forward time over `runs` runs.
    pub median_ms: f64,
    pub runs: usize,
}

/// Runs the evaluation `args` ask for on the batch in `input` (a safetensors file, or one
/// built in memory) or on `--text`; writes nothing.
pub fn evaluate(args: &Args, input: Option<&SafetensorsFile>) -> anyhow::Result<Evaluation> {
    args.precision.refuse_delayed("eval")?;
    let device = crate::device::select(args.device)?;

    let mut model = args.classifier.load(&args.model)?;
    model.set_attention(args.precision.attention.into());
    crate::report::warn_unused(&model);
    let tokenizer = match &args.text {
        Some(_) => Some(TextTokenizer::for_model(&model)?),
        None => None,
    };
    let mut batch = match (input, &args.text, &tokenizer) {
        (Some(input), _, _) => read_batch(input, model.input_names(), model.vocab_size())?,
        (None, Some(text), Some(tok)) => text_batch(&model, tok, text)?,
        _ => return Err(CliError::InvalidInput("give --input FILE or --text TEXT".into()).into()),
    };
    model.derive_inputs(&mut batch.tensors)?;
    let adapter = match &args.adapter {
        Some(dir) => Some(crate::adapter::load(dir)?),
        None => None,
    };
    let lora = adapter.as_ref().map(|a| &a.lora);
    let graph = model.build_graph(batch.batch, batch.seq)?;
    castor_ir::verify(&graph).context("the front end built an invalid graph")?;
    let (graph, lora_report) = crate::training::with_adapters(graph, lora)?;
    if let Some(r) = &lora_report {
        errln!("lora: {}", r.summary);
    }
    let compiled = args.precision.compile(graph, Some(&model), None, false)?;
    let graph = compiled.graph;
    if let Some((_, report)) = compiled.reports.iter().find(|(p, _)| *p == "autocast") {
        errln!(
            "precision: {} ({})",
            args.precision.precision,
            report.summary
        );
    }
    let mut params = model.load_params()?;
    if let Some(crate::adapter::Loaded { tensors, .. }) = &adapter {
        let wanted = crate::adapter::adapters_of(&graph);
        params.extend(crate::adapter::initial(
            &wanted,
            Some(tensors),
            args.adapter.as_deref(),
            0,
        )?);
    }
    let non_finite = model.check_finite(&params, args.strict)?;
    if !non_finite.is_empty() {
        errln!(
            "warning: NaN or Inf in {} (--strict refuses them)",
            castor_models::finite::describe_non_finite(&non_finite)
        );
    }
    let bind = |name: &str| batch.tensors.get(name).or_else(|| params.get(name));

    let mut times = Vec::with_capacity(args.repeat.max(1));
    let mut outputs = Vec::new();
    let on = match device {
        ExecutorKind::Cpu => {
            let executor = CpuExecutor::new();
            for _ in 0..args.repeat.max(1) {
                let start = Instant::now();
                outputs = executor.run(&graph, &bind)?;
                times.push(start.elapsed().as_secs_f64());
            }
            "cpu"
        }
        ExecutorKind::Cuda => {
            // Compiling kernels and uploading weights happen once, outside the timing.
            let mut runner = CudaGraphRunner::new(&graph, &|name| params.get(name).cloned())?;
            for _ in 0..args.repeat.max(1) {
                let start = Instant::now();
                outputs = runner.run(&batch.tensors)?;
                times.push(start.elapsed().as_secs_f64());
            }
            "cuda"
        }
        ExecutorKind::Emulate => {
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
    if let (Some(tok), Some(ids)) = (&tokenizer, batch.tensors.get("input_ids")) {
        let ids: Vec<u32> = ids
            .as_i64()
            .unwrap_or(&[])
            .iter()
            .map(|&i| i as u32)
            .collect();
        let logits = named.iter().find(|(n, _)| n == "logits").map(|(_, t)| t);
        crate::text_eval::print(&model, tok, &ids, logits);
    }
    if args.grad {
        let objective = match args.objective.as_str() {
            "auto" => Objective::auto(&model),
            other => other.parse().map_err(CliError::InvalidInput)?,
        };
        let labels = match (input, objective.needs_labels()) {
            (_, false) => None,
            (Some(input), true) => Some(read_labels(input, &batch, objective, &model)?),
            (None, true) if objective == Objective::Lm => batch.tensors.get("input_ids").cloned(),
            (None, true) => {
                return Err(CliError::InvalidInput(format!(
                    "--grad with --text: objective `{objective}` needs labels; give a batch \
                     with `labels` (--input)"
                ))
                .into())
            }
        };
        let loss_graph = model.build_loss_graph(batch.batch, batch.seq, objective)?;
        let (loss_graph, _) = crate::training::with_adapters(loss_graph, lora)?;
        errln!("objective: {objective}");
        named.extend(gradients(
            args, &model, &batch, loss_graph, labels, &params, device,
        )?);
    }
    Ok(Evaluation {
        outputs: named,
        device: on,
        batch: batch.batch,
        seq: batch.seq,
        median_ms,
        runs: times.len(),
    })
}

/// The loss of `loss_graph` and every parameter's gradient, by the autodiff pass.
fn gradients(
    args: &Args,
    model: &Model,
    batch: &crate::batch::Batch,
    loss_graph: castor_ir::Graph,
    labels: Option<Tensor>,
    params: &std::collections::HashMap<String, Tensor>,
    device: ExecutorKind,
) -> anyhow::Result<Vec<(String, Tensor)>> {
    let compiled = args
        .precision
        .compile(loss_graph, Some(model), None, false)?
        .graph;
    let (train, report) = Autodiff::default().run(&compiled)?;
    errln!("{}", report.summary);
    let train = if args.remat.is_none() {
        train
    } else {
        // Parameters are the persistent bytes; the gradients are outputs, live to the end.
        let ctx = castor_passes::remat::RematContext::of_graph(
            compiled.num_nodes(),
            compiled
                .params()
                .map(|p| compiled.ty(p).size_bytes().unwrap_or(0) as u64)
                .sum(),
            Default::default(),
        );
        let out = castor_passes::remat::rematerialize(&train, args.remat, &ctx)?;
        errln!("{}", out.summary);
        out.graph
    };
    let outputs = match device {
        ExecutorKind::Cpu => {
            let bind = |name: &str| {
                if name == "labels" {
                    return labels.as_ref();
                }
                batch.tensors.get(name).or_else(|| params.get(name))
            };
            CpuExecutor::new().run(&train, &bind)?
        }
        ExecutorKind::Cuda | ExecutorKind::Emulate => {
            let mut inputs = batch.tensors.clone();
            if let Some(l) = &labels {
                inputs.insert("labels".into(), l.clone());
            }
            let bind = |name: &str| params.get(name).cloned();
            if matches!(device, ExecutorKind::Emulate) {
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
