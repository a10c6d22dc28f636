//! Host reads and writes of a resident program, and device-side copies between runs.

use super::load::Loaded;
use super::{drv, CudaError};
use crate::cuda::program::Place;
use cudarc::driver::result as cu;

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

    /// Waits for every run and copy issued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.dev.bind()?;
        self.dev.synchronize("waiting for the runs")
    }
}
