//! A naive F32 interpreter of castor's IR, only for checking front-end graphs against the
//! outputs transformers wrote into the fixtures. Slow and simple on purpose: every op is the
//! textbook loop, independent of the runtime crate.
#![allow(dead_code)]

use castor_ir::{BinaryOp, DType, Graph, Op, ReduceOp, Shape, Tensor, TensorData, UnaryOp};
use std::collections::HashMap;

#[derive(Clone, Debug)]
enum Buf {
    F(Vec<f32>),
    I(Vec<i64>),
    B(Vec<bool>),
}

#[derive(Clone, Debug)]
struct Val {
    shape: Vec<usize>,
    buf: Buf,
}

impl Val {
    fn f(&self) -> &[f32] {
        match &self.buf {
            Buf::F(v) => v,
            other => panic!("expected floats, found {other:?}"),
        }
    }
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

fn strides(s: &[usize]) -> Vec<usize> {
    Shape(s.to_vec()).strides()
}

/// Strides of `s` broadcast to `out` (0 on broadcast axes).
fn bstrides(s: &[usize], out: &[usize]) -> Vec<usize> {
    let st = strides(s);
    let off = out.len() - s.len();
    (0..out.len())
        .map(|i| {
            if i < off || s[i - off] == 1 {
                0
            } else {
                st[i - off]
            }
        })
        .collect()
}

/// Offsets into a broadcast operand for every output index, in row-major order.
fn offsets(s: &[usize], out: &[usize]) -> Vec<usize> {
    let bs = bstrides(s, out);
    let n = numel(out);
    let mut res = Vec::with_capacity(n);
    let mut idx = vec![0usize; out.len()];
    for _ in 0..n {
        res.push(idx.iter().zip(&bs).map(|(i, s)| i * s).sum());
        for a in (0..out.len()).rev() {
            idx[a] += 1;
            if idx[a] < out[a] {
                break;
            }
            idx[a] = 0;
        }
    }
    res
}

fn erf(x: f64) -> f64 {
    // Abramowitz & Stegun 7.1.26 is too coarse; use the series / continued fraction split.
    if x.abs() < 2.5 {
        // Maclaurin series.
        let mut sum = x;
        let mut term = x;
        let x2 = x * x;
        for n in 1..200 {
            term *= -x2 / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // Continued fraction for erfc.
        let ax = x.abs();
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (ax + f);
        }
        let erfc = (-ax * ax).exp() / std::f64::consts::PI.sqrt() / (ax + f);
        (1.0 - erfc).copysign(x)
    }
}

fn unary(op: UnaryOp, x: f32) -> f32 {
    let xd = x as f64;
    let y = match op {
        UnaryOp::GeluTanh => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * xd * (1.0 + (c * (xd + 0.044715 * xd * xd * xd)).tanh())
        }
        UnaryOp::GeluErf => 0.5 * xd * (1.0 + erf(xd / std::f64::consts::SQRT_2)),
        UnaryOp::Silu => xd / (1.0 + (-xd).exp()),
        UnaryOp::Tanh => xd.tanh(),
        UnaryOp::Exp => xd.exp(),
        UnaryOp::Rsqrt => 1.0 / xd.sqrt(),
        UnaryOp::Neg => -xd,
    };
    y as f32
}

fn to_val(t: &Tensor) -> Val {
    let buf = match t.data() {
        TensorData::F32(v) => Buf::F(v.clone()),
        TensorData::I64(v) => Buf::I(v.clone()),
        TensorData::Bool(v) => Buf::B(v.clone()),
    };
    Val {
        shape: t.shape().0.clone(),
        buf,
    }
}

fn to_tensor(v: &Val) -> Tensor {
    match &v.buf {
        Buf::F(x) => Tensor::from_f32(DType::F32, v.shape.clone(), x.clone()),
        Buf::I(x) => Tensor::from_i64(DType::I64, v.shape.clone(), x.clone()),
        Buf::B(x) => Tensor::from_bool(v.shape.clone(), x.clone()),
    }
}

/// Runs the graph; `feeds` binds inputs and parameters by name. Returns the outputs by name.
pub fn run(g: &Graph, feeds: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let mut vals: Vec<Option<Val>> = vec![None; g.num_values()];
    let users = g.users();
    let mut remaining: Vec<usize> = users.iter().map(Vec::len).collect();
    let outputs: Vec<usize> = g.outputs().iter().map(|v| v.index()).collect();
    for (_, node) in g.nodes() {
        let out_ty = g.ty(node.outputs[0]).clone();
        let ins: Vec<&Val> = node
            .inputs
            .iter()
            .map(|v| vals[v.index()].as_ref().expect("operand computed"))
            .collect();
        let results: Vec<Val> = match &node.op {
            Op::Input | Op::Param => {
                let name = g.name(node.outputs[0]);
                let t = feeds
                    .get(name)
                    .unwrap_or_else(|| panic!("no value bound to `{name}`"));
                assert_eq!(t.shape(), &out_ty.shape, "`{name}`");
                vec![to_val(t)]
            }
            Op::Split { axis, sizes } => split(ins[0], *axis, sizes),
            op => vec![eval(op, &ins, &out_ty.shape.0)],
        };
        for (&o, r) in node.outputs.iter().zip(results) {
            vals[o.index()] = Some(r);
        }
        for v in &node.inputs {
            remaining[v.index()] -= 1;
            if remaining[v.index()] == 0 && !outputs.contains(&v.index()) {
                vals[v.index()] = None;
            }
        }
    }
    g.outputs()
        .iter()
        .map(|&v| {
            (
                g.name(v).to_string(),
                to_tensor(vals[v.index()].as_ref().expect("output computed")),
            )
        })
        .collect()
}

fn split(x: &Val, axis: usize, sizes: &[usize]) -> Vec<Val> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&s| {
            let v = slice(x, axis, start, start + s);
            start += s;
            v
        })
        .collect()
}

fn slice(x: &Val, axis: usize, start: usize, end: usize) -> Val {
    let outer = numel(&x.shape[..axis]);
    let inner = numel(&x.shape[axis + 1..]);
    let len = x.shape[axis];
    let mut shape = x.shape.clone();
    shape[axis] = end - start;
    let pick = |i: usize, j: usize| (i * len + j) * inner;
    let buf = match &x.buf {
        Buf::F(v) => Buf::F(
            (0..outer)
                .flat_map(|i| {
                    (start..end).flat_map(move |j| v[pick(i, j)..pick(i, j) + inner].to_vec())
                })
                .collect(),
        ),
        Buf::I(v) => Buf::I(
            (0..outer)
                .flat_map(|i| {
                    (start..end).flat_map(move |j| v[pick(i, j)..pick(i, j) + inner].to_vec())
                })
                .collect(),
        ),
        Buf::B(v) => Buf::B(
            (0..outer)
                .flat_map(|i| {
                    (start..end).flat_map(move |j| v[pick(i, j)..pick(i, j) + inner].to_vec())
                })
                .collect(),
        ),
    };
    Val { shape, buf }
}

fn eval(op: &Op, ins: &[&Val], out: &[usize]) -> Val {
    let f = |v: Vec<f32>| Val {
        shape: out.to_vec(),
        buf: Buf::F(v),
    };
    match op {
        Op::Input | Op::Param | Op::Split { .. } => unreachable!("handled by run"),
        Op::Embedding => {
            let table = ins[0];
            let h = table.shape[1];
            let ids = match &ins[1].buf {
                Buf::I(v) => v,
                _ => panic!("ids"),
            };
            let t = table.f();
            let mut o = Vec::with_capacity(ids.len() * h);
            for &id in ids {
                let id = usize::try_from(id).expect("id >= 0");
                assert!(id < table.shape[0], "id {id} out of range");
                o.extend_from_slice(&t[id * h..(id + 1) * h]);
            }
            f(o)
        }
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => {
            let (a, b) = (ins[0], ins[1]);
            let ra = a.shape.len();
            let rb = b.shape.len();
            let (am, ak) = (a.shape[ra - 2], a.shape[ra - 1]);
            let (bk, bn) = (b.shape[rb - 2], b.shape[rb - 1]);
            let (m, k) = if *transpose_a { (ak, am) } else { (am, ak) };
            let n = if *transpose_b { bk } else { bn };
            let batch = &out[..out.len() - 2];
            let oa = offsets(&a.shape[..ra - 2], batch);
            let ob = offsets(&b.shape[..rb - 2], batch);
            let (av, bv) = (a.f(), b.f());
            let mut o = vec![0f32; numel(out)];
            for (bi, (&pa, &pb)) in oa.iter().zip(&ob).enumerate() {
                let pa = pa * am * ak;
                let pb = pb * bk * bn;
                for i in 0..m {
                    for j in 0..n {
                        let mut acc = 0f64;
                        for kk in 0..k {
                            let x = if *transpose_a {
                                av[pa + kk * ak + i]
                            } else {
                                av[pa + i * ak + kk]
                            };
                            let y = if *transpose_b {
                                bv[pb + j * bn + kk]
                            } else {
                                bv[pb + kk * bn + j]
                            };
                            acc += x as f64 * y as f64;
                        }
                        o[bi * m * n + i * n + j] = acc as f32;
                    }
                }
            }
            f(o)
        }
        Op::Unary(u) => f(ins[0].f().iter().map(|&x| unary(*u, x)).collect()),
        Op::Binary(b) => {
            let oa = offsets(&ins[0].shape, out);
            let ob = offsets(&ins[1].shape, out);
            let (x, y) = (ins[0].f(), ins[1].f());
            f(oa.iter()
                .zip(&ob)
                .map(|(&i, &j)| match b {
                    BinaryOp::Add => x[i] + y[j],
                    BinaryOp::Sub => x[i] - y[j],
                    BinaryOp::Mul => x[i] * y[j],
                    BinaryOp::Div => x[i] / y[j],
                })
                .collect())
        }
        Op::Scale { factor } => f(ins[0]
            .f()
            .iter()
            .map(|&x| (x as f64 * factor) as f32)
            .collect()),
        Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
            let x = ins[0].f();
            let h = *out.last().unwrap();
            let w = ins[1].f();
            let bias = ins.get(2).map(|b| b.f());
            let mut o = Vec::with_capacity(x.len());
            for row in x.chunks_exact(h) {
                let (mean, denom) = if matches!(op, Op::LayerNorm { .. }) {
                    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
                    let var =
                        row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
                    (mean, (var + eps).sqrt())
                } else {
                    let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / h as f64;
                    (0.0, (ms + eps).sqrt())
                };
                for (i, &v) in row.iter().enumerate() {
                    let mut y = (v as f64 - mean) / denom * w[i] as f64;
                    if let Some(b) = bias {
                        y += b[i] as f64;
                    }
                    o.push(y as f32);
                }
            }
            f(o)
        }
        Op::Softmax { causal } => {
            let x = ins[0].f();
            let r = out.len();
            let (tq, tk) = (out[r - 2], out[r - 1]);
            let mask: Option<Vec<bool>> = ins.get(1).map(|m| {
                let mv = match &m.buf {
                    Buf::B(v) => v,
                    _ => panic!("mask"),
                };
                offsets(&m.shape, out).into_iter().map(|i| mv[i]).collect()
            });
            let mut o = vec![0f32; x.len()];
            for (ri, row) in x.chunks_exact(tk).enumerate() {
                let qi = ri % tq;
                let keep = |j: usize| {
                    (!*causal || j <= qi + tk - tq) && mask.as_ref().is_none_or(|m| m[ri * tk + j])
                };
                let kept: Vec<usize> = (0..tk).filter(|&j| keep(j)).collect();
                if kept.is_empty() {
                    o[ri * tk..(ri + 1) * tk].fill(1.0 / tk as f32);
                    continue;
                }
                let mx = kept
                    .iter()
                    .map(|&j| row[j] as f64)
                    .fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = kept.iter().map(|&j| (row[j] as f64 - mx).exp()).sum();
                for &j in &kept {
                    o[ri * tk + j] = ((row[j] as f64 - mx).exp() / s) as f32;
                }
            }
            f(o)
        }
        Op::Rope { theta } => {
            let x = ins[0].f();
            let r = out.len();
            let (t, d) = (out[r - 2], out[r - 1]);
            let half = d / 2;
            let mut cos = vec![0f32; t * half];
            let mut sin = vec![0f32; t * half];
            for p in 0..t {
                for i in 0..half {
                    // As transformers: inv_freq in f32, angle = pos * inv_freq in f32.
                    let e = (2 * i) as f32 / d as f32;
                    let inv = 1.0f32 / (*theta as f32).powf(e);
                    let a = p as f32 * inv;
                    cos[p * half + i] = a.cos();
                    sin[p * half + i] = a.sin();
                }
            }
            let mut o = vec![0f32; x.len()];
            for (ri, row) in x.chunks_exact(d).enumerate() {
                let p = ri % t;
                for i in 0..half {
                    let (c, s) = (cos[p * half + i], sin[p * half + i]);
                    let (x1, x2) = (row[i], row[i + half]);
                    o[ri * d + i] = x1 * c - x2 * s;
                    o[ri * d + i + half] = x2 * c + x1 * s;
                }
            }
            f(o)
        }
        Op::Reshape { .. } => Val {
            shape: out.to_vec(),
            buf: ins[0].buf.clone(),
        },
        Op::Transpose { perm } => {
            let x = ins[0];
            let st = strides(&x.shape);
            let pst: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
            let n = numel(out);
            let mut idx = vec![0usize; out.len()];
            let mut src = Vec::with_capacity(n);
            for _ in 0..n {
                src.push(idx.iter().zip(&pst).map(|(i, s)| i * s).sum::<usize>());
                for a in (0..out.len()).rev() {
                    idx[a] += 1;
                    if idx[a] < out[a] {
                        break;
                    }
                    idx[a] = 0;
                }
            }
            let buf = match &x.buf {
                Buf::F(v) => Buf::F(src.iter().map(|&i| v[i]).collect()),
                Buf::I(v) => Buf::I(src.iter().map(|&i| v[i]).collect()),
                Buf::B(v) => Buf::B(src.iter().map(|&i| v[i]).collect()),
            };
            Val {
                shape: out.to_vec(),
                buf,
            }
        }
        Op::Slice { axis, start, end } => slice(ins[0], *axis, *start, *end),
        Op::Concat { axis } => {
            let outer = numel(&out[..*axis]);
            let mut o = Vec::new();
            for i in 0..outer {
                for x in ins {
                    let chunk = numel(&x.shape[*axis..]);
                    o.extend_from_slice(&x.f()[i * chunk..(i + 1) * chunk]);
                }
            }
            f(o)
        }
        Op::Reduce { op, axes, .. } => {
            let x = ins[0];
            let keep: Vec<usize> = (0..x.shape.len())
                .map(|a| if axes.contains(&a) { 1 } else { x.shape[a] })
                .collect();
            let idx = offsets(&keep, &x.shape);
            // `offsets` maps a full index to the reduced one via broadcasting.
            let n = numel(&keep);
            let init = if *op == ReduceOp::Max {
                f64::NEG_INFINITY
            } else {
                0.0
            };
            let mut acc = vec![init; n];
            let count = (numel(&x.shape) / n.max(1)) as f64;
            for (i, &v) in x.f().iter().enumerate() {
                let a = &mut acc[idx[i]];
                match op {
                    ReduceOp::Max => *a = a.max(v as f64),
                    _ => *a += v as f64,
                }
            }
            if *op == ReduceOp::Mean {
                acc.iter_mut().for_each(|a| *a /= count);
            }
            f(acc.into_iter().map(|a| a as f32).collect())
        }
        Op::CrossEntropy { .. } => panic!("cross_entropy is not used by front-end graphs"),
        Op::Cast { to } => {
            let x = ins[0];
            let buf = match (&x.buf, to) {
                (Buf::I(v), DType::Bool) => Buf::B(v.iter().map(|&i| i != 0).collect()),
                (Buf::F(v), DType::Bool) => Buf::B(v.iter().map(|&i| i != 0.0).collect()),
                (Buf::I(v), d) if d.is_float() => Buf::F(v.iter().map(|&i| i as f32).collect()),
                (Buf::F(v), d) if d.is_float() => Buf::F(v.clone()),
                (b, _) => b.clone(),
            };
            Val {
                shape: out.to_vec(),
                buf,
            }
        }
    }
}
