//! Device memory: the buffers (arena, slots, tables), fake device addresses and their
//! resolution, bounds-checked typed loads and stores, poison-mode tracking of written arena
//! bytes, and the check that a command's buffers lie in bounds and do not overlap.

use super::R;
use crate::cuda::program::Place;
use castor_ir::DType;
use half::{bf16, f16};
use std::ops::Range;

/// Bits of a fake device address that hold the byte offset.
const ADDR_SHIFT: u32 = 48;
const ADDR_MASK: u64 = (1 << ADDR_SHIFT) - 1;

/// A resolved device pointer: a buffer and a byte offset into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ptr {
    pub(crate) buf: usize,
    pub(crate) off: u64,
}

impl Ptr {
    pub(crate) fn addr(self) -> u64 {
        if self.off > ADDR_MASK {
            // An offset no buffer has (an unresolved arena tag): an address that resolves to
            // no buffer, reported where it is used.
            return u64::MAX;
        }
        ((self.buf as u64 + 1) << ADDR_SHIFT) | self.off
    }
}

/// The device memory: the arena, the slots, the tables.
pub(crate) struct Mem {
    pub(crate) bufs: Vec<Vec<u8>>,
    pub(crate) names: Vec<String>,
    pub(crate) slots: usize,
    pub(crate) tables: usize,
    /// Poison mode: which arena bytes the current run has written.
    pub(crate) written: Option<Vec<bool>>,
}

impl Mem {
    pub(crate) fn place(&self, p: Place) -> Ptr {
        match p {
            Place::Arena { offset } => Ptr {
                buf: 0,
                off: offset,
            },
            Place::Slot { slot, offset } => Ptr {
                buf: 1 + slot,
                off: offset,
            },
            // No buffer has this index: any access through it is refused as out of range.
            Place::Buffer { .. } => Ptr {
                buf: usize::MAX,
                off: 0,
            },
        }
    }

    pub(crate) fn table(&self, t: usize) -> R<Ptr> {
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
    pub(crate) fn decode(&self, addr: u64) -> R<Option<Ptr>> {
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

    pub(crate) fn name(&self, buf: usize) -> &str {
        self.names.get(buf).map_or("no buffer", String::as_str)
    }

    pub(crate) fn describe(&self, p: Ptr) -> String {
        format!("{}+{}", self.name(p.buf), p.off)
    }

    /// The bytes `byte..byte + len` from `p`, checked.
    pub(crate) fn range(&self, p: Ptr, byte: i64, len: u64) -> R<Range<usize>> {
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
    pub(crate) fn bytes(&self, p: Ptr, byte: i64, len: u64) -> R<&[u8]> {
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
    pub(crate) fn bytes_mut(&mut self, p: Ptr, byte: i64, len: u64) -> R<&mut [u8]> {
        let r = self.range(p, byte, len)?;
        if let (0, Some(written)) = (p.buf, &mut self.written) {
            written[r.clone()].fill(true);
        }
        Ok(&mut self.bufs[p.buf][r])
    }

    /// Records that a command wrote `bytes` bytes at `p` (poison mode).
    pub(crate) fn mark_written(&mut self, p: Ptr, bytes: u64) {
        if let (0, Some(written)) = (p.buf, &mut self.written) {
            let start = p.off as usize;
            let end = (start + bytes as usize).min(written.len());
            written[start.min(end)..end].fill(true);
        }
    }

    /// Poison mode: the arena filled with `0xFF` and marked unwritten.
    pub(crate) fn poison(&mut self) {
        self.bufs[0].fill(0xff);
        self.written = Some(vec![false; self.bufs[0].len()]);
    }

    pub(crate) fn get<const N: usize>(&self, p: Ptr, i: i64) -> R<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(p, i * N as i64, N as u64)?);
        Ok(out)
    }

    pub(crate) fn put<const N: usize>(&mut self, p: Ptr, i: i64, v: [u8; N]) -> R<()> {
        self.bytes_mut(p, i * N as i64, N as u64)?
            .copy_from_slice(&v);
        Ok(())
    }

    pub(crate) fn i64_at(&self, p: Ptr, i: i64) -> R<i64> {
        Ok(i64::from_le_bytes(self.get(p, i)?))
    }
    pub(crate) fn i32_at(&self, p: Ptr, i: i64) -> R<i32> {
        Ok(i32::from_le_bytes(self.get(p, i)?))
    }
    pub(crate) fn u64_at(&self, p: Ptr, i: i64) -> R<u64> {
        Ok(u64::from_le_bytes(self.get(p, i)?))
    }

    /// Element `i` of a float buffer of dtype `dt`, widened to F32.
    pub(crate) fn f(&self, p: Ptr, i: i64, dt: DType) -> R<f32> {
        Ok(match dt {
            DType::F32 => f32::from_le_bytes(self.get(p, i)?),
            DType::F16 => f16::from_bits(u16::from_le_bytes(self.get(p, i)?)).to_f32(),
            DType::BF16 => bf16::from_bits(u16::from_le_bytes(self.get(p, i)?)).to_f32(),
            DType::F8E4M3 | DType::F8E5M2 => {
                let [byte] = self.get(p, i)?;
                castor_ir::fp8::Fp8Format::of(dt).map_or(f32::NAN, |f| f.decode(byte))
            }
            other => return Err(format!("a float load from a {} buffer", other.name())),
        })
    }

    /// Stores `v` rounded to `dt` (nearest, ties to even).
    pub(crate) fn set_f(&mut self, p: Ptr, i: i64, dt: DType, v: f32) -> R<()> {
        match dt {
            DType::F32 => self.put(p, i, v.to_le_bytes()),
            DType::F16 => self.put(p, i, f16::from_f32(v).to_bits().to_le_bytes()),
            DType::BF16 => self.put(p, i, bf16::from_f32(v).to_bits().to_le_bytes()),
            other => Err(format!("a float store to a {} buffer", other.name())),
        }
    }
}

/// How a launch or command uses a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Io {
    R,
    W,
    Rw,
}

/// A buffer a command touches: `bytes` bytes from `p`, elements of `elem` bytes, reached by
/// a kernel through the pointer `at` (`p` itself, or before it when the kernel indexes from a
/// base, as a strided copy does).
pub(crate) struct Use {
    pub(crate) what: String,
    pub(crate) p: Ptr,
    pub(crate) bytes: u64,
    pub(crate) elem: usize,
    pub(crate) io: Io,
    pub(crate) at: Ptr,
    /// Rows inside the span: (bytes of a row, bytes from one row's start to the next's). The
    /// kernel reads or writes the rows only; the padding between them is copied with the span
    /// but neither needs to be written before nor counts as written after.
    pub(crate) rows: Option<(u64, u64)>,
    /// The touched byte ranges listed one by one (offsets from `p`, lengths; sorted, disjoint),
    /// for a kernel that reads or writes through strides (an attention head in place).
    pub(crate) ranges: Option<Vec<(u64, u64)>>,
}

impl Use {
    /// The byte ranges (offsets from `p`, lengths) the kernel touches.
    pub(crate) fn touched(&self) -> Vec<(u64, u64)> {
        if let Some(ranges) = &self.ranges {
            return ranges.clone();
        }
        match self.rows {
            Some((row, stride)) if stride > row && row > 0 => (0..self.bytes)
                .step_by(stride as usize)
                .map(|start| (start, row.min(self.bytes - start)))
                .collect(),
            _ => vec![(0, self.bytes)],
        }
    }
}

pub(crate) fn use_(
    what: impl Into<String>,
    p: Option<Ptr>,
    bytes: u64,
    elem: usize,
    io: Io,
) -> Option<Use> {
    p.map(|p| Use {
        what: what.into(),
        p,
        bytes,
        elem,
        io,
        at: p,
        rows: None,
        ranges: None,
    })
}

/// The byte ranges `ranges` (offsets from `p`, lengths, in any order) of one buffer: their
/// span, of which the kernel touches the ranges only (merged where they meet).
pub(crate) fn ranges_use(
    what: impl Into<String>,
    p: Ptr,
    mut ranges: Vec<(u64, u64)>,
    elem: usize,
    io: Io,
) -> Option<Use> {
    ranges.retain(|r| r.1 > 0);
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, len) in ranges {
        match merged.last_mut() {
            Some(last) if last.0 + last.1 >= start => {
                last.1 = last.1.max(start + len - last.0);
            }
            _ => merged.push((start, len)),
        }
    }
    let bytes = merged.last().map_or(0, |r| r.0 + r.1);
    use_(what, Some(p), bytes, elem, io).map(|u| Use {
        ranges: Some(merged),
        ..u
    })
}

/// Whether two uses of one buffer touch a common byte (their spans may interleave: heads of
/// one tensor written through strides).
fn touch_common_bytes(a: &Use, b: &Use) -> bool {
    let abs = |u: &Use| -> Vec<(u64, u64)> {
        u.touched()
            .into_iter()
            .map(|(start, len)| (u.p.off + start, u.p.off + start + len))
            .collect()
    };
    let (mut x, mut y) = (abs(a), abs(b));
    x.sort_unstable();
    y.sort_unstable();
    let (mut i, mut j) = (0, 0);
    while i < x.len() && j < y.len() {
        if x[i].1 <= y[j].0 {
            i += 1;
        } else if y[j].1 <= x[i].0 {
            j += 1;
        } else {
            return true;
        }
    }
    false
}

/// `rows` rows of `row` bytes, `stride` bytes apart from `p`: one span, of which the kernel
/// touches the rows only.
pub(crate) fn rows_use(
    what: impl Into<String>,
    p: Ptr,
    (rows, row, stride): (u64, u64, u64),
    elem: usize,
    io: Io,
) -> Option<Use> {
    let bytes = if rows == 0 {
        0
    } else {
        (rows - 1) * stride + row
    };
    use_(what, Some(p), bytes, elem, io).map(|u| Use {
        rows: Some((row, stride)),
        ..u
    })
}

/// Every use must lie in its buffer, and no buffer written may overlap another use, except the
/// exact in-place pairs `in_place` names (same start, same element size).
pub(crate) fn check_uses(m: &Mem, uses: &[Option<Use>], in_place: &[(&str, &str)]) -> R<()> {
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
            let interleaved = a.ranges.is_some() || b.ranges.is_some();
            if interleaved && !touch_common_bytes(a, b) {
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
