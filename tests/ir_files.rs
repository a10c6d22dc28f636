//! The IR text format round-trips and verifies on every hand-written input and every model
//! family's graph: print(parse(print(g))) == print(g).

use crate::common;

use castor_ir::{text, verify};
use castor_models::Model;
use common::*;

#[test]
fn hand_written_ir_files_verify_and_round_trip() {
    let dir = root().join("tests").join("ir");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "ir") {
            let src = std::fs::read_to_string(&path).unwrap();
            let g = text::parse(&src).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            verify(&g).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let printed = text::print(&g);
            let again = text::parse(&printed).unwrap();
            assert_eq!(text::print(&again), printed, "{}", path.display());
            count += 1;
        }
    }
    assert!(count >= 4, "found only {count} .ir files");
}

#[test]
fn every_model_graph_verifies_and_round_trips() {
    for variant in VARIANTS {
        let model = Model::load(fixture(variant)).unwrap();
        for (b, t) in [(1, 1), (2, 7), (3, 32)] {
            let g = model.build_graph(b, t).unwrap();
            verify(&g).unwrap_or_else(|e| panic!("{variant} [{b},{t}]: {e}"));
            let printed = text::print(&g);
            let again = text::parse(&printed).unwrap_or_else(|e| panic!("{variant}: {e}"));
            verify(&again).unwrap();
            assert_eq!(text::print(&again), printed, "{variant}");
            // The DOT export draws every node and every operand edge.
            let dot = castor_ir::to_dot(&g);
            let edges: usize = g.nodes().map(|(_, n)| n.inputs.len()).sum();
            assert!(dot.starts_with("digraph"));
            assert!(dot.matches(" [label=").count() >= g.num_nodes());
            assert_eq!(dot.matches(" -> n").count(), edges, "{variant}");
        }
    }
}

#[test]
fn model_graph_snapshots() {
    // The forward graph of each family, as text: reviewing a change here is reviewing a change
    // to what the front end builds.
    for variant in ["gpt2_lm", "bert_base", "llama_gqa"] {
        let model = Model::load(fixture(variant)).unwrap();
        let g = model.build_graph(1, 4).unwrap();
        insta::assert_snapshot!(format!("forward_{variant}"), text::print(&g));
    }
}
