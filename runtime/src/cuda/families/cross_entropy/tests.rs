//! `cross_entropy.cu` against `cpu/loss.rs`: the twin's rounding points (max, F32 exponentials,
//! F64 sum and log), the sums in another order: the loss and the gradient within 1 ulp; bad
//! labels reported by position.

use crate::cuda::emulate::kernel_tests::{check, dec, dec_i32, enc, enc_i64, i32, i64, Launcher, Rng, FLOATS};
use crate::cpu::loss::{cross_entropy, cross_entropy_grad};
use crate::cuda::program::Arg;
use castor_ir::{round_to, DType};

pub(crate) fn entries() -> Vec<String> {
    let mut out = vec!["cross_entropy_finalize".to_string()];
    for (_, s) in FLOATS {
        out.push(format!("cross_entropy_fwd_{s}"));
        out.push(format!("cross_entropy_bwd_{s}"));
    }
    out
}

const IGNORE: i64 = -100;

#[test]
fn cross_entropy_forward_finalize_and_backward_agree_with_the_twin() {
    let mut rng = Rng::new(8);
    let mut differ = 0;
    for (d, s) in FLOATS {
        // Packed rows, and rows `ld` apart with NaN padding that the forward must not read and
        // the backward must write 0 (the fused classifier's chunk).
        for (rows, v, pad) in [
            (1usize, 1usize, 0usize),
            (7, 31, 0),
            (11, 33, 0),
            (5, 1025, 0),
            (7, 31, 33),
            (5, 1025, 63),
        ] {
            let ld = v + pad;
            for block in [(v.div_ceil(32) * 32).min(256) as u32, 512] {
                let logits = rng.values(rows * v, 9.0, d);
                let labels: Vec<i64> = (0..rows)
                    .map(|r| {
                        if r % 4 == 3 {
                            IGNORE
                        } else {
                            (rng.next() % v as u64) as i64
                        }
                    })
                    .collect();
                let loss = cross_entropy(&logits, v, &labels, IGNORE).unwrap_or(f32::NAN);
                let dloss = 0.75f32;
                let mut grad = logits.clone();
                let _ = cross_entropy_grad(&mut grad, v, &labels, IGNORE, dloss);
                let grad: Vec<f32> = grad.iter().map(|&x| round_to(d, x)).collect();

                let padded: Vec<f32> = logits
                    .chunks(v)
                    .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(f32::NAN, pad)))
                    .collect();
                let unpad = |x: &[f32]| -> Vec<f32> {
                    x.chunks(ld).flat_map(|r| r[..v].to_vec()).collect()
                };
                let mut l = Launcher::new("cross_entropy.cu");
                let bx = l.buf(enc(d, &padded), d.size_bytes() as u64);
                let bl = l.buf(enc_i64(&labels), 0);
                let (rl, rm, ri) = (l.out(rows * 8, 0), l.out(rows * 4, 0), l.out(rows * 4, 0));
                let bad = l.buf(i32::MAX.to_le_bytes().to_vec(), 0);
                let args = vec![
                    l.ptr(bx),
                    l.ptr(bl),
                    i64(rows),
                    i32(v),
                    i64(ld),
                    Arg::I64(IGNORE),
                    l.ptr(rl),
                    l.ptr(rm),
                    l.ptr(ri),
                    l.ptr(bad),
                ];
                let what = format!("cross_entropy_fwd_{s} rows={rows} v={v} ld={ld} block={block}");
                let fwd = l
                    .run(
                        &format!("cross_entropy_fwd_{s}"),
                        (rows as u32, 1, 1),
                        (block, 1, 1),
                        args,
                    )
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(dec_i32(&fwd[bad.0]), [i32::MAX], "{what}: no bad label");

                // Finalize: the mean over counted rows (and their count).
                let mut l = Launcher::new("cross_entropy.cu");
                let brl = l.buf(fwd[rl.0].clone(), 0);
                let bl = l.buf(enc_i64(&labels), 0);
                let (bloss, bcount) = (l.out(4, 0), l.out(4, 0));
                let args = vec![
                    l.ptr(brl),
                    l.ptr(bl),
                    i64(rows),
                    Arg::I64(IGNORE),
                    l.ptr(bloss),
                    l.ptr(bcount),
                ];
                let fin = l
                    .run("cross_entropy_finalize", (1, 1, 1), (64, 1, 1), args)
                    .unwrap_or_else(|e| panic!("{what} finalize: {e}"));
                differ += check(
                    &format!("{what} loss"),
                    DType::F32,
                    &dec(DType::F32, &fin[bloss.0]),
                    &[loss],
                    1,
                );
                let counted = labels.iter().filter(|&&x| x != IGNORE).count() as i32;
                assert_eq!(dec_i32(&fin[bcount.0]), [counted]);

                // Backward with the forward's statistics, and recomputing them (null), in place.
                for saved in [true, false] {
                    let mut l = Launcher::new("cross_entropy.cu");
                    let bx = l.buf(enc(d, &padded), 0);
                    let bl = l.buf(enc_i64(&labels), 0);
                    let bm = l.buf(fwd[rm.0].clone(), 0);
                    let bi = l.buf(fwd[ri.0].clone(), 0);
                    let bdl = l.buf(dloss.to_le_bytes().to_vec(), 0);
                    let bc = l.buf(counted.to_le_bytes().to_vec(), 0);
                    let stat = |b| if saved { l.ptr(b) } else { Arg::Null };
                    let args = vec![
                        l.ptr(bx),
                        l.ptr(bl),
                        i64(rows),
                        i32(v),
                        i64(ld),
                        Arg::I64(IGNORE),
                        stat(bm),
                        stat(bi),
                        l.ptr(bdl),
                        l.ptr(bc),
                        l.ptr(bx),
                    ];
                    let what =
                        format!("cross_entropy_bwd_{s} rows={rows} v={v} ld={ld} saved={saved}");
                    let out = l
                        .run(
                            &format!("cross_entropy_bwd_{s}"),
                            (rows as u32, 1, 1),
                            (block, 1, 1),
                            args,
                        )
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let got = dec(d, &out[bx.0]);
                    differ += check(&what, d, &unpad(&got), &grad, 1);
                    assert!(
                        got.chunks(ld).all(|r| r[v..].iter().all(|&x| x == 0.0)),
                        "{what}: the padding is not 0"
                    );
                }
            }
        }
    }
    println!("cross-entropy: {differ} elements 1 ulp from the twin");
}

#[test]
fn bad_labels_are_reported_by_their_first_position() {
    let (rows, v) = (6usize, 10usize);
    let labels = [3i64, IGNORE, 10, 2, -1, 4];
    let mut l = Launcher::new("cross_entropy.cu");
    let bx = l.buf(enc(DType::F32, &vec![0.5; rows * v]), 0);
    let bl = l.buf(enc_i64(&labels), 0);
    let (rl, bad) = (
        l.out(rows * 8, 0),
        l.buf(i32::MAX.to_le_bytes().to_vec(), 0),
    );
    let args = vec![
        l.ptr(bx),
        l.ptr(bl),
        i64(rows),
        i32(v),
        i64(v),
        Arg::I64(IGNORE),
        l.ptr(rl),
        Arg::Null,
        Arg::Null,
        l.ptr(bad),
    ];
    let out = l
        .run("cross_entropy_fwd_f32", (2, 1, 1), (32, 1, 1), args)
        .unwrap();
    assert_eq!(dec_i32(&out[bad.0]), [2]);
    let losses = crate::cuda::emulate::kernel_tests::dec_f64(&out[rl.0]);
    assert!(
        losses[2].is_nan() && losses[4].is_nan() && losses[1] == 0.0,
        "{losses:?}"
    );
}
