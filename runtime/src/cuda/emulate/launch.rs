//! Running a launch on the host build of its kernel.
//!
//! The kernel runs on copies: every region of device memory its contract names (the uses,
//! merged where they overlap, as an in-place update's do) is copied into an allocation of its
//! own, at an address with the device address's alignment modulo 256 (device buffers are
//! 256-byte aligned, and the kernels pick their vector paths by alignment), between guard
//! bytes. After the kernel the guards must be intact (a write outside the contract is an
//! error naming the buffer), regions the kernel only reads must be unchanged, and the written
//! regions are copied back. Pointers are resolved to the copies: the launch's arguments, and
//! the pointers inside tables (re-encoded for the copies). Under AddressSanitizer the guards
//! are poisoned as well, so a read outside the contract is reported where it happens.

use super::memory::{Io, Mem, Ptr, Use};
use super::R;
use crate::cuda::program::{Arg, Launch, Program};
use castor_kernels::host::{HostEntry, LaunchShape, Order, ParamKind};
use std::alloc::Layout;
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::OnceLock;

/// Guard bytes on each side of a copy.
const GUARD: usize = 256;
/// The byte guards hold.
const CANARY: u8 = 0xC5;
/// Device buffers' alignment: a copy keeps its address modulo this.
const DEVICE_ALIGN: usize = 256;

/// One copied region of a buffer: bytes `start..end` of buffer `buf`.
struct Region {
    buf: usize,
    start: u64,
    end: u64,
    /// The uses it holds.
    uses: Vec<usize>,
    copy: Copy,
}

/// An allocation holding a region between guards.
struct Copy {
    base: *mut u8,
    layout: Layout,
    /// Offset of the region's first byte in the allocation.
    lead: usize,
    len: usize,
}

impl Copy {
    fn new(start: u64, bytes: &[u8]) -> Copy {
        let lead = GUARD + (start % DEVICE_ALIGN as u64) as usize;
        let size = lead + bytes.len() + GUARD;
        // A valid layout: the size is small and nonzero, the alignment a power of two.
        let layout = Layout::from_size_align(size, DEVICE_ALIGN).unwrap_or(Layout::new::<u8>());
        // SAFETY: `layout` has a nonzero size.
        let base = unsafe { std::alloc::alloc(layout) };
        if base.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: `base` is valid for `size` bytes.
        unsafe {
            std::ptr::write_bytes(base, CANARY, lead);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(lead), bytes.len());
            std::ptr::write_bytes(base.add(lead + bytes.len()), CANARY, GUARD);
        }
        let c = Copy {
            base,
            layout,
            lead,
            len: bytes.len(),
        };
        if let Some(asan) = asan() {
            // SAFETY: both ranges lie in the allocation.
            unsafe {
                (asan.poison)(base.cast(), lead);
                (asan.poison)(base.add(lead + c.len).cast(), GUARD);
            }
        }
        c
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: `lead` is inside the allocation.
        unsafe { self.base.add(self.lead) }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the region's bytes, initialized in `new`.
        unsafe { std::slice::from_raw_parts(self.data(), self.len) }
    }

    /// The first guard byte that changed, as an offset from the region's start.
    fn damaged_guard(&self) -> Option<i64> {
        // SAFETY: the guards lie in the allocation and were initialized in `new`; reading them
        // here is not instrumented, so their poisoning does not matter.
        let (before, after) = unsafe {
            (
                std::slice::from_raw_parts(self.base, self.lead),
                std::slice::from_raw_parts(self.data().add(self.len), GUARD),
            )
        };
        if let Some(k) = before.iter().rposition(|&b| b != CANARY) {
            return Some(k as i64 - self.lead as i64);
        }
        after
            .iter()
            .position(|&b| b != CANARY)
            .map(|k| (self.len + k) as i64)
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        if let Some(asan) = asan() {
            // SAFETY: the whole allocation.
            unsafe { (asan.unpoison)(self.base.cast(), self.layout.size()) };
        }
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.base, self.layout) };
    }
}

/// AddressSanitizer's manual poisoning, when the process runs under it.
struct Asan {
    poison: unsafe extern "C" fn(*const c_void, usize),
    unpoison: unsafe extern "C" fn(*const c_void, usize),
}

fn asan() -> Option<&'static Asan> {
    static ASAN: OnceLock<Option<Asan>> = OnceLock::new();
    ASAN.get_or_init(|| {
        // SAFETY: looks up two functions of the running process by their C names; their
        // signatures are AddressSanitizer's public interface.
        unsafe {
            let this = libloading::os::unix::Library::this();
            let poison = *this
                .get::<unsafe extern "C" fn(*const c_void, usize)>(b"__asan_poison_memory_region\0")
                .ok()?;
            let unpoison = *this
                .get::<unsafe extern "C" fn(*const c_void, usize)>(
                    b"__asan_unpoison_memory_region\0",
                )
                .ok()?;
            Some(Asan { poison, unpoison })
        }
    })
    .as_ref()
}

/// The regions of `uses`: per buffer, the uses' byte ranges merged where they overlap (or
/// start at the same byte).
fn regions(m: &Mem, uses: &[Use]) -> Vec<Region> {
    let mut order: Vec<usize> = (0..uses.len()).collect();
    order.sort_by_key(|&i| (uses[i].p.buf, uses[i].p.off));
    let mut out: Vec<(usize, u64, u64, Vec<usize>)> = Vec::new();
    for i in order {
        let u = &uses[i];
        let (start, end) = (u.p.off, u.p.off + u.bytes);
        match out.last_mut() {
            Some((buf, s, e, members)) if *buf == u.p.buf && (start < *e || start == *s) => {
                *e = (*e).max(end);
                members.push(i);
            }
            _ => out.push((u.p.buf, start, end, vec![i])),
        }
    }
    out.into_iter()
        .map(|(buf, start, end, uses)| Region {
            buf,
            start,
            end,
            uses,
            // Unwritten (poisoned) bytes are copied as they are: the copy is not a read.
            copy: Copy::new(start, &m.bufs[buf][start as usize..end as usize]),
        })
        .collect()
}

/// Where the kernel finds the device address `p`: in the copy of the region a use reaches
/// through `p`, else of the region holding `p`.
fn resolve(regions: &[Region], uses: &[Use], p: Ptr) -> Option<*mut u8> {
    let reached: Vec<&Region> = regions
        .iter()
        .filter(|r| r.uses.iter().any(|&i| uses[i].at == p))
        .collect();
    let region = match reached.as_slice() {
        [r] => *r,
        // Two regions reached through one pointer (the contracts make none) would need the
        // argument's name to tell apart: refused.
        [_, _, ..] => return None,
        [] => regions
            .iter()
            .find(|r| r.buf == p.buf && r.start <= p.off && p.off < r.end.max(r.start + 1))?,
    };
    // Pointer arithmetic only: the kernel adds the use's offset back before it reads.
    Some(
        region
            .copy
            .data()
            .wrapping_offset(p.off as isize - region.start as isize),
    )
}

/// Runs launch `l` of `entry` on the uses its contract gives, in `order`.
pub(super) fn run(
    m: &mut Mem,
    program: &Program,
    l: &Launch,
    entry: &HostEntry,
    uses: &[Use],
    order: Order,
) -> R<()> {
    // Poison mode: what the kernel reads must have been written earlier in the run.
    for u in uses.iter().filter(|u| u.io != Io::W) {
        for (start, len) in u.touched() {
            m.bytes(u.p, start as i64, len)
                .map_err(|e| format!("`{}`: {e}", u.what))?;
        }
    }
    let mut regions = regions(m, uses);
    // Pointers the contract does not name (an operand the launch does not read, such as a
    // norm's weight when it computes statistics only) still get an address: an empty region.
    let mut stray = Vec::new();
    for arg in &l.args {
        if let Arg::Ptr(place) = arg {
            let p = m.place(*place);
            if resolve(&regions, uses, p).is_none() {
                stray.push(p);
            }
        }
    }
    for p in stray {
        regions.push(Region {
            buf: p.buf,
            start: p.off,
            end: p.off,
            uses: Vec::new(),
            copy: Copy::new(p.off, &[]),
        });
    }
    // Tables hold addresses: their copies are encoded for the copies.
    let first_table = 1 + m.slots;
    for r in regions.iter().filter(|r| r.buf >= first_table) {
        let t = r.buf - first_table;
        let missing = RefCell::new(None);
        let encoded = program.tables[t].encode(&|place| {
            let p = m.place(place);
            resolve(&regions, uses, p).map_or_else(
                || {
                    missing.borrow_mut().get_or_insert(p);
                    0
                },
                |a| a as u64,
            )
        });
        if let Some(p) = missing.into_inner() {
            return Err(format!(
                "table #{t} points to {}, which the kernel's contract does not name",
                m.describe(p)
            ));
        }
        let bytes = &encoded[r.start as usize..r.end as usize];
        // SAFETY: the copy holds exactly the region's bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), r.copy.data(), bytes.len()) };
    }
    let before: Vec<Option<Vec<u8>>> = regions
        .iter()
        .map(|r| {
            let writes = r.uses.iter().any(|&i| uses[i].io != Io::R);
            (!writes).then(|| r.copy.bytes().to_vec())
        })
        .collect();

    let args = arguments(m, l, entry, &regions, uses)?;
    let ptrs: Vec<*mut c_void> = args
        .iter()
        .map(|a| a.as_ptr().cast_mut().cast::<c_void>())
        .collect();
    // Blocks that wait for earlier blocks run in index order, as the device dispatches them;
    // their threads still run in the reverse order.
    let order = match order {
        Order::Reverse if crate::cuda::families::waits_for_earlier_blocks(&l.entry) => {
            Order::ReverseThreads
        }
        other => other,
    };
    let shape = LaunchShape {
        grid: l.grid,
        block: l.block,
        shared_bytes: l.shared_bytes,
    };
    // SAFETY: `ptrs` holds one pointer per parameter to a value of its size (checked in
    // `arguments`); every pointer among them, and in the tables, points into a copy that
    // holds what the contract says the kernel touches (guards around it).
    unsafe { entry.launch(&shape, order, &ptrs) }.map_err(|e| format!("in the kernel: {e}"))?;

    for (r, before) in regions.iter().zip(&before) {
        let names = || {
            r.uses
                .iter()
                .map(|&i| format!("`{}`", uses[i].what))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if let Some(at) = r.copy.damaged_guard() {
            let what = if r.uses.is_empty() {
                format!(
                    "memory at {}",
                    m.describe(Ptr {
                        buf: r.buf,
                        off: r.start
                    })
                )
            } else {
                names()
            };
            return Err(format!(
                "the kernel wrote byte {at} of {what} ({} bytes): outside what its contract \
                 allows",
                r.end - r.start
            ));
        }
        if before.as_deref().is_some_and(|b| b != r.copy.bytes()) {
            return Err(format!("the kernel wrote {}, which it only reads", names()));
        }
    }
    for (r, before) in regions.iter().zip(&before) {
        if before.is_some() || r.end == r.start {
            continue;
        }
        m.bufs[r.buf][r.start as usize..r.end as usize].copy_from_slice(r.copy.bytes());
        for &i in &r.uses {
            let u = &uses[i];
            if u.io != Io::R {
                for (start, len) in u.touched() {
                    let p = Ptr {
                        buf: u.p.buf,
                        off: u.p.off + start,
                    };
                    m.mark_written(p, len);
                }
            }
        }
    }
    Ok(())
}

/// The launch's arguments as the kernel's parameters, each value 8-byte aligned storage:
/// checked against the parameter list of the kernel's C signature.
fn arguments(
    m: &Mem,
    l: &Launch,
    entry: &HostEntry,
    regions: &[Region],
    uses: &[Use],
) -> R<Vec<Vec<u64>>> {
    if l.args.len() != entry.params.len() {
        return Err(format!(
            "{} arguments given, `{}` takes {}",
            l.args.len(),
            entry.name,
            entry.params.len()
        ));
    }
    let mut out = Vec::with_capacity(l.args.len());
    for (i, (arg, param)) in l.args.iter().zip(&entry.params).enumerate() {
        let bad = |want: &str| {
            format!(
                "argument {i} of `{}` is {arg:?}, the parameter is {want} ({:?}, {} bytes)",
                entry.name, param.kind, param.size
            )
        };
        let scalar = |kind: ParamKind, bits: u64| {
            if param.kind == kind {
                Ok(vec![bits])
            } else {
                Err(bad("another type"))
            }
        };
        let value = match arg {
            Arg::Null => scalar(ParamKind::Ptr, 0)?,
            Arg::Ptr(place) => {
                let p = m.place(*place);
                pointer(param.pointee, resolve(regions, uses, p), &bad)?
            }
            Arg::Table(t) => {
                let p = m.table(*t)?;
                pointer(param.pointee, resolve(regions, uses, p), &bad)?
            }
            Arg::I32(x) => scalar(ParamKind::I32, u64::from(*x as u32))?,
            Arg::U32(x) => scalar(ParamKind::U32, u64::from(*x))?,
            Arg::U16(x) => scalar(ParamKind::U16, u64::from(*x))?,
            Arg::I64(x) => scalar(ParamKind::I64, *x as u64)?,
            Arg::U64(x) => scalar(ParamKind::U64, *x)?,
            Arg::F64(x) => scalar(ParamKind::F64, x.to_bits())?,
            Arg::Layout(lay) => {
                let size = std::mem::size_of_val(lay);
                if param.kind != ParamKind::Struct || param.size != size {
                    return Err(bad(&format!("a {size}-byte CopyLayout")));
                }
                let mut words = vec![0u64; size.div_ceil(8)];
                // SAFETY: `CopyLayout` is plain old data (#[repr(C)] integers), `words` holds
                // at least its size.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (lay as *const crate::cuda::program::CopyLayout).cast::<u8>(),
                        words.as_mut_ptr().cast::<u8>(),
                        size,
                    )
                };
                words
            }
        };
        out.push(value);
    }
    Ok(out)
}

/// A pointer argument: its address, checked to suit the pointed-to type's alignment (a
/// misaligned pointer faults on the device).
fn pointer(pointee: usize, addr: Option<*mut u8>, bad: &dyn Fn(&str) -> String) -> R<Vec<u64>> {
    let addr = addr.ok_or_else(|| bad("a pointer into memory the contract names"))? as u64;
    let align = if pointee == 0 {
        1
    } else {
        1u64 << pointee.trailing_zeros().min(3)
    };
    if !addr.is_multiple_of(align) {
        return Err(bad(&format!(
            "a pointer {align}-byte aligned (this one is {} past)",
            addr % align
        )));
    }
    Ok(vec![addr])
}
