//! `lora`: low-rank adapters beside the products by chosen weights, as PEFT's LoRA defines
//! them. A product `y = x·W` (or `x·Wᵀ`, plus its bias) by the weight of a target module
//! becomes `y + (alpha/r) · (x·Aᵀ)·Bᵀ`, with `A` (`[r, in]`) and `B` (`[out, r]`) new
//! parameters named `<module>.lora_A.weight` and `<module>.lora_B.weight`, PEFT's names
//! without its `base_model.model.` prefix. The sum is added after the bias, in PEFT's order
//! (`result + lora_B(lora_A(x)) * scaling`); the base product keeps its node and is renamed
//! `<name>.base`, so the sum carries the name the model gave the product. Every other
//! parameter is the frozen base (the training plan gives it no gradient, state or master).
//!
//! Targets follow PEFT's `target_modules` given as a list: a module (a weight's name without
//! `.weight`) is a target when it equals a target or ends with `.` and the target
//! (`c_attn` matches `transformer.h.0.attn.c_attn`); a target with `*` or `?` is a glob on the
//! whole module name; `all-linear` takes every product by a 2-D weight except the output
//! layer (the product the front end marked `origin=head`, or one by a weight an embedding
//! also reads), as PEFT's `all-linear` does. The adapter parameters are marked
//! `origin=adapter`: what the training plan reads to tell them from the frozen base.

use crate::{Pass, PassError, PassReport};
use castor_ir::{BinaryOp, DType, Graph, LoraSettings, Node, Op, Origin, Shape, TensorType, Value};
use std::collections::BTreeMap;

/// The `lora` pass.
pub struct Lora {
    pub config: LoraSettings,
}

/// One adapted product: the node whose result gets the adapters' sum (the product, or its
/// bias add), the product's input, and the weight's shape as `(in, out)`.
struct Site {
    module: String,
    input: Value,
    after: Node,
    inner: usize,
    outer: usize,
}

impl Pass for Lora {
    fn name(&self) -> &'static str {
        "lora"
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let c = &self.config;
        if c.rank == 0 {
            return Err(PassError::Training("--lora-rank must be at least 1".into()));
        }
        let sites = find_sites(g, c);
        if sites.is_empty() {
            let modules = weight_modules(g);
            return Err(PassError::Training(format!(
                "--lora-targets `{}` matches no product by a weight; the modules with one are \
                 {}",
                c.targets.join(","),
                summarize(&modules)
            )));
        }
        let graph = rewrite(g, &sites, c)?;
        let adapter_params: usize = sites.iter().map(|s| c.rank * (s.inner + s.outer)).sum();
        let base_params: usize = g.params().map(|p| g.ty(p).shape.numel().unwrap_or(0)).sum();
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        for s in &sites {
            let leaf = s.module.rsplit('.').next().unwrap_or(&s.module);
            *kinds.entry(leaf).or_default() += 1;
        }
        let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} x{n}")).collect();
        let report = PassReport::new(format!(
            "r={}, alpha={} (scale {}): adapters on {} product(s) ({}); {} adapter \
             parameters, {} base parameters frozen ({:.3}% trained)",
            c.rank,
            c.alpha,
            c.scaling(),
            sites.len(),
            kinds.join(", "),
            castor_ir::thousands(adapter_params as u64),
            castor_ir::thousands(base_params as u64),
            100.0 * adapter_params as f64 / (adapter_params + base_params).max(1) as f64
        ));
        Ok((graph, report))
    }
}

/// The modules whose weight a product reads, in graph order, each once.
fn weight_modules(g: &Graph) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (_, node) in g.nodes() {
        if let Some((module, _, _)) = product_by_weight(g, node) {
            if !out.contains(&module) {
                out.push(module);
            }
        }
    }
    out
}

/// A few module names, then how many more.
fn summarize(modules: &[String]) -> String {
    if modules.is_empty() {
        return "none".into();
    }
    let shown: Vec<&str> = modules.iter().take(6).map(String::as_str).collect();
    match modules.len() - shown.len() {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

/// `(module, in, out)` of a product by a 2-D weight parameter `<module>.weight`.
fn product_by_weight(g: &Graph, node: &castor_ir::NodeData) -> Option<(String, usize, usize)> {
    let Op::MatMul {
        transpose_a: false,
        transpose_b,
    } = node.op
    else {
        return None;
    };
    let w = node.inputs[1];
    if !matches!(g.node(g.value(w).producer).op, Op::Param) {
        return None;
    }
    let module = g.name(w).strip_suffix(".weight")?.to_string();
    let dims = g.ty(w).shape.dims();
    let (inner, outer) = match (dims, transpose_b) {
        (&[out, inn], true) => (inn, out),
        (&[inn, out], false) => (inn, out),
        _ => return None,
    };
    Some((module, inner, outer))
}

fn find_sites(g: &Graph, c: &LoraSettings) -> Vec<Site> {
    let users = g.users();
    // Weights an embedding also reads: a tied output layer, which `all-linear` leaves out.
    let embedded: Vec<Value> = g
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::Embedding { .. }))
        .map(|(_, n)| n.inputs[0])
        .collect();
    let mut sites = Vec::new();
    for (n, node) in g.nodes() {
        let Some((module, inner, outer)) = product_by_weight(g, node) else {
            continue;
        };
        let output_layer = node.origin == Some(Origin::Head) || embedded.contains(&node.inputs[1]);
        let chosen = if c.all_linear() {
            !output_layer
        } else {
            c.targets_module(&module)
        };
        if !chosen {
            continue;
        }
        // The sum goes after the bias add when the product's one reader adds a bias vector.
        let y = node.outputs[0];
        let after = match users[y.index()].as_slice() {
            [add] if !g.outputs().contains(&y) => {
                let a = g.node(*add);
                let bias = a.inputs.iter().find(|&&v| v != y).copied();
                let is_bias = bias.is_some_and(|b| {
                    matches!(g.node(g.value(b).producer).op, Op::Param)
                        && g.ty(b).shape.dims() == [outer]
                });
                if a.op == Op::Binary(BinaryOp::Add) && is_bias {
                    *add
                } else {
                    n
                }
            }
            _ => n,
        };
        sites.push(Site {
            module,
            input: node.inputs[0],
            after,
            inner,
            outer,
        });
    }
    sites
}

/// `g` with every site's adapters: the adapter parameters first (sources, in site order),
/// then `g`'s nodes, each site's anchor followed by its adapter ops.
fn rewrite(g: &Graph, sites: &[Site], c: &LoraSettings) -> Result<Graph, PassError> {
    let ir = |e: castor_ir::IrError| PassError::Internal {
        pass: "lora",
        message: e.to_string(),
    };
    let mut out = Graph::empty_like(g);
    let f32 = |dims: Vec<usize>| TensorType::new(DType::F32, Shape(dims));
    let mut adapters = Vec::with_capacity(sites.len());
    for s in sites {
        let mut param = |which: char, dims: Vec<usize>| {
            let n = out
                .push_node(
                    Op::Param,
                    vec![],
                    vec![(LoraSettings::adapter_name(&s.module, which), f32(dims))],
                )
                .map_err(ir)?;
            out.set_origin(n, Some(Origin::Adapter));
            Ok::<Value, PassError>(out.node(n).outputs[0])
        };
        let a = param('A', vec![c.rank, s.inner])?;
        let b = param('B', vec![s.outer, c.rank])?;
        adapters.push((a, b));
    }
    let mut map: Vec<Option<Value>> = vec![None; g.num_values()];
    let at = |map: &[Option<Value>], v: Value| {
        map[v.index()].ok_or_else(|| PassError::Internal {
            pass: "lora",
            message: format!("`%{}` is used before it is defined", g.name(v)),
        })
    };
    for (n, node) in g.nodes() {
        let ins = node
            .inputs
            .iter()
            .map(|&v| at(&map, v))
            .collect::<Result<Vec<_>, _>>()?;
        let site = sites.iter().position(|s| s.after == n);
        let result = |v: Value| {
            let name = match site {
                Some(_) => format!("{}.base", g.name(v)),
                None => g.name(v).to_string(),
            };
            (name, g.ty(v).clone())
        };
        let copy = out
            .push_copy(g, n, ins, node.outputs.iter().map(|&v| result(v)).collect())
            .map_err(ir)?;
        let new_outputs = out.node(copy).outputs.clone();
        for (&old, &new) in node.outputs.iter().zip(&new_outputs) {
            map[old.index()] = Some(new);
        }
        let Some(i) = site else { continue };
        let (s, (a, b)) = (&sites[i], adapters[i]);
        let y = node.outputs[0];
        let name = g.name(y);
        let x = at(&map, s.input)?;
        let mut lead: Vec<usize> = g.ty(y).shape.dims().to_vec();
        lead.pop();
        let with_last = |last: usize| {
            let mut d = lead.clone();
            d.push(last);
            f32(d)
        };
        let block = out.node(copy).block;
        let mut push = |op: Op, ins: Vec<Value>, out_name: String, ty: TensorType| {
            let made = out.push_node(op, ins, vec![(out_name, ty)]).map_err(ir)?;
            out.set_block(made, block);
            Ok::<Value, PassError>(out.node(made).outputs[0])
        };
        let product = |transpose_b| Op::MatMul {
            transpose_a: false,
            transpose_b,
        };
        let xa = push(
            product(true),
            vec![x, a],
            format!("{name}.lora_a"),
            with_last(c.rank),
        )?;
        let xab = push(
            product(true),
            vec![xa, b],
            format!("{name}.lora_b"),
            with_last(s.outer),
        )?;
        let scaled = push(
            Op::Scale {
                factor: c.scaling(),
            },
            vec![xab],
            format!("{name}.lora"),
            with_last(s.outer),
        )?;
        let sum = push(
            Op::Binary(BinaryOp::Add),
            vec![new_outputs[0], scaled],
            name.to_string(),
            g.ty(y).clone(),
        )?;
        map[y.index()] = Some(sum);
    }
    let outputs = g
        .outputs()
        .iter()
        .map(|&v| at(&map, v))
        .collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(outputs);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use castor_ir::text;

    const LINEARS: &str = "graph g {
  %x: f32[2,3,4] = input
  %layers.0.q_proj.weight: f32[6,4] = param
  %layers.0.v_proj.weight: f32[6,4] = param
  %layers.0.v_proj.bias: f32[6] = param
  %q: f32[2,3,6] = matmul(%x, %layers.0.q_proj.weight) {transpose_a=false, transpose_b=true}
  %v.matmul: f32[2,3,6] = matmul(%x, %layers.0.v_proj.weight) {transpose_a=false, transpose_b=true}
  %v: f32[2,3,6] = add(%v.matmul, %layers.0.v_proj.bias)
  %y: f32[2,3,6] = add(%q, %v)
  return %y
}
";

    fn lora(targets: &[&str]) -> Lora {
        Lora {
            config: LoraSettings {
                rank: 2,
                alpha: 8.0,
                targets: targets.iter().map(|t| t.to_string()).collect(),
                base: castor_ir::LoraBase::Compute,
            },
        }
    }

    #[test]
    fn targets_follow_peft_list_semantics() {
        let c = lora(&["q_proj", "h.*.c_attn"]).config;
        assert!(c.targets_module("model.layers.0.self_attn.q_proj"));
        assert!(c.targets_module("q_proj"));
        assert!(!c.targets_module("model.layers.0.self_attn.xq_proj"));
        assert!(c.targets_module("h.3.c_attn"));
        assert!(
            !c.targets_module("transformer.h.3.c_attn"),
            "globs match the whole name"
        );
        assert_eq!(c.scaling(), 4.0);
    }

    #[test]
    fn adapters_go_beside_each_target_after_its_bias() {
        let g = text::parse(LINEARS).unwrap();
        let (out, report) = lora(&["q_proj", "v_proj"]).run(&g).unwrap();
        castor_ir::verify(&out).unwrap();
        let printed = text::print(&out);
        for line in [
            "%layers.0.q_proj.lora_A.weight: f32[2,4] = param {origin=adapter}",
            "%layers.0.q_proj.lora_B.weight: f32[6,2] = param {origin=adapter}",
            "%q.base: f32[2,3,6] = matmul(%x, %layers.0.q_proj.weight)",
            "%q.lora_a: f32[2,3,2] = matmul(%x, %layers.0.q_proj.lora_A.weight) {transpose_a=false, transpose_b=true}",
            "%q.lora_b: f32[2,3,6] = matmul(%q.lora_a, %layers.0.q_proj.lora_B.weight) {transpose_a=false, transpose_b=true}",
            "%q.lora: f32[2,3,6] = scale(%q.lora_b) {factor=4.0}",
            "%q: f32[2,3,6] = add(%q.base, %q.lora)",
            "%v.matmul: f32[2,3,6] = matmul(%x, %layers.0.v_proj.weight)",
            "%v.base: f32[2,3,6] = add(%v.matmul, %layers.0.v_proj.bias)",
            "%v: f32[2,3,6] = add(%v.base, %v.lora)",
            "%y: f32[2,3,6] = add(%q, %v)",
        ] {
            assert!(printed.contains(line), "missing `{line}` in\n{printed}");
        }
        assert_eq!(
            report.summary,
            "r=2, alpha=8 (scale 4): adapters on 2 product(s) (q_proj x1, v_proj x1); 40 \
             adapter parameters, 54 base parameters frozen (42.553% trained)"
        );
    }

    #[test]
    fn a_target_that_matches_nothing_names_the_modules_there_are() {
        let g = text::parse(LINEARS).unwrap();
        let Err(e) = lora(&["c_attn"]).run(&g) else {
            panic!("no error")
        };
        assert!(
            e.to_string().contains(
                "--lora-targets `c_attn` matches no product by a weight; the modules with one \
                 are layers.0.q_proj, layers.0.v_proj"
            ),
            "{e}"
        );
    }

    #[test]
    fn all_linear_leaves_out_a_tied_output_layer() {
        let src = "graph g {
  %ids: i64[1,3] = input
  %wte.weight: f32[10,4] = param
  %h.0.fc.weight: f32[4,4] = param
  %e: f32[1,3,4] = embedding(%wte.weight, %ids)
  %h: f32[1,3,4] = matmul(%e, %h.0.fc.weight) {transpose_a=false, transpose_b=false}
  %logits: f32[1,3,10] = matmul(%h, %wte.weight) {transpose_a=false, transpose_b=true}
  return %logits
}
";
        let g = text::parse(src).unwrap();
        let (out, report) = lora(&["all-linear"]).run(&g).unwrap();
        assert!(out.lookup("h.0.fc.lora_A.weight").is_some());
        assert!(out.lookup("wte.lora_A.weight").is_none());
        assert!(report.summary.contains("adapters on 1 product(s) (fc x1)"));
    }

    #[test]
    fn all_linear_leaves_out_the_product_marked_head_whatever_its_name() {
        // The front end marks the output head; a weight merely named `lm_head` is a linear
        // layer like any other.
        let src = "graph g {
  %x: f32[1,3,4] = input
  %blocks.0.fc.weight: f32[4,4] = param
  %lm_head.weight: f32[4,4] = param
  %out.weight: f32[10,4] = param
  %h: f32[1,3,4] = matmul(%x, %blocks.0.fc.weight) {transpose_a=false, transpose_b=true}
  %g: f32[1,3,4] = matmul(%h, %lm_head.weight) {transpose_a=false, transpose_b=true}
  %logits: f32[1,3,10] = matmul(%g, %out.weight) {transpose_a=false, transpose_b=true, origin=head}
  return %logits
}
";
        let g = text::parse(src).unwrap();
        let (out, report) = lora(&["all-linear"]).run(&g).unwrap();
        let adapters: Vec<&str> = out
            .with_origin(Origin::Adapter)
            .map(|v| out.name(v))
            .collect();
        assert_eq!(
            adapters,
            [
                "blocks.0.fc.lora_A.weight",
                "blocks.0.fc.lora_B.weight",
                "lm_head.lora_A.weight",
                "lm_head.lora_B.weight"
            ]
        );
        assert!(out.has_origin(out.lookup("logits").unwrap(), Origin::Head));
        assert!(
            report.summary.contains("adapters on 2 product(s)"),
            "{}",
            report.summary
        );
    }
}
