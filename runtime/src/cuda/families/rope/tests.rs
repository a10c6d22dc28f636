//! `rope.cu` against `cpu/rope.rs`: the table with the twin's powf, sinf and cosf (the host
//! build's are the C library's, which the twin calls too), the rotation in F32 rounded once:
//! bit for bit, at positions `0..t` or at packed sequences' positions (clamped into `0..t`
//! alike).

use crate::cuda::emulate::kernel_tests::{
    check, dec, enc, enc_i64, grid_1d, i32, Launcher, Rng, FLOATS,
};
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

/// A rotation's arguments: x, y and the table, no positions, the tests' 3 batches as 3 heads
/// of one, x and y both through the (batch, head, row) `strides`.
fn three_heads(x: Arg, y: Arg, cs: Arg, t: usize, d: usize, strides: [usize; 3]) -> Vec<Arg> {
    let mut args = vec![x, y, cs, Arg::Null];
    args.extend([i32(3), i32(t), i32(d), i32(3)]);
    args.extend(strides.map(i32));
    args.extend(strides.map(i32));
    args.extend([i32(0), i32(0), i32(0)]);
    args
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
                let dims = [3, t, d];
                if bwd {
                    rope_grad(&mut y, &dims, None, theta, RopeScaling::None);
                } else {
                    rope(&mut y, &dims, None, theta, RopeScaling::None);
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
                let dense = [3 * t * d, t * d, d];
                let args = three_heads(l.ptr(bx), l.ptr(bx), l.ptr(bcs), t, d, dense);
                let got = l.run(&name, grid, block, args).unwrap();
                check(
                    &format!("{name} t={t} d={d}"),
                    dt,
                    &dec(dt, &got[bx.0]),
                    &y,
                    0,
                );
                // Out of place, dense and 16-byte aligned: the 16-byte vectors where d/2 is a
                // multiple of 8 (d = 16), one pair per thread elsewhere; the lowering's
                // shape of a block for d = 16 (one thread per vector of each half).
                let mut l = Launcher::new("rope.cu");
                let bx = l.buf(enc(dt, &x), 0);
                let by = l.out(rows * d * dt.size_bytes(), 0);
                let bcs = l.buf(out[cs.0].clone(), 0);
                let dense = [3 * t * d, t * d, d];
                let args = three_heads(l.ptr(bx), l.ptr(by), l.ptr(bcs), t, d, dense);
                let got = l.run(&name, (2, 2, 1), (1, 8, 1), args).unwrap();
                check(
                    &format!("{name} t={t} d={d} aligned"),
                    dt,
                    &dec(dt, &got[by.0]),
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
                let strided = [t * 3 * w, w, 3 * w];
                let args = three_heads(l.ptr(bx), l.ptr(by), l.ptr(bcs), t, d, strided);
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

/// Packed sequences' positions: x `[2, 3, t, d]` (two sequences' rows of three heads each)
/// with positions `[2, 1, t]` shared by the heads (the kernels' head stride 0). Row 0 packs
/// sequences of 5, 1 and 4 tokens in turn; row 1 holds positions no packing makes (negative,
/// at and past t), which both sides clamp into `0..t`. Bit for bit, forward and backward, in
/// place and out of place.
#[test]
fn rotations_at_packed_positions_equal_the_twin() {
    let mut rng = Rng::new(12);
    for (t, d, theta) in [(1usize, 2usize, 10_000.0), (33, 16, 500_000.0), (40, 130, 10_000.0)] {
        let mut positions: Vec<i64> = [5usize, 1, 4]
            .iter()
            .cycle()
            .flat_map(|&n| 0..n as i64)
            .take(t)
            .collect();
        positions.extend((0..t).map(|i| match i % 4 {
            0 => -(i as i64) - 1,
            1 => t as i64 + i as i64,
            2 => t as i64,
            _ => (rng.next() % t as u64) as i64,
        }));
        let (outer, heads) = (2usize, 3usize);
        let rows = outer * heads * t;
        // One position per row of x, as the CPU dispatch broadcasts them.
        let per_row: Vec<i64> = (0..rows)
            .map(|r| positions[(r / (heads * t)) * t + r % t])
            .collect();
        let table: Vec<f32> = rope_table(t, d, theta, RopeScaling::None)
            .iter()
            .flat_map(|&(c, s)| [c, s])
            .collect();
        for (dt, s) in FLOATS {
            let x = rng.values(rows * d, 2.0, dt);
            for bwd in [false, true] {
                let mut y = x.clone();
                let dims = [outer, heads, t, d];
                if bwd {
                    rope_grad(&mut y, &dims, Some(&per_row), theta, RopeScaling::None);
                } else {
                    rope(&mut y, &dims, Some(&per_row), theta, RopeScaling::None);
                }
                let y: Vec<f32> = y.iter().map(|&v| round_to(dt, v)).collect();
                let name = format!("rope_{}_{s}", if bwd { "bwd" } else { "fwd" });
                for in_place in [false, true] {
                    let mut l = Launcher::new("rope.cu");
                    let bx = l.buf(enc(dt, &x), dt.size_bytes() as u64);
                    let by = if in_place { bx } else { l.out(rows * d * dt.size_bytes(), 0) };
                    let bcs = l.buf(enc(DType::F32, &table), 0);
                    let bp = l.buf(enc_i64(&positions), 0);
                    let dense = [heads * t * d, t * d, d].map(i32);
                    let mut args = vec![l.ptr(bx), l.ptr(by), l.ptr(bcs), l.ptr(bp)];
                    args.extend([i32(outer * heads), i32(t), i32(d), i32(heads)]);
                    args.extend(dense.clone());
                    args.extend(dense);
                    args.extend([i32(t), i32(0), i32(1)]);
                    let got = l.run(&name, (2, 2, 1), (32, 4, 1), args).unwrap();
                    let what = format!("{name} t={t} d={d} positions in_place={in_place}");
                    check(&what, dt, &dec(dt, &got[by.0]), &y, 0);
                }
            }
        }
    }
}
