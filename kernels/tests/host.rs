//! The host build's execution model against CUDA's documented semantics: warp shuffles (with
//! widths), votes, ballots and matches, barriers and shared memory, atomics, the half and
//! bfloat16 conversions with every rounding mode; misuse the device leaves undefined is an
//! error naming the thread; and seeded bugs are caught: a missing barrier (the results depend
//! on the thread order, and ThreadSanitizer reports the race) and a write past the end of a
//! buffer (AddressSanitizer reports it).
//!
//! The kernels are `tests/host_model.cu`. The sanitizer checks run this test binary again
//! under the sanitizer (`castor_kernels::host::sanitizer_env`); without the sanitizer runtimes
//! they skip with a message, except under `CI=true`, where they fail.

use castor_kernels::host::{self, HostMath, HostModule, LaunchShape, Order, Sanitize};
use half::{bf16, f16};
use std::ffi::c_void;
use std::sync::Arc;

const SOURCE: &str = include_str!("host_model.cu");
const ENTRIES: [&str; 11] = [
    "warp_ops",
    "half_warps",
    "reverse_block",
    "reverse_block_racy",
    "atomics",
    "conversions",
    "widen",
    "misuse",
    "write_past_end",
    "chained_blocks",
    "warp_matrix_ops",
];

extern "C" fn expf(x: f32) -> f32 {
    x.exp()
}

extern "C" fn erff(_: f32) -> f32 {
    f32::NAN // no kernel here calls it
}

fn module() -> Arc<HostModule> {
    host::module("host_model.cu", SOURCE, &ENTRIES, HostMath { expf, erff })
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A kernel argument.
enum A {
    Ptr(*mut c_void),
    I32(i32),
}

fn ptr<T>(v: &mut [T]) -> A {
    A::Ptr(v.as_mut_ptr().cast())
}

/// Launches `entry` with a 1-D grid and block.
fn launch(entry: &str, grid: u32, block: u32, order: Order, args: &[A]) -> Result<(), String> {
    let m = module();
    let e = m.entry(entry).unwrap_or_else(|| panic!("no entry {entry}"));
    let mut values: Vec<u64> = args
        .iter()
        .map(|a| match a {
            A::Ptr(p) => *p as u64,
            A::I32(x) => u64::from(*x as u32),
        })
        .collect();
    let ptrs: Vec<*mut c_void> = values
        .iter_mut()
        .map(|v| (v as *mut u64).cast::<c_void>())
        .collect();
    let shape = LaunchShape {
        grid: (grid, 1, 1),
        block: (block, 1, 1),
        shared_bytes: 0,
    };
    // SAFETY: each argument value matches the kernel's parameter (checked below against its
    // C type), and every pointer is to a buffer as large as the kernel uses.
    unsafe { e.launch(&shape, order, &ptrs) }
}

const ORDERS: [Order; 2] = [Order::Forward, Order::Reverse];

#[test]
fn entry_points_carry_their_c_signatures() {
    let m = module();
    let e = m.entry("conversions").unwrap();
    let kinds: Vec<_> = e
        .params
        .iter()
        .map(|p| (p.kind, p.size, p.pointee))
        .collect();
    use host::ParamKind::*;
    assert_eq!(
        kinds,
        [
            (Ptr, 8, 4),
            (I32, 4, 0),
            (Ptr, 8, 2),
            (Ptr, 8, 8),
            (Ptr, 8, 4)
        ]
    );
}

/// CUDA's `__shfl_*_sync` source lane for `lane` (its own value when out of its segment).
fn shfl_src(kind: usize, lane: usize, arg: usize, width: usize) -> usize {
    let seg = lane & !(width - 1);
    match kind {
        0 => seg + (arg & (width - 1)),
        1 if lane < seg + arg => lane,
        1 => lane - arg,
        2 if lane + arg >= seg + width => lane,
        2 => lane + arg,
        _ if (lane ^ arg) >= seg + width => lane,
        _ => lane ^ arg,
    }
}

#[test]
fn warp_operations_follow_cudas_lane_semantics() {
    let threads = 128usize;
    let input: Vec<i32> = (0..threads as i32).map(|i| (i * 37 + 11) % 101).collect();
    for width in [32usize, 16, 8, 4, 2, 1] {
        for order in ORDERS {
            let mut inp = input.clone();
            let mut out = vec![0i32; 14 * threads];
            launch(
                "warp_ops",
                2,
                64,
                order,
                &[ptr(&mut inp), ptr(&mut out), A::I32(width as i32)],
            )
            .unwrap();
            for t in 0..threads {
                let (warp0, lane) = (t / 32 * 32, t % 32);
                let at = |l: usize| input[warp0 + l];
                let src = |kind, arg| at(shfl_src(kind, lane, arg, width));
                let bits = |f: &dyn Fn(usize) -> bool| {
                    (0..32).filter(|&l| f(l)).map(|l| 1u32 << l).sum::<u32>() as i32
                };
                let all_equal = (0..32).all(|l| at(l) / 1000 == at(0) / 1000);
                let want = [
                    src(0, 3),
                    src(1, 1),
                    src(2, 2),
                    src(3, 5),
                    i32::from((0..32).all(|l| at(l) > 0)),
                    i32::from((0..32).any(|l| at(l) > 90)),
                    bits(&|l| at(l) & 1 == 1),
                    bits(&|l| at(l) % 4 == at(lane) % 4),
                    if all_equal { -1 } else { 0 },
                    i32::from(all_equal),
                    (i64::from(at(7)) * 3_000_000_000 / 1_000_000) as i32,
                    1,
                    (0..32).map(|l| at(l) - 50).min().unwrap_or(0),
                    (0..32).map(|l| at(l) - 50).max().unwrap_or(0),
                ];
                assert_eq!(
                    out[14 * t..14 * t + 14],
                    want,
                    "thread {t} width {width} {order:?}"
                );
            }
        }
    }
}

/// castor_common.cuh's warp product and ldmatrix in the host build, one warp operation each
/// (castor_host_warp_mma, castor_host_gather): the product has exactly the bits of its shuffle
/// form and is A B by the fragment layout; ldmatrix gives each lane the values the PTX ISA
/// assigns it.
#[test]
fn warp_matrix_operations_equal_their_shuffle_forms_and_definitions() {
    let (warps, threads) = (4usize, 128usize);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // Fragment values from -32 to 32: halves of integers (their F32 sums are exact) and thirds
    // (theirs round), so that the comparison of bits covers rounded sums too.
    let mut value = || {
        let r = next();
        ((r % 129) as f32 - 64.0) / if r & 256 == 0 { 2.0 } else { 3.0 }
    };
    let mut a: Vec<f32> = (0..8 * threads).map(|_| value()).collect();
    let mut b: Vec<f32> = (0..4 * threads).map(|_| value()).collect();
    let mut d: Vec<f32> = (0..4 * threads).map(|_| value()).collect();
    let mut tiles: Vec<u16> = (0..256 * warps).map(|_| next() as u16).collect();
    for order in ORDERS {
        let mut d_out = vec![0f32; 8 * threads];
        let mut r_out = vec![0u32; 12 * threads];
        launch(
            "warp_matrix_ops",
            2,
            64,
            order,
            &[
                ptr(&mut a),
                ptr(&mut b),
                ptr(&mut d),
                ptr(&mut d_out),
                ptr(&mut tiles),
                ptr(&mut r_out),
            ],
        )
        .unwrap();
        for w in 0..warps {
            let lane_of = |l: usize| 32 * w + l;
            // A (16 x 16) and B (16 x 8) from the fragment layout (castor_common.cuh).
            let a_at = |row: usize, k: usize| {
                let l = (row % 8) * 4 + (k % 8) / 2;
                a[8 * lane_of(l) + (k % 2) + 2 * usize::from(row >= 8) + 4 * usize::from(k >= 8)]
            };
            let b_at = |k: usize, n: usize| {
                let l = n * 4 + (k % 8) / 2;
                b[4 * lane_of(l) + (k % 2) + 2 * usize::from(k >= 8)]
            };
            for l in 0..32 {
                let t = lane_of(l);
                let fast = &d_out[8 * t..8 * t + 4];
                let slow = &d_out[8 * t + 4..8 * t + 8];
                assert_eq!(
                    fast.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    slow.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "lane {l} of warp {w} {order:?}"
                );
                let (g, c) = (l / 4, l % 4);
                for (i, (row, col)) in [
                    (g, 2 * c),
                    (g, 2 * c + 1),
                    (g + 8, 2 * c),
                    (g + 8, 2 * c + 1),
                ]
                .into_iter()
                .enumerate()
                {
                    let terms: Vec<f64> = std::iter::once(f64::from(d[4 * t + i]))
                        .chain((0..16).map(|k| f64::from(a_at(row, k)) * f64::from(b_at(k, col))))
                        .collect();
                    let exact: f64 = terms.iter().sum();
                    let magnitude: f64 = terms.iter().map(|x| x.abs()).sum();
                    let got = f64::from(fast[i]);
                    // 17 terms summed in F32: at most 17 roundings of 2^-24 of their magnitude.
                    assert!(
                        (got - exact).abs() <= 17.0 * f64::from(f32::EPSILON / 2.0) * magnitude,
                        "D[{row}][{col}] of warp {w}: {got} vs {exact}"
                    );
                }
                // Matrix i, row r, column c of the warp's tiles; a register's two values.
                let m =
                    |i: usize, r: usize, c: usize| u32::from(tiles[256 * w + 64 * i + 8 * r + c]);
                let pair = |lo: u32, hi: u32| lo | hi << 16;
                let rows = |i: usize| pair(m(i, l / 4, 2 * (l % 4)), m(i, l / 4, 2 * (l % 4) + 1));
                let cols = |i: usize| pair(m(i, 2 * (l % 4), l / 4), m(i, 2 * (l % 4) + 1, l / 4));
                let want: Vec<u32> = (0..4)
                    .map(rows)
                    .chain((0..4).map(cols))
                    .chain((0..2).map(rows))
                    .chain((0..2).map(cols))
                    .collect();
                assert_eq!(
                    r_out[12 * t..12 * t + 12],
                    want,
                    "ldmatrix, lane {l} of warp {w} {order:?}"
                );
            }
        }
    }
}

#[test]
fn partial_masks_exchange_within_their_lanes() {
    let mut inp: Vec<i32> = (0..64).map(|i| i * 3 + 1).collect();
    let mut out = vec![0i32; 64];
    launch(
        "half_warps",
        1,
        64,
        Order::Reverse,
        &[ptr(&mut inp), ptr(&mut out)],
    )
    .unwrap();
    for t in 0..64 {
        let half = t / 16 * 16;
        let odd = (half..half + 16).filter(|&l| inp[l] & 1 == 1).count() as i32;
        assert_eq!(out[t], inp[t ^ 1] + 1000 * odd, "thread {t}");
    }
}

#[test]
fn barriers_order_shared_memory_and_the_race_shows() {
    for block in [32u32, 96, 1024] {
        let n = 3 * block as usize;
        let input: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut results = Vec::new();
        for entry in ["reverse_block", "reverse_block_racy"] {
            for order in ORDERS {
                let mut inp = input.clone();
                let mut out = vec![0f32; n];
                launch(entry, 3, block, order, &[ptr(&mut inp), ptr(&mut out)]).unwrap();
                results.push(out);
            }
        }
        // Reversed twice: each block's values doubled in place.
        let want: Vec<f32> = input.iter().map(|x| 2.0 * x).collect();
        assert_eq!(results[0], want);
        assert_eq!(results[1], want);
        // Without its barrier, thread order decides what a thread reads.
        assert!(
            results[2] != results[3],
            "the missing barrier went unnoticed at block {block}"
        );
    }
}

#[test]
fn atomics_are_atomic_across_the_grid() {
    let n = 5000;
    let mut inp: Vec<i32> = (0..n).map(|i| (i * 7919 + 13) % 1009 + 5).collect();
    let mut counts = vec![0i32; 7];
    let mut minimum = vec![i32::MAX];
    let mut sum = vec![0u64];
    let mut cas = vec![0i32; 2];
    launch(
        "atomics",
        5,
        128,
        Order::Forward,
        &[
            ptr(&mut inp),
            A::I32(n),
            ptr(&mut counts),
            ptr(&mut minimum),
            ptr(&mut sum),
            ptr(&mut cas),
        ],
    )
    .unwrap();
    for (k, &c) in counts.iter().enumerate() {
        assert_eq!(
            c as usize,
            inp.iter().filter(|&&x| x % 7 == k as i32).count()
        );
    }
    assert_eq!(minimum[0], *inp.iter().min().unwrap());
    assert_eq!(sum[0], inp.iter().map(|&x| x as u64).sum::<u64>());
    assert_eq!(cas, [1, 1]);
}

/// Bit patterns in value order, for stepping to the next representable value.
fn ordered(bits: u16) -> i32 {
    if bits & 0x8000 != 0 {
        -i32::from(bits & 0x7fff)
    } else {
        i32::from(bits) + 1
    }
}

fn unordered(o: i32) -> u16 {
    if o <= 0 {
        0x8000 | (-o) as u16
    } else {
        (o - 1) as u16
    }
}

/// The four roundings of `x` (rn, rz, rd, ru) to a 16-bit format, from its round-to-nearest
/// result `rn` and the value `to_f64` gives a pattern.
fn roundings(x: f32, rn: u16, to_f64: fn(u16) -> f64) -> [u16; 4] {
    let v = to_f64(rn);
    let x = f64::from(x);
    let step = |b: u16, by: i32| unordered(ordered(b) + by);
    let (rd, ru) = if v == x {
        (rn, rn)
    } else if v < x {
        (rn, step(rn, 1))
    } else {
        (step(rn, -1), rn)
    };
    let rz = if x > 0.0 { rd } else { ru };
    [rn, rz, rd, ru]
}

#[test]
fn conversions_round_as_cuda_documents() {
    // Every rounding decision of both formats: for each 16-bit value, the F32 values at the
    // midpoints to its neighbours and one F32 step either side; for bfloat16 the F32 patterns
    // whose low half is at or next to the rounding boundaries; then infinities and NaN.
    let mut xs: Vec<f32> = Vec::new();
    for b in 0..=u16::MAX {
        let h = f16::from_bits(b).to_f64();
        let next = f16::from_bits(b.wrapping_add(1)).to_f64();
        if h.is_finite() && next.is_finite() && b != 0x7fff {
            let mid = ((h + next) / 2.0) as f32;
            for d in [-1i32, 0, 1] {
                xs.push(f32::from_bits(mid.to_bits().wrapping_add_signed(d)));
            }
        }
        for low in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
            xs.push(f32::from_bits(u32::from(b) << 16 | low));
        }
    }
    xs.extend([
        65504.0,
        65519.99,
        65520.0,
        1e9,
        -1e9,
        f32::INFINITY,
        -f32::INFINITY,
    ]);
    xs.extend([f32::NAN, 9.3e18, -9.3e18, 1.5, -2.5, 0.0, -0.0, 1e-45]);
    xs.retain(|x| !x.is_nan() || x.to_bits() == f32::NAN.to_bits());
    let n = xs.len();
    let mut halves = vec![0u16; 8 * n];
    let mut ll = vec![0i64; n];
    let mut back = vec![0f32; 2 * n];
    launch(
        "conversions",
        64,
        256,
        Order::Forward,
        &[
            ptr(&mut xs),
            A::I32(n as i32),
            ptr(&mut halves),
            ptr(&mut ll),
            ptr(&mut back),
        ],
    )
    .unwrap();
    for (i, &x) in xs.iter().enumerate() {
        let got = &halves[8 * i..8 * i + 8];
        let h = f16::from_f32(x).to_bits();
        let b = bf16::from_f32(x).to_bits();
        if x.is_nan() {
            assert!(f16::from_bits(got[0]).is_nan() && bf16::from_bits(got[4]).is_nan());
            continue;
        }
        assert_eq!(
            got[..4],
            roundings(x, h, |b| f16::from_bits(b).to_f64()),
            "half of {x:e} ({:#010x})",
            x.to_bits()
        );
        assert_eq!(
            got[4..],
            roundings(x, b, |b| bf16::from_bits(b).to_f64()),
            "bfloat16 of {x:e} ({:#010x})",
            x.to_bits()
        );
        assert_eq!(ll[i], x as i64, "__float2ll_rz({x:e})");
        assert_eq!(back[2 * i], x as i64 as f32, "__ll2float_rn");
        assert_eq!(
            back[2 * i + 1].to_bits(),
            f16::from_f32(x).to_f32().to_bits()
        );
    }
    // Every pattern widened.
    let mut f = vec![0f32; 65536];
    let mut b = vec![0f32; 65536];
    launch(
        "widen",
        64,
        256,
        Order::Forward,
        &[A::I32(65536), ptr(&mut f), ptr(&mut b)],
    )
    .unwrap();
    for bits in 0..=u16::MAX {
        let (wf, wb) = (
            f16::from_bits(bits).to_f32(),
            bf16::from_bits(bits).to_f32(),
        );
        let same = |a: f32, w: f32| a.to_bits() == w.to_bits() || (a.is_nan() && w.is_nan());
        assert!(same(f[bits as usize], wf), "half {bits:#06x}");
        assert!(same(b[bits as usize], wb), "bfloat16 {bits:#06x}");
    }
}

#[test]
fn misuse_is_an_error_naming_the_thread() {
    let expect = [
        (0, "exited"),
        (1, "__syncthreads"),
        (2, "does not name the calling lane"),
        (3, "of its warp waits at"),
        (4, "which is not in the mask"),
    ];
    for (kind, words) in expect {
        for order in ORDERS {
            let mut out = vec![0i32; 64];
            let e = launch("misuse", 1, 64, order, &[A::I32(kind), ptr(&mut out)]).unwrap_err();
            let kind_ok = e.contains(words)
                // An exited lane is reported when it exits or when it is named, by order.
                || (kind == 0 && e.contains("exits while"));
            assert!(
                kind_ok && e.contains("block (0, 0, 0), thread ("),
                "kind {kind} {order:?}: {e}"
            );
        }
    }
    // A full mask in a warp of 16 lanes names lanes that do not exist.
    let mut inp = vec![1i32; 48 * 12];
    let mut out = vec![0i32; 48 * 12];
    let e = launch(
        "warp_ops",
        1,
        48,
        Order::Forward,
        &[ptr(&mut inp), ptr(&mut out), A::I32(32)],
    )
    .unwrap_err();
    assert!(e.contains("the warp has lanes 0x0000ffff only"), "{e}");
    let e = launch(
        "misuse",
        1,
        2048,
        Order::Forward,
        &[A::I32(9), ptr(&mut out)],
    )
    .unwrap_err();
    assert!(e.contains("2048 threads"), "{e}");
}

/// A block that waits for a flag earlier blocks raise (the attention backward's ordered dQ
/// sums) completes when blocks run in index order, as the device dispatches them; in the
/// reverse order the wait could never end, which is an error naming the thread rather than a
/// hang. `Order::ReverseThreads` (what the emulator runs such kernels' reverse pass in) keeps
/// the blocks in index order and reverses only the threads.
#[test]
fn a_wait_for_an_earlier_block_needs_blocks_in_index_order() {
    let mut count = vec![0i32];
    let mut order = vec![-1i32; 6];
    launch(
        "chained_blocks",
        6,
        32,
        Order::Forward,
        &[ptr(&mut count), ptr(&mut order)],
    )
    .unwrap();
    assert_eq!(order, [0, 1, 2, 3, 4, 5]);
    assert_eq!(count, [6]);
    let (mut count, mut order) = (vec![0i32], vec![-1i32; 6]);
    launch(
        "chained_blocks",
        6,
        32,
        Order::ReverseThreads,
        &[ptr(&mut count), ptr(&mut order)],
    )
    .unwrap();
    assert_eq!((order.as_slice(), count[0]), (&[0, 1, 2, 3, 4, 5][..], 6));
    let mut count = vec![0i32];
    let e = launch(
        "chained_blocks",
        6,
        32,
        Order::Reverse,
        &[ptr(&mut count), ptr(&mut order)],
    )
    .unwrap_err();
    assert!(
        e.contains("block (5, 0, 0), thread (0, 0, 0)") && e.contains("no earlier block raised"),
        "{e}"
    );
}

/// Runs this binary's ignored test `name` under `sanitize`; its stderr, or `None` when the
/// sanitizer is not available here (an error under `CI=true`).
fn under_sanitizer(name: &str, sanitize: Sanitize) -> Option<std::process::Output> {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let Some(env) = host::sanitizer_env(sanitize) else {
        assert!(!ci, "CI=true but the compiler has no {sanitize:?} runtime");
        eprintln!("skipped: the host compiler has no {sanitize:?} runtime");
        return None;
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--ignored", "--nocapture"])
        .envs(env)
        .output()
        .unwrap();
    Some(out)
}

#[test]
fn sanitizers_catch_the_seeded_bugs() {
    if host::sanitize().is_ok_and(|s| s != Sanitize::None) {
        return; // already the run under a sanitizer
    }
    if let Some(out) = under_sanitizer("seeded_race", Sanitize::Thread) {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("ThreadSanitizer: data race"),
            "ThreadSanitizer did not report the missing barrier:\n{err}"
        );
        assert!(err.contains("reverse_block_racy"), "{err}");
    }
    if let Some(out) = under_sanitizer("seeded_overflow", Sanitize::Address) {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("heap-buffer-overflow"),
            "AddressSanitizer did not report the write past the end:\n{err}"
        );
        assert!(err.contains("write_past_end"), "{err}");
    }
    // The same seeded-bug tests with a correct kernel pass under the sanitizers.
    for (name, sanitize) in [
        ("correct_barriers", Sanitize::Thread),
        ("correct_barriers", Sanitize::Address),
    ] {
        if let Some(out) = under_sanitizer(name, sanitize) {
            assert!(
                out.status.success(),
                "{name} under {sanitize:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
#[ignore = "run under ThreadSanitizer by sanitizers_catch_the_seeded_bugs"]
fn seeded_race() {
    let mut inp: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let mut out = vec![0f32; 64];
    let _ = launch(
        "reverse_block_racy",
        1,
        64,
        Order::Forward,
        &[ptr(&mut inp), ptr(&mut out)],
    );
}

#[test]
#[ignore = "run under AddressSanitizer by sanitizers_catch_the_seeded_bugs"]
fn seeded_overflow() {
    let mut out = vec![0f32; 100];
    let _ = launch(
        "write_past_end",
        1,
        128,
        Order::Forward,
        &[ptr(&mut out), A::I32(100)],
    );
}

#[test]
#[ignore = "run under the sanitizers by sanitizers_catch_the_seeded_bugs"]
fn correct_barriers() {
    let mut inp: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let mut out = vec![0f32; 256];
    launch(
        "reverse_block",
        2,
        128,
        Order::Forward,
        &[ptr(&mut inp), ptr(&mut out)],
    )
    .unwrap();
    let mut out = vec![0f32; 99];
    launch(
        "write_past_end",
        1,
        128,
        Order::Forward,
        &[ptr(&mut out), A::I32(98)],
    )
    .unwrap();
}
