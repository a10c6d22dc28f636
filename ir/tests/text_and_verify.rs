//! The text format's error reporting and the verifier's rules, on small inline graphs.
//! (Round trips of the hand-written files and model graphs live in the workspace tests.)

use castor_ir::{
    text, verify, BinaryOp, DType, Graph, GraphBuilder, IrError, Op, Origin, TensorType,
};

fn parse_err(src: &str) -> (usize, usize, String) {
    match text::parse(src) {
        Err(IrError::Parse {
            line,
            column,
            message,
        }) => (line, column, message),
        other => panic!("expected a parse error, got {other:?}"),
    }
}

fn verify_err(src: &str) -> String {
    let g = text::parse(src).expect("parses");
    verify(&g).expect_err("verifier should reject").to_string()
}

#[test]
fn builder_graph_round_trips_and_verifies() {
    let mut b = GraphBuilder::new("t");
    let x = b.input("x", TensorType::new(DType::F32, [2, 3])).unwrap();
    let w = b.param("w", TensorType::new(DType::F32, [4, 3])).unwrap();
    let y = b
        .scoped("layer", |b| {
            b.op(
                "proj",
                Op::MatMul {
                    transpose_a: false,
                    transpose_b: true,
                },
                &[x, w],
            )
        })
        .unwrap();
    let z = b.op("proj", Op::Scale { factor: 1e-5 }, &[y]).unwrap();
    let parts = b
        .op_multi(
            "parts",
            Op::Split {
                axis: 1,
                sizes: vec![1, 3],
            },
            &[z],
        )
        .unwrap();
    b.set_outputs(parts.clone());
    let g = b.finish();
    verify(&g).unwrap();
    assert_eq!(g.name(y), "layer.proj");
    assert_eq!(g.name(parts[1]), "parts.1");
    let printed = text::print(&g);
    let again = text::parse(&printed).unwrap();
    verify(&again).unwrap();
    assert_eq!(text::print(&again), printed);
    assert!(printed
        .contains("%layer.proj: f32[2,4] = matmul(%x, %w) {transpose_a=false, transpose_b=true}"));
}

#[test]
fn notes_round_trip() {
    let src = "graph n {\n  %x: f32[2] = input  # the input\n  %y: f32[2] = neg(%x)  # follow: input %x is f32\n  return %y\n}\n";
    let g = text::parse(src).unwrap();
    assert_eq!(text::print(&g), src);
}

#[test]
fn parse_errors_have_line_and_column() {
    let (l, c, m) = parse_err(
        "graph g {\n  %x: f32[2] = input\n  %y: f32[2] = frobnicate(%x)\n  return %y\n}\n",
    );
    assert_eq!((l, c), (3, 16));
    assert!(m.contains("unknown op `frobnicate`"), "{m}");

    let (l, c, m) = parse_err("graph g {\n  %x: f33[2] = input\n  return %x\n}\n");
    assert_eq!((l, c), (2, 7));
    assert!(m.contains("unknown dtype `f33`"), "{m}");

    let (l, _, m) =
        parse_err("graph g {\n  %x: f32[2] = input\n  %y: f32[2] = neg(%z)\n  return %y\n}\n");
    assert_eq!(l, 3);
    assert!(m.contains("unknown value `%z`"), "{m}");

    let (l, c, m) =
        parse_err("graph g {\n  %x: f32[2] = input\n  %x: f32[2] = neg(%x)\n  return %x\n}\n");
    assert_eq!((l, c), (3, 3));
    assert!(m.contains("defined twice"), "{m}");

    let (_, _, m) =
        parse_err("graph g {\n  %x: f32[2] = input\n  %y: f32[2] = scale(%x)\n  return %y\n}\n");
    assert!(m.contains("needs attribute `factor`"), "{m}");

    let (_, _, m) = parse_err("graph g {\n  %x: f32[2] = input\n  %y: f32[2] = scale(%x) {factor=2.0, axis=1}\n  return %y\n}\n");
    assert!(m.contains("has no attribute `axis`"), "{m}");

    let (l, _, m) = parse_err("graph g {\n  %x: f32[2] = input\n  return %x\n");
    assert_eq!(l, 3);
    assert!(m.contains("missing closing `}`"), "{m}");

    let (_, _, m) = parse_err("graph g {\n  %x: f32[2 = input\n  return %x\n}\n");
    assert!(m.contains("expected `,`"), "{m}");

    let (_, _, m) = parse_err("");
    assert!(m.contains("expected `graph NAME {`"), "{m}");
}

#[test]
fn verifier_rejects_type_errors_with_location() {
    let m = verify_err("graph g {\n  %a: f32[2,3] = input\n  %b: f32[4,5] = input\n  %c: f32[2,5] = matmul(%a, %b) {transpose_a=false, transpose_b=false}\n  return %c\n}\n");
    assert!(m.contains("node `%c` at line 4, column 3"), "{m}");
    assert!(
        m.contains("inner dimensions differ: 3 (lhs) vs 4 (rhs)"),
        "{m}"
    );

    let m =
        verify_err("graph g {\n  %a: f32[2,3] = input\n  %c: f32[2,4] = neg(%a)\n  return %c\n}\n");
    assert!(m.contains("should be f32[2,3], found f32[2,4]"), "{m}");

    let m =
        verify_err("graph g {\n  %a: f32[2,3] = input\n  %c: f16[2,3] = neg(%a)\n  return %c\n}\n");
    assert!(m.contains("should be f32[2,3], found f16[2,3]"), "{m}");

    let m =
        verify_err("graph g {\n  %a: i64[2,3] = input\n  %c: i64[2,3] = exp(%a)\n  return %c\n}\n");
    assert!(m.contains("must be a float tensor"), "{m}");

    let m = verify_err("graph g {\n  %a: f32[2,3] = input\n  %b: f32[3,2] = input\n  %c: f32[2,3] = add(%a, %b)\n  return %c\n}\n");
    assert!(m.contains("do not broadcast"), "{m}");
}

#[test]
fn contractions_may_write_another_float_dtype() {
    let ok = "graph g {\n  %a: bf16[2,3] = input\n  %b: bf16[3,4] = input\n  %c: f32[2,4] = matmul(%a, %b) {transpose_a=false, transpose_b=false}\n  return %c\n}\n";
    verify(&text::parse(ok).unwrap()).unwrap();
    let bad = ok.replace("%c: f32[2,4]", "%c: i32[2,4]");
    assert!(verify(&text::parse(&bad).unwrap()).is_err());
}

/// A product that adds into its addend writes the addend's type and shape: a BF16 product
/// may add into an F32 addend (and so write F32), but never into another shape or type.
#[test]
fn a_product_adds_into_an_addend_of_its_result_type() {
    let ok = "graph g {\n  %a: bf16[2,3] = input\n  %b: bf16[4,3] = input\n  %c: f32[2,4] = input\n  %y: f32[2,4] = matmul_add(%a, %b, %c) {transpose_a=false, transpose_b=true, alpha=0.5}\n  return %y\n}\n";
    let g = text::parse(ok).unwrap();
    verify(&g).unwrap();
    assert_eq!(text::print(&g), ok);
    let m = verify_err(&ok.replace("%c: f32[2,4] = input", "%c: f32[4,2] = input"));
    assert!(
        m.contains("the addend must have the product's shape [2,4], found f32[4,2]"),
        "{m}"
    );
    let m = verify_err(&ok.replace("%y: f32[2,4]", "%y: bf16[2,4]"));
    assert!(
        m.contains("result of `matmul_add` should be f32[2,4]"),
        "{m}"
    );
}

#[test]
fn verifier_rejects_use_before_definition_and_cycles() {
    let m = verify_err("graph g {\n  %a: f32[2] = input\n  %c: f32[2] = neg(%b)\n  %b: f32[2] = neg(%a)\n  return %c\n}\n");
    assert!(m.contains("`%b` is used before it is defined"), "{m}");
    assert!(m.contains("line 3"), "{m}");

    let m = verify_err("graph g {\n  %a: f32[2] = input\n  %b: f32[2] = add(%a, %c)\n  %c: f32[2] = neg(%b)\n  return %c\n}\n");
    assert!(m.contains("cycle"), "{m}");
}

#[test]
fn builder_reports_typing_errors_by_name() {
    let mut b = GraphBuilder::new("t");
    let x = b.input("x", TensorType::new(DType::F32, [2, 3])).unwrap();
    let y = b.input("y", TensorType::new(DType::F16, [2, 3])).unwrap();
    let e = b.op("sum", Op::Binary(BinaryOp::Add), &[x, y]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "node `%sum`: operands differ in dtype: f32 and f16"
    );
    assert!(b.input("x", TensorType::new(DType::F32, [1])).is_err());
}

/// What a node is (a recomputation, a gather, an adapter, the output head) is an IR fact:
/// printed as `origin=`, parsed back, kept by `push_copy`, found by `with_origin`; an unknown
/// origin is a parse error that lists the known ones.
#[test]
fn origins_round_trip() {
    let src = "graph g {
  %x: f32[3,4] = input
  %a: f32[3,4] = tanh(%x)
  %a.remat: f32[3,4] = tanh(%x) {origin=remat}
  %b: f32[3,4] = scale(%a.remat) {factor=2.0, block=1, origin=gather}
  %w.lora_A.weight: f32[2,4] = param {origin=adapter}
  %c: f32[3,2] = matmul(%b, %w.lora_A.weight) {transpose_a=false, transpose_b=true, origin=head}
  return %c
}
";
    let g = text::parse(src).unwrap();
    assert_eq!(text::print(&g), src);
    let origins: Vec<Option<Origin>> = g.nodes().map(|(_, d)| d.origin).collect();
    assert_eq!(
        origins,
        [
            None,
            None,
            Some(Origin::Remat),
            Some(Origin::Gather),
            Some(Origin::Adapter),
            Some(Origin::Head)
        ]
    );
    let adapters: Vec<&str> = g.with_origin(Origin::Adapter).map(|v| g.name(v)).collect();
    assert_eq!(adapters, ["w.lora_A.weight"]);
    assert!(g.has_origin(g.lookup("c").unwrap(), Origin::Head));
    assert!(!g.has_origin(g.lookup("b").unwrap(), Origin::Head));
    let ty = g.ty(g.lookup("x").unwrap()).clone();
    let mut copy = Graph::new("c");
    let x = copy
        .push_node(Op::Input, vec![], vec![("x".into(), ty.clone())])
        .unwrap();
    let x = copy.node(x).outputs[0];
    let remat = g.value(g.lookup("a.remat").unwrap()).producer;
    let n = copy
        .push_copy(&g, remat, vec![x], vec![("y".into(), ty)])
        .unwrap();
    assert_eq!(copy.node(n).origin, Some(Origin::Remat));
    let (line, _, m) = parse_err(&src.replace("origin=gather", "origin=shard"));
    assert_eq!(
        (line, m.as_str()),
        (
            5,
            "bad origin `shard`: expected one of remat, gather, regather, adapter, head"
        )
    );
}

/// The model's shape and each node's block are IR facts: printed, parsed back, kept by the
/// builder, and checked by the verifier.
#[test]
fn model_shape_and_blocks_round_trip_and_verify() {
    let src = "graph g {
  model {layers=2, width=4, heads=2, kv_heads=1, head_dim=2, vocab=10, batch=1, seq=3}
  %x: f32[3,4] = input
  %a: f32[3,4] = tanh(%x) {block=0}
  %b: f32[3,4] = scale(%a) {factor=2.0, block=1}
  return %b
}
";
    let g = text::parse(src).unwrap();
    verify(&g).unwrap();
    assert_eq!(text::print(&g), src);
    let shape = g.shape.unwrap();
    assert_eq!((shape.layers, shape.kv_heads, shape.seq), (2, 1, 3));
    let blocks: Vec<Option<u32>> = g.nodes().map(|(_, d)| d.block).collect();
    assert_eq!(blocks, [None, Some(0), Some(1)]);

    let mut b = GraphBuilder::from_graph(g);
    b.set_block(Some(1));
    let x = b.graph().lookup("b").unwrap();
    let c = b.op("c", Op::Scale { factor: 0.5 }, &[x]).unwrap();
    let g = b.finish();
    assert_eq!(g.node(g.value(c).producer).block, Some(1));

    assert!(verify_err(&src.replace("block=1", "block=2"))
        .contains("block 2 is out of range for a 2-layer model"));
    assert!(verify_err(&src.replace("= input", "= input {block=0}"))
        .contains("sources belong to no block"));
    let (line, _, m) = parse_err(&src.replace("block=1", "block=-1"));
    assert_eq!(
        (line, m.as_str()),
        (5, "bad block index -1: expected 0 to 4294967295")
    );
    let moved = src.replace(
        "  model {layers=2, width=4, heads=2, kv_heads=1, head_dim=2, vocab=10, batch=1, seq=3}\n  %x: f32[3,4] = input\n",
        "  %x: f32[3,4] = input\n  model {layers=2, width=4, heads=2, kv_heads=1, head_dim=2, vocab=10, batch=1, seq=3}\n",
    );
    let (line, _, m) = parse_err(&moved);
    assert_eq!(line, 3);
    assert!(
        m.contains("the `model` line comes once, before the first node"),
        "{m}"
    );
    let (_, _, m) = parse_err(&src.replace("heads=2, kv", "kv"));
    assert_eq!(m, "`model` needs attribute `heads`");
}
