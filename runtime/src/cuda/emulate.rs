//! A host interpreter of a lowered [`Program`]: every command executed on byte-addressed
//! memory as the device would, with no GPU.
//!
//! What it is for: running a lowered plan end to end on machines without a GPU, so that the
//! lowering's decisions (which kernel, which arguments, where every buffer lives, when an
//! arena buffer may be reused, what is updated in place) are checked against the CPU
//! executor. Every access is bounds-checked and reported as an error naming the command and
//! the argument, never a panic; launches are checked against the launch-shape rules their
//! kernel files state, and buffers a launch writes are checked not to overlap buffers it
//! reads unless the kernel's header allows that exact in-place use. An optional *poison*
//! mode fills the arena with `0xFF` bytes (NaN for every float dtype, `-1` for ints) before
//! each run and tracks which arena bytes the run has written: reading bytes no earlier command
//! of the run wrote is an error, and a value read after its space was reused shows up in the
//! results.
//!
//! Memory: the arena is one `Vec<u8>`, every slot one more, every table one more (encoded
//! with [`super::program::Table::encode`]). Pointers stored in tables are fake device
//! addresses: buffer `b` (0 the arena, `1 + s` slot `s`, then the tables) at byte `o` is
//! `(b + 1) << 48 | o`, and the interpreter resolves them back, so a table that holds a wrong
//! place fails here.
//!
//! Kernels: each `kernels/*.cu` entry point is implemented from its header comment (argument
//! order and meaning, rounding points), with the CPU executor's arithmetic where the header
//! names it the kernel's twin (`cpu::math`'s `exp` and F64 sums, the optimizer and loss-scale
//! functions, the RoPE table): so, where the lowering is right, results are bit-identical to
//! the CPU executor's except for reduction orders the executors do not share (cuBLAS products
//! here are naive column-major loops accumulating fused multiply-adds in `k` order, which is
//! the CPU `gemm` crate's order for most small products). Where a kernel's own arithmetic
//! differs from its twin only in summation order or in CUDA's `expf` (the online log-sum-exp
//! of cross-entropy, block trees), the twin's is used; each header documents that as a
//! sub-ulp difference, and it is not what this checks.
//!
//! Generated pointwise kernels (modules that are not `kernels/` files; the lowering puts them
//! all in one module) are emulated from their CUDA source, found by the launch's entry point:
//! the `<entry>_body` function's lines `const float tJ = round_to<T>(EXPR);` (an
//! expression language of `xK`, `tJ`, `+ - * /`, `Functor::f(..)`, `Functor::df(..)` and
//! `__int_as_float(0x..)` literals), its `*rO = tJ;` results, the entry point's parameter
//! dtypes and the scalar loop's input index expressions (`i`, `0`, or sums of
//! `((i / S) % D) * T`). The functors are evaluated with the CPU executor's pointwise
//! functions (`cpu::elementwise`), so a fused kernel gives exactly what its members give
//! unfused on the CPU. Parsing the source rather than keeping the IR checks what the device
//! would actually run.

use super::program::{
    Arg, Command, CopyLayout, Gemm, GemmCompute, Launch, Place, Program, SlotKind,
};
use crate::cpu::{elementwise, math, optimizer, rope};
use castor_ir::{round_tf32, round_to, BinaryOp, DType, ReduceOp, UnaryOp};
use half::{bf16, f16};
use std::collections::{HashMap, HashSet};
use std::ops::Range;

type R<T> = Result<T, String>;

/// Bits of a fake device address that hold the byte offset.
const ADDR_SHIFT: u32 = 48;
const ADDR_MASK: u64 = (1 << ADDR_SHIFT) - 1;

/// A resolved device pointer: a buffer and a byte offset into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ptr {
    buf: usize,
    off: u64,
}

impl Ptr {
    fn addr(self) -> u64 {
        if self.off > ADDR_MASK {
            // An offset no buffer has (an unresolved arena tag): an address that resolves to
            // no buffer, reported where it is used.
            return u64::MAX;
        }
        ((self.buf as u64 + 1) << ADDR_SHIFT) | self.off
    }
}

/// The device memory: the arena, the slots, the tables.
struct Mem {
    bufs: Vec<Vec<u8>>,
    names: Vec<String>,
    slots: usize,
    tables: usize,
    /// Poison mode: which arena bytes the current run has written.
    written: Option<Vec<bool>>,
}

impl Mem {
    fn place(&self, p: Place) -> Ptr {
        match p {
            Place::Arena { offset } => Ptr {
                buf: 0,
                off: offset,
            },
            Place::Slot { slot, offset } => Ptr {
                buf: 1 + slot,
                off: offset,
            },
        }
    }

    fn table(&self, t: usize) -> R<Ptr> {
        if t >= self.tables {
            return Err(format!(
                "table #{t} does not exist ({} tables)",
                self.tables
            ));
        }
        Ok(Ptr {
            buf: 1 + self.slots + t,
            off: 0,
        })
    }

    /// A pointer read from device memory: null, or a buffer of this program.
    fn decode(&self, addr: u64) -> R<Option<Ptr>> {
        if addr == 0 {
            return Ok(None);
        }
        let b = (addr >> ADDR_SHIFT) as usize;
        if b == 0 || b > self.bufs.len() {
            return Err(format!("{addr:#x} is not an address of this program"));
        }
        Ok(Some(Ptr {
            buf: b - 1,
            off: addr & ADDR_MASK,
        }))
    }

    fn name(&self, buf: usize) -> &str {
        self.names.get(buf).map_or("no buffer", String::as_str)
    }

    fn describe(&self, p: Ptr) -> String {
        format!("{}+{}", self.name(p.buf), p.off)
    }

    /// The bytes `byte..byte + len` from `p`, checked.
    fn range(&self, p: Ptr, byte: i64, len: u64) -> R<Range<usize>> {
        let Some(buf) = self.bufs.get(p.buf) else {
            return Err(format!(
                "pointer into buffer #{} that does not exist",
                p.buf
            ));
        };
        let start = i128::from(p.off) + i128::from(byte);
        let end = start + i128::from(len);
        if start < 0 || end > buf.len() as i128 {
            return Err(format!(
                "out of bounds: bytes {start}..{end} of {} ({} bytes)",
                self.name(p.buf),
                buf.len()
            ));
        }
        Ok(start as usize..end as usize)
    }

    /// Bytes a command reads: in poison mode, arena bytes must have been written by an
    /// earlier command of the same run.
    fn bytes(&self, p: Ptr, byte: i64, len: u64) -> R<&[u8]> {
        let r = self.range(p, byte, len)?;
        if let (0, Some(written)) = (p.buf, &self.written) {
            if let Some(k) = written[r.clone()].iter().position(|&w| !w) {
                return Err(format!(
                    "reads byte {} of the arena, which no earlier command of this run wrote \
                     (a buffer used before it is made, or after its space was reused)",
                    r.start + k
                ));
            }
        }
        Ok(&self.bufs[p.buf][r])
    }

    /// Bytes a command writes.
    fn bytes_mut(&mut self, p: Ptr, byte: i64, len: u64) -> R<&mut [u8]> {
        let r = self.range(p, byte, len)?;
        if let (0, Some(written)) = (p.buf, &mut self.written) {
            written[r.clone()].fill(true);
        }
        Ok(&mut self.bufs[p.buf][r])
    }

    /// Poison mode: the arena filled with `0xFF` and marked unwritten.
    fn poison(&mut self) {
        self.bufs[0].fill(0xff);
        self.written = Some(vec![false; self.bufs[0].len()]);
    }

    fn get<const N: usize>(&self, p: Ptr, i: i64) -> R<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(p, i * N as i64, N as u64)?);
        Ok(out)
    }

    fn put<const N: usize>(&mut self, p: Ptr, i: i64, v: [u8; N]) -> R<()> {
        self.bytes_mut(p, i * N as i64, N as u64)?
            .copy_from_slice(&v);
        Ok(())
    }

    fn i64_at(&self, p: Ptr, i: i64) -> R<i64> {
        Ok(i64::from_le_bytes(self.get(p, i)?))
    }
    fn set_i64(&mut self, p: Ptr, i: i64, v: i64) -> R<()> {
        self.put(p, i, v.to_le_bytes())
    }
    fn i32_at(&self, p: Ptr, i: i64) -> R<i32> {
        Ok(i32::from_le_bytes(self.get(p, i)?))
    }
    fn set_i32(&mut self, p: Ptr, i: i64, v: i32) -> R<()> {
        self.put(p, i, v.to_le_bytes())
    }
    fn f64_at(&self, p: Ptr, i: i64) -> R<f64> {
        Ok(f64::from_le_bytes(self.get(p, i)?))
    }
    fn set_f64(&mut self, p: Ptr, i: i64, v: f64) -> R<()> {
        self.put(p, i, v.to_le_bytes())
    }
    fn u64_at(&self, p: Ptr, i: i64) -> R<u64> {
        Ok(u64::from_le_bytes(self.get(p, i)?))
    }
    fn f32_at(&self, p: Ptr, i: i64) -> R<f32> {
        Ok(f32::from_le_bytes(self.get(p, i)?))
    }
    fn set_f32(&mut self, p: Ptr, i: i64, v: f32) -> R<()> {
        self.put(p, i, v.to_le_bytes())
    }

    /// Element `i` of a float buffer of dtype `dt`, widened to F32.
    fn f(&self, p: Ptr, i: i64, dt: DType) -> R<f32> {
        Ok(match dt {
            DType::F32 => f32::from_le_bytes(self.get(p, i)?),
            DType::F16 => f16::from_bits(u16::from_le_bytes(self.get(p, i)?)).to_f32(),
            DType::BF16 => bf16::from_bits(u16::from_le_bytes(self.get(p, i)?)).to_f32(),
            other => return Err(format!("a float load from a {} buffer", other.name())),
        })
    }

    /// Stores `v` rounded to `dt` (nearest, ties to even).
    fn set_f(&mut self, p: Ptr, i: i64, dt: DType, v: f32) -> R<()> {
        match dt {
            DType::F32 => self.put(p, i, v.to_le_bytes()),
            DType::F16 => self.put(p, i, f16::from_f32(v).to_bits().to_le_bytes()),
            DType::BF16 => self.put(p, i, bf16::from_f32(v).to_bits().to_le_bytes()),
            other => Err(format!("a float store to a {} buffer", other.name())),
        }
    }

    /// `n` elements from element `start` of a float buffer, widened to F32.
    fn fv(&self, p: Ptr, start: i64, n: usize, dt: DType) -> R<Vec<f32>> {
        let size = dt.size_bytes();
        let b = self.bytes(p, start * size as i64, (n * size) as u64)?;
        Ok(match dt {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            other => return Err(format!("a float load from a {} buffer", other.name())),
        })
    }

    /// Stores `v` from element `start`, each value rounded to `dt`.
    fn set_fv(&mut self, p: Ptr, start: i64, dt: DType, v: &[f32]) -> R<()> {
        let size = dt.size_bytes();
        let b = self.bytes_mut(p, start * size as i64, (v.len() * size) as u64)?;
        match dt {
            DType::F32 => {
                for (c, x) in b.chunks_exact_mut(4).zip(v) {
                    c.copy_from_slice(&x.to_le_bytes());
                }
            }
            DType::F16 => {
                for (c, &x) in b.chunks_exact_mut(2).zip(v) {
                    c.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
                }
            }
            DType::BF16 => {
                for (c, &x) in b.chunks_exact_mut(2).zip(v) {
                    c.copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
                }
            }
            other => return Err(format!("a float store to a {} buffer", other.name())),
        }
        Ok(())
    }

    /// The kernel's `report_bad`: an `atomicMin` of the position into the flag.
    fn report_bad(&mut self, bad: Option<Ptr>, position: i64) -> R<()> {
        let Some(b) = bad else { return Ok(()) };
        let pos = position.min(0x7fff_ffff) as i32;
        if pos < self.i32_at(b, 0)? {
            self.set_i32(b, 0, pos)?;
        }
        Ok(())
    }
}

/// How a launch or command uses a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Io {
    R,
    W,
    Rw,
}

/// A buffer a command touches: `bytes` bytes from `p`, elements of `elem` bytes.
struct Use {
    what: String,
    p: Ptr,
    bytes: u64,
    elem: usize,
    io: Io,
}

fn use_(what: impl Into<String>, p: Option<Ptr>, bytes: u64, elem: usize, io: Io) -> Option<Use> {
    p.map(|p| Use {
        what: what.into(),
        p,
        bytes,
        elem,
        io,
    })
}

/// Every use must lie in its buffer, and no buffer written may overlap another use, except the
/// exact in-place pairs `in_place` names (same start, same element size).
fn check_uses(m: &Mem, uses: &[Option<Use>], in_place: &[(&str, &str)]) -> R<()> {
    let uses: Vec<&Use> = uses.iter().flatten().collect();
    for u in &uses {
        m.range(u.p, 0, u.bytes)
            .map_err(|e| format!("`{}` at {}: {e}", u.what, m.describe(u.p)))?;
    }
    for (i, a) in uses.iter().enumerate() {
        for b in &uses[i + 1..] {
            if a.io == Io::R && b.io == Io::R {
                continue;
            }
            if a.p.buf != b.p.buf || a.bytes == 0 || b.bytes == 0 {
                continue;
            }
            let (a0, a1) = (a.p.off, a.p.off + a.bytes);
            let (b0, b1) = (b.p.off, b.p.off + b.bytes);
            if a0 >= b1 || b0 >= a1 {
                continue;
            }
            let allowed = a.p == b.p
                && a.elem == b.elem
                && in_place
                    .iter()
                    .any(|&(x, y)| (x == a.what && y == b.what) || (x == b.what && y == a.what));
            if !allowed {
                return Err(format!(
                    "`{}` ({}, {} bytes) overlaps `{}` ({}, {} bytes), and the kernel does not \
                     allow that in-place use",
                    a.what,
                    m.describe(a.p),
                    a.bytes,
                    b.what,
                    m.describe(b.p),
                    b.bytes
                ));
            }
        }
    }
    Ok(())
}

/// The arguments of a launch, read in the kernel's parameter order.
struct Args<'a> {
    l: &'a Launch,
    next: usize,
}

impl<'a> Args<'a> {
    fn new(l: &'a Launch) -> Self {
        Args { l, next: 0 }
    }

    fn arg(&mut self, what: &str) -> R<&'a Arg> {
        let i = self.next;
        self.next += 1;
        self.l.args.get(i).ok_or_else(|| {
            format!(
                "argument {i} `{what}` is missing ({} arguments given)",
                self.l.args.len()
            )
        })
    }

    fn bad(&self, what: &str, want: &str, got: &Arg) -> String {
        format!(
            "argument {} `{what}` must be {want}, found {got:?}",
            self.next - 1
        )
    }

    /// A nullable pointer.
    fn ptr(&mut self, m: &Mem, what: &str) -> R<Option<Ptr>> {
        match self.arg(what)? {
            Arg::Ptr(p) => Ok(Some(m.place(*p))),
            Arg::Null => Ok(None),
            Arg::Table(t) => Ok(Some(m.table(*t)?)),
            other => Err(self.bad(what, "a pointer", other)),
        }
    }

    /// A pointer that must not be null.
    fn need(&mut self, m: &Mem, what: &str) -> R<Ptr> {
        self.ptr(m, what)?
            .ok_or_else(|| format!("argument {} `{what}` must not be null", self.next - 1))
    }

    fn i64(&mut self, what: &str) -> R<i64> {
        match self.arg(what)? {
            Arg::I64(x) => Ok(*x),
            other => Err(self.bad(what, "an i64", other)),
        }
    }

    /// An i64 that must be at least 0, as a count.
    fn count(&mut self, what: &str) -> R<usize> {
        let x = self.i64(what)?;
        usize::try_from(x).map_err(|_| format!("argument `{what}` = {x} is negative"))
    }

    fn i32(&mut self, what: &str) -> R<i32> {
        match self.arg(what)? {
            Arg::I32(x) => Ok(*x),
            other => Err(self.bad(what, "an i32", other)),
        }
    }

    /// An i32 that must be at least 0.
    fn count32(&mut self, what: &str) -> R<usize> {
        let x = self.i32(what)?;
        usize::try_from(x).map_err(|_| format!("argument `{what}` = {x} is negative"))
    }

    fn u16(&mut self, what: &str) -> R<u16> {
        match self.arg(what)? {
            Arg::U16(x) => Ok(*x),
            other => Err(self.bad(what, "a u16", other)),
        }
    }

    fn u32(&mut self, what: &str) -> R<u32> {
        match self.arg(what)? {
            Arg::U32(x) => Ok(*x),
            other => Err(self.bad(what, "a u32", other)),
        }
    }

    fn u64(&mut self, what: &str) -> R<u64> {
        match self.arg(what)? {
            Arg::U64(x) => Ok(*x),
            other => Err(self.bad(what, "a u64", other)),
        }
    }

    fn f64(&mut self, what: &str) -> R<f64> {
        match self.arg(what)? {
            Arg::F64(x) => Ok(*x),
            other => Err(self.bad(what, "an f64", other)),
        }
    }

    fn layout(&mut self, what: &str) -> R<CopyLayout> {
        match self.arg(what)? {
            Arg::Layout(l) => Ok(*l),
            other => Err(self.bad(what, "a CopyLayout", other)),
        }
    }

    /// Every argument was read.
    fn end(&self) -> R<()> {
        if self.l.args.len() != self.next {
            return Err(format!(
                "{} arguments given, the kernel takes {}",
                self.l.args.len(),
                self.next
            ));
        }
        Ok(())
    }
}

/// A lowered program running on the host.
pub struct Emulator {
    program: Program,
    mem: Mem,
    poison: bool,
    /// Parsed generated kernels, by module and entry point.
    fused: HashMap<(usize, String), Fused>,
}

impl Emulator {
    /// Memory for `program`: the arena and the slots zeroed, constant slots filled, tables
    /// encoded with addresses the interpreter resolves.
    pub fn new(program: &Program) -> Emulator {
        let mut bufs = vec![vec![0u8; program.arena_bytes as usize]];
        let mut names = vec!["arena".to_string()];
        for s in &program.slots {
            let mut b = vec![0u8; s.bytes as usize];
            if let SlotKind::Constant(c) = &s.kind {
                let n = c.len().min(b.len());
                b[..n].copy_from_slice(&c[..n]);
            }
            bufs.push(b);
            names.push(format!("slot `{}`", s.name));
        }
        let slots = program.slots.len();
        let tables = program.tables.len();
        let mut mem = Mem {
            bufs,
            names,
            slots,
            tables,
            written: None,
        };
        for (t, table) in program.tables.iter().enumerate() {
            let bytes = table.encode(&|p| mem.place(p).addr());
            mem.bufs.push(bytes);
            mem.names.push(format!("table #{t}"));
        }
        Emulator {
            program: program.clone(),
            mem,
            poison: false,
            fused: HashMap::new(),
        }
    }

    /// The program being run.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Poison mode: before every run (and the prologue) the arena is filled with `0xFF` bytes
    /// (NaN in every float dtype, `-1` in ints) and marked unwritten; a command that reads
    /// arena bytes no earlier command of the run wrote is an error, and a value read after its
    /// space was reused by another buffer shows up in the results.
    pub fn set_poison(&mut self, on: bool) {
        self.poison = on;
        if !on {
            self.mem.written = None;
        }
    }

    /// Writes a whole slot (its exact size).
    pub fn write_slot(&mut self, slot: usize, bytes: &[u8]) -> Result<(), String> {
        let name = self.mem.name(1 + slot).to_string();
        let b = self
            .mem
            .bufs
            .get_mut(1 + slot)
            .filter(|_| slot < self.mem.slots)
            .ok_or_else(|| format!("slot {slot} does not exist"))?;
        if b.len() != bytes.len() {
            return Err(format!(
                "{name} has {} bytes, given {}",
                b.len(),
                bytes.len()
            ));
        }
        b.copy_from_slice(bytes);
        Ok(())
    }

    /// `bytes` bytes at `place` (a host read: not checked against poison).
    pub fn read(&self, place: Place, bytes: u64) -> Result<Vec<u8>, String> {
        let p = self.mem.place(place);
        let r = self
            .mem
            .range(p, 0, bytes)
            .map_err(|e| format!("reading {place:?}: {e}"))?;
        Ok(self.mem.bufs[p.buf][r].to_vec())
    }

    /// A whole slot.
    pub fn read_slot(&self, slot: usize) -> Result<Vec<u8>, String> {
        if slot >= self.mem.slots {
            return Err(format!("slot {slot} does not exist"));
        }
        Ok(self.mem.bufs[1 + slot].clone())
    }

    /// A device-to-device copy between runs (the runner's loss log, the used loss scale).
    pub fn copy(&mut self, dst: Place, src: Place, bytes: u64) -> Result<(), String> {
        let (d, s) = (self.mem.place(dst), self.mem.place(src));
        copy(&mut self.mem, d, s, bytes).map_err(|e| format!("copy {src:?} -> {dst:?}: {e}"))
    }

    /// Runs the prologue (working copies from masters).
    pub fn run_prologue(&mut self) -> Result<(), String> {
        if self.poison {
            self.mem.poison();
        }
        for (i, c) in self.program.prologue.iter().enumerate() {
            exec(&self.program, &mut self.mem, &mut self.fused, c)
                .map_err(|e| format!("prologue command {i} ({}): {e}", describe(c)))?;
        }
        Ok(())
    }

    /// Runs `run` (an index into the program's runs).
    pub fn run(&mut self, run: usize) -> Result<(), String> {
        let r = self
            .program
            .runs
            .get(run)
            .ok_or_else(|| format!("run {run} does not exist"))?;
        if self.poison {
            self.mem.poison();
        }
        for (i, c) in r.commands.iter().enumerate() {
            exec(&self.program, &mut self.mem, &mut self.fused, c)
                .map_err(|e| format!("run `{}` command {i} ({}): {e}", r.name, describe(c)))?;
        }
        Ok(())
    }

    /// The run's error flags: `Err` naming the first out-of-range index a kernel reported.
    pub fn check_flags(&self, run: usize) -> Result<(), String> {
        let r = self
            .program
            .runs
            .get(run)
            .ok_or_else(|| format!("run {run} does not exist"))?;
        for f in &r.error_flags {
            let pos = self.mem.i32_at(self.mem.place(f.place), 0)?;
            if pos == i32::MAX || pos < 0 {
                continue;
            }
            let index = self.mem.i64_at(self.mem.place(f.indices), i64::from(pos))?;
            return Err(format!(
                "%{}: {} {index} at position {pos} is out of range (limit {})",
                f.node, f.what, f.limit
            ));
        }
        Ok(())
    }
}

fn describe(c: &Command) -> String {
    match c {
        Command::Launch(l) => format!("launch `{}` for %{}", l.entry, l.node),
        Command::Gemm(g) => format!("cuBLAS product for %{}", g.node),
        Command::Copy { dst, src, bytes } => format!("copy of {bytes} bytes {src:?} -> {dst:?}"),
        Command::Memset { dst, bytes, byte } => {
            format!("memset of {bytes} bytes at {dst:?} to {byte:#x}")
        }
    }
}

fn exec(
    program: &Program,
    mem: &mut Mem,
    fused: &mut HashMap<(usize, String), Fused>,
    c: &Command,
) -> R<()> {
    match c {
        Command::Launch(l) => launch(program, mem, fused, l),
        Command::Gemm(g) => gemm(mem, g),
        Command::Copy { dst, src, bytes } => {
            let (d, s) = (mem.place(*dst), mem.place(*src));
            copy(mem, d, s, *bytes)
        }
        Command::Memset { dst, bytes, byte } => {
            let d = mem.place(*dst);
            mem.bytes_mut(d, 0, *bytes)?.fill(*byte);
            Ok(())
        }
    }
}

fn copy(mem: &mut Mem, d: Ptr, s: Ptr, bytes: u64) -> R<()> {
    check_uses(
        mem,
        &[
            use_("src", Some(s), bytes, 1, Io::R),
            use_("dst", Some(d), bytes, 1, Io::W),
        ],
        &[],
    )?;
    let data = mem.bytes(s, 0, bytes)?.to_vec();
    mem.bytes_mut(d, 0, bytes)?.copy_from_slice(&data);
    Ok(())
}

// ---- launches ------------------------------------------------------------------------------

fn launch(
    program: &Program,
    mem: &mut Mem,
    fused: &mut HashMap<(usize, String), Fused>,
    l: &Launch,
) -> R<()> {
    let (gx, gy, gz) = l.grid;
    let (bx, by, bz) = l.block;
    if [gx, gy, gz, bx, by, bz].contains(&0) {
        return Err(format!(
            "empty launch shape: grid {:?} block {:?}",
            l.grid, l.block
        ));
    }
    if gx > i32::MAX as u32 || gy > 65_535 || gz > 65_535 {
        return Err(format!("grid {:?} exceeds CUDA's limits", l.grid));
    }
    if u64::from(bx) * u64::from(by) * u64::from(bz) > 1024 || bz > 64 {
        return Err(format!("block {:?} exceeds CUDA's limits", l.block));
    }
    if l.shared_bytes > 48 * 1024 {
        return Err(format!(
            "{} bytes of dynamic shared memory (48 KiB without an opt-in)",
            l.shared_bytes
        ));
    }
    let module = program
        .modules
        .get(l.module)
        .ok_or_else(|| format!("module {} does not exist", l.module))?;
    match castor_kernels::file(&module.name) {
        Some(file) => {
            if !file.entry_points.contains(&l.entry.as_str()) {
                return Err(format!(
                    "`{}` is not an entry point of {}",
                    l.entry, file.name
                ));
            }
            if module.source != file.source {
                return Err(format!(
                    "module {} does not hold the source of kernels/{}",
                    module.name, file.name
                ));
            }
            builtin(mem, l)
        }
        None => {
            let key = (l.module, l.entry.clone());
            if !fused.contains_key(&key) {
                let f = Fused::parse(&module.source, &l.entry)
                    .map_err(|e| format!("generated module {}: {e}", module.name))?;
                fused.insert(key.clone(), f);
            }
            let f = fused
                .get(&key)
                .ok_or_else(|| "the parsed kernel is missing".to_string())?;
            f.run(mem, l)
        }
    }
}

/// Kernels whose block reductions need `blockDim = (32 k, 1, 1)`, `k <= 32`.
fn row_block(l: &Launch) -> R<()> {
    let (bx, by, bz) = l.block;
    if bx % 32 != 0 || by != 1 || bz != 1 {
        return Err(format!(
            "block {:?}: the kernel needs blockDim.x a multiple of 32 (at most 1024) and a 1-D \
             block",
            l.block
        ));
    }
    Ok(())
}

/// Kernels documented as one block.
fn one_block(l: &Launch) -> R<()> {
    if l.grid != (1, 1, 1) {
        return Err(format!("grid {:?}: the kernel runs as one block", l.grid));
    }
    Ok(())
}

fn dt(s: &str) -> Option<DType> {
    match s {
        "f32" => Some(DType::F32),
        "f16" => Some(DType::F16),
        "bf16" => Some(DType::BF16),
        "i64" => Some(DType::I64),
        "bool" => Some(DType::Bool),
        _ => None,
    }
}

fn float(s: &str) -> R<DType> {
    match dt(s) {
        Some(d) if d.is_float() => Ok(d),
        _ => Err(format!("`{s}` is not a float dtype suffix")),
    }
}

/// `bf16` -> (BF16, BF16); `f32_bf16` -> (F32, BF16).
fn io(s: &str) -> R<(DType, DType)> {
    if let Ok(d) = float(s) {
        return Ok((d, d));
    }
    let (a, b) = s
        .split_once('_')
        .ok_or_else(|| format!("`{s}` is not a dtype suffix"))?;
    Ok((float(a)?, float(b)?))
}

fn builtin(m: &mut Mem, l: &Launch) -> R<()> {
    let e = l.entry.as_str();
    if let Some(s) = e.strip_prefix("cast_") {
        let (a, b) = s
            .split_once('_')
            .and_then(|(a, b)| Some((dt(a)?, dt(b)?)))
            .ok_or_else(|| format!("`{e}`: no such cast"))?;
        return cast(m, l, a, b);
    }
    if let Some(w) = e.strip_prefix("strided_copy_b") {
        return strided_copy(m, l, w.parse().map_err(|_| format!("`{e}`"))?);
    }
    if let Some(w) = e.strip_prefix("fill_b") {
        return fill(m, l, w.parse().map_err(|_| format!("`{e}`"))?);
    }
    for (prefix, op) in [
        ("reduce_sum_", ReduceOp::Sum),
        ("reduce_mean_", ReduceOp::Mean),
        ("reduce_max_", ReduceOp::Max),
    ] {
        if let Some(s) = e.strip_prefix(prefix) {
            let (ti, to) = io(s)?;
            return reduce(m, l, op, ti, to);
        }
    }
    for (prefix, rms) in [("layer_norm_", false), ("rms_norm_", true)] {
        let Some(rest) = e.strip_prefix(prefix) else {
            continue;
        };
        if let Some(s) = rest.strip_prefix("fwd_") {
            let (ti, to) = io(s)?;
            return norm_fwd(m, l, rms, ti, to);
        }
        if let Some(s) = rest.strip_prefix("bwd_weight_") {
            let (ti, to) = io(s)?;
            return norm_bwd_weight(m, l, rms, ti, to);
        }
        if let Some(s) = rest.strip_prefix("bwd_") {
            let (ti, to) = io(s)?;
            return norm_bwd(m, l, rms, ti, to);
        }
    }
    if e == "norm_weight_grad_reduce" {
        return norm_weight_grad_reduce(m, l);
    }
    if let Some(s) = e.strip_prefix("softmax_fwd_") {
        let (ti, to) = io(s)?;
        return softmax_fwd(m, l, ti, to);
    }
    if let Some(s) = e.strip_prefix("softmax_bwd_") {
        let (ti, to) = io(s)?;
        return softmax_bwd(m, l, ti, to);
    }
    if e == "cross_entropy_finalize" {
        return cross_entropy_finalize(m, l);
    }
    if let Some(s) = e.strip_prefix("cross_entropy_fwd_") {
        return cross_entropy_fwd(m, l, float(s)?);
    }
    if let Some(s) = e.strip_prefix("cross_entropy_bwd_") {
        return cross_entropy_bwd(m, l, float(s)?);
    }
    match e {
        "embedding_bwd_count" => return embedding_bwd_count(m, l),
        "embedding_bwd_scan" => return embedding_bwd_scan(m, l),
        "embedding_bwd_fill" => return embedding_bwd_fill(m, l),
        "grad_norm_partials" => return grad_norm_partials(m, l),
        "grad_norm_finalize" => return grad_norm_finalize(m, l),
        "count_step" => return count_step(m, l),
        "loss_scale_update" => return loss_scale_update(m, l),
        "rope_table" => return rope_table(m, l),
        _ => {}
    }
    if let Some(s) = e.strip_prefix("embedding_fwd_") {
        return embedding_fwd(m, l, float(s)?);
    }
    if let Some(s) = e.strip_prefix("embedding_bwd_accumulate_") {
        let (t, o) = io(s)?;
        return embedding_bwd_accumulate(m, l, t, o);
    }
    if let Some(s) = e.strip_prefix("rope_fwd_") {
        return rope_launch(m, l, float(s)?, false);
    }
    if let Some(s) = e.strip_prefix("rope_bwd_") {
        return rope_launch(m, l, float(s)?, true);
    }
    if let Some(s) = e.strip_prefix("adamw_") {
        return multi_tensor_update(m, l, true, float(s)?);
    }
    if let Some(s) = e.strip_prefix("sgd_") {
        return multi_tensor_update(m, l, false, float(s)?);
    }
    for (prefix, op) in [
        ("gelu_tanh_", UnaryOp::GeluTanh),
        ("gelu_erf_", UnaryOp::GeluErf),
        ("silu_", UnaryOp::Silu),
    ] {
        if let Some(rest) = e.strip_prefix(prefix) {
            if let Some(s) = rest.strip_prefix("fwd_") {
                return unary_kernel(m, l, op, float(s)?, false);
            }
            if let Some(s) = rest.strip_prefix("bwd_") {
                return unary_kernel(m, l, op, float(s)?, true);
            }
        }
    }
    if let Some(s) = e.strip_prefix("add_") {
        return binary_kernel(m, l, BinaryOp::Add, float(s)?);
    }
    if let Some(s) = e.strip_prefix("mul_") {
        return binary_kernel(m, l, BinaryOp::Mul, float(s)?);
    }
    Err(format!("the emulator has no implementation of `{e}`"))
}

// ---- cast.cu, layout.cu ----------------------------------------------------------------------

fn cast(m: &mut Mem, l: &Launch, from: DType, to: DType) -> R<()> {
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let n = a.count("n")?;
    a.end()?;
    let (sf, st) = (from.size_bytes(), to.size_bytes());
    check_uses(
        m,
        &[
            use_("x", Some(x), (n * sf) as u64, sf, Io::R),
            use_("y", Some(y), (n * st) as u64, st, Io::W),
        ],
        &[],
    )?;
    for i in 0..n as i64 {
        match (from, to) {
            (f, t) if f.is_float() && t.is_float() => {
                let v = m.f(x, i, f)?;
                m.set_f(y, i, t, v)?;
            }
            (DType::I64, DType::Bool) => {
                let v = m.i64_at(x, i)?;
                m.put(y, i, [u8::from(v != 0)])?;
            }
            (DType::F32, DType::Bool) => {
                let v = m.f32_at(x, i)?;
                m.put(y, i, [u8::from(v != 0.0)])?;
            }
            (DType::Bool, DType::I64) => {
                let [v] = m.get::<1>(x, i)?;
                m.set_i64(y, i, i64::from(v != 0))?;
            }
            (DType::Bool, t) if t.is_float() => {
                let [v] = m.get::<1>(x, i)?;
                m.set_f(y, i, t, if v != 0 { 1.0 } else { 0.0 })?;
            }
            (DType::I64, t) if t.is_float() => {
                let v = m.i64_at(x, i)?;
                m.set_f(y, i, t, v as f32)?;
            }
            (DType::F32, DType::I64) => {
                let v = m.f32_at(x, i)?;
                m.set_i64(y, i, v as i64)?;
            }
            (f, t) => return Err(format!("no cast from {} to {}", f.name(), t.name())),
        }
    }
    Ok(())
}

fn strided_copy(m: &mut Mem, l: &Launch, w: usize) -> R<()> {
    if ![1, 2, 4, 8].contains(&w) {
        return Err(format!("no strided copy of {w}-byte elements"));
    }
    let mut a = Args::new(l);
    let src = a.need(m, "src")?;
    let dst = a.need(m, "dst")?;
    let n = a.i64("n")?;
    let lay = a.layout("l")?;
    a.end()?;
    let rank = lay.rank.clamp(0, super::program::MAX_RANK as i32) as usize;
    let want: i64 = lay.shape[..rank].iter().product();
    if n != want {
        return Err(format!(
            "n = {n}, but the layout's shape {:?} holds {want} elements",
            &lay.shape[..rank]
        ));
    }
    if lay.shape[..rank].iter().any(|&d| d < 0) {
        return Err(format!("negative dims in {:?}", &lay.shape[..rank]));
    }
    let mut moves = Vec::with_capacity(n.max(0) as usize);
    let mut seen = HashSet::new();
    let (mut s_lo, mut s_hi, mut d_lo, mut d_hi) = (i64::MAX, i64::MIN, i64::MAX, i64::MIN);
    for i in 0..n {
        let (mut rest, mut s, mut d) = (i, lay.src_offset, lay.dst_offset);
        for k in (0..rank).rev() {
            let c = rest % lay.shape[k];
            rest /= lay.shape[k];
            s += c * lay.src_stride[k];
            d += c * lay.dst_stride[k];
        }
        if !seen.insert(d) {
            return Err(format!(
                "element {i} writes destination element {d} a second time (the kernel needs \
                 distinct destinations)"
            ));
        }
        (s_lo, s_hi, d_lo, d_hi) = (s_lo.min(s), s_hi.max(s), d_lo.min(d), d_hi.max(d));
        moves.push((s, d));
    }
    if n > 0 {
        let wb = w as i64;
        // The element span [lo, hi] from `p`, as a use.
        let span = |what: &str, p: Ptr, lo: i64, hi: i64, io: Io| -> R<Option<Use>> {
            let off = u64::try_from(i128::from(p.off) + i128::from(lo * wb))
                .map_err(|_| format!("`{what}` element {lo} is before {}", m.describe(p)))?;
            let p = Ptr { buf: p.buf, off };
            Ok(use_(what, Some(p), ((hi - lo + 1) * wb) as u64, w, io))
        };
        check_uses(
            m,
            &[
                span("src", src, s_lo, s_hi, Io::R)?,
                span("dst", dst, d_lo, d_hi, Io::W)?,
            ],
            &[],
        )?;
    }
    for (s, d) in moves {
        let v = m.bytes(src, s * w as i64, w as u64)?.to_vec();
        m.bytes_mut(dst, d * w as i64, w as u64)?
            .copy_from_slice(&v);
    }
    Ok(())
}

fn fill(m: &mut Mem, l: &Launch, w: usize) -> R<()> {
    let mut a = Args::new(l);
    let dst = a.need(m, "dst")?;
    let n = a.count("n")?;
    let bits: Vec<u8> = match w {
        1 => vec![a.u32("value")? as u8],
        2 => a.u16("value")?.to_le_bytes().to_vec(),
        4 => a.u32("value")?.to_le_bytes().to_vec(),
        8 => a.u64("value")?.to_le_bytes().to_vec(),
        _ => return Err(format!("no fill of {w}-byte elements")),
    };
    a.end()?;
    let b = m
        .bytes_mut(dst, 0, (n * w) as u64)
        .map_err(|e| format!("`dst`: {e}"))?;
    for c in b.chunks_exact_mut(w) {
        c.copy_from_slice(&bits);
    }
    Ok(())
}

// ---- reduce.cu -------------------------------------------------------------------------------

fn reduce(m: &mut Mem, l: &Launch, op: ReduceOp, ti: DType, to: DType) -> R<()> {
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let outer = a.count("outer")?;
    let len = a.count("len")?;
    let inner = a.count("inner")?;
    a.end()?;
    if outer * inner == 0 {
        return Err("launched for an empty result (the header: nothing to launch)".into());
    }
    let grid = (
        inner.div_ceil(32).min(65_535) as u32,
        outer.min(65_535) as u32,
        1,
    );
    if l.block != (32, 8, 1) || l.grid != grid {
        return Err(format!(
            "launched with grid {:?} block {:?}; the kernel must be launched with grid {grid:?} \
             block (32, 8, 1)",
            l.grid, l.block
        ));
    }
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    check_uses(
        m,
        &[
            use_("x", Some(x), (outer * len * inner * si) as u64, si, Io::R),
            use_("y", Some(y), (outer * inner * so) as u64, so, Io::W),
        ],
        &[],
    )?;
    let xs = m.fv(x, 0, outer * len * inner, ti)?;
    let mut out = vec![0f32; outer * inner];
    for o in 0..outer {
        if inner == 1 {
            let row = &xs[o * len..(o + 1) * len];
            out[o] = match op {
                ReduceOp::Sum => math::sum(row) as f32,
                ReduceOp::Mean if len == 0 => f32::NAN,
                ReduceOp::Mean => (math::sum(row) / len as f64) as f32,
                ReduceOp::Max => math::max(row),
            };
            continue;
        }
        for c in 0..inner {
            let col = (0..len).map(|r| xs[(o * len + r) * inner + c]);
            out[o * inner + c] = match op {
                ReduceOp::Max => col.fold(f32::NEG_INFINITY, math::max2),
                ReduceOp::Sum => col.map(f64::from).sum::<f64>() as f32,
                ReduceOp::Mean if len == 0 => f32::NAN,
                ReduceOp::Mean => (col.map(f64::from).sum::<f64>() / len as f64) as f32,
            };
        }
    }
    m.set_fv(y, 0, to, &out)
}

// ---- norm.cu ---------------------------------------------------------------------------------

fn norm_fwd(m: &mut Mem, l: &Launch, rms: bool, ti: DType, to: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let res = a.ptr(m, "res")?;
    let sum_out = a.ptr(m, "sum_out")?;
    let w = a.need(m, "w")?;
    let b = if rms { None } else { Some(a.need(m, "b")?) };
    let y = a.need(m, "y")?;
    let mean_out = if rms { None } else { a.ptr(m, "mean_out")? };
    let rstd_out = a.ptr(m, "rstd_out")?;
    let rows = a.count("rows")?;
    let h = a.count32("h")?;
    let eps = a.f64("eps")?;
    a.end()?;
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    let big = |s: usize| (rows * h * s) as u64;
    check_uses(
        m,
        &[
            use_("x", Some(x), big(si), si, Io::R),
            use_("res", res, big(si), si, Io::R),
            use_("sum_out", sum_out, big(si), si, Io::W),
            use_("w", Some(w), h as u64 * 4, 4, Io::R),
            use_("b", b, h as u64 * 4, 4, Io::R),
            use_("y", Some(y), big(so), so, Io::W),
            use_("mean_out", mean_out, rows as u64 * 4, 4, Io::W),
            use_("rstd_out", rstd_out, rows as u64 * 4, 4, Io::W),
        ],
        &[("y", "x"), ("y", "sum_out"), ("sum_out", "x")],
    )?;
    let wv = m.fv(w, 0, h, DType::F32)?;
    let bv = match b {
        Some(b) => m.fv(b, 0, h, DType::F32)?,
        None => vec![0.0; h],
    };
    for r in 0..rows {
        let at = (r * h) as i64;
        let mut s = m.fv(x, at, h, ti)?;
        if let Some(res) = res {
            for (v, rv) in s.iter_mut().zip(m.fv(res, at, h, ti)?) {
                *v = round_to(ti, *v + rv);
            }
        }
        if let Some(so) = sum_out {
            m.set_fv(so, at, ti, &s)?;
        }
        let hf = h as f64;
        let (mean, rstd) = if rms {
            (0.0, (1.0 / (math::sum_sq(&s) / hf + eps).sqrt()) as f32)
        } else {
            let mean = math::sum(&s) / hf;
            let var = math::sum_sq_dev(&s, mean) / hf;
            (mean as f32, (1.0 / (var + eps).sqrt()) as f32)
        };
        if let Some(p) = mean_out {
            m.set_f32(p, r as i64, mean)?;
        }
        if let Some(p) = rstd_out {
            m.set_f32(p, r as i64, rstd)?;
        }
        let out: Vec<f32> = s
            .iter()
            .zip(&wv)
            .zip(&bv)
            .map(|((&v, &w), &b)| {
                if rms {
                    v * rstd * w
                } else {
                    (v - mean) * rstd * w + b
                }
            })
            .collect();
        m.set_fv(y, at, to, &out)?;
    }
    Ok(())
}

fn norm_bwd(m: &mut Mem, l: &Launch, rms: bool, ti: DType, to: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let s = a.need(m, "s")?;
    let dy = a.need(m, "dy")?;
    let w = a.need(m, "w")?;
    let mean = if rms { None } else { Some(a.need(m, "mean")?) };
    let rstd = a.need(m, "rstd")?;
    let dadd = a.ptr(m, "dadd")?;
    let dx = a.need(m, "dx")?;
    let rows = a.count("rows")?;
    let h = a.count32("h")?;
    a.end()?;
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    let big = |s: usize| (rows * h * s) as u64;
    check_uses(
        m,
        &[
            use_("s", Some(s), big(si), si, Io::R),
            use_("dy", Some(dy), big(so), so, Io::R),
            use_("w", Some(w), h as u64 * 4, 4, Io::R),
            use_("mean", mean, rows as u64 * 4, 4, Io::R),
            use_("rstd", Some(rstd), rows as u64 * 4, 4, Io::R),
            use_("dadd", dadd, big(si), si, Io::R),
            use_("dx", Some(dx), big(si), si, Io::W),
        ],
        &[("dx", "dy"), ("dx", "s")],
    )?;
    let wv = m.fv(w, 0, h, DType::F32)?;
    let hf = h as f64;
    for r in 0..rows {
        let at = (r * h) as i64;
        let xs = m.fv(s, at, h, ti)?;
        let ds = m.fv(dy, at, h, to)?;
        let mu = match mean {
            Some(p) => m.f32_at(p, r as i64)?,
            None => 0.0,
        };
        let rs = m.f32_at(rstd, r as i64)?;
        let (mut sg, mut sgx) = (0f64, 0f64);
        for ((&x, &d), &w) in xs.iter().zip(&ds).zip(&wv) {
            let g = f64::from(d * w);
            if rms {
                sgx += g * f64::from(x);
            } else {
                sg += g;
                sgx += g * f64::from((x - mu) * rs);
            }
        }
        let (mean_g, mean_gx) = ((sg / hf) as f32, (sgx / hf) as f32);
        let c = rs * rs * mean_gx;
        let mut out: Vec<f32> = xs
            .iter()
            .zip(&ds)
            .zip(&wv)
            .map(|((&x, &d), &w)| {
                if rms {
                    rs * (d * w - x * c)
                } else {
                    let xhat = (x - mu) * rs;
                    rs * (d * w - mean_g - xhat * mean_gx)
                }
            })
            .collect();
        if let Some(p) = dadd {
            for (v, add) in out.iter_mut().zip(m.fv(p, at, h, ti)?) {
                *v = round_to(ti, *v) + add;
            }
        }
        m.set_fv(dx, at, ti, &out)?;
    }
    Ok(())
}

fn norm_bwd_weight(m: &mut Mem, l: &Launch, rms: bool, ti: DType, to: DType) -> R<()> {
    let mut a = Args::new(l);
    let s = a.need(m, "s")?;
    let dy = a.need(m, "dy")?;
    let mean = if rms { None } else { Some(a.need(m, "mean")?) };
    let rstd = a.need(m, "rstd")?;
    let dw_part = a.need(m, "dw_part")?;
    let db_part = if rms {
        None
    } else {
        Some(a.need(m, "db_part")?)
    };
    let rows = a.count("rows")?;
    let h = a.count32("h")?;
    let per = a.count32("rows_per_group")?;
    a.end()?;
    if l.block.1 != 1 || l.block.2 != 1 {
        return Err(format!("block {:?}: the kernel takes a 1-D block", l.block));
    }
    // Not a grid-stride kernel: block (x, y) owns columns x * blockDim.x.. and row group y.
    let groups = l.grid.1 as usize;
    let cols = (l.grid.0 as usize * l.block.0 as usize).min(h);
    let needed = rows.div_ceil(per.max(1));
    if per == 0 || groups < needed || cols < h {
        return Err(format!(
            "grid {:?} block {:?} covers {cols} of {h} columns and {groups} of {needed} row \
             groups of {per}",
            l.grid, l.block
        ));
    }
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    let big = |s: usize| (rows * h * s) as u64;
    let part = (groups * h * 8) as u64;
    check_uses(
        m,
        &[
            use_("s", Some(s), big(si), si, Io::R),
            use_("dy", Some(dy), big(so), so, Io::R),
            use_("mean", mean, rows as u64 * 4, 4, Io::R),
            use_("rstd", Some(rstd), rows as u64 * 4, 4, Io::R),
            use_("dw_part", Some(dw_part), part, 8, Io::W),
            use_("db_part", db_part, part, 8, Io::W),
        ],
        &[],
    )?;
    for g in 0..groups {
        let (r0, r1) = ((g * per).min(rows), ((g + 1) * per).min(rows));
        let mut dw = vec![0f64; h];
        let mut db = vec![0f64; h];
        for r in r0..r1 {
            let at = (r * h) as i64;
            let xs = m.fv(s, at, h, ti)?;
            let ds = m.fv(dy, at, h, to)?;
            let mu = match mean {
                Some(p) => m.f32_at(p, r as i64)?,
                None => 0.0,
            };
            let rs = m.f32_at(rstd, r as i64)?;
            for j in 0..h {
                let xhat = if rms { xs[j] * rs } else { (xs[j] - mu) * rs };
                dw[j] += f64::from(ds[j]) * f64::from(xhat);
                db[j] += f64::from(ds[j]);
            }
        }
        for j in 0..h {
            m.set_f64(dw_part, (g * h + j) as i64, dw[j])?;
            if let Some(p) = db_part {
                m.set_f64(p, (g * h + j) as i64, db[j])?;
            }
        }
    }
    Ok(())
}

fn norm_weight_grad_reduce(m: &mut Mem, l: &Launch) -> R<()> {
    let mut a = Args::new(l);
    let part = a.need(m, "part")?;
    let groups = a.count32("groups")?;
    let h = a.count32("h")?;
    let out = a.need(m, "out")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("part", Some(part), (groups * h * 8) as u64, 8, Io::R),
            use_("out", Some(out), h as u64 * 4, 4, Io::W),
        ],
        &[],
    )?;
    for j in 0..h {
        let mut t = 0f64;
        for g in 0..groups {
            t += m.f64_at(part, (g * h + j) as i64)?;
        }
        m.set_f32(out, j as i64, t as f32)?;
    }
    Ok(())
}

// ---- softmax.cu ------------------------------------------------------------------------------

fn softmax_fwd(m: &mut Mem, l: &Launch, ti: DType, to: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let x = a.need(m, "x")?;
    let y = a.need(m, "y")?;
    let rows = a.count("rows")?;
    let tk = a.count32("tk")?;
    let tq = a.count32("tq")?;
    let heads = a.count32("heads")?;
    let causal = a.i32("causal")? != 0;
    let mask = a.ptr(m, "mask")?;
    let (sb, sh, sq, sk) = (
        a.i64("mask_sb")?,
        a.i64("mask_sh")?,
        a.i64("mask_sq")?,
        a.i64("mask_sk")?,
    );
    a.end()?;
    if tq == 0 || heads == 0 {
        return Err(format!("tq = {tq}, heads = {heads}"));
    }
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    check_uses(
        m,
        &[
            use_("x", Some(x), (rows * tk * si) as u64, si, Io::R),
            use_("y", Some(y), (rows * tk * so) as u64, so, Io::W),
        ],
        &[("y", "x")],
    )?;
    for row in 0..rows {
        let q = (row % tq) as i64;
        let bh = row / tq;
        let (hh, bb) = ((bh % heads) as i64, (bh / heads) as i64);
        let at = (row * tk) as i64;
        let visible = if causal {
            (q + 1 + tk as i64 - tq as i64).clamp(0, tk as i64) as usize
        } else {
            tk
        };
        let mut keep = vec![true; visible];
        if let Some(mp) = mask {
            let base = bb * sb + hh * sh + q * sq;
            for (j, k) in keep.iter_mut().enumerate() {
                let [b] = m
                    .get::<1>(mp, base + j as i64 * sk)
                    .map_err(|e| format!("`mask` of row {row}: {e}"))?;
                *k = b != 0;
            }
        }
        // Only the entries the kernel reads: visible and kept.
        let mut xs = vec![0f32; visible];
        for j in (0..visible).filter(|&j| keep[j]) {
            xs[j] = m.f(x, at + j as i64, ti)?;
        }
        let max = (0..visible)
            .filter(|&j| keep[j])
            .map(|j| xs[j])
            .reduce(math::max2);
        let out = match max {
            None => vec![1.0 / tk as f32; tk],
            Some(max) => {
                let mut e = vec![0f32; tk];
                for j in 0..visible {
                    if keep[j] {
                        e[j] = math::exp(xs[j] - max);
                    }
                }
                let inv = (1.0 / math::sum(&e[..visible])) as f32;
                e[..visible].iter_mut().for_each(|v| *v *= inv);
                e
            }
        };
        m.set_fv(y, at, to, &out)?;
    }
    Ok(())
}

fn softmax_bwd(m: &mut Mem, l: &Launch, ti: DType, to: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let y = a.need(m, "y")?;
    let dy = a.need(m, "dy")?;
    let dx = a.need(m, "dx")?;
    let rows = a.count("rows")?;
    let n = a.count32("n")?;
    a.end()?;
    let (si, so) = (ti.size_bytes(), to.size_bytes());
    check_uses(
        m,
        &[
            use_("y", Some(y), (rows * n * so) as u64, so, Io::R),
            use_("dy", Some(dy), (rows * n * so) as u64, so, Io::R),
            use_("dx", Some(dx), (rows * n * si) as u64, si, Io::W),
        ],
        &[],
    )?;
    for r in 0..rows {
        let at = (r * n) as i64;
        let (ys, ds) = (m.fv(y, at, n, to)?, m.fv(dy, at, n, to)?);
        let mut dot = 0f64;
        for (&y, &d) in ys.iter().zip(&ds) {
            dot += f64::from(y) * f64::from(d);
        }
        let dot = dot as f32;
        let out: Vec<f32> = ys.iter().zip(&ds).map(|(&y, &d)| y * (d - dot)).collect();
        m.set_fv(dx, at, ti, &out)?;
    }
    Ok(())
}

// ---- cross_entropy.cu ------------------------------------------------------------------------

/// The row's max and `Σ exp(x - max)` in F64, as the CPU twin computes them.
fn row_stats(row: &[f32]) -> (f32, f64) {
    let max = math::max(row);
    (max, math::sum_by(row, |x| f64::from(math::exp(x - max))))
}

fn cross_entropy_fwd(m: &mut Mem, l: &Launch, t: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let logits = a.need(m, "logits")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let v = a.count32("v")?;
    let ignore = a.i64("ignore_index")?;
    let row_loss = a.need(m, "row_loss")?;
    let row_max = a.ptr(m, "row_max")?;
    let row_inv = a.ptr(m, "row_inv")?;
    let bad = a.ptr(m, "bad")?;
    a.end()?;
    let st = t.size_bytes();
    check_uses(
        m,
        &[
            use_("logits", Some(logits), (rows * v * st) as u64, st, Io::R),
            use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
            use_("row_loss", Some(row_loss), rows as u64 * 8, 8, Io::W),
            use_("row_max", row_max, rows as u64 * 4, 4, Io::W),
            use_("row_inv", row_inv, rows as u64 * 4, 4, Io::W),
            use_("bad", bad, 4, 4, Io::Rw),
        ],
        &[],
    )?;
    for r in 0..rows {
        let ri = r as i64;
        let label = m.i64_at(labels, ri)?;
        let ok = label >= 0 && label < v as i64;
        let (loss, mx, inv) = if label == ignore || !ok {
            if label != ignore {
                m.report_bad(bad, ri)?;
            }
            (if label == ignore { 0.0 } else { f64::NAN }, 0.0, 0.0)
        } else {
            let xs = m.fv(logits, ri * v as i64, v, t)?;
            let (mx, s) = row_stats(&xs);
            (
                s.ln() + f64::from(mx) - f64::from(xs[label as usize]),
                mx,
                (1.0 / s) as f32,
            )
        };
        m.set_f64(row_loss, ri, loss)?;
        if let Some(p) = row_max {
            m.set_f32(p, ri, mx)?;
        }
        if let Some(p) = row_inv {
            m.set_f32(p, ri, inv)?;
        }
    }
    Ok(())
}

fn cross_entropy_finalize(m: &mut Mem, l: &Launch) -> R<()> {
    row_block(l)?;
    one_block(l)?;
    let mut a = Args::new(l);
    let row_loss = a.need(m, "row_loss")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let ignore = a.i64("ignore_index")?;
    let loss = a.need(m, "loss")?;
    let count = a.need(m, "count")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("row_loss", Some(row_loss), rows as u64 * 8, 8, Io::R),
            use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
            use_("loss", Some(loss), 4, 4, Io::W),
            use_("count", Some(count), 4, 4, Io::W),
        ],
        &[],
    )?;
    let (mut s, mut c) = (0f64, 0i64);
    for r in 0..rows as i64 {
        if m.i64_at(labels, r)? != ignore {
            s += m.f64_at(row_loss, r)?;
            c += 1;
        }
    }
    m.set_f32(loss, 0, (s / c as f64) as f32)?;
    m.set_i32(count, 0, c as i32)
}

fn cross_entropy_bwd(m: &mut Mem, l: &Launch, t: DType) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let logits = a.need(m, "logits")?;
    let labels = a.need(m, "labels")?;
    let rows = a.count("rows")?;
    let v = a.count32("v")?;
    let ignore = a.i64("ignore_index")?;
    let row_max = a.ptr(m, "row_max")?;
    let row_inv = a.ptr(m, "row_inv")?;
    let dloss = a.need(m, "dloss")?;
    let count = a.need(m, "count")?;
    let dlogits = a.need(m, "dlogits")?;
    a.end()?;
    let st = t.size_bytes();
    let big = (rows * v * st) as u64;
    check_uses(
        m,
        &[
            use_("logits", Some(logits), big, st, Io::R),
            use_("labels", Some(labels), rows as u64 * 8, 8, Io::R),
            use_("row_max", row_max, rows as u64 * 4, 4, Io::R),
            use_("row_inv", row_inv, rows as u64 * 4, 4, Io::R),
            use_("dloss", Some(dloss), 4, 4, Io::R),
            use_("count", Some(count), 4, 4, Io::R),
            use_("dlogits", Some(dlogits), big, st, Io::W),
        ],
        &[("dlogits", "logits")],
    )?;
    let scale = m.f32_at(dloss, 0)? / m.i32_at(count, 0)? as f32;
    for r in 0..rows {
        let ri = r as i64;
        let at = ri * v as i64;
        let label = m.i64_at(labels, ri)?;
        if label == ignore || label < 0 || label >= v as i64 {
            let fill = if label == ignore { 0.0 } else { f32::NAN };
            m.set_fv(dlogits, at, t, &vec![fill; v])?;
            continue;
        }
        let xs = m.fv(logits, at, v, t)?;
        let (mx, inv) = match (row_max, row_inv) {
            (Some(pm), Some(pi)) => (m.f32_at(pm, ri)?, m.f32_at(pi, ri)?),
            _ => {
                let (mx, s) = row_stats(&xs);
                (mx, (1.0 / s) as f32)
            }
        };
        let mut out: Vec<f32> = xs
            .iter()
            .map(|&x| math::exp(x - mx) * inv * scale)
            .collect();
        out[label as usize] -= scale;
        m.set_fv(dlogits, at, t, &out)?;
    }
    Ok(())
}

// ---- embedding.cu ----------------------------------------------------------------------------

fn embedding_fwd(m: &mut Mem, l: &Launch, t: DType) -> R<()> {
    let mut a = Args::new(l);
    let table = a.need(m, "table")?;
    let ids = a.need(m, "ids")?;
    let out = a.need(m, "out")?;
    let n = a.count("n")?;
    let v = a.count("v")?;
    let h = a.count32("h")?;
    let bad = a.ptr(m, "bad")?;
    a.end()?;
    let st = t.size_bytes();
    let row = (h * st) as u64;
    check_uses(
        m,
        &[
            use_("table", Some(table), v as u64 * row, st, Io::R),
            use_("ids", Some(ids), n as u64 * 8, 8, Io::R),
            use_("out", Some(out), n as u64 * row, st, Io::W),
            use_("bad", bad, 4, 4, Io::Rw),
        ],
        &[],
    )?;
    for i in 0..n as i64 {
        let id = m.i64_at(ids, i)?;
        let bytes = if id < 0 || id >= v as i64 {
            m.report_bad(bad, i)?;
            let mut z = Vec::new();
            for _ in 0..h {
                z.extend(match t {
                    DType::F32 => 0f32.to_le_bytes().to_vec(),
                    _ => vec![0, 0],
                });
            }
            z
        } else {
            m.bytes(table, id * row as i64, row)?.to_vec()
        };
        m.bytes_mut(out, i * row as i64, row)?
            .copy_from_slice(&bytes);
    }
    Ok(())
}

fn embedding_bwd_count(m: &mut Mem, l: &Launch) -> R<()> {
    let mut a = Args::new(l);
    let ids = a.need(m, "ids")?;
    let n = a.count("n")?;
    let v = a.count("v")?;
    let counts = a.need(m, "counts")?;
    let bad = a.ptr(m, "bad")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("ids", Some(ids), n as u64 * 8, 8, Io::R),
            use_("counts", Some(counts), v as u64 * 4, 4, Io::Rw),
            use_("bad", bad, 4, 4, Io::Rw),
        ],
        &[],
    )?;
    for i in 0..n as i64 {
        let id = m.i64_at(ids, i)?;
        if id < 0 || id >= v as i64 {
            m.report_bad(bad, i)?;
        } else {
            let c = m.i32_at(counts, id)?;
            m.set_i32(counts, id, c.wrapping_add(1))?;
        }
    }
    Ok(())
}

fn embedding_bwd_scan(m: &mut Mem, l: &Launch) -> R<()> {
    row_block(l)?;
    one_block(l)?;
    let mut a = Args::new(l);
    let counts = a.need(m, "counts")?;
    let v = a.count("v")?;
    let starts = a.need(m, "starts")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("counts", Some(counts), v as u64 * 4, 4, Io::R),
            use_("starts", Some(starts), (v as u64 + 1) * 4, 4, Io::W),
        ],
        &[],
    )?;
    let mut run = 0i32;
    for k in 0..v as i64 {
        let c = m.i32_at(counts, k)?;
        m.set_i32(starts, k, run)?;
        run = run.wrapping_add(c);
    }
    m.set_i32(starts, v as i64, run)
}

fn embedding_bwd_fill(m: &mut Mem, l: &Launch) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let ids = a.need(m, "ids")?;
    let n = a.count("n")?;
    let v = a.count("v")?;
    let starts = a.need(m, "starts")?;
    let positions = a.need(m, "positions")?;
    a.end()?;
    // Block b owns ids [256 b, 256 b + 256): not grid-stride.
    let covered = l.grid.0 as usize * 256;
    if covered < v {
        return Err(format!(
            "grid {:?} covers ids below {covered}, the vocabulary has {v}",
            l.grid
        ));
    }
    check_uses(
        m,
        &[
            use_("ids", Some(ids), n as u64 * 8, 8, Io::R),
            use_("starts", Some(starts), (v as u64 + 1) * 4, 4, Io::R),
            use_("positions", Some(positions), n as u64 * 4, 4, Io::W),
        ],
        &[],
    )?;
    let mut cursor: HashMap<i64, i64> = HashMap::new();
    for p in 0..n as i64 {
        let id = m.i64_at(ids, p)?;
        if id < 0 || id >= v as i64 {
            continue;
        }
        let slot = match cursor.get(&id) {
            Some(&c) => c,
            None => i64::from(m.i32_at(starts, id)?),
        };
        m.set_i32(positions, slot, p as i32)
            .map_err(|e| format!("`positions` for id {id}: {e}"))?;
        cursor.insert(id, slot + 1);
    }
    Ok(())
}

fn embedding_bwd_accumulate(m: &mut Mem, l: &Launch, t: DType, o: DType) -> R<()> {
    let mut a = Args::new(l);
    let dy = a.need(m, "dy")?;
    let positions = a.need(m, "positions")?;
    let starts = a.need(m, "starts")?;
    let v = a.count("v")?;
    let h = a.count32("h")?;
    let dtable = a.need(m, "dtable")?;
    a.end()?;
    let so = o.size_bytes();
    check_uses(
        m,
        &[
            use_("starts", Some(starts), (v as u64 + 1) * 4, 4, Io::R),
            use_("dtable", Some(dtable), (v * h * so) as u64, so, Io::W),
        ],
        &[],
    )?;
    for k in 0..v as i64 {
        let (s0, s1) = (m.i32_at(starts, k)?, m.i32_at(starts, k + 1)?);
        let mut acc = vec![0f64; h];
        for s in s0..s1 {
            let p = i64::from(m.i32_at(positions, i64::from(s))?);
            for (j, x) in m.fv(dy, p * h as i64, h, t)?.into_iter().enumerate() {
                acc[j] += f64::from(x);
            }
        }
        let row: Vec<f32> = acc.into_iter().map(|x| x as f32).collect();
        m.set_fv(dtable, k * h as i64, o, &row)?;
    }
    Ok(())
}

// ---- rope.cu ---------------------------------------------------------------------------------

fn rope_launch(m: &mut Mem, l: &Launch, dt: DType, backward: bool) -> R<()> {
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
fn rope_table(m: &mut Mem, l: &Launch) -> R<()> {
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

// ---- optimizer.cu, grad_norm.cu, loss_scale.cu -----------------------------------------------

/// The chunk table `{i32 tensor; i32 len; i64 start}` of a multi-tensor launch, checked to
/// cover every tensor exactly once (`numel` per tensor).
fn chunks(m: &Mem, p: Ptr, n_chunks: usize, numel: &[i64]) -> R<Vec<(usize, i64, i64)>> {
    let mut out = Vec::with_capacity(n_chunks);
    let mut covered: Vec<Vec<(i64, i64)>> = vec![Vec::new(); numel.len()];
    for c in 0..n_chunks as i64 {
        let b = m
            .bytes(p, c * 16, 16)
            .map_err(|e| format!("`chunks` row {c}: {e}"))?;
        let tensor = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let len = i32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let start = i64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
        let t = usize::try_from(tensor)
            .ok()
            .filter(|&t| t < numel.len())
            .ok_or_else(|| format!("chunk {c} names tensor {tensor} ({} tensors)", numel.len()))?;
        if len < 0 || start < 0 {
            return Err(format!("chunk {c}: start {start}, len {len}"));
        }
        let len = i64::from(len).min(numel[t] - start).max(0);
        covered[t].push((start, start + len));
        out.push((t, start, len));
    }
    for (t, spans) in covered.iter_mut().enumerate() {
        spans.sort_unstable();
        let mut at = 0;
        for &(s, e) in spans.iter() {
            if s != at {
                return Err(format!(
                    "the chunks of tensor {t} cover [{s}, {e}) after [.., {at}): elements are \
                     missed or covered twice"
                ));
            }
            at = e;
        }
        if at != numel[t] {
            return Err(format!(
                "the chunks of tensor {t} cover {at} of its {} elements",
                numel[t]
            ));
        }
    }
    Ok(out)
}

/// The rows of a multi-tensor launch's tensor table: every row of the table when the
/// pointer is a table of the program (at its start), else as many as the chunks name.
fn table_rows(
    m: &Mem,
    tensors: Ptr,
    row_bytes: usize,
    chunk_table: Ptr,
    n_chunks: usize,
) -> R<usize> {
    let table = 1 + m.slots..1 + m.slots + m.tables;
    if table.contains(&tensors.buf) && tensors.off == 0 {
        let len = m.bufs[tensors.buf].len();
        if !len.is_multiple_of(row_bytes) {
            return Err(format!(
                "the tensor table holds {len} bytes, not whole {row_bytes}-byte rows"
            ));
        }
        return Ok(len / row_bytes);
    }
    let mut n = 0usize;
    for c in 0..n_chunks as i64 {
        let t = m
            .i32_at(chunk_table, c * 4)
            .map_err(|e| format!("`chunks` row {c}: {e}"))?;
        n = n.max(usize::try_from(t).unwrap_or(0) + 1);
    }
    Ok(n)
}

/// A device F32 scalar.
fn scalar(m: &Mem, p: Ptr, what: &str) -> R<f32> {
    m.f32_at(p, 0).map_err(|e| format!("`{what}`: {e}"))
}

/// `adamw_<c>` and `sgd_<c>`.
fn multi_tensor_update(m: &mut Mem, l: &Launch, adamw: bool, copy_dt: DType) -> R<()> {
    let mut a = Args::new(l);
    let tensors = a.need(m, "tensors")?;
    let chunk_table = a.need(m, "chunks")?;
    let n_chunks = a.count32("n_chunks")?;
    let lr = a.need(m, "lr")?;
    let step = a.need(m, "step")?;
    let scale = a.need(m, "scale")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let hyper: Vec<f64> = if adamw {
        vec![
            a.f64("beta1")?,
            a.f64("beta2")?,
            a.f64("eps")?,
            a.f64("max_grad_norm")?,
        ]
    } else {
        vec![a.f64("momentum")?, a.f64("max_grad_norm")?]
    };
    a.end()?;
    let control = optimizer::Control {
        lr: scalar(m, lr, "lr")?,
        step: scalar(m, step, "step")?,
        scale: scalar(m, scale, "scale")?,
        grad_norm: scalar(m, grad_norm, "grad_norm")?,
    };
    // Rows: AdamWTensor (master, grad, m, v, copy, numel, wd: 56 bytes) or SgdTensor
    // (master, grad, buf, copy, numel, wd: 48 bytes).
    let bufs = if adamw { 4 } else { 3 };
    let row_bytes = (bufs + 3) * 8;
    let n_tensors = table_rows(m, tensors, row_bytes, chunk_table, n_chunks)?;
    struct Row {
        ptrs: Vec<Ptr>,
        copy: Option<Ptr>,
        numel: i64,
        wd: f64,
    }
    let mut rows = Vec::with_capacity(n_tensors);
    let mut uses = Vec::new();
    let names = if adamw {
        ["master", "grad", "m", "v"].as_slice()
    } else {
        ["master", "grad", "buf"].as_slice()
    };
    for t in 0..n_tensors as i64 {
        let base = t * row_bytes as i64 / 8;
        let mut ptrs = Vec::with_capacity(bufs);
        for (k, name) in names.iter().enumerate() {
            let addr = m
                .u64_at(tensors, base + k as i64)
                .map_err(|e| format!("`tensors` row {t}: {e}"))?;
            let p = m
                .decode(addr)
                .map_err(|e| format!("tensor {t} `{name}`: {e}"))?
                .ok_or_else(|| format!("tensor {t} `{name}` is null"))?;
            ptrs.push(p);
        }
        let copy = m.decode(m.u64_at(tensors, base + bufs as i64)?)?;
        let numel = m.i64_at(tensors, base + bufs as i64 + 1)?;
        let wd = m.f64_at(tensors, base + bufs as i64 + 2)?;
        if numel < 0 {
            return Err(format!("tensor {t}: numel {numel}"));
        }
        for (k, (name, &p)) in names.iter().zip(&ptrs).enumerate() {
            let io = if k == 1 { Io::R } else { Io::Rw };
            uses.push(use_(
                format!("tensor {t} {name}"),
                Some(p),
                numel as u64 * 4,
                4,
                io,
            ));
        }
        let cs = copy_dt.size_bytes();
        uses.push(use_(
            format!("tensor {t} copy"),
            copy,
            numel as u64 * cs as u64,
            cs,
            Io::W,
        ));
        rows.push(Row {
            ptrs,
            copy,
            numel,
            wd,
        });
    }
    for (what, p) in [
        ("lr", lr),
        ("step", step),
        ("scale", scale),
        ("grad_norm", grad_norm),
    ] {
        uses.push(use_(what, Some(p), 4, 4, Io::R));
    }
    check_uses(m, &uses, &[])?;
    let numel: Vec<i64> = rows.iter().map(|r| r.numel).collect();
    let chunk_list = chunks(m, chunk_table, n_chunks, &numel)?;
    if control.skip() {
        return Ok(()); // a skipped step writes nothing
    }
    for (t, start, len) in chunk_list {
        let row = &rows[t];
        let n = len as usize;
        let mut p = m.fv(row.ptrs[0], start, n, DType::F32)?;
        let g = m.fv(row.ptrs[1], start, n, DType::F32)?;
        let mut s1 = m.fv(row.ptrs[2], start, n, DType::F32)?;
        if adamw {
            let mut s2 = m.fv(row.ptrs[3], start, n, DType::F32)?;
            let h = optimizer::AdamW {
                beta1: hyper[0],
                beta2: hyper[1],
                eps: hyper[2],
                weight_decay: row.wd,
                max_grad_norm: hyper[3],
            };
            optimizer::adamw(&h, control, &mut p, &g, &mut s1, &mut s2);
            m.set_fv(row.ptrs[3], start, DType::F32, &s2)?;
        } else {
            let h = optimizer::Sgd {
                momentum: hyper[0],
                weight_decay: row.wd,
                max_grad_norm: hyper[1],
            };
            optimizer::sgd(&h, control, &mut p, &g, &mut s1);
        }
        m.set_fv(row.ptrs[0], start, DType::F32, &p)?;
        m.set_fv(row.ptrs[2], start, DType::F32, &s1)?;
        if let Some(c) = row.copy {
            m.set_fv(c, start, copy_dt, &p)?;
        }
    }
    Ok(())
}

fn grad_norm_partials(m: &mut Mem, l: &Launch) -> R<()> {
    row_block(l)?;
    let mut a = Args::new(l);
    let tensors = a.need(m, "tensors")?;
    let chunk_table = a.need(m, "chunks")?;
    let n_chunks = a.count32("n_chunks")?;
    let scale = a.need(m, "scale")?;
    let partials = a.need(m, "partials")?;
    a.end()?;
    let n_tensors = table_rows(m, tensors, 24, chunk_table, n_chunks)?;
    // NormTensor { const void* data; i64 numel; i32 dtype; i32 pad } (24 bytes).
    let mut rows = Vec::with_capacity(n_tensors);
    let mut uses = vec![
        use_("scale", Some(scale), 4, 4, Io::R),
        use_("partials", Some(partials), n_chunks as u64 * 8, 8, Io::W),
    ];
    for t in 0..n_tensors as i64 {
        let addr = m
            .u64_at(tensors, 3 * t)
            .map_err(|e| format!("`tensors` row {t}: {e}"))?;
        let p = m
            .decode(addr)?
            .ok_or_else(|| format!("tensor {t} is null"))?;
        let numel = m.i64_at(tensors, 3 * t + 1)?;
        let dtype = match m.i32_at(tensors, 6 * t + 4)? {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::BF16,
            other => return Err(format!("tensor {t}: dtype code {other} (0, 1 or 2)")),
        };
        if numel < 0 {
            return Err(format!("tensor {t}: numel {numel}"));
        }
        let s = dtype.size_bytes();
        uses.push(use_(
            format!("tensor {t}"),
            Some(p),
            numel as u64 * s as u64,
            s,
            Io::R,
        ));
        rows.push((p, numel, dtype));
    }
    check_uses(m, &uses, &[])?;
    let numel: Vec<i64> = rows.iter().map(|r| r.1).collect();
    let chunk_list = chunks(m, chunk_table, n_chunks, &numel)?;
    let inv = f64::from(1.0f32 / scalar(m, scale, "scale")?);
    for (c, (t, start, len)) in chunk_list.into_iter().enumerate() {
        let (p, _, dtype) = rows[t];
        let acc: f64 = m
            .fv(p, start, len as usize, dtype)?
            .into_iter()
            .map(|x| {
                let u = f64::from(x) * inv;
                u * u
            })
            .sum();
        m.set_f64(partials, c as i64, acc)?;
    }
    Ok(())
}

fn grad_norm_finalize(m: &mut Mem, l: &Launch) -> R<()> {
    row_block(l)?;
    one_block(l)?;
    let mut a = Args::new(l);
    let partials = a.need(m, "partials")?;
    let n_chunks = a.count32("n_chunks")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let found_inf = a.ptr(m, "found_inf")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("partials", Some(partials), n_chunks as u64 * 8, 8, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::W),
            use_("found_inf", found_inf, 4, 4, Io::W),
        ],
        &[],
    )?;
    let mut acc = 0f64;
    for c in 0..n_chunks as i64 {
        acc += m.f64_at(partials, c)?;
    }
    let norm = acc.sqrt() as f32;
    m.set_f32(grad_norm, 0, norm)?;
    if let Some(p) = found_inf {
        m.set_i32(p, 0, i32::from(!norm.is_finite()))?;
    }
    Ok(())
}

fn count_step(m: &mut Mem, l: &Launch) -> R<()> {
    let mut a = Args::new(l);
    let step_in = a.need(m, "step_in")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let step_out = a.need(m, "step_out")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("step_in", Some(step_in), 4, 4, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
            use_("step_out", Some(step_out), 4, 4, Io::W),
        ],
        &[("step_out", "step_in")],
    )?;
    let s = optimizer::count_step(
        scalar(m, step_in, "step_in")?,
        scalar(m, grad_norm, "grad_norm")?,
    );
    m.set_f32(step_out, 0, s)
}

fn loss_scale_update(m: &mut Mem, l: &Launch) -> R<()> {
    let mut a = Args::new(l);
    let scale_in = a.need(m, "scale_in")?;
    let counters_in = a.need(m, "counters_in")?;
    let grad_norm = a.need(m, "grad_norm")?;
    let scale_out = a.need(m, "scale_out")?;
    let counters_out = a.need(m, "counters_out")?;
    let growth_factor = a.f64("growth_factor")?;
    let backoff_factor = a.f64("backoff_factor")?;
    let growth_interval = a.i64("growth_interval")?;
    let hysteresis = a.i64("hysteresis")?;
    let max_scale = a.f64("max_scale")?;
    a.end()?;
    check_uses(
        m,
        &[
            use_("scale_in", Some(scale_in), 4, 4, Io::R),
            use_("counters_in", Some(counters_in), 8, 4, Io::R),
            use_("grad_norm", Some(grad_norm), 4, 4, Io::R),
            use_("scale_out", Some(scale_out), 4, 4, Io::W),
            use_("counters_out", Some(counters_out), 8, 4, Io::W),
        ],
        &[("scale_out", "scale_in"), ("counters_out", "counters_in")],
    )?;
    let h = optimizer::LossScaler {
        growth_factor,
        backoff_factor,
        growth_interval: usize::try_from(growth_interval)
            .map_err(|_| format!("growth_interval {growth_interval}"))?,
        hysteresis: usize::try_from(hysteresis).map_err(|_| format!("hysteresis {hysteresis}"))?,
        max_scale,
    };
    let counters = [m.f32_at(counters_in, 0)?, m.f32_at(counters_in, 1)?];
    let (s, c) = optimizer::loss_scale_update(
        &h,
        scalar(m, scale_in, "scale_in")?,
        counters,
        scalar(m, grad_norm, "grad_norm")?,
    );
    m.set_f32(scale_out, 0, s)?;
    m.set_f32(counters_out, 0, c[0])?;
    m.set_f32(counters_out, 1, c[1])
}

// ---- elementwise.cu --------------------------------------------------------------------------

fn unary_kernel(m: &mut Mem, l: &Launch, op: UnaryOp, t: DType, backward: bool) -> R<()> {
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

fn binary_kernel(m: &mut Mem, l: &Launch, op: BinaryOp, t: DType) -> R<()> {
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

// ---- cuBLAS ----------------------------------------------------------------------------------

/// `C[i] = op(A[i]) · op(B[i])` in column-major terms: F32 accumulation by fused
/// multiply-adds in `k` order (cuBLAS's SGEMM accumulates with FFMA; the CPU executor's `gemm`
/// crate with FMA in the same order, so small products match it bit for bit), operands
/// rounded to TF32 under [`GemmCompute::Tf32`], the result rounded to `c_dtype` (beta = 0).
fn gemm(m: &mut Mem, g: &Gemm) -> R<()> {
    let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    if g.a_dtype != g.b_dtype || !float(g.a_dtype) || !float(g.c_dtype) {
        return Err(format!(
            "cuBLAS has no {} x {} -> {} product",
            g.a_dtype.name(),
            g.b_dtype.name(),
            g.c_dtype.name()
        ));
    }
    if g.c_dtype != g.a_dtype && g.c_dtype != DType::F32 {
        return Err(format!(
            "a {} product cannot write {}",
            g.a_dtype.name(),
            g.c_dtype.name()
        ));
    }
    let dims = [g.m, g.n, g.k, g.batch];
    if dims.iter().any(|&d| d < 0) {
        return Err(format!("negative sizes m, n, k, batch = {dims:?}"));
    }
    let (mm, nn, kk, batch) = (g.m as i64, g.n as i64, g.k as i64, g.batch as i64);
    // cuBLAS's CUBLAS_STATUS_INVALID_VALUE conditions on the leading dimensions.
    let (a_rows, a_cols) = if g.transa { (kk, mm) } else { (mm, kk) };
    let (b_rows, b_cols) = if g.transb { (nn, kk) } else { (kk, nn) };
    if g.lda < a_rows.max(1) || g.ldb < b_rows.max(1) || g.ldc < mm.max(1) {
        return Err(format!(
            "leading dimensions lda {} ldb {} ldc {} below the rows {a_rows}, {b_rows}, {mm} \
             (cuBLAS refuses the call)",
            g.lda, g.ldb, g.ldc
        ));
    }
    if g.stride_a < 0 || g.stride_b < 0 || g.stride_c < 0 {
        return Err("negative batch strides".into());
    }
    if batch > 1 && g.stride_c < g.ldc * nn && mm * nn > 0 {
        return Err(format!(
            "stride_c {} < ldc * n = {}: the batch entries' outputs overlap",
            g.stride_c,
            g.ldc * nn
        ));
    }
    if mm * nn * batch == 0 {
        return Ok(());
    }
    let (pa, pb, pc) = (m.place(g.a), m.place(g.b), m.place(g.c));
    let extent = |rows: i64, cols: i64, ld: i64, stride: i64| -> u64 {
        if rows * cols == 0 {
            0
        } else {
            ((batch - 1) * stride + (cols - 1) * ld + rows) as u64
        }
    };
    let (ea, ec) = (g.a_dtype.size_bytes(), g.c_dtype.size_bytes());
    check_uses(
        m,
        &[
            use_(
                "A",
                Some(pa),
                extent(a_rows, a_cols, g.lda, g.stride_a) * ea as u64,
                ea,
                Io::R,
            ),
            use_(
                "B",
                Some(pb),
                extent(b_rows, b_cols, g.ldb, g.stride_b) * ea as u64,
                ea,
                Io::R,
            ),
            use_(
                "C",
                Some(pc),
                extent(mm, nn, g.ldc, g.stride_c) * ec as u64,
                ec,
                Io::W,
            ),
        ],
        &[],
    )?;
    let tf32 = g.compute == GemmCompute::Tf32;
    let load = |m: &Mem, p: Ptr, i: i64, d: DType| -> R<f32> {
        let v = m.f(p, i, d)?;
        Ok(if tf32 { round_tf32(v) } else { v })
    };
    let (mu, nu, ku) = (mm as usize, nn as usize, kk as usize);
    for b in 0..batch {
        let (ao, bo, co) = (b * g.stride_a, b * g.stride_b, b * g.stride_c);
        // op(A) row-major [m][k], op(B) column-major [n][k].
        let mut opa = vec![0f32; mu * ku];
        for i in 0..mm {
            for p in 0..kk {
                let at = if g.transa {
                    p + i * g.lda
                } else {
                    i + p * g.lda
                };
                opa[i as usize * ku + p as usize] = load(m, pa, ao + at, g.a_dtype)?;
            }
        }
        let mut opb = vec![0f32; nu * ku];
        for j in 0..nn {
            for p in 0..kk {
                let at = if g.transb {
                    j + p * g.ldb
                } else {
                    p + j * g.ldb
                };
                opb[j as usize * ku + p as usize] = load(m, pb, bo + at, g.b_dtype)?;
            }
        }
        for j in 0..nu {
            for i in 0..mu {
                let mut s = 0f32;
                for p in 0..ku {
                    s = opa[i * ku + p].mul_add(opb[j * ku + p], s);
                }
                m.set_f(pc, co + i as i64 + j as i64 * g.ldc, g.c_dtype, s)?;
            }
        }
    }
    Ok(())
}

// ---- generated pointwise kernels -------------------------------------------------------------

/// An expression of a generated kernel's body.
#[derive(Clone, Debug)]
enum Expr {
    X(usize),
    T(usize),
    Const(f32),
    Bin(Box<Expr>, BinaryOp, Box<Expr>),
    F(UnaryOp, Box<Expr>),
    Df(UnaryOp, Box<Expr>),
}

/// How an input element is found from the output's flat index `i`.
#[derive(Clone, Debug, PartialEq)]
enum Index {
    Full,
    Scalar,
    /// `sum ((i / s) % d) * t`.
    Terms(Vec<(i64, i64, i64)>),
}

impl Index {
    fn at(&self, i: i64) -> i64 {
        match self {
            Index::Full => i,
            Index::Scalar => 0,
            Index::Terms(ts) => ts.iter().map(|&(s, d, t)| ((i / s) % d) * t).sum(),
        }
    }
}

/// A generated pointwise kernel, parsed from its source.
struct Fused {
    inputs: Vec<(DType, Index)>,
    outputs: Vec<DType>,
    /// `t_j = round_to<dtype>(expr)`, in order.
    body: Vec<(DType, Expr)>,
    /// `*r_o = t_j`.
    results: Vec<usize>,
}

fn cuda_dtype(s: &str) -> R<DType> {
    match s {
        "float" => Ok(DType::F32),
        "__half" => Ok(DType::F16),
        "__nv_bfloat16" => Ok(DType::BF16),
        other => Err(format!("unknown CUDA type `{other}`")),
    }
}

fn functor(s: &str) -> R<UnaryOp> {
    Ok(match s {
        "GeluTanh" => UnaryOp::GeluTanh,
        "GeluErf" => UnaryOp::GeluErf,
        "Silu" => UnaryOp::Silu,
        "TanhFn" => UnaryOp::Tanh,
        "ExpFn" => UnaryOp::Exp,
        "RsqrtFn" => UnaryOp::Rsqrt,
        "NegFn" => UnaryOp::Neg,
        other => return Err(format!("unknown functor `{other}`")),
    })
}

/// A tiny recursive-descent parser of the body's expressions.
struct ExprParser<'s> {
    s: &'s str,
    at: usize,
}

impl ExprParser<'_> {
    fn rest(&self) -> &str {
        &self.s[self.at..]
    }

    fn skip_ws(&mut self) {
        while self.rest().starts_with(' ') {
            self.at += 1;
        }
    }

    fn eat(&mut self, tok: &str) -> bool {
        self.skip_ws();
        if self.rest().starts_with(tok) {
            self.at += tok.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, tok: &str) -> R<()> {
        if self.eat(tok) {
            Ok(())
        } else {
            Err(format!(
                "expected `{tok}` at `{}` in `{}`",
                self.rest(),
                self.s
            ))
        }
    }

    fn ident(&mut self) -> &str {
        self.skip_ws();
        let start = self.at;
        while self
            .rest()
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            self.at += 1;
        }
        &self.s[start..self.at]
    }

    /// expr := term (('+' | '-') term)*
    fn expr(&mut self) -> R<Expr> {
        let mut e = self.term()?;
        loop {
            let op = if self.eat("+") {
                BinaryOp::Add
            } else if self.eat("-") {
                BinaryOp::Sub
            } else {
                return Ok(e);
            };
            e = Expr::Bin(Box::new(e), op, Box::new(self.term()?));
        }
    }

    /// term := atom (('*' | '/') atom)*
    fn term(&mut self) -> R<Expr> {
        let mut e = self.atom()?;
        loop {
            let op = if self.eat("*") {
                BinaryOp::Mul
            } else if self.eat("/") {
                BinaryOp::Div
            } else {
                return Ok(e);
            };
            e = Expr::Bin(Box::new(e), op, Box::new(self.atom()?));
        }
    }

    fn atom(&mut self) -> R<Expr> {
        if self.eat("(") {
            let e = self.expr()?;
            self.expect(")")?;
            return Ok(e);
        }
        if self.eat("0.0f") {
            return Ok(Expr::Const(0.0));
        }
        let id = self.ident().to_string();
        if id == "__int_as_float" {
            self.expect("(")?;
            self.expect("0x")?;
            let hex = self.ident().to_string();
            self.expect(")")?;
            let bits = u32::from_str_radix(&hex, 16).map_err(|_| format!("bad literal 0x{hex}"))?;
            return Ok(Expr::Const(f32::from_bits(bits)));
        }
        if let Some(k) = id.strip_prefix('x').and_then(|k| k.parse().ok()) {
            return Ok(Expr::X(k));
        }
        if let Some(j) = id.strip_prefix('t').and_then(|j| j.parse().ok()) {
            return Ok(Expr::T(j));
        }
        if self.eat("::") {
            let op = functor(&id)?;
            let which = self.ident().to_string();
            self.expect("(")?;
            let arg = Box::new(self.expr()?);
            self.expect(")")?;
            return match which.as_str() {
                "f" => Ok(Expr::F(op, arg)),
                "df" => Ok(Expr::Df(op, arg)),
                other => Err(format!("unknown functor method `{other}`")),
            };
        }
        Err(format!("unexpected `{}` in `{}`", self.rest(), self.s))
    }
}

fn parse_expr(s: &str) -> R<Expr> {
    let mut p = ExprParser { s, at: 0 };
    let e = p.expr()?;
    p.skip_ws();
    if !p.rest().is_empty() {
        return Err(format!("trailing `{}` in `{s}`", p.rest()));
    }
    Ok(e)
}

/// `((i / 37LL) % 5LL) * 1LL + ...`, `i` or `0`.
fn parse_index(s: &str) -> R<Index> {
    let s = s.trim();
    if s == "i" {
        return Ok(Index::Full);
    }
    if s == "0" {
        return Ok(Index::Scalar);
    }
    let num = |x: &str| -> R<i64> {
        x.trim()
            .trim_end_matches("LL")
            .parse()
            .map_err(|_| format!("bad number `{x}` in index `{s}`"))
    };
    let mut terms = Vec::new();
    for term in s.split(" + ") {
        // ((i / S) % D) * T
        let t = term
            .strip_prefix("((i / ")
            .ok_or_else(|| format!("bad index term `{term}`"))?;
        let (sdiv, rest) = t
            .split_once(") % ")
            .ok_or_else(|| format!("bad index term `{term}`"))?;
        let (d, mul) = rest
            .split_once(") * ")
            .ok_or_else(|| format!("bad index term `{term}`"))?;
        let (sdiv, d, mul) = (num(sdiv)?, num(d)?, num(mul)?);
        if sdiv <= 0 || d <= 0 {
            return Err(format!("bad index term `{term}`"));
        }
        terms.push((sdiv, d, mul));
    }
    Ok(Index::Terms(terms))
}

impl Fused {
    /// The kernel `name` of a generated module (which may hold several).
    fn parse(src: &str, name: &str) -> R<Fused> {
        // The entry point's parameters: inputs, outputs, `i64 n`.
        let head = format!("extern \"C\" __global__ void {name}(");
        let sig = src
            .lines()
            .find(|l| l.starts_with(&head))
            .ok_or_else(|| format!("no entry point `{name}`"))?;
        let params = sig[head.len()..]
            .rsplit_once(')')
            .ok_or("bad entry point parameters")?
            .0;
        let mut inputs_dt = Vec::new();
        let mut outputs = Vec::new();
        for p in params.split(", ") {
            let words: Vec<&str> = p.split_whitespace().collect();
            match words.as_slice() {
                ["const", ty, "__restrict__", arg] if arg.starts_with("in") => {
                    inputs_dt.push(cuda_dtype(ty.trim_end_matches('*'))?)
                }
                [ty, "__restrict__", arg] if arg.starts_with("out") => {
                    outputs.push(cuda_dtype(ty.trim_end_matches('*'))?)
                }
                ["i64", "n"] => {}
                _ => return Err(format!("unexpected parameter `{p}`")),
            }
        }
        // The body.
        let head = format!("__device__ __forceinline__ void {name}_body(");
        let mut lines = src.lines().skip_while(|l| !l.starts_with(&head));
        lines.next().ok_or("no body function")?;
        let mut body = Vec::new();
        let mut results = vec![usize::MAX; outputs.len()];
        for line in lines {
            let line = line.trim();
            if line == "}" {
                break;
            }
            if let Some(rest) = line.strip_prefix("const float t") {
                let code = rest.split("  //").next().unwrap_or(rest).trim();
                let (j, rest) = code
                    .split_once(" = round_to<")
                    .ok_or_else(|| format!("bad body line `{line}`"))?;
                let (ty, expr) = rest
                    .split_once(">(")
                    .ok_or_else(|| format!("bad body line `{line}`"))?;
                let expr = expr
                    .strip_suffix(");")
                    .ok_or_else(|| format!("bad body line `{line}`"))?;
                let j: usize = j.parse().map_err(|_| format!("bad body line `{line}`"))?;
                if j != body.len() {
                    return Err(format!("body line t{j} out of order"));
                }
                body.push((cuda_dtype(ty)?, parse_expr(expr)?));
            } else if let Some(rest) = line.strip_prefix("*r") {
                let (o, t) = rest
                    .strip_suffix(';')
                    .and_then(|r| r.split_once(" = t"))
                    .ok_or_else(|| format!("bad result line `{line}`"))?;
                let o: usize = o.parse().map_err(|_| format!("bad result line `{line}`"))?;
                let t: usize = t.parse().map_err(|_| format!("bad result line `{line}`"))?;
                *results
                    .get_mut(o)
                    .ok_or_else(|| format!("result r{o} of {} outputs", outputs.len()))? = t;
            } else {
                return Err(format!("unexpected body line `{line}`"));
            }
        }
        if results.iter().any(|&t| t >= body.len()) {
            return Err("a result is not a body value".into());
        }
        // The scalar loop's call: each input's index expression.
        let call = format!("{name}_body(to_f32(in");
        let line = src.lines().map(str::trim).find(|l| l.starts_with(&call));
        let mut inputs = Vec::with_capacity(inputs_dt.len());
        for (k, &d) in inputs_dt.iter().enumerate() {
            let line = line.ok_or("no scalar loop")?;
            let open = format!("to_f32(in{k}[");
            let start = line
                .find(&open)
                .ok_or_else(|| format!("input {k} is not read in the scalar loop"))?
                + open.len();
            let end = line[start..]
                .find(']')
                .ok_or_else(|| format!("input {k}'s index is not closed"))?;
            inputs.push((d, parse_index(&line[start..start + end])?));
        }
        Ok(Fused {
            inputs,
            outputs,
            body,
            results,
        })
    }

    fn run(&self, m: &mut Mem, l: &Launch) -> R<()> {
        let mut a = Args::new(l);
        let mut ins = Vec::with_capacity(self.inputs.len());
        for k in 0..self.inputs.len() {
            ins.push(a.need(m, &format!("in{k}"))?);
        }
        let mut outs = Vec::with_capacity(self.outputs.len());
        for o in 0..self.outputs.len() {
            outs.push(a.need(m, &format!("out{o}"))?);
        }
        let n = a.count("n")?;
        a.end()?;
        let mut uses = Vec::new();
        let mut in_place = Vec::new();
        let names_in: Vec<String> = (0..ins.len()).map(|k| format!("in{k}")).collect();
        let names_out: Vec<String> = (0..outs.len()).map(|o| format!("out{o}")).collect();
        for (k, (&p, (d, index))) in ins.iter().zip(&self.inputs).enumerate() {
            let elems = match index {
                _ if n == 0 => 0,
                Index::Full => n as i64,
                Index::Scalar => 1,
                Index::Terms(_) => (0..n as i64).map(|i| index.at(i)).max().unwrap_or(0) + 1,
            };
            let s = d.size_bytes();
            uses.push(use_(
                names_in[k].clone(),
                Some(p),
                elems as u64 * s as u64,
                s,
                Io::R,
            ));
        }
        for (o, (&p, d)) in outs.iter().zip(&self.outputs).enumerate() {
            let s = d.size_bytes();
            uses.push(use_(
                names_out[o].clone(),
                Some(p),
                (n * s) as u64,
                s,
                Io::W,
            ));
            for (k, (_, index)) in self.inputs.iter().enumerate() {
                if *index == Index::Full {
                    in_place.push((names_out[o].as_str(), names_in[k].as_str()));
                }
            }
        }
        check_uses(m, &uses, &in_place)?;
        let mut xs = Vec::with_capacity(ins.len());
        for (&p, (d, index)) in ins.iter().zip(&self.inputs) {
            xs.push(match index {
                Index::Full => m.fv(p, 0, n, *d)?,
                _ => (0..n as i64)
                    .map(|i| m.f(p, index.at(i), *d))
                    .collect::<R<Vec<f32>>>()?,
            });
        }
        let mut ts: Vec<Vec<f32>> = Vec::with_capacity(self.body.len());
        for (d, e) in &self.body {
            let mut v = eval(e, &xs, &ts, n)?;
            v.iter_mut().for_each(|x| *x = round_to(*d, *x));
            ts.push(v);
        }
        for ((&p, d), &t) in outs.iter().zip(&self.outputs).zip(&self.results) {
            m.set_fv(p, 0, *d, &ts[t])?;
        }
        Ok(())
    }
}

fn eval(e: &Expr, xs: &[Vec<f32>], ts: &[Vec<f32>], n: usize) -> R<Vec<f32>> {
    Ok(match e {
        Expr::X(k) => xs
            .get(*k)
            .ok_or_else(|| format!("x{k} is no input"))?
            .clone(),
        Expr::T(j) => ts
            .get(*j)
            .ok_or_else(|| format!("t{j} is not yet made"))?
            .clone(),
        Expr::Const(c) => vec![*c; n],
        Expr::Bin(a, op, b) => {
            let (a, b) = (eval(a, xs, ts, n)?, eval(b, xs, ts, n)?);
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| match op {
                    BinaryOp::Add => x + y,
                    BinaryOp::Sub => x - y,
                    BinaryOp::Mul => x * y,
                    BinaryOp::Div => x / y,
                })
                .collect()
        }
        Expr::F(op, a) => {
            let mut v = eval(a, xs, ts, n)?;
            elementwise::unary(*op, &mut v);
            v
        }
        Expr::Df(op, a) => {
            // f'(x) alone: the CPU twin's `dy *= f'(x)` with dy = 1 (exact).
            let x = eval(a, xs, ts, n)?;
            let mut d = vec![1.0f32; n];
            elementwise::unary_grad(*op, &x, &mut d);
            d
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::program::{Module, Run, Slot};

    fn program(commands: Vec<Command>, slot_bytes: &[u64]) -> Program {
        Program {
            slots: slot_bytes
                .iter()
                .enumerate()
                .map(|(i, &bytes)| Slot {
                    name: format!("s{i}"),
                    bytes,
                    kind: SlotKind::Internal,
                })
                .collect(),
            arena_bytes: 256,
            runs: vec![Run {
                name: "graph".into(),
                commands,
                ..Run::default()
            }],
            ..Program::default()
        }
    }

    #[test]
    fn out_of_bounds_and_overlaps_are_errors_naming_the_command() {
        let slot = |slot, offset| Place::Slot { slot, offset };
        let p = program(
            vec![Command::Copy {
                dst: slot(1, 0),
                src: slot(0, 8),
                bytes: 16,
            }],
            &[16, 16],
        );
        let e = Emulator::new(&p).run(0).unwrap_err();
        assert!(
            e.contains("command 0 (copy") && e.contains("out of bounds"),
            "{e}"
        );
        let p = program(
            vec![Command::Copy {
                dst: slot(0, 4),
                src: slot(0, 0),
                bytes: 8,
            }],
            &[16],
        );
        let e = Emulator::new(&p).run(0).unwrap_err();
        assert!(e.contains("overlaps"), "{e}");
    }

    #[test]
    fn launches_check_arguments_and_poison_fills_the_arena() {
        let file = castor_kernels::file("layout.cu").unwrap();
        let fill = |args| {
            Command::Launch(Launch {
                node: "z".into(),
                module: 0,
                entry: "fill_b4".into(),
                grid: (1, 1, 1),
                block: (256, 1, 1),
                shared_bytes: 0,
                args,
            })
        };
        let mut p = program(
            vec![
                fill(vec![
                    Arg::Ptr(Place::Slot { slot: 0, offset: 0 }),
                    Arg::I64(2),
                    Arg::U32(7),
                ]),
                Command::Copy {
                    dst: Place::Slot { slot: 0, offset: 8 },
                    src: Place::Arena { offset: 0 },
                    bytes: 4,
                },
            ],
            &[12],
        );
        p.modules.push(Module {
            name: file.name.into(),
            source: file.source.into(),
        });
        let mut emu = Emulator::new(&p);
        emu.run(0).unwrap();
        let b = emu.read_slot(0).unwrap();
        assert_eq!(&b[..8], &[7, 0, 0, 0, 7, 0, 0, 0]);
        assert_eq!(&b[8..], &[0; 4]);
        // Poisoned, the arena reads as unwritten: the copy is an error.
        emu.set_poison(true);
        let e = emu.run(0).unwrap_err();
        assert!(
            e.contains("command 1 (copy") && e.contains("no earlier command"),
            "{e}"
        );
        p.runs[0].commands = vec![fill(vec![
            Arg::Ptr(Place::Slot { slot: 0, offset: 0 }),
            Arg::I32(2),
            Arg::U32(7),
        ])];
        let e = Emulator::new(&p).run(0).unwrap_err();
        assert!(e.contains("`n` must be an i64"), "{e}");
    }

    #[test]
    fn generated_kernels_parse() {
        let e = parse_expr("x1 * GeluTanh::df(x0)").unwrap();
        assert!(matches!(e, Expr::Bin(_, BinaryOp::Mul, _)));
        let e = parse_expr("t0 * __int_as_float(0x3f000000)").unwrap();
        match e {
            Expr::Bin(_, _, c) => assert!(matches!(*c, Expr::Const(x) if x == 0.5)),
            _ => panic!("{e:?}"),
        }
        let i = parse_index("((i / 37LL) % 5LL) * 1LL + ((i / 1LL) % 37LL) * 5LL").unwrap();
        assert_eq!(i.at(38), 1 + 5);
    }
}
