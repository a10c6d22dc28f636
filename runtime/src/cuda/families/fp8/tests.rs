//! `fp8.cu` against `cpu/fp8.rs` and `castor_ir::fp8`, bit for bit: the FP8 bytes of every
//! BF16 and F16 bit pattern and of F32 values across every binade, ties and the edges of both
//! formats (NaN of either sign, infinities, F32 subnormals), times several scales; amaxes and
//! scales over awkward sizes, grids and alignments, with NaN and all-zero tensors; the
//! dequantization factors.

use crate::cpu::fp8 as twin;
use crate::cuda::emulate::kernel_tests::{dec, enc, grid_1d, i32, i64, Buf, Launcher, Rng, SIZES};
use crate::cuda::program::{Arg, Field};
use castor_ir::fp8::{Fp8Format, Overflow};
use castor_ir::DType;

const FORMATS: [(Fp8Format, &str); 2] = [(Fp8Format::E4M3, "e4m3"), (Fp8Format::E5M2, "e5m2")];
const INPUTS: [(DType, &str); 3] = [
    (DType::F32, "f32"),
    (DType::F16, "f16"),
    (DType::BF16, "bf16"),
];

pub(crate) fn entries() -> Vec<String> {
    let mut out: Vec<String> = [
        "fp8_scale_finalize",
        "fp8_amax_finalize",
        "fp8_amax_history",
        "fp8_dequantization",
    ]
    .map(String::from)
    .to_vec();
    for (_, t) in INPUTS {
        out.push(format!("fp8_amax_{t}"));
        for (_, f) in FORMATS {
            out.push(format!("fp8_quantize_{t}_{f}"));
        }
    }
    out
}

fn scalar(l: &mut Launcher, v: f32) -> Buf {
    l.buf(v.to_le_bytes().to_vec(), 0)
}

fn f32_of(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The bytes `x * scale` quantizes to, by the twin: castor_ir's saturating encoding of the F32
/// product.
fn want_bytes(f: Fp8Format, x: &[f32], scale: f32) -> Vec<u8> {
    x.iter()
        .map(|&v| f.encode(v * scale, Overflow::Saturate))
        .collect()
}

/// Quantizes `raw` (elements of `dtype`, `n` of them) with `scale` through
/// `fp8_quantize_<t>_<f>` on `blocks` blocks, pointers `skew` bytes off alignment; the bytes
/// and the amax (through `fp8_amax_finalize`).
fn quantize(
    dtype: DType,
    f: Fp8Format,
    raw: Vec<u8>,
    scale: f32,
    blocks: u32,
    skew: (u64, u64),
) -> (Vec<u8>, f32) {
    let n = raw.len() / dtype.size_bytes();
    let name = format!(
        "fp8_quantize_{}_{}",
        INPUTS.iter().find(|i| i.0 == dtype).map_or("?", |i| i.1),
        f
    );
    let mut l = Launcher::new("fp8.cu");
    let bx = l.buf(raw, skew.0);
    let bs = scalar(&mut l, scale);
    let bq = l.out(n, skew.1);
    let bp = l.out(blocks as usize * 4, 0);
    let args = vec![l.ptr(bx), i64(n), l.ptr(bs), l.ptr(bq), l.ptr(bp)];
    let out = l
        .run(&name, (blocks, 1, 1), (128, 1, 1), args)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let q = out[bq.0].clone();
    let mut l = Launcher::new("fp8.cu");
    let bp = l.buf(out[bp.0].clone(), 0);
    let ba = l.out(4, 0);
    let args = vec![l.ptr(bp), i32(blocks as usize), l.ptr(ba)];
    let out = l
        .run("fp8_amax_finalize", (1, 1, 1), (64, 1, 1), args)
        .unwrap();
    (q, f32_of(&out[ba.0]))
}

fn assert_bytes(what: &str, got: &[u8], want: &[u8], x: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: element {i} ({:e}, bits {:#010x}) is {:#04x}, castor_ir::fp8's {:#04x}",
            x[i],
            x[i].to_bits(),
            got[i],
            want[i]
        );
    }
}

fn assert_same_f32(what: &str, got: f32, want: f32) {
    assert!(
        got.to_bits() == want.to_bits(),
        "{what}: {got:e} ({:#010x}), the twin's {want:e} ({:#010x})",
        got.to_bits(),
        want.to_bits()
    );
}

/// Every BF16 and every F16 bit pattern, NaNs and infinities included, encodes to castor's
/// byte in both formats (scale 1, so the product is the value itself), and the amax is the
/// twin's (NaN: the patterns hold NaNs).
#[test]
fn every_bf16_and_f16_pattern_quantizes_as_castor() {
    for (dtype, _) in [INPUTS[1], INPUTS[2]] {
        let raw: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        let x = dec(dtype, &raw);
        for (f, _) in FORMATS {
            let (q, amax) = quantize(dtype, f, raw.clone(), 1.0, 13, (0, 0));
            assert_bytes(&format!("{dtype} {f}"), &q, &want_bytes(f, &x, 1.0), &x);
            assert_same_f32(&format!("{dtype} {f} amax"), amax, twin::amax(&x));
            assert!(amax.is_nan());
        }
        // Without the NaNs the amax is the largest finite value or infinity.
        let finite: Vec<f32> = x.iter().copied().filter(|v| !v.is_nan()).collect();
        let (_, amax) = quantize(dtype, Fp8Format::E4M3, enc(dtype, &finite), 1.0, 5, (0, 0));
        assert_same_f32(&format!("{dtype} amax"), amax, twin::amax(&finite));
    }
}

/// F32 values: random bit patterns over every exponent, each format's ties (midpoints between
/// neighbouring values, just below and above them), the overflow edges, NaN of both signs,
/// infinities and subnormals, times scales of 1, a power of two, an awkward scale and a tiny
/// one, at pointers off alignment.
#[test]
fn f32_values_quantize_as_castor_at_every_scale() {
    let mut rng = Rng::new(8);
    let mut x: Vec<f32> = (0..20_000)
        .map(|_| f32::from_bits(rng.next() as u32))
        .collect();
    for f in Fp8Format::ALL {
        let mut values: Vec<f32> = (0..=f.max_byte()).map(|b| f.decode(b)).collect();
        values.sort_by(|a, b| a.total_cmp(b));
        for w in values.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for v in [
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
                w[0],
            ] {
                x.push(v);
                x.push(-v);
            }
        }
    }
    x.extend([
        0.0,
        -0.0,
        464.0,
        464.03125,
        61439.996,
        61440.0,
        1e9,
        -1e30,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7F80_0001),
        f32::from_bits(1),
        f32::from_bits(0x8000_0001),
        f32::MIN_POSITIVE,
    ]);
    for (f, name) in FORMATS {
        for scale in [1.0f32, 64.0, 224.0 / 3.0, 1e-3, 2f32.powi(-20)] {
            for (blocks, skew) in [(7, (0, 0)), (1, (4, 1)), (40, (8, 3))] {
                let (q, amax) =
                    quantize(DType::F32, f, enc(DType::F32, &x), scale, blocks, skew);
                let what = format!("f32 {name} scale {scale:e} blocks {blocks} skew {skew:?}");
                assert_bytes(&what, &q, &want_bytes(f, &x, scale), &x);
                assert_same_f32(&what, amax, twin::amax(&x));
            }
        }
    }
}

/// The scaled cast against `cpu::fp8::quantize` (the values the CPU executor stores) and the
/// amax, at every size's tail and alignment, for each input dtype.
#[test]
fn quantize_equals_the_twin_at_every_size() {
    let mut rng = Rng::new(81);
    for (dtype, _) in INPUTS {
        for n in SIZES.into_iter().chain([4096 + 7]) {
            let x = rng.values(n, 300.0, dtype);
            let scale = twin::scale(Fp8Format::E4M3, twin::amax(&x), 0);
            for (f, name) in FORMATS {
                let want: Vec<u8> = twin::quantize(f, &x, scale)
                    .iter()
                    .map(|&v| f.encode(v, Overflow::Saturate))
                    .collect();
                for skew in [(0, 0), (2 * dtype.size_bytes() as u64, 5)] {
                    let (q, amax) = quantize(dtype, f, enc(dtype, &x), scale, 3, skew);
                    let what = format!("{dtype} {name} n={n} skew {skew:?}");
                    assert_bytes(&what, &q, &want, &x);
                    assert_same_f32(&what, amax, twin::amax(&x));
                }
            }
        }
    }
}

/// `fp8_amax_<t>` then `fp8_scale_finalize` against `cpu::fp8::{amax, scale}`: random data,
/// all zeros (the floor), a NaN (the floor's scale, as the twin's maxNum gives), an infinity
/// (scale 0), margins 0, 1, 5 and 1024 (an infinite divisor), on grids of 1 to 64 blocks.
#[test]
fn amax_and_scale_equal_the_twin() {
    let mut rng = Rng::new(5);
    for (dtype, t) in INPUTS {
        for n in SIZES.into_iter().chain([10_000]) {
            let random = rng.values(n, 7.0, dtype);
            let mut with_nan = random.clone();
            with_nan[n / 2] = f32::NAN;
            let mut with_inf = random.clone();
            with_inf[n - 1] = f32::NEG_INFINITY;
            for (case, x) in [
                ("random", random),
                ("zeros", vec![0.0; n]),
                ("nan", with_nan),
                ("inf", with_inf),
            ] {
                // The partial maxima depend on the grid, not on the format or margin: one
                // amax launch per grid, then the finalize for each format and margin.
                for (blocks, skew) in [(1u32, 0u64), (3, 2), (64, 0)] {
                    let name = format!("fp8_amax_{t}");
                    let mut l = Launcher::new("fp8.cu");
                    let bx = l.buf(enc(dtype, &x), skew * dtype.size_bytes() as u64);
                    let bp = l.out(blocks as usize * 4, 0);
                    let args = vec![l.ptr(bx), i64(n), l.ptr(bp)];
                    let (_, block) = grid_1d(n, 256);
                    let out = l.run(&name, (blocks, 1, 1), block, args).unwrap();
                    let partials = out[bp.0].clone();
                    for (f, _) in FORMATS {
                        for margin in [0usize, 1, 5, 1024] {
                            let mut l = Launcher::new("fp8.cu");
                            let bp = l.buf(partials.clone(), 0);
                            let bs = l.out(4, 0);
                            let args = vec![
                                l.ptr(bp),
                                i32(blocks as usize),
                                Arg::F64(f64::from(f.max())),
                                Arg::F64(2f64.powi(margin as i32)),
                                l.ptr(bs),
                            ];
                            let out = l
                                .run("fp8_scale_finalize", (1, 1, 1), (32, 1, 1), args)
                                .unwrap();
                            let want = twin::scale(f, twin::amax(&x), margin);
                            let what = format!(
                                "{t} {case} n={n} {f} margin {margin} blocks {blocks}"
                            );
                            assert_same_f32(&what, f32_of(&out[bs.0]), want);
                        }
                    }
                }
            }
        }
    }
}

/// The two reciprocals, as `cpu::fp8::dequantization` forms them before their product, for
/// every product of one launch (a grid with threads to spare, two products sharing a scale).
#[test]
fn dequantization_factors_are_the_reciprocals() {
    let mut rng = Rng::new(3);
    let mut pairs: Vec<(f32, f32)> = (0..50)
        .map(|_| {
            let v = rng.values(2, 1e4, DType::F32);
            (v[0].abs() + 1e-3, v[1].abs() * 1e9)
        })
        .collect();
    pairs.extend([(0.0, -0.0), (f32::NAN, f32::INFINITY), (448.0 / 1e-12, 3.0)]);
    let mut l = Launcher::new("fp8.cu");
    let scales: Vec<(Buf, Buf)> = pairs
        .iter()
        .map(|&(a, b)| (scalar(&mut l, a), scalar(&mut l, b)))
        .collect();
    let factors = l.out(8 * pairs.len(), 0);
    let mut rows: Vec<Vec<Field>> = scales
        .iter()
        .enumerate()
        .map(|(i, &(ba, bb))| {
            vec![
                Field::Ptr(l.place(ba)),
                Field::Ptr(l.place(bb)),
                Field::Ptr(l.place(factors).plus(8 * i as u64)),
            ]
        })
        .collect();
    // The first product's a scale read again by one more product, written past the others.
    let extra = l.out(8, 0);
    rows.push(vec![
        Field::Ptr(l.place(scales[0].0)),
        Field::Ptr(l.place(scales[1].1)),
        Field::Ptr(l.place(extra)),
    ]);
    let count = rows.len();
    let table = l.table(rows);
    let out = l
        .run("fp8_dequantization", (2, 1, 1), (64, 1, 1), vec![table, i32(count)])
        .unwrap();
    let mut got: Vec<(f32, f32)> = out[factors.0]
        .chunks(8)
        .map(|c| (f32_of(&c[..4]), f32_of(&c[4..])))
        .collect();
    got.push((f32_of(&out[extra.0][..4]), f32_of(&out[extra.0][4..])));
    let mut want = pairs.clone();
    want.push((pairs[0].0, pairs[1].1));
    for (&(fa, fb), &(a, b)) in got.iter().zip(&want) {
        assert_same_f32(&format!("1/{a:e}"), fa, 1.0 / a);
        assert_same_f32(&format!("1/{b:e}"), fb, 1.0 / b);
        let product = fa * fb;
        let want = twin::dequantization(a, b);
        assert!(product.to_bits() == want.to_bits() || (product.is_nan() && want.is_nan()));
    }
}

/// `fp8_amax_history` against `cpu::fp8::amax_history`: histories of 1 to 16 with random
/// amaxes, zeros (the scale kept), a NaN or an infinity anywhere (kept), an amax so small the
/// scale overflows (F32's largest), margins 0 and 3, both formats; and written in place (the
/// next history and scale over the old ones), as a plan's write back makes it. Each format and
/// length is one launch of all its cases, as a batch unit runs them.
#[test]
fn amax_history_equals_the_twin() {
    let mut rng = Rng::new(11);
    for (f, _) in FORMATS {
        for length in [1usize, 2, 3, 16] {
            let random: Vec<f32> = rng
                .values(length, 50.0, DType::F32)
                .into_iter()
                .map(f32::abs)
                .collect();
            let mut with_nan = random.clone();
            with_nan[length / 2] = f32::NAN;
            let mut with_inf = random.clone();
            with_inf[0] = f32::INFINITY;
            // Every case of this format and length is a row of one launch (a batch).
            let mut l = Launcher::new("fp8.cu");
            let mut rows = Vec::new();
            let mut checks = Vec::new();
            for (case, history, amax) in [
                ("random", random.clone(), 3.5f32),
                ("zeros", vec![0.0; length], 0.0),
                ("nan history", with_nan, 1.0),
                ("inf history", with_inf, 1.0),
                ("nan amax", random.clone(), f32::NAN),
                ("tiny", vec![0.0; length], f32::from_bits(1)),
            ] {
                for margin in [0usize, 3] {
                    for in_place in [false, true] {
                        let bh = l.buf(enc(DType::F32, &history), 0);
                        let bs = scalar(&mut l, 7.0);
                        let ba = scalar(&mut l, amax);
                        let (bh2, bs2) = if in_place {
                            (bh, bs)
                        } else {
                            (l.out(length * 4, 0), l.out(4, 0))
                        };
                        rows.push(vec![
                            Field::Ptr(l.place(bh)),
                            Field::Ptr(l.place(bs)),
                            Field::Ptr(l.place(ba)),
                            Field::Ptr(l.place(bh2)),
                            Field::Ptr(l.place(bs2)),
                            Field::F64(f64::from(f.max())),
                            Field::F64(2f64.powi(margin as i32)),
                            Field::I32(length as i32),
                            Field::I32(0),
                        ]);
                        let want = twin::amax_history(f, margin, &history, 7.0, amax);
                        let what = format!("{f} {case} length {length} margin {margin}");
                        checks.push((what, bh2, bs2, want));
                    }
                }
            }
            let count = rows.len();
            let table = l.table(rows);
            let out = l
                .run("fp8_amax_history", (2, 1, 1), (32, 1, 1), vec![table, i32(count)])
                .unwrap();
            for (what, bh2, bs2, (want_h, want_s)) in checks {
                let got_h = dec(DType::F32, &out[bh2.0]);
                assert_eq!(got_h.len(), want_h.len(), "{what}");
                for (g, w) in got_h.iter().zip(&want_h) {
                    assert_same_f32(&what, *g, *w);
                }
                assert_same_f32(&what, f32_of(&out[bs2.0]), want_s);
            }
        }
    }
}
