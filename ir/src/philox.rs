//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
//! counter-based generator cuRAND and PyTorch's CUDA generator use, and the dropout masks made
//! from it.
//!
//! A counter-based generator draws the numbers of element `i` from `i` alone, with no state
//! carried from one draw to the next: the CPU executor, the emulator and the GPU draw the same
//! mask bit for bit in any order, and a recomputed dropout regenerates its mask instead of
//! saving it. The kernels (`runtime/src/cuda/families/dropout/dropout.cu`) implement the
//! same functions; the known-answer vectors of the Random123 distribution are tested below.
//!
//! How a [`crate::Op::Dropout`] node's mask is keyed: the Philox key is the 64-bit seed (the
//! first word of the node's `key` operand), the counter is `(block lo, block hi, stream,
//! offset)`, where `block = i / 4` (one call gives the draws of four consecutive elements),
//! `stream` is the node's attribute (which dropout of the graph) and `offset` the low 32 bits
//! of the second word of `key` (which micro step). Element `i` is kept when its draw
//! `r = philox(..)[i % 4]` is below [`keep_threshold`], and then scaled by
//! [`dropout_scale`], as `torch.nn.functional.dropout` scales by `1 / (1 - p)`. A negative
//! offset is evaluation mode (transformers' `model.eval()`): every element is kept unscaled,
//! so one plan both trains (a key per micro step) and validates (offset -1).

/// Philox4x32's multipliers and Weyl key increments (Random123's `PHILOX_M4x32_*` and
/// `PHILOX_W32_*`).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds: four 32-bit draws from a 128-bit counter and a 64-bit key.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The draws are kept below this bound: `round((1 - p) * 2^32)`, so each element is kept with
/// probability `1 - p` to within 2^-33. `p = 0` keeps every element (the bound is 2^32,
/// above every draw); `p` must lie in `[0, 1)`.
pub fn keep_threshold(p: f64) -> u64 {
    ((1.0 - p) * 4_294_967_296.0).round() as u64
}

/// The factor kept elements are multiplied by: `1 / (1 - p)`, rounded to F32 once (the
/// kernels receive this F32).
pub fn dropout_scale(p: f64) -> f32 {
    (1.0 / (1.0 - p)) as f32
}

/// The Philox draws of elements `4 * block .. 4 * block + 4` of a dropout keyed by `key`
/// (`[seed, offset]`) and `stream`.
pub fn dropout_draws(key: [i64; 2], stream: u32, block: u64) -> [u32; 4] {
    let seed = key[0] as u64;
    philox4x32_10(
        [block as u32, (block >> 32) as u32, stream, key[1] as u32],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// Whether `key` is evaluation mode (a negative offset): dropout is the identity.
pub fn is_evaluation(key: [i64; 2]) -> bool {
    key[1] < 0
}

/// Whether each element of a dropout of `n` elements is kept (all of them in evaluation
/// mode, where they are also not scaled).
pub fn dropout_mask(key: [i64; 2], stream: u32, p: f64, n: usize) -> Vec<bool> {
    if is_evaluation(key) {
        return vec![true; n];
    }
    let threshold = keep_threshold(p);
    let mut keep = Vec::with_capacity(n);
    for block in 0..n.div_ceil(4) as u64 {
        let draws = dropout_draws(key, stream, block);
        let left = (n - keep.len()).min(4);
        keep.extend(draws[..left].iter().map(|&r| u64::from(r) < threshold));
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for philox4x32 with 10 rounds (`kat_vectors`).
    #[test]
    fn philox_matches_random123_known_answers() {
        let cases: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0, 0, 0, 0],
                [0, 0],
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (counter, key, expected) in cases {
            assert_eq!(philox4x32_10(counter, key), expected, "{counter:08x?}");
        }
    }

    #[test]
    fn masks_keep_one_minus_p_and_differ_by_stream_and_offset() {
        let n = 1 << 20;
        for p in [0.1, 0.5] {
            let mask = dropout_mask([42, 7], 3, p, n);
            let kept = mask.iter().filter(|&&k| k).count() as f64 / n as f64;
            // Five standard deviations of a binomial proportion over 2^20 draws.
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            assert!((kept - (1.0 - p)).abs() < 5.0 * sd, "p={p}: kept {kept}");
        }
        let base = dropout_mask([42, 7], 3, 0.5, 4096);
        assert_eq!(base, dropout_mask([42, 7], 3, 0.5, 4096));
        for other in [
            dropout_mask([43, 7], 3, 0.5, 4096),
            dropout_mask([42, 8], 3, 0.5, 4096),
            dropout_mask([42, 7], 4, 0.5, 4096),
        ] {
            let same = base.iter().zip(&other).filter(|(a, b)| a == b).count();
            assert!((1800..2300).contains(&same), "{same} of 4096 agree");
        }
        // A prefix of a longer mask is the shorter mask: element i depends on i alone.
        assert_eq!(dropout_mask([42, 7], 3, 0.5, 4097)[..4093], base[..4093]);
        assert!(dropout_mask([1, 2], 0, 0.0, 999).iter().all(|&k| k));
        assert!(dropout_mask([1, -1], 0, 0.9, 999).iter().all(|&k| k));
        assert_eq!(keep_threshold(0.0), 1 << 32);
        assert_eq!(dropout_scale(0.1), (1.0f64 / 0.9) as f32);
    }
}
