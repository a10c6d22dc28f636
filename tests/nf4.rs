//! NF4 quantization (`castor_ir::nf4`) against bitsandbytes' `quantize_4bit(blocksize=64,
//! quant_type="nf4")` on the CPU (tests/fixtures/generate_nf4.py): the code book, the packed
//! codes and the absmaxes bit-identical, and the dequantized values equal to
//! `dequantize_4bit`'s, on a normal weight, an odd count, a partial last block, values exactly
//! on the midpoints between codes, and a block of zeros.

use crate::common;

use castor_ir::nf4::{dequantize, quantize, NF4_BLOCK, NF4_CODE};
use castor_models::SafetensorsFile;

#[test]
fn nf4_quantization_is_bitsandbytes_bit_for_bit() {
    let f =
        SafetensorsFile::open(common::root().join("tests/fixtures/nf4/nf4.safetensors")).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&NF4_CODE), bits(&f.read_f32("code").unwrap()));
    let mut cases = 0;
    for name in f.names().filter_map(|n| n.strip_prefix("w.")) {
        let w = f.read_f32(&format!("w.{name}")).unwrap();
        let q = quantize(&w, NF4_BLOCK);
        let packed = f.tensor(&format!("packed.{name}")).unwrap();
        assert_eq!(
            q.packed.as_slice(),
            packed.as_u8().unwrap(),
            "{name}: codes"
        );
        let absmax = f.read_f32(&format!("absmax.{name}")).unwrap();
        assert_eq!(bits(&q.absmax), bits(&absmax), "{name}: absmax");
        let want = f.read_f32(&format!("dequant.{name}")).unwrap();
        assert_eq!(
            bits(&dequantize(&q, NF4_BLOCK)),
            bits(&want),
            "{name}: values"
        );
        cases += 1;
    }
    assert_eq!(cases, 5);
}
