//! `elementwise.cu` against `cpu/elementwise.rs`: bit for bit (the header: the twin's formulas
//! in its order; the host build's expf and erff are the twin's).

use crate::cuda::emulate::kernel_tests::{check, dec, enc, grid_1d, Launcher, Rng, FLOATS, SIZES};
use crate::cpu::elementwise::{unary, unary_grad};
use castor_ir::{round_to, DType, UnaryOp};

const UNARY: [(UnaryOp, &str); 3] = [
    (UnaryOp::GeluTanh, "gelu_tanh"),
    (UnaryOp::GeluErf, "gelu_erf"),
    (UnaryOp::Silu, "silu"),
];

pub(crate) fn entries() -> Vec<String> {
    let mut out = Vec::new();
    for (_, s) in FLOATS {
        for (_, name) in UNARY {
            out.push(format!("{name}_fwd_{s}"));
            out.push(format!("{name}_bwd_{s}"));
        }
        out.push(format!("add_{s}"));
        out.push(format!("mul_{s}"));
    }
    out
}

/// Skews that keep a pointer aligned, and that break 16-byte alignment (the kernels take any).
fn skews(d: DType) -> [u64; 2] {
    [0, d.size_bytes() as u64]
}

#[test]
fn activations_and_their_gradients_equal_the_twin() {
    let mut rng = Rng::new(1);
    for (d, s) in FLOATS {
        for (op, name) in UNARY {
            for n in SIZES {
                for skew in skews(d) {
                    let x = rng.values(n, 6.0, d);
                    let dy = rng.values(n, 2.0, d);
                    let mut y = x.clone();
                    unary(op, &mut y);
                    let y: Vec<f32> = y.iter().map(|&v| round_to(d, v)).collect();
                    let mut dx = dy.clone();
                    unary_grad(op, &x, &mut dx);
                    let dx: Vec<f32> = dx.iter().map(|&v| round_to(d, v)).collect();
                    let size = n * d.size_bytes();
                    let (grid, block) = grid_1d(n.div_ceil(8), 256);

                    let mut l = Launcher::new("elementwise.cu");
                    let bx = l.buf(enc(d, &x), skew);
                    let by = l.out(size, skew);
                    let args = vec![l.ptr(bx), l.ptr(by), crate::cuda::emulate::kernel_tests::i64(n)];
                    let out = l
                        .run(&format!("{name}_fwd_{s}"), grid, block, args)
                        .unwrap();
                    check(
                        &format!("{name}_fwd_{s} n={n}"),
                        d,
                        &dec(d, &out[by.0]),
                        &y,
                        0,
                    );

                    // In place: y over x.
                    let args = vec![l.ptr(bx), l.ptr(bx), crate::cuda::emulate::kernel_tests::i64(n)];
                    let out = l
                        .run(&format!("{name}_fwd_{s}"), grid, block, args)
                        .unwrap();
                    check(
                        &format!("{name}_fwd_{s} in place"),
                        d,
                        &dec(d, &out[bx.0]),
                        &y,
                        0,
                    );

                    let mut l = Launcher::new("elementwise.cu");
                    let bx = l.buf(enc(d, &x), skew);
                    let bdy = l.buf(enc(d, &dy), skew);
                    let bdx = l.out(size, skew);
                    let args = vec![l.ptr(bx), l.ptr(bdy), l.ptr(bdx), crate::cuda::emulate::kernel_tests::i64(n)];
                    let out = l
                        .run(&format!("{name}_bwd_{s}"), grid, block, args)
                        .unwrap();
                    check(
                        &format!("{name}_bwd_{s} n={n}"),
                        d,
                        &dec(d, &out[bdx.0]),
                        &dx,
                        0,
                    );
                }
            }
        }
    }
}

#[test]
fn add_and_mul_with_a_trailing_bias_equal_the_twin() {
    let mut rng = Rng::new(2);
    for (d, s) in FLOATS {
        for (name, f) in [
            ("add", (|a, b| a + b) as fn(f32, f32) -> f32),
            ("mul", |a, b| a * b),
        ] {
            // (rows, nb): plain, a bias row of a length that is and is not a multiple of 8,
            // a scalar.
            for (n, nb) in [(1025, 1025), (33 * 5, 33), (64 * 3, 16), (31, 1), (1, 1)] {
                for skew in skews(d) {
                    let a = rng.values(n, 3.0, d);
                    let b = rng.values(nb, 3.0, d);
                    let want: Vec<f32> = (0..n).map(|i| round_to(d, f(a[i], b[i % nb]))).collect();
                    let mut l = Launcher::new("elementwise.cu");
                    let ba = l.buf(enc(d, &a), skew);
                    let bb = l.buf(enc(d, &b), skew);
                    let bo = l.out(n * d.size_bytes(), skew);
                    let (grid, block) = grid_1d(n.div_ceil(8), 256);
                    let args = vec![
                        l.ptr(ba),
                        l.ptr(bb),
                        l.ptr(bo),
                        crate::cuda::emulate::kernel_tests::i64(n),
                        crate::cuda::emulate::kernel_tests::i64(nb),
                    ];
                    let out = l.run(&format!("{name}_{s}"), grid, block, args).unwrap();
                    check(
                        &format!("{name}_{s} {n}/{nb}"),
                        d,
                        &dec(d, &out[bo.0]),
                        &want,
                        0,
                    );
                    // A small grid strides over the elements.
                    let args = vec![
                        l.ptr(ba),
                        l.ptr(bb),
                        l.ptr(ba),
                        crate::cuda::emulate::kernel_tests::i64(n),
                        crate::cuda::emulate::kernel_tests::i64(nb),
                    ];
                    let out = l
                        .run(&format!("{name}_{s}"), (2, 1, 1), (64, 1, 1), args)
                        .unwrap();
                    check(
                        &format!("{name}_{s} in place"),
                        d,
                        &dec(d, &out[ba.0]),
                        &want,
                        0,
                    );
                }
            }
        }
    }
}
