//! Host reads and writes of a resident program, and device-side copies between runs.

use super::load::Loaded;
use super::{drv, CudaError};
use crate::cuda::program::Place;
use cudarc::driver::result as cu;
use cudarc::driver::sys as cu_sys;

impl Loaded {
    /// Copies `bytes` to `place` (synchronously: after every earlier run, before returning).
    pub fn write(&self, place: Place, bytes: &[u8]) -> Result<(), CudaError> {
        self.check_place(place, bytes.len() as u64, "write")?;
        self.dev.bind()?;
        if bytes.is_empty() {
            return self.dev.synchronize("writing from the host");
        }
        let dst = self.address(place);
        // SAFETY: `dst` spans `bytes.len()` bytes of a live allocation (checked above); the
        // host buffer outlives the copy, which the synchronize below waits for.
        drv(
            unsafe { cu::memcpy_htod_async(dst, bytes, self.dev.stream()) },
            || format!("cuMemcpyHtoDAsync of {} bytes to {place:?}", bytes.len()),
        )?;
        self.dev.synchronize("writing from the host")
    }

    /// Replaces slot `slot`'s bytes (all of them) with `bytes`.
    pub fn write_slot(&self, slot: usize, bytes: &[u8]) -> Result<(), CudaError> {
        let s = self
            .program
            .slots
            .get(slot)
            .ok_or_else(|| CudaError::Data(format!("slot {slot} does not exist")))?;
        if bytes.len() as u64 != s.bytes {
            return Err(CudaError::Data(format!(
                "slot `{}` holds {} bytes, {} were given",
                s.name,
                s.bytes,
                bytes.len()
            )));
        }
        self.write(Place::Slot { slot, offset: 0 }, bytes)
    }

    /// `bytes` bytes from `place`, once every earlier run has finished.
    pub fn read(&self, place: Place, bytes: u64) -> Result<Vec<u8>, CudaError> {
        self.check_place(place, bytes, "read")?;
        self.dev.bind()?;
        if bytes == 0 {
            self.dev.synchronize("reading back to the host")?;
            return Ok(Vec::new());
        }
        let mut out = vec![0u8; bytes as usize];
        // SAFETY: `place` spans `bytes` bytes of a live allocation (checked above), and `out`
        // holds as many; the synchronize below waits for the copy before `out` is used.
        drv(
            unsafe { cu::memcpy_dtoh_async(&mut out, self.address(place), self.dev.stream()) },
            || format!("cuMemcpyDtoHAsync of {bytes} bytes from {place:?}"),
        )?;
        self.dev.synchronize("reading back to the host")?;
        Ok(out)
    }

    /// All of slot `slot`'s bytes, once every earlier run has finished.
    pub fn read_slot(&self, slot: usize) -> Result<Vec<u8>, CudaError> {
        let s = self
            .program
            .slots
            .get(slot)
            .ok_or_else(|| CudaError::Data(format!("slot {slot} does not exist")))?;
        self.read(Place::Slot { slot, offset: 0 }, s.bytes)
    }

    /// Device-to-device copy on the stream, after every earlier run (asynchronous).
    pub fn copy(&self, dst: Place, src: Place, bytes: u64) -> Result<(), CudaError> {
        self.check_place(dst, bytes, "copy destination")?;
        self.check_place(src, bytes, "copy source")?;
        self.dev.bind()?;
        self.memcpy(dst, src, bytes, "a copy between runs")
    }

    /// Makes this program rank `rank`'s of the data-parallel group of `world` that `id`
    /// names: its collectives go to NCCL. Waits until every rank has joined.
    pub fn join_group(
        &mut self,
        id: &[u8; crate::cuda::nccl::UNIQUE_ID_BYTES],
        rank: usize,
        world: usize,
    ) -> Result<(), CudaError> {
        self.dev.bind()?;
        self.comm = Some(crate::cuda::nccl::Communicator::init(id, rank, world)?);
        // The side stream and one event per overlapping collective of the runs.
        let events = self
            .program
            .runs
            .iter()
            .flat_map(|r| &r.commands)
            .filter_map(|c| match c {
                crate::cuda::program::Command::Collective { side: Some(k), .. } => Some(k + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        if events > 0 {
            let event = || {
                drv(
                    cu::event::create(cu_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
                    || "cuEventCreate (a side-stream event)".into(),
                )
            };
            let stream = drv(
                cu::stream::create(cu::stream::StreamKind::NonBlocking),
                || "cuStreamCreate (the side stream of the collectives)".into(),
            )?;
            let fork = event()?;
            let events = (0..events).map(|_| event()).collect::<Result<_, _>>()?;
            self.side = Some(super::load::SideStream {
                stream,
                fork,
                events,
            });
        }
        Ok(())
    }

    /// Every rank's shard in slot `slot` (of `dtype` values) gathered into the whole value
    /// of `whole_bytes`, on the host, once every earlier run has finished. Every rank of the
    /// group must call it, in the same order.
    pub fn gather_slot(
        &self,
        slot: usize,
        dtype: castor_ir::DType,
        whole_bytes: u64,
    ) -> Result<Vec<u8>, CudaError> {
        let comm = self.comm.as_ref().ok_or_else(|| {
            CudaError::Data("gathering a shard needs the rank's communicator".into())
        })?;
        let s = self
            .program
            .slots
            .get(slot)
            .ok_or_else(|| CudaError::Data(format!("slot {slot} does not exist")))?;
        self.dev.bind()?;
        let n = whole_bytes as usize / dtype.size_bytes().max(1);
        let op = castor_ir::Op::AllGather {
            world: comm.world(),
            shape: vec![n],
        };
        // SAFETY: a fresh allocation of `whole_bytes` (at least one byte), freed below after
        // the stream has finished with it.
        let whole = drv(
            unsafe { cu::malloc_sync(whole_bytes.max(1) as usize) },
            || format!("cuMemAlloc of {whole_bytes} bytes to gather `{}`", s.name),
        )?;
        let mut out = vec![0u8; whole_bytes as usize];
        // SAFETY: the slot spans `s.bytes` bytes and `whole` `whole_bytes`; the synchronize
        // waits for the gather and the copy before `out` is used and `whole` freed.
        let result = unsafe {
            comm.issue(
                &op,
                dtype,
                self.address(Place::Slot { slot, offset: 0 }),
                s.bytes,
                whole,
                whole_bytes,
                self.dev.stream(),
            )
            .and_then(|()| {
                drv(
                    cu::memcpy_dtoh_async(&mut out, whole, self.dev.stream()),
                    || format!("cuMemcpyDtoHAsync of the gathered `{}`", s.name),
                )
            })
            .and_then(|()| self.dev.synchronize("gathering a shard"))
        };
        // Nothing may still use it when it is freed, whatever failed.
        let _ = self.dev.synchronize("gathering a shard");
        // SAFETY: allocated above; the stream is idle.
        let _ = unsafe { cu::free_sync(whole) };
        result.map(|()| out)
    }

    /// Waits for every run and copy issued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.dev.bind()?;
        self.dev.synchronize("waiting for the runs")
    }
}
