//! LoRA adapters in PEFT's format: `adapter_config.json` and `adapter_model.safetensors`,
//! as `peft.PeftModel.from_pretrained(base, DIR)` reads them and `save_pretrained` writes
//! them. Tensor names are PEFT's: `base_model.model.<checkpoint name of the module>.lora_A.weight`
//! (castor's parameter names are the checkpoint's, so only the prefix differs).

use crate::CliError;
use castor_ir::{LoraBase, LoraSettings, Tensor};
use castor_models::{write_atomically, write_safetensors, SafetensorsFile};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

pub const CONFIG: &str = "adapter_config.json";
pub const WEIGHTS: &str = "adapter_model.safetensors";
/// PEFT's prefix of every tensor name: the `PeftModel`'s `base_model` (the LoRA model) and
/// its `model` (the wrapped transformers model).
const PREFIX: &str = "base_model.model.";

/// What PEFT's config records beside the adapters' shape.
#[derive(Clone, Debug)]
pub struct AdapterBase {
    /// The base checkpoint, as given (PEFT's `base_model_name_or_path`).
    pub path: String,
    /// PEFT's `task_type`: `CAUSAL_LM`, `SEQ_CLS`, or none (a base model, BERT's MLM).
    pub task_type: Option<&'static str>,
    /// GPT-2's `Conv1D` stores weights `[in, out]`: PEFT's `fan_in_fan_out`.
    pub fan_in_fan_out: bool,
}

impl AdapterBase {
    /// The base `model`, loaded from `path`.
    pub fn of(model: &castor_models::Model, path: &Path) -> AdapterBase {
        use castor_models::Family;
        let task_type = match model.architecture() {
            a if a.ends_with("ForSequenceClassification") => Some("SEQ_CLS"),
            a if a.ends_with("LMHeadModel") || a.ends_with("ForCausalLM") => Some("CAUSAL_LM"),
            _ => None,
        };
        AdapterBase {
            path: path.display().to_string(),
            task_type,
            fan_in_fan_out: model.family() == Family::Gpt2,
        }
    }
}

/// Writes `dir/adapter_config.json` and `dir/adapter_model.safetensors` (the adapters in
/// F32, under PEFT's names), each atomically. `dir` exists.
pub fn save(
    dir: &Path,
    lora: &LoraSettings,
    base: &AdapterBase,
    adapters: &[(&str, &Tensor)],
) -> anyhow::Result<()> {
    let config = json!({
        "peft_type": "LORA",
        "task_type": base.task_type,
        "base_model_name_or_path": base.path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": lora.targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": base.fan_in_fan_out,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "use_rslora": false,
        "use_dora": false,
    });
    let named: Vec<(String, &Tensor)> = adapters
        .iter()
        .map(|(n, t)| (format!("{PREFIX}{n}"), *t))
        .collect();
    let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    write_atomically(
        &dir.join(CONFIG),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    write_safetensors(&dir.join(WEIGHTS), &refs)?;
    Ok(())
}

/// A PEFT LoRA adapter folder, read.
pub struct Loaded {
    pub lora: LoraSettings,
    /// The adapters under castor's parameter names (F32).
    pub tensors: HashMap<String, Tensor>,
    /// The adapted weights are stored `[in, out]` (GPT-2's Conv1D).
    pub fan_in_fan_out: bool,
}

/// Reads a PEFT LoRA adapter folder: its settings and its tensors under castor's parameter
/// names. Refuses what castor does not run (another PEFT method, DoRA, rsLoRA, trained
/// biases, a regular-expression `target_modules`), saying which field.
pub fn load(dir: &Path) -> anyhow::Result<Loaded> {
    let bad = |m: String| CliError::InvalidInput(format!("--adapter `{}`: {m}", dir.display()));
    let path = dir.join(CONFIG);
    let text =
        std::fs::read_to_string(&path).map_err(|e| bad(format!("cannot read {CONFIG}: {e}")))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("{CONFIG} is not JSON: {e}")))?;
    let field = |k: &str| config.get(k).filter(|v| !v.is_null());
    match field("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => {
            return Err(bad(format!(
                "{CONFIG}: peft_type is {}, castor runs LORA adapters",
                other.map_or("missing".into(), |s| format!("`{s}`"))
            ))
            .into())
        }
    }
    for (key, unsupported) in [("use_dora", "DoRA"), ("use_rslora", "rsLoRA's scaling")] {
        if field(key).and_then(Value::as_bool) == Some(true) {
            return Err(bad(format!(
                "{CONFIG}: {key} is true; castor does not run {unsupported}"
            ))
            .into());
        }
    }
    // Per-module ranks and scales, layer subsets and exclusions change which adapters exist
    // or how they scale; castor applies none of them, so such a config is refused.
    let set = |k: &str| match field(k) {
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Bool(b)) => *b,
        Some(_) => true,
        None => false,
    };
    for key in [
        "rank_pattern",
        "alpha_pattern",
        "layers_to_transform",
        "exclude_modules",
        "target_parameters",
        "lora_bias",
        "modules_to_save",
    ] {
        if set(key) {
            return Err(bad(format!(
                "{CONFIG}: `{key}` is set; castor does not apply it"
            ))
            .into());
        }
    }
    if let Some(b) = field("bias")
        .and_then(Value::as_str)
        .filter(|b| *b != "none")
    {
        return Err(bad(format!(
            "{CONFIG}: bias is `{b}`; castor's adapters train no biases (bias `none`)"
        ))
        .into());
    }
    let rank = field("r")
        .and_then(Value::as_u64)
        .filter(|&r| r > 0)
        .ok_or_else(|| bad(format!("{CONFIG}: r must be a positive integer")))?
        as usize;
    let alpha = field("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
    let targets: Vec<String> = match field("target_modules") {
        Some(Value::Array(list)) => list
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad(format!("{CONFIG}: target_modules holds a non-string")))
            })
            .collect::<Result<_, _>>()?,
        Some(Value::String(s)) if s == "all-linear" => vec![s.clone()],
        Some(Value::String(s)) => {
            return Err(bad(format!(
                "{CONFIG}: target_modules is the regular expression `{s}`; castor takes a list \
                 of module names (or all-linear)"
            ))
            .into())
        }
        _ => return Err(bad(format!("{CONFIG}: target_modules is missing")).into()),
    };
    let file = SafetensorsFile::open(dir.join(WEIGHTS))
        .map_err(|e| bad(format!("cannot read {WEIGHTS}: {e}")))?;
    let mut tensors = HashMap::new();
    for name in file.names() {
        let ours = name.strip_prefix(PREFIX).unwrap_or(name);
        if !LoraSettings::is_adapter_tensor(ours) {
            return Err(bad(format!(
                "{WEIGHTS} holds `{name}`, which is no LoRA A or B weight"
            ))
            .into());
        }
        let t = file
            .tensor_f32(name)
            .map_err(|e| bad(format!("{WEIGHTS}: {e}")))?;
        tensors.insert(ours.to_string(), t);
    }
    Ok(Loaded {
        lora: LoraSettings {
            rank,
            alpha,
            targets,
            base: LoraBase::Compute,
        },
        tensors,
        fan_in_fan_out: field("fan_in_fan_out").and_then(Value::as_bool) == Some(true),
    })
}

/// The adapter parameters of a graph the `lora` pass rewrote (`origin=adapter`), each with its
/// type.
pub fn adapters_of(graph: &castor_ir::Graph) -> Vec<(String, castor_ir::TensorType)> {
    graph
        .with_origin(castor_ir::Origin::Adapter)
        .map(|p| (graph.name(p).to_string(), graph.ty(p).clone()))
        .collect()
}

/// The values of `adapters` (a plan's adapter parameters), from `--adapter DIR` (every one
/// must be there) or initialized as PEFT initializes them (`seed` per tensor).
pub fn initial(
    adapters: &[(String, castor_ir::TensorType)],
    loaded: Option<&HashMap<String, Tensor>>,
    from: Option<&Path>,
    seed: u64,
) -> anyhow::Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (name, ty) in adapters {
        let t = match loaded {
            Some(tensors) => tensors.get(name).cloned().ok_or_else(|| {
                CliError::InvalidInput(format!(
                    "--adapter `{}`: {WEIGHTS} has no `{PREFIX}{name}` for this model's \
                     adapters (r and target_modules must match the model)",
                    from.map(|p| p.display().to_string()).unwrap_or_default()
                ))
            })?,
            None => castor_models::init_adapter(name, &ty.shape, seed),
        };
        out.insert(name.clone(), t);
    }
    Ok(out)
}
