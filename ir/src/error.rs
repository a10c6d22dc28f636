//! The IR's error type.

use crate::Location;
use std::fmt;

/// Where in a graph an error was found: the node's first result name and, for parsed text,
/// its line and column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    pub node: String,
    pub location: Option<Location>,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node `%{}`", self.node)?;
        if let Some(l) = self.location {
            write!(f, " at line {}, column {}", l.line, l.column)?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum IrError {
    #[error("value name `%{name}` is defined twice")]
    DuplicateName { name: String },
    #[error("{site}: {message}")]
    Invalid { site: Site, message: String },
    #[error("line {line}, column {column}: {message}")]
    Parse {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("graph has a cycle through {site}: a value is used before it is defined")]
    Cycle { site: Site },
}
