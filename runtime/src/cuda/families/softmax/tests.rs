//! `softmax.cu` against `cpu/softmax.rs`: the twin's rounding points (the max, F32
//! exponentials, the F64 sum, one rounding of y), the sums in another order: within 1 ulp.

use crate::cuda::emulate::kernel_tests::{check, dec, enc, enc_i64, i32, i64, Launcher, Rng};
use crate::cuda::families::norm::tests as norm;
use crate::cpu::mask::KeyMask;
use crate::cpu::softmax::{softmax, softmax_grad};
use crate::cuda::program::Arg;
use castor_ir::round_to;

pub(crate) fn entries() -> Vec<String> {
    norm::pairs()
        .into_iter()
        .flat_map(|(ti, to)| {
            let s = crate::cuda::emulate::kernel_tests::io(ti, to);
            [format!("softmax_fwd_{s}"), format!("softmax_bwd_{s}")]
        })
        .collect()
}

#[test]
fn softmax_with_masks_and_its_gradient_agree_with_the_twin() {
    let mut rng = Rng::new(7);
    let mut differ = 0;
    let (batch, heads) = (2usize, 3usize);
    for (ti, to) in norm::pairs() {
        let s = crate::cuda::emulate::kernel_tests::io(ti, to);
        // Ragged rows read element by element (the scores skewed off 16 bytes), and rows of a
        // multiple of 8 that fit the block's registers (aligned).
        for (tq, tk) in [
            (1usize, 1usize),
            (5, 31),
            (4, 33),
            (3, 1025),
            (2, 64),
            (3, 1024),
        ] {
            // Causal masks with and without a sliding window (2 keys, 17 keys).
            for (causal, window) in [
                (false, None),
                (true, None),
                (true, Some(2)),
                (true, Some(17)),
            ] {
                for masked in [false, true] {
                    let rows = batch * heads * tq;
                    let n = rows * tk;
                    let x = rng.values(n, 8.0, ti);
                    // A padding mask [batch, 1, 1, tk]: batch 0 keeps two keys in three; batch 1
                    // keeps none (its rows become uniform).
                    let keep: Vec<bool> = (0..batch * tk).map(|i| i < tk && i % 3 != 1).collect();
                    let dims = [batch, heads, tq, tk];
                    let mut y = x.clone();
                    let mask_shape = [batch, 1, 1, tk];
                    let mask = masked.then(|| KeyMask::Keep(&keep, &mask_shape));
                    softmax(&mut y, &dims, causal, window, mask);
                    let y: Vec<f32> = y.iter().map(|&v| round_to(to, v)).collect();

                    let block = if tk > 2048 {
                        512
                    } else {
                        (tk.div_ceil(32) * 32).min(128)
                    } as u32;
                    let mut l = Launcher::new("softmax.cu");
                    let skew = if tk % 8 == 0 {
                        0
                    } else {
                        ti.size_bytes() as u64
                    };
                    let bx = l.buf(enc(ti, &x), skew);
                    let by = l.out(n * to.size_bytes(), 0);
                    let bm = l.buf(keep.iter().map(|&k| u8::from(k)).collect(), 1);
                    let mask_arg = if masked { l.ptr(bm) } else { Arg::Null };
                    let args = vec![
                        l.ptr(bx),
                        l.ptr(by),
                        i64(rows),
                        i32(tk),
                        i32(tq),
                        i32(heads),
                        i32(usize::from(causal)),
                        i32(window.unwrap_or(0)),
                        mask_arg,
                        Arg::Null,
                        i64(tk),
                        i64(0),
                        i64(0),
                        i64(1),
                    ];
                    let what =
                        format!("softmax_fwd_{s} tq={tq} tk={tk} causal={causal} window={window:?} mask={masked}");
                    let out = l
                        .run(
                            &format!("softmax_fwd_{s}"),
                            (rows as u32, 1, 1),
                            (block, 1, 1),
                            args,
                        )
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    differ += check(&what, to, &dec(to, &out[by.0]), &y, 1);

                    // The gradient at the twin's y.
                    let dy = rng.values(n, 1.0, to);
                    let mut dx = dy.clone();
                    softmax_grad(&y, &mut dx, tk);
                    let dx: Vec<f32> = dx.iter().map(|&v| round_to(ti, v)).collect();
                    let mut l = Launcher::new("softmax.cu");
                    let by = l.buf(enc(to, &y), 0);
                    let bdy = l.buf(enc(to, &dy), to.size_bytes() as u64);
                    let bdx = l.out(n * ti.size_bytes(), 0);
                    let args = vec![l.ptr(by), l.ptr(bdy), l.ptr(bdx), i64(rows), i32(tk)];
                    let what = format!("softmax_bwd_{s} tk={tk}");
                    let out = l
                        .run(
                            &format!("softmax_bwd_{s}"),
                            (rows as u32, 1, 1),
                            (block.min(256), 1, 1),
                            args,
                        )
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    differ += check(&what, ti, &dec(ti, &out[bdx.0]), &dx, 1);
                }
            }
        }
    }
    println!("softmax: {differ} elements 1 ulp from the twin");
}

/// Positions of `n` keys packed from sequences of the given lengths, in turn (each sequence
/// counting 0, 1, ..), as a data loader packs examples into one row.
pub(crate) fn packed(n: usize, lengths: &[usize]) -> Vec<i64> {
    let mut out = Vec::with_capacity(n);
    for &len in lengths.iter().cycle() {
        if out.len() >= n {
            break;
        }
        out.extend((0..len.min(n - out.len())).map(|p| p as i64));
    }
    out
}

/// Positions that no packing makes: jumps forward past the key, negatives, values past the
/// row. The kernels clamp them as the twin does.
pub(crate) fn malformed(rng: &mut Rng, n: usize) -> Vec<i64> {
    (0..n)
        .map(|_| (rng.next() % (n as u64 + 12)) as i64 - 6)
        .collect()
}

#[test]
fn softmax_over_packed_sequences_agrees_with_the_twin() {
    let mut rng = Rng::new(17);
    let mut differ = 0;
    let (batch, heads) = (3usize, 2usize);
    for (ti, to) in norm::pairs() {
        let s = crate::cuda::emulate::kernel_tests::io(ti, to);
        // Registers (aligned multiples of 8) and the element-by-element path; fewer queries
        // than keys (each query's own key is i + tk - tq).
        for (tq, tk) in [(1usize, 1usize), (6, 31), (33, 33), (4, 64), (64, 64), (3, 1025)] {
            for window in [None, Some(3)] {
                // Batch 0 packs sequences of 4, 3, 2 and 9 keys; batch 1 of 1, 13 and 5; batch
                // 2's positions are malformed.
                let mut positions = packed(tk, &[4, 3, 2, 9]);
                positions.extend(packed(tk, &[1, 13, 5]));
                positions.extend(malformed(&mut rng, tk));
                let rows = batch * heads * tq;
                let n = rows * tk;
                let x = rng.values(n, 8.0, ti);
                let dims = [batch, heads, tq, tk];
                let shape = [batch, 1, 1, tk];
                let mut y = x.clone();
                softmax(&mut y, &dims, true, window, Some(KeyMask::Positions(&positions, &shape)));
                let y: Vec<f32> = y.iter().map(|&v| round_to(to, v)).collect();
                let block = (tk.div_ceil(32) * 32).min(128) as u32;
                let mut l = Launcher::new("softmax.cu");
                let skew = if tk % 8 == 0 { 0 } else { ti.size_bytes() as u64 };
                let bx = l.buf(enc(ti, &x), skew);
                let by = l.out(n * to.size_bytes(), 0);
                let bp = l.buf(enc_i64(&positions), 0);
                let args = vec![
                    l.ptr(bx),
                    l.ptr(by),
                    i64(rows),
                    i32(tk),
                    i32(tq),
                    i32(heads),
                    i32(1),
                    i32(window.unwrap_or(0)),
                    Arg::Null,
                    l.ptr(bp),
                    i64(tk),
                    i64(0),
                    i64(0),
                    i64(1),
                ];
                let what = format!("softmax_fwd_{s} tq={tq} tk={tk} window={window:?} positions");
                let out = l
                    .run(&format!("softmax_fwd_{s}"), (rows as u32, 1, 1), (block, 1, 1), args)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                differ += check(&what, to, &dec(to, &out[by.0]), &y, 1);
            }
        }
    }
    println!("softmax over packed sequences: {differ} elements 1 ulp from the twin");
}
