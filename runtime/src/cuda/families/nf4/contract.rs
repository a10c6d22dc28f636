//! `nf4.cu`: an NF4 weight's codes and block maxima in, the dequantized weight out.

use crate::cuda::emulate::contracts::checked;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::DType;
use super::Kernel;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    dequantize(m, l, k.dtype)
}

pub(crate) fn dequantize(m: &Mem, l: &Launch, t: DType) -> R<Vec<Use>> {
    let mut a = Args::new(l);
    let codes = a.need(m, "codes")?;
    let absmax = a.need(m, "absmax")?;
    let n = a.count("n")?;
    let block = a.count("block")?;
    let out = a.need(m, "out")?;
    a.end()?;
    if block == 0 {
        return Err("block must be at least 1".into());
    }
    checked(
        m,
        vec![
            use_("codes", Some(codes), n.div_ceil(2) as u64, 1, Io::R),
            use_(
                "absmax",
                Some(absmax),
                4 * n.div_ceil(block) as u64,
                4,
                Io::R,
            ),
            use_(
                "out",
                Some(out),
                (n * t.size_bytes()) as u64,
                t.size_bytes(),
                Io::W,
            ),
        ],
        &[],
    )
}
