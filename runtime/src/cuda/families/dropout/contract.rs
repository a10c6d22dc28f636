//! `dropout.cu`: reads `x` and the 16-byte key, writes `y` (in place allowed).

use super::Kernel;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::contracts::checked;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    let Kernel::Dropout { dtype } = k;
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let key = a.need(m, "key")?;
    let n = a.count("n")?;
    a.u32("stream")?;
    let threshold = a.u64("threshold")?;
    let scale = a.f64("scale")?;
    a.end()?;
    if threshold > 1 << 32 {
        return Err(format!("threshold {threshold} is above 2^32"));
    }
    if !(scale >= 1.0 && scale as f32 as f64 == scale) {
        return Err(format!("scale {scale} is not an F32 of at least 1"));
    }
    let s = dtype.size_bytes();
    let b = (n * s) as u64;
    checked(
        m,
        vec![
            use_("x", Some(x), b, s, Io::R),
            use_("key", Some(key), 16, 8, Io::R),
            use_("y", Some(y), b, s, Io::W),
        ],
        &[("y", "x")],
    )
}
