//! Typed references into a [`Graph`](crate::Graph)'s arenas.
//!
//! Nodes and values live in vectors owned by the graph and are referred to by `u32` indices
//! wrapped in distinct types, so a node id can never be used as a value id. Indices are small,
//! `Copy`, hashable, and stable for the life of a graph; a pass that restructures a graph builds
//! a new one. Because both arenas are filled in definition order, iterating them *is* a
//! topological order, and printing is deterministic.

use std::fmt;

/// A node: one operation with its operands and results.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Node(pub u32);

/// A value: one tensor result of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value(pub u32);

impl Node {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl Value {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}
