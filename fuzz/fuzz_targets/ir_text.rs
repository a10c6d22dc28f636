//! IR text through the parser and the verifier. Any text must parse to a graph or fail with a
//! located error; a graph that verifies must print to text that parses and prints the same.
#![no_main]

use castor_ir::{text, verify};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(graph) = text::parse(src) else {
        return;
    };
    if verify(&graph).is_err() {
        return;
    }
    let printed = text::print(&graph);
    let again = match text::parse(&printed) {
        Ok(g) => g,
        Err(e) => panic!("printed IR does not parse: {e}\n{printed}"),
    };
    assert_eq!(
        text::print(&again),
        printed,
        "print(parse(print(g))) != print(g)"
    );
});
