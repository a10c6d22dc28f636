//! `nf4.cu` against `castor_ir::nf4::dequantize` (the CPU executor's weight): every value
//! bit for bit after the rounding to the product's dtype, with an odd count and a partial
//! last block, at fewer threads than bytes.

use crate::cuda::emulate::kernel_tests::{dec, enc, Launcher, Rng, FLOATS};
use crate::cuda::program::Arg;
use castor_ir::nf4::{self, NF4_BLOCK};
use castor_ir::{round_to, DType};

pub(crate) fn entries() -> Vec<String> {
    FLOATS
        .iter()
        .map(|(_, s)| format!("nf4_dequantize_{s}"))
        .collect()
}

#[test]
fn nf4_dequantize_equals_the_twin() {
    let mut rng = Rng::new(44);
    for (d, s) in FLOATS {
        for n in [1usize, 7, NF4_BLOCK, 3 * NF4_BLOCK + 29] {
            let w = rng.values(n, 3.0, DType::F32);
            let q = nf4::quantize(&w, NF4_BLOCK);
            let want: Vec<f32> = nf4::dequantize(&q, NF4_BLOCK)
                .into_iter()
                .map(|v| round_to(d, v))
                .collect();
            let mut l = Launcher::new("nf4.cu");
            let codes = l.buf(q.packed.clone(), 0);
            let absmax = l.buf(enc(DType::F32, &q.absmax), 0);
            let out = l.out(n * d.size_bytes(), 0);
            let args = vec![
                l.ptr(codes),
                l.ptr(absmax),
                Arg::I64(n as i64),
                Arg::I64(NF4_BLOCK as i64),
                l.ptr(out),
            ];
            let got = l
                .run(&format!("nf4_dequantize_{s}"), (2, 1, 1), (32, 1, 1), args)
                .unwrap_or_else(|e| panic!("nf4_dequantize_{s} n={n}: {e}"));
            let got = dec(d, &got[out.0]);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "nf4_dequantize_{s} n={n}"
            );
        }
    }
}
