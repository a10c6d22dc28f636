//! Autodiff: reverse mode over the IR, one vector-Jacobian product rule per op.
//!
//! The input graph's first output is a scalar loss. The pass appends the backward pass to the
//! forward graph and returns a graph whose outputs are the loss and, for every parameter that
//! can reach the loss, its gradient, named `grad.<parameter name>`. Parameters that cannot reach
//! the loss get a zero gradient, so every trainable parameter has one.
//!
//! Dtypes: the gradient of a value has the value's dtype (activation gradients in BF16 where
//! the forward stored BF16), except that parameters and their low-precision copies get F32
//! gradients: contributions are widened as they arrive, and a contraction producing a weight
//! gradient writes F32 directly, so parameter gradients accumulate in F32. Contributions to one
//! value are summed in the order their uses appear in the forward graph (deterministic).
//!
//! For training, the backward pass can start from a scaled seed (loss scaling, and the
//! `1/N` of gradient accumulation) and leave frozen parameters out.

use crate::{Pass, PassError, PassReport};
use castor_ir::{
    BinaryOp, DType, Graph, GraphBuilder, Node, Op, ReduceOp, Shape, TensorType, UnaryOp, Value,
};
use std::collections::BTreeMap;

/// The name of a parameter's gradient: the autodiff pass's output, and the training plan's
/// state entry it is written to.
pub fn grad_name(param: &str) -> String {
    format!("grad.{param}")
}

/// The autodiff pass.
#[derive(Clone, Debug, Default)]
pub struct Autodiff {
    /// Parameters that get no gradient (frozen), by name.
    pub frozen: Vec<String>,
    /// Where the backward pass starts.
    pub seed: Seed,
    /// Compute each weight-gradient contribution in the dtype of the low-precision working
    /// copy it flows through (as PyTorch autocast and llm.c do) instead of writing F32
    /// directly; the copy's gradient is widened to F32 for its master. Cheaper, but an F16
    /// weight gradient can overflow where an F32 one would not.
    pub param_grads_in_compute_dtype: bool,
}

/// The gradient of the loss with respect to itself, where the backward pass starts.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Seed {
    /// 1: the gradients of the loss.
    #[default]
    One,
    /// An F32 scalar `state` of this name (the loss scale) times `factor`: gradients of
    /// `loss * scale * factor`.
    Scaled { state: String, factor: f64 },
}

impl Pass for Autodiff {
    fn name(&self) -> &'static str {
        "autodiff"
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        castor_ir::verify(g)?;
        let loss = *g
            .outputs()
            .first()
            .ok_or_else(|| bad("the graph has no output to differentiate"))?;
        let lt = g.ty(loss);
        if lt.shape.rank() != 0 || !lt.dtype.is_float() {
            return Err(bad(&format!(
                "the loss `%{}` must be a float scalar, found {lt}",
                g.name(loss)
            )));
        }
        let trainable = |v: Value| !self.frozen.iter().any(|f| f == g.name(v));
        let needs = needs_grad(g, loss, &trainable);
        let mut ad = Backward {
            b: GraphBuilder::from_graph(g.clone()),
            grads: BTreeMap::new(),
            fwd: g,
            copy_grads_in_compute_dtype: self.param_grads_in_compute_dtype,
        };
        let seed_name = format!("{}.grad_seed", g.name(loss));
        let seed = match &self.seed {
            Seed::One => ad.b.op(
                &seed_name,
                Op::Full {
                    value: 1.0,
                    dtype: lt.dtype,
                    shape: vec![],
                },
                &[],
            )?,
            Seed::Scaled { state, factor } => {
                let scale =
                    ad.b.state(state, TensorType::new(DType::F32, Shape::scalar()))?;
                let mut seed = scale;
                if *factor != 1.0 {
                    seed =
                        ad.b.op(&seed_name, Op::Scale { factor: *factor }, &[seed])?;
                }
                ad.convert(seed, lt.dtype, &seed_name)?
            }
        };
        ad.grads.insert(loss, vec![seed]);
        for (n, node) in g.nodes().collect::<Vec<_>>().into_iter().rev() {
            if node.op.is_source() || !node.inputs.iter().any(|v| needs[v.index()]) {
                continue;
            }
            // The gradient of a node (the sum of its results' contributions and its VJP) runs
            // in the node's block.
            ad.b.set_block(node.block);
            let dys: Vec<Option<Value>> = node
                .outputs
                .iter()
                .map(|&v| ad.total(v))
                .collect::<Result<_, _>>()?;
            if dys.iter().all(Option::is_none) {
                continue;
            }
            ad.vjp(n, &dys, &needs)?;
        }
        ad.b.set_block(None);

        let mut outputs = vec![loss];
        let mut with_grad = 0;
        for p in g.params().filter(|&p| trainable(p)) {
            let name = grad_name(g.name(p));
            let grad = match ad.total(p)? {
                Some(v) => {
                    with_grad += 1;
                    ad.convert(v, DType::F32, &name)?
                }
                None => {
                    let shape = g.ty(p).shape.0.clone();
                    ad.b.op(
                        &name,
                        Op::Full {
                            value: 0.0,
                            dtype: DType::F32,
                            shape,
                        },
                        &[],
                    )?
                }
            };
            if ad.b.graph().name(grad) != name {
                ad.b.rename(grad, &name)?;
            }
            outputs.push(grad);
        }
        ad.b.set_outputs(outputs);
        let out = ad.b.finish();
        let report = PassReport::new(format!(
            "differentiated `%{}`: {} backward nodes; {with_grad} of {} parameters reach the loss{}",
            g.name(loss),
            out.num_nodes() - g.num_nodes(),
            g.params().count(),
            if self.frozen.is_empty() {
                String::new()
            } else {
                format!(" ({} frozen)", self.frozen.len())
            }
        ));
        Ok((out, report))
    }
}

fn bad(message: &str) -> PassError {
    PassError::Policy {
        source_name: "autodiff".into(),
        message: message.to_string(),
    }
}

/// Values on a path from a trainable parameter to the loss.
fn needs_grad(g: &Graph, loss: Value, trainable: &dyn Fn(Value) -> bool) -> Vec<bool> {
    let mut from_param = vec![false; g.num_values()];
    for (_, node) in g.nodes() {
        let reached = (node.op == Op::Param && trainable(node.outputs[0]))
            || node.inputs.iter().any(|v| from_param[v.index()]);
        let float_outputs = node.outputs.iter().filter(|&&v| g.ty(v).dtype.is_float());
        for &v in float_outputs {
            from_param[v.index()] = reached;
        }
    }
    let mut to_loss = vec![false; g.num_values()];
    to_loss[loss.index()] = true;
    for (_, node) in g.nodes().collect::<Vec<_>>().into_iter().rev() {
        if node.outputs.iter().any(|v| to_loss[v.index()]) {
            for &v in &node.inputs {
                to_loss[v.index()] = true;
            }
        }
    }
    (0..g.num_values())
        .map(|i| from_param[i] && to_loss[i])
        .collect()
}

/// What a VJP rule reads of its node: the operands, the first result, the gradient's name,
/// and which operands need a gradient.
struct Site<'a> {
    x: &'a [Value],
    y: Value,
    name: &'a str,
    needs: Vec<bool>,
}

impl Site<'_> {
    fn need(&self, i: usize) -> bool {
        self.needs.get(i).copied().unwrap_or(false)
    }
}

struct Backward<'g> {
    b: GraphBuilder,
    /// Gradient contributions per forward value, in arrival order.
    grads: BTreeMap<Value, Vec<Value>>,
    fwd: &'g Graph,
    copy_grads_in_compute_dtype: bool,
}

impl Backward<'_> {
    /// The dtype a value's gradient has: F32 for parameters and (unless gradients stay in the
    /// compute dtype) their copies.
    fn grad_dtype(&self, v: Value) -> DType {
        let producer = self.fwd.node(self.fwd.value(v).producer);
        // An FP8 cast's gradient is the gradient of what it casts (it passes through).
        if let Op::Quantize { .. } = producer.op {
            return self.grad_dtype(producer.inputs[0]);
        }
        let producer = &producer.op;
        if matches!(producer, Op::ParamCopy { .. }) && self.copy_grads_in_compute_dtype {
            self.fwd.ty(v).dtype
        } else if matches!(producer, Op::Param | Op::ParamCopy { .. }) {
            DType::F32
        } else {
            self.fwd.ty(v).dtype
        }
    }

    /// The summed gradient of `v`, or `None` if nothing reached it.
    fn total(&mut self, v: Value) -> Result<Option<Value>, PassError> {
        let Some(parts) = self.grads.remove(&v) else {
            return Ok(None);
        };
        let name = format!("{}.grad", self.fwd.name(v));
        let mut acc = parts[0];
        for &p in &parts[1..] {
            acc = self.b.op(&name, Op::Binary(BinaryOp::Add), &[acc, p])?;
        }
        Ok(Some(acc))
    }

    /// Records `d` as a gradient contribution to `v`, widened or narrowed to `v`'s gradient
    /// dtype and summed over broadcast dims down to `v`'s shape.
    fn contribute(&mut self, v: Value, d: Value) -> Result<(), PassError> {
        let name = format!("{}.grad", self.fwd.name(v));
        let dtype = self.grad_dtype(v);
        let d = self.reduce_to(d, &self.fwd.ty(v).shape.clone(), dtype, &name)?;
        let d = self.convert(d, dtype, &name)?;
        self.grads.entry(v).or_default().push(d);
        Ok(())
    }

    fn convert(&mut self, v: Value, dtype: DType, name: &str) -> Result<Value, PassError> {
        if self.b.ty(v).dtype == dtype {
            Ok(v)
        } else {
            Ok(self
                .b
                .op(&format!("{name}.{dtype}"), Op::Cast { to: dtype }, &[v])?)
        }
    }

    /// Sums `d` over the dims that broadcasting added or stretched, so it has `shape`.
    /// The sum is written in `dtype`, the gradient's dtype, so a bias gradient summed over
    /// every token is not first rounded to (or overflowed in) a narrower activation dtype.
    fn reduce_to(
        &mut self,
        d: Value,
        shape: &Shape,
        dtype: DType,
        name: &str,
    ) -> Result<Value, PassError> {
        let have = self.b.ty(d).shape.clone();
        if &have == shape {
            return Ok(d);
        }
        let extra = have.rank() - shape.rank();
        let axes: Vec<usize> = (0..have.rank())
            .filter(|&i| i < extra || (shape.0[i - extra] == 1 && have.0[i] != 1))
            .collect();
        let summed = self.b.op_with_dtype(
            &format!("{name}.sum"),
            Op::Reduce {
                op: ReduceOp::Sum,
                axes,
                keepdim: false,
            },
            &[d],
            dtype,
        )?;
        if &self.b.ty(summed).shape == shape {
            Ok(summed)
        } else {
            Ok(self.b.op(
                &format!("{name}.reshape"),
                Op::Reshape {
                    shape: shape.0.clone(),
                },
                &[summed],
            )?)
        }
    }

    fn ty(&self, v: Value) -> TensorType {
        self.b.ty(v).clone()
    }

    /// Applies node `n`'s VJP rule to its output gradients `dys`.
    fn vjp(&mut self, n: Node, dys: &[Option<Value>], needs: &[bool]) -> Result<(), PassError> {
        let node = self.fwd.node(n).clone();
        let x = &node.inputs;
        let y = node.outputs[0];
        let name = format!("{}.grad", self.fwd.name(y));
        let need = |i: usize| x.get(i).is_some_and(|v| needs[v.index()]);
        let site = Site {
            x,
            y,
            name: &name,
            needs: x.iter().map(|v| needs[v.index()]).collect(),
        };
        let dy = dys[0];
        let with_dtype =
            |b: &mut GraphBuilder, name: &str, op: Op, inputs: &[Value], dtype: DType| {
                b.op_with_dtype(name, op, inputs, dtype)
            };
        match &node.op {
            Op::Input | Op::Param | Op::Full { .. } => {}
            Op::Embedding { padding } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let vocab = self.fwd.ty(x[0]).shape.0[0];
                    let op = Op::EmbeddingGrad {
                        vocab,
                        padding: *padding,
                    };
                    let d = self.b.op(&name, op, &[x[1], dy])?;
                    self.contribute(x[0], d)?;
                }
            }
            Op::MatMul {
                transpose_a: ta,
                transpose_b: tb,
            } => {
                let Some(dy) = dy else { return Ok(()) };
                let (a, b) = (x[0], x[1]);
                // A contraction may write a wider dtype than it reads (F16 operands, F32
                // output): its gradient products run in the operands' dtype, as PyTorch's
                // autocast backward does.
                let dy = self.convert(dy, self.b.ty(a).dtype, &format!("{name}.dy"))?;
                if need(0) {
                    let op = if *ta {
                        Op::MatMul {
                            transpose_a: *tb,
                            transpose_b: true,
                        }
                    } else {
                        Op::MatMul {
                            transpose_a: false,
                            transpose_b: !*tb,
                        }
                    };
                    let operands = if *ta { [b, dy] } else { [dy, b] };
                    let dtype = self.grad_dtype(a);
                    let d = with_dtype(&mut self.b, &format!("{name}.lhs"), op, &operands, dtype)?;
                    self.contribute(a, d)?;
                }
                if need(1) {
                    let dtype = self.grad_dtype(b);
                    let d =
                        self.matmul_rhs_grad(a, b, dy, *ta, *tb, &format!("{name}.rhs"), dtype)?;
                    self.contribute(b, d)?;
                }
            }
            Op::Binary(op) => self.vjp_binary(&site, op, dy)?,
            Op::Scale { factor } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let d = self.b.op(&name, Op::Scale { factor: *factor }, &[dy])?;
                    self.contribute(x[0], d)?;
                }
            }
            Op::Unary(u) => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let d = match u {
                        UnaryOp::Neg => self.b.op(&name, Op::Unary(UnaryOp::Neg), &[dy])?,
                        _ => {
                            let dy = self.convert(dy, self.fwd.ty(x[0]).dtype, &name)?;
                            self.b.op(&name, Op::UnaryGrad(*u), &[x[0], dy])?
                        }
                    };
                    self.contribute(x[0], d)?;
                }
            }
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
                let Some(dy) = dy else { return Ok(()) };
                let op = if matches!(node.op, Op::LayerNorm { .. }) {
                    Op::LayerNormGrad { eps: *eps }
                } else {
                    Op::RmsNormGrad { eps: *eps }
                };
                // The norm's backward reads dy in its own dtype when that is narrower than the
                // input's: widening to F32 is exact, so a cast would only copy the values.
                let xd = self.fwd.ty(x[0]).dtype;
                let dy = if widens_exactly(self.b.ty(dy).dtype, xd) {
                    dy
                } else {
                    self.convert(dy, xd, &name)?
                };
                let outs = self.b.op_multi(&name, op, &[x[0], x[1], dy])?;
                for (i, &d) in outs.iter().enumerate() {
                    if need(i) {
                        self.contribute(x[i], d)?;
                    }
                }
            }
            Op::Attention {
                causal,
                window,
                scale,
                library,
                dropout,
            } => {
                let Some(dy) = dy else { return Ok(()) };
                if !(need(0) || need(1) || need(2)) {
                    return Ok(());
                }
                // The output gradient enters the kernel's products in the output's dtype.
                let (o, lse) = (y, node.outputs[1]);
                let dy = self.convert(dy, self.fwd.ty(o).dtype, &name)?;
                // The mask and the dropout key (the same key and stream: the backward
                // regenerates the forward's dropout mask).
                let mut operands = vec![x[0], x[1], x[2], o, lse, dy];
                operands.extend_from_slice(&x[3..]);
                let op = Op::AttentionGrad {
                    causal: *causal,
                    window: *window,
                    scale: *scale,
                    library: *library,
                    dropout: *dropout,
                };
                let outs = self.b.op_multi(&name, op, &operands)?;
                for (i, &d) in outs.iter().enumerate() {
                    if need(i) {
                        self.contribute(x[i], d)?;
                    }
                }
            }
            Op::Softmax { .. } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let dtype = self.fwd.ty(x[0]).dtype;
                    let d = with_dtype(&mut self.b, &name, Op::SoftmaxGrad, &[y, dy], dtype)?;
                    self.contribute(x[0], d)?;
                }
            }
            // The same mask (same key and stream), regenerated: dx = dropout(dy).
            Op::Dropout { p, stream } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let op = Op::Dropout {
                        p: *p,
                        stream: *stream,
                    };
                    let d = self.b.op(&name, op, &[dy, x[1]])?;
                    self.contribute(x[0], d)?;
                }
            }
            Op::Rope { theta, scaling } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let op = Op::RopeGrad {
                        theta: *theta,
                        scaling: *scaling,
                    };
                    let mut operands = vec![dy];
                    operands.extend(x.get(1));
                    let d = self.b.op(&name, op, &operands)?;
                    self.contribute(x[0], d)?;
                }
            }
            Op::Reshape { .. } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let shape = self.fwd.ty(x[0]).shape.0.clone();
                    let d = self.b.op(&name, Op::Reshape { shape }, &[dy])?;
                    self.contribute(x[0], d)?;
                }
            }
            Op::Transpose { perm } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let mut inverse = vec![0; perm.len()];
                    for (i, &p) in perm.iter().enumerate() {
                        inverse[p] = i;
                    }
                    let d = self.b.op(&name, Op::Transpose { perm: inverse }, &[dy])?;
                    self.contribute(x[0], d)?;
                }
            }
            Op::Slice { axis, start, end } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let len = self.fwd.ty(x[0]).shape.0[*axis];
                    let op = Op::Pad {
                        axis: *axis,
                        before: *start,
                        after: len - end,
                    };
                    let d = self.b.op(&name, op, &[dy])?;
                    self.contribute(x[0], d)?;
                }
            }
            Op::Concat { axis } => {
                let Some(dy) = dy else { return Ok(()) };
                let sizes: Vec<usize> = x.iter().map(|&v| self.fwd.ty(v).shape.0[*axis]).collect();
                let parts = self
                    .b
                    .op_multi(&name, Op::Split { axis: *axis, sizes }, &[dy])?;
                for (i, &d) in parts.iter().enumerate() {
                    if need(i) {
                        self.contribute(x[i], d)?;
                    }
                }
            }
            Op::Split { axis, sizes } => self.vjp_split(&site, (axis, sizes), dys)?,
            Op::Reduce { op, axes, .. } => self.vjp_reduce(&site, (op, axes), dy)?,
            Op::CrossEntropy { ignore_index } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    let dtype = self.fwd.ty(x[0]).dtype;
                    let op = Op::CrossEntropyGrad {
                        ignore_index: *ignore_index,
                    };
                    let d = with_dtype(&mut self.b, &name, op, &[x[0], x[1], dy], dtype)?;
                    self.contribute(x[0], d)?;
                }
            }
            // The fused classifier's gradient recomputes each chunk's logits with the forward's
            // accumulation; its dhidden and dweight products accumulate in F32, as the eager
            // backward's.
            Op::LinearCrossEntropy {
                ignore_index,
                chunk_rows,
                logits,
            } => {
                if let (true, Some(dy)) = (need(0) || need(1), dy) {
                    let op = Op::LinearCrossEntropyGrad {
                        ignore_index: *ignore_index,
                        chunk_rows: *chunk_rows,
                        logits: *logits,
                    };
                    let d = self.b.op_multi(&name, op, &[x[0], x[1], x[2], dy])?;
                    self.b.set_acc(d[0], node.acc);
                    if need(0) {
                        self.contribute(x[0], d[0])?;
                    }
                    if need(1) {
                        self.contribute(x[1], d[1])?;
                    }
                }
            }
            // The FP8 cast passes the gradient through, as torchao's does; scales (and the
            // amax) are constants of the step.
            Op::Cast { .. } | Op::ParamCopy { .. } | Op::Quantize { .. } => {
                if let (true, Some(dy)) = (need(0), dy) {
                    self.contribute(x[0], dy)?;
                }
            }
            Op::Fp8Scale { .. } | Op::AmaxHistory { .. } => {}
            Op::Fp8MatMul {
                transpose_a: false,
                transpose_b: tb,
            } => {
                let Some(dy) = dy else { return Ok(()) };
                self.vjp_fp8_matmul(&site, *tb, dy)?;
            }
            Op::AllReduce { .. }
            | Op::ReduceScatter { .. }
            | Op::AllGather { .. }
            | Op::Shard { .. } => self.vjp_collective(&site, &node.op, dy)?,
            other => {
                return Err(bad(&format!("no gradient rule for `{}`", other.mnemonic())));
            }
        }
        Ok(())
    }

    /// The VJP of `y = fp8_matmul(a, b, a_scale, b_scale)` (`a` not transposed; `b` a
    /// matrix): the output gradient is cast to E5M2 with its own tensorwise scale, and both
    /// gradient products take FP8 operands, as torchao's float8 linear computes them:
    /// `da = dy op(b)ᵀ` and `db` from `aᵀ dy` (every row of `a` folded into one product).
    fn vjp_fp8_matmul(&mut self, site: &Site, tb: bool, dy: Value) -> Result<(), PassError> {
        let (x, name) = (site.x, site.name);
        let (a, b, a_scale, b_scale) = (x[0], x[1], x[2], x[3]);
        let to = DType::F8E5M2;
        // Under delayed scaling (the activation's scale is state), the gradient's cast reads
        // its scale from its own amax history of the same length.
        let history = self.delayed_history(a_scale);
        let dy_scale = match history {
            Some(_) => {
                let scalar = TensorType::new(DType::F32, castor_ir::Shape(vec![]));
                self.b.state(&format!("{name}.dy_scale"), scalar)?
            }
            None => self.b.op(
                &format!("{name}.dy_scale"),
                Op::Fp8Scale { to, margin: 0 },
                &[dy],
            )?,
        };
        let cast = self.b.op_multi(
            &format!("{name}.dy_fp8"),
            Op::Quantize { to },
            &[dy, dy_scale],
        )?;
        self.b.rename(cast[1], &format!("{name}.dy_amax"))?;
        let dy8 = cast[0];
        if let Some(h) = history {
            let ty = TensorType::new(DType::F32, castor_ir::Shape(vec![h]));
            let past = self.b.state(&format!("{name}.dy_amax_history"), ty)?;
            let next = self.b.op_multi(
                &format!("{name}.dy_amax_history.next"),
                Op::AmaxHistory { to, margin: 0 },
                &[past, dy_scale, cast[1]],
            )?;
            self.b.rename(next[1], &format!("{name}.dy_scale.next"))?;
            self.b.set_acc(next[0], Some(castor_ir::Accum::F32));
        }
        if site.need(0) {
            let op = Op::Fp8MatMul {
                transpose_a: false,
                transpose_b: !tb,
            };
            let dtype = self.grad_dtype(a);
            let d = self.b.op_with_dtype(
                &format!("{name}.lhs"),
                op,
                &[dy8, b, dy_scale, b_scale],
                dtype,
            )?;
            self.contribute(a, d)?;
        }
        if site.need(1) {
            let (at, dyt) = (self.ty(a), self.ty(dy8));
            let (k, n) = (at.shape.last(), dyt.shape.last());
            let rows = at.shape.numel().unwrap_or(0) / k.max(1);
            let flat = |s: &mut Self, v: Value, cols: usize, what: &str| {
                if s.ty(v).shape.rank() == 2 {
                    Ok(v)
                } else {
                    s.b.op(
                        &format!("{name}.rhs.{what}2d"),
                        Op::Reshape {
                            shape: vec![rows, cols],
                        },
                        &[v],
                    )
                }
            };
            let a2 = flat(self, a, k, "a")?;
            let dy2 = flat(self, dy8, n, "dy")?;
            // `x Wᵀ`: dW [n, k] = dyᵀ x; `x W`: dW [k, n] = xᵀ dy.
            let operands = if tb {
                [dy2, a2, dy_scale, a_scale]
            } else {
                [a2, dy2, a_scale, dy_scale]
            };
            let op = Op::Fp8MatMul {
                transpose_a: true,
                transpose_b: false,
            };
            let dtype = self.grad_dtype(b);
            let d = self
                .b
                .op_with_dtype(&format!("{name}.rhs"), op, &operands, dtype)?;
            self.contribute(b, d)?;
        }
        Ok(())
    }

    /// The amax history length when `scale` (a forward FP8 cast's scale) is delayed-scaling
    /// state, read off the `amax_history` node that updates it.
    fn delayed_history(&self, scale: Value) -> Option<usize> {
        let g = self.b.graph();
        if g.node(g.value(scale).producer).op != Op::State {
            return None;
        }
        g.nodes()
            .find(|(_, n)| matches!(n.op, Op::AmaxHistory { .. }) && n.inputs[1] == scale)
            .and_then(|(_, n)| g.ty(n.inputs[0]).shape.dims().first().copied())
    }

    /// The VJP of an elementwise binary op.
    fn vjp_binary(
        &mut self,
        site: &Site,
        op: &BinaryOp,
        dy: Option<Value>,
    ) -> Result<(), PassError> {
        let (x, y, name) = (site.x, site.y, site.name);
        let Some(dy) = dy else { return Ok(()) };
        let (a, b) = (x[0], x[1]);
        match op {
            BinaryOp::Add | BinaryOp::Sub => {
                if site.need(0) {
                    self.contribute(a, dy)?;
                }
                if site.need(1) {
                    let d = if *op == BinaryOp::Sub {
                        self.b
                            .op(&format!("{name}.rhs"), Op::Unary(UnaryOp::Neg), &[dy])?
                    } else {
                        dy
                    };
                    self.contribute(b, d)?;
                }
            }
            BinaryOp::Mul => {
                if site.need(0) {
                    let d =
                        self.b
                            .op(&format!("{name}.lhs"), Op::Binary(BinaryOp::Mul), &[dy, b])?;
                    self.contribute(a, d)?;
                }
                if site.need(1) {
                    let d =
                        self.b
                            .op(&format!("{name}.rhs"), Op::Binary(BinaryOp::Mul), &[dy, a])?;
                    self.contribute(b, d)?;
                }
            }
            BinaryOp::Div => {
                if site.need(0) {
                    let d =
                        self.b
                            .op(&format!("{name}.lhs"), Op::Binary(BinaryOp::Div), &[dy, b])?;
                    self.contribute(a, d)?;
                }
                if site.need(1) {
                    // d(a/b)/db = -y/b
                    let t =
                        self.b
                            .op(&format!("{name}.rhs.q"), Op::Binary(BinaryOp::Div), &[y, b])?;
                    let t = self.b.op(
                        &format!("{name}.rhs.p"),
                        Op::Binary(BinaryOp::Mul),
                        &[dy, t],
                    )?;
                    let d = self
                        .b
                        .op(&format!("{name}.rhs"), Op::Unary(UnaryOp::Neg), &[t])?;
                    self.contribute(b, d)?;
                }
            }
        }
        Ok(())
    }

    /// The VJP of a split: the pieces' gradients concatenated, or padded and summed where
    /// some piece has none.
    fn vjp_split(
        &mut self,
        site: &Site,
        (axis, sizes): (&usize, &[usize]),
        dys: &[Option<Value>],
    ) -> Result<(), PassError> {
        let (x, name) = (site.x, site.name);
        if !site.need(0) {
            return Ok(());
        }
        let total: usize = sizes.iter().sum();
        let mut start = 0;
        let mut pieces = Vec::new();
        for (i, (&size, dy)) in sizes.iter().zip(dys).enumerate() {
            if let Some(dy) = dy {
                let op = Op::Pad {
                    axis: *axis,
                    before: start,
                    after: total - start - size,
                };
                // Every piece present: concatenate instead of padding and adding.
                pieces.push((i, *dy, op));
            }
            start += size;
        }
        let d = if pieces.len() == sizes.len() {
            let parts: Vec<Value> = pieces.iter().map(|p| p.1).collect();
            self.b.op(name, Op::Concat { axis: *axis }, &parts)?
        } else {
            let mut acc: Option<Value> = None;
            for (i, dy, op) in pieces {
                let padded = self.b.op(&format!("{name}.{i}"), op, &[dy])?;
                acc = Some(match acc {
                    None => padded,
                    Some(a) => self.b.op(name, Op::Binary(BinaryOp::Add), &[a, padded])?,
                });
            }
            match acc {
                Some(a) => a,
                None => return Ok(()),
            }
        };
        self.contribute(x[0], d)?;
        Ok(())
    }

    /// The VJP of a reduction: the gradient broadcast back over the reduced axes.
    fn vjp_reduce(
        &mut self,
        site: &Site,
        (op, axes): (&ReduceOp, &[usize]),
        dy: Option<Value>,
    ) -> Result<(), PassError> {
        let (x, name) = (site.x, site.name);
        let (true, Some(dy)) = (site.need(0), dy) else {
            return Ok(());
        };
        let xs = self.fwd.ty(x[0]).shape.clone();
        let kept: Vec<usize> =
            xs.0.iter()
                .enumerate()
                .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
                .collect();
        let r = self.b.op(
            &format!("{name}.keepdim"),
            Op::Reshape { shape: kept },
            &[dy],
        )?;
        let mut d = self.b.op(
            name,
            Op::BroadcastTo {
                shape: xs.0.clone(),
            },
            &[r],
        )?;
        match op {
            ReduceOp::Sum => {}
            ReduceOp::Mean => {
                let count: usize = axes.iter().map(|&a| xs.0[a]).product();
                d = self.b.op(
                    &format!("{name}.mean"),
                    Op::Scale {
                        factor: 1.0 / count as f64,
                    },
                    &[d],
                )?;
            }
            ReduceOp::Max => {
                return Err(bad("no gradient rule for `max` (no model family uses it)"))
            }
        }
        self.contribute(x[0], d)?;
        Ok(())
    }

    /// The VJP of a collective: each rank's loss is its own, so the gradient of the group's
    /// total flows back through the transposed exchange.
    fn vjp_collective(&mut self, site: &Site, op: &Op, dy: Option<Value>) -> Result<(), PassError> {
        let (x, name) = (site.x, site.name);
        match op {
            // Collectives: each rank's loss is its own, the gradient of the group's total
            // flows back through the transposed exchange.
            Op::AllReduce { reduce, world } => {
                if let (true, Some(dy)) = (site.need(0), dy) {
                    let op = Op::AllReduce {
                        reduce: *reduce,
                        world: *world,
                    };
                    let d = self.b.op(name, op, &[dy])?;
                    self.contribute(x[0], d)?;
                }
            }
            Op::ReduceScatter { world, average } => {
                if let (true, Some(dy)) = (site.need(0), dy) {
                    let shape = self.fwd.ty(x[0]).shape.0.clone();
                    let op = Op::AllGather {
                        world: *world,
                        shape,
                    };
                    let mut d = self.b.op(name, op, &[dy])?;
                    if *average {
                        let factor = 1.0 / *world as f64;
                        d = self
                            .b
                            .op(&format!("{name}.mean"), Op::Scale { factor }, &[d])?;
                    }
                    self.contribute(x[0], d)?;
                }
            }
            // A gathered (or sharded) value is the same on every rank: its gradient is the
            // sum of the ranks' gradients, each rank keeping its shard (or gathering them).
            Op::AllGather { world, .. } => {
                if let (true, Some(dy)) = (site.need(0), dy) {
                    let op = Op::ReduceScatter {
                        world: *world,
                        average: false,
                    };
                    let d = self.b.op(name, op, &[dy])?;
                    self.contribute(x[0], d)?;
                }
            }
            Op::Shard { world } => {
                if let (true, Some(dy)) = (site.need(0), dy) {
                    let shape = self.fwd.ty(x[0]).shape.0.clone();
                    let op = Op::AllGather {
                        world: *world,
                        shape,
                    };
                    let d = self.b.op(name, op, &[dy])?;
                    self.contribute(x[0], d)?;
                }
            }
            other => {
                return Err(bad(&format!("`{}` is not a collective", other.mnemonic())));
            }
        }
        Ok(())
    }

    /// The gradient of a matmul's right operand `b`. When `b` is a 2-D weight shared across
    /// the batch, the batch is folded into the rows: one GEMM, no batch of partial products.
    #[allow(clippy::too_many_arguments)]
    fn matmul_rhs_grad(
        &mut self,
        a: Value,
        b: Value,
        dy: Value,
        ta: bool,
        tb: bool,
        name: &str,
        dtype: DType,
    ) -> Result<Value, PassError> {
        let (at, dyt) = (self.ty(a), self.ty(dy));
        let fold = !ta && at.shape.rank() > 2 && self.fwd.ty(b).shape.rank() == 2;
        if fold {
            let k = at.shape.last();
            let n = dyt.shape.last();
            let rows = at.shape.numel().unwrap_or(0) / k.max(1);
            let a2 = self.b.op(
                &format!("{name}.a2d"),
                Op::Reshape {
                    shape: vec![rows, k],
                },
                &[a],
            )?;
            let dy2 = self.b.op(
                &format!("{name}.dy2d"),
                Op::Reshape {
                    shape: vec![rows, n],
                },
                &[dy],
            )?;
            let (op, operands) = if tb {
                (
                    Op::MatMul {
                        transpose_a: true,
                        transpose_b: false,
                    },
                    [dy2, a2],
                )
            } else {
                (
                    Op::MatMul {
                        transpose_a: true,
                        transpose_b: false,
                    },
                    [a2, dy2],
                )
            };
            return Ok(self.b.op_with_dtype(name, op, &operands, dtype)?);
        }
        let (op, operands) = if tb {
            (
                Op::MatMul {
                    transpose_a: true,
                    transpose_b: ta,
                },
                [dy, a],
            )
        } else {
            (
                Op::MatMul {
                    transpose_a: !ta,
                    transpose_b: false,
                },
                [a, dy],
            )
        };
        Ok(self.b.op_with_dtype(name, op, &operands, dtype)?)
    }
}

/// Whether every `from` value is exactly a `to` value (a 16-bit float widened to F32).
fn widens_exactly(from: DType, to: DType) -> bool {
    from == to || (matches!(from, DType::F16 | DType::BF16) && to == DType::F32)
}
