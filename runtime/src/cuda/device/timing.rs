//! Device time between points of the stream, measured with CUDA events: how long a step's
//! runs took on the GPU itself, apart from the host (`castor train --profile`).

use super::load::Loaded;
use super::{drv, CudaError};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cu_sys;

impl Loaded {
    /// Records mark `mark` (created on first use) on the stream, after everything issued so
    /// far. Marks are outside captured graphs, so they time whole runs.
    pub fn mark(&mut self, mark: usize) -> Result<(), CudaError> {
        self.dev.bind()?;
        while self.marks.len() <= mark {
            let e = drv(
                cu::event::create(cu_sys::CUevent_flags::CU_EVENT_DEFAULT),
                || "cuEventCreate (a timing mark)".into(),
            )?;
            self.marks.push(e);
        }
        // SAFETY: the event is live and the stream belongs to the current context.
        drv(
            unsafe { cu::event::record(self.marks[mark], self.dev.stream()) },
            || format!("cuEventRecord (timing mark {mark})"),
        )
    }

    /// Milliseconds of device time from mark `from` to mark `to`, waiting for `to`.
    pub fn elapsed_ms(&self, from: usize, to: usize) -> Result<f32, CudaError> {
        let (Some(&a), Some(&b)) = (self.marks.get(from), self.marks.get(to)) else {
            return Err(CudaError::Data(format!(
                "timing marks {from} and {to} were not both recorded"
            )));
        };
        self.dev.bind()?;
        // SAFETY: both events are live and were recorded on our stream.
        drv(unsafe { cu::event::synchronize(b) }, || {
            "cuEventSynchronize (timing)".into()
        })?;
        // SAFETY: as above; `b` has completed.
        drv(unsafe { cu::event::elapsed(a, b) }, || {
            "cuEventElapsedTime".into()
        })
    }
}
