//! `castor generate`: continue a prompt with a causal model (GPT-2, LLaMA), token by token
//! with a KV cache, tokenized and detokenized with the model's own tokenizer.
//!
//! The text goes to stdout as it is generated (the prompt first); what ran and how fast to
//! stderr.

use crate::chat::ChatTemplate;
use crate::generate::{Generator, Sampling};
use crate::precision::PrecisionArgs;
use crate::rng::Rng;
use crate::tokenizer::TextTokenizer;
use crate::CliError;
use castor_models::Model;
use std::path::PathBuf;
use std::time::Instant;

/// Where `generate` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GenerateDevice {
    /// The CPU executor (the only one decoding runs on for now: the CUDA executor runs
    /// training plans and single graphs, not a graph per decoding step).
    Cpu,
}

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder (config.json + safetensors; a folder `castor train --save` wrote
    /// works) of a causal model, with its tokenizer files.
    pub model: PathBuf,
    /// The text to continue (with --chat: the user's message).
    #[arg(long, required_unless_present = "messages")]
    pub prompt: Option<String>,
    /// Chat with an instruct model: its chat template (`chat_template.jinja`, or
    /// `chat_template` in tokenizer_config.json, rendered as transformers'
    /// `apply_chat_template` renders it) turns the conversation into the prompt, with the
    /// assistant's generation prompt; only the reply is printed, and it ends at the model's
    /// end-of-turn token.
    #[arg(long, help_heading = "Chat")]
    pub chat: bool,
    /// With --chat: a system message before the user's.
    #[arg(long, value_name = "TEXT", requires = "chat", help_heading = "Chat")]
    pub system: Option<String>,
    /// With --chat: the conversation to continue, a JSON list of messages (`{"role": ...,
    /// "content": ...}`), instead of --prompt and --system.
    #[arg(long, value_name = "FILE.json", requires = "chat", conflicts_with_all = ["prompt", "system"], help_heading = "Chat")]
    pub messages: Option<PathBuf>,
    /// Tokens to generate at most (generation also stops at the tokenizer's end-of-text token
    /// and at the model's last position).
    #[arg(long, default_value_t = 50, value_name = "N")]
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 is greedy (always the most likely token). Giving any sampling
    /// flag samples; without one, decoding is as the checkpoint's generation_config.json says
    /// (greedy unless it sets `do_sample`), as transformers' `generate` does.
    #[arg(long, help_heading = "Sampling")]
    pub temperature: Option<f64>,
    /// Sample among the K most likely tokens only (0 = all; default 50).
    #[arg(long, value_name = "K", help_heading = "Sampling")]
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probability reaches P (1 = all; the default).
    #[arg(long, value_name = "P", help_heading = "Sampling")]
    pub top_p: Option<f64>,
    /// Seed of the sampler: the same seed, model and flags give the same text.
    #[arg(long, default_value_t = 0, help_heading = "Sampling")]
    pub seed: u64,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// A PEFT LoRA adapter folder to generate with (as `PeftModel.from_pretrained`).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Where to run: `cpu` only for now (decoding is not lowered for the CUDA executor).
    #[arg(long, value_enum, default_value_t = GenerateDevice::Cpu, help_heading = "Device")]
    pub device: GenerateDevice,
}

/// What a generation made.
#[derive(Clone, Debug)]
pub struct Generated {
    /// The prompt and its continuation, as the tokenizer decodes them.
    pub text: String,
    /// The new tokens.
    pub tokens: Vec<u32>,
    /// Why generation stopped (`end of text`, `--max-new-tokens reached`, ...).
    pub stopped: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // The prompt first (not in a chat: the reply alone), then the text as it grows; a token
    // that ends inside a UTF-8 character waits.
    let shown = shown_prompt(&args);
    out!("{shown}");
    let mut printed = String::new();
    let done = generate(&args, &mut |text| {
        if let Some(more) = text.strip_prefix(printed.as_str()) {
            if !more.is_empty() && !more.ends_with('\u{fffd}') {
                out!("{more}");
                printed = text.to_string();
            }
        }
    })?;
    let text = &done.text[shown.len()..];
    match text.strip_prefix(printed.as_str()) {
        Some(more) => outln!("{more}"),
        // The decoder rewrote what was printed (rare: a cleanup across tokens).
        None => outln!("\n{shown}{text}"),
    }
    Ok(())
}

/// What is printed before the continuation: the prompt, or nothing in a chat.
fn shown_prompt(args: &Args) -> &str {
    match (args.chat, &args.prompt) {
        (false, Some(p)) => p,
        _ => "",
    }
}

/// The conversation `--chat` continues: `--messages`, else `--system` and `--prompt`.
fn conversation(args: &Args) -> anyhow::Result<serde_json::Value> {
    if let Some(path) = &args.messages {
        let invalid = |what: String| {
            CliError::InvalidInput(format!("--messages `{}`: {what}", path.display()))
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| invalid(format!("cannot read: {e}")))?;
        let messages: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        crate::chat::as_messages(&messages).map_err(invalid)?;
        return Ok(messages);
    }
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    let prompt = args.prompt.clone().unwrap_or_default();
    messages.push(serde_json::json!({"role": "user", "content": prompt}));
    Ok(serde_json::Value::Array(messages))
}

/// Continues `args.prompt`; `on_text` sees the decoded continuation each time it grows.
pub fn generate(args: &Args, on_text: &mut dyn FnMut(&str)) -> anyhow::Result<Generated> {
    args.precision.refuse_delayed("generate")?;
    if let Some(t) = args.temperature.filter(|t| !(*t >= 0.0 && t.is_finite())) {
        return Err(CliError::InvalidInput(format!(
            "--temperature must be 0 (greedy) or positive, found {t}"
        ))
        .into());
    }
    if let Some(p) = args.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(CliError::InvalidInput(format!("--top-p must be in (0, 1], found {p}")).into());
    }
    let mut model = Model::load(&args.model)?;
    model.set_attention(args.precision.attention.into());
    crate::report::warn_unused(&model);
    if model.head() != castor_models::Head::CausalLm {
        return Err(CliError::InvalidInput(format!(
            "`{}` is a {}: generate continues text with a causal LM (GPT2LMHeadModel, \
             LlamaForCausalLM){}",
            args.model.display(),
            model.architecture(),
            if model.head() == castor_models::Head::MaskedLm {
                "; `castor eval --text` fills in its mask tokens"
            } else {
                ""
            }
        ))
        .into());
    }
    let tokenizer = TextTokenizer::for_model(&model)?;
    // A chat's prompt is the rendered conversation, tokenized without added framing (the
    // template writes it), as `apply_chat_template(tokenize=True)` does.
    let (text, framed) = match args.chat {
        true => (chat_prompt(args, &model)?, false),
        false => (args.prompt.clone().unwrap_or_default(), true),
    };
    let prompt: Vec<i64> = tokenizer
        .encode(&text, framed)?
        .into_iter()
        .map(i64::from)
        .collect();
    if prompt.is_empty() {
        return Err(CliError::InvalidInput("--prompt has no tokens".into()).into());
    }
    if prompt.len() >= model.max_positions() {
        return Err(CliError::InvalidInput(format!(
            "--prompt is {} tokens; the model has {} positions",
            prompt.len(),
            model.max_positions()
        ))
        .into());
    }
    let mut weights = model.load_params()?;
    let adapter = match &args.adapter {
        Some(dir) => Some(crate::adapter::load(dir)?),
        None => None,
    };
    if let Some(a) = &adapter {
        // Every adapter the pass adds must be in the folder: check against the prompt's graph.
        let graph = model.build_decode_graph(1, 0, prompt.len())?;
        let (graph, report) = crate::training::with_adapters(graph, Some(&a.lora))?;
        let wanted = crate::adapter::adapters_of(&graph);
        weights.extend(crate::adapter::initial(
            &wanted,
            Some(&a.tensors),
            args.adapter.as_deref(),
            0,
        )?);
        if let Some(r) = report {
            errln!("lora        {}", r.summary);
        }
    }
    errln!(
        "generate    {} on the CPU executor, {}; tokenizer {}; prompt {} tokens",
        model.architecture(),
        args.precision.precision,
        tokenizer.describe(),
        prompt.len()
    );
    let config = GenerationConfig::read(&args.model)?;
    let (sampling, said) = decoding(args, &config);
    errln!("decoding    {said}");
    let mut generator =
        Generator::new(&model, args.precision.clone()).with_adapters(adapter.map(|a| a.lora));
    let mut rng = Rng::new(args.seed);
    // transformers stops at any of generation_config.json's `eos_token_id`s; castor at the
    // tokenizer's end of text as well.
    let mut ends = config.eos_token_ids.clone();
    ends.extend(tokenizer.end_of_text());
    let mut ids: Vec<u32> = Vec::new();
    let start = Instant::now();
    let new = generator.generate(
        &prompt,
        args.max_new_tokens,
        &sampling,
        &mut rng,
        &|name| weights.get(name),
        &|t| ends.contains(&t),
        &mut |t| {
            ids.push(t);
            on_text(&tokenizer.decode(&ids));
        },
    )?;
    let text = tokenizer.decode(&ids);
    let seconds = start.elapsed().as_secs_f64();
    let why = if new.len() == args.max_new_tokens {
        "--max-new-tokens reached".to_string()
    } else if generator.len() >= model.max_positions() {
        format!("the model's {} positions are full", model.max_positions())
    } else {
        "end of text".to_string()
    };
    errln!(
        "generated   {} tokens in {seconds:.2} s ({:.1} tokens/s); stopped: {why}",
        new.len(),
        new.len() as f64 / seconds.max(1e-9)
    );
    Ok(Generated {
        text: format!("{}{text}", shown_prompt(args)),
        tokens: new,
        stopped: why,
    })
}

/// The prompt text of a chat: the conversation through the model's chat template, with the
/// generation prompt.
fn chat_prompt(args: &Args, model: &Model) -> anyhow::Result<String> {
    let dir = model
        .config()
        .file
        .parent()
        .unwrap_or(std::path::Path::new("."));
    let template = ChatTemplate::find(dir)?.ok_or_else(|| {
        CliError::InvalidInput(format!(
            "--chat: `{}` has no chat template (chat_template.jinja, or chat_template in \
             tokenizer_config.json); a base model continues text: leave out --chat",
            dir.display()
        ))
    })?;
    let messages = conversation(args)?;
    let rendered = template.render(&messages, true)?;
    errln!(
        "chat        {} message(s) through the chat template of `{}`",
        messages.as_array().map_or(0, Vec::len),
        template.origin().display()
    );
    Ok(rendered.text)
}

/// What a checkpoint's generation_config.json says about decoding (the fields castor reads).
#[derive(Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// Whether the file exists.
    pub found: bool,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    /// `eos_token_id`: one id or a list (LLaMA-3's instruct models list two).
    pub eos_token_ids: Vec<u32>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`, if there is one; a malformed one is an error naming
    /// the field.
    pub fn read(dir: &std::path::Path) -> anyhow::Result<GenerationConfig> {
        let path = dir.join("generation_config.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(GenerationConfig::default());
        };
        let bad = |what: String| CliError::InvalidInput(format!("`{}`: {what}", path.display()));
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let field = |key: &str| json.get(key).filter(|v| !v.is_null());
        let number = |key: &str| -> anyhow::Result<Option<f64>> {
            field(key)
                .map(|v| {
                    v.as_f64()
                        .ok_or_else(|| bad(format!("`{key}`: expected a number, found {v}")))
                })
                .transpose()
                .map_err(Into::into)
        };
        let id = |v: &serde_json::Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad(format!("`eos_token_id`: expected token ids, found {v}")))
        };
        let eos_token_ids = match field("eos_token_id") {
            None => Vec::new(),
            Some(serde_json::Value::Array(ids)) => ids.iter().map(id).collect::<Result<_, _>>()?,
            Some(v) => vec![id(v)?],
        };
        let do_sample =
            match field("do_sample") {
                None => None,
                Some(v) => Some(v.as_bool().ok_or_else(|| {
                    bad(format!("`do_sample`: expected true or false, found {v}"))
                })?),
            };
        Ok(GenerationConfig {
            found: true,
            do_sample,
            temperature: number("temperature")?,
            top_k: number("top_k")?.map(|k| k.max(0.0) as usize),
            top_p: number("top_p")?,
            eos_token_ids,
        })
    }
}

/// The sampling `generate` uses, and where each setting came from, as transformers decides:
/// the command line first (any sampling flag samples), then generation_config.json (which
/// samples only with `do_sample`), then transformers' defaults (greedy; when sampling,
/// temperature 1, top-k 50, top-p 1).
fn decoding(args: &Args, config: &GenerationConfig) -> (Sampling, String) {
    let asked = args.temperature.is_some() || args.top_k.is_some() || args.top_p.is_some();
    if !asked && config.do_sample != Some(true) {
        let why = match (config.found, config.do_sample) {
            (_, Some(false)) => "generation_config.json: do_sample false",
            (true, _) => "transformers' default: generation_config.json sets no do_sample",
            (false, _) => "transformers' default: no generation_config.json",
        };
        return (Sampling::GREEDY, format!("greedy ({why})"));
    }
    let pick = |flag: Option<f64>, from_file: Option<f64>, default: f64, name: &str| match (
        flag, from_file,
    ) {
        (Some(v), _) => (v, format!("{name} {v} (--{})", name.replace('_', "-"))),
        (None, Some(v)) => (v, format!("{name} {v} (generation_config.json)")),
        (None, None) => (default, format!("{name} {default} (default)")),
    };
    let (temperature, t) = pick(args.temperature, config.temperature, 1.0, "temperature");
    let (top_k, k) = pick(
        args.top_k.map(|k| k as f64),
        config.top_k.map(|k| k as f64),
        50.0,
        "top_k",
    );
    let (top_p, p) = pick(args.top_p, config.top_p, 1.0, "top_p");
    let why = if asked {
        "a sampling flag was given".to_string()
    } else {
        "generation_config.json: do_sample true".to_string()
    };
    (
        Sampling {
            temperature,
            top_k: top_k as usize,
            top_p,
        },
        format!("sampling ({why}): {t}, {k}, {p}"),
    )
}
