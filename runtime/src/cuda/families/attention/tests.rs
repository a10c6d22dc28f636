//! `attention.cu` against `cpu/attention.rs`. The kernels and the twin round at the same
//! points (P and dS to the operand dtype where they enter a product, o and the gradients once
//! at the end); they sum in other orders (the tensor-core kernels in F32, 16 products at a
//! time and tile by tile; the twin in F64, key by key), the online softmax rescales its running
//! sums as the maximum grows, and the exponentials are CUDA's `expf` form against the twin's.
//! So results agree to a bound, not bit for bit; the bounds below are the measured worst case
//! with a margin, stated as a relative error ‖a−b‖/‖b‖ per output (and, for the F32 kernels,
//! whose sums are the twin's F64 sums, in units in the last place per element).

use crate::cuda::emulate::kernel_tests::{dec, dec_i32, enc, enc_i64, i32, i64, Launcher, Rng};
use crate::cpu::attention::{attention, attention_grad, Dropout, Operand, Problem};
use crate::cpu::mask::KeyMask;
use crate::cuda::program::Arg;
use castor_ir::philox::{dropout_scale, keep_threshold};
use castor_ir::{relative_error, round_to, DType};
use super::geometry::{self, Kernel};
use castor_kernels::host::{self, Sanitize};

/// Each dtype with its tiles (`None`: the F32 warp-per-row kernels) and the head dims tried
/// at each: the tile itself, and at the two narrow tiles a width that leaves part of the tile
/// as zero padding (the padding code is the same at every tile; the wide tiles cost the most
/// time on the host, under the sanitizers most of all).
fn variants() -> Vec<(DType, &'static str, Option<u32>, Vec<usize>)> {
    let mut v = vec![(DType::F32, "f32", None, vec![8, 33, 100])];
    for (dtype, sfx) in [(DType::F16, "f16"), (DType::BF16, "bf16")] {
        for p in geometry::TILES {
            let d = p as usize;
            let dims = if d <= 32 {
                vec![d, d - d / 4 + 1, d / 2]
            } else {
                vec![d]
            };
            v.push((dtype, sfx, Some(p), dims));
        }
    }
    v
}

pub(crate) fn entries() -> Vec<String> {
    let mut out = Vec::new();
    for (_, sfx, tile, _) in variants() {
        let suffix = tile.map_or(sfx.to_string(), |p| format!("{sfx}_d{p}"));
        let kernels: &[&str] = if tile.is_some() {
            &["fwd", "bwd"]
        } else {
            &["fwd", "bwd_dq", "bwd_dkdv"]
        };
        let packed: &[&str] = if tile.is_some() {
            &["", "_packed"]
        } else {
            &[""]
        };
        for k in kernels {
            for pk in packed {
                out.push(format!("attention_{k}_{suffix}{pk}"));
                out.push(format!("attention_{k}_{suffix}{pk}_dropout"));
            }
        }
    }
    for sfx in ["f32", "f16", "bf16"] {
        out.push(format!("attention_bwd_delta_{sfx}"));
    }
    out.push("attention_key_lengths".into());
    out
}

/// `attention_key_lengths` on rows of 300 keys (more than a block's 256 threads): every
/// query row, the kept prefix's length, and the first bad row's position for rows that
/// lengths cannot express (a hole, left padding, no key kept).
#[test]
fn key_lengths_are_the_kept_prefixes_and_other_rows_are_reported() {
    let keys = 300;
    // Keys kept: [start, end) runs.
    let row = |kept: &[(usize, usize)]| -> Vec<u8> {
        (0..keys)
            .map(|j| u8::from(kept.iter().any(|&(a, b)| (a..b).contains(&j))))
            .collect()
    };
    let run = |rows: &[Vec<u8>]| -> (Vec<i32>, i32) {
        let n = rows.len();
        let kv_offset = (4 * n).next_multiple_of(16) / 4;
        let mut l = Launcher::new("key_lengths.cu");
        let flags = l.buf(rows.concat(), 0);
        let lengths = l.out(4 * (kv_offset + n), 0);
        let bad = l.buf(i32::MAX.to_le_bytes().to_vec(), 0);
        let mut args = vec![
            l.ptr(flags),
            i32(n),
            i32(keys),
            i32(7),
            l.ptr(lengths),
            i32(kv_offset),
            l.ptr(bad),
            Arg::Null,
            Arg::Null,
        ];
        args.extend((0..8).map(|_| i32(0)));
        let out = l
            .run("attention_key_lengths", (n as u32, 1, 1), (256, 1, 1), args)
            .unwrap();
        let lengths = dec_i32(&out[lengths.0]);
        assert_eq!(&lengths[..n], vec![7; n].as_slice());
        assert!(lengths[n..kv_offset].iter().all(|&x| x == 0));
        (lengths[kv_offset..].to_vec(), dec_i32(&out[bad.0])[0])
    };
    // Right-padded rows, a full row, a row of one key, one whose last key is the 257th.
    let good = [row(&[(0, 300)]), row(&[(0, 1)]), row(&[(0, 257)]), row(&[(0, 120)])];
    assert_eq!(run(&good), (vec![300, 1, 257, 120], i32::MAX));
    // A hole in row 1 (key 290 kept after 200 dropped), left padding in row 2, no key in 3.
    let holes = row(&[(0, 200), (290, 291)]);
    let bad = [row(&[(0, 5)]), holes, row(&[(10, 300)]), row(&[])];
    let (lengths, first_bad) = run(&bad);
    assert_eq!(lengths, vec![5, 200, 0, 0]);
    assert_eq!(first_bad, (keys + 290) as i32);
    assert_eq!(run(&[row(&[(0, 3)]), row(&[])]).1, keys as i32);
}

/// Before a padded backward, `attention_key_lengths` zeroes the padded keys' dK and dV rows
/// (every head) through their strides, here a fused QKV product's `[b, s, 3, h, d]` gradient,
/// and leaves every other element (dQ, the kept keys' rows) as it was.
#[test]
fn key_lengths_zero_the_padded_keys_gradient_rows_in_place() {
    let (b, s, h, d) = (3usize, 300usize, 2usize, 24usize);
    let kept = [300usize, 1, 0];
    let flags: Vec<u8> = kept
        .iter()
        .flat_map(|&k| (0..s).map(move |j| u8::from(j < k)))
        .collect();
    let kv_offset = (4 * b).next_multiple_of(16) / 4;
    // Every element nonzero: [b, s, 3 (q, k, v), h, d], 16-bit.
    let elements = b * s * 3 * h * d;
    let before: Vec<u8> = (0..elements)
        .flat_map(|i| (1 + (i % 4000) as u16).to_le_bytes())
        .collect();
    let mut l = Launcher::new("key_lengths.cu");
    let flags = l.buf(flags, 0);
    let lengths = l.out(4 * (kv_offset + b), 0);
    let grads = l.buf(before.clone(), 0);
    let elem = 2u64;
    let (row, head, batch) = (3 * h * d, d, s * 3 * h * d);
    let args = vec![
        l.ptr(flags),
        i32(b),
        i32(s),
        i32(s),
        l.ptr(lengths),
        i32(kv_offset),
        Arg::Null,
        l.at(grads, (h * d) as u64 * elem),
        l.at(grads, (2 * h * d) as u64 * elem),
        i32(h),
        i32(d),
        i32(batch),
        i32(head),
        i32(row),
        i32(batch),
        i32(head),
        i32(row),
    ];
    let out = l
        .run("attention_key_lengths", (b as u32, 1, 1), (256, 1, 1), args)
        .unwrap();
    assert_eq!(dec_i32(&out[lengths.0])[kv_offset..], [300, 1, 0]);
    let after = &out[grads.0];
    for i in 0..elements {
        let (bi, rest) = (i / batch, i % batch);
        let (j, part) = (rest / row, rest % row / (h * d));
        let zeroed = part > 0 && j >= kept[bi];
        let x = u16::from_le_bytes([after[2 * i], after[2 * i + 1]]);
        let was = u16::from_le_bytes([before[2 * i], before[2 * i + 1]]);
        let want = if zeroed { 0 } else { was };
        assert_eq!(x, want, "batch {bi} key {j} part {part}");
    }
}

/// One problem: `nb` batches of `hkv` kv heads, each shared by `g` query heads; `t` queries,
/// `s` keys; a causal mask, narrowed by a sliding `window`, and/or a padding mask (one row of
/// keys per batch; the last batch keeps no key, so its rows are uniform; with one batch, every
/// third key is masked, so a window of one key sees none in every third row), or (`packed`,
/// with the causal mask) packed sequences' positions ([`positions`]).
#[derive(Clone, Copy, Debug)]
struct Case {
    nb: usize,
    hkv: usize,
    g: usize,
    t: usize,
    s: usize,
    causal: bool,
    window: Option<usize>,
    masked: bool,
    packed: bool,
}

impl Case {
    fn bq(&self) -> usize {
        self.nb * self.hkv * self.g
    }
}

const CASES: [Case; 6] = [
    // GPT-2's test fixture: four heads share the padding mask.
    Case {
        nb: 1,
        hkv: 4,
        g: 1,
        t: 32,
        s: 32,
        causal: true,
        window: None,
        masked: true,
        packed: false,
    },
    Case {
        nb: 1,
        hkv: 1,
        g: 1,
        t: 1,
        s: 1,
        causal: false,
        window: None,
        masked: false,
        packed: false,
    },
    Case {
        nb: 1,
        hkv: 2,
        g: 1,
        t: 33,
        s: 33,
        causal: true,
        window: None,
        masked: false,
        packed: false,
    },
    Case {
        nb: 2,
        hkv: 1,
        g: 2,
        t: 65,
        s: 70,
        causal: true,
        window: None,
        masked: true,
        packed: false,
    },
    // A sliding window: the last query tile skips the first key tile, the last key block
    // skips the first query tiles.
    Case {
        nb: 2,
        hkv: 1,
        g: 2,
        t: 65,
        s: 70,
        causal: true,
        window: Some(5),
        masked: true,
        packed: false,
    },
    // A window of one key over a mask with holes: rows whose key is masked see none.
    Case {
        nb: 1,
        hkv: 1,
        g: 1,
        t: 33,
        s: 33,
        causal: true,
        window: Some(1),
        masked: true,
        packed: false,
    },
];

/// Problems that span several backward key blocks (128 keys) and query tiles, so that query
/// tiles take dQ shares from several blocks in the order the counters keep. Run at the tiles
/// real models use, once per tile (bf16 at 64, f16 at 128), and not again under the
/// sanitizers: the host build takes longest here, and blocks run one at a time there anyway.
const LONG_CASES: [Case; 5] = [
    // More keys than queries (bottom-right causal), grouped heads, a padding mask.
    Case {
        nb: 1,
        hkv: 1,
        g: 2,
        t: 130,
        s: 200,
        causal: true,
        window: None,
        masked: true,
        packed: false,
    },
    // Every key block reads every tile: no causal mask.
    Case {
        nb: 1,
        hkv: 1,
        g: 1,
        t: 70,
        s: 260,
        causal: false,
        window: None,
        masked: false,
        packed: false,
    },
    // A window over a mask: every tile goes to every key block (a row may see none).
    Case {
        nb: 2,
        hkv: 1,
        g: 1,
        t: 140,
        s: 140,
        causal: true,
        window: Some(60),
        masked: true,
        packed: false,
    },
    // Past one segment of query rows (512): the first key blocks' work splits over blocks
    // that sum their dK and dV in turn, with the grouped heads' links.
    Case {
        nb: 1,
        hkv: 1,
        g: 2,
        t: 530,
        s: 530,
        causal: true,
        window: None,
        masked: false,
        packed: false,
    },
    // A sliding window past one segment: links whose segment reads none of the key block's
    // tiles, first (the last key block's first segment), in the middle and last (the first
    // key block's second segment), which pass the dK and dV sum on without adding to it.
    Case {
        nb: 1,
        hkv: 1,
        g: 2,
        t: 530,
        s: 530,
        causal: true,
        window: Some(64),
        masked: false,
        packed: false,
    },
];

/// The largest relative error of any output, by dtype: the measured worst (F32 1.6e-7, F16
/// 2.8e-4, BF16 2.2e-3 over every case at every tile) with a margin of about 2. F32 differs in
/// the online rescaling and `expf`; F16 and BF16 mostly where an F32 value a few ulps from the
/// twin's rounds to the neighbouring F16/BF16 value: P and dS entering a product (the kernels
/// round P relative to the running maximum, the twin relative to the row's maximum) and o and
/// the gradients at the end, where one flipped rounding is a whole unit of 2^-8 in BF16. The
/// worst is the forward's o over 260 unmasked keys (several key tiles: the running maximum
/// moves).
fn bound(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 3e-7,
        DType::F16 => 6e-4,
        _ => 5e-3,
    }
}

/// Where a test puts a `[batches, rows, d]` operand whose batches split by `heads`: dense, or
/// in place as a head of a fused QKV product or a context in `[B, T, H, d]` sits,
/// `[batches / heads, rows, heads, d + GAP]` with other data in the gaps (the kernels read it
/// through strides and must neither read nor write the gaps).
#[derive(Clone, Copy, Debug)]
struct Layout {
    heads: usize,
    rows: usize,
    d: usize,
    in_place: bool,
}

/// Elements between one head's row and the next head's in the in-place layout.
const GAP: usize = 8;
/// What the gaps hold: a value no result is near.
const GAP_FILL: f32 = 1000.0;

impl Layout {
    /// (batch, head, row) strides in elements.
    fn strides(&self) -> [usize; 3] {
        let (h, r, d) = (self.heads, self.rows, self.d);
        if self.in_place {
            let w = d + GAP;
            [r * h * w, w, h * w]
        } else {
            [h * r * d, r * d, d]
        }
    }

    /// The stride arguments `X_batch`, `X_head`, `X_row`.
    fn args(&self) -> [Arg; 3] {
        self.strides().map(i32)
    }

    fn index(&self, b: usize, r: usize, j: usize) -> usize {
        let st = self.strides();
        (b / self.heads) * st[0] + (b % self.heads) * st[1] + r * st[2] + j
    }

    fn len(&self, batches: usize) -> usize {
        batches.div_ceil(self.heads) * self.strides()[0]
    }

    /// Dense `x` laid out, the gaps filled.
    fn place(&self, x: &[f32], batches: usize) -> Vec<f32> {
        let mut y = vec![GAP_FILL; self.len(batches)];
        for b in 0..batches {
            for r in 0..self.rows {
                for j in 0..self.d {
                    y[self.index(b, r, j)] = x[(b * self.rows + r) * self.d + j];
                }
            }
        }
        y
    }

    /// The dense operand read back from `y`; panics if a gap was written.
    fn gather(&self, y: &[f32], batches: usize, what: &str) -> Vec<f32> {
        let mut x = vec![0.0; batches * self.rows * self.d];
        let mut inside = vec![false; y.len()];
        for b in 0..batches {
            for r in 0..self.rows {
                for j in 0..self.d {
                    let i = self.index(b, r, j);
                    x[(b * self.rows + r) * self.d + j] = y[i];
                    inside[i] = true;
                }
            }
        }
        if self.in_place {
            let written = (0..y.len()).find(|&i| !inside[i] && y[i] != GAP_FILL);
            assert!(
                written.is_none(),
                "{what}: a gap was written at {written:?}"
            );
        }
        x
    }
}

struct Worst {
    what: String,
    err: f64,
}

/// Packed sequences' positions ([`positions`]), with the causal mask: each query sees only the
/// keys of its own sequence up to itself.
const PACKED_CASES: [Case; 5] = [
    // GPT-2's test fixture: four heads share the positions.
    Case {
        nb: 1,
        hkv: 4,
        g: 1,
        t: 32,
        s: 32,
        causal: true,
        window: None,
        masked: false,
        packed: true,
    },
    Case {
        nb: 1,
        hkv: 1,
        g: 1,
        t: 1,
        s: 1,
        causal: true,
        window: None,
        masked: false,
        packed: true,
    },
    // Grouped heads, more keys than queries; the second batch's positions are malformed.
    Case {
        nb: 2,
        hkv: 1,
        g: 2,
        t: 65,
        s: 70,
        causal: true,
        window: None,
        masked: false,
        packed: true,
    },
    // A sliding window over packed rows (Mistral's): the later of the two starts.
    Case {
        nb: 2,
        hkv: 1,
        g: 1,
        t: 65,
        s: 65,
        causal: true,
        window: Some(5),
        masked: false,
        packed: true,
    },
    // Far fewer queries than keys: the rows' keys start at s - t.
    Case {
        nb: 2,
        hkv: 1,
        g: 1,
        t: 17,
        s: 40,
        causal: true,
        window: None,
        masked: false,
        packed: true,
    },
];

/// Packed rows over several key tiles, backward key blocks and query tiles: key blocks that
/// skip query tiles whose rows all start past them, tiles inside a block's run that no row of
/// it reads (the third batch's), and sequences across tile edges. Run as [`LONG_CASES`].
const PACKED_LONG_CASES: [Case; 2] = [
    Case {
        nb: 3,
        hkv: 1,
        g: 2,
        t: 300,
        s: 300,
        causal: true,
        window: None,
        masked: false,
        packed: true,
    },
    Case {
        nb: 2,
        hkv: 1,
        g: 1,
        t: 140,
        s: 260,
        causal: true,
        window: Some(60),
        masked: false,
        packed: true,
    },
];

/// Positions of `nb` rows of `s` keys, each counting 0, 1, .. along its sequences. Row 0 packs
/// sequences of random lengths (a third of them one key long, some longer than a key tile);
/// row 1 too, with one key in five given a position no packing makes (negative, past the key
/// itself, past the row), which the kernels clamp as the twin does; row 2 packs sequences of
/// 64 keys (starting at the backward's query tiles' edges) and gives its last key a position
/// past itself, so that its sequence reaches back to the row's start: a key block then reads
/// the last query tile but none of the tiles between it and the block's own.
fn positions(rng: &mut Rng, nb: usize, s: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(nb * s);
    for b in 0..nb {
        let row = out.len();
        while out.len() < row + s {
            let len = match (b, rng.next() % 6) {
                (2, _) => 64,
                (_, 0 | 1) => 1,
                (_, 2) => 2 + rng.next() % 4,
                (_, 3) => 6 + rng.next() % 20,
                _ => 30 + rng.next() % 150,
            } as usize;
            let len = len.min(row + s - out.len());
            out.extend((0..len).map(|p| p as i64));
        }
        match b {
            1 => {
                for p in &mut out[row..] {
                    if rng.next().is_multiple_of(5) {
                        *p = (rng.next() % (s as u64 + 12)) as i64 - 6;
                    }
                }
            }
            2 => out[row + s - 1] = s as i64 + 3,
            _ => {}
        }
    }
    out
}

#[test]
fn attention_kernels_agree_with_the_twin() {
    let worst = agree_with_the_twin(Rng::new(11), &CASES, &LONG_CASES, None);
    for (dtype, w) in worst {
        println!(
            "attention {dtype:?}: worst relative error {:.2e} ({})",
            w.err, w.what
        );
    }
}

#[test]
fn attention_kernels_over_packed_sequences_agree_with_the_twin() {
    let worst = agree_with_the_twin(Rng::new(23), &PACKED_CASES, &PACKED_LONG_CASES, None);
    for (dtype, w) in worst {
        println!(
            "attention over packed sequences {dtype:?}: worst relative error {:.2e} ({})",
            w.err, w.what
        );
    }
}

/// The `_dropout` entry points beside the twin with the same dropout: every case (plain,
/// padded, grouped, windowed, and packed) at every variant and head dim, in training mode
/// (p = 0.1 and, on the plain cases, 0.5) and in evaluation mode (a negative offset), each
/// output within the bound of the kernels without dropout. A mask that differed from the
/// twin's in one entry of a row would move that row's output by about that probability times
/// 1 / (1 - p), far past the bound: the kernels drop exactly the twin's entries.
#[test]
fn attention_kernels_with_dropout_agree_with_the_twin() {
    let sanitized = host::sanitize().is_ok_and(|s| s != Sanitize::None);
    let runs: &[(&[Case], &[Case], Dropout)] = &[
        (&CASES, &LONG_CASES, Dropout { key: [42, 3], stream: 5, p: 0.1 }),
        (&PACKED_CASES, &PACKED_LONG_CASES, Dropout { key: [7, 11], stream: 2, p: 0.1 }),
        (&CASES[..3], &[], Dropout { key: [9, 1], stream: 0, p: 0.5 }),
        (&CASES[3..4], &[], Dropout { key: [42, -1], stream: 5, p: 0.1 }),
    ];
    for (i, &(cases, long, drop)) in runs.iter().enumerate() {
        if sanitized && i > 0 {
            break;
        }
        let worst = agree_with_the_twin(Rng::new(31 + i as u64), cases, long, Some(drop));
        for (dtype, w) in worst {
            println!(
                "attention with dropout {drop:?} {dtype:?}: worst relative error {:.2e} ({})",
                w.err, w.what
            );
        }
    }
}

/// Runs `cases` at every variant and head dim (and `long` at one tile per 16-bit dtype) beside
/// the twin, each output within [`bound`]; returns each dtype's worst. With `drop`, the
/// `_dropout` entry points and the twin with that dropout.
fn agree_with_the_twin(
    mut rng: Rng,
    cases: &[Case],
    long_cases: &[Case],
    drop: Option<Dropout>,
) -> Vec<(DType, Worst)> {
    let mut worst: Vec<(DType, Worst)> = Vec::new();
    for (dtype, sfx, tile, dims) in variants() {
        let suffix = tile.map_or(sfx.to_string(), |p| format!("{sfx}_d{p}"));
        let long = matches!(
            (dtype, tile),
            (DType::BF16, Some(64)) | (DType::F16, Some(128))
        ) && !host::sanitize().is_ok_and(|s| s != Sanitize::None);
        let first = dims.first().copied();
        for d in dims {
            for case in cases.iter().chain(if long { long_cases } else { &[] }) {
                let case = *case;
                // In place: the tensor-core kernels, at the variant's first head dim.
                let in_place = tile.is_some() && Some(d) == first;
                let layouts: &[bool] = if in_place { &[false, true] } else { &[false] };
                for (what, err) in layouts
                    .iter()
                    .flat_map(|&ip| run_case(&mut rng, dtype, &suffix, tile, d, case, (ip, drop)))
                {
                    assert!(
                        err <= bound(dtype),
                        "{what}: relative error {err:.3e} over the bound {:.1e}",
                        bound(dtype)
                    );
                    match worst.iter_mut().find(|(t, _)| *t == dtype) {
                        Some((_, w)) if w.err >= err => {}
                        Some((_, w)) => *w = Worst { what, err },
                        None => worst.push((dtype, Worst { what, err })),
                    }
                }
            }
        }
    }
    worst
}

/// Runs the forward, delta, dq and dk/dv kernels of one case beside the twin; returns each
/// output's relative error.
fn run_case(
    rng: &mut Rng,
    dtype: DType,
    suffix: &str,
    tile: Option<u32>,
    d: usize,
    c: Case,
    (in_place, drop): (bool, Option<Dropout>),
) -> Vec<(String, f64)> {
    let (bq, bkv) = (c.bq(), c.nb * c.hkv);
    let hq = c.hkv * c.g;
    let ql = Layout {
        heads: hq,
        rows: c.t,
        d,
        in_place,
    };
    let kl = Layout {
        heads: c.hkv,
        rows: c.s,
        d,
        in_place,
    };
    // Odd cases put one operand a few bytes past 16-byte alignment (the kernels' element-by-
    // element tile loads and stores); even ones keep every buffer aligned (their 16-byte
    // asynchronous copies and vector stores).
    let elem = dtype.size_bytes();
    let skew = if (c.s + d) % 2 == 1 { elem as u64 } else { 0 };
    let scale = 1.0 / (d as f64).sqrt();
    let q = rng.values(bq * c.t * d, 1.0, dtype);
    let k = rng.values(bkv * c.s * d, 1.0, dtype);
    let v = rng.values(bkv * c.s * d, 1.0, dtype);
    // One batch: every third key is dropped. Two: batch 0 is left-padded (its first eight
    // keys dropped, so its first rows see none under a causal mask and attend uniformly while
    // later rows see keys), the last batch keeps none.
    let keep: Vec<bool> = (0..c.nb * c.s)
        .map(|i| match (c.nb, i / c.s) {
            (1, _) => i % 3 != 1,
            (_, b) => b + 1 < c.nb && i % c.s >= 8,
        })
        .collect();
    let pos = if c.packed {
        positions(rng, c.nb, c.s)
    } else {
        Vec::new()
    };
    let (q_shape, kv_shape) = ([c.nb, c.hkv, c.g, c.t, d], [c.nb, c.hkv, 1, c.s, d]);
    let mask_shape = [c.nb, 1, 1, 1, c.s];
    let mask = if c.packed {
        Some(KeyMask::Positions(&pos[..], &mask_shape[..]))
    } else {
        c.masked.then_some(KeyMask::Keep(&keep[..], &mask_shape[..]))
    };
    let problem = Problem {
        q: &q_shape,
        k: &kv_shape,
        v: &kv_shape,
        mask,
        causal: c.causal,
        window: c.window,
        scale,
        operand: Operand::Dtype(dtype),
        // Evaluation mode is the twin without dropout.
        dropout: drop.filter(|d| d.key[1] >= 0),
    };
    let (o, lse) = attention(&q, &k, &v, &problem);
    let o: Vec<f32> = o.iter().map(|&x| round_to(dtype, x)).collect();
    let d_o = rng.values(bq * c.t * d, 1.0, dtype);
    let (dq, dk, dv) = attention_grad(&q, &k, &v, &o, &lse, &d_o, &problem);
    let round = |x: Vec<f32>| -> Vec<f32> { x.iter().map(|&x| round_to(dtype, x)).collect() };
    let (dq, dk, dv) = (round(dq), round(dk), round(dv));
    // D = rowsum(dO * O), F64 in order, as the twin computes it.
    let delta: Vec<f32> = (0..bq * c.t)
        .map(|r| {
            let dot: f64 = (0..d)
                .map(|j| f64::from(d_o[r * d + j]) * f64::from(o[r * d + j]))
                .sum();
            dot as f32
        })
        .collect();

    let at = if in_place { " in place" } else { "" };
    // The dropout entry points and their last arguments (the key in device memory).
    let ds = if drop.is_some() { "_dropout" } else { "" };
    // Packed sequences' positions: the tensor-core kernels' `_packed` entry points.
    let ds = match (c.packed && tile.is_some(), ds) {
        (true, ds) => format!("_packed{ds}"),
        (false, ds) => ds.to_string(),
    };
    let drop_args = |l: &mut Launcher| -> Vec<Arg> {
        let Some(dr) = drop else { return Vec::new() };
        let key = l.buf(enc_i64(&dr.key), 0);
        vec![
            l.ptr(key),
            Arg::U32(dr.stream),
            Arg::U64(keep_threshold(dr.p)),
            Arg::F64(f64::from(dropout_scale(dr.p))),
        ]
    };
    let name = |k: &str| format!("attention_{k}_{suffix}{ds} d={d} {c:?}{at}");
    // The kernels' strides, each operand's (q-side or key-side) in turn.
    let strides_args =
        |sides: &[&Layout]| -> Vec<Arg> { sides.iter().flat_map(|l| l.args()).collect() };
    let shape_args = |batches: usize| -> Vec<Arg> {
        vec![
            i64(batches),
            i32(c.t),
            i32(c.s),
            i32(d),
            i32(c.g),
            i32(c.hkv * c.g),
            i32(usize::from(c.causal)),
            i32(c.window.unwrap_or(0)),
            Arg::F64(scale),
        ]
    };
    let launch = |l: &mut Launcher, kernel: Kernel| {
        let grid = geometry::grid(
            kernel,
            tile,
            bq as u32,
            (hq as u32, c.g as u32),
            (c.t as u32, c.s as u32),
            geometry::banded(c.causal, c.window.unwrap_or(0)),
        );
        l.shared(tile.map_or(0, |p| geometry::shared_bytes(kernel, p, elem as u32)));
        (grid, (geometry::threads(kernel, tile.is_some()), 1, 1))
    };
    let mask_bytes: Vec<u8> = keep.iter().map(|&k| u8::from(k)).collect();
    // The kernels' mask and positions arguments: one of them, or neither.
    let mask_args = |l: &Launcher, bm, bp| -> [Arg; 2] {
        match (c.packed, c.masked) {
            (true, _) => [Arg::Null, l.ptr(bp)],
            (false, true) => [l.ptr(bm), Arg::Null],
            (false, false) => [Arg::Null, Arg::Null],
        }
    };
    let mut errors = Vec::new();

    // Forward.
    let mut l = Launcher::new("attention.cu");
    let bqv = l.buf(enc(dtype, &ql.place(&q, bq)), skew);
    let bk = l.buf(enc(dtype, &kl.place(&k, bkv)), 0);
    let bv = l.buf(enc(dtype, &kl.place(&v, bkv)), 0);
    let bm = l.buf(mask_bytes.clone(), 1);
    let bp = l.buf(enc_i64(&pos), 0);
    let bo = l.buf(enc(dtype, &ql.place(&vec![0.0; bq * c.t * d], bq)), 0);
    let blse = l.out(bq * c.t * 4, 0);
    let mut args = vec![l.ptr(bqv), l.ptr(bk), l.ptr(bv)];
    args.extend(mask_args(&l, bm, bp));
    args.extend([l.ptr(bo), l.ptr(blse)]);
    args.extend(shape_args(bq));
    if tile.is_some() {
        args.extend(strides_args(&[&ql, &kl, &kl, &ql]));
    }
    args.extend(drop_args(&mut l));
    let (grid, block) = launch(&mut l, Kernel::Forward);
    let what = name("fwd");
    let out = l
        .run(&format!("attention_fwd_{suffix}{ds}"), grid, block, args)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let got_o = ql.gather(&dec(dtype, &out[bo.0]), bq, &what);
    errors.push((format!("{what} o"), relative_error(&got_o, &o)));
    errors.push((
        format!("{what} lse"),
        relative_error(&dec(DType::F32, &out[blse.0]), &lse),
    ));

    // delta.
    let sfx = suffix.split('_').next().unwrap_or(suffix);
    let mut l = Launcher::new("attention.cu");
    let bo = l.buf(enc(dtype, &ql.place(&o, bq)), 0);
    let bdo = l.buf(enc(dtype, &ql.place(&d_o, bq)), skew);
    let bdelta = l.out(bq * c.t * 4, 0);
    let mut args = vec![
        l.ptr(bo),
        l.ptr(bdo),
        l.ptr(bdelta),
        i64(bq * c.t),
        i32(c.t),
        i32(d),
        i32(hq),
    ];
    args.extend(strides_args(&[&ql, &ql]));
    let what = format!("attention_bwd_delta_{sfx} d={d} {c:?}{at}");
    let out = l
        .run(
            &format!("attention_bwd_delta_{sfx}"),
            geometry::delta_grid((bq * c.t) as u64, d as u32),
            (geometry::THREADS, 1, 1),
            args,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    errors.push((
        what,
        relative_error(&dec(DType::F32, &out[bdelta.0]), &delta),
    ));

    // The gradients, from the twin's o, lse and delta.
    let grads = |kernel: Kernel| -> Vec<Vec<f32>> {
        let mut l = Launcher::new("attention.cu");
        let bqv = l.buf(enc(dtype, &ql.place(&q, bq)), 0);
        let bk = l.buf(enc(dtype, &kl.place(&k, bkv)), skew);
        let bv = l.buf(enc(dtype, &kl.place(&v, bkv)), 0);
        let bm = l.buf(mask_bytes.clone(), 0);
        let bp = l.buf(enc_i64(&pos), 8);
        let bdo = l.buf(enc(dtype, &ql.place(&d_o, bq)), 0);
        let blse = l.buf(enc(DType::F32, &lse), 0);
        let bdelta = l.buf(enc(DType::F32, &delta), 0);
        let mut args = vec![l.ptr(bqv), l.ptr(bk), l.ptr(bv)];
        args.extend(mask_args(&l, bm, bp));
        args.extend([l.ptr(bdo), l.ptr(blse), l.ptr(bdelta)]);
        let (entry, outs) = match kernel {
            Kernel::Dq => {
                let b = l.out(bq * c.t * d * elem, 0);
                args.push(l.ptr(b));
                args.extend(shape_args(bq));
                ("bwd_dq", vec![b])
            }
            Kernel::DkDv => {
                let bdk = l.out(bkv * c.s * d * elem, 0);
                let bdv = l.out(bkv * c.s * d * elem, skew);
                args.push(l.ptr(bdk));
                args.push(l.ptr(bdv));
                args.extend(shape_args(bkv));
                ("bwd_dkdv", vec![bdk, bdv])
            }
            _ => {
                let p = tile.expect("the one-pass backward is a tensor-core kernel");
                let zeros =
                    |l: &Layout, n: usize| enc(dtype, &l.place(&vec![0.0; n * l.rows * d], n));
                let b = l.buf(zeros(&ql, bq), 0);
                let bdk = l.buf(zeros(&kl, bkv), 0);
                let bdv = l.buf(zeros(&kl, bkv), skew);
                let scratch = geometry::backward_scratch(
                    p,
                    (bq as u64, c.g as u64),
                    (c.t as u64, c.s as u64),
                    geometry::banded(c.causal, c.window.unwrap_or(0)),
                );
                let acc = l.out(4 * scratch.acc_elems as usize, 0);
                let ready = l.buf(vec![0; 4 * scratch.ready_count as usize], 0);
                for x in [b, bdk, bdv, acc, ready] {
                    args.push(l.ptr(x));
                }
                args.extend(shape_args(bkv));
                args.extend(strides_args(&[&ql, &kl, &kl, &ql, &ql, &kl, &kl]));
                ("bwd", vec![b, bdk, bdv])
            }
        };
        args.extend(drop_args(&mut l));
        let (grid, block) = launch(&mut l, kernel);
        let what = name(entry);
        let out = l
            .run(&format!("attention_{entry}_{suffix}{ds}"), grid, block, args)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        if tile.is_some() {
            let layouts = [(ql, bq), (kl, bkv), (kl, bkv)];
            return outs
                .iter()
                .zip(layouts)
                .map(|(b, (lay, n))| lay.gather(&dec(dtype, &out[b.0]), n, &what))
                .collect();
        }
        outs.iter().map(|b| dec(dtype, &out[b.0])).collect()
    };
    // With one key (or one visible key per row) dq and dk are zero in exact arithmetic: the
    // score gradient dS = P (dP - D) is the difference of two sums of the same products in
    // other orders. There the error is measured against the incoming gradient's norm.
    // With dropout, such a gradient is not zero but the rounding of o (whose delta no longer
    // cancels dP exactly once o is scaled by 1 / (1 - p)): wherever the twin's gradient is
    // that small against do, the error is measured the same way.
    let gradient_error = |got: &[f32], want: &[f32]| {
        if want.iter().all(|&x| x == 0.0) {
            relative_error(got, &vec![0.0; got.len()]).min(norm(got) / norm(&d_o))
        } else if drop.is_some() && norm(want) < 1e-2 * norm(&d_o) {
            let diff: Vec<f32> = got.iter().zip(want).map(|(a, b)| a - b).collect();
            relative_error(got, want).min(norm(&diff) / norm(&d_o))
        } else {
            relative_error(got, want)
        }
    };
    let got = if tile.is_some() {
        grads(Kernel::Backward)
    } else {
        let mut got = grads(Kernel::Dq);
        got.extend(grads(Kernel::DkDv));
        got
    };
    let entry = if tile.is_some() { "bwd" } else { "bwd_dq" };
    errors.push((format!("{} dq", name(entry)), gradient_error(&got[0], &dq)));
    let entry = if tile.is_some() { "bwd" } else { "bwd_dkdv" };
    errors.push((format!("{} dk", name(entry)), gradient_error(&got[1], &dk)));
    errors.push((format!("{} dv", name(entry)), relative_error(&got[2], &dv)));
    errors
}

fn norm(x: &[f32]) -> f64 {
    x.iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt()
}
