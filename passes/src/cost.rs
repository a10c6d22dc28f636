//! The cost model: FLOPs, bytes moved and a roofline time for every node, on a target GPU.
//!
//! Each node is one kernel that reads its operands from and writes its results to device
//! memory (fusion is not credited here). Its time is the larger of its arithmetic time at the
//! peak rate of the unit that runs it and its memory time at the peak bandwidth:
//!
//! - contractions run on tensor cores at the rate of their operand dtype (BF16/F16), TF32 when
//!   they accumulate with `acc=tf32`, and at the FP32 rate when they read F32 without TF32;
//! - every other op runs on the FP32 CUDA cores;
//! - bytes are the operands' and results' sizes by dtype; reshapes are views (no bytes),
//!   sources and persistent parameter copies move nothing (the optimizer writes the copies),
//!   a gather reads only the rows it gathers.
//!
//! FLOPs per element of the pointwise and normalization ops are nominal counts (one per add
//! or multiply, a handful for a transcendental); what matters at these sizes is that such ops
//! are bandwidth-bound, which the roofline shows whatever the constants.

use crate::PassError;
use castor_ir::{
    Accum, DType, Graph, ModelShape, Node, NodeData, Op, OpClass, TrainingPlan, UnaryOp,
};
use serde::{Deserialize, Serialize};

/// The peak rates of a GPU. Numbers are per second.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    pub name: String,
    /// Dense BF16/F16 tensor-core FLOP/s.
    pub low_precision_flops: f64,
    /// Dense FP8 tensor-core FLOP/s with F32 accumulation; `None` for a GPU without FP8
    /// tensor cores, whose FP8 products the cost model prices at the BF16 rate.
    #[serde(default)]
    pub fp8_flops: Option<f64>,
    /// Dense TF32 tensor-core FLOP/s.
    pub tf32_flops: f64,
    /// FP32 (CUDA core) FLOP/s.
    pub f32_flops: f64,
    /// Device memory bandwidth in bytes/s.
    pub memory_bandwidth: f64,
    /// Device memory in bytes (optional: shown beside the anatomy's total).
    #[serde(default)]
    pub memory_bytes: Option<u64>,
    /// How the GPUs of a data-parallel group reach each other (the collectives' time).
    #[serde(default)]
    pub interconnect: Interconnect,
}

/// A GPU's links to its peers, per GPU and per direction, in bytes/s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Interconnect {
    /// Within a node (NVLink, or PCIe).
    pub link_bandwidth: f64,
    /// Across nodes (InfiniBand or Ethernet, the share of one GPU).
    pub network_bandwidth: f64,
    /// GPUs in a node: a group of more spans nodes, and its rings run at the network's rate.
    pub gpus_per_node: usize,
}

impl Default for Interconnect {
    /// A PCIe 4.0 x16 card in an 8-GPU server on 100 Gb/s Ethernet: what a spec file that
    /// says nothing about links gets.
    fn default() -> Self {
        Interconnect {
            link_bandwidth: 25e9,
            network_bandwidth: 12.5e9,
            gpus_per_node: 8,
        }
    }
}

impl Interconnect {
    /// An NVLink server (HGX) with one InfiniBand NIC per GPU.
    pub fn nvlink(link_gb_s: f64, network_gbit_s: f64) -> Interconnect {
        Interconnect {
            link_bandwidth: link_gb_s * 1e9,
            network_bandwidth: network_gbit_s * 1e9 / 8.0,
            gpus_per_node: 8,
        }
    }

    /// The bandwidth of a ring over `world` GPUs: the links within a node, the network when
    /// the group spans nodes.
    pub fn ring_bandwidth(&self, world: usize) -> f64 {
        if world <= self.gpus_per_node.max(1) {
            self.link_bandwidth
        } else {
            self.network_bandwidth
        }
    }

    /// Ring-algorithm seconds of a collective over `world` GPUs: an all-reduce of `bytes`
    /// sends `2 (world - 1) / world` of them, a reduce-scatter or all-gather of `bytes` (the
    /// whole value) `(world - 1) / world`.
    pub fn seconds(&self, op: &Op, bytes: f64) -> f64 {
        let (world, passes) = match op {
            Op::AllReduce { world, .. } => (*world, 2.0),
            Op::ReduceScatter { world, .. } | Op::AllGather { world, .. } => (*world, 1.0),
            _ => return 0.0,
        };
        if world <= 1 {
            return 0.0;
        }
        passes * (world - 1) as f64 / world as f64 * bytes / self.ring_bandwidth(world)
    }
}

impl Default for GpuSpec {
    fn default() -> Self {
        GpuSpec::h100_sxm()
    }
}

impl GpuSpec {
    /// NVIDIA H100 SXM (datasheet, dense).
    pub fn h100_sxm() -> GpuSpec {
        GpuSpec {
            name: "H100 SXM".into(),
            low_precision_flops: 989e12,
            fp8_flops: Some(1979e12),
            tf32_flops: 495e12,
            f32_flops: 67e12,
            memory_bandwidth: 3.35e12,
            memory_bytes: Some(80 * (1 << 30)),
            // NVLink 4 (900 GB/s both ways), one 400 Gb/s NDR NIC per GPU.
            interconnect: Interconnect::nvlink(450.0, 400.0),
        }
    }

    /// Parses a GPU description: JSON when the text starts with `{`, else TOML, with the
    /// fields of [`GpuSpec`].
    pub fn parse(text: &str, source_name: &str) -> Result<GpuSpec, PassError> {
        let bad = |message: String| PassError::Gpu {
            source_name: source_name.to_string(),
            message,
        };
        let spec: GpuSpec = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| bad(e.to_string()))?
        } else {
            toml::from_str(text).map_err(|e| bad(e.to_string()))?
        };
        for (field, v) in [
            ("low_precision_flops", spec.low_precision_flops),
            ("tf32_flops", spec.tf32_flops),
            ("f32_flops", spec.f32_flops),
            ("memory_bandwidth", spec.memory_bandwidth),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(format!(
                    "`{field}` must be a positive number, found {v}"
                )));
            }
        }
        Ok(spec)
    }

    /// The peak FLOP/s of the unit that runs `node`.
    pub fn peak_for(&self, g: &Graph, node: &NodeData) -> f64 {
        if node.op.class() != OpClass::Contraction {
            return self.f32_flops;
        }
        let dtype = node.inputs.first().map(|&v| g.ty(v).dtype);
        match (dtype, node.acc) {
            (Some(DType::F8E4M3 | DType::F8E5M2), _) => {
                self.fp8_flops.unwrap_or(self.low_precision_flops)
            }
            (Some(DType::BF16 | DType::F16), _) => self.low_precision_flops,
            (_, Some(Accum::Tf32)) => self.tf32_flops,
            _ => self.f32_flops,
        }
    }
}

/// The cost of one node.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NodeCost {
    pub flops: f64,
    pub bytes: f64,
    /// Roofline seconds: max(flops / peak, bytes / bandwidth).
    pub seconds: f64,
}

impl std::ops::AddAssign for NodeCost {
    fn add_assign(&mut self, o: NodeCost) {
        self.flops += o.flops;
        self.bytes += o.bytes;
        self.seconds += o.seconds;
    }
}

fn numel(g: &Graph, v: castor_ir::Value) -> f64 {
    g.ty(v).shape.numel().unwrap_or(0) as f64
}

fn size(g: &Graph, v: castor_ir::Value) -> f64 {
    g.ty(v).size_bytes().unwrap_or(0) as f64
}

/// FLOPs of one node (multiply-adds count two).
pub fn node_flops(g: &Graph, node: &NodeData) -> f64 {
    let out = node.outputs.first().map_or(0.0, |&v| numel(g, v));
    let in0 = node.inputs.first().map_or(0.0, |&v| numel(g, v));
    match &node.op {
        Op::MatMul { transpose_a, .. } | Op::Fp8MatMul { transpose_a, .. } => {
            2.0 * out * product_depth(g, node, *transpose_a)
        }
        // The product, then the scale's one multiply per element (as the separate op counts).
        Op::MatMulScaled { transpose_a, .. } => {
            (2.0 * product_depth(g, node, *transpose_a) + 1.0) * out
        }
        // The product, then per element the scale's multiply and the add (as the separate
        // ops count them).
        Op::MatMulAdd { transpose_a, .. } => {
            (2.0 * product_depth(g, node, *transpose_a) + 2.0) * out
        }
        // The product, then per element the bias add (and the GELU or its gradient, as the
        // separate ops count them).
        Op::MatMulBias { transpose_a, .. } => {
            (2.0 * product_depth(g, node, *transpose_a) + 1.0) * out
        }
        Op::MatMulBiasGelu { transpose_a, .. } => {
            (2.0 * product_depth(g, node, *transpose_a) + 11.0) * out
        }
        // The product and the bias gradient's one addition per summed element.
        Op::MatMulBiasGrad { lhs } => {
            let k = g.ty(node.inputs[0]).shape.dims()[0] as f64;
            let summed = numel(g, node.inputs[usize::from(!*lhs)]);
            2.0 * out * k + summed
        }
        Op::MatMulGeluGrad { transpose_a, .. } => {
            (2.0 * product_depth(g, node, *transpose_a) + 20.0) * out
        }
        // The product, and one multiply per weight element to dequantize it.
        Op::Nf4MatMul { rows, cols, .. } => {
            let k = g
                .ty(node.inputs[0])
                .shape
                .dims()
                .last()
                .copied()
                .unwrap_or(0) as f64;
            2.0 * out * k + (rows * cols) as f64
        }
        // The head's product (and, for the gradient, its recomputation and the two gradient
        // products) plus the cross-entropy's few operations per logit.
        Op::LinearCrossEntropy { .. }
        | Op::LinearCrossEntropyGrad { .. }
        | Op::LinearCrossEntropyStep { .. } => {
            let (h, w) = (
                g.ty(node.inputs[0]).shape.dims(),
                g.ty(node.inputs[1]).shape.dims(),
            );
            let logits = (h[0] * w[0]) as f64;
            match node.op {
                Op::LinearCrossEntropy { .. } => 2.0 * logits * w[1] as f64 + 5.0 * logits,
                Op::LinearCrossEntropyGrad { .. } => 6.0 * logits * w[1] as f64 + 6.0 * logits,
                // The logits once, the two gradient products, the loss and its gradient.
                _ => 6.0 * logits * w[1] as f64 + 11.0 * logits,
            }
        }
        Op::Attention { causal, window, .. } | Op::AttentionGrad { causal, window, .. } => {
            let (q, v) = (
                g.ty(node.inputs[0]).shape.dims(),
                g.ty(node.inputs[2]).shape.dims(),
            );
            let (t, d) = (q[q.len() - 2], q[q.len() - 1] as f64);
            let (s, dv) = (v[v.len() - 2], v[v.len() - 1] as f64);
            let heads = q[..q.len() - 2].iter().product::<usize>() as f64;
            let pairs = heads * attended_pairs(t, s, *causal, *window);
            if matches!(node.op, Op::Attention { .. }) {
                // q k^T and p v, and the online softmax's ~5 operations per score.
                pairs * (2.0 * d + 2.0 * dv + 5.0)
            } else {
                // Scores recomputed, dp = do v^T, dv = p^T do, dq = ds k, dk = ds^T q.
                pairs * (6.0 * d + 4.0 * dv + 8.0)
            }
        }
        Op::Unary(u) | Op::UnaryGrad(u) => {
            let per = match u {
                UnaryOp::GeluTanh | UnaryOp::GeluErf => 10.0,
                UnaryOp::Silu | UnaryOp::Tanh => 5.0,
                UnaryOp::Exp | UnaryOp::Rsqrt | UnaryOp::Sqrt => 2.0,
                UnaryOp::Neg => 1.0,
            };
            let grad = if matches!(node.op, Op::UnaryGrad(_)) {
                2.0
            } else {
                1.0
            };
            per * grad * out
        }
        // Dropout's Philox draws are integer work: its FLOPs are the scale's multiply.
        Op::Binary(_) | Op::Scale { .. } | Op::Dropout { .. } => out,
        Op::LayerNorm { .. } => 8.0 * out,
        Op::RmsNorm { .. } => 5.0 * out,
        Op::Softmax { .. } => 5.0 * out,
        Op::Rope { .. } | Op::RopeGrad { .. } => 3.0 * out,
        Op::Reduce { .. } => in0,
        // The amax's one comparison per element; the cast's multiply and the amax's compare.
        Op::Fp8Scale { .. } => in0,
        Op::Quantize { .. } => 2.0 * in0,
        // A comparison per history entry.
        Op::AmaxHistory { .. } => in0,
        Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => 5.0 * in0,
        Op::LayerNormGrad { .. } => 12.0 * in0,
        Op::RmsNormGrad { .. } => 8.0 * in0,
        Op::SoftmaxGrad => 4.0 * out,
        Op::EmbeddingGrad { .. } => node.inputs.get(1).map_or(0.0, |&v| numel(g, v)),
        Op::GradNorm => {
            2.0 * node.inputs[..node.inputs.len().saturating_sub(1)]
                .iter()
                .map(|&v| numel(g, v))
                .sum::<f64>()
        }
        Op::AdamW { .. } => 15.0 * in0,
        // AdamW's arithmetic, two decodes, two block maxima and two 8-step code searches.
        Op::AdamW8bit { .. } => 40.0 * in0,
        Op::Sgd { .. } => 6.0 * in0,
        // Unscale, decay, the interpolation and its sign, the step, the moment.
        Op::Lion { .. } => 8.0 * in0,
        // Unscale, square, the row and column sums, the factored update, its RMS, the step.
        Op::Adafactor { .. } => 14.0 * in0,
        Op::CountStep | Op::LossScaleUpdate { .. } => 4.0,
        Op::Input
        | Op::Param
        | Op::State
        | Op::ParamCopy { .. }
        | Op::Embedding { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Split { .. }
        | Op::Cast { .. }
        | Op::Full { .. }
        | Op::Pad { .. }
        | Op::BroadcastTo { .. }
        | Op::Shard { .. } => 0.0,
        // The reduction's additions.
        Op::AllReduce { world, .. } => out * world.saturating_sub(1) as f64,
        Op::ReduceScatter { world, .. } => in0 * world.saturating_sub(1) as f64 / *world as f64,
        Op::AllGather { .. } => 0.0,
    }
}

/// The inner dimension of a product node's `matmul`: each output element's multiply-adds.
fn product_depth(g: &Graph, node: &NodeData, transpose_a: bool) -> f64 {
    let a = g.ty(node.inputs[0]).shape.dims();
    (match (a.len(), transpose_a) {
        (0, _) => 1,
        (1, _) => a[0],
        (n, false) => a[n - 1],
        (n, true) => a[n - 2],
    }) as f64
}

/// The (query, key) pairs an attention computes: all `T x S`, or under a causal mask those
/// with `j <= i + S - T`, which a fused kernel skips the rest of.
fn attended_pairs(t: usize, s: usize, causal: bool, window: Option<usize>) -> f64 {
    if !causal {
        return (t * s) as f64;
    }
    (0..t)
        .map(|i| {
            let visible = (i + 1 + s - t).min(s);
            window.map_or(visible, |w| visible.min(w)) as f64
        })
        .sum()
}

/// Bytes a node moves through device memory inside itself, beyond reading its operands and
/// writing its results once: its scratch traffic.
///
/// Only the fused classifier has any. Each chunk's `[chunk, V]` logits are written by the
/// head's product and read back by the cross-entropy; with the gradient they are also
/// rewritten in place as their gradient and read by the two gradient products (6 passes
/// over them, 2 for the loss alone). And each chunk after the first reads and rewrites the
/// F32 `[V, C]` weight gradient it accumulates into: with short chunks this traffic is
/// larger than the products themselves (LLaMA-3's 128,256 x 2,048 gradient is 1 GB each
/// way, at 256 rows a chunk).
pub fn scratch_bytes(g: &Graph, node: &NodeData) -> f64 {
    let (chunk_rows, logits, passes) = match node.op {
        Op::LinearCrossEntropy {
            chunk_rows, logits, ..
        } => (chunk_rows, logits, 2.0),
        Op::LinearCrossEntropyGrad {
            chunk_rows, logits, ..
        }
        | Op::LinearCrossEntropyStep {
            chunk_rows, logits, ..
        } => (chunk_rows, logits, 6.0),
        _ => return 0.0,
    };
    let (h, w) = (
        g.ty(node.inputs[0]).shape.dims(),
        g.ty(node.inputs[1]).shape.dims(),
    );
    let (rows, vocab, width) = (h[0], w[0], w[1]);
    let logit_bytes = logits.size_bytes() as f64;
    let chunks = rows.div_ceil(chunk_rows.max(1));
    let logits_traffic = passes * (rows * vocab) as f64 * logit_bytes;
    let accumulation = if passes > 2.0 {
        2.0 * chunks.saturating_sub(1) as f64 * (vocab * width * 4) as f64
    } else {
        0.0
    };
    logits_traffic + accumulation
}

/// Output tiles (128 x 128) a weight gradient needs before its bias gradient runs in the
/// product's epilogue on CUDA: four waves of an H100's 132 SMs. Below it the CUDA program runs
/// the plain product and sums the bias gradient's rows in a kernel of its own. A bias-gradient
/// epilogue product (cuBLASLt's `BGRADA`/`BGRADB`) ran 2.06-2.15x its roofline on H100 and
/// H200 (GPT-2 124M, 2026-11-27 to 29) where plain products ran about 1.1x; GPT-2's weight
/// gradients have 36 to 144 such tiles, and one block a tile without a split of the 8192-deep
/// sum accounts for that time (a product of 144 tiles takes two waves of 132, the second
/// nearly empty). Where the output fills four waves the last one costs at most a fifth, and
/// the epilogue saves the sum's read of the gradient.
pub const BIAS_GRAD_EPILOGUE_MIN_TILES: usize = 4 * 132;

/// Whether a weight gradient of `rows x cols` computes its bias gradient in the product's
/// epilogue on CUDA (see [`BIAS_GRAD_EPILOGUE_MIN_TILES`]).
pub fn bias_grad_in_epilogue(rows: usize, cols: usize) -> bool {
    rows.div_ceil(128) * cols.div_ceil(128) >= BIAS_GRAD_EPILOGUE_MIN_TILES
}

/// Bytes one node reads and writes in device memory.
pub fn node_bytes(g: &Graph, node: &NodeData) -> f64 {
    let outs: f64 = node.outputs.iter().map(|&v| size(g, v)).sum();
    let ins: f64 = node.inputs.iter().map(|&v| size(g, v)).sum();
    let scratch = scratch_bytes(g, node);
    if scratch > 0.0 {
        return ins + outs + scratch;
    }
    match &node.op {
        Op::Input | Op::Param | Op::State | Op::ParamCopy { .. } | Op::Reshape { .. } => 0.0,
        Op::Full { .. } | Op::Pad { .. } | Op::BroadcastTo { .. } => outs + ins,
        // A gather reads the rows it writes and the ids; a slice reads what it keeps.
        Op::Embedding { .. } => 2.0 * outs + node.inputs.get(1).map_or(0.0, |&v| size(g, v)),
        Op::Slice { .. } => 2.0 * outs,
        Op::MatMulBiasGrad { .. } => ins + outs + bias_grad_apart_bytes(g, node),
        _ => ins + outs,
    }
}

/// Bytes a weight gradient's bias gradient reads in a kernel of its own, after the product
/// (none where it is in the product's epilogue): the summed operand again.
pub fn bias_grad_apart_bytes(g: &Graph, node: &NodeData) -> f64 {
    let Op::MatMulBiasGrad { lhs } = node.op else {
        return 0.0;
    };
    let dims = g.ty(node.outputs[0]).shape.dims();
    match bias_grad_in_epilogue(dims[0], dims[1]) {
        true => 0.0,
        false => size(g, node.inputs[usize::from(!lhs)]),
    }
}

/// The cost of one node on `gpu`.
pub fn node_cost(g: &Graph, n: Node, gpu: &GpuSpec) -> NodeCost {
    let node = g.node(n);
    let flops = node_flops(g, node);
    let bytes = node_bytes(g, node);
    let seconds = if node.op.class() == OpClass::Communication {
        // The wire, not the device's memory, bounds a collective: the whole value's bytes.
        let moved = match node.op {
            Op::ReduceScatter { .. } => size(g, node.inputs[0]),
            _ => size(g, node.outputs[0]),
        };
        gpu.interconnect.seconds(&node.op, moved)
    } else {
        // A bias gradient summed apart runs after its product, not under it.
        let apart = bias_grad_apart_bytes(g, node);
        let product = (flops / gpu.peak_for(g, node)).max((bytes - apart) / gpu.memory_bandwidth);
        product + apart / gpu.memory_bandwidth
    };
    NodeCost {
        flops,
        bytes,
        seconds,
    }
}

/// The total cost of a graph's nodes, and the part spent in contractions.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GraphCost {
    pub total: NodeCost,
    pub contractions: NodeCost,
    /// Nodes added by rematerialization (named `*.remat`).
    pub recompute: NodeCost,
    /// The contractions among them.
    pub recompute_contractions: NodeCost,
    /// Collectives (data parallelism): their seconds are the interconnect's.
    pub communication: NodeCost,
    /// The graph's seconds with its collectives on a second stream: each starts when its
    /// operand is ready and the previous one is done, and a node waits only for the
    /// collectives it reads (what NCCL on its own stream allows).
    pub overlapped_seconds: f64,
    /// Whether the graph's attention is fused ops, which compute only the (query, key) pairs
    /// their masks keep (eager attention's products compute all `T x S`).
    pub fused_attention: bool,
}

pub fn graph_cost(g: &Graph, gpu: &GpuSpec) -> GraphCost {
    let mut c = GraphCost::default();
    // Two streams: compute runs the nodes in order, the network the collectives in order.
    let mut ready = vec![0f64; g.num_values()];
    let (mut compute, mut network) = (0f64, 0f64);
    for (n, node) in g.nodes() {
        let nc = node_cost(g, n, gpu);
        let operands = node
            .inputs
            .iter()
            .map(|v| ready[v.index()])
            .fold(0f64, f64::max);
        let done = if node.op.class() == OpClass::Communication {
            network = network.max(operands) + nc.seconds;
            network
        } else {
            compute = compute.max(operands) + nc.seconds;
            compute
        };
        for v in &node.outputs {
            ready[v.index()] = done;
        }
        c.total += nc;
        if node.op.class() == OpClass::Contraction {
            c.contractions += nc;
        }
        c.fused_attention |= matches!(node.op, Op::Attention { .. } | Op::AttentionGrad { .. });
        if node.op.class() == OpClass::Communication {
            c.communication += nc;
        }
        if node.origin == Some(castor_ir::Origin::Remat) {
            c.recompute += nc;
            if node.op.class() == OpClass::Contraction {
                c.recompute_contractions += nc;
            }
        }
    }
    c.overlapped_seconds = compute.max(network);
    c
}

/// Parameters of a plan: every `param` of its micro step (tied weights once), as the model
/// counts them ([`model_numel`]), the masters a data-parallel rank keeps a shard of, which the
/// micro step reads only through their working copies, and the weights it reads only as FP8
/// copies.
pub fn param_count(plan: &TrainingPlan) -> u64 {
    let g = &plan.micro_step;
    let read = g.params().map(|p| model_numel(plan, p)).sum::<u64>();
    let sharded = plan
        .state
        .iter()
        .filter(|s| s.role == castor_ir::StateRole::Master && g.lookup(&s.name).is_none())
        .filter_map(|s| s.shard_of.as_ref())
        .map(|t| t.shape.numel().unwrap_or(0) as u64)
        .sum::<u64>();
    // Weights the micro step reads only as their FP8 copies (state, not parameters).
    let fp8 = plan
        .state
        .iter()
        .filter(|s| {
            matches!(
                &s.init,
                castor_ir::StateInit::Fp8CopyOf {
                    master,
                    part: castor_ir::Fp8Part::Values,
                    ..
                } if g.lookup(master).is_none()
            )
        })
        .map(|s| s.ty.shape.numel().unwrap_or(0) as u64)
        .sum::<u64>();
    read + sharded + fp8
}

/// The parameters of [`param_count`] that the step reads frozen (a LoRA base, stored once as
/// state of the frozen role): they get no weight gradient.
pub fn frozen_param_count(plan: &TrainingPlan) -> u64 {
    let g = &plan.micro_step;
    plan.state
        .iter()
        .filter(|s| s.role == castor_ir::StateRole::Frozen)
        .filter_map(|s| g.lookup(&s.name))
        .filter(|&v| g.node(g.value(v).producer).op == castor_ir::Op::Param)
        .map(|v| model_numel(plan, v))
        .sum()
}

/// How many of the model's parameters the micro step's `param` `p` holds: its elements, but
/// a ZeRO-3 rank's shard counts the whole parameter, NF4 codes count the two weights each
/// byte packs, and NF4 block maxima count none (they are part of their weight).
fn model_numel(plan: &TrainingPlan, p: castor_ir::Value) -> u64 {
    let g = &plan.micro_step;
    let stored = g.ty(p).shape.numel().unwrap_or(0) as u64;
    let Some(entry) = plan.state.iter().find(|s| s.name == g.name(p)) else {
        return stored;
    };
    if let Some(whole) = &entry.shard_of {
        return whole.shape.numel().unwrap_or(0) as u64;
    }
    match &entry.init {
        castor_ir::StateInit::Nf4 { part, .. } => match part {
            castor_ir::Nf4Part::Codes => 2 * stored,
            castor_ir::Nf4Part::Absmax => 0,
        },
        _ => stored,
    }
}

/// 6N + 6·L·C·T: training FLOPs per token by the llm.c convention (attention products
/// counted with the causal half), from the model's shape as the front end recorded it. Of the
/// `params`, the `frozen` ones count 4 (their products forward and their input gradients)
/// instead of 6, as PEFT's and the benchmark's MFU count a LoRA base: without that a LoRA
/// step would claim the FLOPs of weight gradients it never computes.
pub fn flops_per_token_rule(params: u64, frozen: u64, shape: &ModelShape) -> f64 {
    let frozen = frozen.min(params);
    6.0 * (params - frozen) as f64
        + 4.0 * frozen as f64
        + 6.0 * (shape.layers * shape.width * shape.seq) as f64
}

/// The estimated cost of one training step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepCost {
    pub gpu: GpuSpec,
    pub micro_step: GraphCost,
    pub optimizer_step: GraphCost,
    pub grad_accum: usize,
    /// Tokens per optimizer step (batch x seq x grad_accum).
    pub tokens: u64,
    /// Parameters (N of the 6N + 6·L·C·T rule).
    pub params: u64,
    /// Of `params`, those read frozen (counted 4 per token instead of 6).
    pub frozen_params: u64,
    /// The model's shape, when the graph records it (not for hand-written IR without a
    /// `model` line): the rule and MFU need it.
    pub shape: Option<ModelShape>,
    /// Ranks of the data-parallel group (the step, tokens and memory are one rank's).
    pub world_size: usize,
}

impl StepCost {
    pub fn of_plan(plan: &TrainingPlan, gpu: &GpuSpec) -> StepCost {
        let s = &plan.settings;
        StepCost {
            gpu: gpu.clone(),
            micro_step: graph_cost(&plan.micro_step, gpu),
            optimizer_step: graph_cost(&plan.optimizer_step, gpu),
            grad_accum: s.grad_accum,
            tokens: (s.batch * s.seq * s.grad_accum) as u64,
            params: param_count(plan),
            frozen_params: frozen_param_count(plan),
            shape: plan.micro_step.shape,
            world_size: s.parallel.world_size.max(1),
        }
    }

    /// FLOPs castor's step executes (recomputation included).
    pub fn flops(&self) -> f64 {
        self.micro_step.total.flops * self.grad_accum as f64 + self.optimizer_step.total.flops
    }

    pub fn seconds(&self) -> f64 {
        self.micro_step.total.seconds * self.grad_accum as f64 + self.optimizer_step.total.seconds
    }

    /// The step's seconds with the collectives overlapping compute (see
    /// [`GraphCost::overlapped_seconds`]): what a device that runs NCCL on its own stream
    /// could reach, against [`StepCost::seconds`], which counts every collective in full.
    pub fn overlapped_seconds(&self) -> f64 {
        self.micro_step.overlapped_seconds * self.grad_accum as f64
            + self.optimizer_step.overlapped_seconds
    }

    /// Seconds of collectives a step (counted in [`StepCost::seconds`]).
    pub fn communication_seconds(&self) -> f64 {
        self.micro_step.communication.seconds * self.grad_accum as f64
            + self.optimizer_step.communication.seconds
    }

    pub fn recompute_seconds(&self) -> f64 {
        self.micro_step.recompute.seconds * self.grad_accum as f64
    }

    pub fn flops_per_token(&self) -> f64 {
        self.flops() / self.tokens.max(1) as f64
    }

    /// Contraction FLOPs per token, recomputation excluded.
    pub fn contraction_flops_per_token(&self) -> f64 {
        (self.micro_step.contractions.flops - self.micro_step.recompute_contractions.flops)
            * self.grad_accum as f64
            / self.tokens.max(1) as f64
    }

    /// 6N + 6·L·C·T per token (4 per frozen parameter), when the model's shape is known.
    pub fn flops_per_token_rule(&self) -> Option<f64> {
        self.shape
            .as_ref()
            .map(|s| flops_per_token_rule(self.params, self.frozen_params, s))
    }

    /// Model FLOPs utilization: 6N + 6·L·C·T per token (no recompute) over the estimated step
    /// time, as a fraction of the BF16 tensor-core peak; unknown without the model's shape or
    /// a token count.
    pub fn mfu(&self) -> Option<f64> {
        let secs = self.seconds();
        let rule = self.flops_per_token_rule()?;
        (secs > 0.0 && self.tokens > 0)
            .then(|| rule * self.tokens as f64 / secs / self.gpu.low_precision_flops)
    }
}
