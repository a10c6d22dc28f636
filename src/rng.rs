//! The CLI's one random source: SplitMix64, seeded explicitly, so shuffled windows, masked
//! tokens and sampled text are the same on every machine and every run with the same seed.

/// SplitMix64 (Steele, Lea and Flood): a 64-bit state, one multiply-xorshift chain per draw.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A stream for one purpose and index (`derive(seed, MASKING, window)`), independent of
    /// how many draws other streams made: resumed runs need no saved generator state.
    pub fn derive(seed: u64, purpose: u64, index: u64) -> Rng {
        let mut r = Rng(seed ^ purpose.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        r.0 ^= r.next_u64().wrapping_add(index);
        Rng(r.next_u64())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is below 2^-40 for the sizes used here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}
