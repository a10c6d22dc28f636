//! Every entry point of every kernel family's `.cu` files, in every dtype it is built for, run from
//! its source (the host build) against its CPU twin in `cpu/`, at awkward sizes (1, 31, 33,
//! 1023, 1025 elements; rows that are not a multiple of the 8-element vector; pointers 2 or 4
//! bytes past 16-byte alignment where the kernel takes any alignment), in both thread orders
//! (results must not depend on it: a dependence is a race).
//!
//! Each check states its bound: equal bit for bit where the kernel's header says its rounding
//! points are the twin's; at most 1 unit in the last place of the stored dtype where the header
//! documents F64 sums added in another order (block trees here, lanes or row blocks there: the
//! F64 results differ by ~1e-16 relative, so an F32 rounding can land one step apart). The
//! tests print how many elements differed at all.
//!
//! A launch here is a one-command program on the emulator, so the kernel's contract is checked
//! too, and each buffer is exactly the size the kernel may touch: under AddressSanitizer
//! (`kernel_tests_pass_under_the_sanitizers`) a byte outside it is reported.

use super::{Emulator, Order};
use crate::cuda::kernel_id::KernelId;
use crate::cuda::program::{Arg, Command, Field, Launch, Module, Place, Program, Run, Slot};
use crate::cuda::program::{SlotKind, Table};
use castor_ir::{round_to, DType};
use castor_kernels::host::{self, Sanitize};

/// Element counts every elementwise kernel is tried at.
pub(crate) const SIZES: [usize; 6] = [1, 8, 31, 33, 1023, 1025];

/// The float storage dtypes and their entry point suffixes.
pub(crate) const FLOATS: [(DType, &str); 3] = [
    (DType::F32, "f32"),
    (DType::F16, "f16"),
    (DType::BF16, "bf16"),
];

/// The suffix of a dtype pair: the dtype's when equal, `<in>_<out>` otherwise.
pub(crate) fn io(ti: DType, to: DType) -> String {
    let s = |d: DType| FLOATS.iter().find(|f| f.0 == d).map_or("?", |f| f.1);
    if ti == to {
        s(ti).to_string()
    } else {
        format!("{}_{}", s(ti), s(to))
    }
}

pub(crate) fn i64(x: usize) -> Arg {
    Arg::I64(x as i64)
}

pub(crate) fn i32(x: usize) -> Arg {
    Arg::I32(x as i32)
}

/// A deterministic generator.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-scale, scale), exactly representable in `d`.
    pub(crate) fn values(&mut self, n: usize, scale: f32, d: DType) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                round_to(d, u * scale)
            })
            .collect()
    }
}

/// `v` stored as `d` (rounded to nearest even).
pub(crate) fn enc(d: DType, v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * d.size_bytes());
    for &x in v {
        match d {
            DType::F16 => out.extend(half::f16::from_f32(x).to_bits().to_le_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f32(x).to_bits().to_le_bytes()),
            _ => out.extend(x.to_le_bytes()),
        }
    }
    out
}

/// Elements of dtype `d` widened to F32.
pub(crate) fn dec(d: DType, b: &[u8]) -> Vec<f32> {
    match d {
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

pub(crate) fn enc_i64(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(crate) fn dec_i32(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub(crate) fn dec_f64(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect()
}

/// Units in the last place of `d` between two values of `d` (0 when both are NaN).
fn ulps(d: DType, a: f32, b: f32) -> u32 {
    if a.is_nan() || b.is_nan() {
        return if a.is_nan() && b.is_nan() {
            0
        } else {
            u32::MAX
        };
    }
    let ordered = |x: f32| -> i64 {
        let bits = match d {
            DType::F16 => i64::from(half::f16::from_f32(x).to_bits()) << 16,
            DType::BF16 => i64::from(half::bf16::from_f32(x).to_bits()) << 16,
            _ => i64::from(x.to_bits()),
        };
        // Sign-magnitude to a monotonic integer.
        if bits & 0x8000_0000 != 0 {
            -(bits & 0x7fff_ffff)
        } else {
            bits
        }
    };
    let shift = if d == DType::F32 { 0 } else { 16 };
    ((ordered(a) - ordered(b)).unsigned_abs() >> shift).min(u64::from(u32::MAX)) as u32
}

/// Checks `got` against the twin's `want`, both values of dtype `d`: at most `max_ulps` apart
/// (NaN equal to NaN). Returns how many elements differ at all.
pub(crate) fn check(what: &str, d: DType, got: &[f32], want: &[f32], max_ulps: u32) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut differ = 0;
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let u = ulps(d, a, b);
        assert!(
            u <= max_ulps,
            "{what}: element {i} is {a:e}, the CPU twin's {b:e} ({u} ulp, at most {max_ulps})"
        );
        differ += usize::from(u > 0);
    }
    if differ > 0 {
        println!("{what}: {differ} of {} elements 1 ulp apart", got.len());
    }
    differ
}

/// Bytes before a buffer's 256-byte-aligned start: the skew of a misaligned pointer.
const SKEW_FILL: u8 = 0xAB;

/// A one-launch program: buffers in slots (each exactly its contents' size past its skew),
/// tables, then the launch run in both thread orders.
pub(crate) struct Launcher {
    file: &'static castor_kernels::KernelFile,
    slots: Vec<Slot>,
    data: Vec<Vec<u8>>,
    skews: Vec<u64>,
    tables: Vec<Table>,
    shared_bytes: u32,
}

/// A buffer of a [`Launcher`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Buf(pub(crate) usize);

impl Launcher {
    pub(crate) fn new(file: &str) -> Launcher {
        Launcher {
            file: crate::cuda::families::file(file)
                .unwrap_or_else(|| panic!("no kernel file {file}")),
            slots: Vec::new(),
            data: Vec::new(),
            skews: Vec::new(),
            tables: Vec::new(),
            shared_bytes: 0,
        }
    }

    /// Launches with `bytes` of dynamic shared memory.
    pub(crate) fn shared(&mut self, bytes: u32) {
        self.shared_bytes = bytes;
    }

    /// A buffer holding `bytes`, `skew` bytes past a 256-byte boundary.
    pub(crate) fn buf(&mut self, bytes: Vec<u8>, skew: u64) -> Buf {
        let mut data = vec![SKEW_FILL; skew as usize];
        data.extend(bytes);
        self.slots.push(Slot {
            name: format!("b{}", self.slots.len()),
            bytes: data.len() as u64,
            kind: SlotKind::Internal,
        });
        self.data.push(data);
        self.skews.push(skew);
        Buf(self.slots.len() - 1)
    }

    /// A buffer of `bytes` bytes filled with `0xFF` (NaN in every float dtype).
    pub(crate) fn out(&mut self, bytes: usize, skew: u64) -> Buf {
        self.buf(vec![0xFF; bytes], skew)
    }

    /// The argument pointing at `b`, `byte` bytes in.
    pub(crate) fn at(&self, b: Buf, byte: u64) -> Arg {
        Arg::Ptr(Place::Slot {
            slot: b.0,
            offset: self.skews[b.0] + byte,
        })
    }

    pub(crate) fn ptr(&self, b: Buf) -> Arg {
        self.at(b, 0)
    }

    /// A device table (rows of fields), as the multi-tensor kernels take.
    pub(crate) fn table(&mut self, rows: Vec<Vec<Field>>) -> Arg {
        self.tables.push(Table::Rows(rows));
        Arg::Table(self.tables.len() - 1)
    }

    /// The place of `b`'s first byte, for table fields.
    pub(crate) fn place(&self, b: Buf) -> Place {
        Place::Slot {
            slot: b.0,
            offset: self.skews[b.0],
        }
    }

    /// Runs `entry` in both thread orders; the buffers' contents after the forward run (each
    /// without its skew). The two runs must leave every buffer the same. Under a sanitizer
    /// the launch runs once: there the sanitizer finds races, whatever the order.
    pub(crate) fn run(
        &self,
        entry: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Vec<Arg>,
    ) -> Result<Vec<Vec<u8>>, String> {
        let program = Program {
            modules: vec![Module {
                name: self.file.name.into(),
                source: self.file.source.into(),
                generated: Vec::new(),
            }],
            slots: self.slots.clone(),
            tables: self.tables.clone(),
            runs: vec![Run {
                name: entry.into(),
                commands: vec![Command::Launch(Launch {
                    node: entry.into(),
                    module: 0,
                    kernel: Some(
                        KernelId::from_entry(entry)
                            .ok_or_else(|| format!("`{entry}` is the name of no kernel id"))?,
                    ),
                    entry: entry.into(),
                    grid,
                    block,
                    shared_bytes: self.shared_bytes,
                    args,
                })],
                ..Run::default()
            }],
            ..Program::default()
        };
        let run = |order: Order| -> Result<Vec<Vec<u8>>, String> {
            let mut emu = Emulator::new(&program);
            emu.set_order(order);
            for (s, d) in self.data.iter().enumerate() {
                emu.write_slot(s, d)?;
            }
            emu.run(0)?;
            (0..self.slots.len())
                .map(|s| {
                    emu.read_slot(s)
                        .map(|b| b[self.skews[s] as usize..].to_vec())
                })
                .collect()
        };
        let forward = run(Order::Forward)?;
        if host::sanitize().is_ok_and(|s| s != Sanitize::None) {
            return Ok(forward);
        }
        let reverse = run(Order::Reverse)?;
        if let Some(b) = (0..forward.len()).find(|&b| forward[b] != reverse[b]) {
            return Err(format!(
                "{entry}: buffer {b} differs between the forward and the reverse thread order \
                 (a race)"
            ));
        }
        Ok(forward)
    }
}

/// `(grid, block)` of a 1-D launch of `block` threads over `work` items, as the lowering
/// makes it.
pub(crate) fn grid_1d(work: usize, block: u32) -> ((u32, u32, u32), (u32, u32, u32)) {
    (
        (work.div_ceil(block as usize).max(1) as u32, 1, 1),
        (block, 1, 1),
    )
}

/// The test-name filter of the kernel families' tests (each family's `tests` module), which
/// [`kernel_tests_pass_under_the_sanitizers`] runs again: every test under `cuda::families::`
/// but the NVRTC compile checks, which run no host build.
const KERNEL_TESTS: [&str; 3] = ["cuda::families::", "--skip", "cuda::families::compile::"];

/// How many tests a libtest run's `args` select (its `--list` output).
fn selected(exe: &std::path::Path, args: &[&str]) -> usize {
    let out = std::process::Command::new(exe)
        .args(args)
        .arg("--list")
        .output()
        .unwrap_or_else(|e| panic!("listing the kernel tests: {e}"));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.ends_with(": test"))
        .count()
}

/// How many tests a libtest run reports as passed ("test result: ok. N passed; ...").
fn passed(stdout: &str) -> Option<usize> {
    let line = stdout.lines().find(|l| l.starts_with("test result: ok."))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

#[test]
fn kernel_tests_pass_under_the_sanitizers() {
    if host::sanitize().is_ok_and(|s| s != Sanitize::None) {
        return; // this is the run under a sanitizer
    }
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let exe = std::env::current_exe().unwrap_or_default();
    // The run must select the families' tests: a filter that matched none (as one did after
    // the tests moved into the families' folders) would pass while checking nothing.
    let want = selected(&exe, &KERNEL_TESTS);
    assert!(want >= 20, "the filter selects {want} kernel tests");
    for sanitize in [Sanitize::Address, Sanitize::Thread] {
        let Some(env) = host::sanitizer_env(sanitize) else {
            assert!(
                !ci,
                "CI=true but the host compiler has no {sanitize:?} runtime"
            );
            eprintln!("skipped: the host compiler has no {sanitize:?} runtime");
            continue;
        };
        let out = std::process::Command::new(&exe)
            .args(KERNEL_TESTS)
            .envs(env)
            .output()
            .unwrap_or_else(|e| panic!("running the kernel tests under {sanitize:?}: {e}"));
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        assert!(
            out.status.success(),
            "the kernel tests under {sanitize:?}:\n{}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        let stdout = text(&out.stdout);
        assert_eq!(
            passed(&stdout),
            Some(want),
            "the kernel tests under {sanitize:?} ran other than the {want} selected:\n{stdout}"
        );
        println!(
            "{sanitize:?}: {}",
            stdout
                .lines()
                .find(|l| l.starts_with("test result"))
                .unwrap_or("")
        );
    }
}
