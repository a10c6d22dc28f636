//! `optimizer.cu`, `grad_norm.cu` and `loss_scale.cu` against `cpu/optimizer.rs`: the updates
//! and the loss scaler operation by operation, bit for bit; the gradient norm's F64 sums in
//! another order, within 1 ulp.

use crate::cuda::emulate::kernel_tests::{check, dec, dec_i32, enc, i32, Launcher, Rng, FLOATS};
use crate::cpu::optimizer::{self as opt, Control, LossScaler};
use crate::cuda::program::{Arg, Field};
use castor_ir::{round_to, DType};
use super::UpdateRule;
use castor_ir::{AdamWHparams, LionHparams, SgdHparams};

pub(crate) fn entries() -> Vec<String> {
    let mut out: Vec<String> = [
        "grad_norm_partials",
        "grad_norm_finalize",
        "loss_scale_update",
        "count_step",
    ]
    .map(String::from)
    .to_vec();
    for (_, s) in FLOATS {
        for state in ["", "bf16state_"] {
            out.push(format!("adamw_{state}{s}"));
            out.push(format!("sgd_{state}{s}"));
            out.push(format!("lion_{state}{s}"));
        }
    }
    out
}

/// Tensor sizes of one multi-tensor launch: a scalar, awkward lengths, one over a chunk.
const SIZES: [usize; 4] = [1, 33, 1023, 2500];
/// Elements per chunk (the lowering uses 16384; smaller here so tensors span chunks).
const CHUNK: usize = 1000;

/// The chunk table: `{tensor, len, start}` rows covering every tensor.
fn chunks(sizes: &[usize]) -> Vec<Vec<Field>> {
    let mut rows = Vec::new();
    for (t, &n) in sizes.iter().enumerate() {
        for start in (0..n).step_by(CHUNK) {
            rows.push(vec![
                Field::I32(t as i32),
                Field::I32(CHUNK.min(n - start) as i32),
                Field::I64(start as i64),
            ]);
        }
    }
    rows
}

fn scalar(l: &mut Launcher, v: f32) -> crate::cuda::emulate::kernel_tests::Buf {
    l.buf(v.to_le_bytes().to_vec(), 0)
}

fn f32s(v: &[f32]) -> Vec<u8> {
    enc(DType::F32, v)
}

/// Moments in F32 and in BF16: the twin updates in F32 and the executor rounds the stored
/// moments, which the kernel must match bit for bit.
#[test]
fn adamw_sgd_and_lion_updates_equal_the_twin() {
    let mut rng = Rng::new(12);
    for (c, s) in FLOATS {
        for (rule, state) in [UpdateRule::AdamW, UpdateRule::Sgd, UpdateRule::Lion]
            .into_iter()
            .flat_map(|r| [(r, DType::F32), (r, DType::BF16)])
        {
            let adamw = rule == UpdateRule::AdamW;
            // A plain step; clipped with a loss scale; skipped (an inf grad norm).
            for (grad_norm, scale, max_norm) in [
                (0.7f32, 1.0f32, 0.0),
                (3.5, 1024.0, 1.0),
                (f32::INFINITY, 1.0, 0.0),
            ] {
                let control = Control {
                    lr: 1e-3,
                    step: 4.0,
                    scale,
                    grad_norm,
                    max_grad_norm: max_norm,
                };
                let mut l = Launcher::new("optimizer.cu");
                let mut rows = Vec::new();
                let mut bufs = Vec::new();
                let mut want = Vec::new();
                for (t, &n) in SIZES.iter().enumerate() {
                    let wd = if t % 2 == 0 { 0.01 } else { 0.0 };
                    let p = rng.values(n, 1.0, DType::F32);
                    let g = rng.values(n, scale, DType::F32);
                    let m = rng.values(n, 0.1, state);
                    let v: Vec<f32> = rng.values(n, 0.01, state).iter().map(|x| x.abs()).collect();
                    let (mut p2, mut m2, mut v2) = (p.clone(), m.clone(), v.clone());
                    match rule {
                        UpdateRule::AdamW => {
                            let h = AdamWHparams {
                                beta1: 0.9,
                                beta2: 0.999,
                                eps: 1e-8,
                                weight_decay: wd,
                            };
                            opt::adamw(&h, control, &mut p2, &g, &mut m2, &mut v2);
                        }
                        UpdateRule::Sgd => {
                            let h = SgdHparams {
                                momentum: 0.9,
                                weight_decay: wd,
                            };
                            opt::sgd(&h, control, &mut p2, &g, &mut m2);
                        }
                        UpdateRule::Lion => {
                            let h = LionHparams {
                                beta1: 0.9,
                                beta2: 0.99,
                                weight_decay: wd,
                            };
                            opt::lion(&h, control, &mut p2, &g, &mut m2);
                        }
                    }
                    for x in m2.iter_mut().chain(v2.iter_mut()) {
                        *x = round_to(state, *x);
                    }
                    // The tensors' buffers, the first misaligned (scalar paths), a copy on
                    // every tensor but the last.
                    let skew = if t == 0 { 4 } else { 0 };
                    let (bp, bg, bm) = (
                        l.buf(f32s(&p), skew),
                        l.buf(f32s(&g), skew),
                        l.buf(enc(state, &m), skew),
                    );
                    let bv = l.buf(enc(state, &v), skew);
                    let copy = (t + 1 < SIZES.len()).then(|| l.out(n * c.size_bytes(), 0));
                    let mut row = vec![
                        Field::Ptr(l.place(bp)),
                        Field::Ptr(l.place(bg)),
                        Field::Ptr(l.place(bm)),
                    ];
                    if adamw {
                        row.push(Field::Ptr(l.place(bv)));
                    }
                    row.push(copy.map_or(Field::Null, |b| Field::Ptr(l.place(b))));
                    row.extend([Field::I64(n as i64), Field::F64(wd)]);
                    rows.push(row);
                    bufs.push((bp, bm, bv, copy));
                    want.push((p2, m2, v2));
                }
                let tensors = l.table(rows);
                let chunk_rows = chunks(&SIZES);
                let n_chunks = chunk_rows.len();
                let chunk_table = l.table(chunk_rows);
                let (blr, bstep, bscale, bnorm) = (
                    scalar(&mut l, control.lr),
                    scalar(&mut l, control.step),
                    scalar(&mut l, scale),
                    scalar(&mut l, grad_norm),
                );
                let mut args = vec![
                    tensors,
                    chunk_table,
                    i32(n_chunks),
                    l.ptr(blr),
                    l.ptr(bstep),
                    l.ptr(bscale),
                    l.ptr(bnorm),
                ];
                match rule {
                    UpdateRule::AdamW => {
                        args.extend([Arg::F64(0.9), Arg::F64(0.999), Arg::F64(1e-8)])
                    }
                    UpdateRule::Sgd => args.push(Arg::F64(0.9)),
                    UpdateRule::Lion => args.extend([Arg::F64(0.9), Arg::F64(0.99)]),
                }
                args.push(Arg::F64(max_norm));
                // The masters' largest magnitudes per chunk, on every other launch (null on the
                // rest).
                let amax = (grad_norm != 3.5).then(|| l.out(n_chunks * 4, 0));
                args.push(amax.map_or(Arg::Null, |b| l.ptr(b)));
                let entry = format!(
                    "{}_{}{s}",
                    match rule {
                        UpdateRule::AdamW => "adamw",
                        UpdateRule::Sgd => "sgd",
                        UpdateRule::Lion => "lion",
                    },
                    if state == DType::BF16 {
                        "bf16state_"
                    } else {
                        ""
                    }
                );
                let what = format!("{entry} grad_norm={grad_norm} scale={scale}");
                let out = l
                    .run(&entry, (3, 1, 1), (128, 1, 1), args)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                if let Some(b) = amax {
                    // Each tensor's chunks, in order: the maximum of its partials is the
                    // amax of its master as the step left it (fp8_scale's input).
                    let partials = dec(DType::F32, &out[b.0]);
                    let mut at = 0;
                    for (&n, (p, _, _)) in SIZES.iter().zip(&want) {
                        let count = n.div_ceil(CHUNK);
                        let got = crate::cpu::fp8::amax(&partials[at..at + count]);
                        let wanted = crate::cpu::fp8::amax(p);
                        assert_eq!(got.to_bits(), wanted.to_bits(), "{entry} amax of {n}");
                        at += count;
                    }
                    assert_eq!(at, n_chunks);
                }
                for ((bp, bm, bv, copy), (p, m, v)) in bufs.iter().zip(&want) {
                    check(
                        &format!("{what} master"),
                        DType::F32,
                        &dec(DType::F32, &out[bp.0]),
                        p,
                        0,
                    );
                    check(
                        &format!("{what} moment"),
                        state,
                        &dec(state, &out[bm.0]),
                        m,
                        0,
                    );
                    if adamw {
                        check(&format!("{what} v"), state, &dec(state, &out[bv.0]), v, 0);
                    }
                    if let Some(cb) = copy {
                        // The copy is the master rounded, updated or not: a skipped step
                        // leaves the master as it was and writes its copy again (a rank's
                        // copy shard is a fresh buffer nothing else writes).
                        let got = dec(c, &out[cb.0]);
                        let w: Vec<f32> = p.iter().map(|&x| round_to(c, x)).collect();
                        check(&format!("{what} copy"), c, &got, &w, 0);
                    }
                }
            }
        }
    }
}

#[test]
fn the_gradient_norm_over_mixed_dtypes_agrees_with_the_twin() {
    let mut rng = Rng::new(13);
    for poison in [false, true] {
        let dtypes = [DType::F32, DType::F16, DType::BF16, DType::F32];
        let scale = 256.0f32;
        let mut l = Launcher::new("grad_norm.cu");
        let mut rows = Vec::new();
        let mut grads = Vec::new();
        for (t, (&n, &d)) in SIZES.iter().zip(&dtypes).enumerate() {
            let mut g = rng.values(n, 100.0, d);
            if poison && t == 2 {
                g[n / 2] = f32::INFINITY;
            }
            let b = l.buf(enc(d, &g), d.size_bytes() as u64 * (t as u64 % 2));
            let code = match d {
                DType::F16 => 1,
                DType::BF16 => 2,
                _ => 0,
            };
            rows.push(vec![
                Field::Ptr(l.place(b)),
                Field::I64(n as i64),
                Field::I32(code),
                Field::I32(0),
            ]);
            grads.push(g);
        }
        let slices: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
        let want = opt::grad_norm(&slices, scale);
        let tensors = l.table(rows);
        let chunk_rows = chunks(&SIZES);
        let n_chunks = chunk_rows.len();
        let chunk_table = l.table(chunk_rows);
        let bscale = scalar(&mut l, scale);
        let partials = l.out(n_chunks * 8, 0);
        let args = vec![
            tensors,
            chunk_table,
            i32(n_chunks),
            l.ptr(bscale),
            l.ptr(partials),
        ];
        let out = l
            .run("grad_norm_partials", (2, 1, 1), (64, 1, 1), args)
            .unwrap();
        let mut l = Launcher::new("grad_norm.cu");
        let bp = l.buf(out[partials.0].clone(), 0);
        let (bn, bf) = (l.out(4, 0), l.out(4, 0));
        let args = vec![l.ptr(bp), i32(n_chunks), l.ptr(bn), l.ptr(bf)];
        let out = l
            .run("grad_norm_finalize", (1, 1, 1), (32, 1, 1), args)
            .unwrap();
        check(
            "grad_norm",
            DType::F32,
            &dec(DType::F32, &out[bn.0]),
            &[want],
            1,
        );
        assert_eq!(dec_i32(&out[bf.0]), [i32::from(poison)], "found_inf");
    }
}

#[test]
fn the_loss_scaler_and_the_step_counter_equal_the_twin() {
    let h = LossScaler {
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 3,
        hysteresis: 2,
        max_scale: 65536.0,
    };
    // (scale, counters, grad norm): growth, capped growth, tolerated and backed-off
    // overflows, a clean step, a NaN norm.
    let cases = [
        (1024.0f32, [2.0f32, 2.0f32], 1.0f32),
        (65536.0, [2.0, 1.0], 1.0),
        (1e6, [2.0, 2.0], 1.0),
        (1024.0, [0.0, 2.0], f32::INFINITY),
        (1024.0, [1.0, 1.0], f32::INFINITY),
        (8.0, [0.0, 2.0], 0.5),
        (8.0, [0.0, 1.0], f32::NAN),
    ];
    for (scale, counters, norm) in cases {
        let (ws, wc) = opt::loss_scale_update(&h, scale, counters, norm);
        let mut l = Launcher::new("loss_scale.cu");
        let (bs, bc, bn) = (
            scalar(&mut l, scale),
            l.buf(f32s(&counters), 0),
            scalar(&mut l, norm),
        );
        // In place, as the lowering runs it.
        let args = vec![
            l.ptr(bs),
            l.ptr(bc),
            l.ptr(bn),
            l.ptr(bs),
            l.ptr(bc),
            Arg::F64(h.growth_factor),
            Arg::F64(h.backoff_factor),
            Arg::I64(h.growth_interval as i64),
            Arg::I64(h.hysteresis as i64),
            Arg::F64(h.max_scale),
        ];
        let out = l
            .run("loss_scale_update", (1, 1, 1), (1, 1, 1), args)
            .unwrap();
        assert_eq!(
            dec(DType::F32, &out[bs.0]),
            [ws],
            "scale {scale} {counters:?} {norm}"
        );
        assert_eq!(
            dec(DType::F32, &out[bc.0]),
            wc,
            "counters {scale} {counters:?} {norm}"
        );

        let mut l = Launcher::new("loss_scale.cu");
        let (bstep, bn) = (scalar(&mut l, 7.0), scalar(&mut l, norm));
        let args = vec![l.ptr(bstep), l.ptr(bn), l.ptr(bstep)];
        let out = l.run("count_step", (1, 1, 1), (32, 1, 1), args).unwrap();
        assert_eq!(dec(DType::F32, &out[bstep.0]), [opt::count_step(7.0, norm)]);
    }
}
