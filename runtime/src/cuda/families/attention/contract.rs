//! `attention.cu`: the fused attention forward, its `delta` row sums, and its backward (one
//! tensor-core kernel, or the F32 dq and dk/dv kernels). Launch shapes, dynamic shared memory
//! and scratch are `geometry.rs`'s.

use crate::cuda::emulate::contracts::{checked, Strides};
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Ptr, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::geometry::{self, Kernel};

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: super::Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        super::Kernel::Attention {
            kernel,
            dtype,
            tile,
            packed,
            dropout,
        } => {
            let v = Variant {
                dtype,
                tile,
                packed,
                dropout,
            };
            match kernel {
                geometry::Kernel::Forward => forward(m, l, v),
                geometry::Kernel::Backward => backward(m, l, v),
                geometry::Kernel::Dq => dq(m, l, v),
                geometry::Kernel::DkDv => dkdv(m, l, v),
            }
        }
        super::Kernel::Delta { dtype } => delta(m, l, dtype),
        super::Kernel::KeyLengths => key_lengths(m, l),
    }
}

/// The operands' dtype, the head-dim tile (`None`: the F32 warp-per-row kernels), whether a
/// tensor-core entry point reads packed sequences' positions (the others compile them out),
/// and whether the entry point drops probabilities (its dropout arguments come last).
#[derive(Clone, Copy)]
pub(crate) struct Variant {
    pub(crate) dtype: DType,
    pub(crate) tile: Option<u32>,
    pub(crate) packed: bool,
    pub(crate) dropout: bool,
}

/// The `_dropout` entry points' last arguments, as `dropout.cu`'s: the 16-byte key (read),
/// the stream, the keep threshold (at most 2^32) and the F32 `1 / (1 - p)` as a double.
fn dropout_use(a: &mut Args, m: &Mem, v: Variant) -> R<Option<Use>> {
    if !v.dropout {
        return Ok(None);
    }
    let key = a.need(m, "dropout_key")?;
    a.u32("stream")?;
    let threshold = a.u64("threshold")?;
    let scale = a.f64("keep_scale")?;
    if threshold > 1 << 32 {
        return Err(format!("threshold {threshold} is above 2^32"));
    }
    if !(scale >= 1.0 && scale as f32 as f64 == scale) {
        return Err(format!("keep_scale {scale} is not an F32 of at least 1"));
    }
    Ok(use_("dropout_key", Some(key), 16, 8, Io::R))
}

/// The shape arguments every attention kernel takes after its pointers.
struct Shape {
    /// Query batches (or, for dk/dv, key batches times `group`).
    bq: usize,
    t: usize,
    s: usize,
    d: usize,
    group: usize,
    mask_group: usize,
    causal: bool,
    /// Causal or windowed (the backward's segments, `geometry::bwd_segments`).
    banded: bool,
}

impl Shape {
    fn read(a: &mut Args, kernel: Kernel) -> R<Shape> {
        let per_key_batch = matches!(kernel, Kernel::Backward | Kernel::DkDv);
        let batches = a.count(if per_key_batch { "bkv" } else { "bq" })?;
        let t = a.count32("t")?;
        let s = a.count32("s")?;
        let d = a.count32("d")?;
        let group = a.count32("group")?;
        let mask_group = a.count32("mask_group")?;
        let causal = a.i32("causal")? != 0;
        let window = a.i32("window")?;
        if window < 0 {
            return Err("a negative sliding window".into());
        }
        let scale = a.f64("scale")?;
        if group == 0 || mask_group == 0 {
            return Err(format!(
                "group {group} and mask_group {mask_group} must be positive"
            ));
        }
        if !scale.is_finite() {
            return Err(format!("scale {scale} is not finite"));
        }
        let bq = if per_key_batch {
            batches * group
        } else {
            batches
        };
        if bq % group != 0 || bq % mask_group != 0 {
            return Err(format!(
                "{bq} query batches are not whole groups of {group} (kv) and {mask_group} (mask)"
            ));
        }
        if d == 0 {
            return Err("head dim 0".into());
        }
        Ok(Shape {
            bq,
            t,
            s,
            d,
            group,
            mask_group,
            causal,
            banded: geometry::banded(causal, window as usize),
        })
    }

    /// The query heads of one outer batch, as the tensor-core kernels' grid splits them (its
    /// y dim); 1 for the F32 kernels.
    fn heads(&self, l: &Launch, v: Variant) -> usize {
        match v.tile {
            None => 1,
            Some(_) => l.grid.1 as usize,
        }
    }

    fn check_launch(&self, l: &Launch, kernel: Kernel, v: Variant) -> R<()> {
        let tensor_cores = v.tile.is_some();
        match v.tile {
            Some(p) if self.d > p as usize => {
                return Err(format!(
                    "head dim {} is wider than the variant's tile {p}",
                    self.d
                ))
            }
            None if self.d > geometry::F32_MAX_HEAD_DIM => {
                return Err(format!(
                    "head dim {} is wider than the F32 kernels' {}",
                    self.d,
                    geometry::F32_MAX_HEAD_DIM
                ))
            }
            _ => {}
        }
        let heads = self.heads(l, v);
        let splits = heads > 0 && self.bq.is_multiple_of(heads) && heads.is_multiple_of(self.group);
        if tensor_cores && !splits {
            return Err(format!(
                "grid {:?}: {heads} heads a batch do not split {} query batches in groups of {}",
                l.grid, self.bq, self.group
            ));
        }
        let grid = geometry::grid(
            kernel,
            v.tile,
            self.bq as u32,
            (heads as u32, self.group as u32),
            (self.t as u32, self.s as u32),
            self.banded,
        );
        let shared = v.tile.map_or(0, |p| {
            geometry::shared_bytes(kernel, p, v.dtype.size_bytes() as u32)
        });
        expect_shape(l, grid, geometry::threads(kernel, tensor_cores), shared)
    }

    fn q_bytes(&self, elem: usize) -> u64 {
        (self.bq * self.t * self.d * elem) as u64
    }

    fn kv_bytes(&self, elem: usize) -> u64 {
        (self.bq / self.group * self.s * self.d * elem) as u64
    }

    /// (batches, heads, rows, d) of the query-side operands.
    fn q_dims(&self, heads: usize) -> R<(usize, usize, usize, usize)> {
        if heads == 0 || !heads.is_multiple_of(self.group) {
            return Err(format!(
                "heads {heads} is not a whole number of kv groups of {}",
                self.group
            ));
        }
        Ok((self.bq, heads, self.t, self.d))
    }

    /// (batches, heads, rows, d) of the key-side operands.
    fn kv_dims(&self, heads: usize) -> R<(usize, usize, usize, usize)> {
        self.q_dims(heads)?;
        Ok((self.bq / self.group, heads / self.group, self.s, self.d))
    }

    /// The uses of q, k, v (through `st`), the mask and the positions.
    fn strided_operands(
        &self,
        p: [Option<Ptr>; 5],
        heads: usize,
        st: &[Strides],
        elem: usize,
    ) -> R<Vec<Option<Use>>> {
        let (qd, kd) = (self.q_dims(heads)?, self.kv_dims(heads)?);
        let need = |x: Option<Ptr>| x.ok_or_else(|| "a null operand".to_string());
        Ok(vec![
            st[0].use_of("q", need(p[0])?, qd, elem, Io::R)?,
            st[1].use_of("k", need(p[1])?, kd, elem, Io::R)?,
            st[2].use_of("v", need(p[2])?, kd, elem, Io::R)?,
            self.mask_use(p[3]),
            self.positions_use(p[4])?,
        ])
    }

    /// One mask row of s bytes per `mask_group` query batches.
    fn mask_use(&self, mask: Option<Ptr>) -> Option<Use> {
        use_("mask", mask, (self.bq / self.mask_group * self.s) as u64, 1, Io::R)
    }

    /// One row of s i64 positions per `mask_group` query batches, with the causal mask.
    fn positions_use(&self, positions: Option<Ptr>) -> R<Option<Use>> {
        if positions.is_some() && !self.causal {
            return Err("positions without the causal mask".into());
        }
        let bytes = (8 * (self.bq / self.mask_group) * self.s) as u64;
        Ok(use_("positions", positions, bytes, 8, Io::R))
    }

    fn rows(&self) -> u64 {
        (self.bq * self.t) as u64
    }
}

/// The strides of each named operand, in order.
fn read_strides(a: &mut Args, names: &[&str]) -> R<Vec<Strides>> {
    names.iter().map(|x| Strides::read(a, x)).collect()
}

/// The launch must be `(grid, (threads, 1, 1))` with exactly `shared` bytes of dynamic shared
/// memory.
fn expect_shape(l: &Launch, grid: (u32, u32, u32), threads: u32, shared: u32) -> R<()> {
    let block = (threads, 1, 1);
    if l.grid != grid || l.block != block || l.shared_bytes != shared {
        return Err(format!(
            "launch grid {:?} block {:?} with {} bytes of dynamic shared memory; the kernel \
             needs grid {grid:?} block {block:?} and {shared} bytes",
            l.grid, l.block, l.shared_bytes
        ));
    }
    Ok(())
}

/// The pointers the three main kernels read first: q, k, v, and the nullable mask and
/// positions (one or the other; a tensor-core kernel takes positions exactly when it is a
/// `_packed` entry point, since the others ignore them).
fn operands(a: &mut Args, m: &Mem, v: Variant) -> R<[Option<Ptr>; 5]> {
    let p = [
        Some(a.need(m, "q")?),
        Some(a.need(m, "k")?),
        Some(a.need(m, "v")?),
        a.ptr(m, "mask")?,
        a.ptr(m, "positions")?,
    ];
    if p[3].is_some() && p[4].is_some() {
        return Err("a bool mask and positions together (the kernels take one or the other)".into());
    }
    if v.tile.is_some() && v.packed != p[4].is_some() {
        return Err(if v.packed {
            "a `_packed` entry point without positions".into()
        } else {
            "positions passed to an entry point that ignores them (the `_packed` ones read them)"
                .into()
        });
    }
    Ok(p)
}

fn operand_uses(sh: &Shape, p: [Option<Ptr>; 5], elem: usize) -> R<Vec<Option<Use>>> {
    Ok(vec![
        use_("q", p[0], sh.q_bytes(elem), elem, Io::R),
        use_("k", p[1], sh.kv_bytes(elem), elem, Io::R),
        use_("v", p[2], sh.kv_bytes(elem), elem, Io::R),
        sh.mask_use(p[3]),
        sh.positions_use(p[4])?,
    ])
}

pub(crate) fn forward(m: &Mem, l: &Launch, v: Variant) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let ops = operands(&mut a, m, v)?;
    let o = a.need(m, "o")?;
    let lse = a.need(m, "lse")?;
    let sh = Shape::read(&mut a, Kernel::Forward)?;
    let elem = v.dtype.size_bytes();
    let mut uses = if v.tile.is_some() {
        let st = read_strides(&mut a, &["q", "k", "v", "o"])?;
        let key = dropout_use(&mut a, m, v)?;
        a.end()?;
        let heads = sh.heads(l, v);
        let mut uses = sh.strided_operands(ops, heads, &st[..3], elem)?;
        uses.push(st[3].use_of("o", o, sh.q_dims(heads)?, elem, Io::W)?);
        uses.push(key);
        uses
    } else {
        let key = dropout_use(&mut a, m, v)?;
        a.end()?;
        let mut uses = operand_uses(&sh, ops, elem)?;
        uses.push(use_("o", Some(o), sh.q_bytes(elem), elem, Io::W));
        uses.push(key);
        uses
    };
    sh.check_launch(l, Kernel::Forward, v)?;
    uses.push(use_("lse", Some(lse), 4 * sh.rows(), 4, Io::W));
    checked(m, uses, &[])
}

pub(crate) fn dq(m: &Mem, l: &Launch, v: Variant) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let ops = operands(&mut a, m, v)?;
    let d_o = a.need(m, "d_o")?;
    let lse = a.need(m, "lse")?;
    let delta = a.need(m, "delta")?;
    let dq = a.need(m, "dq")?;
    let sh = Shape::read(&mut a, Kernel::Dq)?;
    let key = dropout_use(&mut a, m, v)?;
    a.end()?;
    sh.check_launch(l, Kernel::Dq, v)?;
    let elem = v.dtype.size_bytes();
    let mut uses = operand_uses(&sh, ops, elem)?;
    uses.push(use_("do", Some(d_o), sh.q_bytes(elem), elem, Io::R));
    uses.push(use_("lse", Some(lse), 4 * sh.rows(), 4, Io::R));
    uses.push(use_("delta", Some(delta), 4 * sh.rows(), 4, Io::R));
    uses.push(use_("dq", Some(dq), sh.q_bytes(elem), elem, Io::W));
    uses.push(key);
    checked(m, uses, &[])
}

pub(crate) fn dkdv(m: &Mem, l: &Launch, v: Variant) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let ops = operands(&mut a, m, v)?;
    let d_o = a.need(m, "d_o")?;
    let lse = a.need(m, "lse")?;
    let delta = a.need(m, "delta")?;
    let dk = a.need(m, "dk")?;
    let dv = a.need(m, "dv")?;
    let sh = Shape::read(&mut a, Kernel::DkDv)?;
    let key = dropout_use(&mut a, m, v)?;
    a.end()?;
    sh.check_launch(l, Kernel::DkDv, v)?;
    let elem = v.dtype.size_bytes();
    let mut uses = operand_uses(&sh, ops, elem)?;
    uses.push(use_("do", Some(d_o), sh.q_bytes(elem), elem, Io::R));
    uses.push(use_("lse", Some(lse), 4 * sh.rows(), 4, Io::R));
    uses.push(use_("delta", Some(delta), 4 * sh.rows(), 4, Io::R));
    uses.push(use_("dk", Some(dk), sh.kv_bytes(elem), elem, Io::W));
    uses.push(use_("dv", Some(dv), sh.kv_bytes(elem), elem, Io::W));
    uses.push(key);
    checked(m, uses, &[])
}

/// The tensor-core backward: dq, dk and dv in one pass, dq summed in `dq_acc` (F32 rows of the
/// tile's width, scratch the kernel writes before it reads) in the order the `dq_ready`
/// counters (zeroed before the launch) keep; with several links per key block, their dk and
/// dv sums follow in both (`geometry::backward_scratch`).
pub(crate) fn backward(m: &Mem, l: &Launch, v: Variant) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let ops = operands(&mut a, m, v)?;
    let d_o = a.need(m, "d_o")?;
    let lse = a.need(m, "lse")?;
    let delta = a.need(m, "delta")?;
    let dq = a.need(m, "dq")?;
    let dk = a.need(m, "dk")?;
    let dv = a.need(m, "dv")?;
    let acc = a.need(m, "dq_acc")?;
    let ready = a.need(m, "dq_ready")?;
    let sh = Shape::read(&mut a, Kernel::Backward)?;
    let st = read_strides(&mut a, &["q", "k", "v", "d_o", "dq", "dk", "dv"])?;
    let key = dropout_use(&mut a, m, v)?;
    a.end()?;
    let Some(p) = v.tile else {
        return Err("the one-pass backward has tensor-core variants only".into());
    };
    sh.check_launch(l, Kernel::Backward, v)?;
    let heads = sh.heads(l, v);
    let elem = v.dtype.size_bytes();
    let scratch = geometry::backward_scratch(
        p,
        (sh.bq as u64, sh.group as u64),
        (sh.t as u64, sh.s as u64),
        sh.banded,
    );
    let (qd, kd) = (sh.q_dims(heads)?, sh.kv_dims(heads)?);
    let mut uses = sh.strided_operands(ops, heads, &st[..3], elem)?;
    uses.push(st[3].use_of("do", d_o, qd, elem, Io::R)?);
    uses.push(use_("lse", Some(lse), 4 * sh.rows(), 4, Io::R));
    uses.push(use_("delta", Some(delta), 4 * sh.rows(), 4, Io::R));
    uses.push(st[4].use_of("dq", dq, qd, elem, Io::W)?);
    uses.push(st[5].use_of("dk", dk, kd, elem, Io::W)?);
    uses.push(st[6].use_of("dv", dv, kd, elem, Io::W)?);
    uses.push(use_(
        "dq_acc",
        Some(acc),
        4 * scratch.acc_elems,
        4,
        Io::W,
    ));
    uses.push(use_(
        "dq_ready",
        Some(ready),
        4 * scratch.ready_count,
        4,
        Io::Rw,
    ));
    uses.push(key);
    checked(m, uses, &[])
}

pub(crate) fn delta(m: &Mem, l: &Launch, dtype: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let o = a.need(m, "o")?;
    let d_o = a.need(m, "d_o")?;
    let delta = a.need(m, "delta")?;
    let rows = a.count("rows")?;
    let t = a.count32("t")?;
    let d = a.count32("d")?;
    let heads = a.count32("heads")?;
    let st = read_strides(&mut a, &["o", "d_o"])?;
    a.end()?;
    expect_shape(l, geometry::delta_grid(rows as u64, d as u32), geometry::THREADS, 0)?;
    if t == 0 || rows % t != 0 {
        return Err(format!("{rows} rows are not whole batches of t = {t}"));
    }
    let elem = dtype.size_bytes();
    let dims = (rows / t, heads, t, d);
    checked(
        m,
        vec![
            st[0].use_of("o", o, dims, elem, Io::R)?,
            st[1].use_of("do", d_o, dims, elem, Io::R)?,
            use_("delta", Some(delta), 4 * rows as u64, 4, Io::W),
        ],
        &[],
    )
}

/// `attention_key_lengths`: one block of 256 per mask row, reading the row's flags and
/// writing its two lengths; before a padded backward, also zeroing some of the rows of dK and
/// dV (16-bit, `[rows, heads, keys, dim]` through their strides).
pub(crate) fn key_lengths(m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let flags = a.need(m, "flags")?;
    let rows = a.count32("rows")?;
    let keys = a.count32("keys")?;
    a.count32("rows_q")?;
    let lengths = a.need(m, "lengths")?;
    let kv_offset = a.count32("kv_offset")?;
    let bad = a.ptr(m, "bad")?;
    let (dk, dv) = (a.ptr(m, "dk")?, a.ptr(m, "dv")?);
    let heads = a.count32("heads")?;
    let dim = a.count32("dim")?;
    let st = read_strides(&mut a, &["dk", "dv"])?;
    a.end()?;
    expect_shape(l, (rows as u32, 1, 1), 256, 0)?;
    if kv_offset < rows {
        return Err(format!(
            "the key lengths at {kv_offset} overlap the {rows} query lengths"
        ));
    }
    let mut uses = vec![
        use_("flags", Some(flags), (rows * keys) as u64, 1, Io::R),
        use_("lengths", Some(lengths), 4 * (kv_offset + rows) as u64, 4, Io::W),
        use_("bad", bad, 4, 4, Io::Rw),
    ];
    match (dk, dv) {
        (None, None) => {}
        (Some(dk), Some(dv)) => {
            let dims = (rows * heads, heads, keys, dim);
            uses.push(st[0].use_of("dk", dk, dims, 2, Io::W)?);
            uses.push(st[1].use_of("dv", dv, dims, 2, Io::W)?);
        }
        _ => return Err("dk and dv must both be given or both be null".into()),
    }
    checked(m, uses, &[])
}
