//! Input uploads that do not wait for the device.
//!
//! A training step's inputs (token ids, labels, the learning rate) change every step, so they
//! are written before each replay. A plain `cuMemcpyHtoD` from pageable memory, or an
//! asynchronous copy followed by a synchronize, makes the host wait for every run queued
//! before it: steps could not queue. Instead each input slot has two pinned host buffers used
//! in turn. A write copies the bytes into the next buffer, queues the upload on the stream
//! (after every earlier run, so a run still reading the slot finishes first) and records an
//! event; it waits only when that buffer's previous upload, two writes ago, has not left it
//! yet. The host can therefore prepare batch `n + 1` while the device runs step `n`, and is
//! held back once it is two uploads ahead.

use super::load::Loaded;
use super::{drv, CudaError};
use crate::cuda::program::{Place, SlotKind};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cu_sys;

/// Which of the two buffers a write uses, and whether it must first wait for that buffer's
/// previous upload. Kept apart from the driver calls so the turn-taking is tested anywhere.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Turns {
    next: usize,
    in_flight: [bool; 2],
}

impl Turns {
    /// The buffer the next write uses and whether an upload from it may still be running.
    pub(super) fn claim(&mut self) -> (usize, bool) {
        let k = self.next;
        let wait = self.in_flight[k];
        self.in_flight[k] = true;
        self.next = 1 - k;
        (k, wait)
    }
}

/// One pinned host buffer and the event recorded after its last upload.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
    event: cu_sys::CUevent,
}

/// An input slot's two pinned buffers.
pub(super) struct StagedSlot {
    slot: usize,
    buffers: [Pinned; 2],
    turns: Turns,
}

/// The pinned staging of every input slot of a program.
#[derive(Default)]
pub(super) struct Staging {
    slots: Vec<StagedSlot>,
}

impl Staging {
    /// Two pinned buffers and two events for every input slot of `loaded`'s program (in the
    /// current context). What was made before a failure is freed by [`Staging`]'s drop.
    pub(super) fn for_inputs(loaded: &Loaded) -> Result<Staging, CudaError> {
        let mut staging = Staging::default();
        for (slot, s) in loaded.program.slots.iter().enumerate() {
            if !matches!(s.kind, SlotKind::Input(_)) || s.bytes == 0 {
                continue;
            }
            let bytes = s.bytes as usize;
            let mut made: Vec<Pinned> = Vec::with_capacity(2);
            for _ in 0..2 {
                // SAFETY: a plain page-locked allocation of `bytes`, freed in `drop`.
                let ptr = drv(unsafe { cu::malloc_host(bytes, 0) }, || {
                    format!("cuMemAllocHost of {bytes} bytes staging input `{}`", s.name)
                })?;
                let event = match cu::event::create(cu_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                {
                    Ok(e) => e,
                    Err(source) => {
                        // SAFETY: `ptr` was just allocated by cuMemAllocHost and is unused.
                        let _ = unsafe { cu::free_host(ptr) };
                        return Err(CudaError::Driver {
                            what: format!("cuEventCreate staging input `{}`", s.name),
                            source,
                        });
                    }
                };
                made.push(Pinned {
                    ptr: ptr.cast(),
                    bytes,
                    event,
                });
            }
            let (b1, b0) = (made.pop(), made.pop());
            if let (Some(b0), Some(b1)) = (b0, b1) {
                staging.slots.push(StagedSlot {
                    slot,
                    buffers: [b0, b1],
                    turns: Turns::default(),
                });
            }
        }
        Ok(staging)
    }

    pub(super) fn get_mut(&mut self, slot: usize) -> Option<&mut StagedSlot> {
        self.slots.iter_mut().find(|s| s.slot == slot)
    }
}

impl StagedSlot {
    /// Queues the upload of `bytes` (the slot's exact size, checked by the caller) to the
    /// device address `dst` on `stream`, through the next pinned buffer.
    pub(super) fn upload(
        &mut self,
        dst: u64,
        bytes: &[u8],
        stream: cu_sys::CUstream,
        name: &str,
    ) -> Result<(), CudaError> {
        let (k, wait) = self.turns.claim();
        let b = &self.buffers[k];
        if bytes.len() != b.bytes {
            return Err(CudaError::Data(format!(
                "input `{name}` holds {} bytes, {} were given",
                b.bytes,
                bytes.len()
            )));
        }
        if wait {
            // SAFETY: the event was created with the buffer and recorded after its last
            // upload.
            drv(unsafe { cu::event::synchronize(b.event) }, || {
                format!("cuEventSynchronize (staging input `{name}`)")
            })?;
        }
        // SAFETY: the pinned buffer holds `b.bytes` bytes and no upload reads it any more
        // (its event completed, or it was never used); `bytes` has that length.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.ptr, b.bytes) };
        // SAFETY: `dst` spans the slot's bytes (checked at load); the pinned source stays
        // untouched until the event recorded below completes.
        drv(
            unsafe { cu_sys::cuMemcpyHtoDAsync_v2(dst, b.ptr.cast(), b.bytes, stream) }.result(),
            || format!("cuMemcpyHtoDAsync of {} bytes to input `{name}`", b.bytes),
        )?;
        // SAFETY: the event and the stream are live.
        drv(unsafe { cu::event::record(b.event, stream) }, || {
            format!("cuEventRecord (staging input `{name}`)")
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The owner synchronized the stream before dropping, so no upload reads a buffer.
        for s in self.slots.drain(..) {
            for b in s.buffers {
                // SAFETY: each event and buffer was created by `for_inputs`, is idle, and is
                // destroyed or freed once here.
                unsafe {
                    let _ = cu::event::destroy(b.event);
                    let _ = cu::free_host(b.ptr.cast());
                }
            }
        }
    }
}

impl Loaded {
    /// Replaces input slot `slot`'s bytes with `bytes`, asynchronously: the upload is queued
    /// after every earlier run through a pinned staging buffer (see the module doc), and this
    /// returns without waiting for the device. Other slots are written synchronously.
    pub fn write_input(&mut self, slot: usize, bytes: &[u8]) -> Result<(), CudaError> {
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
        let name = s.name.clone();
        let dst = self.address(Place::Slot { slot, offset: 0 });
        self.dev.bind()?;
        let stream = self.dev.stream();
        match self.staging.get_mut(slot) {
            Some(staged) => staged.upload(dst, bytes, stream, &name),
            None => self.write_slot(slot, bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Turns;

    #[test]
    fn writes_alternate_buffers_and_wait_only_two_uploads_back() {
        let mut t = Turns::default();
        // The first use of each buffer has nothing to wait for.
        assert_eq!(t.claim(), (0, false));
        assert_eq!(t.claim(), (1, false));
        // From then on each write waits for the upload two writes before it.
        assert_eq!(t.claim(), (0, true));
        assert_eq!(t.claim(), (1, true));
        assert_eq!(t.claim(), (0, true));
    }
}
