//! What a pass is.

use crate::PassError;
use castor_ir::Graph;

/// A graph-to-graph transformation with a report of what it did.
pub trait Pass {
    /// The name used by `--dump-after` and in reports.
    fn name(&self) -> &'static str;
    fn run(&self, graph: &Graph) -> Result<(Graph, PassReport), PassError>;
}

/// What a pass did, for people: a one-line summary and optional detail lines.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    pub summary: String,
    pub details: Vec<String>,
}

impl PassReport {
    pub fn new(summary: impl Into<String>) -> Self {
        PassReport {
            summary: summary.into(),
            details: Vec::new(),
        }
    }
}
