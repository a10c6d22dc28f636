//! Block-wise dynamic quantization of optimizer moments (Dettmers et al., "8-bit Optimizers
//! via Block-wise Quantization", 2022), as bitsandbytes' `AdamW8bit` stores them.
//!
//! A buffer is cut into blocks of [`QUANT_BLOCK`] consecutive values. Each block keeps its
//! absolute maximum in F32 and each value one byte: the index of the code-map entry nearest to
//! `value / absmax`. The code map is the dynamic (tree) data type: a sign bit (signed map
//! only), a run of zero bits that sets a decimal exponent from 10^-6 to 10^0, and a linear
//! fraction in the remaining bits, so small magnitudes keep their relative precision.
//!
//! This module is the format's one definition: the plan's code-map state is built from
//! [`code_maps`], and the CPU executor and the CUDA kernel quantize with [`nearest_code`]'s
//! rule.

/// Values per quantization block (bitsandbytes' block size for blockwise 8-bit optimizer
/// states).
pub const QUANT_BLOCK: usize = 256;

/// Parameters with fewer values keep 32-bit moments, as bitsandbytes' `min_8bit_size` default.
pub const MIN_QUANTIZED_NUMEL: usize = 4096;

/// Entries of one code map.
pub const CODES: usize = 256;

/// The dynamic code map, sorted ascending: for `signed`, 127 negative and 127 positive values,
/// 0 and 1; unsigned, 254 positive values, 0 and 1. Exponent `i` (0..7) spreads `2^i + 1`
/// (signed; `2^(i+1) + 1` unsigned) points evenly over [0.1, 1] and keeps the midpoints of
/// consecutive points, times `10^(i-6)`.
///
/// Each entry is the exact value rounded once to F32. bitsandbytes' `create_dynamic_map`
/// forms the same values through `torch.linspace` in F32, so 172 of its 512 entries differ
/// in the last bits (by at most 2 units in the last place; a test holds this against its
/// maps).
pub fn dynamic_map(signed: bool) -> [f32; CODES] {
    let mut values: Vec<f64> = vec![0.0, 1.0];
    for i in 0..7 {
        let points = if signed {
            (1 << i) + 1
        } else {
            (1 << (i + 1)) + 1
        };
        let scale = 10f64.powi(i - 6);
        let at = |k: usize| 0.1 + 0.9 * k as f64 / (points - 1) as f64;
        for k in 0..points - 1 {
            let mid = scale * (at(k) + at(k + 1)) / 2.0;
            values.push(mid);
            if signed {
                values.push(-mid);
            }
        }
    }
    values.resize(CODES, 0.0);
    values.sort_by(f64::total_cmp);
    let mut map = [0f32; CODES];
    for (m, v) in map.iter_mut().zip(values) {
        *m = v as f32;
    }
    map
}

/// The two maps a quantized AdamW reads, signed (first moment) then unsigned (second), as
/// one F32 buffer of `2 * CODES` values.
pub fn code_maps() -> Vec<f32> {
    [true, false].into_iter().flat_map(dynamic_map).collect()
}

/// The code index for the normalized value `x`: the nearest entry, the lower one on a tie.
/// `code` is sorted ascending; a value below its first entry takes index 0.
#[inline]
pub fn nearest_code(code: &[f32], x: f32) -> u8 {
    // Binary search for the last entry <= x (index 0 when none is), then its right
    // neighbour if that is strictly nearer.
    let (mut lo, mut hi) = (0usize, code.len());
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if code[mid] <= x {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let mut idx = lo;
    if idx + 1 < code.len() && (x - code[idx + 1]).abs() < (x - code[idx]).abs() {
        idx += 1;
    }
    idx as u8
}

/// Quantizes one block: writes each value's code into `out` and returns the block's absolute
/// maximum. A block of zeros has absmax 0 and codes its values as 0 would be.
pub fn quantize_block(code: &[f32], values: &[f32], out: &mut [u8]) -> f32 {
    let absmax = values.iter().fold(0f32, |m, &x| m.max(x.abs()));
    for (o, &x) in out.iter_mut().zip(values) {
        let normed = if absmax > 0.0 { x / absmax } else { 0.0 };
        *o = nearest_code(code, normed);
    }
    absmax
}

/// The values one block of codes stands for.
pub fn dequantize_block(code: &[f32], codes: &[u8], absmax: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = code[usize::from(c)] * absmax;
    }
}

/// Blocks a buffer of `numel` values is cut into.
pub fn quant_blocks(numel: usize) -> usize {
    numel.div_ceil(QUANT_BLOCK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_are_sorted_and_span_the_range() {
        for signed in [true, false] {
            let m = dynamic_map(signed);
            assert!(m.windows(2).all(|w| w[0] <= w[1]));
            assert_eq!(m[CODES - 1], 1.0);
            assert_eq!(m.iter().filter(|&&x| x == 0.0).count(), 1);
            assert_eq!(m[0] < 0.0, signed);
        }
        // The smallest positive magnitude is 10^-6 times the first midpoint.
        let u = dynamic_map(false);
        assert!((u[1] as f64 - 1e-6 * (0.1 + 0.9 / 4.0)).abs() < 1e-12);
    }

    #[test]
    fn nearest_code_picks_the_closer_neighbour_and_ties_low() {
        let code = [-1.0, -0.5, 0.0, 0.25, 1.0];
        assert_eq!(nearest_code(&code, -1.0), 0);
        assert_eq!(nearest_code(&code, -0.8), 0);
        assert_eq!(nearest_code(&code, -0.7), 1);
        assert_eq!(nearest_code(&code, 0.125), 2);
        assert_eq!(nearest_code(&code, 0.13), 3);
        assert_eq!(nearest_code(&code, 1.0), 4);
    }

    #[test]
    fn quantization_round_trips_within_the_map_spacing() {
        let maps = code_maps();
        let values: Vec<f32> = (0..QUANT_BLOCK)
            .map(|i| ((i as f32) * 0.37).sin() * 3.0)
            .collect();
        let mut codes = vec![0u8; QUANT_BLOCK];
        let absmax = quantize_block(&maps[..CODES], &values, &mut codes);
        let mut back = vec![0f32; QUANT_BLOCK];
        dequantize_block(&maps[..CODES], &codes, absmax, &mut back);
        for (a, b) in values.iter().zip(&back) {
            // The widest gap of the signed map is 0.9 / 64 near 1.
            assert!((a - b).abs() <= absmax * 0.9 / 128.0 + 1e-6, "{a} vs {b}");
        }
        let mut zeros = vec![7u8; 4];
        assert_eq!(quantize_block(&maps[..CODES], &[0.0; 4], &mut zeros), 0.0);
        dequantize_block(&maps[..CODES], &zeros, 0.0, &mut back[..4]);
        assert!(back[..4].iter().all(|&x| x == 0.0));
    }
}
