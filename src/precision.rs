//! The precision flags `compile` and `eval` share, and running the precision passes.

use anyhow::Context;
use castor_ir::Graph;
use castor_passes::{
    precision_pipeline, PipelineOutput, Policy, PolicyFileFormat, Precision, Target,
};
use std::path::PathBuf;

#[derive(clap::Args, Clone, Debug)]
pub struct PrecisionArgs {
    /// Precision policy: fp32, tf32 (TF32 contractions), bf16 or fp16.
    #[arg(long, default_value = "fp32", value_parser = parse_precision)]
    pub precision: Precision,
    /// Policy file (TOML, or JSON by its .json extension): op-list edits and name rules.
    #[arg(long, value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// Keep nodes whose name, or whose parameter's name, matches GLOB in F32 (repeatable).
    #[arg(long = "keep-f32", value_name = "GLOB")]
    pub keep_f32: Vec<String>,
    /// Force nodes matching GLOB into the policy's low-precision dtype (repeatable).
    #[arg(long = "force-low", value_name = "GLOB")]
    pub force_low: Vec<String>,
}

fn parse_precision(s: &str) -> Result<Precision, String> {
    s.parse()
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
        if let Some(path) = &self.policy {
            let text = std::fs::read_to_string(path).map_err(|e| {
                crate::CliError::InvalidInput(format!(
                    "cannot read policy file `{}`: {e}",
                    path.display()
                ))
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

    /// Runs the precision passes on a forward graph; `verify` checks the graph after each pass
    /// (always done in debug builds).
    pub fn compile(
        &self,
        graph: Graph,
        dump_after: Option<&str>,
        verify: bool,
    ) -> anyhow::Result<PipelineOutput> {
        let mut pipeline = precision_pipeline(self.policy()?).dump_after(dump_after)?;
        if verify {
            pipeline = pipeline.verify_each(true);
        }
        pipeline.run(graph).context("precision passes failed")
    }
}
