//! A launch's arguments, read by parameter name and type-checked.
//!
//! A hand-written kernel's parameters come from its signature
//! ([`crate::cuda::families::signature`], read from the declaration), so a contract reads each
//! argument by the name the kernel gives it, in any order, and must read them all. A
//! generated kernel (no signature) is read in order.

use super::memory::{Mem, Ptr};
use super::R;
use crate::cuda::program::{Arg, CopyLayout, Launch};

/// The arguments of a launch, read in the kernel's parameter order.
pub(crate) struct Args<'a> {
    l: &'a Launch,
    /// The kernel's parameters; `None` for a generated kernel.
    signature: Option<&'static castor_kernels::Signature>,
    /// Arguments read so far (by index).
    read: Vec<bool>,
    /// The next argument of a kernel read in order, and the one read last.
    next: usize,
    last: usize,
}

impl<'a> Args<'a> {
    pub(crate) fn new(l: &'a Launch) -> Self {
        Args {
            l,
            signature: crate::cuda::families::signature(&l.entry).ok(),
            read: vec![false; l.args.len()],
            next: 0,
            last: 0,
        }
    }

    pub(crate) fn arg(&mut self, what: &str) -> R<&'a Arg> {
        let i = match self.signature {
            Some(sig) => sig
                .params
                .iter()
                .position(|p| p.name == what)
                .ok_or_else(|| {
                    format!(
                        "`{}` has no parameter `{what}` (it takes {})",
                        self.l.entry,
                        sig.names().join(", ")
                    )
                })?,
            None => {
                self.next += 1;
                self.next - 1
            }
        };
        self.last = i;
        if let Some(r) = self.read.get_mut(i) {
            *r = true;
        }
        self.l.args.get(i).ok_or_else(|| {
            format!(
                "argument {i} `{what}` is missing ({} arguments given)",
                self.l.args.len()
            )
        })
    }

    pub(crate) fn bad(&self, what: &str, want: &str, got: &Arg) -> String {
        format!(
            "argument {} `{what}` must be {want}, found {got:?}",
            self.last
        )
    }

    /// A nullable pointer.
    pub(crate) fn ptr(&mut self, m: &Mem, what: &str) -> R<Option<Ptr>> {
        match self.arg(what)? {
            Arg::Ptr(p) => Ok(Some(m.place(*p))),
            Arg::Null => Ok(None),
            Arg::Table(t) => Ok(Some(m.table(*t)?)),
            other => Err(self.bad(what, "a pointer", other)),
        }
    }

    /// A pointer that must not be null.
    pub(crate) fn need(&mut self, m: &Mem, what: &str) -> R<Ptr> {
        self.ptr(m, what)?
            .ok_or_else(|| format!("argument {} `{what}` must not be null", self.last))
    }

    pub(crate) fn i64(&mut self, what: &str) -> R<i64> {
        match self.arg(what)? {
            Arg::I64(x) => Ok(*x),
            other => Err(self.bad(what, "an i64", other)),
        }
    }

    /// An i64 that must be at least 0, as a count.
    pub(crate) fn count(&mut self, what: &str) -> R<usize> {
        let x = self.i64(what)?;
        usize::try_from(x).map_err(|_| format!("argument `{what}` = {x} is negative"))
    }

    pub(crate) fn i32(&mut self, what: &str) -> R<i32> {
        match self.arg(what)? {
            Arg::I32(x) => Ok(*x),
            other => Err(self.bad(what, "an i32", other)),
        }
    }

    /// An i32 that must be at least 0.
    pub(crate) fn count32(&mut self, what: &str) -> R<usize> {
        let x = self.i32(what)?;
        usize::try_from(x).map_err(|_| format!("argument `{what}` = {x} is negative"))
    }

    pub(crate) fn u16(&mut self, what: &str) -> R<u16> {
        match self.arg(what)? {
            Arg::U16(x) => Ok(*x),
            other => Err(self.bad(what, "a u16", other)),
        }
    }

    pub(crate) fn u32(&mut self, what: &str) -> R<u32> {
        match self.arg(what)? {
            Arg::U32(x) => Ok(*x),
            other => Err(self.bad(what, "a u32", other)),
        }
    }

    pub(crate) fn u64(&mut self, what: &str) -> R<u64> {
        match self.arg(what)? {
            Arg::U64(x) => Ok(*x),
            other => Err(self.bad(what, "a u64", other)),
        }
    }

    pub(crate) fn f64(&mut self, what: &str) -> R<f64> {
        match self.arg(what)? {
            Arg::F64(x) => Ok(*x),
            other => Err(self.bad(what, "an f64", other)),
        }
    }

    pub(crate) fn layout(&mut self, what: &str) -> R<CopyLayout> {
        match self.arg(what)? {
            Arg::Layout(l) => Ok(*l),
            other => Err(self.bad(what, "a CopyLayout", other)),
        }
    }

    /// Every argument was read, and the launch passes as many as the kernel takes.
    pub(crate) fn end(&self) -> R<()> {
        let takes = self.signature.map_or(self.next, |s| s.params.len());
        if self.l.args.len() != takes {
            return Err(format!(
                "{} arguments given, the kernel takes {takes}",
                self.l.args.len()
            ));
        }
        if let Some(i) = self.read.iter().position(|r| !r) {
            let name = self
                .signature
                .and_then(|s| s.params.get(i))
                .map_or("?", |p| p.name.as_str());
            return Err(format!(
                "argument {i} `{name}` is passed but its contract never reads it"
            ));
        }
        Ok(())
    }
}
