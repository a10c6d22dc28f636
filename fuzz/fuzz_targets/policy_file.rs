//! Precision policy files, TOML and JSON, applied to the default bf16 and fp16 policies. Any
//! text must be applied or refused with an error; never a panic.
#![no_main]

use castor_passes::{Policy, PolicyFileFormat, Precision};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for format in [PolicyFileFormat::Toml, PolicyFileFormat::Json] {
        for precision in [Precision::Bf16, Precision::Fp16] {
            let mut policy = Policy::new(precision);
            if policy.apply_file(text, format, "fuzz.policy").is_ok() {
                let _ = policy.rule_for_names("h.0.attn", &["h.0.attn.weight"]);
            }
        }
    }
});
