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
//! Kernels: every launch runs the real kernel, hand-written and generated alike, from the
//! host build of its module's source (`castor_kernels::host`: the CUDA C compiled as C++ for
//! the CPU, a block's threads run as fibers). Before it runs, the launch is checked against
//! its kernel's contract (`contracts`: the argument types and meanings, the launch shape and
//! the bytes behind each pointer, from the kernel file's header comment, or, for a generated
//! kernel, from the module's record of it), and the kernel runs on copies of exactly those
//! bytes (`launch`), so a kernel that reads or writes outside its contract is caught too. The
//! arguments are checked against the kernel's C signature. The F32 functions the kernels call
//! whose CUDA versions are not correctly rounded (`expf`, `erff`) are the CPU executor's, so a
//! kernel computes what its CPU twin computes where its header says it does; what still
//! differs from the CPU executor is what the headers document (summation orders of block
//! reductions, cross-entropy's online log-sum-exp) and cuBLAS's products (`gemm`).
//!
//! Modules: this one holds [`Emulator`], its public API and the dispatch of commands and
//! launches (launch-shape checks, kernel files against generated modules); `memory` the
//! buffers, fake addresses, bounds checks, poison tracking and typed loads and stores; `args`
//! a launch's typed arguments; `contracts` what each entry point may touch, one submodule per
//! kernel file; `launch` the run of a kernel on copies of its buffers; `gemm` the cuBLAS
//! product.

pub(crate) mod args;
pub(crate) mod contracts;
mod gemm;
#[cfg(test)]
pub(crate) mod kernel_tests;
mod launch;
pub(crate) mod memory;
mod sdpa;

pub use castor_kernels::host::Order;

use super::program::{Command, Launch, Place, Program, SlotKind};
use castor_kernels::host::{HostMath, HostModule};
use gemm::gemm;
use memory::{check_uses, use_, Io, Mem, Ptr};
use std::sync::Arc;

pub(crate) type R<T> = Result<T, String>;

/// A lowered program running on the host.
pub struct Emulator {
    program: Program,
    mem: Mem,
    poison: bool,
    order: Order,
    /// The host build of each module, once a launch needed it.
    modules: Vec<Option<Arc<HostModule>>>,
    /// A data-parallel program's rank: its collectives go to the group's CPU exchange.
    member: Option<crate::cpu::collective::Member>,
    /// Side-stream collectives issued and not joined yet: run at their join, so that what
    /// the compute stream did meanwhile (reusing the operand's memory, reading the result
    /// early) shows, as a GPU's concurrency could make it show.
    pending: Vec<(usize, Command)>,
}

/// The F32 functions the host build takes from the CPU executor (see `castor_host.h`).
extern "C" fn cpu_expf(x: f32) -> f32 {
    crate::cpu::math::exp(x)
}

extern "C" fn cpu_erff(x: f32) -> f32 {
    libm::erff(x)
}

const MATH: HostMath = HostMath {
    expf: cpu_expf,
    erff: cpu_erff,
};

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
            order: Order::Forward,
            modules: vec![None; program.modules.len()],
            member: None,
            pending: Vec::new(),
        }
    }

    /// Makes this program one rank's of a data-parallel group: its collectives are computed
    /// with the other members' (as CPU ranks compute them), where a GPU would call NCCL.
    pub fn join_group(&mut self, member: crate::cpu::collective::Member) {
        self.member = Some(member);
    }

    /// Every rank's shard at slot `slot` (of `dtype` values), gathered into the whole value
    /// of `whole_bytes`; every member calls it together.
    pub fn gather_slot(
        &self,
        slot: usize,
        dtype: castor_ir::DType,
        whole_bytes: u64,
    ) -> Result<Vec<u8>, String> {
        let member = self
            .member
            .as_ref()
            .ok_or("gathering a shard needs the rank's group")?;
        let shard = self.read_slot(slot)?;
        let n = whole_bytes as usize / dtype.size_bytes().max(1);
        let op = castor_ir::Op::AllGather {
            world: member.world(),
            shape: vec![n],
        };
        exchange(
            member,
            &op,
            dtype,
            &shard,
            whole_bytes,
            &format!("slot {slot}"),
        )
    }

    /// The order the kernels start their blocks and threads in (forward by default). A
    /// kernel whose results depend on it has a race (a missing barrier, say).
    pub fn set_order(&mut self, order: Order) {
        self.order = order;
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
            exec(
                &self.program,
                &mut self.mem,
                &mut self.modules,
                (self.order, self.member.as_ref()),
                c,
            )
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
            let at = |e: String| format!("run `{}` command {i} ({}): {e}", r.name, describe(c));
            match c {
                Command::Collective { side: Some(k), .. } => {
                    self.pending.push((*k, c.clone()));
                    continue;
                }
                Command::Join { events } => {
                    let (due, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
                        .into_iter()
                        .partition(|(k, _)| events.contains(k));
                    self.pending = rest;
                    for (_, side) in due {
                        exec(
                            &self.program,
                            &mut self.mem,
                            &mut self.modules,
                            (self.order, self.member.as_ref()),
                            &side,
                        )
                        .map_err(at)?;
                    }
                    continue;
                }
                _ => {}
            }
            exec(
                &self.program,
                &mut self.mem,
                &mut self.modules,
                (self.order, self.member.as_ref()),
                c,
            )
            .map_err(at)?;
        }
        if let Some((k, c)) = self.pending.first() {
            return Err(format!(
                "run `{}`: side event {k} ({}) is never joined",
                r.name,
                describe(c)
            ));
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
            if f.kind == crate::cuda::program::FlagKind::RightPadded {
                return Err(crate::cuda::runner::mask_not_right_padded(f, pos as usize).to_string());
            }
            let index = self.mem.i64_at(self.mem.place(f.indices), i64::from(pos))?;
            return Err(format!(
                "%{}: {} {index} at position {} is out of range (limit {})",
                f.node,
                f.what,
                f.first + pos as usize,
                f.limit
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
        Command::Collective { node, op, .. } => format!("`{}` for %{node}", op.mnemonic()),
        Command::Join { events } => format!("join of side events {events:?}"),
        Command::Sdpa(call) => format!("cuDNN attention for %{}", call.node),
    }
}

fn exec(
    program: &Program,
    mem: &mut Mem,
    modules: &mut [Option<Arc<HostModule>>],
    (order, member): (Order, Option<&crate::cpu::collective::Member>),
    c: &Command,
) -> R<()> {
    match c {
        Command::Launch(l) => launch(program, mem, modules, order, l),
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
        Command::Collective {
            node,
            op,
            dtype,
            src,
            dst,
            src_bytes,
            dst_bytes,
            ..
        } => {
            let member = member.ok_or_else(|| {
                format!(
                    "`{}` for %{node}: a data-parallel program runs as one rank of its group \
                     (emulated ranks: --world-size N --device emulate)",
                    op.mnemonic()
                )
            })?;
            let (s, d) = (mem.place(*src), mem.place(*dst));
            check_uses(
                mem,
                &[
                    use_("src", Some(s), *src_bytes, 1, Io::R),
                    use_("dst", Some(d), *dst_bytes, 1, Io::W),
                ],
                &[],
            )?;
            let mine = mem.bytes(s, 0, *src_bytes)?.to_vec();
            let out = exchange(member, op, *dtype, &mine, *dst_bytes, node)?;
            mem.bytes_mut(d, 0, *dst_bytes)?.copy_from_slice(&out);
            Ok(())
        }
        Command::Join { .. } => Ok(()),
        // Where cuDNN may not run it, the fallback is what this machine (no cuDNN) runs;
        // a command cuDNN must run is checked against the op's CPU twin.
        Command::Sdpa(call) if !call.fallback.is_empty() => {
            for f in &call.fallback {
                exec(program, mem, modules, (order, member), f)
                    .map_err(|e| format!("{} (castor's kernels): {e}", describe(f)))?;
            }
            Ok(())
        }
        Command::Sdpa(call) => {
            for c in &call.prelude {
                exec(program, mem, modules, (order, member), c)
                    .map_err(|e| format!("{} (before cuDNN's graph): {e}", describe(c)))?;
            }
            sdpa::twin(mem, call)
        }
    }
}

/// Collective `op` of this rank's `mine` (`dtype` values) with the other members: the
/// `out_bytes` bytes it leaves this rank, computed as the CPU executor's ranks compute them.
fn exchange(
    member: &crate::cpu::collective::Member,
    op: &castor_ir::Op,
    dtype: castor_ir::DType,
    mine: &[u8],
    out_bytes: u64,
    node: &str,
) -> R<Vec<u8>> {
    let size = dtype.size_bytes().max(1);
    let flat =
        |bytes: usize| castor_ir::TensorType::new(dtype, castor_ir::Shape(vec![bytes / size]));
    let x = crate::cuda::runner::from_bytes(&flat(mine.len()), mine).map_err(|e| e.to_string())?;
    let y = crate::cpu::collective::execute(op, Some(member), &x, &flat(out_bytes as usize), node)
        .map_err(|e| e.to_string())?;
    Ok(crate::cuda::runner::to_bytes(&y))
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
    modules: &mut [Option<Arc<HostModule>>],
    order: Order,
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
    let module = program
        .modules
        .get(l.module)
        .ok_or_else(|| format!("module {} does not exist", l.module))?;
    let file = crate::cuda::families::file(&module.name);
    let entries: Vec<&str> = match file {
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
            file.entry_points.to_vec()
        }
        None => module.generated.iter().map(|k| k.entry.as_str()).collect(),
    };
    let host = match &modules[l.module] {
        Some(h) => h.clone(),
        None => {
            let h = castor_kernels::host::module(&module.name, &module.source, &entries, MATH)
                .map_err(|e| format!("the host build of module {}: {e}", module.name))?;
            modules[l.module] = Some(h.clone());
            h
        }
    };
    let entry = host
        .entry(&l.entry)
        .ok_or_else(|| format!("`{}` is not an entry point of {}", l.entry, module.name))?;
    let uses = match file {
        Some(_) => contracts::builtin(mem, l)?,
        None => {
            let kernel = module
                .generated
                .iter()
                .find(|k| k.entry == l.entry)
                .ok_or_else(|| {
                    format!(
                        "module {} has no generated kernel `{}`",
                        module.name, l.entry
                    )
                })?;
            contracts::no_dynamic_shared(l)?;
            contracts::generated(mem, l, kernel, entry)?
        }
    };
    launch::run(mem, program, l, entry, &uses, order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::program::{Arg, Module, Run, Slot};

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

    /// A tensor-core attention kernel takes packed sequences' positions exactly when it is a
    /// `_packed` entry point: the others compile the positions out and would ignore them.
    #[test]
    fn attention_positions_go_only_to_the_packed_entry_points() {
        use crate::cuda::families::attention::{geometry, Kernel};
        let file = crate::cuda::families::file("attention.cu").unwrap();
        let slot = |slot| Arg::Ptr(Place::Slot { slot, offset: 0 });
        let launch = |packed: bool, positions: Arg| {
            let mut args = vec![slot(0), slot(1), slot(2), Arg::Null, positions, slot(3)];
            args.extend([slot(4), Arg::I64(1), Arg::I32(1), Arg::I32(1), Arg::I32(8)]);
            args.extend([
                Arg::I32(1),
                Arg::I32(1),
                Arg::I32(1),
                Arg::I32(0),
                Arg::F64(1.0),
            ]);
            args.extend((0..12).map(|_| Arg::I32(8)));
            let kernel = Kernel::Attention {
                kernel: geometry::Kernel::Forward,
                dtype: castor_ir::DType::BF16,
                tile: Some(16),
                packed,
                dropout: false,
            };
            Command::Launch(Launch {
                node: "att".into(),
                module: 0,
                kernel: Some(crate::cuda::kernel_id::KernelId::Attention(kernel)),
                entry: kernel.entry(),
                grid: (1, 1, 1),
                block: (256, 1, 1),
                shared_bytes: geometry::shared_bytes(geometry::Kernel::Forward, 16, 2),
                args,
            })
        };
        for (packed, positions, why) in [
            (false, slot(5), "ignores them"),
            (true, Arg::Null, "`_packed` entry point without positions"),
        ] {
            let mut p = program(vec![launch(packed, positions)], &[16, 16, 16, 16, 4, 8]);
            p.modules.push(Module {
                name: file.name.into(),
                source: file.source.into(),
                ..Module::default()
            });
            let e = Emulator::new(&p).run(0).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn launches_check_arguments_and_poison_fills_the_arena() {
        let file = crate::cuda::families::file("layout.cu").unwrap();
        let fill = |args| {
            Command::Launch(Launch {
                node: "z".into(),
                module: 0,
                kernel: Some(crate::cuda::kernel_id::KernelId::Layout(
                    crate::cuda::families::layout::Kernel::Fill { bytes: 4 },
                )),
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
            ..Module::default()
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
}
