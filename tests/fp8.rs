//! The FP8 formats (`castor_ir::fp8`) against PyTorch 2.15 and ml_dtypes, byte for byte
//! (tests/fixtures/generate_fp8.py): encoding every BF16 bit pattern and ten thousand F32
//! values (edge cases, every rounding midpoint and its neighbours, random values) in both
//! formats and both overflow modes, decoding all 256 bytes of each format, and reading the
//! float8 tensors torch's safetensors wrote.
//!
//! Which reference each mode answers to:
//! - saturating: torch's `x.float().clamp(-max, max).to(fp8)` (both formats), and torch 2.15's
//!   plain `.to(torch.float8_e4m3fn)`, which saturates too (pytorch/pytorch#178817);
//! - non-saturating: torch's `.to(torch.float8_e5m2)` and ml_dtypes'
//!   `astype(float8_e4m3fn)` (overflow and infinities to NaN).
//!
//! Bytes compare exactly, NaN bytes included: castor writes NaN as `0x7F | sign`, as both
//! references do for these columns, so no NaN output is let off as "both NaN". Decoded values
//! compare by their F32 bits, NaNs included (torch's NaN bits).

use crate::common;

use castor_ir::fp8::{Fp8Format, Overflow};
use castor_ir::DType;
use castor_models::SafetensorsFile;
use half::bf16;
use std::collections::HashSet;

fn fixture(file: &str) -> SafetensorsFile {
    SafetensorsFile::open(common::root().join("tests/fixtures/fp8").join(file)).unwrap()
}

/// `got` equals `want` element for element; otherwise fails listing the first mismatches with
/// their inputs (`input(i)` describes input `i`) and how many there are.
fn assert_same_bytes(what: &str, got: &[u8], want: &[u8], input: impl Fn(usize) -> String) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    if !bad.is_empty() {
        let first: Vec<String> = bad
            .iter()
            .take(12)
            .map(|&i| {
                format!(
                    "\n  {}: castor {:#04x}, reference {:#04x}",
                    input(i),
                    got[i],
                    want[i]
                )
            })
            .collect();
        panic!(
            "{what}: {} of {} bytes differ; the first:{}",
            bad.len(),
            got.len(),
            first.concat()
        );
    }
}

/// The reference columns of one input set and castor's mode for each: `(column, format, mode)`.
const COLUMNS: [(&str, Fp8Format, Overflow); 5] = [
    ("to.e4m3", Fp8Format::E4M3, Overflow::Saturate),
    ("sat.e4m3", Fp8Format::E4M3, Overflow::Saturate),
    ("nosat.e4m3", Fp8Format::E4M3, Overflow::NonFinite),
    ("to.e5m2", Fp8Format::E5M2, Overflow::NonFinite),
    ("sat.e5m2", Fp8Format::E5M2, Overflow::Saturate),
];

#[test]
fn every_bf16_encodes_as_pytorch_does() {
    let f = fixture("conversions.safetensors");
    let inputs: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    for (column, format, mode) in COLUMNS {
        let want = f.tensor(&format!("bf16.{column}")).unwrap();
        let got: Vec<u8> = inputs
            .iter()
            .map(|&x| format.encode_bf16(x, mode))
            .collect();
        assert_same_bytes(
            &format!("bf16.{column} ({mode:?})"),
            &got,
            want.as_u8().unwrap(),
            |i| format!("bf16 {:#06x} ({:e})", inputs[i].to_bits(), inputs[i]),
        );
    }
}

#[test]
fn f32_values_encode_as_pytorch_does() {
    let f = fixture("conversions.safetensors");
    let inputs: Vec<f32> = f
        .read_i64("f32.input")
        .unwrap()
        .into_iter()
        .map(|b| f32::from_bits(b as u32))
        .collect();
    assert!(inputs.len() >= 10_000, "{} inputs", inputs.len());
    for (column, format, mode) in COLUMNS {
        let want = f.tensor(&format!("f32.{column}")).unwrap();
        let got: Vec<u8> = inputs.iter().map(|&x| format.encode(x, mode)).collect();
        assert_same_bytes(
            &format!("f32.{column} ({mode:?})"),
            &got,
            want.as_u8().unwrap(),
            |i| format!("f32 {:#010x} ({:e})", inputs[i].to_bits(), inputs[i]),
        );
    }
}

/// The F32 inputs hold the cases that decide a conversion: signed zeros, infinities, NaNs of
/// both signs, F32 subnormals, and for each format every midpoint between neighbouring values
/// (the one past the largest finite value included) with the F32 values on either side.
#[test]
fn f32_inputs_cover_every_rounding_boundary() {
    let f = fixture("conversions.safetensors");
    let inputs: HashSet<u32> = f
        .read_i64("f32.input")
        .unwrap()
        .into_iter()
        .map(|b| b as u32)
        .collect();
    for bits in [
        0,
        0x8000_0000,
        0x7F80_0000,
        0xFF80_0000,
        0x7FC0_0000,
        0xFFC0_0000,
        1,
    ] {
        assert!(inputs.contains(&bits), "{bits:#010x}");
    }
    for format in Fp8Format::ALL {
        let mut values: Vec<f32> = (0..=format.max_byte()).map(|b| format.decode(b)).collect();
        let top = values[values.len() - 1] - values[values.len() - 2];
        values.push(format.max() + top);
        for w in values.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for m in [mid, -mid] {
                for b in [m.to_bits() - 1, m.to_bits(), m.to_bits() + 1] {
                    assert!(inputs.contains(&b), "{format}: {:e}", f32::from_bits(b));
                }
            }
        }
    }
}

#[test]
fn every_byte_decodes_as_pytorch_does() {
    let f = fixture("conversions.safetensors");
    for format in Fp8Format::ALL {
        let want = f.read_i64(&format!("decode.{format}")).unwrap();
        for byte in 0..=255u8 {
            let got = format.decode(byte).to_bits();
            let want = want[usize::from(byte)] as u32;
            assert_eq!(
                got, want,
                "{format} {byte:#04x}: {got:#010x} vs {want:#010x}"
            );
        }
    }
}

/// A file torch's `safetensors.torch.save_file` wrote with `float8_e4m3fn` and `float8_e5m2`
/// tensors reads as FP8 tensors holding the values torch's `.float()` gives, bit for bit.
#[test]
fn float8_tensors_written_by_torch_load_exactly() {
    let f = fixture("float8_tensors.safetensors");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (name, dtype, shape) in [
        ("e4m3", DType::F8E4M3, vec![16, 16]),
        ("e5m2", DType::F8E5M2, vec![2, 128]),
        ("e4m3.rounded", DType::F8E4M3, vec![3, 5]),
    ] {
        let t = f.tensor(name).unwrap();
        assert_eq!(t.dtype(), dtype, "{name}");
        assert_eq!(t.shape().dims(), shape, "{name}");
        let want = f.read_f32(&format!("{name}.values")).unwrap();
        assert_eq!(bits(t.as_f32().unwrap()), bits(&want), "{name}");
        assert_eq!(bits(&f.read_f32(name).unwrap()), bits(&want), "{name}");
        // The bytes come back out unchanged, but for NaNs, written as 0x7F | sign.
        let format = Fp8Format::of(dtype).unwrap();
        let stored = f.bytes(name).unwrap();
        let canonical: Vec<u8> = stored
            .iter()
            .map(|&b| if format.is_nan_byte(b) { b | 0x7F } else { b })
            .collect();
        assert_eq!(t.fp8_bytes().unwrap(), canonical, "{name}");
    }
    let every: Vec<u8> = (0..=255).collect();
    assert_eq!(f.bytes("e4m3").unwrap(), every);
    assert_eq!(f.bytes("e5m2").unwrap(), every);
}
