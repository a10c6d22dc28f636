//! Classify: every node's class, from its op.

use crate::{Pass, PassError, PassReport};
use castor_ir::{Graph, OpClass};
use std::collections::BTreeMap;

/// Reports how many nodes of each op kind fall in each class. The class is a property of the
/// op (`Op::class`), so the graph is returned unchanged; the pass makes the classification
/// visible and is the first thing a precision policy reads.
pub struct Classify;

impl Pass for Classify {
    fn name(&self) -> &'static str {
        "classify"
    }

    fn run(&self, graph: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut by_class: BTreeMap<OpClass, BTreeMap<&str, usize>> = BTreeMap::new();
        for (_, node) in graph.nodes().filter(|(_, n)| !n.op.is_source()) {
            *by_class
                .entry(node.op.class())
                .or_default()
                .entry(node.op.mnemonic())
                .or_default() += 1;
        }
        // Communication only shows in data-parallel plans that have it.
        let counts: Vec<String> = OpClass::ALL
            .iter()
            .filter(|&&c| c != OpClass::Communication || by_class.contains_key(&c))
            .map(|c| format!("{c} {}", by_class.get(c).map_or(0, |m| m.values().sum())))
            .collect();
        let mut report = PassReport::new(format!("classified: {}", counts.join(", ")));
        for (class, kinds) in &by_class {
            let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
            report
                .details
                .push(format!("{class}: {}", kinds.join(", ")));
        }
        Ok((graph.clone(), report))
    }
}
