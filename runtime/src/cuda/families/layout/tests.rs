//! `cast.cu` and `layout.cu` against `cpu/cast.rs` and `cpu/layout.rs`: bit for bit (copies
//! move bits; conversions round once where the twin stores).

use crate::cuda::emulate::kernel_tests::{check, dec, enc, enc_i64, grid_1d, i64, Launcher, Rng, FLOATS, SIZES};
use crate::cpu::{cast, layout};
use crate::cuda::program::{Arg, CopyLayout, MAX_RANK};
use castor_ir::{round_to, DType, TensorData};

/// The casts of `layout.cu` that involve bool or i64: (name, from, to).
const INT_CASTS: [(&str, DType, DType); 11] = [
    ("cast_i64_bool", DType::I64, DType::Bool),
    ("cast_f32_bool", DType::F32, DType::Bool),
    ("cast_bool_f32", DType::Bool, DType::F32),
    ("cast_bool_f16", DType::Bool, DType::F16),
    ("cast_bool_bf16", DType::Bool, DType::BF16),
    ("cast_bool_i32", DType::Bool, DType::I32),
    ("cast_bool_i64", DType::Bool, DType::I64),
    ("cast_i64_f32", DType::I64, DType::F32),
    ("cast_i64_f16", DType::I64, DType::F16),
    ("cast_i64_bf16", DType::I64, DType::BF16),
    ("cast_f32_i64", DType::F32, DType::I64),
];

pub(crate) fn entries() -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (a, sa) in FLOATS {
        for (b, sb) in FLOATS {
            if a != b {
                out.push(format!("cast_{sa}_{sb}"));
            }
        }
    }
    out.extend(INT_CASTS.iter().map(|c| c.0.to_string()));
    for w in [1, 2, 4, 8] {
        out.push(format!("strided_copy_b{w}"));
        out.push(format!("fill_b{w}"));
    }
    out.push("strided_copy_b16".into());
    out
}

#[test]
fn float_casts_round_once_as_the_twin_stores() {
    let mut rng = Rng::new(3);
    for (a, sa) in FLOATS {
        for (b, sb) in FLOATS {
            if a == b {
                continue;
            }
            for n in SIZES {
                // Aligned, and one element past 16-byte alignment.
                for skewed in [false, true] {
                    let skew = |d: DType| if skewed { d.size_bytes() as u64 } else { 0 };
                    // Wide values, so that F16's range overflows too.
                    let mut x = rng.values(n, 7e4, a);
                    if n > 4 {
                        x[..4].copy_from_slice(&[f32::NAN, f32::INFINITY, -0.0, 1e-6]);
                        x.iter_mut().for_each(|v| *v = round_to(a, *v));
                    }
                    let TensorData::F32(w) = cast::cast(TensorData::F32(x.clone()), b) else {
                        unreachable!("a float cast gives floats");
                    };
                    let want: Vec<f32> = w.iter().map(|&v| round_to(b, v)).collect();
                    let mut l = Launcher::new("cast.cu");
                    let bx = l.buf(enc(a, &x), skew(a));
                    let by = l.out(n * b.size_bytes(), skew(b));
                    let (grid, block) = grid_1d(n.div_ceil(8), 256);
                    let out = l
                        .run(
                            &format!("cast_{sa}_{sb}"),
                            grid,
                            block,
                            vec![l.ptr(bx), l.ptr(by), i64(n)],
                        )
                        .unwrap();
                    check(
                        &format!("cast_{sa}_{sb} n={n}"),
                        b,
                        &dec(b, &out[by.0]),
                        &want,
                        0,
                    );
                }
            }
        }
    }
}

/// `v` as `d`'s bytes, from the twin's data.
fn bytes(d: DType, v: &TensorData) -> Vec<u8> {
    match v {
        TensorData::F32(f) => {
            let rounded: Vec<f32> = f.iter().map(|&x| round_to(d, x)).collect();
            enc(d, &rounded)
        }
        TensorData::I64(i) if d == DType::I32 => {
            i.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect()
        }
        TensorData::I64(i) => enc_i64(i),
        TensorData::Bool(b) => b.iter().map(|&x| u8::from(x)).collect(),
        TensorData::U8(b) => b.clone(),
    }
}

#[test]
fn casts_with_bool_and_i64_equal_the_twin() {
    let mut rng = Rng::new(4);
    for (name, from, to) in INT_CASTS {
        for n in SIZES {
            let data = match from {
                DType::I64 => TensorData::I64(
                    (0..n)
                        .map(|i| match i % 4 {
                            0 => 0,
                            1 => (rng.next() >> 1) as i64 - (1 << 62),
                            2 => 16_777_217 + i as i64,
                            _ => -(rng.next() as i64 % 70_000),
                        })
                        .collect(),
                ),
                DType::Bool => TensorData::Bool((0..n).map(|i| i % 3 == 1).collect()),
                _ => {
                    let mut v = rng.values(n, 1e19, DType::F32);
                    if n > 4 {
                        v[..4].copy_from_slice(&[f32::NAN, -0.0, 0.75, -2.5]);
                    }
                    TensorData::F32(v)
                }
            };
            let want = bytes(to, &cast::cast(data.clone(), to));
            let input = match &data {
                TensorData::F32(f) => enc(DType::F32, f),
                other => bytes(from, other),
            };
            let mut l = Launcher::new("layout.cu");
            let bx = l.buf(input, 0);
            let by = l.out(n * to.size_bytes(), 0);
            let (grid, block) = grid_1d(n, 256);
            let out = l
                .run(name, grid, block, vec![l.ptr(bx), l.ptr(by), i64(n)])
                .unwrap();
            assert_eq!(out[by.0], want, "{name} n={n}");
        }
    }
}

/// A copy layout: `shape` read with `src` strides from `src_offset`, written contiguously.
fn layout_of(shape: &[usize], src: &[i64], src_offset: i64) -> CopyLayout {
    let mut l = CopyLayout {
        rank: shape.len() as i32,
        src_offset,
        ..CopyLayout::default()
    };
    let mut dst = 1i64;
    for k in (0..MAX_RANK).rev() {
        l.shape[k] = 1;
        if k < shape.len() {
            l.shape[k] = shape[k] as i64;
            l.src_stride[k] = src[k];
            l.dst_stride[k] = dst;
            dst *= shape[k] as i64;
        }
    }
    l
}

#[test]
fn strided_copies_are_the_twins_transpose_slice_and_broadcast() {
    let mut rng = Rng::new(5);
    let (a, b, c) = (3usize, 33usize, 7usize);
    let x = rng.values(a * b * c, 100.0, DType::F32);
    // (what, layout, the twin's result over `x`'s values)
    let cases: Vec<(&str, CopyLayout, Vec<f32>)> = vec![
        (
            "transpose [2, 0, 1]",
            layout_of(&[c, a, b], &[1, (b * c) as i64, c as i64], 0),
            layout::transpose(&x, &[a, b, c], &[2, 0, 1]),
        ),
        (
            "slice 5..30 of axis 1",
            layout_of(&[a, 25, c], &[(b * c) as i64, c as i64, 1], 5 * c as i64),
            layout::slice(&x, &[a, b, c], 1, 5, 30),
        ),
        (
            "broadcast [1, 231] to [3, 231]",
            layout_of(&[3, b * c], &[0, 1], 0),
            layout::broadcast_to(&x[..b * c], &[1, b * c], &[3, b * c]),
        ),
        ("one element (rank 0)", layout_of(&[], &[], 17), vec![x[17]]),
    ];
    for (what, lay, want) in cases {
        let n = want.len();
        for (w, d) in [
            (1, DType::Bool),
            (2, DType::BF16),
            (4, DType::F32),
            (8, DType::I64),
        ] {
            let to_bytes = |v: &[f32]| -> Vec<u8> {
                match d {
                    DType::Bool => v.iter().map(|&f| u8::from(f > 0.0)).collect(),
                    DType::I64 => enc_i64(&v.iter().map(|&f| f as i64).collect::<Vec<_>>()),
                    _ => enc(d, v),
                }
            };
            let mut l = Launcher::new("layout.cu");
            let bx = l.buf(to_bytes(&x), 0);
            let by = l.out(n * w, 0);
            let (grid, block) = grid_1d(n, 256);
            let args = vec![l.ptr(bx), l.ptr(by), i64(n), Arg::Layout(lay)];
            let out = l
                .run(&format!("strided_copy_b{w}"), grid, block, args)
                .unwrap();
            assert_eq!(out[by.0], to_bytes(&want), "strided_copy_b{w}: {what}");
        }
    }
}

/// 16-byte units: the attention heads' split, `[T, H, D] -> [H, T, D]` with rows of D values
/// moved whole, is the twin's transpose of the elements.
#[test]
fn strided_copies_of_16_byte_units_are_the_twins_transpose() {
    let mut rng = Rng::new(6);
    let (t, h, d) = (5usize, 3usize, 8usize);
    let x = rng.values(t * h * d, 100.0, DType::F32);
    let want = layout::transpose(&x, &[t, h, d], &[1, 0, 2]);
    // In units of four F32 values: [H, T, D/4] read with strides [D/4, H*D/4, 1].
    let u = (d / 4) as i64;
    let lay = layout_of(&[h, t, d / 4], &[u, h as i64 * u, 1], 0);
    let n = h * t * d / 4;
    let mut l = Launcher::new("layout.cu");
    let bx = l.buf(enc(DType::F32, &x), 0);
    let by = l.out(t * h * d * 4, 0);
    let (grid, block) = grid_1d(n, 256);
    let args = vec![l.ptr(bx), l.ptr(by), i64(n), Arg::Layout(lay)];
    let out = l.run("strided_copy_b16", grid, block, args).unwrap();
    assert_eq!(out[by.0], enc(DType::F32, &want));
}

#[test]
fn fills_write_the_pattern_at_any_alignment() {
    for n in SIZES {
        for skew in [0u64, 1, 2, 4] {
            for w in [1usize, 2, 4, 8] {
                let pattern: u64 = 0x0123_4567_89ab_cdef;
                let value = match w {
                    1 => Arg::U32(0xef),
                    2 => Arg::U16(0xcdef),
                    4 => Arg::U32(0x89ab_cdef),
                    _ => Arg::U64(pattern),
                };
                let skew = skew - skew % w as u64;
                let mut l = Launcher::new("layout.cu");
                let b = l.out(n * w, skew);
                let (grid, block) = grid_1d(n.div_ceil(16), 256);
                let out = l
                    .run(
                        &format!("fill_b{w}"),
                        grid,
                        block,
                        vec![l.ptr(b), i64(n), value],
                    )
                    .unwrap();
                let want: Vec<u8> = (0..n)
                    .flat_map(|_| pattern.to_le_bytes()[..w].to_vec())
                    .collect();
                assert_eq!(out[b.0], want, "fill_b{w} n={n} skew={skew}");
            }
        }
    }
}
