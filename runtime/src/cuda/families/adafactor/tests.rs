//! `adafactor.cu` against `cpu/adafactor.rs`: the seven launches of one update, in the
//! lowering's order and shapes, equal the twin bit for bit (master, moments, working copy),
//! factored and full, with and without a first moment, weight decay, clipping, the relative
//! step, and a skipped step.

use crate::cuda::emulate::kernel_tests::{check, dec, enc, grid_1d, i32, i64, Buf, Launcher, Rng, FLOATS};
use crate::cpu::adafactor::{self as twin, SecondMoment};
use crate::cpu::optimizer::Control;
use crate::cuda::program::Arg;
use castor_ir::AdafactorHparams;
use castor_ir::{round_to, DType};

pub(crate) fn entries() -> Vec<String> {
    let mut out: Vec<String> = [
        "adafactor_rows",
        "adafactor_cols",
        "adafactor_full",
        "adafactor_row_mean",
        "adafactor_partials",
        "adafactor_finalize",
    ]
    .map(String::from)
    .to_vec();
    for (_, s) in FLOATS {
        out.push(format!("adafactor_apply_{s}"));
    }
    out
}

const THREADS: u32 = 256;
const CHUNK: usize = 16_384;

/// The buffers of one update, by name; each launch gets a fresh launcher holding all of them
/// and hands back their contents, so the next launch reads what this one wrote.
struct Bufs {
    names: Vec<&'static str>,
    data: Vec<Vec<u8>>,
}

/// A launch argument: a buffer by name, or a value. (A few per launch: their size does not
/// matter.)
#[allow(clippy::large_enum_variant)]
enum A {
    B(&'static str),
    V(Arg),
}

impl Bufs {
    fn run(
        &mut self,
        entry: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[(&str, A)],
    ) {
        let mut l = Launcher::new("adafactor.cu");
        let bufs: Vec<Buf> = self.data.iter().map(|b| l.buf(b.clone(), 0)).collect();
        let named: Vec<(&str, Arg)> = args
            .iter()
            .map(|(name, a)| {
                let arg = match a {
                    A::B(b) => {
                        let i = self.names.iter().position(|n| n == b).unwrap();
                        l.ptr(bufs[i])
                    }
                    A::V(v) => v.clone(),
                };
                (*name, arg)
            })
            .collect();
        let ordered = crate::cuda::families::signature(entry)
            .and_then(|s| s.order(entry, &named))
            .unwrap_or_else(|e| panic!("{entry}: {e}"));
        self.data = l
            .run(entry, grid, block, ordered)
            .unwrap_or_else(|e| panic!("{entry}: {e}"));
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        let i = self.names.iter().position(|n| *n == name).unwrap();
        dec(DType::F32, &self.data[i])
    }
}

struct Case {
    dims: Vec<usize>,
    beta1: Option<f64>,
    weight_decay: f64,
    relative_step: bool,
    max_grad_norm: f64,
    grad_norm: f32,
    copy: Option<DType>,
}

fn run_case(case: &Case, rng: &mut Rng) {
    let n: usize = case.dims.iter().product();
    let r = case.dims.len();
    let factored = r >= 2;
    let (rows, cols) = if factored {
        (case.dims[r - 2], case.dims[r - 1])
    } else {
        (1, 1)
    };
    let lead = n / (rows * cols);
    let h = AdafactorHparams {
        beta1: case.beta1,
        decay_rate: -0.8,
        eps1: 1e-30,
        eps2: 1e-3,
        clip_threshold: 1.0,
        weight_decay: case.weight_decay,
        relative_step: case.relative_step,
        scale_parameter: case.relative_step,
        warmup_init: false,
    };
    let c = Control {
        lr: 1e-2,
        step: 3.0,
        scale: 2.0,
        grad_norm: case.grad_norm,
        max_grad_norm: case.max_grad_norm,
    };
    let p = rng.values(n, 1.0, DType::F32);
    let g = rng.values(n, 3.0, DType::F32);
    let m = rng.values(n, 0.01, DType::F32);
    let mut positive = |k: usize| -> Vec<f32> {
        rng.values(k, 1.0, DType::F32)
            .iter()
            .map(|x| x.abs() + 0.1)
            .collect()
    };
    let (row, col, v) = if factored {
        (positive(lead * rows), positive(lead * cols), vec![0.0])
    } else {
        (vec![0.0], vec![0.0], positive(n))
    };

    // The twin.
    let (mut p2, mut m2, mut row2, mut col2, mut v2) =
        (p.clone(), m.clone(), row.clone(), col.clone(), v.clone());
    let second = if factored {
        SecondMoment::Factored {
            rows,
            cols,
            row: &mut row2,
            col: &mut col2,
        }
    } else {
        SecondMoment::Full(&mut v2)
    };
    let exp_avg = case.beta1.map(|_| m2.as_mut_slice());
    twin::adafactor(&h, c, &mut p2, &g, exp_avg, second);

    // The launches, in the lowering's order and shapes.
    let n_chunks = n.div_ceil(CHUNK);
    let cdt = case.copy.unwrap_or(DType::F32);
    let f32s = |v: &[f32]| enc(DType::F32, v);
    let mut b = Bufs {
        names: vec![
            "master",
            "grad",
            "exp_avg",
            "row",
            "col",
            "v",
            "row_mean",
            "partials",
            "factors",
            "copy",
            "lr",
            "step",
            "scale",
            "grad_norm",
        ],
        data: vec![
            f32s(&p),
            f32s(&g),
            f32s(&m),
            f32s(&row),
            f32s(&col),
            f32s(&v),
            vec![0xFF; lead * 4],
            vec![0xFF; 2 * n_chunks * 8],
            vec![0xFF; 8],
            vec![0xFF; n * cdt.size_bytes()],
            f32s(&[c.lr]),
            f32s(&[c.step]),
            f32s(&[c.scale]),
            f32s(&[c.grad_norm]),
        ],
    };
    let moment = |name: &'static str| {
        vec![
            ("grad", A::B("grad")),
            (name, A::B(name)),
            ("scale", A::B("scale")),
            ("grad_norm", A::B("grad_norm")),
            ("max_grad_norm", A::V(Arg::F64(c.max_grad_norm))),
            ("eps1", A::V(Arg::F64(h.eps1))),
            ("step", A::B("step")),
            ("decay_rate", A::V(Arg::F64(h.decay_rate))),
        ]
    };
    if factored {
        let mut a = moment("row");
        a.extend([
            ("n_rows", A::V(i32(lead * rows))),
            ("cols", A::V(i32(cols))),
        ]);
        b.run(
            "adafactor_rows",
            ((lead * rows) as u32, 1, 1),
            (THREADS, 1, 1),
            &a,
        );
        let mut a = moment("col");
        a.extend([
            ("lead", A::V(i32(lead))),
            ("rows", A::V(i32(rows))),
            ("cols", A::V(i32(cols))),
        ]);
        let (grid, block) = grid_1d(lead * cols, 128);
        b.run("adafactor_cols", grid, block, &a);
        b.run(
            "adafactor_row_mean",
            (lead as u32, 1, 1),
            (THREADS, 1, 1),
            &[
                ("row", A::B("row")),
                ("lead", A::V(i32(lead))),
                ("rows", A::V(i32(rows))),
                ("grad_norm", A::B("grad_norm")),
                ("row_mean", A::B("row_mean")),
            ],
        );
    } else {
        let mut a = moment("v");
        a.push(("n", A::V(i64(n))));
        let (grid, block) = grid_1d(n, 128);
        b.run("adafactor_full", grid, block, &a);
    }
    let update = || {
        let (row, col, row_mean, v) = if factored {
            (A::B("row"), A::B("col"), A::B("row_mean"), A::V(Arg::Null))
        } else {
            (A::V(Arg::Null), A::V(Arg::Null), A::V(Arg::Null), A::B("v"))
        };
        vec![
            ("master", A::B("master")),
            ("grad", A::B("grad")),
            ("row", row),
            ("col", col),
            ("row_mean", row_mean),
            ("v", v),
            ("n", A::V(i64(n))),
            ("rows", A::V(i32(rows))),
            ("cols", A::V(i32(cols))),
            ("scale", A::B("scale")),
            ("grad_norm", A::B("grad_norm")),
            ("max_grad_norm", A::V(Arg::F64(c.max_grad_norm))),
        ]
    };
    let mut a = update();
    a.push(("partials", A::B("partials")));
    b.run(
        "adafactor_partials",
        (n_chunks as u32, 1, 1),
        (THREADS, 1, 1),
        &a,
    );
    b.run(
        "adafactor_finalize",
        (1, 1, 1),
        (1, 1, 1),
        &[
            ("partials", A::B("partials")),
            ("n_chunks", A::V(i32(n_chunks))),
            ("n", A::V(i64(n))),
            ("lr", A::B("lr")),
            ("step", A::B("step")),
            ("grad_norm", A::B("grad_norm")),
            ("eps2", A::V(Arg::F64(h.eps2))),
            ("clip_threshold", A::V(Arg::F64(h.clip_threshold))),
            ("relative_step", A::V(i32(usize::from(h.relative_step)))),
            ("scale_parameter", A::V(i32(usize::from(h.scale_parameter)))),
            ("warmup_init", A::V(i32(usize::from(h.warmup_init)))),
            ("factors", A::B("factors")),
        ],
    );
    let mut a = update();
    a.extend([
        (
            "exp_avg",
            if case.beta1.is_some() {
                A::B("exp_avg")
            } else {
                A::V(Arg::Null)
            },
        ),
        (
            "copy",
            if case.copy.is_some() {
                A::B("copy")
            } else {
                A::V(Arg::Null)
            },
        ),
        ("factors", A::B("factors")),
        ("beta1", A::V(Arg::F64(case.beta1.unwrap_or(0.0)))),
        ("weight_decay", A::V(Arg::F64(case.weight_decay))),
    ]);
    let s = FLOATS.iter().find(|f| f.0 == cdt).map_or("f32", |f| f.1);
    let (grid, block) = grid_1d(n, 128);
    b.run(&format!("adafactor_apply_{s}"), grid, block, &a);

    let what = format!(
        "{:?} beta1 {:?} wd {} relative {} clip {} grad_norm {}",
        case.dims,
        case.beta1,
        case.weight_decay,
        case.relative_step,
        case.max_grad_norm,
        case.grad_norm
    );
    check(
        &format!("{what} master"),
        DType::F32,
        &b.f32s("master"),
        &p2,
        0,
    );
    if case.beta1.is_some() {
        check(
            &format!("{what} exp_avg"),
            DType::F32,
            &b.f32s("exp_avg"),
            &m2,
            0,
        );
    }
    if factored {
        check(&format!("{what} row"), DType::F32, &b.f32s("row"), &row2, 0);
        check(&format!("{what} col"), DType::F32, &b.f32s("col"), &col2, 0);
    } else {
        check(&format!("{what} v"), DType::F32, &b.f32s("v"), &v2, 0);
    }
    if let Some(cd) = case.copy {
        let i = b.names.iter().position(|n| *n == "copy").unwrap();
        let copy = dec(cd, &b.data[i]);
        if case.grad_norm.is_finite() {
            let want: Vec<f32> = p2.iter().map(|&x| round_to(cd, x)).collect();
            check(&format!("{what} copy"), cd, &copy, &want, 0);
        } else {
            assert!(
                copy.iter().all(|x| x.is_nan()),
                "{what}: a skipped step wrote the copy"
            );
        }
    }
}

#[test]
fn adafactor_launches_equal_the_twin() {
    let mut rng = Rng::new(31);
    let shapes: [&[usize]; 5] = [&[7, 300], &[2, 3, 5], &[1, 1], &[1000], &[40_000]];
    for dims in shapes {
        for (beta1, weight_decay, relative_step, max_grad_norm, grad_norm, copy) in [
            (None, 0.0, false, 0.0, 0.5f32, None),
            (Some(0.9), 0.1, true, 1.0, 3.0, Some(DType::BF16)),
            (None, 0.0, true, 0.0, 0.5, Some(DType::F16)),
            (Some(0.9), 0.0, false, 0.0, f32::INFINITY, Some(DType::F32)),
        ] {
            let case = Case {
                dims: dims.to_vec(),
                beta1,
                weight_decay,
                relative_step,
                max_grad_norm,
                grad_norm,
                copy,
            };
            run_case(&case, &mut rng);
        }
    }
}
