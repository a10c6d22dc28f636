//! `elementwise.cu`: the activation functions forward and backward, add and mul.

use crate::cpu::elementwise;
use crate::cuda::emulate::args::Args;
use crate::cuda::emulate::memory::{check_uses, use_, Io, Mem};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_ir::{BinaryOp, DType, UnaryOp};

pub(super) fn unary_kernel(
    m: &mut Mem,
    l: &Launch,
    op: UnaryOp,
    t: DType,
    backward: bool,
) -> R<()> {
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let dy = if backward {
        Some(a.need(m, "dy")?)
    } else {
        None
    };
    let y = a.need(m, if backward { "dx" } else { "y" })?;
    let n = a.count("n")?;
    a.end()?;
    let s = t.size_bytes();
    let b = (n * s) as u64;
    check_uses(
        m,
        &[
            use_("x", Some(x), b, s, Io::R),
            use_("dy", dy, b, s, Io::R),
            use_(if backward { "dx" } else { "y" }, Some(y), b, s, Io::W),
        ],
        &[("y", "x"), ("dx", "dy")],
    )?;
    let xs = m.fv(x, 0, n, t)?;
    let out = match dy {
        Some(dy) => {
            let mut d = m.fv(dy, 0, n, t)?;
            elementwise::unary_grad(op, &xs, &mut d);
            d
        }
        None => {
            let mut v = xs;
            elementwise::unary(op, &mut v);
            v
        }
    };
    m.set_fv(y, 0, t, &out)
}

pub(super) fn binary_kernel(m: &mut Mem, l: &Launch, op: BinaryOp, t: DType) -> R<()> {
    let mut a = Args::new(l);
    let pa = a.need(m, "a")?;
    let pb = a.need(m, "b")?;
    let out = a.need(m, "out")?;
    let n = a.count("n")?;
    let nb = a.count("nb")?;
    a.end()?;
    if nb == 0 {
        return Ok(());
    }
    let s = t.size_bytes();
    check_uses(
        m,
        &[
            use_("a", Some(pa), (n * s) as u64, s, Io::R),
            use_("b", Some(pb), (nb * s) as u64, s, Io::R),
            use_("out", Some(out), (n * s) as u64, s, Io::W),
        ],
        &[("out", "a")],
    )?;
    let (xa, xb) = (m.fv(pa, 0, n, t)?, m.fv(pb, 0, nb, t)?);
    let r: Vec<f32> = (0..n)
        .map(|i| {
            let (x, y) = (xa[i], xb[if nb == n { i } else { i % nb }]);
            match op {
                BinaryOp::Add => x + y,
                BinaryOp::Mul => x * y,
                BinaryOp::Sub => x - y,
                BinaryOp::Div => x / y,
            }
        })
        .collect();
    m.set_fv(out, 0, t, &r)
}
