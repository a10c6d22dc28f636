//! Building graphs with type inference and model-traceable names.

use crate::{DType, Graph, IrError, ModelShape, Op, Site, TensorType, Value};

/// Appends typed nodes to a graph. Result types come from [`Op::infer`], so a builder can only
/// make well-typed nodes; a typing error names the node being built.
///
/// Names are `scope.name` (`h.3.attn.qkv`); a name already taken gets a numeric suffix
/// (`h.3.attn.qkv.1`), so callers never have to invent unique names.
pub struct GraphBuilder {
    graph: Graph,
    scopes: Vec<String>,
    /// The block the nodes being appended belong to (sources excepted).
    block: Option<u32>,
}

impl GraphBuilder {
    pub fn new(name: impl Into<String>) -> Self {
        GraphBuilder {
            graph: Graph::new(name),
            scopes: Vec::new(),
            block: None,
        }
    }

    /// Starts a new graph that continues an existing one.
    pub fn from_graph(graph: Graph) -> Self {
        GraphBuilder {
            graph,
            scopes: Vec::new(),
            block: None,
        }
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn ty(&self, v: Value) -> &TensorType {
        self.graph.ty(v)
    }

    /// Runs `f` with `scope` appended to the current name prefix.
    pub fn scoped<T>(&mut self, scope: &str, f: impl FnOnce(&mut Self) -> T) -> T {
        self.scopes.push(scope.to_string());
        let out = f(self);
        self.scopes.pop();
        out
    }

    /// Records the model's shape on the graph.
    pub fn set_shape(&mut self, shape: ModelShape) {
        self.graph.shape = Some(shape);
    }

    /// The block that nodes appended from now on belong to (`None`: outside every block).
    pub fn set_block(&mut self, block: Option<u32>) {
        self.block = block;
    }

    pub fn block(&self) -> Option<u32> {
        self.block
    }

    /// A graph input with an exact name (no scope, no suffix): inputs are bound by name.
    pub fn input(&mut self, name: &str, ty: TensorType) -> Result<Value, IrError> {
        self.source(Op::Input, name, ty)
    }

    /// A parameter named by its checkpoint tensor name (no scope, no suffix).
    pub fn param(&mut self, name: &str, ty: TensorType) -> Result<Value, IrError> {
        self.source(Op::Param, name, ty)
    }

    /// A `state` source: persistent training state bound by name.
    pub fn state(&mut self, name: &str, ty: TensorType) -> Result<Value, IrError> {
        self.source(Op::State, name, ty)
    }

    fn source(&mut self, op: Op, name: &str, ty: TensorType) -> Result<Value, IrError> {
        let node = self
            .graph
            .push_node(op, vec![], vec![(name.to_string(), ty)])?;
        Ok(self.graph.node(node).outputs[0])
    }

    /// Applies a single-result op.
    pub fn op(&mut self, name: &str, op: Op, inputs: &[Value]) -> Result<Value, IrError> {
        Ok(self.op_multi(name, op, inputs)?[0])
    }

    /// Applies an op and returns all of its results; result `i > 0` is named `name.i`.
    pub fn op_multi(
        &mut self,
        name: &str,
        op: Op,
        inputs: &[Value],
    ) -> Result<Vec<Value>, IrError> {
        let full = self.fresh_name(name);
        let types = {
            let tys: Vec<&TensorType> = inputs.iter().map(|&v| self.graph.ty(v)).collect();
            op.infer(&tys).map_err(|message| IrError::Invalid {
                site: Site {
                    node: full.clone(),
                    location: None,
                },
                message,
            })?
        };
        let outputs = types
            .into_iter()
            .enumerate()
            .map(|(i, ty)| {
                let n = if i == 0 {
                    full.clone()
                } else {
                    self.fresh_name(&format!("{full}.{i}"))
                };
                (n, ty)
            })
            .collect();
        let node = self.graph.push_node(op, inputs.to_vec(), outputs)?;
        self.graph.set_block(node, self.block);
        Ok(self.graph.node(node).outputs.clone())
    }

    /// Applies an op whose result dtype is chosen rather than inferred (a contraction writing
    /// F32 from BF16 operands, say). The op must allow it.
    pub fn op_with_dtype(
        &mut self,
        name: &str,
        op: Op,
        inputs: &[Value],
        dtype: DType,
    ) -> Result<Value, IrError> {
        let v = self.op(name, op, inputs)?;
        let natural = self.graph.ty(v).dtype;
        if natural != dtype {
            let node = self.graph.value(v).producer;
            if !self.graph.node(node).op.output_dtype_is_free() || !dtype.is_float() {
                return Err(IrError::Invalid {
                    site: Site {
                        node: self.graph.name(v).to_string(),
                        location: None,
                    },
                    message: format!(
                        "`{}` cannot write {dtype}",
                        self.graph.node(node).op.mnemonic()
                    ),
                });
            }
            self.graph.retype(v, dtype);
        }
        Ok(v)
    }

    /// Sets the accumulation of the node that produces `v`.
    pub fn set_acc(&mut self, v: Value, acc: Option<crate::Accum>) {
        let node = self.graph.value(v).producer;
        self.graph.set_acc(node, acc);
    }

    /// Sets the origin of the node that produces `v`.
    pub fn set_origin(&mut self, v: Value, origin: Option<crate::Origin>) {
        let node = self.graph.value(v).producer;
        self.graph.set_origin(node, origin);
    }

    /// Renames a value (an output that must carry an exact name, such as `grad.<param>`).
    pub fn rename(&mut self, v: Value, name: &str) -> Result<(), IrError> {
        self.graph.rename(v, name)
    }

    pub fn set_outputs(&mut self, outputs: Vec<Value>) {
        self.graph.set_outputs(outputs);
    }

    pub fn finish(self) -> Graph {
        self.graph
    }

    /// The scoped name, made unique with a numeric suffix if needed.
    fn fresh_name(&self, name: &str) -> String {
        let mut base = self.scopes.join(".");
        if !base.is_empty() && !name.is_empty() {
            base.push('.');
        }
        base.push_str(name);
        let base = sanitize_name(&base);
        if self.graph.lookup(&base).is_none() {
            return base;
        }
        let mut i = 1;
        loop {
            let candidate = format!("{base}.{i}");
            if self.graph.lookup(&candidate).is_none() {
                return candidate;
            }
            i += 1;
        }
    }
}

/// Replaces characters the text format does not allow in names with `_`.
pub fn sanitize_name(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| if is_name_char(c) { c } else { '_' })
        .collect();
    if s.is_empty() {
        "_".into()
    } else {
        s
    }
}

/// Characters allowed in value and graph names.
pub fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
}
