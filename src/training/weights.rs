//! The weights a run starts from: the checkpoint's or the config's initialization, the
//! adapters it trains, and what is wrong with them (NaN or Inf, NF4's quantization error).

use super::args::Args;
use castor_ir::TrainingPlan;
use castor_models::Model;

/// Seed of the initialization of config-only models.
const INIT_SEED: u64 = 0x00ca_5709;

/// The weights the run starts from (the checkpoint's, or initialized from the config; the
/// adapters from `--adapter` or initialized), and the NaN/Inf they hold, said as `eval` says
/// it.
pub(super) fn initial_weights(
    args: &Args,
    model: &Model,
    plan: &TrainingPlan,
    adapter: Option<&crate::adapter::Loaded>,
) -> anyhow::Result<(std::collections::HashMap<String, castor_ir::Tensor>, String)> {
    let mut params = if model.checkpoint().is_some() {
        model.load_params()?
    } else {
        errln!("weights: initialized from the config (seed {INIT_SEED:#x})");
        model.init_params(INIT_SEED)
    };
    if plan.settings.lora.is_some() {
        let adapters: Vec<(String, castor_ir::TensorType)> = plan
            .state
            .iter()
            .filter(|s| s.role == castor_ir::StateRole::Master)
            // A rank's state table holds shards: the adapters start whole.
            .map(|s| {
                (
                    s.name.clone(),
                    s.shard_of.clone().unwrap_or_else(|| s.ty.clone()),
                )
            })
            .collect();
        params.extend(crate::adapter::initial(
            &adapters,
            adapter.map(|a| &a.tensors),
            args.adapter.as_deref(),
            args.run.seed ^ INIT_SEED,
        )?);
    }
    // As eval does: a checkpoint holding NaN or Inf trains nothing, every step is skipped.
    let found = model.check_finite(&params, false)?;
    let non_finite = match found.is_empty() {
        true => String::new(),
        false => castor_models::finite::describe_non_finite(&found),
    };
    if !non_finite.is_empty() {
        errln!("warning: NaN or Inf in {non_finite} (every step they reach will be skipped)");
    }
    Ok((params, non_finite))
}

/// `--base nf4`: how far the quantized base is from the checkpoint's weights, over all of
/// them (`||W - W'|| / ||W||`, `W'` the dequantized weights the products read) and for the
/// worst one.
pub(super) fn nf4_error(
    plan: &TrainingPlan,
    params: &std::collections::HashMap<String, castor_ir::Tensor>,
) -> Option<String> {
    use rayon::prelude::*;
    let mut names: Vec<&str> = plan
        .state
        .iter()
        .filter_map(|s| match &s.init {
            castor_ir::StateInit::Nf4 { tensor, .. } => Some(tensor.as_str()),
            _ => None,
        })
        .collect();
    names.dedup();
    if names.is_empty() {
        return None;
    }
    let errors: Vec<(&str, f64, f64)> = names
        .par_iter()
        .filter_map(|&n| {
            let values = params.get(n)?.as_f32()?;
            let (e, w) = castor_ir::nf4::squared_error(values, castor_ir::nf4::NF4_BLOCK);
            Some((n, e, w))
        })
        .collect();
    let (e, w) = errors
        .iter()
        .fold((0.0, 0.0), |(a, b), &(_, e, w)| (a + e, b + w));
    let worst = errors
        .iter()
        .map(|&(n, e, w)| (n, (e / w.max(f64::MIN_POSITIVE)).sqrt()))
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    Some(format!(
        "nf4         {} base weights quantized: relative error {:.4} over all of them \
         (||W - W'|| / ||W||), worst {:.4} (`{}`)",
        errors.len(),
        (e / w.max(f64::MIN_POSITIVE)).sqrt(),
        worst.1,
        worst.0
    ))
}
