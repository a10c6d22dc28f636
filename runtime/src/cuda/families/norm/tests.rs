//! `norm.cu` against `cpu/norm.rs`: the header's rounding points are the twin's, with the F64
//! row sums added in another order (a block tree here), so each result is within 1 ulp of the
//! twin's; the residual sum is exact. Both of the kernels' paths: the general loop (rows off
//! 16-byte alignment, or more units than threads) and the one-read path. The forward with
//! its FP8 tail writes exactly the bytes and amax that `fp8.cu` (and the CPU twin) make of the
//! output it stores.

use crate::cuda::emulate::kernel_tests::{check, dec, enc, i32, i64, Launcher, Rng, FLOATS};
use crate::cpu::{math, norm};
use crate::cuda::program::Arg;
use castor_ir::{round_to, DType};

/// The (input, output) dtype pairs the norms are built for.
pub(crate) fn pairs() -> Vec<(DType, DType)> {
    let mut out: Vec<(DType, DType)> = FLOATS.iter().map(|f| (f.0, f.0)).collect();
    for (d, _) in &FLOATS[1..] {
        out.push((DType::F32, *d));
        out.push((*d, DType::F32));
    }
    out
}

pub(crate) fn entries() -> Vec<String> {
    let mut out = Vec::new();
    for (ti, to) in pairs() {
        let s = crate::cuda::emulate::kernel_tests::io(ti, to);
        for k in ["layer_norm", "rms_norm"] {
            for step in ["fwd", "fwd_fp8", "bwd", "bwd_weight"] {
                out.push(format!("{k}_{step}_{s}"));
            }
        }
    }
    out
}

const ROWS: usize = 5;
const EPS: f64 = 1e-5;

/// The forward's F32 mean and rstd of a row, as the twin computes them.
fn stats(row: &[f32], rms: bool) -> (f32, f32) {
    let h = row.len() as f64;
    if rms {
        return (0.0, (1.0 / (math::sum_sq(row) / h + EPS).sqrt()) as f32);
    }
    let mean = math::sum(row) / h;
    let var = math::sum_sq_dev(row, mean) / h;
    (mean as f32, (1.0 / (var + EPS).sqrt()) as f32)
}

fn f32s(v: &[f32]) -> Vec<u8> {
    enc(DType::F32, v)
}

#[test]
fn norms_forward_and_backward_agree_with_the_twin() {
    let mut rng = Rng::new(6);
    let mut differ = 0;
    for (ti, to) in pairs() {
        let s = crate::cuda::emulate::kernel_tests::io(ti, to);
        // Rows one element off 16-byte alignment (the general loop), and aligned rows of
        // whole units (the one-read path, one unit a thread: one warp, part of a warp idle,
        // several warps summing through shared memory).
        let cases = [
            (1usize, false),
            (31, false),
            (33, false),
            (1023, false),
            (1025, false),
            (64, true),
            (776, true),
            (2048, true),
        ];
        for (h, aligned) in cases {
            // The lowering's block; for the longest unaligned rows the largest (32 warps in
            // each reduction); for 2048 one warp, too few threads for the one-read path.
            let lowering = if h % 8 == 0 {
                ((h / 8).div_ceil(32) * 32).clamp(32, 1024) as u32
            } else {
                (h.div_ceil(32) * 32).min(256) as u32
            };
            let blocks: &[u32] = match h {
                1025 => &[lowering, 1024],
                2048 => &[lowering, 32],
                _ => &[lowering],
            };
            for &block in blocks {
                let (skew, oskew) = if aligned {
                    (0, 0)
                } else {
                    (ti.size_bytes() as u64, to.size_bytes() as u64)
                };
                let wskew = if aligned { 0 } else { 4 };
                let n = ROWS * h;
                let x = rng.values(n, 3.0, ti);
                let res = rng.values(n, 1.0, ti);
                let w = rng.values(h, 2.0, DType::F32);
                let b = rng.values(h, 0.5, DType::F32);
                let dy = rng.values(n, 1.0, to);
                let dadd = rng.values(n, 1.0, ti);
                // The twin: the residual sum rounded where it is stored, then the norm.
                let sum: Vec<f32> = x
                    .iter()
                    .zip(&res)
                    .map(|(a, r)| round_to(ti, a + r))
                    .collect();
                for rms in [false, true] {
                    let kind = if rms { "rms_norm" } else { "layer_norm" };
                    // The twin's output of a residual sum, rounded to the output dtype.
                    let normed = |sum: &[f32]| -> Vec<f32> {
                        let mut y = sum.to_vec();
                        if rms {
                            norm::rms_norm(&mut y, &w, EPS);
                        } else {
                            norm::layer_norm(&mut y, &w, &b, EPS);
                        }
                        y.iter().map(|&v| round_to(to, v)).collect()
                    };
                    // The forward with the residual added to `first` (the `x` operand, or
                    // `x_low` in the output dtype when `low`) over `grid` blocks, every
                    // output stored: the sum, y, mean and rstd as stored.
                    let forward = |first: &[f32], low: bool, grid: u32| -> [Vec<f32>; 4] {
                        let mut l = Launcher::new("norm.cu");
                        let bx = match low {
                            true => l.buf(enc(to, first), oskew),
                            false => l.buf(enc(ti, first), skew),
                        };
                        let br = l.buf(enc(ti, &res), skew);
                        let bsum = l.out(n * ti.size_bytes(), skew);
                        let (bw, bb) = (l.buf(f32s(&w), wskew), l.buf(f32s(&b), wskew));
                        let by = l.out(n * to.size_bytes(), oskew);
                        let (bm, bs) = (l.out(ROWS * 4, 0), l.out(ROWS * 4, 0));
                        let (xa, la) = match low {
                            true => (Arg::Null, l.ptr(bx)),
                            false => (l.ptr(bx), Arg::Null),
                        };
                        let mut args = vec![xa, la, l.ptr(br), l.ptr(bsum), l.ptr(bw)];
                        if !rms {
                            args.push(l.ptr(bb));
                        }
                        args.push(l.ptr(by));
                        if !rms {
                            args.push(l.ptr(bm));
                        }
                        args.extend([l.ptr(bs), i64(ROWS), i32(h), Arg::F64(EPS)]);
                        let what = format!("{kind}_fwd_{s} h={h} block={block} x_low={low}");
                        let out = l
                            .run(&format!("{kind}_fwd_{s}"), (grid, 1, 1), (block, 1, 1), args)
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                        [
                            dec(ti, &out[bsum.0]),
                            dec(to, &out[by.0]),
                            dec(DType::F32, &out[bm.0]),
                            dec(DType::F32, &out[bs.0]),
                        ]
                    };
                    let y = normed(&sum);
                    let st: Vec<(f32, f32)> = sum.chunks(h).map(|r| stats(r, rms)).collect();
                    let (mean, rstd): (Vec<f32>, Vec<f32>) = st.iter().copied().unzip();
                    let what = format!("{kind}_fwd_{s} h={h} block={block}");

                    // Forward with the residual add, every output.
                    let [got_sum, got_y, got_mean, got_rstd] = forward(&x, false, ROWS as u32);
                    check(&format!("{what} sum"), ti, &got_sum, &sum, 0);
                    differ += check(&format!("{what} y"), to, &got_y, &y, 1);
                    differ += check(&format!("{what} rstd"), DType::F32, &got_rstd, &rstd, 1);
                    if !rms {
                        differ += check(&format!("{what} mean"), DType::F32, &got_mean, &mean, 1);
                    }

                    // The add's first operand in the output dtype, widened as it is loaded
                    // (`x_low`, a norm unit's cast): the sum and output the twin makes of the
                    // widened operand.
                    let low: Vec<f32> = x.iter().map(|&v| round_to(to, v)).collect();
                    let low_sum: Vec<f32> = low
                        .iter()
                        .zip(&res)
                        .map(|(a, r)| round_to(ti, a + r))
                        .collect();
                    let [got_sum, got_y, _, _] = forward(&low, true, 2);
                    check(&format!("{what} x_low sum"), ti, &got_sum, &low_sum, 0);
                    differ += check(&format!("{what} x_low y"), to, &got_y, &normed(&low_sum), 1);

                    // Statistics only (null y, w and b not read), in place over the input.
                    let mut l = Launcher::new("norm.cu");
                    let bx = l.buf(enc(ti, &sum), skew);
                    let bw = l.buf(f32s(&w), wskew);
                    let bs = l.out(ROWS * 4, 0);
                    let mut args = vec![l.ptr(bx), Arg::Null, Arg::Null, Arg::Null, l.ptr(bw)];
                    if !rms {
                        args.push(Arg::Null);
                    }
                    args.push(Arg::Null);
                    if !rms {
                        args.push(Arg::Null);
                    }
                    args.extend([l.ptr(bs), i64(ROWS), i32(h), Arg::F64(EPS)]);
                    let out = l
                        .run(&format!("{kind}_fwd_{s}"), (2, 1, 1), (block, 1, 1), args)
                        .unwrap_or_else(|e| panic!("{what} statistics only: {e}"));
                    differ += check(
                        &format!("{what} rstd only"),
                        DType::F32,
                        &dec(DType::F32, &out[bs.0]),
                        &rstd,
                        1,
                    );

                    // Backward: dx with the residual branch's gradient added, dx over dy when
                    // the dtypes allow; the weight gradients in row groups, then reduced.
                    let mut dx = dy.clone();
                    let (dw, db) = if rms {
                        (norm::rms_norm_grad(&sum, &w, &mut dx, EPS), Vec::new())
                    } else {
                        norm::layer_norm_grad(&sum, &w, &mut dx, EPS)
                    };
                    let dx: Vec<f32> = dx
                        .iter()
                        .zip(&dadd)
                        .map(|(&g, &a)| round_to(ti, round_to(ti, g) + a))
                        .collect();
                    let mut l = Launcher::new("norm.cu");
                    let bs_ = l.buf(enc(ti, &sum), skew);
                    let bdy = l.buf(enc(to, &dy), oskew);
                    let bw = l.buf(f32s(&w), wskew);
                    let (bm, br) = (l.buf(f32s(&mean), 0), l.buf(f32s(&rstd), 0));
                    let ba = l.buf(enc(ti, &dadd), skew);
                    let bdx = if ti == to {
                        bdy
                    } else {
                        l.out(n * ti.size_bytes(), skew)
                    };
                    // The low copy of dx (the cast to the products' dtype) on every other
                    // width, so the null pointer is covered too.
                    let low = (h % 4 == 1 || h == 776).then(|| l.out(n * to.size_bytes(), oskew));
                    let mut args = vec![l.ptr(bs_), l.ptr(bdy), l.ptr(bw)];
                    if !rms {
                        args.push(l.ptr(bm));
                    }
                    args.extend([l.ptr(br), l.ptr(ba), l.ptr(bdx)]);
                    args.push(low.map_or(Arg::Null, |b| l.ptr(b)));
                    args.extend([i64(ROWS), i32(h)]);
                    let what = format!("{kind}_bwd_{s} h={h} block={block}");
                    let out = l
                        .run(&format!("{kind}_bwd_{s}"), (3, 1, 1), (block, 1, 1), args)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    differ += check(&what, ti, &dec(ti, &out[bdx.0]), &dx, 1);
                    if let Some(b) = low {
                        let want: Vec<f32> = dx.iter().map(|&v| round_to(to, v)).collect();
                        differ +=
                            check(&format!("{what} dx_low"), to, &dec(to, &out[b.0]), &want, 1);
                    }

                    // Row groups of 2 (a lane or none each) and of 5 (one group, 5 lanes).
                    let per = if h % 2 == 0 { 2usize } else { ROWS };
                    let groups = ROWS.div_ceil(per);
                    let weight_block = (32u32, 8u32, 1u32);
                    let grid = (h.div_ceil(256) as u32, groups as u32, 1);
                    let mut l = Launcher::new("norm.cu");
                    let bs_ = l.buf(enc(ti, &sum), skew);
                    let bdy = l.buf(enc(to, &dy), oskew);
                    let (bm, br) = (l.buf(f32s(&mean), 0), l.buf(f32s(&rstd), 0));
                    let (pw, pb) = (l.out(groups * h * 8, 0), l.out(groups * h * 8, 0));
                    // The sums, in one launch: the bias's left out on every other width (a
                    // gradient nobody reads), so the null pointer is covered too.
                    let bo_w = l.out(h * 4, 4);
                    let bo_b = (h % 4 != 1).then(|| l.out(h * 4, 4));
                    let done = l.buf(vec![0; 4 * grid.0 as usize], 0);
                    let mut args = vec![l.ptr(bs_), l.ptr(bdy)];
                    if !rms {
                        args.push(l.ptr(bm));
                    }
                    args.extend([l.ptr(br), l.ptr(pw)]);
                    if !rms {
                        args.push(l.ptr(pb));
                    }
                    args.push(l.ptr(bo_w));
                    if !rms {
                        args.push(bo_b.map_or(Arg::Null, |b| l.ptr(b)));
                    }
                    args.extend([l.ptr(done), i64(ROWS), i32(h), i32(per)]);
                    let what = format!("{kind}_bwd_weight_{s} h={h}");
                    let out = l
                        .run(&format!("{kind}_bwd_weight_{s}"), grid, weight_block, args)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let sums = [(Some(bo_w), &dw, "dw"), (bo_b, &db, "db")];
                    for (buf, want, name) in sums {
                        let Some(buf) = buf.filter(|_| !want.is_empty()) else {
                            continue;
                        };
                        differ += check(
                            &format!("{what} {name}"),
                            DType::F32,
                            &dec(DType::F32, &out[buf.0]),
                            want,
                            1,
                        );
                    }
                    // The last group of each column block leaves its counter at zero, ready
                    // for the next launch.
                    assert!(out[done.0].iter().all(|&b| b == 0), "{what}: counters");
                }
            }
        }
    }
    println!("norms: {differ} elements 1 ulp from the twin");
}

/// The `*_fwd_fp8` kernels: the output as the plain forward stores it; its E4M3 cast the bytes
/// `castor_ir::fp8` makes of that output times the scale (saturating: the scale sends some
/// values past 448); the partials' maximum its amax (NaN where a row holds one). Each with `y`
/// stored, with `y` null (the cast alone) and without the cast (the amax alone, current
/// scaling's), on both paths of the kernel.
#[test]
fn norms_with_an_fp8_tail_write_the_cast_and_amax_of_their_output() {
    use castor_ir::fp8::{Fp8Format, Overflow};
    let mut rng = Rng::new(17);
    let scale = 96.0f32;
    let blocks = 3u32;
    for (ti, to) in pairs() {
        let s = crate::cuda::emulate::kernel_tests::io(ti, to);
        // (h, aligned, block, a NaN in the input)
        let cases = [
            (33usize, false, 64u32, false),
            (64, true, 32, false),
            (776, true, 128, true),
            (2048, true, 256, false),
            (2048, true, 64, false),
        ];
        for (h, aligned, block, nan) in cases {
            let skew = if aligned { 0 } else { ti.size_bytes() as u64 };
            let oskew = if aligned { 0 } else { to.size_bytes() as u64 };
            let n = ROWS * h;
            let mut x = rng.values(n, 3.0, ti);
            if nan {
                x[2 * h + 5] = f32::NAN;
            }
            let res = rng.values(n, 1.0, ti);
            let w = rng.values(h, 2.0, DType::F32);
            let b = rng.values(h, 0.5, DType::F32);
            for rms in [false, true] {
                let kind = if rms { "rms_norm" } else { "layer_norm" };
                // The plain forward's output: what the cast reads in the unfused plan.
                let run = |entry: &str, y: bool, cast: bool| -> (Vec<u8>, Vec<u8>, Vec<f32>) {
                    let fp8 = entry.contains("fp8");
                    let mut l = Launcher::new("norm.cu");
                    let (bx, br) = (l.buf(enc(ti, &x), skew), l.buf(enc(ti, &res), skew));
                    let (bw, bb) = (l.buf(f32s(&w), 0), l.buf(f32s(&b), 0));
                    let by = l.out(n * to.size_bytes(), oskew);
                    let (bm, bs) = (l.out(ROWS * 4, 0), l.out(ROWS * 4, 0));
                    let bscale = l.buf(f32s(&[scale]), 0);
                    let bq = l.out(n, if aligned { 0 } else { 1 });
                    let bp = l.out(blocks as usize * 4, 0);
                    let mut args = vec![l.ptr(bx), Arg::Null, l.ptr(br), Arg::Null, l.ptr(bw)];
                    if !rms {
                        args.push(l.ptr(bb));
                    }
                    args.push(if y { l.ptr(by) } else { Arg::Null });
                    if !rms {
                        args.push(l.ptr(bm));
                    }
                    args.push(l.ptr(bs));
                    if fp8 {
                        if cast {
                            args.extend([l.ptr(bscale), l.ptr(bq)]);
                        } else {
                            args.extend([Arg::Null, Arg::Null]);
                        }
                        args.push(l.ptr(bp));
                    }
                    args.extend([i64(ROWS), i32(h), Arg::F64(EPS)]);
                    let what = format!("{entry} h={h} block={block} y={y} cast={cast}");
                    let out = l
                        .run(entry, (blocks, 1, 1), (block, 1, 1), args)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let partials = dec(DType::F32, &out[bp.0]);
                    (out[by.0].clone(), out[bq.0].clone(), partials)
                };
                let (y, _, _) = run(&format!("{kind}_fwd_{s}"), true, false);
                let yv = dec(to, &y);
                let want_q: Vec<u8> = yv
                    .iter()
                    .map(|&v| Fp8Format::E4M3.encode(v * scale, Overflow::Saturate))
                    .collect();
                let want_amax = crate::cpu::fp8::amax(&yv);
                let entry = format!("{kind}_fwd_fp8_{s}");
                for (with_y, cast) in [(true, true), (false, true), (true, false)] {
                    let what = format!("{entry} h={h} block={block} y={with_y} cast={cast}");
                    let (y2, q, partials) = run(&entry, with_y, cast);
                    if with_y {
                        assert_eq!(y2, y, "{what}: y is not the plain forward's");
                    }
                    if cast {
                        if let Some(i) = (0..n).find(|&i| q[i] != want_q[i]) {
                            panic!(
                                "{what}: byte {i} of the cast is {:#04x}, not {:#04x} ({:e} x {scale})",
                                q[i], want_q[i], yv[i]
                            );
                        }
                    }
                    let amax = crate::cpu::fp8::amax(&partials);
                    assert!(
                        amax.to_bits() == want_amax.to_bits()
                            || (amax.is_nan() && want_amax.is_nan()),
                        "{what}: amax {amax:e}, not {want_amax:e}"
                    );
                    assert_eq!(want_amax.is_nan(), nan, "{what}: the case's NaN");
                }
            }
        }
    }
}
