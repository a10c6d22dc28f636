//! A cuDNN attention command on the host: its fallback (castor's kernels, which a machine
//! without cuDNN runs) when it has one, else the attention op's CPU twin
//! (`cpu::attention`) on the command's tensors, read and written through their strides. So an
//! emulated `--attention cudnn` program is checked against the twin, not against cuDNN's own
//! code, which runs only on a GPU.

use super::memory::{check_uses, use_, Io, Mem, Ptr};
use super::R;
use crate::cpu::attention::{attention, attention_grad, Operand, Problem};
use crate::cuda::sdpa::{Sdpa, SdpaPass, Tensor4};
use castor_ir::{round_to, DType};

/// The dims of a tensor of `heads` heads, `rows` rows of `dim` elements.
type Dims = (usize, usize, usize);

/// Bytes from the tensor's first element to one past its last.
fn extent(t: &Tensor4, (h, r, d): Dims, elem: usize) -> u64 {
    let last = (h as i64 - 1) * t.strides[1]
        + (r as i64 - 1) * t.strides[2]
        + (d as i64 - 1) * t.strides[3];
    (last as u64 + 1) * elem as u64
}

/// The elements of `t`, in `[heads, rows, dim]` order.
fn gather(m: &Mem, p: Ptr, t: &Tensor4, (h, r, d): Dims, dtype: DType) -> R<Vec<f32>> {
    let mut out = Vec::with_capacity(h * r * d);
    for i in 0..h as i64 {
        for j in 0..r as i64 {
            for k in 0..d as i64 {
                out.push(m.f(
                    p,
                    i * t.strides[1] + j * t.strides[2] + k * t.strides[3],
                    dtype,
                )?);
            }
        }
    }
    Ok(out)
}

/// Writes `x` (`[heads, rows, dim]` order) into `t`, rounded to `dtype`.
fn scatter(m: &mut Mem, p: Ptr, t: &Tensor4, (h, r, d): Dims, dtype: DType, x: &[f32]) -> R<()> {
    let mut at = 0;
    for i in 0..h as i64 {
        for j in 0..r as i64 {
            for k in 0..d as i64 {
                let off = i * t.strides[1] + j * t.strides[2] + k * t.strides[3];
                m.set_f(p, off, dtype, round_to(dtype, x[at]))?;
                at += 1;
            }
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
    let (hq, hk) = (p.batch * p.heads_q, p.batch * p.heads_kv);
    let (qd, kd) = ((hq, p.rows_q, p.head_dim), (hk, p.rows_kv, p.head_dim));
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
        use_("q", Some(q), extent(&c.q, qd, elem), elem, Io::R),
        use_("k", Some(k), extent(&c.k, kd, elem), elem, Io::R),
        use_("v", Some(v), extent(&c.v, kd, elem), elem, Io::R),
    ];
    let forward = c.pass == SdpaPass::Forward;
    uses.push(use_(
        "o",
        Some(o),
        extent(&c.o, qd, elem),
        elem,
        if forward { Io::W } else { Io::R },
    ));
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
    let keep: Option<Vec<bool>> = match c.mask {
        Some(place) => {
            let mp = m.place(place);
            let n = (p.batch * p.rows_kv) as u64;
            check_uses(m, &[use_("mask", Some(mp), 4 * n, 4, Io::R)], &[])?;
            Some(
                (0..n as i64)
                    .map(|i| m.f(mp, i, DType::F32).map(|x| x > 0.5))
                    .collect::<R<_>>()?,
            )
        }
        None => None,
    };
    let problem = Problem {
        q: &q_shape,
        k: &kv_shape,
        v: &kv_shape,
        mask: keep.as_deref().map(|k| (k, &mask_shape[..])),
        causal: p.causal,
        window: p.window,
        scale: p.scale(),
        operand: Operand::Dtype(p.dtype),
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
                use_("do", Some(d_o), extent(&g.d_o, qd, elem), elem, Io::R),
                use_("dq", Some(dq), extent(&g.dq, qd, elem), elem, Io::W),
                use_("dk", Some(dk), extent(&g.dk, kd, elem), elem, Io::W),
                use_("dv", Some(dv), extent(&g.dv, kd, elem), elem, Io::W),
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
            scatter(m, dk, &g.dk, kd, p.dtype, &gk)?;
            scatter(m, dv, &g.dv, kd, p.dtype, &gv)?;
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
