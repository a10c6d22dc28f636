//! `--sample-prompts FILE`: a few answers at each evaluation, so a fine-tuning run shows what
//! the model says as well as its loss. Each line of the file is a prompt; a model with a chat
//! template answers it as a user message (the template's generation prompt, the answer ending
//! at its end-of-turn token, as `castor generate --chat`), a model without one continues it
//! as text. Decoding is greedy from the run's current weights (KV-cache decoding on the
//! host copy, as `castor generate` runs it), so the same weights give the same answers.

use crate::chat::ChatTemplate;
use crate::generate::{Generator, Sampling};
use crate::precision::PrecisionArgs;
use crate::rng::Rng;
use crate::tokenizer::TextTokenizer;
use crate::CliError;
use castor_ir::LoraSettings;
use castor_models::Model;
use castor_runtime::PlanRunner;
use std::path::Path;

/// The prompts and what answering them needs.
pub struct Samples {
    model: Model,
    precision: PrecisionArgs,
    tokenizer: TextTokenizer,
    template: Option<ChatTemplate>,
    prompts: Vec<String>,
    max_new: usize,
    lora: Option<LoraSettings>,
}

/// One prompt and the answer at an evaluation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub prompt: String,
    pub answer: String,
}

impl Samples {
    /// The prompts of `path` for the causal LM `model` (loaded again from `model_path`, so the
    /// samples own what they decode with).
    pub fn open(
        path: &Path,
        model_path: &Path,
        precision: PrecisionArgs,
        lora: Option<LoraSettings>,
        max_new: usize,
    ) -> anyhow::Result<Samples> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            CliError::InvalidInput(format!("--sample-prompts `{}`: {e}", path.display()))
        })?;
        let prompts: Vec<String> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        if prompts.is_empty() {
            return Err(CliError::InvalidInput(format!(
                "--sample-prompts `{}` holds no prompt (one per line)",
                path.display()
            ))
            .into());
        }
        let model = Model::load(model_path)?;
        if model.head() != castor_models::Head::CausalLm {
            return Err(CliError::InvalidInput(format!(
                "--sample-prompts: {} is not a causal LM, which answers prompts",
                model.architecture()
            ))
            .into());
        }
        let tokenizer = TextTokenizer::for_model(&model)?;
        let dir = model.config().file.parent().unwrap_or(Path::new("."));
        let template = ChatTemplate::find(dir)?;
        Ok(Samples {
            model,
            precision,
            tokenizer,
            template,
            prompts,
            max_new,
            lora,
        })
    }

    /// Whether prompts go through a chat template.
    pub fn chat(&self) -> bool {
        self.template.is_some()
    }

    /// Each prompt's greedy answer with the weights `host` holds.
    pub fn answer(&self, host: &PlanRunner) -> anyhow::Result<Vec<Sample>> {
        let mut ends: Vec<u32> = self.tokenizer.end_of_text().into_iter().collect();
        let config_dir = self.model.config().file.parent().unwrap_or(Path::new("."));
        ends.extend(crate::commands::generate::GenerationConfig::read(config_dir)?.eos_token_ids);
        self.prompts
            .iter()
            .map(|prompt| {
                let (text, framed) = match &self.template {
                    Some(t) => {
                        let messages = serde_json::json!([{"role": "user", "content": prompt}]);
                        (t.render(&messages, true)?.text, false)
                    }
                    None => (prompt.clone(), true),
                };
                let ids: Vec<i64> = self
                    .tokenizer
                    .encode(&text, framed)?
                    .into_iter()
                    .map(i64::from)
                    .collect();
                let room = self.model.max_positions().saturating_sub(ids.len());
                let mut generator = Generator::new(&self.model, self.precision.clone())
                    .with_adapters(self.lora.clone());
                let new = generator.generate(
                    &ids,
                    self.max_new.min(room),
                    &Sampling::GREEDY,
                    &mut Rng::new(0),
                    &|name| host.state(name),
                    &|t| ends.contains(&t),
                    &mut |_| {},
                )?;
                Ok(Sample {
                    prompt: prompt.clone(),
                    answer: self.tokenizer.decode(&new),
                })
            })
            .collect()
    }
}
