//! `fp8.cu`: the amax and quantize launches read `x` and write one partial maximum per block
//! of the grid (and quantize the FP8 bytes); the finalizers, one block each, read `count`
//! partials and write one F32; the dequantization reads two F32 scales and writes two F32
//! factors; the amax history step reads a history, a scale and an amax and writes the next
//! history and scale (in place allowed).

use super::Kernel;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::contracts::{checked, one_block, row_block};
use crate::cuda::emulate::memory::{use_, Io, Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;

/// What a launch of kernel `k` may read and write.
pub(crate) fn uses(k: Kernel, m: &Mem, l: &Launch) -> R<Vec<Use>> {
    match k {
        Kernel::Amax { dtype } => {
            row_block(l)?;
            let mut a = Args::new(l);
            let x = a.need(m, "x")?;
            let n = a.count("n")?;
            let partials = a.need(m, "partials")?;
            a.end()?;
            let s = dtype.size_bytes();
            checked(
                m,
                vec![
                    use_("x", Some(x), (n * s) as u64, s, Io::R),
                    use_("partials", Some(partials), blocks(l)? * 4, 4, Io::W),
                ],
                &[],
            )
        }
        Kernel::Quantize { dtype, .. } => {
            row_block(l)?;
            let mut a = Args::new(l);
            let x = a.need(m, "x")?;
            let n = a.count("n")?;
            let scale = a.need(m, "scale")?;
            let q = a.need(m, "q")?;
            let partials = a.ptr(m, "partials")?;
            a.end()?;
            let s = dtype.size_bytes();
            checked(
                m,
                vec![
                    use_("x", Some(x), (n * s) as u64, s, Io::R),
                    use_("scale", Some(scale), 4, 4, Io::R),
                    use_("q", Some(q), n as u64, 1, Io::W),
                    use_("partials", partials, blocks(l)? * 4, 4, Io::W),
                ],
                &[],
            )
        }
        Kernel::ScaleFinalize | Kernel::AmaxFinalize => {
            row_block(l)?;
            one_block(l)?;
            let mut a = Args::new(l);
            let partials = a.need(m, "partials")?;
            let count = a.count32("count")?;
            let out = if k == Kernel::ScaleFinalize {
                let largest = a.f64("largest")?;
                let divisor = a.f64("divisor")?;
                if !(largest > 0.0 && divisor >= 1.0) {
                    return Err(format!(
                        "largest {largest} and divisor {divisor}: a format's largest value and \
                         2^margin"
                    ));
                }
                ("scale", a.need(m, "scale")?)
            } else {
                ("amax", a.need(m, "amax")?)
            };
            a.end()?;
            checked(
                m,
                vec![
                    use_("partials", Some(partials), count as u64 * 4, 4, Io::R),
                    use_(out.0, Some(out.1), 4, 4, Io::W),
                ],
                &[],
            )
        }
        Kernel::AmaxHistory => {
            let mut a = Args::new(l);
            let histories = a.need(m, "histories")?;
            let count = a.count32("count")?;
            a.end()?;
            thread_per_row(l, count, "history")?;
            // Rows {history, scale, amax, history_next, scale_next, largest, divisor, length,
            // pad}: 64 bytes.
            let mut uses = vec![use_("histories", Some(histories), count as u64 * 64, 8, Io::R)];
            let mut in_place = Vec::new();
            for r in 0..count as i64 {
                let base = 8 * r;
                let largest = f64::from_bits(m.u64_at(histories, base + 5)?);
                let divisor = f64::from_bits(m.u64_at(histories, base + 6)?);
                if !(largest > 0.0 && divisor >= 1.0) {
                    return Err(format!(
                        "history {r}: largest {largest} and divisor {divisor}: a format's \
                         largest value and 2^margin"
                    ));
                }
                let length = m.i32_at(histories, 2 * (base + 7))?;
                let length =
                    u64::try_from(length).map_err(|_| format!("history {r}: length {length}"))?;
                let fields = [
                    ("history", length * 4, Io::R),
                    ("scale", 4, Io::R),
                    ("amax", 4, Io::R),
                    ("history_next", length * 4, Io::W),
                    ("scale_next", 4, Io::W),
                ];
                for (k, (name, bytes, io)) in fields.into_iter().enumerate() {
                    let ptr = m
                        .decode(m.u64_at(histories, base + k as i64)?)
                        .map_err(|e| format!("history {r} `{name}`: {e}"))?
                        .ok_or_else(|| format!("history {r} `{name}` is null"))?;
                    uses.push(use_(format!("history {r} {name}"), Some(ptr), bytes, 4, io));
                }
                // A row reads everything before it writes: its write back in place is safe.
                for (read, write) in [("history", "history_next"), ("scale", "scale_next")] {
                    in_place.push((format!("history {r} {read}"), format!("history {r} {write}")));
                }
            }
            let in_place: Vec<(&str, &str)> = in_place
                .iter()
                .map(|(a, b)| (a.as_str(), b.as_str()))
                .collect();
            checked(m, uses, &in_place)
        }
        Kernel::Dequantization => {
            let mut a = Args::new(l);
            let products = a.need(m, "products")?;
            let count = a.count32("count")?;
            a.end()?;
            thread_per_row(l, count, "product")?;
            // Rows {a_scale, b_scale, factors}: three pointers.
            let mut uses = vec![use_("products", Some(products), count as u64 * 24, 8, Io::R)];
            for p in 0..count as i64 {
                for (k, (name, bytes, io)) in [("a_scale", 4, Io::R), ("b_scale", 4, Io::R), ("factors", 8, Io::W)]
                    .into_iter()
                    .enumerate()
                {
                    let addr = m
                        .u64_at(products, 3 * p + k as i64)
                        .map_err(|e| format!("`products` row {p}: {e}"))?;
                    let ptr = m
                        .decode(addr)
                        .map_err(|e| format!("product {p} `{name}`: {e}"))?
                        .ok_or_else(|| format!("product {p} `{name}` is null"))?;
                    uses.push(use_(format!("product {p} {name}"), Some(ptr), bytes, 4, io));
                }
            }
            checked(m, uses, &[])
        }
    }
}

/// A 1-D grid of at least a thread for each of `count` rows (`what`s).
fn thread_per_row(l: &Launch, count: usize, what: &str) -> R<()> {
    let threads = u64::from(l.grid.0) * u64::from(l.block.0);
    if (l.grid.1, l.grid.2, l.block.1, l.block.2) != (1, 1, 1, 1) || threads < count as u64 {
        return Err(format!(
            "grid {:?} block {:?}: the kernel takes a 1-D grid of a thread per {what} ({count})",
            l.grid, l.block
        ));
    }
    Ok(())
}

/// The blocks of a 1-D grid: one partial maximum each.
fn blocks(l: &Launch) -> R<u64> {
    match l.grid {
        (x, 1, 1) if x > 0 => Ok(u64::from(x)),
        g => Err(format!("grid {g:?}: the kernel takes a 1-D grid")),
    }
}
