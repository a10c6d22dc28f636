//! Shared helpers: a deterministic RNG, graph building and running, naive references.

use castor_ir::{DType, Graph, GraphBuilder, Op, Tensor, TensorType, Value};
use castor_runtime::cpu::CpuExecutor;
use castor_runtime::RuntimeError;
use std::collections::HashMap;

/// xorshift64*: small, deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn tensor(&mut self, dtype: DType, shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_f32(dtype, shape.to_vec(), self.vec(n))
    }
}

pub fn ty(dtype: DType, shape: &[usize]) -> TensorType {
    TensorType::new(dtype, shape.to_vec())
}

/// Runs `graph` with the given bindings.
pub fn run(graph: &Graph, bindings: &[(&str, &Tensor)]) -> Result<Vec<Tensor>, RuntimeError> {
    let map: HashMap<&str, &Tensor> = bindings.iter().copied().collect();
    CpuExecutor::new().run(graph, &|name| map.get(name).copied())
}

/// Runs a graph of one op applied to inputs `x0, x1, ...` of the given tensors' types.
pub fn run_op(op: Op, inputs: &[&Tensor]) -> Result<Tensor, RuntimeError> {
    let graph = op_graph(op, inputs, None);
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("x{i}")).collect();
    let bindings: Vec<(&str, &Tensor)> = names
        .iter()
        .map(|n| n.as_str())
        .zip(inputs.iter().copied())
        .collect();
    Ok(run(&graph, &bindings)?.remove(0))
}

/// A graph applying `op` to inputs named `x0, x1, ...`, with its result typed `dtype` if given.
pub fn op_graph(op: Op, inputs: &[&Tensor], dtype: Option<DType>) -> Graph {
    let mut b = GraphBuilder::new("op");
    let vs: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            b.input(&format!("x{i}"), t.ty().clone())
                .expect("fresh name")
        })
        .collect();
    let y = match dtype {
        Some(d) => b.op_with_dtype("y", op, &vs, d),
        None => b.op("y", op, &vs),
    }
    .expect("well-typed op");
    b.set_outputs(vec![y]);
    b.finish()
}

pub fn f32s(t: &Tensor) -> &[f32] {
    t.as_f32().expect("a float tensor")
}

/// Asserts `|got - want| <= tol * max(1, |want|)` elementwise.
pub fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= tol * w.abs().max(1.0) || (g.is_nan() && w.is_nan()),
            "element {i}: got {g}, want {w} (error {err:e})"
        );
    }
}

/// Row-major strides.
pub fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// The multi-index of flat position `i` in `dims`.
pub fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = i % dims[d];
        i /= dims[d];
    }
    idx
}

/// The flat position in `shape` that output index `idx` (of a broadcast shape) reads.
pub fn broadcast_index(idx: &[usize], shape: &[usize]) -> usize {
    let pad = idx.len() - shape.len();
    let s = strides(shape);
    (0..shape.len())
        .map(|d| {
            if shape[d] == 1 {
                0
            } else {
                idx[pad + d] * s[d]
            }
        })
        .sum()
}
