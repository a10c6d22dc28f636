//! Snapshot tests of the precision passes: the IR text before and after each pass, for every
//! hand-written IR file under tests/ir (run with the `# args:` lines each file carries) and for
//! every model family fixture under every policy. Reviewing a snapshot change is reviewing a
//! change to what castor decides.

use crate::common;

use castor::precision::PrecisionArgs;
use castor_ir::{text, verify, Accum, DType, Graph, Op, OpClass};
use castor_models::Model;
use castor_passes::{Autocast, Classify, FoldCasts, Fp8Products, Pass, Precision};
use clap::Parser;
use common::*;
use std::collections::HashSet;
use std::fmt::Write;

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    precision: PrecisionArgs,
}

/// Runs classify, autocast and fold_casts one by one, verifying after each, and renders the
/// IR before and after each pass (or the error).
fn run_passes(graph: Graph, args: &[&str], dir: &std::path::Path) -> (String, Option<Graph>) {
    let mut argv = vec!["castor"];
    argv.extend_from_slice(args);
    let flags = Flags::try_parse_from(argv).expect("valid args line");
    let mut precision = flags.precision;
    precision.policy = precision.policy.map(|p| dir.join(p));
    let mut out = format!("== input\n{}", text::print(&graph));
    // Snapshots must not depend on where the repository lives.
    let local = |s: String| s.replace(&format!("{}/", dir.display()), "");
    let policy = match precision.policy() {
        Ok(p) => p,
        Err(e) => return (local(format!("{out}== error\n{e:#}\n")), None),
    };
    let mut passes: Vec<Box<dyn Pass>> = vec![
        Box::new(Classify),
        Box::new(Autocast::new(policy.clone())),
        Box::new(FoldCasts),
    ];
    if policy.precision.is_fp8() {
        passes.push(Box::new(Fp8Products::new(
            policy.fp8().clone(),
            policy.precision.is_delayed(),
        )));
    }
    let mut g = graph;
    for pass in passes {
        match pass.run(&g) {
            Ok((next, report)) => {
                verify(&next)
                    .unwrap_or_else(|e| panic!("{} produced an invalid graph: {e}", pass.name()));
                let _ = writeln!(out, "== after {}: {}", pass.name(), report.summary);
                for d in &report.details {
                    let _ = writeln!(out, "   {d}");
                }
                if next == g {
                    out.push_str("(graph unchanged)\n");
                } else {
                    out.push_str(&text::print(&next));
                }
                g = next;
            }
            Err(e) => {
                let _ = writeln!(out, "== error in {}\n{e}", pass.name());
                return (local(out), None);
            }
        }
    }
    (local(out), Some(g))
}

#[test]
fn hand_written_ir_through_the_precision_passes() {
    let dir = root().join("tests").join("ir");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ir"))
        .collect();
    files.sort();
    let mut runs = 0;
    for path in files {
        let src = std::fs::read_to_string(&path).unwrap();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let arg_lines: Vec<&str> = src
            .lines()
            .filter_map(|l| l.strip_prefix("# args:"))
            .collect();
        for (i, line) in arg_lines.iter().enumerate() {
            let args: Vec<&str> = line.split_whitespace().collect();
            let g = text::parse(&src).unwrap();
            let (rendered, _) = run_passes(g, &args, &dir);
            insta::assert_snapshot!(format!("passes_{stem}_{i}"), rendered, line.trim());
            runs += 1;
        }
    }
    assert!(runs >= 12, "only {runs} runs");
}

#[test]
fn every_family_under_every_policy() {
    for variant in VARIANTS {
        let model = Model::load(fixture(variant)).unwrap();
        for precision in Precision::ALL {
            let g = model.build_graph(1, 4).unwrap();
            let (_, compiled) = run_passes(g, &["--precision", precision.name()], &root());
            let compiled = compiled.expect("the default policies compile every family");
            check_invariants(&compiled, precision, &format!("{variant} {precision}"));
            // `fp8:delayed` is `family_<variant>_fp8_delayed`.
            insta::assert_snapshot!(
                format!("family_{variant}_{}", precision.name().replace(':', "_")),
                text::print(&compiled)
            );
        }
    }
}

/// What every compiled graph must satisfy, whatever the family and policy.
fn check_invariants(g: &Graph, precision: Precision, what: &str) {
    let mut cast_targets = HashSet::new();
    for (_, node) in g.nodes() {
        let name = g.name(node.outputs[0]);
        if let Op::Cast { to } = node.op {
            let src = g.node(g.value(node.inputs[0]).producer);
            assert!(
                src.op != Op::Param,
                "{what}: parameter cast inside the step: %{name}"
            );
            assert!(
                cast_targets.insert((node.inputs[0], to)),
                "{what}: %{} cast twice to {to}",
                g.name(node.inputs[0])
            );
        }
        match node.op.class() {
            OpClass::Contraction => {
                let want = if precision == Precision::Tf32 {
                    Accum::Tf32
                } else {
                    Accum::F32
                };
                assert_eq!(
                    node.acc,
                    Some(want),
                    "{what}: contraction %{name} accumulates in {:?}",
                    node.acc
                );
            }
            OpClass::Normalization => {
                assert_eq!(
                    node.acc,
                    Some(Accum::F32),
                    "{what}: normalization %{name} computes in {:?}",
                    node.acc
                );
            }
            _ => {}
        }
    }
    for v in g.inputs() {
        assert!(
            !g.ty(v).dtype.is_low_precision(),
            "{what}: input %{} changed dtype",
            g.name(v)
        );
    }
    for &v in g.outputs() {
        assert!(
            !g.ty(v).dtype.is_low_precision(),
            "{what}: output %{} changed dtype",
            g.name(v)
        );
    }
}

/// `--residual low`: the residual stream, found by structure in every family (pre-norm adds,
/// post-norm residual adds, the embeddings that start it), computes and stores in the low
/// dtype and says why; the default keeps it F32; without a low dtype it is an error.
#[test]
fn residual_low_keeps_the_stream_in_the_low_dtype() {
    for (variant, adds) in [
        (
            "gpt2_lm",
            &["embeddings", "h.0.attn_residual", "h.1.mlp_residual"][..],
        ),
        (
            "llama_gqa",
            &[
                "embed_tokens",
                "layers.0.attn_residual",
                "layers.1.mlp_residual",
            ][..],
        ),
        (
            "bert_mlm",
            &[
                "embeddings.with_token_types",
                "encoder.layer.0.attention.output.residual",
            ][..],
        ),
    ] {
        for (residual, dtype) in [("low", DType::BF16), ("f32", DType::F32)] {
            let o = castor(&[
                "compile",
                path_str(&fixture(variant)),
                "--precision",
                "bf16",
                "--residual",
                residual,
                "--seq",
                "7",
                "--emit",
                "ir",
            ]);
            assert!(o.status.success(), "{}", stderr(&o));
            let g = castor_ir::text::parse(&stdout(&o)).unwrap();
            for name in adds {
                let v = g
                    .lookup(name)
                    .unwrap_or_else(|| panic!("{variant}: no %{name}"));
                assert_eq!(
                    g.ty(v).dtype,
                    dtype,
                    "{variant} --residual {residual}: %{name}"
                );
                if residual == "low" {
                    let note = g.node(g.value(v).producer).note.clone().unwrap_or_default();
                    assert!(note.contains("--residual low"), "{variant} %{name}: {note}");
                }
            }
        }
    }
    let o = castor(&[
        "compile",
        path_str(&fixture("gpt2_lm")),
        "--precision",
        "fp32",
        "--residual",
        "low",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains("needs a low-precision dtype"),
        "{}",
        stderr(&o)
    );
}
