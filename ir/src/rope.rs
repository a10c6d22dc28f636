//! Rotary embedding frequencies: the base `theta` and the context-extension schemes
//! transformers applies to them (`rope_scaling`), computed in one place so that every executor
//! and the CUDA tables use the same F32 values.

/// How the rotary frequencies are rescaled for contexts beyond the trained one
/// (transformers' `rope_scaling` / `rope_parameters`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain rotary embeddings: `inv_freq[i] = theta^(-2i/d)`.
    None,
    /// Position interpolation (`linear`): every frequency divided by `factor`.
    Linear { factor: f64 },
    /// LLaMA 3.1's scheme (`llama3`): wavelengths shorter than `original / high_freq_factor`
    /// are kept, those longer than `original / low_freq_factor` are divided by `factor`, and
    /// the band between is interpolated smoothly.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        /// `original_max_position_embeddings`: the context the model was trained on.
        original: usize,
    },
}

impl RopeScaling {
    /// The attribute's numbers in the text format: `[]` (none, never printed), `[factor]`
    /// (linear) or `[factor, low_freq_factor, high_freq_factor, original]` (llama3).
    pub fn numbers(&self) -> Vec<f64> {
        match *self {
            RopeScaling::None => vec![],
            RopeScaling::Linear { factor } => vec![factor],
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original,
            } => vec![factor, low_freq_factor, high_freq_factor, original as f64],
        }
    }

    /// The inverse of [`RopeScaling::numbers`], checking what each number may be.
    pub fn from_numbers(v: &[f64]) -> Result<RopeScaling, String> {
        let positive = |x: f64, what: &str| {
            if x.is_finite() && x > 0.0 {
                Ok(x)
            } else {
                Err(format!(
                    "rope scaling {what} must be a positive number, found {x}"
                ))
            }
        };
        match *v {
            [] => Ok(RopeScaling::None),
            [factor] => Ok(RopeScaling::Linear {
                factor: positive(factor, "factor")?,
            }),
            [factor, low, high, original] => {
                // (NaN fails this too; the factors are checked for being positive below.)
                if low.partial_cmp(&high) != Some(std::cmp::Ordering::Less) {
                    return Err(format!(
                        "llama3 rope scaling needs low_freq_factor < high_freq_factor, found \
                         {low} and {high}"
                    ));
                }
                if !(original >= 1.0 && original.fract() == 0.0 && original < 1e12) {
                    return Err(format!(
                        "llama3 rope scaling needs a whole original context length, found \
                         {original}"
                    ));
                }
                Ok(RopeScaling::Llama3 {
                    factor: positive(factor, "factor")?,
                    low_freq_factor: positive(low, "low_freq_factor")?,
                    high_freq_factor: positive(high, "high_freq_factor")?,
                    original: original as usize,
                })
            }
            _ => Err(format!(
                "rope scaling takes [factor] (linear) or [factor, low_freq_factor, \
                 high_freq_factor, original] (llama3), found {} numbers",
                v.len()
            )),
        }
    }
}

/// The `d / 2` inverse frequencies of a rotary embedding over head size `d`, in F32 with
/// transformers' order of operations (`_compute_default_rope_parameters` and the scaling
/// functions in `modeling_rope_utils`), so that angles match its tables.
pub fn rope_inv_freq(d: usize, theta: f64, scaling: RopeScaling) -> Vec<f32> {
    let half = d / 2;
    let base = theta as f32;
    let plain = (0..half).map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32));
    match scaling {
        RopeScaling::None => plain.collect(),
        RopeScaling::Linear { factor } => plain.map(|f| f / factor as f32).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original,
        } => {
            let (factor, low, high) = (
                factor as f32,
                low_freq_factor as f32,
                high_freq_factor as f32,
            );
            let old = original as f32;
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            plain
                .map(|f| {
                    // torch evaluates `scalar / tensor` as `tensor.reciprocal() * scalar`.
                    let wavelen = (1.0 / f) * (2.0 * std::f32::consts::PI);
                    let f = if wavelen > low_wavelen { f / factor } else { f };
                    if wavelen < high_wavelen || wavelen > low_wavelen {
                        f
                    } else {
                        let smooth = ((1.0 / wavelen) * old - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_round_trip() {
        for s in [
            RopeScaling::None,
            RopeScaling::Linear { factor: 4.0 },
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original: 8192,
            },
        ] {
            assert_eq!(RopeScaling::from_numbers(&s.numbers()), Ok(s));
        }
        assert!(RopeScaling::from_numbers(&[1.0, 2.0]).is_err());
        assert!(RopeScaling::from_numbers(&[8.0, 4.0, 1.0, 8192.0]).is_err());
        assert!(RopeScaling::from_numbers(&[0.0]).is_err());
    }

    #[test]
    fn llama3_keeps_high_frequencies_and_divides_low_ones() {
        let (d, theta) = (128, 500000.0);
        let plain = rope_inv_freq(d, theta, RopeScaling::None);
        let scaled = rope_inv_freq(
            d,
            theta,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original: 8192,
            },
        );
        // The first frequency has a wavelength of 2π < 2048: kept exactly.
        assert_eq!(scaled[0], plain[0]);
        // The last has a wavelength far above 8192: divided by the factor.
        assert_eq!(scaled[63], plain[63] / 8.0);
        // Every one lies between the two.
        for (s, p) in scaled.iter().zip(&plain) {
            assert!(*s <= *p && *s >= p / 8.0, "{s} vs {p}");
        }
        let linear = rope_inv_freq(d, theta, RopeScaling::Linear { factor: 2.0 });
        assert_eq!(linear[5], plain[5] / 2.0);
    }
}
