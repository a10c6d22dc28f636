//! `rope.cu` against `cpu/rope.rs`: the table with the twin's powf, sinf and cosf (the host
//! build's are the C library's, which the twin calls too), the rotation in F32 rounded once:
//! bit for bit.

use super::{check, dec, enc, grid_1d, i32, i64, Launcher, Rng, FLOATS};
use crate::cpu::rope::{rope, rope_grad, rope_table};
use crate::cuda::program::Arg;
use castor_ir::{round_to, DType, RopeScaling};

pub(super) fn entries() -> Vec<String> {
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
                let (grid, block) = grid_1d(rows * d / 2, 256);
                // In place, as the lowering allows.
                let args = vec![l.ptr(bx), l.ptr(bx), l.ptr(bcs), i64(rows), i32(t), i32(d)];
                let got = l.run(&name, grid, block, args).unwrap();
                check(
                    &format!("{name} t={t} d={d}"),
                    dt,
                    &dec(dt, &got[bx.0]),
                    &y,
                    0,
                );
            }
        }
    }
}
