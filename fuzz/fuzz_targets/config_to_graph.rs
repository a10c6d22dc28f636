//! config.json text into a model and its forward graph (config only: no weights, batch 1,
//! at most 4 tokens). Parsing must fail cleanly or give a model whose graph builds and
//! verifies.
#![no_main]

use castor_models::{Config, Model};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = Config::parse(text, "config.json") else {
        return;
    };
    let Ok(model) = Model::from_config(config) else {
        return;
    };
    // Building is linear in the layer count; keep each run short (sizes are symbolic).
    if model.expected_params().len() > 2_000 {
        return;
    }
    let seq = model.max_positions().min(4);
    if let Ok(graph) = model.build_graph(1, seq) {
        if let Err(e) = castor_ir::verify(&graph) {
            panic!("the front end built an invalid graph: {e}");
        }
    }
});
