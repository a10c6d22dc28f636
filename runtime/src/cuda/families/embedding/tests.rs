//! `embedding.cu` against `cpu/embedding.rs`: the gather moves bits; the backward sums each
//! id's rows in position order in F64, the twin's order: bit for bit.

use crate::cuda::emulate::kernel_tests::{check, dec, dec_i32, enc, enc_i64, i32, i64, Launcher, Rng, FLOATS};
use crate::cpu::embedding::{embedding, embedding_grad};
use castor_ir::{round_to, DType};

pub(crate) fn entries() -> Vec<String> {
    let mut out: Vec<String> = [
        "embedding_bwd_count",
        "embedding_bwd_scan",
        "embedding_bwd_fill",
    ]
    .map(String::from)
    .to_vec();
    for (d, s) in FLOATS {
        out.push(format!("embedding_fwd_{s}"));
        out.push(format!("embedding_bwd_accumulate_{s}_f32"));
        if d != DType::F32 {
            out.push(format!("embedding_bwd_accumulate_{s}_{s}"));
        }
    }
    out
}

#[test]
fn gather_and_scatter_add_equal_the_twin() {
    let mut rng = Rng::new(9);
    for (d, s) in FLOATS {
        for (v, h, n) in [
            (1usize, 1usize, 1usize),
            (37, 13, 33),
            (300, 33, 1025),
            (1025, 8, 31),
        ] {
            let table = rng.values(v * h, 2.0, d);
            // Ids with repeats (a small vocabulary hit many times) in no order.
            let ids: Vec<i64> = (0..n)
                .map(|_| (rng.next() % v.min(40) as u64) as i64)
                .collect();
            let want = embedding(&table, v, h, &ids).unwrap_or_default();
            let skew = d.size_bytes() as u64;
            let mut l = Launcher::new("embedding.cu");
            let bt = l.buf(enc(d, &table), skew);
            let bi = l.buf(enc_i64(&ids), 0);
            let bo = l.out(n * h * d.size_bytes(), skew);
            let bad = l.buf(i32::MAX.to_le_bytes().to_vec(), 0);
            let args = vec![
                l.ptr(bt),
                l.ptr(bi),
                l.ptr(bo),
                i64(n),
                i64(v),
                i32(h),
                l.ptr(bad),
            ];
            let out = l
                .run(
                    &format!("embedding_fwd_{s}"),
                    (n as u32, 1, 1),
                    (128, 1, 1),
                    args,
                )
                .unwrap();
            check(
                &format!("embedding_fwd_{s}"),
                d,
                &dec(d, &out[bo.0]),
                &want,
                0,
            );

            // Backward: count, scan, fill, accumulate, each launch as the lowering makes it.
            let dy = rng.values(n * h, 1.0, d);
            let grad = embedding_grad(&ids, &dy, v, h).unwrap_or_default();
            let mut l = Launcher::new("embedding.cu");
            let bi = l.buf(enc_i64(&ids), 0);
            let counts = l.buf(vec![0; v * 4], 0);
            let bad = l.buf(i32::MAX.to_le_bytes().to_vec(), 0);
            let args = vec![l.ptr(bi), i64(n), i64(v), l.ptr(counts), l.ptr(bad)];
            let c = l
                .run(
                    "embedding_bwd_count",
                    ((n as u32).div_ceil(256), 1, 1),
                    (256, 1, 1),
                    args,
                )
                .unwrap();
            let mut l = Launcher::new("embedding.cu");
            let bc = l.buf(c[counts.0].clone(), 0);
            let starts = l.out((v + 1) * 4, 0);
            let threads = (v.div_ceil(32) * 32).min(1024) as u32;
            let args = vec![l.ptr(bc), i64(v), l.ptr(starts)];
            let st = l
                .run("embedding_bwd_scan", (1, 1, 1), (threads, 1, 1), args)
                .unwrap();
            let mut run = 0;
            let want_starts: Vec<i32> = std::iter::once(0)
                .chain(dec_i32(&c[counts.0]).iter().map(|&k| {
                    run += k;
                    run
                }))
                .collect();
            assert_eq!(dec_i32(&st[starts.0]), want_starts, "scan v={v}");
            let mut l = Launcher::new("embedding.cu");
            let bi = l.buf(enc_i64(&ids), 0);
            let bs = l.buf(st[starts.0].clone(), 0);
            let pos = l.out(n * 4, 0);
            let threads = (n.div_ceil(32) * 32).min(1024) as u32;
            let args = vec![l.ptr(bi), i64(n), i64(v), l.ptr(bs), l.ptr(pos)];
            let p = l
                .run(
                    "embedding_bwd_fill",
                    (v.div_ceil(256) as u32, 1, 1),
                    (threads, 1, 1),
                    args,
                )
                .unwrap();
            // Positions grouped by id, in increasing order within each id (a stable sort).
            let mut want_pos: Vec<i32> = (0..n as i32).collect();
            want_pos.sort_by_key(|&p| ids[p as usize]);
            assert_eq!(dec_i32(&p[pos.0]), want_pos, "fill v={v} n={n}");
            for o in [DType::F32, d] {
                let so = FLOATS.iter().find(|f| f.0 == o).map_or("?", |f| f.1);
                let mut l = Launcher::new("embedding.cu");
                let bdy = l.buf(enc(d, &dy), 0);
                let bp = l.buf(p[pos.0].clone(), 0);
                let bs = l.buf(st[starts.0].clone(), 0);
                let bo = l.out(v * h * o.size_bytes(), 0);
                let args = vec![l.ptr(bdy), l.ptr(bp), l.ptr(bs), i64(v), i32(h), l.ptr(bo)];
                let out = l
                    .run(
                        &format!("embedding_bwd_accumulate_{s}_{so}"),
                        (v as u32, 1, 1),
                        (128, 1, 1),
                        args,
                    )
                    .unwrap();
                let want: Vec<f32> = grad.iter().map(|&x| round_to(o, x)).collect();
                check(
                    &format!("embedding_bwd_accumulate_{s}_{so}"),
                    o,
                    &dec(o, &out[bo.0]),
                    &want,
                    0,
                );
            }
        }
    }
}

#[test]
fn bad_ids_are_reported_and_gathered_as_zeros() {
    let (v, h) = (5usize, 3usize);
    let ids = [1i64, 7, 2, -4, 0];
    let mut l = Launcher::new("embedding.cu");
    let bt = l.buf(enc(DType::F32, &[1.0; 15]), 0);
    let bi = l.buf(enc_i64(&ids), 0);
    let bo = l.out(ids.len() * h * 4, 0);
    let bad = l.buf(i32::MAX.to_le_bytes().to_vec(), 0);
    let args = vec![
        l.ptr(bt),
        l.ptr(bi),
        l.ptr(bo),
        i64(5),
        i64(v),
        i32(h),
        l.ptr(bad),
    ];
    let out = l
        .run("embedding_fwd_f32", (2, 1, 1), (32, 1, 1), args)
        .unwrap();
    assert_eq!(dec_i32(&out[bad.0]), [1]);
    let rows = dec(DType::F32, &out[bo.0]);
    assert_eq!(&rows[3..6], &[0.0; 3]);
    assert_eq!(&rows[9..12], &[0.0; 3]);
}
