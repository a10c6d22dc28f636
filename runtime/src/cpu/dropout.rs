//! Dropout, in place: each element multiplied by `1 / (1 - p)` (in F32) when kept, by 0 when
//! dropped (so NaN and Inf stay visible to the overflow check, as in PyTorch's
//! `x * mask * scale`), as its Philox draw says ([`castor_ir::philox`]). The mask is a function of the key, the stream and
//! the element's index, so the blocks of four elements one Philox call draws for are computed
//! in any order, in parallel.

use super::par::for_each_block;
use castor_ir::philox::{dropout_draws, dropout_scale, is_evaluation, keep_threshold};

/// `x = x * (keep ? scale : 0)` for the mask keyed by `key` (`[seed, offset]`) and `stream`;
/// `x` unchanged in evaluation mode (a negative offset).
pub fn dropout(x: &mut [f32], key: [i64; 2], stream: u32, p: f64) {
    if is_evaluation(key) {
        return;
    }
    let threshold = keep_threshold(p);
    let scale = dropout_scale(p);
    // A Philox call is about 40 integer operations: the work of ten elements' pointwise ops.
    for_each_block(x, 4, 40, |block, values| {
        let draws = dropout_draws(key, stream, block as u64);
        for (v, &r) in values.iter_mut().zip(&draws) {
            *v *= if u64::from(r) < threshold { scale } else { 0.0 };
        }
    });
}
