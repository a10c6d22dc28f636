//! Token data files (llm.c's headered .bin, nanoGPT's raw u16 .bin) as `castor train` reads
//! them: any bytes give tokens or an error, never a panic or an allocation the file's size does
//! not justify.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = castor::data::read_token_file(std::path::Path::new("fuzz.bin"), data);
});
