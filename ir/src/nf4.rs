//! NF4, the 4-bit NormalFloat data type of QLoRA (Dettmers et al., "QLoRA: Efficient
//! Finetuning of Quantized LLMs", 2023), block-wise, as bitsandbytes' `quantize_4bit(...,
//! quant_type="nf4")` stores a frozen weight.
//!
//! The weight, flattened row-major, is cut into blocks of [`NF4_BLOCK`] values. Each block
//! keeps its absolute maximum in F32; each value becomes the index of the [`NF4_CODE`] entry
//! its scaled value falls to. Two indices share a byte, the first in the high nibble; an odd
//! count is padded with the code of 0. The rounding follows bitsandbytes' reference exactly,
//! so the bytes are bitsandbytes' bytes (a test holds this against its output):
//! - a full block scales by the F32 reciprocal of its absmax (`x * (1 / absmax)`), the
//!   partial last block divides by its absmax; either is clamped to [-1, 1];
//! - a scaled value takes the first code whose upper midpoint (the F32 mean of two
//!   neighbouring codes) is not below it: a value exactly on a midpoint takes the lower code;
//! - a block of zeros keeps absmax 0 (its values scale by 1e38's reciprocal, to 0).
//!
//! This is the format's one definition: castor's quantizer, its dequantizing kernels and the
//! quantization error it reports all read it.

/// Values per quantization block (bitsandbytes' and QLoRA's default).
pub const NF4_BLOCK: usize = 64;

/// The 16 NF4 values, ascending: quantiles of a standard normal scaled to [-1, 1], with an
/// exact 0 (the QLoRA paper's data type, as bitsandbytes' `get_4bit_type("nf4")` holds it).
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// A weight in NF4: packed 4-bit codes and one F32 absmax per block.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4 {
    /// Two codes per byte, the first in the high nibble: `ceil(numel / 2)` bytes.
    pub packed: Vec<u8>,
    /// One per block of [`NF4_BLOCK`] values (the last block may be shorter).
    pub absmax: Vec<f32>,
    /// Values the weight holds.
    pub numel: usize,
}

/// The F32 midpoints between consecutive codes, as bitsandbytes computes its bounds.
fn midpoints() -> [f32; 15] {
    let mut m = [0f32; 15];
    for (i, v) in m.iter_mut().enumerate() {
        *v = (NF4_CODE[i] + NF4_CODE[i + 1]) / 2.0;
    }
    m
}

/// The code of a scaled value in [-1, 1]: how many midpoints lie strictly below it.
fn code_of(bounds: &[f32; 15], x: f32) -> u8 {
    bounds.iter().take_while(|&&b| b < x).count() as u8
}

/// Quantizes `values` (a weight flattened row-major) to NF4 with blocks of `block` values.
pub fn quantize(values: &[f32], block: usize) -> Nf4 {
    let bounds = midpoints();
    let block = block.max(1);
    let n = values.len();
    let full = n - n % block;
    let mut codes: Vec<u8> = Vec::with_capacity(n + 1);
    let mut absmax = Vec::with_capacity(n.div_ceil(block));
    for (start, chunk) in (0..n).step_by(block).zip(values.chunks(block)) {
        let am = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        absmax.push(am);
        let am = am.max(1e-38);
        let reciprocal = 1.0 / am;
        for &v in chunk {
            let scaled = if start < full { v * reciprocal } else { v / am };
            codes.push(code_of(&bounds, scaled.clamp(-1.0, 1.0)));
        }
    }
    if codes.len() % 2 == 1 {
        codes.push(code_of(&bounds, 0.0));
    }
    let packed = codes.chunks(2).map(|p| (p[0] << 4) | p[1]).collect();
    Nf4 {
        packed,
        absmax,
        numel: n,
    }
}

/// The F32 values an NF4 weight stands for: `code * absmax`, rounded once.
pub fn dequantize(q: &Nf4, block: usize) -> Vec<f32> {
    let block = block.max(1);
    (0..q.numel)
        .map(|i| {
            let byte = q.packed[i / 2];
            let code = if i % 2 == 0 { byte >> 4 } else { byte & 0xF };
            NF4_CODE[code as usize] * q.absmax[i / block]
        })
        .collect()
}

/// The quantization error of `values` in NF4: `(sum (w - w')^2, sum w^2)` in F64, `w'` the
/// dequantized values, so that errors over many weights add up to one relative error.
pub fn squared_error(values: &[f32], block: usize) -> (f64, f64) {
    let back = dequantize(&quantize(values, block), block);
    values
        .iter()
        .zip(&back)
        .fold((0.0, 0.0), |(e, n), (&w, &b)| {
            let d = f64::from(w) - f64::from(b);
            (e + d * d, n + f64::from(w) * f64::from(w))
        })
}

/// Bytes an NF4 weight of `numel` values takes: its codes and its F32 absmaxes.
pub fn nf4_bytes(numel: usize, block: usize) -> usize {
    numel.div_ceil(2) + 4 * numel.div_ceil(block.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_to_the_nearest_value_and_ties_go_down() {
        let bounds = midpoints();
        for (i, &c) in NF4_CODE.iter().enumerate() {
            assert_eq!(code_of(&bounds, c), i as u8);
        }
        // Exactly on the midpoint of codes 7 (0) and 8: the lower code.
        assert_eq!(code_of(&bounds, bounds[7]), 7);
        assert_eq!(code_of(&bounds, f32::from_bits(bounds[7].to_bits() + 1)), 8);
    }

    #[test]
    fn a_block_round_trips_its_extremes_and_packs_high_nibble_first() {
        let values = [2.0f32, -2.0, 0.0];
        let q = quantize(&values, NF4_BLOCK);
        assert_eq!(q.absmax, vec![2.0]);
        assert_eq!(q.packed, vec![0xF0, 0x77]);
        assert_eq!(dequantize(&q, NF4_BLOCK), vec![2.0, -2.0, 0.0]);
        assert_eq!(nf4_bytes(3, NF4_BLOCK), 2 + 4);
    }

    #[test]
    fn a_block_of_zeros_stays_zero() {
        let q = quantize(&[0.0; 70], NF4_BLOCK);
        assert_eq!(q.absmax, vec![0.0, 0.0]);
        assert!(dequantize(&q, NF4_BLOCK).iter().all(|&v| v == 0.0));
    }
}
