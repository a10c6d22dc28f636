//! The kernels the fusion pass generates: `entry(const T* in0, .., T* out0, .., i64 n)`, each
//! output `n` elements, each input as many as the module's record of the kernel says (a
//! broadcast operand holds fewer), the element sizes from the kernel's own parameter types. A
//! kernel that takes an amax has `float* partials` before `n`: one float per block.

use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::contracts::checked;
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::{GeneratedKernel, InputExtent, Launch};
use castor_kernels::host::{HostEntry, ParamKind};

pub(crate) fn generated(
    m: &Mem,
    l: &Launch,
    kernel: &GeneratedKernel,
    entry: &HostEntry,
) -> R<Vec<Use>> {
    let params = &entry.params;
    let n_in = kernel.inputs.len();
    if params.len() < n_in + 2
        || params[..params.len() - 1]
            .iter()
            .any(|p| p.kind != ParamKind::Ptr)
        || params[params.len() - 1].kind != ParamKind::I64
    {
        return Err(format!(
            "`{}` is not `(inputs.., outputs.., i64 n)` with {n_in} inputs",
            l.entry
        ));
    }
    let n_partials = usize::from(kernel.partials);
    if params.len() < n_in + n_partials + 2 {
        return Err(format!("`{}` has no partials buffer", l.entry));
    }
    let n_out = params.len() - n_in - n_partials - 1;
    let mut a = Args::new(l);
    let ins = (0..n_in)
        .map(|k| a.need(m, &format!("in{k}")))
        .collect::<R<Vec<_>>>()?;
    let outs = (0..n_out)
        .map(|o| a.need(m, &format!("out{o}")))
        .collect::<R<Vec<_>>>()?;
    let partials = match kernel.partials {
        true => Some(a.need(m, "partials")?),
        false => None,
    };
    let n = a.count("n")? as u64;
    a.end()?;
    let names_in: Vec<String> = (0..n_in).map(|k| format!("in{k}")).collect();
    let names_out: Vec<String> = (0..n_out).map(|o| format!("out{o}")).collect();
    let mut uses = Vec::new();
    for (k, (&p, extent)) in ins.iter().zip(&kernel.inputs).enumerate() {
        let s = params[k].pointee;
        let elems = match extent {
            _ if n == 0 => 0,
            InputExtent::Full => n,
            InputExtent::Elements(e) => *e,
        };
        uses.push(use_(
            names_in[k].clone(),
            Some(p),
            elems * s as u64,
            s,
            Io::R,
        ));
    }
    // An output may be written over a full-size input (each element is read before the same
    // thread writes it).
    let mut in_place = Vec::new();
    for (o, &p) in outs.iter().enumerate() {
        let s = params[n_in + o].pointee;
        uses.push(use_(names_out[o].clone(), Some(p), n * s as u64, s, Io::W));
        for (k, extent) in kernel.inputs.iter().enumerate() {
            if *extent == InputExtent::Full {
                in_place.push((names_out[o].as_str(), names_in[k].as_str()));
            }
        }
    }
    if let Some(p) = partials {
        uses.push(use_(
            "partials".to_string(),
            Some(p),
            u64::from(l.grid.0) * 4,
            4,
            Io::W,
        ));
    }
    checked(m, uses, &in_place)
}
