//! Times the CPU executor on a GPT-2-shaped forward pass with random weights.
//!
//! `cargo run --release -p castor-runtime --example gpt2_forward -- [batch] [seq] [layers]`
//! (defaults 1, 256, 12; GPT-2 small widths). The graph has the ops and layouts that
//! `castor-models` builds for GPT-2: fused QKV, head split by reshape + transpose, causal
//! softmax with a key mask, tanh GELU, tied LM head.

use castor_ir::{BinaryOp, DType, GraphBuilder, IrError, Op, Tensor, TensorType, UnaryOp, Value};
use castor_runtime::cpu::CpuExecutor;
use std::collections::HashMap;
use std::time::Instant;

const HIDDEN: usize = 768;
const HEADS: usize = 12;
const VOCAB: usize = 50257;
const POSITIONS: usize = 1024;

/// A graph under construction and the shapes of its parameters.
struct Gpt2 {
    g: GraphBuilder,
    params: Vec<(String, Vec<usize>)>,
    batch: usize,
    seq: usize,
}

impl Gpt2 {
    fn param(&mut self, name: &str, dims: &[usize]) -> Result<Value, IrError> {
        self.params.push((name.to_string(), dims.to_vec()));
        self.g
            .param(name, TensorType::new(DType::F32, dims.to_vec()))
    }

    fn op(&mut self, name: &str, op: Op, inputs: &[Value]) -> Result<Value, IrError> {
        self.g.op(name, op, inputs)
    }

    fn layer_norm(&mut self, name: &str, x: Value) -> Result<Value, IrError> {
        let w = self.param(&format!("{name}.weight"), &[HIDDEN])?;
        let b = self.param(&format!("{name}.bias"), &[HIDDEN])?;
        self.op(name, Op::LayerNorm { eps: 1e-5 }, &[x, w, b])
    }

    /// A GPT-2 `Conv1D`: `x @ w + b` with `w` stored `[in, out]`.
    fn linear(&mut self, name: &str, x: Value, i: usize, o: usize) -> Result<Value, IrError> {
        let w = self.param(&format!("{name}.weight"), &[i, o])?;
        let b = self.param(&format!("{name}.bias"), &[o])?;
        let y = self.op(&format!("{name}.matmul"), matmul(false, false), &[x, w])?;
        self.op(name, Op::Binary(BinaryOp::Add), &[y, b])
    }

    fn heads(&mut self, name: &str, x: Value) -> Result<Value, IrError> {
        let shape = vec![self.batch, self.seq, HEADS, HIDDEN / HEADS];
        let r = self.op(&format!("{name}.heads"), Op::Reshape { shape }, &[x])?;
        self.op(
            name,
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[r],
        )
    }

    fn block(&mut self, l: usize, h: Value, mask: Value) -> Result<Value, IrError> {
        let p = |n: &str| format!("h.{l}.{n}");
        let x = self.layer_norm(&p("ln_1"), h)?;
        let qkv = self.linear(&p("attn.c_attn"), x, HIDDEN, 3 * HIDDEN)?;
        let split = Op::Split {
            axis: 2,
            sizes: vec![HIDDEN; 3],
        };
        let parts = self.g.op_multi(&p("attn.qkv.split"), split, &[qkv])?;
        let q = self.heads(&p("attn.q"), parts[0])?;
        let k = self.heads(&p("attn.k"), parts[1])?;
        let v = self.heads(&p("attn.v"), parts[2])?;
        let s = self.op(&p("attn.scores"), matmul(false, true), &[q, k])?;
        let factor = 1.0 / ((HIDDEN / HEADS) as f64).sqrt();
        let s = self.op(&p("attn.scores.scaled"), Op::Scale { factor }, &[s])?;
        let probs = self.op(
            &p("attn.probs"),
            Op::Softmax {
                causal: true,
                window: None,
            },
            &[s, mask],
        )?;
        let ctx = self.op(&p("attn.context"), matmul(false, false), &[probs, v])?;
        let perm = vec![0, 2, 1, 3];
        let ctx = self.op(&p("attn.context.t"), Op::Transpose { perm }, &[ctx])?;
        let shape = vec![self.batch, self.seq, HIDDEN];
        let ctx = self.op(&p("attn.context.merged"), Op::Reshape { shape }, &[ctx])?;
        let attn = self.linear(&p("attn.c_proj"), ctx, HIDDEN, HIDDEN)?;
        let h = self.op(&p("attn_residual"), Op::Binary(BinaryOp::Add), &[attn, h])?;
        let x = self.layer_norm(&p("ln_2"), h)?;
        let fc = self.linear(&p("mlp.c_fc"), x, HIDDEN, 4 * HIDDEN)?;
        let act = self.op(&p("mlp.act"), Op::Unary(UnaryOp::GeluTanh), &[fc])?;
        let mlp = self.linear(&p("mlp.c_proj"), act, 4 * HIDDEN, HIDDEN)?;
        self.op(&p("mlp_residual"), Op::Binary(BinaryOp::Add), &[mlp, h])
    }
}

fn matmul(transpose_a: bool, transpose_b: bool) -> Op {
    Op::MatMul {
        transpose_a,
        transpose_b,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let arg = |i: usize, default: usize| args.get(i).copied().unwrap_or(default);
    let (batch, seq, layers) = (arg(0, 1), arg(1, 256), arg(2, 12));

    let mut m = Gpt2 {
        g: GraphBuilder::new("gpt2"),
        params: Vec::new(),
        batch,
        seq,
    };
    let ids =
        m.g.input("input_ids", TensorType::new(DType::I64, [batch, seq]))?;
    let am =
        m.g.input("attention_mask", TensorType::new(DType::I64, [batch, seq]))?;
    let keep = m.op("mask.bool", Op::Cast { to: DType::Bool }, &[am])?;
    let shape = vec![batch, 1, 1, seq];
    let mask = m.op("mask", Op::Reshape { shape }, &[keep])?;
    let wte = m.param("wte.weight", &[VOCAB, HIDDEN])?;
    let wpe = m.param("wpe.weight", &[POSITIONS, HIDDEN])?;
    let tokens = m.op("wte", Op::Embedding { padding: None }, &[wte, ids])?;
    let slice = Op::Slice {
        axis: 0,
        start: 0,
        end: seq,
    };
    let pos = m.op("wpe", slice, &[wpe])?;
    let mut h = m.op("embeddings", Op::Binary(BinaryOp::Add), &[tokens, pos])?;
    for l in 0..layers {
        h = m.block(l, h, mask)?;
    }
    let h = m.layer_norm("ln_f", h)?;
    let logits = m.op("logits", matmul(false, true), &[h, wte])?;
    m.g.set_outputs(vec![logits]);
    let graph = m.g.finish();

    // Deterministic pseudo-random weights (an LCG: speed, not quality).
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04
    };
    let mut bindings: HashMap<String, Tensor> = m
        .params
        .into_iter()
        .map(|(name, dims)| {
            let data = (0..dims.iter().product()).map(|_| next()).collect();
            (name, Tensor::from_f32(DType::F32, dims, data))
        })
        .collect();
    let ids = (0..batch * seq)
        .map(|i| (i * 7919 % VOCAB) as i64)
        .collect();
    let ones = vec![1; batch * seq];
    bindings.insert(
        "input_ids".into(),
        Tensor::from_i64(DType::I64, [batch, seq], ids),
    );
    bindings.insert(
        "attention_mask".into(),
        Tensor::from_i64(DType::I64, [batch, seq], ones),
    );

    let exec = CpuExecutor::new();
    let lookup = |name: &str| bindings.get(name);
    println!(
        "gpt2 forward: batch {batch}, seq {seq}, {layers} layers, {} threads",
        rayon::current_num_threads()
    );
    for i in 0..3 {
        let start = Instant::now();
        let out = exec.run(&graph, &lookup)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        println!("run {i}: {ms:.1} ms (logits {})", out[0].shape());
    }
    Ok(())
}
