//! Runs front-end graphs on the CPU reference executor (itself tested op by op against naive
//! loops in the runtime crate).

use castor_ir::{Graph, Tensor};
use castor_runtime::cpu::CpuExecutor;
use std::collections::HashMap;

/// The graph's outputs by name, with `feeds` binding inputs and parameters.
pub fn run(g: &Graph, feeds: &HashMap<String, Tensor>) -> Vec<(String, Tensor)> {
    let outputs = CpuExecutor::new()
        .run(g, &|name| feeds.get(name))
        .unwrap_or_else(|e| panic!("{}: {e}", g.name));
    g.outputs()
        .iter()
        .map(|&v| g.name(v).to_string())
        .zip(outputs)
        .collect()
}
