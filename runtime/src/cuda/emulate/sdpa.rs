//! A cuDNN attention command on the host: its fallback (castor's kernels, which a machine
//! without cuDNN runs) when it has one, else its prelude (the kernels cuDNN's graph needs
//! first) and then the attention op's CPU twin (`cpu::attention`) on the command's tensors,
//! read and written through their strides, with the padding mask the graph's sequence
//! lengths express. So an emulated `--attention cudnn` program is checked against the twin,
//! not against cuDNN's own code, which runs only on a GPU. Like cuDNN's padded backward, the
//! twin writes no dK or dV row for a padded key, so the lowering's zeroing of them is checked.

use super::memory::{check_uses, ranges_use, use_, Io, Mem, Ptr, Use};
use super::R;
use crate::cpu::attention::{attention, attention_grad, Operand, Problem};
use crate::cpu::mask::KeyMask;
use crate::cuda::sdpa::{kv_lengths_offset, Sdpa, SdpaPass, SdpaProblem, Tensor4};
use castor_ir::{round_to, DType};

/// The dims of a tensor: `batch` batches of `heads` heads, `rows` rows of `dim` elements.
type Dims = (usize, usize, usize, usize);

/// The element offset of every element of `t`, in `[batch, heads, rows, dim]` order.
fn offsets(t: &Tensor4, (b, h, r, d): Dims) -> impl Iterator<Item = i64> + '_ {
    let s = t.strides;
    (0..b as i64).flat_map(move |i| {
        (0..h as i64).flat_map(move |j| {
            (0..r as i64).flat_map(move |k| {
                (0..d as i64).map(move |l| i * s[0] + j * s[1] + k * s[2] + l * s[3])
            })
        })
    })
}

/// The use of `t`: the bytes of its elements, one range each (heads of one tensor may
/// interleave with another's, as a fused QKV product's and its gradient's do).
fn use_of(what: &str, p: Ptr, t: &Tensor4, dims: Dims, elem: usize, io: Io) -> R<Option<Use>> {
    let ranges = offsets(t, dims)
        .map(|o| {
            u64::try_from(o)
                .map(|o| (o * elem as u64, elem as u64))
                .map_err(|_| format!("`{what}`: a negative offset"))
        })
        .collect::<R<Vec<_>>>()?;
    Ok(ranges_use(what, p, ranges, elem, io))
}

/// The keys the graph's padding mask keeps, `[batch, rows_kv]`, from the sequence lengths at
/// `place` (key `j` of batch `b` while `j` is below the batch's key length). The twin takes
/// every query row, which is what the lowering's lengths say (the prelude writes `rows_q`).
fn kept_keys(m: &Mem, place: crate::cuda::program::Place, p: &SdpaProblem) -> R<Vec<bool>> {
    let lp = m.place(place);
    let kv = kv_lengths_offset(p.batch) / 4;
    let bytes = 4 * (kv + p.batch as u64);
    check_uses(m, &[use_("seq lens", Some(lp), bytes, 4, Io::R)], &[])?;
    let mut keep = Vec::with_capacity(p.batch * p.rows_kv);
    for b in 0..p.batch as i64 {
        let rows = m.i32_at(lp, b)?;
        if usize::try_from(rows).ok() != Some(p.rows_q) {
            return Err(format!(
                "batch {b}'s query length is {rows}, not the {} rows the twin takes",
                p.rows_q
            ));
        }
        let keys = m.i32_at(lp, kv as i64 + b)?;
        keep.extend((0..p.rows_kv as i64).map(|j| j < i64::from(keys)));
    }
    Ok(keep)
}

/// The elements of `t`, in `[batch, heads, rows, dim]` order.
fn gather(m: &Mem, p: Ptr, t: &Tensor4, dims: Dims, dtype: DType) -> R<Vec<f32>> {
    offsets(t, dims).map(|o| m.f(p, o, dtype)).collect()
}

/// Writes `x` (`[batch, heads, rows, dim]` order) into `t`, rounded to `dtype`.
fn scatter(m: &mut Mem, p: Ptr, t: &Tensor4, dims: Dims, dtype: DType, x: &[f32]) -> R<()> {
    for (o, &v) in offsets(t, dims).zip(x) {
        m.set_f(p, o, dtype, round_to(dtype, v))?;
    }
    Ok(())
}

/// Writes the key rows of `x` (`[batch, heads, rows, dim]` order) into `t` as cuDNN's padded
/// backward does: only the rows of the keys a batch keeps (`keep`, `[batch, rows]`), leaving
/// the padded keys' rows as they were (the lowering zeroes them first).
fn scatter_kept_keys(
    m: &mut Mem,
    p: Ptr,
    t: &Tensor4,
    dims: Dims,
    dtype: DType,
    x: &[f32],
    keep: &[bool],
) -> R<()> {
    let (_, heads, rows, dim) = dims;
    for (i, (o, &v)) in offsets(t, dims).zip(x).enumerate() {
        let (b, row) = (i / (heads * rows * dim), (i / dim) % rows);
        if keep[b * rows + row] {
            m.set_f(p, o, dtype, round_to(dtype, v))?;
        }
    }
    Ok(())
}

pub(super) fn twin(m: &mut Mem, c: &Sdpa) -> R<()> {
    let p = &c.problem;
    if p.heads_kv == 0 || !p.heads_q.is_multiple_of(p.heads_kv) {
        return Err(format!(
            "{} query heads are not groups of {} key heads",
            p.heads_q, p.heads_kv
        ));
    }
    let group = p.heads_q / p.heads_kv;
    let hq = p.batch * p.heads_q;
    let qd = (p.batch, p.heads_q, p.rows_q, p.head_dim);
    let kd = (p.batch, p.heads_kv, p.rows_kv, p.head_dim);
    let elem = p.dtype.size_bytes();
    let ptr = |m: &Mem, t: &Tensor4| m.place(t.place);
    let (q, k, v, o, lse) = (
        ptr(m, &c.q),
        ptr(m, &c.k),
        ptr(m, &c.v),
        ptr(m, &c.o),
        m.place(c.lse),
    );
    let rows_bytes = 4 * (hq * p.rows_q) as u64;
    let mut uses = vec![
        use_of("q", q, &c.q, qd, elem, Io::R)?,
        use_of("k", k, &c.k, kd, elem, Io::R)?,
        use_of("v", v, &c.v, kd, elem, Io::R)?,
    ];
    let forward = c.pass == SdpaPass::Forward;
    let o_io = if forward { Io::W } else { Io::R };
    uses.push(use_of("o", o, &c.o, qd, elem, o_io)?);
    uses.push(use_(
        "lse",
        Some(lse),
        rows_bytes,
        4,
        if forward { Io::W } else { Io::R },
    ));
    // q as [batch, kv heads, group, rows, dim], k and v as [batch, kv heads, 1, rows, dim] and
    // the mask as [batch, 1, 1, 1, keys]: the twin's broadcasting of grouped heads and masks.
    let q_shape = [p.batch, p.heads_kv, group, p.rows_q, p.head_dim];
    let kv_shape = [p.batch, p.heads_kv, 1, p.rows_kv, p.head_dim];
    let mask_shape = [p.batch, 1, 1, 1, p.rows_kv];
    let keep: Option<Vec<bool>> = match c.lengths {
        Some(place) => Some(kept_keys(m, place, p)?),
        None => None,
    };
    let problem = Problem {
        q: &q_shape,
        k: &kv_shape,
        v: &kv_shape,
        mask: keep.as_deref().map(|k| KeyMask::Keep(k, &mask_shape[..])),
        causal: p.causal,
        window: p.window,
        scale: p.scale(),
        operand: Operand::Dtype(p.dtype),
        dropout: None,
    };
    match &c.grads {
        None => {
            check_uses(m, &uses, &[])?;
            let (qv, kv, vv) = (
                gather(m, q, &c.q, qd, p.dtype)?,
                gather(m, k, &c.k, kd, p.dtype)?,
                gather(m, v, &c.v, kd, p.dtype)?,
            );
            let (out, l) = attention(&qv, &kv, &vv, &problem);
            scatter(m, o, &c.o, qd, p.dtype, &out)?;
            for (i, x) in l.iter().enumerate() {
                m.set_f(lse, i as i64, DType::F32, *x)?;
            }
            Ok(())
        }
        Some(g) => {
            let (d_o, dq, dk, dv, sums) = (
                ptr(m, &g.d_o),
                ptr(m, &g.dq),
                ptr(m, &g.dk),
                ptr(m, &g.dv),
                m.place(g.row_sums),
            );
            uses.extend([
                use_of("do", d_o, &g.d_o, qd, elem, Io::R)?,
                use_of("dq", dq, &g.dq, qd, elem, Io::W)?,
                use_of("dk", dk, &g.dk, kd, elem, Io::W)?,
                use_of("dv", dv, &g.dv, kd, elem, Io::W)?,
                use_("row sums", Some(sums), rows_bytes, 4, Io::W),
            ]);
            check_uses(m, &uses, &[])?;
            let (qv, kv, vv, ov, dov) = (
                gather(m, q, &c.q, qd, p.dtype)?,
                gather(m, k, &c.k, kd, p.dtype)?,
                gather(m, v, &c.v, kd, p.dtype)?,
                gather(m, o, &c.o, qd, p.dtype)?,
                gather(m, d_o, &g.d_o, qd, p.dtype)?,
            );
            let lv: Vec<f32> = (0..hq * p.rows_q)
                .map(|i| m.f(lse, i as i64, DType::F32))
                .collect::<R<_>>()?;
            let (gq, gk, gv) = attention_grad(&qv, &kv, &vv, &ov, &lv, &dov, &problem);
            scatter(m, dq, &g.dq, qd, p.dtype, &gq)?;
            match &keep {
                Some(keep) => {
                    scatter_kept_keys(m, dk, &g.dk, kd, p.dtype, &gk, keep)?;
                    scatter_kept_keys(m, dv, &g.dv, kd, p.dtype, &gv, keep)?;
                }
                None => {
                    scatter(m, dk, &g.dk, kd, p.dtype, &gk)?;
                    scatter(m, dv, &g.dv, kd, p.dtype, &gv)?;
                }
            }
            // cuDNN's row sums, rowsum(dO · O), as the device leaves them.
            let d = p.head_dim;
            for r in 0..hq * p.rows_q {
                let s: f64 = (0..d)
                    .map(|j| f64::from(dov[r * d + j]) * f64::from(ov[r * d + j]))
                    .sum();
                m.set_f(sums, r as i64, DType::F32, s as f32)?;
            }
            Ok(())
        }
    }
}
