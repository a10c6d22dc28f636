//! `castor merge`: a base checkpoint with a LoRA adapter folded into its weights, written as
//! a full Hugging Face folder (PEFT's `merge_and_unload` followed by `save_pretrained`).

use crate::adapter;
use crate::training::checkpoint::{CheckpointFiles, MODEL_WEIGHTS};
use crate::CliError;
use anyhow::Context;
use castor_ir::{DType, Tensor};
use castor_models::{write_atomically, write_safetensors, Model};
use std::collections::HashMap;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The base checkpoint folder the adapter was trained on.
    pub model: PathBuf,
    /// The PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors).
    #[arg(long, value_name = "DIR")]
    pub adapter: PathBuf,
    /// Where to write the merged checkpoint (a folder: config.json, model.safetensors and the
    /// base's tokenizer files).
    #[arg(long, short, value_name = "DIR")]
    pub out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::outputs::check_folder("--out", &args.out)?;
    let model = Model::load(&args.model)?;
    let adapter = adapter::load(&args.adapter)?;
    let lora = &adapter.lora;
    let mut params = model.load_params()?;
    let merged = fold(
        &mut params,
        &adapter.tensors,
        lora.scaling(),
        adapter.fan_in_fan_out,
    )?;
    let config_json = std::fs::read_to_string(&model.config().file)
        .with_context(|| format!("cannot read `{}`", model.config().file.display()))?;
    let files = CheckpointFiles::new(config_json, model.config().file.parent());
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create `{}`", args.out.display()))?;
    write_atomically(&args.out.join("config.json"), files.config_json.as_bytes())?;
    for (name, bytes) in &files.extras {
        write_atomically(&args.out.join(name), bytes)?;
    }
    let mut names: Vec<&String> = params.keys().collect();
    names.sort();
    let refs: Vec<(&str, &Tensor)> = names.iter().map(|n| (n.as_str(), &params[*n])).collect();
    write_safetensors(&args.out.join(MODEL_WEIGHTS), &refs)?;
    outln!(
        "merged      {merged} adapted weight(s) of {} (r={}, scale {})",
        args.model.display(),
        lora.rank,
        lora.scaling()
    );
    outln!(
        "wrote       {} (F32 weights; from_pretrained loads it without PEFT)",
        args.out.display()
    );
    Ok(())
}

/// Adds `scale · B·A` to each adapted weight (transposed for a `[in, out]` weight, PEFT's
/// `fan_in_fan_out`), in F32; returns how many weights changed. Every adapter must pair with
/// a weight of the model, shaped as its A and B say.
pub fn fold(
    params: &mut HashMap<String, Tensor>,
    adapters: &HashMap<String, Tensor>,
    scale: f64,
    fan_in_fan_out: bool,
) -> anyhow::Result<usize> {
    let mut modules: Vec<&str> = adapters
        .keys()
        .filter_map(|n| n.strip_suffix(".lora_A.weight"))
        .collect();
    modules.sort();
    for module in &modules {
        let (a, b) = (
            &adapters[&format!("{module}.lora_A.weight")],
            adapters
                .get(&format!("{module}.lora_B.weight"))
                .ok_or_else(|| {
                    CliError::InvalidInput(format!("the adapter has no lora_B for `{module}`"))
                })?,
        );
        let weight = format!("{module}.weight");
        let w = params.get(&weight).ok_or_else(|| {
            CliError::InvalidInput(format!(
                "the adapter has `{module}`, but the model has no `{weight}`"
            ))
        })?;
        let (ad, bd, wd) = (a.shape().dims(), b.shape().dims(), w.shape().dims());
        let (r, inner, outer) = (ad[0], ad[1], bd[0]);
        let expected = if fan_in_fan_out {
            [inner, outer]
        } else {
            [outer, inner]
        };
        if bd.len() != 2 || bd[1] != r || wd != expected {
            return Err(CliError::InvalidInput(format!(
                "`{module}`: lora_A {:?} and lora_B {:?} do not fit the weight {:?}",
                ad, bd, wd
            ))
            .into());
        }
        let (av, bv) = (f32s(a)?, f32s(b)?);
        let mut wv = f32s(w)?.to_vec();
        for o in 0..outer {
            for i in 0..inner {
                let delta: f64 = (0..r)
                    .map(|k| f64::from(bv[o * r + k]) * f64::from(av[k * inner + i]))
                    .sum();
                let at = if fan_in_fan_out {
                    i * outer + o
                } else {
                    o * inner + i
                };
                wv[at] = (f64::from(wv[at]) + scale * delta) as f32;
            }
        }
        let shape = w.shape().clone();
        params.insert(weight, Tensor::from_f32(DType::F32, shape, wv));
    }
    Ok(modules.len())
}

fn f32s(t: &Tensor) -> anyhow::Result<&[f32]> {
    t.as_f32().ok_or_else(|| {
        CliError::InvalidInput(format!("a {} tensor is not a float", t.dtype())).into()
    })
}
