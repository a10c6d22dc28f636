//! `adafactor.cu`: one Adafactor update in seven launches (see the file's header).

use crate::cuda::emulate::contracts::{checked, one_block};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Ptr, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::{Stage, Kernel};

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::Stage(stage) => match stage {
            Stage::Rows => rows(m, l),
            Stage::Cols => cols(m, l),
            Stage::Full => full(m, l),
            Stage::RowMean => row_mean(m, l),
            Stage::Partials => partials(m, l),
            Stage::Finalize => finalize(m, l),
        },
        Kernel::Apply { copy } => apply(m, l, copy),
    }
}

/// Threads of the reducing launches (`ADAFACTOR_THREADS`).
const THREADS: u32 = 256;
/// Elements per partial (`ADAFACTOR_CHUNK`).
const CHUNK: i64 = 16_384;

/// The reducing launches sum in the order the CPU twin reproduces: exactly 256 threads.
fn reducing_block(l: &Launch) -> R<()> {
    if l.block != (THREADS, 1, 1) {
        return Err(format!(
            "block {:?}: the kernel's sums need blockDim = ({THREADS}, 1, 1)",
            l.block
        ));
    }
    Ok(())
}

/// The scalars every launch reads after its moment: scale, grad_norm, max_grad_norm, eps1,
/// step, decay_rate.
fn moment_scalars(a: &mut Args, m: &Mem) -> R<Vec<Option<Use>>> {
    let scale = a.need(m, "scale")?;
    let grad_norm = a.need(m, "grad_norm")?;
    a.f64("max_grad_norm")?;
    a.f64("eps1")?;
    let step = a.need(m, "step")?;
    a.f64("decay_rate")?;
    Ok(vec![
        use_("scale", Some(scale), 4, 4, Io::R),
        use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
        use_("step", Some(step), 4, 4, Io::R),
    ])
}

fn dim(v: i32, what: &str) -> R<i64> {
    if v <= 0 {
        return Err(format!("`{what}` is {v}: it must be positive"));
    }
    Ok(i64::from(v))
}

pub(crate) fn rows(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    reducing_block(l)?;
    let mut a = Args::new(l);
    let grad = a.need(m, "grad")?;
    let row = a.need(m, "row")?;
    let mut uses = moment_scalars(&mut a, m)?;
    let n_rows = dim(a.i32("n_rows")?, "n_rows")?;
    let cols = dim(a.i32("cols")?, "cols")?;
    a.end()?;
    uses.extend([
        use_("grad", Some(grad), (n_rows * cols * 4) as u64, 4, Io::R),
        use_("row", Some(row), (n_rows * 4) as u64, 4, Io::Rw),
    ]);
    checked(m, uses, &[])
}

pub(crate) fn cols(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let grad = a.need(m, "grad")?;
    let col = a.need(m, "col")?;
    let mut uses = moment_scalars(&mut a, m)?;
    let lead = dim(a.i32("lead")?, "lead")?;
    let rows = dim(a.i32("rows")?, "rows")?;
    let cols = dim(a.i32("cols")?, "cols")?;
    a.end()?;
    uses.extend([
        use_(
            "grad",
            Some(grad),
            (lead * rows * cols * 4) as u64,
            4,
            Io::R,
        ),
        use_("col", Some(col), (lead * cols * 4) as u64, 4, Io::Rw),
    ]);
    checked(m, uses, &[])
}

pub(crate) fn full(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let grad = a.need(m, "grad")?;
    let v = a.need(m, "v")?;
    let mut uses = moment_scalars(&mut a, m)?;
    let n = a.i64("n")?;
    a.end()?;
    if n <= 0 {
        return Err(format!("`n` is {n}"));
    }
    uses.extend([
        use_("grad", Some(grad), n as u64 * 4, 4, Io::R),
        use_("v", Some(v), n as u64 * 4, 4, Io::Rw),
    ]);
    checked(m, uses, &[])
}

pub(crate) fn row_mean(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    reducing_block(l)?;
    let mut a = Args::new(l);
    let row = a.need(m, "row")?;
    let lead = dim(a.i32("lead")?, "lead")?;
    let rows = dim(a.i32("rows")?, "rows")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let out = a.need(m, "row_mean")?;
    a.end()?;
    checked(
        m,
        vec![
            use_("row", Some(row), (lead * rows * 4) as u64, 4, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
            use_("row_mean", Some(out), (lead * 4) as u64, 4, Io::W),
        ],
        &[],
    )
}

/// The operands of the update `u` (partials and apply): factored (row, col, row_mean) or
/// full (v), and the sizes.
struct UpdateOperands {
    uses: Vec<Option<Use>>,
    n: i64,
}

fn update_operands(a: &mut Args, m: &Mem) -> R<UpdateOperands> {
    let row = a.ptr(m, "row")?;
    let col = a.ptr(m, "col")?;
    let row_mean = a.ptr(m, "row_mean")?;
    let v = a.ptr(m, "v")?;
    let n = a.i64("n")?;
    let rows = dim(a.i32("rows")?, "rows")?;
    let cols = dim(a.i32("cols")?, "cols")?;
    let scale = a.need(m, "scale")?;
    let grad_norm = a.need(m, "grad_norm")?;
    a.f64("max_grad_norm")?;
    if n <= 0 {
        return Err(format!("`n` is {n}"));
    }
    let mut uses = vec![
        use_("scale", Some(scale), 4, 4, Io::R),
        use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
    ];
    match (row, col, row_mean, v) {
        (Some(row), Some(col), Some(row_mean), None) => {
            if n % (rows * cols) != 0 {
                return Err(format!("`n` {n} is not whole {rows} x {cols} matrices"));
            }
            let lead = n / (rows * cols);
            uses.extend([
                use_("row", Some(row), (lead * rows * 4) as u64, 4, Io::R),
                use_("col", Some(col), (lead * cols * 4) as u64, 4, Io::R),
                use_("row_mean", Some(row_mean), (lead * 4) as u64, 4, Io::R),
            ]);
        }
        (None, None, None, Some(v)) => uses.push(use_("v", Some(v), n as u64 * 4, 4, Io::R)),
        _ => {
            return Err(
                "the update needs row, col and row_mean (factored) or v (full), not both".into(),
            )
        }
    }
    Ok(UpdateOperands { uses, n })
}

pub(crate) fn partials(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    reducing_block(l)?;
    let mut a = Args::new(l);
    let master = a.need(m, "master")?;
    let grad = a.need(m, "grad")?;
    let ops = update_operands(&mut a, m)?;
    let partials = a.need(m, "partials")?;
    a.end()?;
    let n_chunks = (ops.n + CHUNK - 1) / CHUNK;
    let mut uses = ops.uses;
    uses.extend([
        use_("master", Some(master), ops.n as u64 * 4, 4, Io::R),
        use_("grad", Some(grad), ops.n as u64 * 4, 4, Io::R),
        use_(
            "partials",
            Some(partials),
            2 * n_chunks as u64 * 8,
            8,
            Io::W,
        ),
    ]);
    checked(m, uses, &[])
}

pub(crate) fn finalize(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    one_block(l)?;
    let mut a = Args::new(l);
    let partials = a.need(m, "partials")?;
    let n_chunks = a.count32("n_chunks")?;
    let n = a.i64("n")?;
    let lr = a.need(m, "lr")?;
    let step = a.need(m, "step")?;
    let grad_norm = a.need(m, "grad_norm")?;
    a.f64("eps2")?;
    a.f64("clip_threshold")?;
    for flag in ["relative_step", "scale_parameter", "warmup_init"] {
        a.i32(flag)?;
    }
    let factors = a.need(m, "factors")?;
    a.end()?;
    if n_chunks as i64 != (n + CHUNK - 1) / CHUNK {
        return Err(format!("{n_chunks} partials for {n} elements"));
    }
    checked(
        m,
        vec![
            use_(
                "partials",
                Some(partials),
                2 * n_chunks as u64 * 8,
                8,
                Io::R,
            ),
            use_("lr", Some(lr), 4, 4, Io::R),
            use_("step", Some(step), 4, 4, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
            use_("factors", Some(factors), 8, 4, Io::W),
        ],
        &[],
    )
}

pub(crate) fn apply(m: &Mem, l: &Launch, copy_dt: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let master = a.need(m, "master")?;
    let grad = a.need(m, "grad")?;
    let exp_avg: Option<Ptr> = a.ptr(m, "exp_avg")?;
    let ops = update_operands(&mut a, m)?;
    let copy = a.ptr(m, "copy")?;
    let factors = a.need(m, "factors")?;
    a.f64("beta1")?;
    a.f64("weight_decay")?;
    a.end()?;
    let n = ops.n as u64;
    let cs = copy_dt.size_bytes();
    let mut uses = ops.uses;
    uses.extend([
        use_("master", Some(master), n * 4, 4, Io::Rw),
        use_("grad", Some(grad), n * 4, 4, Io::R),
        use_("exp_avg", exp_avg, n * 4, 4, Io::Rw),
        use_("copy", copy, n * cs as u64, cs, Io::W),
        use_("factors", Some(factors), 8, 4, Io::R),
    ]);
    checked(m, uses, &[])
}
