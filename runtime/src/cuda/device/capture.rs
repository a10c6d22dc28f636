//! Capturing a run's commands as a CUDA graph: issued once on the capturing stream, then
//! instantiated; every later launch of the run replays the graph.

use super::load::Loaded;
use super::{drv, CudaError};
use crate::cuda::program::Command;
use cudarc::driver::result as cu;
use cudarc::driver::sys as cu_sys;

impl Loaded {
    /// Captures `commands` on the stream and instantiates the graph.
    pub(super) fn capture(
        &self,
        name: &str,
        commands: &[Command],
    ) -> Result<cu_sys::CUgraphExec, CudaError> {
        // Host-side cuBLAS state is read when each product is captured.
        self.set_workspace()?;
        let stream = self.dev.stream();
        // SAFETY: the stream is ours, not capturing, and belongs to the current context.
        drv(
            unsafe {
                cu::stream::begin_capture(
                    stream,
                    cu_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            },
            || format!("cuStreamBeginCapture for run `{name}`"),
        )?;
        let issued = self.issue(commands);
        // Capture always ends, so that the stream is usable again after a failure.
        // SAFETY: the stream is capturing, begun on this thread above.
        let ended = unsafe { cu::stream::end_capture(stream) };
        let graph = match (issued, ended) {
            (Ok(()), Ok(graph)) => graph,
            (Ok(()), Err(source)) => {
                return Err(CudaError::Driver {
                    what: format!("cuStreamEndCapture for run `{name}`"),
                    source,
                })
            }
            (Err(e), ended) => {
                if let Ok(graph) = ended {
                    if !graph.is_null() {
                        // SAFETY: the graph was just created by the capture and is unused.
                        let _ = unsafe { cu::graph::destroy(graph) };
                    }
                }
                return Err(e);
            }
        };
        // SAFETY: `graph` is the valid graph just captured.
        let exec = unsafe { cu::graph::instantiate(graph, cu_sys::CUgraphInstantiate_flags(0)) };
        // The executable graph is independent of the graph it was made from.
        // SAFETY: `graph` is live and destroyed once.
        let _ = unsafe { cu::graph::destroy(graph) };
        drv(exec, || format!("cuGraphInstantiate for run `{name}`"))
    }
}
