//! `reduce.cu` against `cpu/reduce.rs`: max is the twin's fold bit for bit (NaN, ties between
//! -0 and +0 included); sum and mean add in F64 in another order, in one stage or two: within
//! 1 ulp.

use crate::cuda::emulate::kernel_tests::{check, dec, enc, i64, Launcher, Rng, FLOATS};
use crate::cpu::reduce::reduce;
use castor_ir::{round_to, DType, ReduceOp};

/// Every input/output pair of the float dtypes.
fn pairs() -> Vec<(DType, DType)> {
    FLOATS
        .iter()
        .flat_map(|a| FLOATS.iter().map(move |b| (a.0, b.0)))
        .collect()
}

const OPS: [(ReduceOp, &str); 3] = [
    (ReduceOp::Sum, "sum"),
    (ReduceOp::Mean, "mean"),
    (ReduceOp::Max, "max"),
];

pub(crate) fn entries() -> Vec<String> {
    let mut out = Vec::new();
    for (ti, to) in pairs() {
        let io = crate::cuda::emulate::kernel_tests::io(ti, to);
        for (_, op) in OPS {
            out.push(format!("reduce_{op}_{io}"));
        }
        out.push(format!("reduce_grouped_sum_{io}"));
        out.push(format!("reduce_grouped_mean_{io}"));
    }
    out
}

#[test]
fn sums_means_and_maxima_agree_with_the_twin() {
    let mut rng = Rng::new(11);
    let mut differ = 0;
    for (ti, to) in pairs() {
        let s = crate::cuda::emulate::kernel_tests::io(ti, to);
        // (outer, len, inner): rows (inner 1) aligned or not, columns, a single element.
        for (outer, len, inner) in [
            (1usize, 1usize, 1usize),
            (3, 1025, 1),
            (2, 33, 31),
            (1, 31, 1025),
            (4, 8, 33),
        ] {
            for skew in [0u64, ti.size_bytes() as u64] {
                let n = outer * len * inner;
                let mut x = rng.values(n, 4.0, ti);
                // NaNs, infinities and signed-zero ties, where they decide a max.
                if n > 40 {
                    x[5] = f32::NAN;
                    x[17] = f32::INFINITY;
                    x[20] = -0.0;
                    x[21] = 0.0;
                }
                for (op, name) in OPS {
                    let want: Vec<f32> = reduce(op, &x, &[outer, len, inner], &[1])
                        .unwrap_or_default()
                        .iter()
                        .map(|&v| round_to(to, v))
                        .collect();
                    let mut l = Launcher::new("reduce.cu");
                    let bx = l.buf(enc(ti, &x), skew);
                    let by = l.out(outer * inner * to.size_bytes(), 0);
                    let grid = (
                        inner.div_ceil(32).min(65_535) as u32,
                        outer.min(65_535) as u32,
                        1,
                    );
                    let args = vec![l.ptr(bx), l.ptr(by), i64(outer), i64(len), i64(inner)];
                    let entry = format!("reduce_{name}_{s}");
                    let what = format!("{entry} [{outer}, {len}, {inner}] skew={skew}");
                    let out = l
                        .run(&entry, grid, (32, 8, 1), args)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let bound = if op == ReduceOp::Max { 0 } else { 1 };
                    let got = dec(to, &out[by.0]);
                    if op == ReduceOp::Max {
                        // The same NaN and the same zero: bits, not just values.
                        let bits = |v: &[f32]| enc(to, v);
                        assert_eq!(bits(&got), bits(&want), "{what}");
                    }
                    differ += check(&what, to, &got, &want, bound);
                }
            }
        }
    }
    println!("reductions: {differ} elements 1 ulp from the twin");
}

#[test]
fn two_stage_column_sums_and_means_agree_with_the_twin() {
    let mut rng = Rng::new(12);
    let mut differ = 0;
    for (ti, to) in pairs() {
        // (outer, len, inner): columns a multiple of 8 or not, one group or many, no rows.
        for (outer, len, inner) in [(1usize, 517usize, 100usize), (2, 300, 264), (3, 5, 40), (1, 0, 16)] {
            let per_group = super::lower::rows_per_group(outer, len, inner);
            let groups = len.div_ceil(per_group).max(1);
            let blocks = inner.div_ceil(256);
            for skew in [0u64, ti.size_bytes() as u64] {
                let x = rng.values(outer * len * inner, 4.0, ti);
                for (op, name) in [(ReduceOp::Sum, "sum"), (ReduceOp::Mean, "mean")] {
                    let want: Vec<f32> = reduce(op, &x, &[outer, len, inner], &[1])
                        .unwrap_or_default()
                        .iter()
                        .map(|&v| round_to(to, v))
                        .collect();
                    let mut l = Launcher::new("reduce.cu");
                    let bx = l.buf(enc(ti, &x), skew);
                    let bp = l.out(outer * groups * inner * 8, 0);
                    let by = l.out(outer * inner * to.size_bytes(), 0);
                    let done = l.buf(vec![0; 4 * outer * blocks], 0);
                    let grid = (blocks as u32, groups as u32, outer as u32);
                    let args = vec![
                        l.ptr(bx),
                        l.ptr(bp),
                        l.ptr(by),
                        l.ptr(done),
                        i64(outer),
                        i64(len),
                        i64(inner),
                        i64(per_group),
                    ];
                    let io = crate::cuda::emulate::kernel_tests::io(ti, to);
                    let entry = format!("reduce_grouped_{name}_{io}");
                    let what = format!("{entry} [{outer}, {len}, {inner}] skew={skew}");
                    let out = l
                        .run(&entry, grid, (32, 8, 1), args)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    // Each column block's last group leaves its counter at zero.
                    assert!(out[done.0].iter().all(|&b| b == 0), "{what}: counters");
                    let got = dec(to, &out[by.0]);
                    if len == 0 && op == ReduceOp::Mean {
                        assert!(got.iter().all(|v| v.is_nan()), "{what}: the mean of no rows");
                        continue;
                    }
                    differ += check(&what, to, &got, &want, 1);
                }
            }
        }
    }
    println!("two-stage reductions: {differ} elements 1 ulp from the twin");
}
