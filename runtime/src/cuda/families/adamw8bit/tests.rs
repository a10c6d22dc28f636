//! `adamw8bit.cu` against `cpu/adamw8bit.rs`: one update, from a random quantized state, equals
//! the twin bit for bit (master, codes, block maxima, working copy), with a partial last
//! block, fewer thread blocks than quantization blocks, weight decay, clipping under a loss
//! scale, and a skipped step.

use crate::cuda::emulate::kernel_tests::{check, dec, enc, Launcher, Rng, FLOATS};
use crate::cpu::adamw8bit::{self as twin, Quantized};
use crate::cpu::optimizer::Control;
use crate::cuda::program::Arg;
use castor_ir::AdamWHparams;
use castor_ir::{quant, round_to, DType};

pub(crate) fn entries() -> Vec<String> {
    FLOATS
        .iter()
        .map(|(_, s)| format!("adamw8bit_{s}"))
        .collect()
}

#[test]
fn adamw8bit_update_equals_the_twin() {
    let mut rng = Rng::new(81);
    let maps = quant::code_maps();
    for (c, s) in FLOATS {
        for (n, weight_decay, grad_norm, scale, max_grad_norm) in [
            (300, 0.0, 0.7f32, 1.0f32, 0.0),
            (quant::QUANT_BLOCK * 9 + 77, 0.01, 3.5, 1024.0, 1.0),
            (quant::QUANT_BLOCK * 2, 0.01, f32::INFINITY, 1.0, 0.0),
        ] {
            let what = format!("adamw8bit_{s} n={n} grad_norm={grad_norm}");
            let h = AdamWHparams {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay,
            };
            let control = Control {
                lr: 1e-3,
                step: 4.0,
                scale,
                grad_norm,
                max_grad_norm,
            };
            let blocks = quant::quant_blocks(n);
            let p = rng.values(n, 1.0, DType::F32);
            let g = rng.values(n, scale, DType::F32);
            let codes = |rng: &mut Rng| -> Vec<u8> { (0..n).map(|_| rng.next() as u8).collect() };
            let (m, v) = (codes(&mut rng), codes(&mut rng));
            let maxima = |rng: &mut Rng, s: f32| -> Vec<f32> {
                rng.values(blocks, s, DType::F32)
                    .iter()
                    .map(|x| x.abs())
                    .collect()
            };
            let (ma, va) = (maxima(&mut rng, 0.1), maxima(&mut rng, 0.01));

            let (mut p2, mut m2, mut v2, mut ma2, mut va2) =
                (p.clone(), m.clone(), v.clone(), ma.clone(), va.clone());
            twin::adamw8bit(
                &h,
                quant::QUANT_BLOCK,
                control,
                &maps,
                &mut p2,
                &g,
                Quantized {
                    codes: &mut m2,
                    absmax: &mut ma2,
                },
                Quantized {
                    codes: &mut v2,
                    absmax: &mut va2,
                },
            );

            let mut l = Launcher::new("adamw8bit.cu");
            let f32s = |x: &[f32]| enc(DType::F32, x);
            let (bp, bg) = (l.buf(f32s(&p), 0), l.buf(f32s(&g), 0));
            let (bm, bma) = (l.buf(m.clone(), 0), l.buf(f32s(&ma), 0));
            let (bv, bva) = (l.buf(v.clone(), 0), l.buf(f32s(&va), 0));
            let bmaps = l.buf(f32s(&maps), 0);
            let bcopy = l.out(n * c.size_bytes(), 0);
            let scalar = |l: &mut Launcher, x: f32| l.buf(x.to_le_bytes().to_vec(), 0);
            let (blr, bstep, bscale, bnorm) = (
                scalar(&mut l, control.lr),
                scalar(&mut l, control.step),
                scalar(&mut l, scale),
                scalar(&mut l, grad_norm),
            );
            let entry = format!("adamw8bit_{s}");
            let named: Vec<(&str, Arg)> = vec![
                ("master", l.ptr(bp)),
                ("grad", l.ptr(bg)),
                ("m", l.ptr(bm)),
                ("m_absmax", l.ptr(bma)),
                ("v", l.ptr(bv)),
                ("v_absmax", l.ptr(bva)),
                ("code_maps", l.ptr(bmaps)),
                ("copy", l.ptr(bcopy)),
                ("n", Arg::I64(n as i64)),
                ("lr", l.ptr(blr)),
                ("step", l.ptr(bstep)),
                ("scale", l.ptr(bscale)),
                ("grad_norm", l.ptr(bnorm)),
                ("beta1", Arg::F64(h.beta1)),
                ("beta2", Arg::F64(h.beta2)),
                ("eps", Arg::F64(h.eps)),
                ("weight_decay", Arg::F64(h.weight_decay)),
                ("max_grad_norm", Arg::F64(control.max_grad_norm)),
            ];
            let ordered = crate::cuda::families::signature(&entry)
                .and_then(|sig| sig.order(&entry, &named))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            // Three thread blocks: each strides over several quantization blocks.
            let out = l
                .run(
                    &entry,
                    (3, 1, 1),
                    (quant::QUANT_BLOCK as u32, 1, 1),
                    ordered,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            check(
                &format!("{what} master"),
                DType::F32,
                &dec(DType::F32, &out[bp.0]),
                &p2,
                0,
            );
            assert_eq!(out[bm.0], m2, "{what}: first-moment codes differ");
            assert_eq!(out[bv.0], v2, "{what}: second-moment codes differ");
            check(
                &format!("{what} m_absmax"),
                DType::F32,
                &dec(DType::F32, &out[bma.0]),
                &ma2,
                0,
            );
            check(
                &format!("{what} v_absmax"),
                DType::F32,
                &dec(DType::F32, &out[bva.0]),
                &va2,
                0,
            );
            let copy = dec(c, &out[bcopy.0]);
            if grad_norm.is_finite() {
                let want: Vec<f32> = p2.iter().map(|&x| round_to(c, x)).collect();
                check(&format!("{what} copy"), c, &copy, &want, 0);
            } else {
                assert!(
                    copy.iter().all(|x| x.is_nan()),
                    "{what}: the copy was written"
                );
                assert_eq!(p2, p, "{what}: the twin changed a skipped step");
            }
        }
    }
}
