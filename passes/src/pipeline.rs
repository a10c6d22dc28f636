//! Running passes in order.

use crate::{Pass, PassError, PassReport};
use castor_ir::{text, verify, Graph};

/// Passes in order, with the debugging switches every compiler needs: verify after each pass,
/// and keep the IR text after a named pass.
pub struct Pipeline {
    passes: Vec<Box<dyn Pass>>,
    verify_each: bool,
    dump_after: Option<String>,
}

/// The final graph, each pass's report, and the requested dump.
pub struct PipelineOutput {
    pub graph: Graph,
    pub reports: Vec<(&'static str, PassReport)>,
    /// IR text after the pass named by [`Pipeline::dump_after`].
    pub dump: Option<String>,
}

impl Pipeline {
    pub fn new(passes: Vec<Box<dyn Pass>>) -> Self {
        Pipeline {
            passes,
            verify_each: cfg!(debug_assertions),
            dump_after: None,
        }
    }

    pub fn pass_names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Verify the graph after every pass (on by default in debug builds and tests).
    pub fn verify_each(mut self, on: bool) -> Self {
        self.verify_each = on;
        self
    }

    /// Keep the IR text after the pass called `name` (`input` for the graph before any pass).
    pub fn dump_after(mut self, name: Option<&str>) -> Result<Self, PassError> {
        if let Some(n) = name {
            if n != "input" && !self.passes.iter().any(|p| p.name() == n) {
                let mut names = vec!["input"];
                names.extend(self.pass_names());
                return Err(PassError::UnknownPass {
                    name: n.to_string(),
                    available: names.join(", "),
                });
            }
        }
        self.dump_after = name.map(str::to_string);
        Ok(self)
    }

    pub fn run(&self, graph: Graph) -> Result<PipelineOutput, PassError> {
        let mut dump = (self.dump_after.as_deref() == Some("input")).then(|| text::print(&graph));
        let mut graph = graph;
        let mut reports = Vec::new();
        for pass in &self.passes {
            let (next, report) = pass.run(&graph)?;
            if self.verify_each {
                verify(&next).map_err(|source| PassError::Verify {
                    pass: pass.name().to_string(),
                    source,
                })?;
            }
            if self.dump_after.as_deref() == Some(pass.name()) {
                dump = Some(text::print(&next));
            }
            reports.push((pass.name(), report));
            graph = next;
        }
        Ok(PipelineOutput {
            graph,
            reports,
            dump,
        })
    }
}
