//! Tests of the CPU executor, one module per op family. Every kernel is checked against a
//! naive reference written here (index arithmetic in F64) or against hand-computed values.

mod common;

mod casts;
mod dropout;
mod errors;
mod executor;
mod grads;
mod layout;
mod losses;
mod matmul;
mod norms;
mod pointwise;
mod reduce;
mod rope;
mod rounding;
mod softmax;
