//! Device time between points of the stream, measured with CUDA events: how long a step's
//! runs took on the GPU itself, apart from the host (`castor train --profile`), and how long
//! each command of a run took (`castor train --profile-kernels`).

use super::load::Loaded;
use super::{drv, CudaError};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cu_sys;

/// A new timing event.
fn new_event(what: &str) -> Result<cu_sys::CUevent, CudaError> {
    drv(
        cu::event::create(cu_sys::CUevent_flags::CU_EVENT_DEFAULT),
        || format!("cuEventCreate ({what})"),
    )
}

impl Loaded {
    /// Records mark `mark` (created on first use) on the stream, after everything issued so
    /// far. Marks are outside captured graphs, so they time whole runs.
    pub fn mark(&mut self, mark: usize) -> Result<(), CudaError> {
        self.dev.bind()?;
        while self.marks.len() <= mark {
            self.marks.push(new_event("a timing mark")?);
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

    /// Issues run `run` command by command, not as a graph, with an event before each command
    /// and after the last, waits for it, and returns each command's device time in
    /// milliseconds. The commands and their order are those of [`Loaded::run`], so the results
    /// are the same; only the gaps a graph would close are in the times.
    pub fn run_timed(&mut self, run: usize) -> Result<Vec<f32>, CudaError> {
        self.dev.bind()?;
        let Some(r) = self.program.runs.get(run) else {
            return Err(CudaError::Data(format!(
                "run {run} does not exist (the program has {})",
                self.program.runs.len()
            )));
        };
        let n = r.commands.len();
        while self.command_marks.len() <= n {
            self.command_marks.push(new_event("a command timing mark")?);
        }
        self.set_workspace()?;
        let record = |e: cu_sys::CUevent| {
            // SAFETY: the event is live and the stream belongs to the current context.
            drv(unsafe { cu::event::record(e, self.dev.stream()) }, || {
                "cuEventRecord (command timing)".into()
            })
        };
        let commands = &self.program.runs[run].commands;
        for (i, c) in commands.iter().enumerate() {
            record(self.command_marks[i])?;
            self.issue(std::slice::from_ref(c))?;
        }
        record(self.command_marks[n])?;
        // SAFETY: the event is live and was recorded on our stream.
        drv(
            unsafe { cu::event::synchronize(self.command_marks[n]) },
            || "cuEventSynchronize (command timing)".into(),
        )?;
        self.command_marks
            .windows(2)
            .take(n)
            .map(|w| {
                // SAFETY: both events are live and have completed.
                drv(unsafe { cu::event::elapsed(w[0], w[1]) }, || {
                    "cuEventElapsedTime".into()
                })
            })
            .collect()
    }
}
