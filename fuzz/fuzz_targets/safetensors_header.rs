//! A safetensors file from bytes: the 8-byte length, the JSON header and every entry's dtype,
//! shape and offsets. Whatever the bytes, validation returns an error or a header whose
//! offsets lie inside the file and hold exactly the bytes their dtype and shape need.
#![no_main]

use castor_models::safetensors::parse_bytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(header) = parse_bytes("fuzz.safetensors", data) else {
        return;
    };
    assert!(header.data_start <= data.len());
    let mut ranges = Vec::new();
    for (name, info) in &header.tensors {
        let (s, e) = info.data_offsets;
        let bytes = data
            .get(header.data_start + s..header.data_start + e)
            .unwrap_or_else(|| panic!("`{name}`: offsets [{s}, {e}] outside the file"));
        let bits: usize = info.numel() * info.dtype.bitsize();
        assert_eq!(
            bytes.len() * 8,
            bits,
            "`{name}`: length disagrees with dtype and shape"
        );
        if s < e {
            ranges.push((s, e));
        }
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(w[1].0 >= w[0].1, "overlapping tensors accepted");
    }
});
