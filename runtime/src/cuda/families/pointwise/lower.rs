//! Pointwise units: the CUDA C of a unit's typed body, and its launch.
//!
//! The kernel loads each input in its storage dtype, runs the body's steps in F32 (each
//! member rounded where the unfused graph stores it, so fused and unfused agree bit for bit)
//! and stores the outputs. It reads and writes 8 elements per step with 16-byte vectors when
//! every full-size pointer is 16-byte aligned, and element by element otherwise and for the
//! tail.
//!
//! A unit that ends with a cast to FP8 (`quantize`) stores that output with the fp8 family's
//! saturating nearest-even encoding, one byte per element, and where the body has an amax
//! writes each block's largest magnitude of the cast's input to a partials buffer (an extra
//! parameter before `n`, one float per block); the fp8 family's `fp8_amax_finalize` reduces
//! them, as after the family's own `fp8_quantize`. A unit that ends with an `fp8_scale` takes
//! the same partials, and `fp8_scale_finalize` makes the scale of them, as after the family's
//! `fp8_amax`. The maximum is exact in any order, so the
//! result is the CPU twin's whatever the grid. These kernels take 8 elements at a time only as
//! a thread's grid-stride steps: their stores are bytes.

use crate::cuda::lower::{grid_1d, Loc, LowerError, RunLowering};
use crate::cuda::program::{Arg, Command, InputExtent, Launch};
use castor_ir::{BinaryOp, DType, Graph, IndexMap, Node, PointwiseBody, Step, UnaryOp};
use std::fmt::Write;

impl RunLowering<'_, '_> {
    /// The kernel of a pointwise unit: `members` (in node order) computing `body`.
    pub(crate) fn pointwise(
        &mut self,
        members: &[Node],
        body: &PointwiseBody,
        name: &str,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let value = |name: &str| {
            g.lookup(name).ok_or_else(|| LowerError {
                node: name.into(),
                message: "a kernel unit names a value its graph does not have".into(),
            })
        };
        let outputs: Vec<_> = body
            .outputs
            .iter()
            .map(|o| value(&o.value))
            .collect::<Result<_, _>>()?;
        let amax_value = body.amax.as_ref().map(|a| a.value.as_str());
        for &m in members {
            let v = g.node(m).outputs[0];
            // A scale ending the unit is written by its finalizing kernel.
            if !outputs.contains(&v) && amax_value != Some(g.name(v)) {
                self.loc[v.index()] = Loc::InKernel;
            }
        }
        let Some(&last) = members.last() else {
            return Ok(());
        };
        if outputs.is_empty() {
            // Nothing reads what the unit makes (a value the graph computes and never uses,
            // as BERT's logits under the `sum` objective): no kernel, which would have no
            // outputs and not compile.
            return Ok(());
        }
        let n = body.numel();
        let source = cuda_source(g, members, body, name);
        // An amax takes partial maxima per block: at most AMAX_BLOCKS of them.
        let grid = match body.amax {
            Some(_) => (n.div_ceil(256 * 8).clamp(1, AMAX_BLOCKS) as u32, 1, 1),
            None => grid_1d(n.div_ceil(8), 256),
        };
        // The same code is the same shapes for broadcast operands; full-size ones follow `n`.
        let extents = body
            .inputs
            .iter()
            .map(|input| match input.index {
                IndexMap::Full => Ok(InputExtent::Full),
                _ => {
                    let v = value(&input.value)?;
                    Ok(InputExtent::Elements(
                        g.ty(v).shape.numel().unwrap_or(0) as u64
                    ))
                }
            })
            .collect::<Result<_, LowerError>>()?;
        let (module, entry) = self.l.generated(name, body, &source, extents);
        let mut args = Vec::new();
        for input in &body.inputs {
            args.push(Arg::Ptr(self.at(value(&input.value)?)?));
        }
        for &v in &outputs {
            args.push(Arg::Ptr(self.out(v)?));
        }
        let partials = body
            .amax
            .as_ref()
            .map(|_| self.scratch(u64::from(grid.0) * 4));
        if let Some(p) = partials {
            args.push(Arg::Ptr(p));
        }
        args.push(Arg::I64(n as i64));
        let node = g.name(g.node(last).outputs[0]).to_string();
        self.commands.push(Command::Launch(Launch {
            node: node.clone(),
            module,
            kernel: None,
            entry,
            grid,
            block: (256, 1, 1),
            shared_bytes: 0,
            args,
        }));
        let (Some(amax), Some(partials)) = (&body.amax, partials) else {
            return Ok(());
        };
        let a = value(&amax.value)?;
        self.finish_amax(a, partials, grid.0, amax.scale.map(|s| (s.to, s.margin)))
    }
}

/// The most blocks (and so partial maxima) of a unit with an amax, as the fp8 family's.
const AMAX_BLOCKS: usize = 1024;

/// Whether the body stores bytes (an FP8 output) or takes an amax: no 16-byte vector path.
fn elementwise_only(body: &PointwiseBody) -> bool {
    body.amax.is_some() || body.outputs.iter().any(|o| o.dtype.is_fp8())
}

/// The statement that stores `r` in output `o` of dtype `d` at element `at`.
fn store(o: usize, d: DType, at: &str, r: &str) -> String {
    match d {
        DType::F8E4M3 => format!("out{o}[{at}] = E4M3::encode({r});"),
        DType::F8E5M2 => format!("out{o}[{at}] = E5M2::encode({r});"),
        _ => format!("out{o}[{at}] = from_f32<{}>({r});", cuda_type(d)),
    }
}

fn cuda_type(d: DType) -> &'static str {
    match d {
        DType::F16 => "__half",
        DType::BF16 => "__nv_bfloat16",
        DType::F8E4M3 | DType::F8E5M2 => "unsigned char",
        _ => "float",
    }
}

/// The functor of `common.cuh` that computes `u` (`f`) and its derivative (`df`).
fn functor(u: UnaryOp) -> &'static str {
    match u {
        UnaryOp::GeluTanh => "GeluTanh",
        UnaryOp::GeluErf => "GeluErf",
        UnaryOp::Silu => "Silu",
        UnaryOp::Tanh => "TanhFn",
        UnaryOp::Exp => "ExpFn",
        UnaryOp::Rsqrt => "RsqrtFn",
        UnaryOp::Sqrt => "SqrtFn",
        UnaryOp::Neg => "NegFn",
    }
}

/// An exact F32 literal.
fn f32_literal(x: f64) -> String {
    format!("__int_as_float(0x{:08x})", (x as f32).to_bits())
}

/// Input element `i`'s index as C: `i`, `0`, or the broadcast's sum of terms.
fn index_expr(index: &IndexMap) -> String {
    match index {
        IndexMap::Full => "i".into(),
        IndexMap::Scalar => "0".into(),
        IndexMap::Broadcast(terms) if terms.is_empty() => "0".into(),
        IndexMap::Broadcast(terms) => terms
            .iter()
            .map(|t| {
                format!(
                    "((i / {}LL) % {}LL) * {}LL",
                    t.out_stride, t.extent, t.in_stride
                )
            })
            .collect::<Vec<_>>()
            .join(" + "),
    }
}

/// The CUDA C source of a pointwise unit's kernel, entry point `name`. A comment names the
/// members (`members` are the unit's nodes of `g`); the code follows from `body` alone.
pub(crate) fn cuda_source(g: &Graph, members: &[Node], body: &PointwiseBody, name: &str) -> String {
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {} fused pointwise nodes over {}, {} result(s):",
        members.len(),
        castor_ir::Shape::from(body.dims.clone()),
        body.outputs.len()
    );
    for &m in members {
        let v = g.node(m).outputs[0];
        let mark = if body.outputs.iter().any(|o| o.value == g.name(v)) {
            "  (result)"
        } else {
            ""
        };
        let _ = writeln!(
            src,
            "//   %{} = {} : {}{mark}",
            g.name(v),
            g.node(m).op.mnemonic(),
            g.ty(v)
        );
    }
    let _ = writeln!(src, "#include \"castor_common.cuh\"\n");

    // The steps as one function of the inputs' F32 values, writing the results. An op step's
    // expression is written where the `round` of it stores a register `t<j>`.
    let mut params: Vec<String> = (0..body.inputs.len())
        .map(|k| format!("float x{k}"))
        .collect();
    params.extend((0..body.outputs.len()).map(|o| format!("float* r{o}")));
    if body.amax.is_some() {
        params.push("float* ra".into());
    }
    let _ = writeln!(
        src,
        "__device__ __forceinline__ void {name}_body({}) {{",
        params.join(", ")
    );
    let mut expr: Vec<String> = Vec::with_capacity(body.steps.len());
    let mut rounds = 0usize;
    let reg = |expr: &[String], r: usize| expr.get(r).cloned().unwrap_or_else(|| "0.0f".into());
    for step in &body.steps {
        let e = match *step {
            Step::Load { input } => format!("x{input}"),
            Step::Unary { op, x } => format!("{}::f({})", functor(op), reg(&expr, x)),
            // The CPU twin computes dx = dy * f'(x).
            Step::UnaryGrad { op, x, dy } => {
                format!(
                    "{} * {}::df({})",
                    reg(&expr, dy),
                    functor(op),
                    reg(&expr, x)
                )
            }
            Step::Binary { op, a, b } => {
                let sym = match op {
                    BinaryOp::Add => "+",
                    BinaryOp::Sub => "-",
                    BinaryOp::Mul => "*",
                    BinaryOp::Div => "/",
                };
                format!("{} {sym} {}", reg(&expr, a), reg(&expr, b))
            }
            Step::Scale { x, factor } => format!("{} * {}", reg(&expr, x), f32_literal(factor)),
            // The F32 product; the FP8 output's store rounds it.
            Step::Quantize { x, scale } => format!("({} * {})", reg(&expr, x), reg(&expr, scale)),
            Step::Round { x, to } => {
                let member = members
                    .get(rounds)
                    .map(|&m| g.name(g.node(m).outputs[0]).to_string())
                    .unwrap_or_default();
                let _ = writeln!(
                    src,
                    "    const float t{rounds} = round_to<{}>({});  // %{member}",
                    cuda_type(to),
                    reg(&expr, x)
                );
                rounds += 1;
                format!("t{}", rounds - 1)
            }
        };
        expr.push(e);
    }
    for (o, out) in body.outputs.iter().enumerate() {
        let _ = writeln!(src, "    *r{o} = {};", reg(&expr, out.step));
    }
    if let Some(a) = &body.amax {
        let _ = writeln!(src, "    *ra = {};", reg(&expr, a.step));
    }
    src.push_str("}\n\n");

    // No `__restrict__`: the CUDA lowering updates state in place (an accumulated gradient is
    // both an input and an output of its kernel), and restrict-qualified pointers that alias
    // are undefined behaviour. Each thread reads an element before it writes it, so in-place
    // use is otherwise safe.
    let mut args: Vec<String> = body
        .inputs
        .iter()
        .enumerate()
        .map(|(k, input)| format!("const {}* in{k}", cuda_type(input.dtype)))
        .collect();
    args.extend(
        body.outputs
            .iter()
            .enumerate()
            .map(|(o, out)| format!("{}* out{o}", cuda_type(out.dtype))),
    );
    if body.amax.is_some() {
        args.push("float* partials".into());
    }
    args.push("i64 n".into());
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}({}) {{",
        args.join(", ")
    );
    src.push_str("    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;\n");
    src.push_str("    const i64 stride = i64(gridDim.x) * blockDim.x;\n");
    src.push_str("    i64 done = 0;\n");
    if body.amax.is_some() {
        src.push_str("    float m = 0.0f;\n    bool nan = false;\n");
    }
    let index: Vec<String> = body.inputs.iter().map(|x| index_expr(&x.index)).collect();
    let mut outs: Vec<String> = (0..body.outputs.len()).map(|o| format!("&r{o}")).collect();
    if body.amax.is_some() {
        outs.push("&ra".into());
    }
    // The vector path needs every input to be full-size or a scalar, and 16-bit or F32 stores.
    if index.iter().all(|e| e == "i" || e == "0") && !elementwise_only(body) {
        let mut aligned: Vec<String> = (0..body.outputs.len())
            .map(|o| format!("aligned16(out{o})"))
            .collect();
        for (k, e) in index.iter().enumerate() {
            if e == "i" {
                aligned.push(format!("aligned16(in{k})"));
            }
        }
        let _ = writeln!(src, "    if ({}) {{", aligned.join(" && "));
        src.push_str("        const i64 units = n / UNIT;\n");
        src.push_str("        for (i64 u = tid; u < units; u += stride) {\n");
        let mut call = Vec::new();
        for (k, e) in index.iter().enumerate() {
            if e == "i" {
                let _ = writeln!(
                    src,
                    "            float v{k}[UNIT];\n            load8(in{k} + u * UNIT, v{k});"
                );
                call.push(format!("v{k}[e]"));
            } else {
                let _ = writeln!(src, "            const float s{k} = to_f32(in{k}[0]);");
                call.push(format!("s{k}"));
            }
        }
        for o in 0..body.outputs.len() {
            let _ = writeln!(src, "            float r{o}[UNIT];");
            call.push(format!("&r{o}[e]"));
        }
        let _ = writeln!(
            src,
            "#pragma unroll\n            for (int e = 0; e < UNIT; ++e) {name}_body({});",
            call.join(", ")
        );
        for o in 0..body.outputs.len() {
            let _ = writeln!(src, "            store8(out{o} + u * UNIT, r{o});");
        }
        src.push_str("        }\n        done = units * UNIT;\n    }\n");
    }
    src.push_str("    for (i64 i = done + tid; i < n; i += stride) {\n");
    let mut regs: Vec<String> = (0..body.outputs.len()).map(|o| format!("r{o}")).collect();
    if body.amax.is_some() {
        regs.push("ra".into());
    }
    let _ = writeln!(src, "        float {};", regs.join(", "));
    let mut call: Vec<String> = index
        .iter()
        .enumerate()
        .map(|(k, e)| format!("to_f32(in{k}[{e}])"))
        .collect();
    call.extend(outs);
    let _ = writeln!(src, "        {name}_body({});", call.join(", "));
    for (o, out) in body.outputs.iter().enumerate() {
        let _ = writeln!(
            src,
            "        {}",
            store(o, out.dtype, "i", &format!("r{o}"))
        );
    }
    if body.amax.is_some() {
        src.push_str("        fold_abs(ra, m, nan);\n");
    }
    src.push_str("    }\n");
    if body.amax.is_some() {
        // Every thread reaches the block reduction (the loop above is grid-stride).
        src.push_str("    __shared__ float scratch[32];\n");
        src.push_str("    const float b = block_max(nan ? F32_CANONICAL_NAN : m, scratch);\n");
        src.push_str("    if (threadIdx.x == 0) partials[blockIdx.x] = b;\n");
    }
    src.push_str("}\n");
    src
}
