//! The IR's one text format. [`print`] and [`parse`] are inverses:
//! `print(&parse(&print(g))?) == print(g)` for every graph.
//!
//! ```text
//! graph tiny {
//!   %x: f32[2,4] = input
//!   %w: f32[4,3] = param
//!   %y: f32[2,3] = matmul(%x, %w) {transpose_a=false, transpose_b=false}
//!   %a: f32[2,1], %b: f32[2,2] = split(%y) {axis=1, sizes=[1,2]}  # a note
//!   return %y, %b
//! }
//! ```
//!
//! One node per line: results with their types, `=`, the op, operands in parentheses (omitted
//! for sources), attributes in braces, and an optional note after `#`. Lines that hold only a
//! `#` comment are ignored.

mod parse;
mod print;

pub use parse::parse;
pub use print::print;
