//! `adamw8bit.cu`: one 8-bit AdamW update in one launch (see the file's header).

use crate::cuda::emulate::contracts::checked;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::{quant, DType};
use super::Kernel;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    update(m, l, k.copy)
}

pub(crate) fn update(m: &Mem, l: &Launch, copy_dt: DType) -> R<Vec<Use>> {
    let threads = quant::QUANT_BLOCK as u32;
    if l.block != (threads, 1, 1) {
        return Err(format!(
            "block {:?}: the kernel takes one thread per value of a quantization block, \
             blockDim = ({threads}, 1, 1)",
            l.block
        ));
    }
    let mut a = Args::new(l);
    let master = a.need(m, "master")?;
    let grad = a.need(m, "grad")?;
    let codes_m = a.need(m, "m")?;
    let max_m = a.need(m, "m_absmax")?;
    let codes_v = a.need(m, "v")?;
    let max_v = a.need(m, "v_absmax")?;
    let maps = a.need(m, "code_maps")?;
    let copy = a.ptr(m, "copy")?;
    let n = a.count("n")? as u64;
    let scalars: Vec<_> = ["lr", "step", "scale", "grad_norm"]
        .iter()
        .map(|s| a.need(m, s).map(|p| (*s, p)))
        .collect::<R<_>>()?;
    for h in ["beta1", "beta2", "eps", "weight_decay", "max_grad_norm"] {
        a.f64(h)?;
    }
    a.end()?;
    let blocks = n.div_ceil(quant::QUANT_BLOCK as u64);
    let cs = copy_dt.size_bytes();
    let mut uses = vec![
        use_("master", Some(master), n * 4, 4, Io::Rw),
        use_("grad", Some(grad), n * 4, 4, Io::R),
        use_("m", Some(codes_m), n, 1, Io::Rw),
        use_("m_absmax", Some(max_m), blocks * 4, 4, Io::Rw),
        use_("v", Some(codes_v), n, 1, Io::Rw),
        use_("v_absmax", Some(max_v), blocks * 4, 4, Io::Rw),
        use_(
            "code_maps",
            Some(maps),
            2 * quant::CODES as u64 * 4,
            4,
            Io::R,
        ),
        use_("copy", copy, n * cs as u64, cs, Io::W),
    ];
    uses.extend(
        scalars
            .into_iter()
            .map(|(s, p)| use_(s, Some(p), 4, 4, Io::R)),
    );
    checked(m, uses, &[])
}
