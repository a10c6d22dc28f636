//! `rope.cu` against `cpu/rope.rs`: the table with the twin's powf, sinf and cosf (the host
//! build's are the C library's, which the twin calls too), the rotation in F32 rounded once:
//! bit for bit.

use crate::cuda::emulate::kernel_tests::{check, dec, enc, grid_1d, i32, Launcher, Rng, FLOATS};
use crate::cpu::rope::{rope, rope_grad, rope_table};
use crate::cuda::program::Arg;
use castor_ir::{round_to, DType, RopeScaling};

pub(crate) fn entries() -> Vec<String> {
    let mut out = vec!["rope_table".to_string()];
    for (_, s) in FLOATS {
        out.push(format!("rope_fwd_{s}"));
        out.push(format!("rope_bwd_{s}"));
    }
    out
}

#[test]
fn the_table_and_both_rotations_equal_the_twin() {
    let mut rng = Rng::new(10);
    for (t, d, theta) in [
        (1usize, 2usize, 10_000.0),
        (31, 16, 500_000.0),
        (33, 130, 10_000.0),
    ] {
        let table = rope_table(t, d, theta, RopeScaling::None);
        let want: Vec<f32> = table.iter().flat_map(|&(c, s)| [c, s]).collect();
        let mut l = Launcher::new("rope.cu");
        let cs = l.out(t * d / 2 * 8, 0);
        let (grid, block) = grid_1d(t * d / 2, 256);
        let out = l
            .run(
                "rope_table",
                grid,
                block,
                vec![l.ptr(cs), i32(t), i32(d), Arg::F64(theta)],
            )
            .unwrap();
        check(
            &format!("rope_table t={t} d={d}"),
            DType::F32,
            &dec(DType::F32, &out[cs.0]),
            &want,
            0,
        );
        for (dt, s) in FLOATS {
            // Leading dims folded into rows; the position is row % t.
            let rows = 3 * t;
            let x = rng.values(rows * d, 2.0, dt);
            for bwd in [false, true] {
                let mut y = x.clone();
                if bwd {
                    rope_grad(&mut y, t, d, theta, RopeScaling::None);
                } else {
                    rope(&mut y, t, d, theta, RopeScaling::None);
                }
                let y: Vec<f32> = y.iter().map(|&v| round_to(dt, v)).collect();
                let name = format!("rope_{}_{s}", if bwd { "bwd" } else { "fwd" });
                let mut l = Launcher::new("rope.cu");
                let bx = l.buf(enc(dt, &x), dt.size_bytes() as u64);
                let bcs = l.buf(out[cs.0].clone(), 0);
                // Fewer blocks than positions and batches, so that every loop strides; one
                // thread per pair of d <= 64, two for d = 128.
                let (grid, block) = ((2, 2, 1), (32, 4, 1));
                // In place, as the lowering allows; the 3 batches as 3 heads of one.
                let dense = [3 * t * d, t * d, d].map(i32);
                let mut args = vec![l.ptr(bx), l.ptr(bx), l.ptr(bcs), i32(3), i32(t), i32(d)];
                args.push(i32(3));
                args.extend(dense.clone());
                args.extend(dense);
                let got = l.run(&name, grid, block, args).unwrap();
                check(
                    &format!("{name} t={t} d={d}"),
                    dt,
                    &dec(dt, &got[bx.0]),
                    &y,
                    0,
                );
                // Read from and written into [1, t, 3, d + 4] (a head of a [B, T, H, d]
                // product), the gaps left alone.
                let w = d + 4;
                let at = |b: usize, r: usize, j: usize| r * 3 * w + b * w + j;
                let mut xs = vec![7.0f32; t * 3 * w];
                for b in 0..3 {
                    for r in 0..t {
                        for j in 0..d {
                            xs[at(b, r, j)] = x[(b * t + r) * d + j];
                        }
                    }
                }
                let mut l = Launcher::new("rope.cu");
                let bx = l.buf(enc(dt, &xs), 0);
                let by = l.buf(enc(dt, &vec![7.0f32; t * 3 * w]), 0);
                let bcs = l.buf(out[cs.0].clone(), 0);
                let strided = [t * 3 * w, w, 3 * w].map(i32);
                let mut args = vec![l.ptr(bx), l.ptr(by), l.ptr(bcs), i32(3), i32(t), i32(d)];
                args.push(i32(3));
                args.extend(strided.clone());
                args.extend(strided);
                let got = dec(dt, &l.run(&name, grid, block, args).unwrap()[by.0]);
                let mut inside = vec![false; got.len()];
                let mut dense_y = vec![0.0; rows * d];
                for b in 0..3 {
                    for r in 0..t {
                        for j in 0..d {
                            dense_y[(b * t + r) * d + j] = got[at(b, r, j)];
                            inside[at(b, r, j)] = true;
                        }
                    }
                }
                check(&format!("{name} t={t} d={d} in place"), dt, &dense_y, &y, 0);
                let gap = (0..got.len()).find(|&i| !inside[i] && got[i] != 7.0);
                assert!(gap.is_none(), "{name}: a gap was written at {gap:?}");
            }
        }
    }
}
