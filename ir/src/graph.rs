//! The dataflow graph: nodes and values in arenas, in definition order.

use crate::{IrError, ModelShape, Node, Op, OpClass, TensorType, Value};
use std::collections::HashMap;

/// Where a node was written, for graphs parsed from text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub line: usize,
    pub column: usize,
}

/// One operation.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeData {
    pub op: Op,
    /// Operands, each defined by an earlier node.
    pub inputs: Vec<Value>,
    /// Results, in order; every node has at least one.
    pub outputs: Vec<Value>,
    /// The accumulation dtype, when a pass has decided it (printed as `acc=` with the
    /// attributes).
    pub acc: Option<crate::Accum>,
    /// A free-text note printed as a trailing `# comment` (passes record reasons here).
    pub note: Option<String>,
    /// The transformer block (layer) the node belongs to, as the front end built it (printed
    /// as `block=` with the attributes). Sources belong to no block; passes that rebuild a
    /// graph keep each node's block, and nodes they add take the block of what they derive
    /// from (a cast its producer's, a gradient its forward node's, a recomputation its
    /// original's).
    pub block: Option<u32>,
    /// What a pass made this node as, when it is a copy or a companion of another (printed as
    /// `origin=` with the attributes): what passes read instead of name suffixes.
    pub origin: Option<Origin>,
}

/// What a node is, where its name alone would otherwise say it: what passes read instead of
/// name suffixes and checkpoint naming conventions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    /// A forward node recomputed in the backward part (`remat`), named `<value>.remat`.
    Remat,
    /// A ZeRO-3 parameter's gather (`parallel`), named `<parameter>.gathered`.
    Gather,
    /// That gather made again for the backward (`remat`), named `<parameter>.regathered`.
    Regather,
    /// A LoRA adapter parameter the `lora` pass added (`<module>.lora_A.weight` as PEFT names
    /// it): with adapters, these alone are trained and every other parameter is frozen.
    Adapter,
    /// The output head's product (the causal LM's `logits`, as the model's front end builds
    /// it): LoRA's `all-linear` and NF4 quantization leave its weight alone, as PEFT and
    /// bitsandbytes do.
    Head,
}

impl Origin {
    pub const ALL: [Origin; 5] = [
        Origin::Remat,
        Origin::Gather,
        Origin::Regather,
        Origin::Adapter,
        Origin::Head,
    ];

    /// Its name in the IR text.
    pub fn name(self) -> &'static str {
        match self {
            Origin::Remat => "remat",
            Origin::Gather => "gather",
            Origin::Regather => "regather",
            Origin::Adapter => "adapter",
            Origin::Head => "head",
        }
    }

    pub fn from_name(name: &str) -> Option<Origin> {
        Origin::ALL.into_iter().find(|o| o.name() == name)
    }
}

/// One tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct ValueData {
    /// Unique within the graph; traces back to the model (`h.3.attn.qkv`). For sources it is
    /// the binding name: the input's name or the parameter's checkpoint tensor name.
    pub name: String,
    pub ty: TensorType,
    pub producer: Node,
    /// Position among the producer's outputs.
    pub index: usize,
}

/// A tensor program.
///
/// Invariants (checked by [`crate::verify`]): every operand of node `n` is produced by a node
/// before `n`, so `nodes` is a topological order; value names are unique; every node's result
/// types agree with its op's typing rule.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    /// The shape of the model the graph was built from (printed as the `model` line), when
    /// the front end built it.
    pub shape: Option<ModelShape>,
    nodes: Vec<NodeData>,
    values: Vec<ValueData>,
    outputs: Vec<Value>,
    by_name: HashMap<String, Value>,
    /// Source positions, parallel to `nodes`, when the graph was parsed from text.
    locations: Vec<Option<Location>>,
}

/// Graphs are equal when they print the same: source locations do not count.
impl PartialEq for Graph {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.shape == other.shape
            && self.nodes == other.nodes
            && self.values == other.values
            && self.outputs == other.outputs
    }
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Self {
        Graph {
            name: name.into(),
            ..Default::default()
        }
    }

    /// An empty graph with `g`'s name and model shape: where a pass that rebuilds `g` starts.
    pub fn empty_like(g: &Graph) -> Self {
        Graph {
            name: g.name.clone(),
            shape: g.shape,
            ..Default::default()
        }
    }

    /// Appends a copy of node `n` of graph `from` (op, accumulation, note, block, origin,
    /// source location) with the given operands and results: how passes that rebuild a graph carry
    /// each node's facts over.
    pub fn push_copy(
        &mut self,
        from: &Graph,
        n: Node,
        inputs: Vec<Value>,
        outputs: Vec<(String, TensorType)>,
    ) -> Result<Node, IrError> {
        let d = from.node(n);
        let new = self.push_node(d.op.clone(), inputs, outputs)?;
        let data = &mut self.nodes[new.index()];
        data.acc = d.acc;
        data.note = d.note.clone();
        data.block = d.block;
        data.origin = d.origin;
        self.locations[new.index()] = from.location(n);
        Ok(new)
    }

    /// Appends a node whose results have the given names and types. Names must be new; the
    /// operands are not checked here (the verifier does that), so passes and the parser can
    /// build first and verify once.
    pub fn push_node(
        &mut self,
        op: Op,
        inputs: Vec<Value>,
        outputs: Vec<(String, TensorType)>,
    ) -> Result<Node, IrError> {
        let node = Node(self.nodes.len() as u32);
        let mut out_ids = Vec::with_capacity(outputs.len());
        for (index, (name, ty)) in outputs.into_iter().enumerate() {
            if self.by_name.contains_key(&name) {
                return Err(IrError::DuplicateName { name });
            }
            let v = Value(self.values.len() as u32);
            self.by_name.insert(name.clone(), v);
            self.values.push(ValueData {
                name,
                ty,
                producer: node,
                index,
            });
            out_ids.push(v);
        }
        self.nodes.push(NodeData {
            op,
            inputs,
            outputs: out_ids,
            acc: None,
            note: None,
            block: None,
            origin: None,
        });
        self.locations.push(None);
        Ok(node)
    }

    pub fn set_location(&mut self, node: Node, loc: Location) {
        self.locations[node.index()] = Some(loc);
    }

    pub fn location(&self, node: Node) -> Option<Location> {
        self.locations[node.index()]
    }

    pub fn set_acc(&mut self, node: Node, acc: Option<crate::Accum>) {
        self.nodes[node.index()].acc = acc;
    }

    pub fn set_note(&mut self, node: Node, note: Option<String>) {
        self.nodes[node.index()].note = note;
    }

    pub fn set_origin(&mut self, node: Node, origin: Option<Origin>) {
        self.nodes[node.index()].origin = origin;
    }

    pub fn set_block(&mut self, node: Node, block: Option<u32>) {
        self.nodes[node.index()].block = block;
    }

    /// Renames a value; the new name must be unused.
    pub fn rename(&mut self, v: Value, name: &str) -> Result<(), IrError> {
        if self.by_name.contains_key(name) {
            return Err(IrError::DuplicateName {
                name: name.to_string(),
            });
        }
        let old = std::mem::replace(&mut self.values[v.index()].name, name.to_string());
        self.by_name.remove(&old);
        self.by_name.insert(name.to_string(), v);
        Ok(())
    }

    /// Changes a value's dtype (for passes that assign precision; the verifier checks it).
    pub fn retype(&mut self, v: Value, dtype: crate::DType) {
        self.values[v.index()].ty.dtype = dtype;
    }

    pub fn set_outputs(&mut self, outputs: Vec<Value>) {
        self.outputs = outputs;
    }

    pub fn outputs(&self) -> &[Value] {
        &self.outputs
    }

    pub fn node(&self, n: Node) -> &NodeData {
        &self.nodes[n.index()]
    }

    pub fn value(&self, v: Value) -> &ValueData {
        &self.values[v.index()]
    }

    pub fn ty(&self, v: Value) -> &TensorType {
        &self.values[v.index()].ty
    }

    pub fn name(&self, v: Value) -> &str {
        &self.values[v.index()].name
    }

    pub fn lookup(&self, name: &str) -> Option<Value> {
        self.by_name.get(name).copied()
    }

    pub fn num_nodes(&self) -> usize {
        self.nodes.len()
    }

    pub fn num_values(&self) -> usize {
        self.values.len()
    }

    /// Nodes in definition (topological) order.
    pub fn nodes(&self) -> impl ExactSizeIterator<Item = (Node, &NodeData)> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (Node(i as u32), n))
    }

    pub fn values(&self) -> impl ExactSizeIterator<Item = (Value, &ValueData)> {
        self.values
            .iter()
            .enumerate()
            .map(|(i, v)| (Value(i as u32), v))
    }

    /// Graph inputs (`input` nodes), in order.
    pub fn inputs(&self) -> impl Iterator<Item = Value> + '_ {
        self.sources(Op::Input)
    }

    /// Parameters (`param` nodes), in order.
    pub fn params(&self) -> impl Iterator<Item = Value> + '_ {
        self.sources(Op::Param)
    }

    /// Training state (`state` nodes), in order.
    pub fn states(&self) -> impl Iterator<Item = Value> + '_ {
        self.sources(Op::State)
    }

    /// The values whose producer has this origin, in order (the adapters: `Origin::Adapter`).
    pub fn with_origin(&self, origin: Origin) -> impl Iterator<Item = Value> + '_ {
        self.nodes
            .iter()
            .filter(move |n| n.origin == Some(origin))
            .map(|n| n.outputs[0])
    }

    /// Whether `v`'s producer has this origin.
    pub fn has_origin(&self, v: Value, origin: Origin) -> bool {
        self.node(self.value(v).producer).origin == Some(origin)
    }

    fn sources(&self, kind: Op) -> impl Iterator<Item = Value> + '_ {
        self.nodes
            .iter()
            .filter(move |n| n.op == kind)
            .map(|n| n.outputs[0])
    }

    /// For each value, the nodes that use it (in order, once per use).
    pub fn users(&self) -> Vec<Vec<Node>> {
        let mut users = vec![Vec::new(); self.values.len()];
        for (n, data) in self.nodes() {
            for &v in &data.inputs {
                if let Some(u) = users.get_mut(v.index()) {
                    u.push(n);
                }
            }
        }
        users
    }

    /// Number of nodes of each class, sources excluded. The four compute classes are always
    /// listed; communication only in the data-parallel plans that have it.
    pub fn class_counts(&self) -> Vec<(OpClass, usize)> {
        OpClass::ALL
            .iter()
            .map(|&c| {
                let count = self
                    .nodes
                    .iter()
                    .filter(|n| !n.op.is_source() && n.op.class() == c)
                    .count();
                (c, count)
            })
            .filter(|&(c, count)| count > 0 || c != OpClass::Communication)
            .collect()
    }
}
