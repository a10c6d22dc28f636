//! The ops' typing rules: output types from operand types (whose count [`super::Op::infer`]
//! has already checked), or a message saying which rule is broken. The op table names one
//! rule per op.

use super::AttentionDropout;
use crate::{DType, Shape, TensorType};

type Types = Result<Vec<TensorType>, String>;

fn one(t: TensorType) -> Types {
    Ok(vec![t])
}

fn require_float(what: &str, t: &TensorType) -> Result<(), String> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be a float tensor, found {}", t.dtype))
    }
}

fn require_f32_scalar(what: &str, t: &TensorType) -> Result<(), String> {
    if t.dtype == DType::F32 && t.shape.rank() == 0 {
        Ok(())
    } else {
        Err(format!("{what} must be an f32 scalar, found {t}"))
    }
}

fn bad_axis(axis: usize, shape: &Shape) -> String {
    format!("axis {axis} out of range for {shape}")
}

/// Sources are typed by their declaration, not inferred.
pub fn source() -> Types {
    Err("sources have no inferred type".into())
}

/// A float operand, the result like it (`gelu`, `scale`).
pub fn pointwise(inputs: &[&TensorType]) -> Types {
    require_float("operand", inputs[0])?;
    one(inputs[0].clone())
}

/// Two float operands of one dtype, broadcast.
pub fn binary(inputs: &[&TensorType]) -> Types {
    let (a, b) = (inputs[0], inputs[1]);
    require_float("lhs", a)?;
    require_float("rhs", b)?;
    if a.dtype != b.dtype {
        return Err(format!(
            "operands differ in dtype: {} and {}",
            a.dtype, b.dtype
        ));
    }
    let shape = Shape::broadcast(&a.shape, &b.shape)
        .ok_or_else(|| format!("shapes {} and {} do not broadcast", a.shape, b.shape))?;
    one(TensorType::new(a.dtype, shape))
}

/// `(g1, .., gn, scale) -> f32[]`.
pub fn grad_norm(inputs: &[&TensorType]) -> Types {
    let (scale, grads) = inputs.split_last().ok_or("grad_norm needs operands")?;
    for g in grads {
        require_float("gradient", g)?;
    }
    require_f32_scalar("loss scale", scale)?;
    one(TensorType::new(DType::F32, Shape::scalar()))
}

/// AdamW (two moments), SGD and Lion (one): `(master, grad, moments.., lr, step, scale, grad_norm)
/// -> (master', moments'..[, copy'])`. Moments are stored in F32 or BF16 (computed in F32
/// either way).
pub fn optimizer(inputs: &[&TensorType], moments: usize, copy: Option<DType>) -> Types {
    let master = inputs[0];
    let shapes = vec![master.shape.clone(); moments];
    optimizer_state(inputs, &shapes, copy)
}

/// `(master, grad[, exp_avg], row, col | exp_avg_sq, lr, step, scale, grad_norm)`: the
/// moments' shapes follow from the master's ([`adafactor_moments`]).
pub fn adafactor(inputs: &[&TensorType], first_moment: bool, copy: Option<DType>) -> Types {
    let master = inputs[0];
    let mut shapes = Vec::new();
    if first_moment {
        shapes.push(master.shape.clone());
    }
    shapes.extend(adafactor_moments(&master.shape));
    if inputs.len() != 2 + shapes.len() + 4 {
        return Err(format!(
            "adafactor of {master} takes {} operands, found {}",
            2 + shapes.len() + 4,
            inputs.len()
        ));
    }
    optimizer_state(inputs, &shapes, copy)
}

/// `(master, grad, m, m_absmax, v, v_absmax, code_maps, lr, step, scale, grad_norm)`: U8
/// moments of the master's shape, an F32 absolute maximum per block of `block` values, the
/// two F32 code maps `[2, 256]`.
pub fn adamw8bit(inputs: &[&TensorType], block: usize, copy: Option<DType>) -> Types {
    let master = master_and_grad(inputs)?;
    if block == 0 {
        return Err("the quantization block must hold at least one value".into());
    }
    let numel = master
        .shape
        .numel()
        .ok_or("the master has too many elements")?;
    let codes = TensorType::new(DType::U8, master.shape.clone());
    let absmax = TensorType::new(DType::F32, Shape::from(vec![numel.div_ceil(block)]));
    for (what, t, want) in [
        ("first moment", inputs[2], &codes),
        ("first moment's block maxima", inputs[3], &absmax),
        ("second moment", inputs[4], &codes),
        ("second moment's block maxima", inputs[5], &absmax),
    ] {
        if t != want {
            return Err(format!("the {what} must be {want}, found {t}"));
        }
    }
    let maps = TensorType::new(DType::F32, Shape::from(vec![2, crate::quant::CODES]));
    if inputs[6] != &maps {
        return Err(format!("the code maps must be {maps}, found {}", inputs[6]));
    }
    let outs = vec![master.clone(), codes.clone(), absmax.clone(), codes, absmax];
    scalars_and_copy(&inputs[7..], master, copy, outs)
}

/// `(hidden [N, C], weight [V, C], labels [N] i64) -> loss [] f32`: hidden and weight of one
/// float dtype (the product's operands), logits a float dtype, chunks of at least one row.
pub fn linear_cross_entropy(inputs: &[&TensorType], chunk_rows: usize, logits: DType) -> Types {
    classifier_operands(inputs, chunk_rows, logits)?;
    one(TensorType::new(DType::F32, Shape::scalar()))
}

/// `(hidden, weight, labels, dloss []) -> (dhidden like hidden, dweight [V, C] f32)`.
pub fn linear_cross_entropy_grad(
    inputs: &[&TensorType],
    chunk_rows: usize,
    logits: DType,
) -> Types {
    classifier_operands(inputs, chunk_rows, logits)?;
    require_f32_scalar("loss gradient", inputs[3])?;
    Ok(vec![
        inputs[0].clone(),
        TensorType::new(DType::F32, inputs[1].shape.clone()),
    ])
}

/// `(hidden, weight, labels, dloss []) -> (loss [] f32, dhidden like hidden, dweight f32)`.
pub fn linear_cross_entropy_step(
    inputs: &[&TensorType],
    chunk_rows: usize,
    logits: DType,
) -> Types {
    let mut out = linear_cross_entropy_grad(inputs, chunk_rows, logits)?;
    out.insert(0, TensorType::new(DType::F32, Shape::scalar()));
    Ok(out)
}

fn classifier_operands(
    inputs: &[&TensorType],
    chunk_rows: usize,
    logits: DType,
) -> Result<(), String> {
    let (h, w, labels) = (inputs[0], inputs[1], inputs[2]);
    let (hd, wd) = (h.shape.dims(), w.shape.dims());
    if hd.len() != 2 || wd.len() != 2 || hd[1] != wd[1] {
        return Err(format!(
            "the classifier takes hidden [N, C] and weight [V, C], found {h} and {w}"
        ));
    }
    if h.dtype != w.dtype || !h.dtype.is_float() {
        return Err(format!(
            "hidden and weight must share one float dtype, found {} and {}",
            h.dtype, w.dtype
        ));
    }
    if labels.dtype != DType::I64 || labels.shape.dims() != [hd[0]] {
        return Err(format!("labels must be i64[{}], found {labels}", hd[0]));
    }
    if !logits.is_float() {
        return Err(format!(
            "the logits dtype must be a float dtype, found {logits}"
        ));
    }
    if chunk_rows == 0 {
        return Err("a chunk must hold at least one row".into());
    }
    Ok(())
}

/// Adafactor's second-moment shapes for a parameter: for rank 2 or more, the row statistics
/// (the shape without its last axis) and the column statistics (without the one before);
/// for a vector or scalar, the full shape.
pub fn adafactor_moments(param: &Shape) -> Vec<Shape> {
    let d = param.dims();
    match d.len() {
        0 | 1 => vec![param.clone()],
        r => {
            let row = Shape::from(&d[..r - 1]);
            let mut col = d[..r - 2].to_vec();
            col.push(d[r - 1]);
            vec![row, Shape::from(col)]
        }
    }
}

/// The common rule: an F32 master, an F32 gradient of its shape, moments of the given shapes
/// in F32 or BF16, the four F32 scalars; results master', moments' (each in its own dtype)
/// and the optional working copy.
fn optimizer_state(inputs: &[&TensorType], moments: &[Shape], copy: Option<DType>) -> Types {
    let master = master_and_grad(inputs)?;
    let mut outs = vec![master.clone()];
    for (t, shape) in inputs[2..2 + moments.len()].iter().zip(moments) {
        if t.shape != *shape || !matches!(t.dtype, DType::F32 | DType::BF16) {
            return Err(format!(
                "optimizer moment must be f32 or bf16 of shape {shape}, found {t}"
            ));
        }
        outs.push((*t).clone());
    }
    scalars_and_copy(&inputs[2 + moments.len()..], master, copy, outs)
}

/// Every update's first two operands: the F32 master and its gradient, of one type.
fn master_and_grad<'a>(inputs: &[&'a TensorType]) -> Result<&'a TensorType, String> {
    let master = inputs[0];
    if master.dtype != DType::F32 {
        return Err(format!("the master weights must be f32, found {master}"));
    }
    if inputs[1] != master {
        return Err(format!(
            "gradient must be {master} like the master, found {}",
            inputs[1]
        ));
    }
    Ok(master)
}

/// Every update's last four operands (lr, step, loss scale, grad norm: F32 scalars), and its
/// results `outs` followed by the working copy when there is one.
fn scalars_and_copy(
    scalars: &[&TensorType],
    master: &TensorType,
    copy: Option<DType>,
    mut outs: Vec<TensorType>,
) -> Types {
    for (what, t) in ["lr", "step", "loss scale", "grad norm"]
        .iter()
        .zip(scalars)
    {
        require_f32_scalar(what, t)?;
    }
    if let Some(to) = copy {
        if !to.is_float() {
            return Err(format!(
                "a parameter copy must be a float dtype, found {to}"
            ));
        }
        outs.push(TensorType::new(to, master.shape.clone()));
    }
    Ok(outs)
}

/// `(step, grad_norm) -> step'`.
pub fn count_step(inputs: &[&TensorType]) -> Types {
    require_f32_scalar("step", inputs[0])?;
    require_f32_scalar("grad norm", inputs[1])?;
    one(inputs[0].clone())
}

/// `(scale, counters [2], grad_norm) -> (scale', counters')`.
pub fn loss_scale_update(inputs: &[&TensorType]) -> Types {
    let (scale, counters, norm) = (inputs[0], inputs[1], inputs[2]);
    require_f32_scalar("loss scale", scale)?;
    require_f32_scalar("grad norm", norm)?;
    if *counters != TensorType::new(DType::F32, [2]) {
        return Err(format!(
            "loss-scale counters must be f32[2], found {counters}"
        ));
    }
    Ok(vec![scale.clone(), counters.clone()])
}

/// `(table [V, H], ids [..]) -> [.., H]`.
pub fn embedding(inputs: &[&TensorType]) -> Types {
    let (table, ids) = (inputs[0], inputs[1]);
    require_float("table", table)?;
    if table.shape.rank() != 2 {
        return Err(format!(
            "embedding table must be 2-D, found {}",
            table.shape
        ));
    }
    if !ids.dtype.is_int() {
        return Err(format!(
            "embedding ids must be i32 or i64, found {}",
            ids.dtype
        ));
    }
    let mut dims = ids.shape.0.clone();
    dims.push(table.shape.0[1]);
    one(TensorType::new(table.dtype, dims))
}

/// (rows, cols) of the last two dims, after an optional transpose.
fn last_two(s: &Shape, transpose: bool) -> (usize, usize) {
    let d = s.dims();
    let (r, c) = (d[d.len() - 2], d[d.len() - 1]);
    if transpose {
        (c, r)
    } else {
        (r, c)
    }
}

/// `(a [.., M, K], b [.., K, N]) -> [.., M, N]`, batch dims broadcast.
pub fn matmul(inputs: &[&TensorType], transpose_a: bool, transpose_b: bool) -> Types {
    let (a, b) = (inputs[0], inputs[1]);
    require_float("lhs", a)?;
    require_float("rhs", b)?;
    if a.dtype != b.dtype {
        return Err(format!(
            "matmul operands differ in dtype: {} and {}",
            a.dtype, b.dtype
        ));
    }
    if a.shape.rank() < 2 || b.shape.rank() < 2 {
        return Err(format!(
            "matmul operands must be at least 2-D, found {} and {}",
            a.shape, b.shape
        ));
    }
    let (m, ka) = last_two(&a.shape, transpose_a);
    let (kb, n) = last_two(&b.shape, transpose_b);
    if ka != kb {
        return Err(format!(
            "matmul inner dimensions differ: {} (lhs{}) vs {} (rhs{})",
            ka,
            if transpose_a { ", transposed" } else { "" },
            kb,
            if transpose_b { ", transposed" } else { "" }
        ));
    }
    let ba = Shape(a.shape.0[..a.shape.rank() - 2].to_vec());
    let bb = Shape(b.shape.0[..b.shape.rank() - 2].to_vec());
    let mut batch = Shape::broadcast(&ba, &bb)
        .ok_or_else(|| format!("matmul batch dims do not broadcast: {ba} and {bb}"))?;
    batch.0.extend([m, n]);
    one(TensorType::new(a.dtype, batch))
}

fn require_fp8(what: &str, t: &TensorType) -> Result<(), String> {
    if t.dtype.is_fp8() {
        Ok(())
    } else {
        Err(format!(
            "{what} must be an FP8 tensor (f8e4m3 or f8e5m2), found {}",
            t.dtype
        ))
    }
}

/// `(a, b, a_scale f32[], b_scale f32[]) -> [.., M, N]` of FP8 operands, shaped as
/// [`matmul`]'s; the result is BF16 unless a pass chooses F32.
pub fn fp8_matmul(inputs: &[&TensorType], transpose_a: bool, transpose_b: bool) -> Types {
    let (a, b) = (inputs[0], inputs[1]);
    require_fp8("lhs", a)?;
    require_fp8("rhs", b)?;
    require_f32_scalar("the lhs scale", inputs[2])?;
    require_f32_scalar("the rhs scale", inputs[3])?;
    // The shapes follow matmul's rule; the operands' two FP8 formats may differ.
    let a16 = TensorType::new(DType::BF16, a.shape.clone());
    let b16 = TensorType::new(DType::BF16, b.shape.clone());
    matmul(&[&a16, &b16], transpose_a, transpose_b)
}

fn require_fp8_target(to: DType) -> Result<(), String> {
    if to.is_fp8() {
        Ok(())
    } else {
        Err(format!(
            "an FP8 scale or cast targets f8e4m3 or f8e5m2, found {to}"
        ))
    }
}

/// `x -> f32[]`: the scale that maps `x`'s largest magnitude to `to`'s largest value.
pub fn fp8_scale(inputs: &[&TensorType], to: DType) -> Types {
    require_fp8_target(to)?;
    let x = inputs[0];
    require_float("operand", x)?;
    if x.dtype.is_fp8() {
        return Err(format!(
            "the scale is taken of a value before its cast, found {x}"
        ));
    }
    one(TensorType::new(DType::F32, Shape(vec![])))
}

/// `(x, scale f32[]) -> (q of to, amax f32[])`.
pub fn quantize(inputs: &[&TensorType], to: DType) -> Types {
    require_fp8_target(to)?;
    let x = inputs[0];
    require_float("operand", x)?;
    if x.dtype.is_fp8() {
        return Err(format!("quantize casts a wider float to FP8, found {x}"));
    }
    require_f32_scalar("the scale", inputs[1])?;
    Ok(vec![
        TensorType::new(to, x.shape.clone()),
        TensorType::new(DType::F32, Shape(vec![])),
    ])
}

/// `(history f32[H], scale f32[], amax f32[]) -> (history', scale')`.
pub fn amax_history(inputs: &[&TensorType], to: DType) -> Types {
    require_fp8_target(to)?;
    let h = inputs[0];
    if h.dtype != DType::F32 || h.shape.rank() != 1 || h.shape.numel() == Some(0) {
        return Err(format!(
            "an amax history is a non-empty f32 vector, found {h}"
        ));
    }
    require_f32_scalar("the scale", inputs[1])?;
    require_f32_scalar("the amax", inputs[2])?;
    Ok(vec![h.clone(), inputs[1].clone()])
}

/// `(x [.., K], codes u8, absmax f32) -> [.., N]` of a product by an NF4 weight `[rows, cols]`.
pub fn nf4_matmul(inputs: &[&TensorType], transpose_b: bool, rows: usize, cols: usize) -> Types {
    let (x, codes, absmax) = (inputs[0], inputs[1], inputs[2]);
    require_float("x", x)?;
    let numel = rows * cols;
    let want_codes = Shape(vec![numel.div_ceil(2)]);
    let want_absmax = Shape(vec![numel.div_ceil(crate::nf4::NF4_BLOCK)]);
    if codes.dtype != DType::U8 || codes.shape != want_codes {
        return Err(format!(
            "nf4_matmul codes must be u8{want_codes} for a [{rows}, {cols}] weight, found {codes}"
        ));
    }
    if absmax.dtype != DType::F32 || absmax.shape != want_absmax {
        return Err(format!(
            "nf4_matmul absmax must be f32{want_absmax} for a [{rows}, {cols}] weight, found \
             {absmax}"
        ));
    }
    let (k, n) = if transpose_b {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let dims = x.shape.dims();
    if dims.last() != Some(&k) {
        return Err(format!(
            "nf4_matmul input {} does not end in the weight's inner dimension {k}",
            x.shape
        ));
    }
    let mut out = dims.to_vec();
    *out.last_mut().unwrap_or(&mut 0) = n;
    one(TensorType::new(x.dtype, Shape(out)))
}

/// `(a, b, c) -> like c`: a product and the addend its accumulator starts from, of the
/// product's shape; the result has the addend's type (a float of any width, as a product's
/// result may be wider than its operands).
pub fn matmul_add(inputs: &[&TensorType], transpose_a: bool, transpose_b: bool) -> Types {
    let out = matmul(&inputs[..2], transpose_a, transpose_b)?.remove(0);
    let c = inputs[2];
    require_float("addend", c)?;
    if c.shape != out.shape {
        return Err(format!(
            "the addend must have the product's shape {}, found {c}",
            out.shape
        ));
    }
    one(c.clone())
}

/// `(a, b [K, N], bias [N]) -> outputs x [.., M, N]`: a product by a matrix (a weight) whose
/// bias has one value per output column, of the operands' dtype.
pub fn matmul_bias(
    inputs: &[&TensorType],
    transpose_a: bool,
    transpose_b: bool,
    outputs: usize,
) -> Types {
    let out = epilogue_product(inputs, transpose_a, transpose_b)?;
    let bias = inputs[2];
    let n = out.shape.dims()[out.shape.rank() - 1];
    // The bias has the stored result's type: the operands' or, for a product that writes
    // F32 from 16-bit operands, F32.
    if !(bias.dtype == out.dtype || bias.dtype == DType::F32) || bias.shape.dims() != [n] {
        return Err(format!(
            "the bias must be {}[{n}] or f32[{n}] (one value per output column), found {bias}",
            out.dtype
        ));
    }
    Ok(vec![out; outputs])
}

/// `(a [K, M], b [K, N]) -> (a^T b [M, N], dbias [M or N] f32)`: the bias gradient sums the
/// rows of `a` when `lhs`, else of `b`.
pub fn matmul_bias_grad(inputs: &[&TensorType], lhs: bool) -> Types {
    let (a, b) = (inputs[0], inputs[1]);
    if a.shape.rank() != 2 || b.shape.rank() != 2 {
        return Err(format!(
            "a weight gradient with its bias gradient takes two matrices, found {} and {}",
            a.shape, b.shape
        ));
    }
    let product = matmul(inputs, true, false)?.remove(0);
    let summed = if lhs { a } else { b };
    Ok(vec![
        product,
        TensorType::new(DType::F32, Shape(vec![summed.shape.dims()[1]])),
    ])
}

/// `(dy, w [K, N], pre [.., M, N]) -> dpre like pre`.
pub fn matmul_gelu_grad(inputs: &[&TensorType], transpose_a: bool, transpose_b: bool) -> Types {
    let out = epilogue_product(inputs, transpose_a, transpose_b)?;
    let pre = inputs[2];
    if pre.shape != out.shape || !pre.dtype.is_float() {
        return Err(format!(
            "the GELU input must be a float tensor of the product's shape {}, found {pre}",
            out.shape
        ));
    }
    Ok(vec![pre.clone()])
}

/// The product of an epilogue op: `b` a matrix (the epilogue's vector runs along its
/// columns), `a` not transposed so its leading dims are rows of one product.
fn epilogue_product(
    inputs: &[&TensorType],
    transpose_a: bool,
    transpose_b: bool,
) -> Result<TensorType, String> {
    if inputs[1].shape.rank() != 2 || transpose_a {
        return Err(format!(
            "an epilogue product multiplies rows by a matrix: lhs not transposed, rhs 2-D, found {}{} and {}",
            inputs[0].shape,
            if transpose_a { " (transposed)" } else { "" },
            inputs[1].shape
        ));
    }
    let mut out = matmul(&inputs[..2], transpose_a, transpose_b)?;
    Ok(out.remove(0))
}

/// `(x [.., H], weight [H][, bias [H]]) -> like x`.
pub fn norm(inputs: &[&TensorType]) -> Types {
    let x = inputs[0];
    require_float("input", x)?;
    if x.shape.rank() == 0 {
        return Err("normalized input must have at least one dim".into());
    }
    let h = x.shape.last();
    for (i, p) in inputs[1..].iter().enumerate() {
        let what = if i == 0 { "weight" } else { "bias" };
        require_float(what, p)?;
        if p.shape.0 != [h] {
            return Err(format!("{what} must be [{h}], found {}", p.shape));
        }
    }
    one(x.clone())
}

/// A sliding window narrows a causal mask: it means nothing without one.
fn window_needs_causal(what: &str, causal: bool, window: Option<usize>) -> Result<(), String> {
    match window {
        Some(0) => Err(format!("{what} has a sliding window of 0 keys")),
        Some(w) if !causal => Err(format!(
            "{what} has a sliding window ({w}) but no causal mask: a window is the keys ending \
             at each query's causal limit"
        )),
        _ => Ok(()),
    }
}

/// Softmax over the last axis, with an optional causal mask (narrowed by a sliding window)
/// and bool mask operand.
pub fn softmax(inputs: &[&TensorType], causal: bool, window: Option<usize>) -> Types {
    let x = inputs[0];
    require_float("input", x)?;
    window_needs_causal("softmax", causal, window)?;
    if causal {
        if x.shape.rank() < 2 {
            return Err("causal softmax needs a [.., Tq, Tk] input".into());
        }
        let d = x.shape.dims();
        if d[d.len() - 2] > d[d.len() - 1] {
            return Err(format!("causal softmax needs Tq <= Tk, found {}", x.shape));
        }
    } else if x.shape.rank() == 0 {
        return Err("softmax input must have at least one dim".into());
    }
    if let Some(mask) = inputs.get(1) {
        mask_operand("softmax", mask, &x.shape, causal)?;
    }
    one(x.clone())
}

/// The mask operand of a softmax or an attention over `scores [.., T, S]`: bool, broadcast to
/// the scores (false = masked out), or i64 positions `[.., 1, S]` (each key's position in its
/// own sequence, for sequences packed in one row), which need the causal mask.
fn mask_operand(what: &str, mask: &TensorType, scores: &Shape, causal: bool) -> Result<(), String> {
    let broadcasts = Shape::broadcast(&mask.shape, scores).as_ref() == Some(scores);
    match mask.dtype {
        DType::Bool if broadcasts => Ok(()),
        DType::Bool => Err(format!(
            "{what} mask {} does not broadcast to the scores {scores}",
            mask.shape
        )),
        DType::I64 => {
            let rows = mask.shape.rank() >= 2 && mask.shape.dims()[mask.shape.rank() - 2] == 1;
            if !causal {
                Err(format!(
                    "{what} positions (an i64 mask) need the causal mask: packed sequences \
                     are separated by where each one starts"
                ))
            } else if !broadcasts || !rows {
                Err(format!(
                    "{what} positions {} should be [.., 1, S], broadcasting to the scores {scores}",
                    mask.shape
                ))
            } else {
                Ok(())
            }
        }
        other => Err(format!(
            "{what} mask must be bool (kept keys) or i64 (positions), found {other}"
        )),
    }
}

/// The batch dims (all but the last two) of a shape.
fn batch_of(s: &Shape) -> Shape {
    Shape(s.0[..s.rank().saturating_sub(2)].to_vec())
}

/// `(q [.., T, D], k [.., S, D], v [.., S, Dv][, mask bool [.., T, S]][, key i64[2]]) ->
/// (o [.., T, Dv], lse f32 [.., T])`; the batch dims of k, v and the mask broadcast to q's;
/// the dropout key is there exactly when the op has `dropout`.
pub fn attention(
    inputs: &[&TensorType],
    causal: bool,
    window: Option<usize>,
    dropout: Option<AttentionDropout>,
) -> Types {
    let inputs = if let Some(d) = dropout {
        let Some((key, rest)) = inputs.split_last().filter(|(_, rest)| rest.len() >= 3) else {
            return Err("attention with dropout takes (q, k, v[, mask], key)".into());
        };
        dropout_key(key)?;
        if !(d.p > 0.0 && d.p < 1.0) {
            return Err(format!(
                "attention dropout must lie in (0, 1), found {}",
                d.p
            ));
        }
        if u32::try_from(d.stream).is_err() {
            return Err(format!("dropout stream {} does not fit 32 bits", d.stream));
        }
        rest
    } else {
        if inputs.len() > 4 {
            return Err(format!(
                "attention without dropout takes (q, k, v[, mask]), found {} operands",
                inputs.len()
            ));
        }
        inputs
    };
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    window_needs_causal("attention", causal, window)?;
    for (what, t) in [("query", q), ("key", k), ("value", v)] {
        require_float(what, t)?;
        if t.shape.rank() < 2 {
            return Err(format!(
                "attention {what} must be at least 2-D, found {}",
                t.shape
            ));
        }
    }
    if k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(format!(
            "attention operands differ in dtype: {}, {} and {}",
            q.dtype, k.dtype, v.dtype
        ));
    }
    let (qd, kd, vd) = (q.shape.dims(), k.shape.dims(), v.shape.dims());
    let (t, d) = (qd[qd.len() - 2], qd[qd.len() - 1]);
    let (s, dk) = (kd[kd.len() - 2], kd[kd.len() - 1]);
    if dk != d {
        return Err(format!(
            "attention query {} and key {} differ in head dim",
            q.shape, k.shape
        ));
    }
    if vd[vd.len() - 2] != s {
        return Err(format!(
            "attention key {} and value {} differ in length",
            k.shape, v.shape
        ));
    }
    let batch = batch_of(&q.shape);
    for (what, t) in [("key", k), ("value", v)] {
        let b = batch_of(&t.shape);
        if Shape::broadcast(&b, &batch).as_ref() != Some(&batch) {
            return Err(format!(
                "attention {what} batch dims {b} do not broadcast to the query's {batch}"
            ));
        }
    }
    if causal && t > s {
        return Err(format!(
            "causal attention needs T <= S, found T = {t}, S = {s}"
        ));
    }
    if let Some(mask) = inputs.get(3) {
        let mut scores = batch.clone();
        scores.0.extend([t, s]);
        mask_operand("attention", mask, &scores, causal)?;
    }
    let mut o = batch.clone();
    o.0.extend([t, vd[vd.len() - 1]]);
    let mut lse = batch;
    lse.0.push(t);
    Ok(vec![
        TensorType::new(q.dtype, o),
        TensorType::new(DType::F32, lse),
    ])
}

/// `(q, k, v, o, lse, do[, mask][, key]) -> (dq, dk, dv)` like q, k and v.
pub fn attention_grad(
    inputs: &[&TensorType],
    causal: bool,
    window: Option<usize>,
    dropout: Option<AttentionDropout>,
) -> Types {
    let (q, k, v, o, lse, d_o) = (
        inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5],
    );
    let mut forward = vec![q, k, v];
    forward.extend(&inputs[6..]);
    let outs = attention(&forward, causal, window, dropout)?;
    if o.shape != outs[0].shape || d_o.shape != o.shape {
        return Err(format!(
            "attention output {} and its gradient {} should be {}",
            o.shape, d_o.shape, outs[0].shape
        ));
    }
    require_float("output gradient", d_o)?;
    if lse.dtype != DType::F32 || lse.shape != outs[1].shape {
        return Err(format!(
            "attention log-sum-exp should be {}, found {lse}",
            outs[1]
        ));
    }
    Ok(vec![q.clone(), k.clone(), v.clone()])
}

/// Rotary embedding (and its transpose) of `x [.., T, D]`, D even.
pub fn rope(inputs: &[&TensorType]) -> Types {
    let x = inputs[0];
    require_float("input", x)?;
    if x.shape.rank() < 2 || !x.shape.last().is_multiple_of(2) {
        return Err(format!(
            "rope needs [.., T, D] with even D, found {}",
            x.shape
        ));
    }
    if let Some(positions) = inputs.get(1) {
        let rows = Shape(x.shape.0[..x.shape.rank() - 1].to_vec());
        if positions.dtype != DType::I64
            || Shape::broadcast(&positions.shape, &rows).as_ref() != Some(&rows)
        {
            return Err(format!(
                "rope positions should be i64 broadcasting to {rows} (one per row of x), \
                 found {positions}"
            ));
        }
    }
    one(x.clone())
}

/// `(x, key i64[2]) -> y` like `x`, for `p` in `[0, 1)` and a 32-bit `stream` (the Philox
/// counter word it fills).
pub fn dropout(inputs: &[&TensorType], p: f64, stream: usize) -> Types {
    let (x, key) = (inputs[0], inputs[1]);
    require_float("input", x)?;
    dropout_key(key)?;
    if !(0.0..1.0).contains(&p) {
        return Err(format!("dropout p must lie in [0, 1), found {p}"));
    }
    if u32::try_from(stream).is_err() {
        return Err(format!("dropout stream {stream} does not fit 32 bits"));
    }
    one(x.clone())
}

/// The key operand of a dropout (or an attention with dropout): `i64[2]`, `[seed, offset]`.
fn dropout_key(key: &TensorType) -> Result<(), String> {
    if *key != TensorType::new(DType::I64, [2]) {
        return Err(format!(
            "the dropout key must be i64[2] (seed, offset), found {key}"
        ));
    }
    Ok(())
}

pub fn reshape(inputs: &[&TensorType], shape: &[usize]) -> Types {
    let x = inputs[0];
    let to = Shape(shape.to_vec());
    if x.shape.numel() != to.numel() {
        return Err(format!(
            "cannot reshape {} into {to}: element counts differ",
            x.shape
        ));
    }
    one(TensorType::new(x.dtype, to))
}

pub fn transpose(inputs: &[&TensorType], perm: &[usize]) -> Types {
    let x = inputs[0];
    let mut seen = vec![false; x.shape.rank()];
    if perm.len() != x.shape.rank()
        || perm
            .iter()
            .any(|&p| p >= seen.len() || std::mem::replace(&mut seen[p], true))
    {
        return Err(format!(
            "{perm:?} is not a permutation of the axes of {}",
            x.shape
        ));
    }
    let dims = perm.iter().map(|&p| x.shape.0[p]).collect::<Vec<_>>();
    one(TensorType::new(x.dtype, dims))
}

pub fn slice(inputs: &[&TensorType], axis: usize, start: usize, end: usize) -> Types {
    let x = inputs[0];
    let len = *x
        .shape
        .0
        .get(axis)
        .ok_or_else(|| bad_axis(axis, &x.shape))?;
    if start > end || end > len {
        return Err(format!(
            "slice {start}..{end} out of range for axis {axis} of {}",
            x.shape
        ));
    }
    let mut dims = x.shape.0.clone();
    dims[axis] = end - start;
    one(TensorType::new(x.dtype, dims))
}

pub fn concat(inputs: &[&TensorType], axis: usize) -> Types {
    let first = inputs[0];
    if axis >= first.shape.rank() {
        return Err(bad_axis(axis, &first.shape));
    }
    let mut dims = first.shape.0.clone();
    dims[axis] = 0;
    for t in inputs {
        let same_rest = t.shape.rank() == first.shape.rank()
            && (0..dims.len()).all(|i| i == axis || t.shape.0[i] == first.shape.0[i]);
        if t.dtype != first.dtype || !same_rest {
            return Err(format!(
                "concat operands must agree except on axis {axis}: {first} vs {t}"
            ));
        }
        dims[axis] += t.shape.0[axis];
    }
    one(TensorType::new(first.dtype, dims))
}

pub fn split(inputs: &[&TensorType], axis: usize, sizes: &[usize]) -> Types {
    let x = inputs[0];
    let len = *x
        .shape
        .0
        .get(axis)
        .ok_or_else(|| bad_axis(axis, &x.shape))?;
    if sizes.is_empty() || sizes.iter().sum::<usize>() != len {
        return Err(format!(
            "split sizes {sizes:?} do not add up to {len} (axis {axis} of {})",
            x.shape
        ));
    }
    Ok(sizes
        .iter()
        .map(|&s| {
            let mut dims = x.shape.0.clone();
            dims[axis] = s;
            TensorType::new(x.dtype, dims)
        })
        .collect())
}

pub fn reduce(inputs: &[&TensorType], axes: &[usize], keepdim: bool) -> Types {
    let x = inputs[0];
    require_float("input", x)?;
    let mut seen = vec![false; x.shape.rank()];
    for &a in axes {
        if a >= seen.len() || std::mem::replace(&mut seen[a], true) {
            return Err(format!(
                "bad or repeated reduction axis {a} for {}",
                x.shape
            ));
        }
    }
    let dims = x
        .shape
        .0
        .iter()
        .enumerate()
        .filter_map(|(i, &d)| match (seen[i], keepdim) {
            (false, _) => Some(d),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect::<Vec<_>>();
    one(TensorType::new(x.dtype, dims))
}

/// `(logits [N, V], labels [N] int) -> f32[]`.
pub fn cross_entropy(inputs: &[&TensorType]) -> Types {
    let (logits, labels) = (inputs[0], inputs[1]);
    require_float("logits", logits)?;
    if !labels.dtype.is_int() {
        return Err(format!("labels must be i32 or i64, found {}", labels.dtype));
    }
    if logits.shape.rank() != 2 || labels.shape.0 != logits.shape.0[..1] {
        return Err(format!(
            "cross_entropy needs logits [N, V] and labels [N], found {} and {}",
            logits.shape, labels.shape
        ));
    }
    one(TensorType::new(DType::F32, Shape::scalar()))
}

pub fn cast(inputs: &[&TensorType], to: DType) -> Types {
    one(TensorType::new(to, inputs[0].shape.clone()))
}

pub fn param_copy(inputs: &[&TensorType], to: DType) -> Types {
    require_float("master", inputs[0])?;
    if !to.is_float() {
        return Err(format!(
            "a parameter copy must be a float dtype, found {to}"
        ));
    }
    one(TensorType::new(to, inputs[0].shape.clone()))
}

pub fn full(dtype: DType, shape: &[usize]) -> Types {
    one(TensorType::new(dtype, shape.to_vec()))
}

/// `(x, dy) -> dx` like `dy` (unary and softmax gradients).
pub fn pointwise_grad(inputs: &[&TensorType]) -> Types {
    let (x, dy) = (inputs[0], inputs[1]);
    require_float("input", x)?;
    require_float("gradient", dy)?;
    if x.shape != dy.shape {
        return Err(format!(
            "gradient {} does not match input {}",
            dy.shape, x.shape
        ));
    }
    one(dy.clone())
}

/// `(x [.., H], weight [H], dy) -> (dx, dweight [H][, dbias [H]])`.
pub fn norm_grad(inputs: &[&TensorType], with_bias: bool) -> Types {
    let (x, w, dy) = (inputs[0], inputs[1], inputs[2]);
    require_float("input", x)?;
    require_float("weight", w)?;
    require_float("gradient", dy)?;
    let h = x.shape.last();
    if x.shape.rank() == 0 || w.shape.0 != [h] || dy.shape != x.shape {
        return Err(format!(
            "norm gradient needs x [.., H], weight [H], dy like x; found {}, {}, {}",
            x.shape, w.shape, dy.shape
        ));
    }
    // dx has the input's dtype; dy may be narrower (read widened, exactly).
    let dw = TensorType::new(DType::F32, [h]);
    let mut outs = vec![TensorType::new(x.dtype, x.shape.clone()), dw.clone()];
    if with_bias {
        outs.push(dw);
    }
    Ok(outs)
}

pub fn pad(inputs: &[&TensorType], axis: usize, before: usize, after: usize) -> Types {
    let x = inputs[0];
    if axis >= x.shape.rank() {
        return Err(bad_axis(axis, &x.shape));
    }
    let mut dims = x.shape.0.clone();
    dims[axis] += before + after;
    one(TensorType::new(x.dtype, dims))
}

pub fn broadcast_to(inputs: &[&TensorType], shape: &[usize]) -> Types {
    let x = inputs[0];
    let to = Shape(shape.to_vec());
    if Shape::broadcast(&x.shape, &to).as_ref() != Some(&to) {
        return Err(format!("{} does not broadcast to {to}", x.shape));
    }
    one(TensorType::new(x.dtype, to))
}

/// `(ids [..], dy [.., H]) -> dtable [vocab, H]` in F32.
pub fn embedding_grad(inputs: &[&TensorType], vocab: usize) -> Types {
    let (ids, dy) = (inputs[0], inputs[1]);
    if !ids.dtype.is_int() {
        return Err(format!(
            "embedding ids must be i32 or i64, found {}",
            ids.dtype
        ));
    }
    require_float("gradient", dy)?;
    if dy.shape.rank() != ids.shape.rank() + 1 || dy.shape.0[..ids.shape.rank()] != ids.shape.0[..]
    {
        return Err(format!(
            "gradient {} does not match ids {} plus a row dim",
            dy.shape, ids.shape
        ));
    }
    one(TensorType::new(DType::F32, [vocab, dy.shape.last()]))
}

/// `(logits, labels, dloss []) -> dlogits` like the logits.
pub fn cross_entropy_grad(inputs: &[&TensorType]) -> Types {
    let (logits, labels, dloss) = (inputs[0], inputs[1], inputs[2]);
    cross_entropy(&[logits, labels])?;
    require_float("loss gradient", dloss)?;
    if dloss.shape.rank() != 0 {
        return Err(format!(
            "loss gradient must be a scalar, found {}",
            dloss.shape
        ));
    }
    one(logits.clone())
}

/// [`super::Op::AllReduce`]: the operand's type.
pub fn all_reduce(inputs: &[&TensorType]) -> Types {
    let x = inputs[0];
    require_float("operand", x)?;
    one(x.clone())
}

/// The flat shard of one of `world` ranks: `[ceil(n / world)]`, the operand's dtype.
pub fn shard(inputs: &[&TensorType], world: usize) -> Types {
    if world == 0 {
        return Err("world must be at least 1".into());
    }
    let x = inputs[0];
    let numel = x.shape.numel().ok_or("the operand's size overflows")?;
    one(TensorType::new(x.dtype, Shape(vec![numel.div_ceil(world)])))
}

/// [`super::Op::AllGather`]: a shard of a `shape` value from each of `world` ranks.
pub fn all_gather(inputs: &[&TensorType], world: usize, shape: &[usize]) -> Types {
    if world == 0 {
        return Err("world must be at least 1".into());
    }
    let x = inputs[0];
    let numel = Shape(shape.to_vec())
        .numel()
        .ok_or("the gathered shape's size overflows")?;
    let want = numel.div_ceil(world);
    if x.shape.0 != [want] {
        return Err(format!(
            "a shard of {:?} over {world} ranks is [{want}], found {}",
            shape, x.shape
        ));
    }
    one(TensorType::new(x.dtype, Shape(shape.to_vec())))
}
