//! Deterministic parameter initialization, for models built from a config alone (the embedded
//! demo model, benchmarks on config-only checkpoints).
//!
//! Follows transformers' `_init_weights` for the three families: normal(0, initializer_range)
//! for matrices and embeddings, ones for norm weights, zeros for biases. The generator is a
//! fixed SplitMix64 stream per tensor (seeded by the seed and the tensor's name), so a tensor's
//! values do not depend on which other tensors exist or on their order.

use castor_ir::{DType, Shape, Tensor};

/// Initial values for one parameter.
pub fn init_param(name: &str, shape: &Shape, std: f32, seed: u64) -> Tensor {
    let n = shape.numel().unwrap_or(0);
    let is_vector = shape.rank() == 1;
    let data = if is_vector && name.ends_with("bias") {
        vec![0.0; n]
    } else if is_vector {
        // 1-D weights are norm scales (layer norm, RMS norm).
        vec![1.0; n]
    } else {
        let mut rng = SplitMix64::new(seed ^ fnv1a(name));
        (0..n).map(|_| rng.normal() * std).collect()
    };
    Tensor::from_f32(DType::F32, shape.clone(), data)
}

/// Initial values of a LoRA adapter, as PEFT initializes them: `lora_A` (`[r, in]`)
/// Kaiming-uniform with `a = sqrt(5)`, which is uniform in `(-1/sqrt(in), 1/sqrt(in))`;
/// `lora_B` zeros, so the adapted model starts as the base model. Seeded per tensor name as
/// [`init_param`] is.
pub fn init_adapter(name: &str, shape: &Shape, seed: u64) -> Tensor {
    let n = shape.numel().unwrap_or(0);
    let data = if name.ends_with(".lora_A.weight") && shape.rank() == 2 {
        let bound = 1.0 / (shape.dims()[1] as f64).sqrt();
        let mut rng = SplitMix64::new(seed ^ fnv1a(name));
        (0..n)
            .map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32)
            .collect()
    } else {
        vec![0.0; n]
    };
    Tensor::from_f32(DType::F32, shape.clone(), data)
}

/// SplitMix64: tiny, fast, and good enough for initialization; identical on every platform.
struct SplitMix64 {
    state: u64,
    spare: Option<f32>,
}

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        SplitMix64 {
            state: seed,
            spare: None,
        }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Standard normal by Box-Muller, using both values of each pair.
    fn normal(&mut self) -> f32 {
        if let Some(x) = self.spare.take() {
            return x;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some((r * t.sin()) as f32);
        (r * t.cos()) as f32
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_start_as_peft_starts_them() {
        let a = init_adapter("h.0.attn.c_attn.lora_A.weight", &Shape(vec![8, 64]), 3);
        let v = a.as_f32().unwrap();
        let bound = 1.0 / 8.0;
        assert!(v.iter().all(|&x| x.abs() <= bound && x != 0.0));
        let spread = v.iter().fold(0f32, |m, &x| m.max(x.abs()));
        assert!(
            spread > 0.9 * bound,
            "uniform over the whole range: {spread}"
        );
        let b = init_adapter("h.0.attn.c_attn.lora_B.weight", &Shape(vec![192, 8]), 3);
        assert!(b.as_f32().unwrap().iter().all(|&x| x == 0.0));
    }

    #[test]
    fn deterministic_and_shaped_like_transformers() {
        let w = init_param("h.0.attn.c_attn.weight", &Shape(vec![64, 192]), 0.02, 7);
        let again = init_param("h.0.attn.c_attn.weight", &Shape(vec![64, 192]), 0.02, 7);
        assert_eq!(w, again);
        let v = w.as_f32().unwrap();
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let std =
            (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
        assert!(
            mean.abs() < 0.002 && (std - 0.02).abs() < 0.002,
            "mean {mean} std {std}"
        );
        let other = init_param("h.1.attn.c_attn.weight", &Shape(vec![64, 192]), 0.02, 7);
        assert_ne!(w, other);
        assert!(init_param("ln_f.weight", &Shape(vec![8]), 0.02, 7)
            .as_f32()
            .unwrap()
            .iter()
            .all(|&x| x == 1.0));
        assert!(init_param("ln_f.bias", &Shape(vec![8]), 0.02, 7)
            .as_f32()
            .unwrap()
            .iter()
            .all(|&x| x == 0.0));
    }
}
