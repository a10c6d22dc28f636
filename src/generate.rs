//! Text generation with a KV cache, on the CPU executor: the decoding loop `castor generate`
//! and the demo's samples share.
//!
//! The prompt runs once through the decode graph (`Model::build_decode_graph` with no cache),
//! which returns the logits and every layer's keys and values; each new token then runs
//! alone, attending to the cache, which grows by one position per token. Each step's graph
//! is built for its cache length (shapes are static in the IR) and compiled under the
//! precision policy; the logits equal those of the whole sequence's forward graph within F32
//! rounding (tests/generate.rs checks token by token, and against transformers).
//!
//! Sampling follows transformers' order: temperature, then top-k, then top-p (the smallest
//! set of most likely tokens whose probability reaches p), then one draw from a seeded
//! [`Rng`]; temperature 0 is greedy.

use crate::precision::PrecisionArgs;
use crate::rng::Rng;
use anyhow::Context;
use castor_ir::{DType, Tensor};
use castor_models::Model;
use castor_runtime::cpu::CpuExecutor;
use std::collections::HashMap;

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 = greedy.
    pub temperature: f64,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the most likely tokens whose probability reaches p (1 = all).
    pub top_p: f64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
    };

    /// The next token from one row of logits. Draws one number from `rng` unless greedy.
    pub fn pick(&self, logits: &[f32], rng: &mut Rng) -> u32 {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        // Most likely first; ties to the lower id, so greedy is argmax as torch takes it.
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.temperature <= 0.0 || idx.len() == 1 {
            return idx.first().map_or(0, |&i| i as u32);
        }
        if self.top_k > 0 {
            idx.truncate(self.top_k);
        }
        let max = f64::from(logits[idx[0]]);
        let mut weights: Vec<f64> = idx
            .iter()
            .map(|&i| ((f64::from(logits[i]) - max) / self.temperature).exp())
            .collect();
        if self.top_p < 1.0 {
            let total: f64 = weights.iter().sum();
            let mut cumulative = 0.0;
            let keep = weights
                .iter()
                .position(|w| {
                    cumulative += w / total;
                    cumulative >= self.top_p
                })
                .map_or(weights.len(), |i| i + 1);
            weights.truncate(keep);
            idx.truncate(keep);
        }
        let mut r = rng.next_f64() * weights.iter().sum::<f64>();
        for (&i, w) in idx.iter().zip(&weights) {
            r -= w;
            if r <= 0.0 {
                return i as u32;
            }
        }
        idx[0] as u32
    }
}

/// A causal model decoding one sequence, with its KV cache.
pub struct Generator<'m> {
    model: &'m Model,
    precision: PrecisionArgs,
    executor: CpuExecutor,
    /// `past.N.key` / `past.N.value` tensors, by input name.
    cache: HashMap<String, Tensor>,
    /// Positions in the cache.
    past: usize,
    /// LoRA adapters beside the model's products (`--adapter`), as the `lora` pass adds them.
    lora: Option<castor_ir::LoraSettings>,
}

impl<'m> Generator<'m> {
    pub fn new(model: &'m Model, precision: PrecisionArgs) -> Generator<'m> {
        Generator {
            model,
            precision,
            executor: CpuExecutor::new(),
            cache: HashMap::new(),
            past: 0,
            lora: None,
        }
    }

    /// Decodes with LoRA adapters (their weights are bound with the model's).
    pub fn with_adapters(mut self, lora: Option<castor_ir::LoraSettings>) -> Self {
        self.lora = lora;
        self
    }

    /// Positions in the cache (tokens fed so far).
    pub fn len(&self) -> usize {
        self.past
    }

    pub fn is_empty(&self) -> bool {
        self.past == 0
    }

    /// Feeds `tokens` after those fed before; returns the logits of every new position
    /// (`[tokens.len(), vocab]`, row-major). `weights` binds the model's parameters.
    pub fn feed<'w>(
        &mut self,
        tokens: &[i64],
        weights: &dyn Fn(&str) -> Option<&'w Tensor>,
    ) -> anyhow::Result<Vec<f32>> {
        let n = tokens.len();
        let graph = self.model.build_decode_graph(1, self.past, n)?;
        let (graph, _) = crate::training::with_adapters(graph, self.lora.as_ref())?;
        let graph = self
            .precision
            .compile(graph, Some(self.model), None, false)?
            .graph;
        let keys = self.past + n;
        let inputs: HashMap<&str, Tensor> = [
            (
                "input_ids",
                Tensor::from_i64(DType::I64, [1, n], tokens.to_vec()),
            ),
            (
                "attention_mask",
                Tensor::from_i64(DType::I64, [1, keys], vec![1; keys]),
            ),
        ]
        .into_iter()
        .collect();
        let bind = |name: &str| {
            inputs
                .get(name)
                .or_else(|| self.cache.get(name))
                .or_else(|| weights(name))
        };
        let outputs = self.executor.run(&graph, &bind)?;
        let mut logits = None;
        let mut cache = HashMap::new();
        for (&v, t) in graph.outputs().iter().zip(outputs) {
            let name = graph.name(v);
            match name.strip_prefix("present.") {
                Some(rest) => {
                    cache.insert(format!("past.{rest}"), t);
                }
                None if name == "logits" => logits = Some(t),
                None => {}
            }
        }
        self.cache = cache;
        self.past = keys;
        let logits = logits.context("the decode graph has no logits")?;
        Ok(logits
            .as_f32()
            .context("the logits are not floats")?
            .to_vec())
    }

    /// Continues `prompt` by up to `max_new` tokens: `stop` ends it at a token (not kept),
    /// `on_token` sees each kept token as it comes. Stops early at the model's last position.
    /// Returns the new tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn generate<'w>(
        &mut self,
        prompt: &[i64],
        max_new: usize,
        sampling: &Sampling,
        rng: &mut Rng,
        weights: &dyn Fn(&str) -> Option<&'w Tensor>,
        stop: &dyn Fn(u32) -> bool,
        on_token: &mut dyn FnMut(u32),
    ) -> anyhow::Result<Vec<u32>> {
        let vocab = self.model.vocab_size();
        let mut logits = self.feed(prompt, weights)?;
        let mut out = Vec::new();
        let limit = self.model.max_positions();
        while out.len() < max_new {
            let row = &logits[logits.len() - vocab..];
            let next = sampling.pick(row, rng);
            if stop(next) {
                break;
            }
            out.push(next);
            on_token(next);
            if self.past >= limit || out.len() == max_new {
                break;
            }
            logits = self.feed(&[i64::from(next)], weights)?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_filters_keep_what_they_say() {
        let logits = [0.1f32, 3.0, 2.9, -1.0, 3.0];
        let mut rng = Rng::new(1);
        assert_eq!(Sampling::GREEDY.pick(&logits, &mut rng), 1);
        let top1 = Sampling {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
        };
        assert_eq!(top1.pick(&logits, &mut rng), 1);
        // p = 0.5: tokens 1 and 4 (the two 3.0s) hold most of the mass; 2 is cut off only
        // once their share reaches p.
        let nucleus = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.3,
        };
        for seed in 0..50 {
            let t = nucleus.pick(&logits, &mut Rng::new(seed));
            assert!(t == 1 || t == 4, "{t}");
        }
        // Temperature sampling draws every likely token sometimes.
        let warm = Sampling {
            temperature: 1.0,
            top_k: 3,
            top_p: 1.0,
        };
        let drawn: std::collections::BTreeSet<u32> = (0..200)
            .map(|s| warm.pick(&logits, &mut Rng::new(s)))
            .collect();
        assert_eq!(drawn, [1, 2, 4].into_iter().collect());
    }
}
