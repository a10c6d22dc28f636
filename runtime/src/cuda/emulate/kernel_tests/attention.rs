//! `attention.cu` against `cpu/attention.rs`. The kernels and the twin round at the same
//! points (P and dS to the operand dtype where they enter a product, o and the gradients once
//! at the end); they sum in other orders (the tensor-core kernels in F32, 16 products at a
//! time and tile by tile; the twin in F64, key by key), the online softmax rescales its running
//! sums as the maximum grows, and the exponentials are CUDA's `expf` form against the twin's.
//! So results agree to a bound, not bit for bit; the bounds below are the measured worst case
//! with a margin, stated as a relative error ‖a−b‖/‖b‖ per output (and, for the F32 kernels,
//! whose sums are the twin's F64 sums, in units in the last place per element).

use super::{dec, enc, i32, i64, Launcher, Rng};
use crate::cpu::attention::{attention, attention_grad, Operand, Problem};
use crate::cuda::program::Arg;
use castor_ir::{relative_error, round_to, DType};
use castor_kernels::attention::{self as geometry, Kernel};

/// Each dtype with its tiles (`None`: the F32 warp-per-row kernels) and the head dims tried
/// at each: the tile itself, and at the two narrow tiles a width that leaves part of the tile
/// as zero padding (the padding code is the same at every tile; the wide tiles cost the most
/// time on the host, under the sanitizers most of all).
fn variants() -> Vec<(DType, &'static str, Option<u32>, Vec<usize>)> {
    let mut v = vec![(DType::F32, "f32", None, vec![8, 33, 100])];
    for (dtype, sfx) in [(DType::F16, "f16"), (DType::BF16, "bf16")] {
        for p in geometry::TILES {
            let d = p as usize;
            let dims = if d <= 32 {
                vec![d, d - d / 4 + 1]
            } else {
                vec![d]
            };
            v.push((dtype, sfx, Some(p), dims));
        }
    }
    v
}

pub(super) fn entries() -> Vec<String> {
    let mut out = Vec::new();
    for (_, sfx, tile, _) in variants() {
        let suffix = tile.map_or(sfx.to_string(), |p| format!("{sfx}_d{p}"));
        for k in ["fwd", "bwd_dq", "bwd_dkdv"] {
            out.push(format!("attention_{k}_{suffix}"));
        }
    }
    for sfx in ["f32", "f16", "bf16"] {
        out.push(format!("attention_bwd_delta_{sfx}"));
    }
    out
}

/// One problem: `nb` batches of `hkv` kv heads, each shared by `g` query heads; `t` queries,
/// `s` keys; a causal mask, narrowed by a sliding `window`, and/or a padding mask (one row of
/// keys per batch; the last batch keeps no key, so its rows are uniform; with one batch, every
/// third key is masked, so a window of one key sees none in every third row).
#[derive(Clone, Copy, Debug)]
struct Case {
    nb: usize,
    hkv: usize,
    g: usize,
    t: usize,
    s: usize,
    causal: bool,
    window: Option<usize>,
    masked: bool,
}

impl Case {
    fn bq(&self) -> usize {
        self.nb * self.hkv * self.g
    }
}

const CASES: [Case; 5] = [
    Case {
        nb: 1,
        hkv: 1,
        g: 1,
        t: 1,
        s: 1,
        causal: false,
        window: None,
        masked: false,
    },
    Case {
        nb: 1,
        hkv: 2,
        g: 1,
        t: 33,
        s: 33,
        causal: true,
        window: None,
        masked: false,
    },
    Case {
        nb: 2,
        hkv: 1,
        g: 2,
        t: 65,
        s: 70,
        causal: true,
        window: None,
        masked: true,
    },
    // A sliding window: the last query tile skips the first key tile, the last key block
    // skips the first query tiles.
    Case {
        nb: 2,
        hkv: 1,
        g: 2,
        t: 65,
        s: 70,
        causal: true,
        window: Some(5),
        masked: true,
    },
    // A window of one key over a mask with holes: rows whose key is masked see none.
    Case {
        nb: 1,
        hkv: 1,
        g: 1,
        t: 33,
        s: 33,
        causal: true,
        window: Some(1),
        masked: true,
    },
];

/// The largest relative error of any output, by dtype: the measured worst (F32 1.6e-7, F16
/// 7.9e-5, BF16 5.9e-4) with a margin of about 2. F32 differs in the online rescaling and
/// `expf`; F16 and BF16 mostly where an F32 value a few ulps from the twin's rounds to the
/// neighbouring F16/BF16 value (P and dS entering a product, o and the gradients at the end).
/// The BF16 worst is the forward's o under a window of 5 keys: an average of 5 values, each
/// weight rounded to BF16 (2^-8 relative) as it enters the product, averages those roundings
/// out less than the unwindowed rows' 70 (there the worst is 2.3e-4).
fn bound(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 3e-7,
        DType::F16 => 2e-4,
        _ => 1.2e-3,
    }
}

struct Worst {
    what: String,
    err: f64,
}

#[test]
fn attention_kernels_agree_with_the_twin() {
    let mut rng = Rng::new(11);
    let mut worst: Vec<(DType, Worst)> = Vec::new();
    for (dtype, sfx, tile, dims) in variants() {
        let suffix = tile.map_or(sfx.to_string(), |p| format!("{sfx}_d{p}"));
        for d in dims {
            for case in CASES {
                for (what, err) in run_case(&mut rng, dtype, &suffix, tile, d, case) {
                    assert!(
                        err <= bound(dtype),
                        "{what}: relative error {err:.3e} over the bound {:.1e}",
                        bound(dtype)
                    );
                    match worst.iter_mut().find(|(t, _)| *t == dtype) {
                        Some((_, w)) if w.err >= err => {}
                        Some((_, w)) => *w = Worst { what, err },
                        None => worst.push((dtype, Worst { what, err })),
                    }
                }
            }
        }
    }
    for (dtype, w) in worst {
        println!(
            "attention {dtype:?}: worst relative error {:.2e} ({})",
            w.err, w.what
        );
    }
}

/// Runs the forward, delta, dq and dk/dv kernels of one case beside the twin; returns each
/// output's relative error.
fn run_case(
    rng: &mut Rng,
    dtype: DType,
    suffix: &str,
    tile: Option<u32>,
    d: usize,
    c: Case,
) -> Vec<(String, f64)> {
    let (bq, bkv) = (c.bq(), c.nb * c.hkv);
    let scale = 1.0 / (d as f64).sqrt();
    let q = rng.values(bq * c.t * d, 1.0, dtype);
    let k = rng.values(bkv * c.s * d, 1.0, dtype);
    let v = rng.values(bkv * c.s * d, 1.0, dtype);
    // Batch 0 keeps two keys in three; the last batch (when there are two) keeps none.
    let keep: Vec<bool> = (0..c.nb * c.s)
        .map(|i| i / c.s + 1 < c.nb || (c.nb == 1 && i % 3 != 1))
        .collect();
    let (q_shape, kv_shape) = ([c.nb, c.hkv, c.g, c.t, d], [c.nb, c.hkv, 1, c.s, d]);
    let mask_shape = [c.nb, 1, 1, 1, c.s];
    let problem = Problem {
        q: &q_shape,
        k: &kv_shape,
        v: &kv_shape,
        mask: c.masked.then_some((&keep[..], &mask_shape[..])),
        causal: c.causal,
        window: c.window,
        scale,
        operand: Operand::Dtype(dtype),
    };
    let (o, lse) = attention(&q, &k, &v, &problem);
    let o: Vec<f32> = o.iter().map(|&x| round_to(dtype, x)).collect();
    let d_o = rng.values(bq * c.t * d, 1.0, dtype);
    let (dq, dk, dv) = attention_grad(&q, &k, &v, &o, &lse, &d_o, &problem);
    let round = |x: Vec<f32>| -> Vec<f32> { x.iter().map(|&x| round_to(dtype, x)).collect() };
    let (dq, dk, dv) = (round(dq), round(dk), round(dv));
    // D = rowsum(dO * O), F64 in order, as the twin computes it.
    let delta: Vec<f32> = (0..bq * c.t)
        .map(|r| {
            let dot: f64 = (0..d)
                .map(|j| f64::from(d_o[r * d + j]) * f64::from(o[r * d + j]))
                .sum();
            dot as f32
        })
        .collect();

    let elem = dtype.size_bytes();
    let name = |k: &str| format!("attention_{k}_{suffix} d={d} {c:?}");
    let shape_args = |batches: usize| -> Vec<Arg> {
        vec![
            i64(batches),
            i32(c.t),
            i32(c.s),
            i32(d),
            i32(c.g),
            i32(c.hkv * c.g),
            i32(usize::from(c.causal)),
            i32(c.window.unwrap_or(0)),
            Arg::F64(scale),
        ]
    };
    let launch = |l: &mut Launcher, kernel: Kernel| {
        let grid = geometry::grid(
            kernel,
            tile.is_some(),
            bq as u32,
            c.g as u32,
            c.t as u32,
            c.s as u32,
        );
        l.shared(tile.map_or(0, |p| geometry::shared_bytes(kernel, p, elem as u32)));
        (grid, (geometry::THREADS, 1, 1))
    };
    let mask_bytes: Vec<u8> = keep.iter().map(|&k| u8::from(k)).collect();
    let mut errors = Vec::new();

    // Forward.
    let mut l = Launcher::new("attention.cu");
    let bqv = l.buf(enc(dtype, &q), elem as u64);
    let bk = l.buf(enc(dtype, &k), 0);
    let bv = l.buf(enc(dtype, &v), 0);
    let bm = l.buf(mask_bytes.clone(), 1);
    let bo = l.out(bq * c.t * d * elem, 0);
    let blse = l.out(bq * c.t * 4, 0);
    let mask_arg = |l: &Launcher| if c.masked { l.ptr(bm) } else { Arg::Null };
    let mut args = vec![
        l.ptr(bqv),
        l.ptr(bk),
        l.ptr(bv),
        mask_arg(&l),
        l.ptr(bo),
        l.ptr(blse),
    ];
    args.extend(shape_args(bq));
    let (grid, block) = launch(&mut l, Kernel::Forward);
    let what = name("fwd");
    let out = l
        .run(&format!("attention_fwd_{suffix}"), grid, block, args)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    errors.push((
        format!("{what} o"),
        relative_error(&dec(dtype, &out[bo.0]), &o),
    ));
    errors.push((
        format!("{what} lse"),
        relative_error(&dec(DType::F32, &out[blse.0]), &lse),
    ));

    // delta.
    let sfx = suffix.split('_').next().unwrap_or(suffix);
    let mut l = Launcher::new("attention.cu");
    let bo = l.buf(enc(dtype, &o), 0);
    let bdo = l.buf(enc(dtype, &d_o), elem as u64);
    let bdelta = l.out(bq * c.t * 4, 0);
    let args = vec![l.ptr(bo), l.ptr(bdo), l.ptr(bdelta), i64(bq * c.t), i32(d)];
    let what = format!("attention_bwd_delta_{sfx} d={d} {c:?}");
    let out = l
        .run(
            &format!("attention_bwd_delta_{sfx}"),
            geometry::delta_grid((bq * c.t) as u64),
            (geometry::THREADS, 1, 1),
            args,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    errors.push((
        what,
        relative_error(&dec(DType::F32, &out[bdelta.0]), &delta),
    ));

    // The gradients, from the twin's o, lse and delta.
    let grads = |kernel: Kernel| -> Vec<Vec<f32>> {
        let mut l = Launcher::new("attention.cu");
        let bqv = l.buf(enc(dtype, &q), 0);
        let bk = l.buf(enc(dtype, &k), elem as u64);
        let bv = l.buf(enc(dtype, &v), 0);
        let bm = l.buf(mask_bytes.clone(), 0);
        let bdo = l.buf(enc(dtype, &d_o), 0);
        let blse = l.buf(enc(DType::F32, &lse), 0);
        let bdelta = l.buf(enc(DType::F32, &delta), 0);
        let mut args = vec![
            l.ptr(bqv),
            l.ptr(bk),
            l.ptr(bv),
            if c.masked { l.ptr(bm) } else { Arg::Null },
            l.ptr(bdo),
            l.ptr(blse),
            l.ptr(bdelta),
        ];
        let (entry, outs) = if kernel == Kernel::Dq {
            let b = l.out(bq * c.t * d * elem, 0);
            args.push(l.ptr(b));
            args.extend(shape_args(bq));
            ("bwd_dq", vec![b])
        } else {
            let bdk = l.out(bkv * c.s * d * elem, 0);
            let bdv = l.out(bkv * c.s * d * elem, elem as u64);
            args.push(l.ptr(bdk));
            args.push(l.ptr(bdv));
            args.extend(shape_args(bkv));
            ("bwd_dkdv", vec![bdk, bdv])
        };
        let (grid, block) = launch(&mut l, kernel);
        let what = name(entry);
        let out = l
            .run(&format!("attention_{entry}_{suffix}"), grid, block, args)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        outs.iter().map(|b| dec(dtype, &out[b.0])).collect()
    };
    // With one key (or one visible key per row) dq and dk are zero in exact arithmetic: the
    // score gradient dS = P (dP - D) is the difference of two sums of the same products in
    // other orders. There the error is measured against the incoming gradient's norm.
    let gradient_error = |got: &[f32], want: &[f32]| {
        if want.iter().all(|&x| x == 0.0) {
            relative_error(got, &vec![0.0; got.len()]).min(norm(got) / norm(&d_o))
        } else {
            relative_error(got, want)
        }
    };
    let got = grads(Kernel::Dq);
    errors.push((
        format!("{} dq", name("bwd_dq")),
        gradient_error(&got[0], &dq),
    ));
    let got = grads(Kernel::DkDv);
    errors.push((
        format!("{} dk", name("bwd_dkdv")),
        gradient_error(&got[0], &dk),
    ));
    errors.push((
        format!("{} dv", name("bwd_dkdv")),
        relative_error(&got[1], &dv),
    ));
    errors
}

fn norm(x: &[f32]) -> f64 {
    x.iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt()
}
