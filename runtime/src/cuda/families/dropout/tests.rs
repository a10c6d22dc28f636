//! `dropout.cu` against `cpu/dropout.rs`: the same Philox draws and the same F32 product
//! rounded once, bit for bit, in place and not, at every size's tail.

use crate::cpu::dropout::dropout;
use crate::cuda::emulate::kernel_tests::{
    check, dec, enc, enc_i64, grid_1d, i64, Launcher, Rng, FLOATS, SIZES,
};
use crate::cuda::program::Arg;
use castor_ir::philox::{dropout_scale, keep_threshold};
use castor_ir::round_to;

pub(crate) fn entries() -> Vec<String> {
    FLOATS.map(|(_, s)| format!("dropout_{s}")).to_vec()
}

#[test]
fn dropout_equals_the_twin() {
    let mut rng = Rng::new(21);
    for (d, s) in FLOATS {
        for n in SIZES {
            for (p, key, stream) in [
                (0.1, [7i64, 0], 0u32),
                (0.5, [-3, 1 << 40], 9),
                (0.0, [1, 2], 1),
                // Evaluation mode: every element kept unscaled.
                (0.5, [3, -1], 2),
            ] {
                let mut x = rng.values(n, 4.0, d);
                // An infinity that is dropped stays visible (Inf * 0 = NaN), as in PyTorch.
                x[0] = f32::INFINITY;
                let mut want = x.clone();
                dropout(&mut want, key, stream, p);
                let want: Vec<f32> = want.iter().map(|&v| round_to(d, v)).collect();
                let args = |l: &Launcher, bx, by, bk| {
                    vec![
                        l.ptr(bx),
                        l.ptr(by),
                        l.ptr(bk),
                        i64(n),
                        Arg::U32(stream),
                        Arg::U64(keep_threshold(p)),
                        Arg::F64(f64::from(dropout_scale(p))),
                    ]
                };
                let (grid, block) = grid_1d(n.div_ceil(4), 128);
                let name = format!("dropout_{s}");
                let what = format!("{name} n={n} p={p}");

                let mut l = Launcher::new("dropout.cu");
                let bx = l.buf(enc(d, &x), 0);
                let by = l.out(n * d.size_bytes(), 0);
                let bk = l.buf(enc_i64(&key), 0);
                let out = l.run(&name, grid, block, args(&l, bx, by, bk)).unwrap();
                check(&what, d, &dec(d, &out[by.0]), &want, 0);

                // In place, y over x.
                let out = l.run(&name, grid, block, args(&l, bx, bx, bk)).unwrap();
                check(&format!("{what} in place"), d, &dec(d, &out[bx.0]), &want, 0);
            }
        }
    }
}
