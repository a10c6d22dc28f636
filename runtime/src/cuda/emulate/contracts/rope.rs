//! `rope.cu`: rotary embeddings forward and backward, and the (cos, sin) table.

use crate::cpu::rope;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{check_uses, use_, Io, Mem};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;

pub(super) fn rope_launch(m: &mut Mem, l: &Launch, dt: DType, backward: bool) -> R<()> {
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let cs = a.need(m, "cs")?;
    let rows = a.count("rows")?;
    let t = a.count32("t")?;
    let d = a.count32("d")?;
    a.end()?;
    if t == 0 || d % 2 != 0 {
        return Err(format!("t = {t}, d = {d} (d must be even)"));
    }
    let half = d / 2;
    let s = dt.size_bytes();
    check_uses(
        m,
        &[
            use_("x", Some(x), (rows * d * s) as u64, s, Io::R),
            use_("y", Some(y), (rows * d * s) as u64, s, Io::W),
            use_("cs", Some(cs), (t * half * 8) as u64, 8, Io::R),
        ],
        &[("y", "x")],
    )?;
    for r in 0..rows {
        let at = (r * d) as i64;
        let xs = m.fv(x, at, d, dt)?;
        let mut out = vec![0f32; d];
        for i in 0..half {
            let k = ((r % t) * half + i) as i64;
            let (c, sn) = (m.f32_at(cs, 2 * k)?, m.f32_at(cs, 2 * k + 1)?);
            let (x1, x2) = (xs[i], xs[i + half]);
            if backward {
                out[i] = x1 * c + x2 * sn;
                out[i + half] = x2 * c - x1 * sn;
            } else {
                out[i] = x1 * c - x2 * sn;
                out[i + half] = x2 * c + x1 * sn;
            }
        }
        m.set_fv(y, at, dt, &out)?;
    }
    Ok(())
}

/// `rope_table`: the CPU twin's (cos, sin) values (the header allows uploading those instead;
/// CUDA's `powf`/`sincosf` may differ from them by a few ulp).
pub(super) fn rope_table(m: &mut Mem, l: &Launch) -> R<()> {
    let mut a = Args::new(l);
    let cs = a.need(m, "cs")?;
    let t = a.count32("t")?;
    let d = a.count32("d")?;
    let theta = a.f64("theta")?;
    a.end()?;
    for (k, (c, s)) in rope::rope_table(t, d, theta).into_iter().enumerate() {
        m.set_f32(cs, 2 * k as i64, c)?;
        m.set_f32(cs, 2 * k as i64 + 1, s)?;
    }
    Ok(())
}
