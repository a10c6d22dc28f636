//! The precision flags `compile`, `eval`, `train` and `generate` share, and running the
//! precision passes.

use crate::CliError;
use anyhow::Context;
use castor_ir::{Graph, Op, TrainSettings};
use castor_models::Model;
use castor_passes::{
    precision_pipeline, PipelineOutput, Policy, PolicyFileFormat, Precision, Target,
};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(clap::Args, Clone, Debug, Serialize, Deserialize)]
#[command(next_help_heading = "Precision policy")]
pub struct PrecisionArgs {
    /// Precision policy: fp32 (also float32), tf32 (TF32 contractions), bf16 (also bfloat16),
    /// fp16 (also float16, half), fp8 (also fp8:tensorwise: bf16, with the transformer
    /// layers' products on FP8 operands scaled per tensor by its own amax) or fp8:delayed
    /// (the activations and gradients scaled from amax histories kept as plan state); any
    /// case.
    #[arg(long, default_value = "fp32", value_parser = parse_precision)]
    #[serde(with = "precision_name")]
    pub precision: Precision,
    /// Policy file (TOML, or JSON by its .json extension): op-list edits and name rules.
    #[arg(long, value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// Keep nodes whose name, or whose parameter's name, matches GLOB in F32 (repeatable). A
    /// glob that matches nothing is an error.
    #[arg(long = "keep-f32", value_name = "GLOB")]
    pub keep_f32: Vec<String>,
    /// Force nodes matching GLOB into the policy's low-precision dtype (repeatable). A glob
    /// that matches nothing is an error.
    #[arg(long = "force-low", value_name = "GLOB")]
    pub force_low: Vec<String>,
    /// Under --precision fp8: keep the products whose name, or whose weight's name, matches
    /// GLOB in BF16 (repeatable). A glob that matches no product by a weight is an error.
    #[arg(long = "keep-bf16", value_name = "GLOB")]
    #[serde(default)]
    pub keep_bf16: Vec<String>,
    /// Under --precision fp8: keep the first and the last transformer layer's products in
    /// BF16, as some FP8 recipes do.
    #[arg(long = "fp8-skip-first-last")]
    #[serde(default)]
    pub fp8_skip_first_last: bool,
    /// Under --precision fp8:delayed: how many past amaxes each cast's scale is taken from
    /// (the largest of them), as Transformer Engine's amax_history_len [default: 16].
    #[arg(long = "amax-history", value_name = "N")]
    #[serde(default)]
    pub amax_history: Option<usize>,
    /// How the attention core is built: fused, one FlashAttention-2 op (no [.., T, S]
    /// tensor; the backward recomputes the probabilities), or `eager` (q k^T, scale, masked
    /// softmax, p v: a [.., T, S] score tensor per layer), as transformers'
    /// attn_implementation chooses. Fused, on CUDA: `auto` (the default) runs cuDNN's fused
    /// attention where it loads and expresses the op, else castor's kernels; `fused` castor's
    /// kernels; `cudnn` cuDNN's (an error where cuDNN is missing or cannot express the op).
    /// The CPU executor computes the same op for all three.
    #[arg(long, value_enum, default_value_t = Attention::Auto, help_heading = "Model")]
    // Flags saved before `auto` was the default ran eager: absent means eager (its serde
    // default).
    #[serde(default)]
    pub attention: Attention,
    /// The residual stream's dtype: `f32` (autocast's choice: the adds between blocks stay
    /// F32) or `low` (the policy's BF16/FP16, as llm.c and Apex O2 keep it: less memory and
    /// traffic, more rounding; BENCHMARKS.md has both side by side).
    #[arg(long, value_enum, default_value_t = Residual::F32)]
    #[serde(default)]
    pub residual: Residual,
}

/// `--residual`: where the residual stream is kept.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Residual {
    #[default]
    F32,
    Low,
}

/// `--attention`: the front end's [`castor_models::AttentionImpl`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    #[default]
    Eager,
    Fused,
    Cudnn,
    Auto,
}

impl From<Attention> for castor_models::AttentionImpl {
    fn from(a: Attention) -> Self {
        match a {
            Attention::Eager => castor_models::AttentionImpl::Eager,
            Attention::Fused => castor_models::AttentionImpl::Fused,
            Attention::Cudnn => castor_models::AttentionImpl::Cudnn,
            Attention::Auto => castor_models::AttentionImpl::Auto,
        }
    }
}

/// Parses `--precision` (and the precision of demo-like commands).
pub fn parse_precision(s: &str) -> Result<Precision, String> {
    s.parse()
}

/// `Precision` as its name in saved run settings.
mod precision_name {
    use castor_passes::Precision;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(p: &Precision, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(p.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Precision, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

impl PrecisionArgs {
    /// The policy these flags describe: command-line rules first, then the file's.
    pub fn policy(&self) -> anyhow::Result<Policy> {
        let mut policy = Policy::new(self.precision);
        for g in &self.keep_f32 {
            policy.add_rule(g, Target::F32, "--keep-f32")?;
        }
        for g in &self.force_low {
            policy.add_rule(g, Target::Low, "--force-low")?;
        }
        if self.residual == Residual::Low {
            policy.set_residual_low()?;
        }
        policy.set_fp8(castor_passes::Fp8Options {
            skip_first_last: self.fp8_skip_first_last,
            keep_bf16: self.keep_bf16.clone(),
            amax_history: self.amax_history,
        })?;
        if let Some(path) = &self.policy {
            let text = std::fs::read_to_string(path).map_err(|e| {
                CliError::InvalidInput(format!("cannot read policy file `{}`: {e}", path.display()))
            })?;
            let format = if path.extension().is_some_and(|e| e == "json") {
                PolicyFileFormat::Json
            } else {
                PolicyFileFormat::Toml
            };
            policy.apply_file(&text, format, &path.display().to_string())?;
        }
        Ok(policy)
    }

    /// These flags for a training plan of `settings`: the plan's settings are the one carrier
    /// of its precision, and the flags give only the policy's rules (`--keep-f32`,
    /// `--force-low`, `--residual`, `--policy`, the attention).
    pub fn for_plan(&self, settings: &TrainSettings) -> PrecisionArgs {
        PrecisionArgs {
            precision: settings.precision,
            ..self.clone()
        }
    }

    /// `fp8:delayed` reads each cast's scale from amax histories that only a training run
    /// keeps: a command that runs a forward graph alone (`eval`, `generate`) refuses it.
    pub fn refuse_delayed(&self, command: &str) -> anyhow::Result<()> {
        if self.precision.is_delayed() {
            return Err(CliError::InvalidInput(format!(
                "castor {command} keeps no training state, and --precision fp8:delayed reads \
                 each cast's scale from the amax histories a training run keeps; use \
                 --precision fp8 (each tensor scaled by its own amax)"
            ))
            .into());
        }
        Ok(())
    }

    /// Runs the precision passes on a forward graph; `verify` checks the graph after each pass
    /// (always done in debug builds). Every name rule must match a node or a parameter of
    /// `graph`: a command-line glob that matches nothing is an error suggesting the nearest
    /// names (a policy file's, shared between models, is a warning). `model` supplies the
    /// checkpoint names that are no graph name (`lm_head.weight` tied to the embeddings is
    /// the node `logits`).
    pub fn compile(
        &self,
        graph: Graph,
        model: Option<&Model>,
        dump_after: Option<&str>,
        verify: bool,
    ) -> anyhow::Result<PipelineOutput> {
        let policy = self.policy()?;
        check_rules(&policy, &graph, model)?;
        let mut pipeline = precision_pipeline(policy).dump_after(dump_after)?;
        if verify {
            pipeline = pipeline.verify_each(true);
        }
        pipeline.run(graph).context("precision passes failed")
    }
}

/// The names a precision rule is matched against: every node's name and every parameter's.
fn rule_names(graph: &Graph) -> Vec<&str> {
    graph
        .nodes()
        .filter(|(_, n)| !matches!(n.op, Op::Input))
        .filter_map(|(_, n)| n.outputs.first().map(|&v| graph.name(v)))
        .collect()
}

fn check_rules(policy: &Policy, graph: &Graph, model: Option<&Model>) -> anyhow::Result<()> {
    let names = rule_names(graph);
    let aliases = model.map(Model::name_aliases).unwrap_or_default();
    for rule in policy.name_rules() {
        if names.iter().any(|n| rule.matches(n)) {
            continue;
        }
        let mut hints: Vec<String> = aliases
            .iter()
            .filter(|(alias, _)| rule.matches(alias))
            .map(|(alias, node)| {
                format!(
                    "`{node}` (this model stores `{alias}` as a tied copy; the node is `{node}`)"
                )
            })
            .collect();
        // A tied copy explains the miss; otherwise the nearest names.
        if hints.is_empty() {
            hints = castor_passes::names::suggest(&rule.pattern, names.iter().copied())
                .into_iter()
                .map(|s| format!("`{s}`"))
                .collect();
        }
        let message = format!(
            "{} '{}' matches no node or parameter name; did you mean {}?",
            rule.source,
            rule.pattern,
            hints.join(" or ")
        );
        if rule.source.starts_with("--") {
            return Err(CliError::InvalidInput(message).into());
        }
        crate::errln!("warning: {message}");
    }
    Ok(())
}
