//! Where a lowered [`Program`] runs: the GPU ([`Gpu`]) or the host emulator
//! ([`Emulator`]). The runners ([`super::runner`]) drive either through [`Target`], so
//! `--device emulate` executes exactly the commands, buffers and host transfers that
//! `--device cuda` would, in the same order.

use super::device::{Device, Loaded};
use super::emulate::Emulator;
use super::nccl::NcclRank;
use super::program::{Place, Program};
use crate::RuntimeError;

/// A machine a lowered program is resident on. Runs and copies may be asynchronous; reads
/// wait for everything issued before them.
pub trait Target: Sized {
    /// The executor a runner on this target is.
    const KIND: crate::ExecutorKind;
    /// Makes `program` resident (compiled, loaded, buffers allocated and initialized).
    fn load(program: &Program) -> Result<Self, RuntimeError>;
    /// The machine, for people: the GPU's name, or the emulator.
    fn describe(&self) -> String;
    /// What runs the program's cuDNN attention passes (cuDNN, castor's kernels, the CPU
    /// twin), when it has any.
    fn attention(&self) -> Option<String>;
    /// Whether cuDNN runs `call` (a plan was built for it), not its fallback kernels.
    fn runs_on_cudnn(&self, _call: &crate::cuda::sdpa::Sdpa) -> bool {
        false
    }
    /// Replaces a whole slot's bytes, after every earlier run.
    fn write_slot(&mut self, slot: usize, bytes: &[u8]) -> Result<(), RuntimeError>;
    /// Replaces a whole input slot's bytes, after every earlier run, without waiting for the
    /// device where it can (see `device::staging`).
    fn write_input(&mut self, slot: usize, bytes: &[u8]) -> Result<(), RuntimeError>;
    /// `bytes` bytes at `place`, once every earlier run has finished.
    fn read(&self, place: Place, bytes: u64) -> Result<Vec<u8>, RuntimeError>;
    /// A whole slot, once every earlier run has finished.
    fn read_slot(&self, slot: usize) -> Result<Vec<u8>, RuntimeError>;
    /// A device-to-device copy after every earlier run.
    fn copy(&mut self, dst: Place, src: Place, bytes: u64) -> Result<(), RuntimeError>;
    /// Runs the prologue (working copies from their masters) and waits for it.
    fn run_prologue(&mut self) -> Result<(), RuntimeError>;
    /// Issues run `run` (an index into the program's runs).
    fn run(&mut self, run: usize) -> Result<(), RuntimeError>;
    /// Waits for everything issued so far.
    fn synchronize(&self) -> Result<(), RuntimeError>;
    /// Device memory the program holds, in bytes.
    fn allocated_bytes(&self) -> u64;
    /// Every rank's shard in slot `slot` gathered into the whole value of `whole_bytes`, once
    /// every earlier run has finished (a rank of a data-parallel program; every rank calls it
    /// together).
    fn gather_slot(
        &self,
        _slot: usize,
        _dtype: castor_ir::DType,
        _whole_bytes: u64,
    ) -> Result<Vec<u8>, RuntimeError> {
        Err(RuntimeError::Plan(
            "gathering shards needs a rank of a launched group on a GPU".into(),
        ))
    }
    /// Records timing mark `mark` after everything issued so far (where device time means
    /// something: on the GPU).
    fn mark(&mut self, _mark: usize) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// Milliseconds of device time between two marks, or `None` where there is no device
    /// clock.
    fn elapsed_ms(&self, _from: usize, _to: usize) -> Result<Option<f32>, RuntimeError> {
        Ok(None)
    }
    /// Runs run `run` command by command, timing each, and waits for it: each command's
    /// device time in milliseconds, or `None` (having run it) where there is no device clock.
    fn run_timed(&mut self, run: usize) -> Result<Option<Vec<f32>>, RuntimeError> {
        self.run(run)?;
        Ok(None)
    }
}

/// The first CUDA device, with a program resident on it.
pub struct Gpu {
    loaded: Loaded,
    device: Device,
}

impl Gpu {
    /// `program` resident on rank `rank`'s GPU, its collectives joined to the rank's NCCL
    /// group (which waits for every rank to join).
    pub fn load_rank(program: &Program, rank: &NcclRank) -> Result<Self, RuntimeError> {
        crate::cuda::nccl::probe()?;
        let device = Device::open_ordinal(rank.local_rank)?;
        let mut loaded = device.load(program)?;
        loaded.join_group(&rank.id, rank.rank, rank.world)?;
        Ok(Gpu { loaded, device })
    }
}

impl Target for Gpu {
    const KIND: crate::ExecutorKind = crate::ExecutorKind::Cuda;
    fn load(program: &Program) -> Result<Self, RuntimeError> {
        let device = Device::open()?;
        let loaded = device.load(program)?;
        Ok(Gpu { loaded, device })
    }
    fn runs_on_cudnn(&self, call: &crate::cuda::sdpa::Sdpa) -> bool {
        self.loaded.runs_on_cudnn(call)
    }
    fn gather_slot(
        &self,
        slot: usize,
        dtype: castor_ir::DType,
        whole_bytes: u64,
    ) -> Result<Vec<u8>, RuntimeError> {
        Ok(self.loaded.gather_slot(slot, dtype, whole_bytes)?)
    }
    fn describe(&self) -> String {
        self.device.name().to_string()
    }
    fn attention(&self) -> Option<String> {
        self.loaded.attention().map(str::to_string)
    }
    fn write_slot(&mut self, slot: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        Ok(self.loaded.write_slot(slot, bytes)?)
    }
    fn write_input(&mut self, slot: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        Ok(self.loaded.write_input(slot, bytes)?)
    }
    fn read(&self, place: Place, bytes: u64) -> Result<Vec<u8>, RuntimeError> {
        Ok(self.loaded.read(place, bytes)?)
    }
    fn read_slot(&self, slot: usize) -> Result<Vec<u8>, RuntimeError> {
        Ok(self.loaded.read_slot(slot)?)
    }
    fn copy(&mut self, dst: Place, src: Place, bytes: u64) -> Result<(), RuntimeError> {
        Ok(self.loaded.copy(dst, src, bytes)?)
    }
    fn run_prologue(&mut self) -> Result<(), RuntimeError> {
        Ok(self.loaded.run_prologue()?)
    }
    fn run(&mut self, run: usize) -> Result<(), RuntimeError> {
        Ok(self.loaded.run(run)?)
    }
    fn synchronize(&self) -> Result<(), RuntimeError> {
        Ok(self.loaded.synchronize()?)
    }
    fn allocated_bytes(&self) -> u64 {
        self.loaded.allocated_bytes()
    }
    fn mark(&mut self, mark: usize) -> Result<(), RuntimeError> {
        Ok(self.loaded.mark(mark)?)
    }
    fn elapsed_ms(&self, from: usize, to: usize) -> Result<Option<f32>, RuntimeError> {
        Ok(Some(self.loaded.elapsed_ms(from, to)?))
    }
    fn run_timed(&mut self, run: usize) -> Result<Option<Vec<f32>>, RuntimeError> {
        Ok(Some(self.loaded.run_timed(run)?))
    }
}

/// The emulator runs in poison mode: it is a checking tool, and reading arena bytes that no
/// earlier command of the run wrote must fail rather than pass by chance.
impl Target for Emulator {
    const KIND: crate::ExecutorKind = crate::ExecutorKind::Emulate;
    fn load(program: &Program) -> Result<Self, RuntimeError> {
        let mut emu = Emulator::new(program);
        emu.set_poison(true);
        Ok(emu)
    }
    fn describe(&self) -> String {
        "the host emulator of the CUDA program".to_string()
    }
    fn attention(&self) -> Option<String> {
        let cudnn = self.program().all_commands().filter_map(|c| match c {
            crate::cuda::program::Command::Sdpa(call) => Some(call.fallback.is_empty()),
            _ => None,
        });
        let (mut required, mut optional) = (0, 0);
        for must in cudnn {
            if must {
                required += 1;
            } else {
                optional += 1;
            }
        }
        (required + optional > 0).then(|| {
            format!(
                "castor's kernels for {optional}, the CPU twin for {required} cuDNN-only \
                 passes (no cuDNN here)"
            )
        })
    }
    fn write_slot(&mut self, slot: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        Emulator::write_slot(self, slot, bytes).map_err(RuntimeError::Emulated)
    }
    fn write_input(&mut self, slot: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        Emulator::write_slot(self, slot, bytes).map_err(RuntimeError::Emulated)
    }
    fn read(&self, place: Place, bytes: u64) -> Result<Vec<u8>, RuntimeError> {
        Emulator::read(self, place, bytes).map_err(RuntimeError::Emulated)
    }
    fn read_slot(&self, slot: usize) -> Result<Vec<u8>, RuntimeError> {
        Emulator::read_slot(self, slot).map_err(RuntimeError::Emulated)
    }
    fn copy(&mut self, dst: Place, src: Place, bytes: u64) -> Result<(), RuntimeError> {
        Emulator::copy(self, dst, src, bytes).map_err(RuntimeError::Emulated)
    }
    fn run_prologue(&mut self) -> Result<(), RuntimeError> {
        Emulator::run_prologue(self).map_err(RuntimeError::Emulated)
    }
    fn run(&mut self, run: usize) -> Result<(), RuntimeError> {
        Emulator::run(self, run).map_err(RuntimeError::Emulated)
    }
    fn synchronize(&self) -> Result<(), RuntimeError> {
        Ok(())
    }
    fn allocated_bytes(&self) -> u64 {
        self.program().allocation().total()
    }
    fn gather_slot(
        &self,
        slot: usize,
        dtype: castor_ir::DType,
        whole_bytes: u64,
    ) -> Result<Vec<u8>, RuntimeError> {
        Emulator::gather_slot(self, slot, dtype, whole_bytes).map_err(RuntimeError::Emulated)
    }
}
