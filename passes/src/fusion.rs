//! Fusion: groups chains of pointwise nodes into one kernel each and generates its CUDA C.
//!
//! A group is a set of pointwise nodes (`unary`, `unary_grad`, `binary`, `scale`, float
//! `cast`) over one iteration space (every member has the same output shape; operands from
//! outside may broadcast, as a bias does). A node joins the group of a pointwise producer it
//! reads. The group runs where its last member stood, so a node may join only if every value
//! the group's members make that is read outside the group is read after that point. Its
//! results are those values (a training step's forward keeps pre-activations for the backward,
//! so a bias add + GELU group writes both).
//!
//! The generated kernel loads each input in its storage dtype, computes in F32, rounds every
//! member's value to the dtype the unfused graph stores it in (so fused and unfused agree bit
//! for bit), and stores the result. It reads and writes 8 elements per step with 16-byte
//! vectors when every full-size pointer is 16-byte aligned, and element by element otherwise
//! and for the tail. A residual add in front of a normalization, and the add of another
//! gradient after a normalization's backward, are fused into the norm kernels by the CUDA
//! lowering (`runtime/src/cuda/lower`), which takes such an add out of its group.

use castor_ir::{DType, FusedKernel, Graph, Node, Op, Shape, UnaryOp, Value};
use std::collections::HashMap;
use std::fmt::Write;

/// The pointwise groups of `g` (two members or more), each in node order.
pub fn fusion_groups(g: &Graph) -> Vec<Vec<Node>> {
    let users = g.users();
    let mut group_of: Vec<Option<usize>> = vec![None; g.num_nodes()];
    let mut groups: Vec<Vec<Node>> = Vec::new();
    for (n, node) in g.nodes() {
        if !is_pointwise(g, n) {
            continue;
        }
        let shape = &g.ty(node.outputs[0]).shape;
        let mut candidate: Vec<usize> = Vec::new();
        for &v in &node.inputs {
            let p = g.value(v).producer;
            if let Some(gi) = group_of[p.index()] {
                if &g.ty(v).shape == shape && !candidate.contains(&gi) {
                    candidate.push(gi);
                }
            }
        }
        // Join each candidate group that can still run at `n` with the others joined so far.
        let mut members: Vec<Node> = vec![n];
        let mut joined: Vec<usize> = Vec::new();
        for gi in candidate {
            let mut trial = members.clone();
            trial.extend(groups[gi].iter().copied());
            if runs_at_last_member(g, &users, &trial) {
                members = trial;
                joined.push(gi);
            }
        }
        let target = match joined.first() {
            None => {
                groups.push(Vec::new());
                groups.len() - 1
            }
            Some(&first) => {
                for &other in &joined[1..] {
                    for m in std::mem::take(&mut groups[other]) {
                        group_of[m.index()] = Some(first);
                        groups[first].push(m);
                    }
                }
                first
            }
        };
        groups[target].push(n);
        group_of[n.index()] = Some(target);
    }
    let mut out: Vec<Vec<Node>> = groups.into_iter().filter(|m| m.len() >= 2).collect();
    for m in &mut out {
        m.sort();
    }
    out.sort_by_key(|m| m.last().copied());
    out
}

/// True if every value the members make that is read outside them is read after the last
/// member (so the group can run there).
fn runs_at_last_member(g: &Graph, users: &[Vec<Node>], members: &[Node]) -> bool {
    let Some(&last) = members.iter().max() else {
        return true;
    };
    members.iter().all(|&m| {
        users[g.node(m).outputs[0].index()]
            .iter()
            .all(|u| members.contains(u) || *u > last)
    })
}

/// The members' values read outside the group or returned by the graph: the group's results.
pub fn group_outputs(g: &Graph, users: &[Vec<Node>], members: &[Node]) -> Vec<Value> {
    members
        .iter()
        .map(|&m| g.node(m).outputs[0])
        .filter(|v| {
            g.outputs().contains(v) || users[v.index()].iter().any(|u| !members.contains(u))
        })
        .collect()
}

fn is_pointwise(g: &Graph, n: Node) -> bool {
    let node = g.node(n);
    let float_in = node.inputs.iter().all(|&v| g.ty(v).dtype.is_float());
    let float_out = node.outputs.len() == 1 && g.ty(node.outputs[0]).dtype.is_float();
    let op = matches!(
        node.op,
        Op::Unary(_) | Op::UnaryGrad(_) | Op::Binary(_) | Op::Scale { .. } | Op::Cast { .. }
    );
    op && float_in && float_out
}

/// The fused kernels of graph `graph_name` in a plan: one per group, named `<prefix><i>`.
pub fn fused_kernels(g: &Graph, graph_name: &str, prefix: &str) -> Vec<FusedKernel> {
    let users = g.users();
    fusion_groups(g)
        .into_iter()
        .enumerate()
        .map(|(i, members)| {
            let name = format!("{prefix}{i}");
            FusedKernel {
                source: cuda_source(g, &users, &members, &name),
                name,
                graph: graph_name.to_string(),
                members: members
                    .iter()
                    .map(|&m| g.name(g.node(m).outputs[0]).to_string())
                    .collect(),
            }
        })
        .collect()
}

/// The values a group reads from outside, in order of first use.
pub fn group_inputs(g: &Graph, members: &[Node]) -> Vec<Value> {
    let inside: std::collections::HashSet<Value> =
        members.iter().map(|&m| g.node(m).outputs[0]).collect();
    let mut inputs = Vec::new();
    for &m in members {
        for &v in &g.node(m).inputs {
            if !inside.contains(&v) && !inputs.contains(&v) {
                inputs.push(v);
            }
        }
    }
    inputs
}

fn cuda_type(d: DType) -> &'static str {
    match d {
        DType::F16 => "__half",
        DType::BF16 => "__nv_bfloat16",
        _ => "float",
    }
}

fn functor(u: UnaryOp) -> &'static str {
    match u {
        UnaryOp::GeluTanh => "GeluTanh",
        UnaryOp::GeluErf => "GeluErf",
        UnaryOp::Silu => "Silu",
        UnaryOp::Tanh => "TanhFn",
        UnaryOp::Exp => "ExpFn",
        UnaryOp::Rsqrt => "RsqrtFn",
        UnaryOp::Neg => "NegFn",
    }
}

/// An exact F32 literal.
fn f32_literal(x: f64) -> String {
    format!("__int_as_float(0x{:08x})", (x as f32).to_bits())
}

/// How input element `i` of the output's flat index is found: `i` for a full-size input, `0`
/// for a scalar, else a sum over the output's dims that the input does not broadcast.
fn index_expr(input: &Shape, out: &Shape) -> String {
    let out_dims = out.dims();
    let in_dims = input.dims();
    if in_dims == out_dims {
        return "i".into();
    }
    if input.numel() == Some(1) {
        return "0".into();
    }
    let rank = out_dims.len();
    let offset = rank - in_dims.len();
    let mut out_stride = 1i64;
    let mut in_stride = 1i64;
    let mut terms = Vec::new();
    for d in (0..rank).rev() {
        let od = out_dims[d] as i64;
        let id = if d >= offset {
            in_dims[d - offset] as i64
        } else {
            1
        };
        if id != 1 {
            terms.push(format!("((i / {out_stride}LL) % {od}LL) * {in_stride}LL"));
        }
        out_stride *= od;
        if d >= offset {
            in_stride *= in_dims[d - offset] as i64;
        }
    }
    if terms.is_empty() {
        "0".into()
    } else {
        terms.reverse();
        terms.join(" + ")
    }
}

/// The CUDA C source of one group's kernel.
pub fn cuda_source(g: &Graph, users: &[Vec<Node>], members: &[Node], name: &str) -> String {
    let inputs = group_inputs(g, members);
    let outputs = group_outputs(g, users, members);
    let Some(&root) = members.last() else {
        return String::new();
    };
    let shape = g.ty(g.node(root).outputs[0]).shape.clone();
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {} fused pointwise nodes over {shape}, {} result(s):",
        members.len(),
        outputs.len()
    );
    for &m in members {
        let v = g.node(m).outputs[0];
        let mark = if outputs.contains(&v) {
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

    // The members as one function of the inputs' F32 values, writing the results.
    let mut params: Vec<String> = (0..inputs.len()).map(|k| format!("float x{k}")).collect();
    params.extend((0..outputs.len()).map(|o| format!("float* r{o}")));
    let _ = writeln!(
        src,
        "__device__ __forceinline__ void {name}_body({}) {{",
        params.join(", ")
    );
    let mut local: HashMap<Value, String> = HashMap::new();
    for (k, &v) in inputs.iter().enumerate() {
        local.insert(v, format!("x{k}"));
    }
    for (j, &m) in members.iter().enumerate() {
        let node = g.node(m);
        let v = node.outputs[0];
        let a: Vec<String> = node
            .inputs
            .iter()
            .map(|x| local.get(x).cloned().unwrap_or_else(|| "0.0f".into()))
            .collect();
        let expr = match &node.op {
            Op::Unary(u) => format!("{}::f({})", functor(*u), a[0]),
            // The CPU twin computes dx = dy * f'(x).
            Op::UnaryGrad(u) => format!("{} * {}::df({})", a[1], functor(*u), a[0]),
            Op::Binary(b) => {
                let sym = match b {
                    castor_ir::BinaryOp::Add => "+",
                    castor_ir::BinaryOp::Sub => "-",
                    castor_ir::BinaryOp::Mul => "*",
                    castor_ir::BinaryOp::Div => "/",
                };
                format!("{} {sym} {}", a[0], a[1])
            }
            Op::Scale { factor } => format!("{} * {}", a[0], f32_literal(*factor)),
            _ => a[0].clone(),
        };
        let _ = writeln!(
            src,
            "    const float t{j} = round_to<{}>({expr});  // %{}",
            cuda_type(g.ty(v).dtype),
            g.name(v)
        );
        local.insert(v, format!("t{j}"));
    }
    for (o, v) in outputs.iter().enumerate() {
        let t = local.get(v).cloned().unwrap_or_else(|| "0.0f".into());
        let _ = writeln!(src, "    *r{o} = {t};");
    }
    src.push_str("}\n\n");

    // No `__restrict__`: the CUDA lowering updates state in place (an accumulated gradient is
    // both an input and an output of its kernel), and restrict-qualified pointers that alias
    // are undefined behaviour. Each thread reads an element before it writes it, so in-place
    // use is otherwise safe.
    let mut args: Vec<String> = inputs
        .iter()
        .enumerate()
        .map(|(k, &v)| format!("const {}* in{k}", cuda_type(g.ty(v).dtype)))
        .collect();
    args.extend(
        outputs
            .iter()
            .enumerate()
            .map(|(o, &v)| format!("{}* out{o}", cuda_type(g.ty(v).dtype))),
    );
    args.push("i64 n".into());
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}({}) {{",
        args.join(", ")
    );
    src.push_str("    const i64 tid = i64(blockIdx.x) * blockDim.x + threadIdx.x;\n");
    src.push_str("    const i64 stride = i64(gridDim.x) * blockDim.x;\n");
    src.push_str("    i64 done = 0;\n");
    let index: Vec<String> = inputs
        .iter()
        .map(|&v| index_expr(&g.ty(v).shape, &shape))
        .collect();
    let outs: Vec<String> = (0..outputs.len()).map(|o| format!("&r{o}")).collect();
    // The vector path needs every input to be full-size or a scalar.
    if index.iter().all(|e| e == "i" || e == "0") {
        let mut aligned: Vec<String> = (0..outputs.len())
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
        for o in 0..outputs.len() {
            let _ = writeln!(src, "            float r{o}[UNIT];");
            call.push(format!("&r{o}[e]"));
        }
        let _ = writeln!(
            src,
            "#pragma unroll\n            for (int e = 0; e < UNIT; ++e) {name}_body({});",
            call.join(", ")
        );
        for o in 0..outputs.len() {
            let _ = writeln!(src, "            store8(out{o} + u * UNIT, r{o});");
        }
        src.push_str("        }\n        done = units * UNIT;\n    }\n");
    }
    src.push_str("    for (i64 i = done + tid; i < n; i += stride) {\n");
    let _ = writeln!(
        src,
        "        float {};",
        (0..outputs.len())
            .map(|o| format!("r{o}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut call: Vec<String> = index
        .iter()
        .enumerate()
        .map(|(k, e)| format!("to_f32(in{k}[{e}])"))
        .collect();
    call.extend(outs);
    let _ = writeln!(src, "        {name}_body({});", call.join(", "));
    for (o, &v) in outputs.iter().enumerate() {
        let _ = writeln!(
            src,
            "        out{o}[i] = from_f32<{}>(r{o});",
            cuda_type(g.ty(v).dtype)
        );
    }
    src.push_str("    }\n}\n");
    src
}

/// `g` with every group's members moved to run back to back where the group's last member
/// stood: the order in which a fused plan executes. Running it gives the fused plan's results
/// (each member rounded where the graph stores it), so comparing it with `g` checks that the
/// groups are legal.
pub fn fused_order(g: &Graph, groups: &[Vec<Node>]) -> Result<Graph, castor_ir::IrError> {
    let mut last_of: HashMap<Node, usize> = HashMap::new();
    let mut member = vec![false; g.num_nodes()];
    for (gi, m) in groups.iter().enumerate() {
        if let Some(&last) = m.last() {
            last_of.insert(last, gi);
        }
        for &n in m {
            member[n.index()] = true;
        }
    }
    let mut order = Vec::with_capacity(g.num_nodes());
    for (n, _) in g.nodes() {
        if let Some(&gi) = last_of.get(&n) {
            order.extend(groups[gi].iter().copied());
        } else if !member[n.index()] {
            order.push(n);
        }
    }
    let mut out = Graph::empty_like(g);
    let mut map: HashMap<Value, Value> = HashMap::new();
    for n in order {
        let node = g.node(n);
        let inputs = node
            .inputs
            .iter()
            .map(|v| {
                map.get(v)
                    .copied()
                    .ok_or_else(|| castor_ir::IrError::Invalid {
                        site: castor_ir::Site {
                            node: g.name(node.outputs[0]).to_string(),
                            location: None,
                        },
                        message: format!("reads `%{}` before a fused group makes it", g.name(*v)),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let outputs = node
            .outputs
            .iter()
            .map(|&v| (g.name(v).to_string(), g.ty(v).clone()))
            .collect();
        let new = out.push_copy(g, n, inputs, outputs)?;
        for (&old, &v) in node.outputs.iter().zip(&out.node(new).outputs.clone()) {
            map.insert(old, v);
        }
    }
    out.set_outputs(
        g.outputs()
            .iter()
            .map(|v| map.get(v).copied().unwrap_or(*v))
            .collect(),
    );
    Ok(out)
}
