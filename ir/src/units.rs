//! Kernel units: what runs as one kernel, as data.
//!
//! The fusion pass (`castor_passes::fusion`) decides which nodes of a graph run together, and
//! a [`KernelUnit`] records each decision: a pointwise group with its typed body, a
//! normalization with the residual add it absorbs in front ([`UnitKind::NormPrologue`]) or the
//! gradient add (and the sum's cast) it absorbs behind ([`UnitKind::NormEpilogue`]), a
//! normalization that also makes its output's FP8 cast or scale ([`UnitKind::NormFp8`]), a
//! batch of optimizer updates that share their scalars, or a batch of delayed scaling's
//! history updates. A unit runs where its last member stands. Nodes in no
//! unit run as one kernel (or product, or copy) each. Executors read the units; none decides
//! fusion again, so what a plan says is fused is exactly what runs.
//!
//! A pointwise body is a list of [`Step`]s over F32 registers, one per element of the
//! iteration space: `load` an input (through its [`IndexMap`], so a bias broadcasts), apply
//! unary, gradient, binary and scale steps, `round` to the dtype the unfused graph stores each
//! member in, and store the [`UnitOutput`]s. Each step prints and parses as one line of text
//! (`r2 = add r0 r1`), the form plans store and `castor compile --emit ir` shows.

use crate::{BinaryOp, DType, Shape, UnaryOp};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Nodes of one graph that run as one kernel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelUnit {
    /// The graph the members belong to (`micro_step`, `optimizer_step`).
    pub graph: String,
    /// The unit's name, unique in its graph (a generated kernel's entry point ends with it).
    pub name: String,
    /// Each member node by the name of its first result, in node order.
    pub members: Vec<String>,
    #[serde(flatten)]
    pub kind: UnitKind,
}

/// What a unit is, and for a pointwise group, what its kernel computes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum UnitKind {
    /// Pointwise nodes over one iteration space: one generated kernel.
    Pointwise(PointwiseBody),
    /// `[add, norm]`: the norm kernel computes the residual add that makes its input and
    /// writes the sum on its way. `[cast, add, norm]`: also the exact widening of one of the
    /// add's operands from the norm output's 16-bit dtype to F32, which the kernel does as it
    /// loads that operand (a projection's result joining an F32 residual stream).
    NormPrologue,
    /// `[norm_grad, add]` or `[norm_grad, add, cast]`: the norm's backward kernel adds another
    /// gradient to its input gradient before it stores, and writes the sum's cast to the
    /// output gradient's 16-bit dtype beside it.
    NormEpilogue,
    /// `[norm, tail]`, `[add, norm, tail]` or `[cast, add, norm, tail]` (the add and cast as
    /// in a prologue), where the tail is a
    /// `quantize` of the norm's output to E4M3 by a scale made before the unit (delayed
    /// scaling's) or the `fp8_scale` of the output (current scaling's): the norm kernel also
    /// takes the output's amax and, for a `quantize`, writes its FP8 cast, storing the output
    /// itself only where something outside the unit reads it.
    NormFp8,
    /// AdamW, SGD or Lion nodes sharing their scalars: one multi-tensor launch; then any
    /// `fp8_scale` of a master they update, made of the maxima the launch takes of the masters
    /// it leaves.
    OptimizerBatch,
    /// `amax_history` nodes (delayed scaling's updates, a thread each): one launch where the
    /// last of them stands.
    AmaxHistoryBatch,
}

impl UnitKind {
    pub fn name(&self) -> &'static str {
        match self {
            UnitKind::Pointwise(_) => "pointwise",
            UnitKind::NormPrologue => "norm_prologue",
            UnitKind::NormEpilogue => "norm_epilogue",
            UnitKind::NormFp8 => "norm_fp8",
            UnitKind::OptimizerBatch => "optimizer_batch",
            UnitKind::AmaxHistoryBatch => "amax_history_batch",
        }
    }
}

/// The body of a pointwise kernel: for each element `i` of `dims`, run `steps` and store the
/// outputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PointwiseBody {
    /// The iteration space: the members' common shape.
    pub dims: Vec<usize>,
    pub inputs: Vec<UnitInput>,
    pub steps: Vec<Step>,
    pub outputs: Vec<UnitOutput>,
    /// A `quantize` or `fp8_scale` the unit ends with: the largest magnitude of the value it
    /// reads, over the whole iteration space (or the scale made of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amax: Option<UnitAmax>,
}

/// The amax a unit computes: the largest `|r<step>|` over the iteration space (NaN if one is
/// NaN, 0 for none), stored as the F32 scalar `value`; with `scale`, the `fp8_scale` of it
/// instead (`fmax / max(amax, 1e-12) / 2^margin` in F64, rounded to F32).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitAmax {
    pub value: String,
    pub step: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<AmaxScale>,
}

/// The `fp8_scale` a unit's amax becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AmaxScale {
    /// The FP8 format whose largest value the scale maps the amax to.
    pub to: DType,
    pub margin: usize,
}

impl PointwiseBody {
    /// Elements of the iteration space.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A value the unit reads from memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitInput {
    pub value: String,
    pub dtype: DType,
    pub index: IndexMap,
}

/// A member's value the unit writes to memory: the one step `step` computes. An FP8 output
/// stores its step's F32 value rounded to the format (nearest even, saturating), as `quantize`
/// does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitOutput {
    pub value: String,
    pub dtype: DType,
    pub step: usize,
}

/// Which element of an input element `i` of the iteration space reads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexMap {
    /// The input has the iteration space's shape: element `i`.
    Full,
    /// One element, read by every `i`.
    Scalar,
    /// A broadcast operand (a bias): `Σ ((i / out_stride) % extent) * in_stride`.
    Broadcast(Vec<IndexTerm>),
}

/// One dimension of a [`IndexMap::Broadcast`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexTerm {
    pub out_stride: u64,
    pub extent: u64,
    pub in_stride: u64,
}

impl IndexMap {
    /// How an operand of shape `input` broadcasts over the iteration space `out` (the
    /// operand's dims align with the trailing dims of `out`, as broadcasting aligns them).
    pub fn of(input: &Shape, out: &Shape) -> IndexMap {
        let out_dims = out.dims();
        let in_dims = input.dims();
        if in_dims == out_dims {
            return IndexMap::Full;
        }
        if input.numel() == Some(1) {
            return IndexMap::Scalar;
        }
        let rank = out_dims.len();
        let offset = rank.saturating_sub(in_dims.len());
        let mut out_stride = 1u64;
        let mut in_stride = 1u64;
        let mut terms = Vec::new();
        for d in (0..rank).rev() {
            let extent = out_dims[d] as u64;
            let id = if d >= offset {
                in_dims[d - offset] as u64
            } else {
                1
            };
            if id != 1 {
                terms.push(IndexTerm {
                    out_stride,
                    extent,
                    in_stride,
                });
            }
            out_stride *= extent;
            if d >= offset {
                in_stride *= id;
            }
        }
        terms.reverse();
        IndexMap::Broadcast(terms)
    }

    /// The input element that element `i` of the iteration space reads.
    pub fn element(&self, i: u64) -> u64 {
        match self {
            IndexMap::Full => i,
            IndexMap::Scalar => 0,
            IndexMap::Broadcast(terms) => terms
                .iter()
                .map(|t| ((i / t.out_stride) % t.extent) * t.in_stride)
                .sum(),
        }
    }
}

impl fmt::Display for IndexMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IndexMap::Full => f.write_str("full"),
            IndexMap::Scalar => f.write_str("scalar"),
            IndexMap::Broadcast(terms) => {
                f.write_str("broadcast")?;
                for t in terms {
                    write!(f, " (i/{})%{}*{}", t.out_stride, t.extent, t.in_stride)?;
                }
                Ok(())
            }
        }
    }
}

/// One step of a pointwise body. Registers are step indices: step `k` defines `r<k>`, and a
/// step reads only registers defined before it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    /// Input `input`'s element, widened to F32.
    Load {
        input: usize,
    },
    Unary {
        op: UnaryOp,
        x: usize,
    },
    /// `dy * f'(x)`, as the `*_grad` ops compute it.
    UnaryGrad {
        op: UnaryOp,
        x: usize,
        dy: usize,
    },
    Binary {
        op: BinaryOp,
        a: usize,
        b: usize,
    },
    /// `x * factor`, the factor rounded to F32.
    Scale {
        x: usize,
        factor: f64,
    },
    /// `x` rounded to `to` and widened back: the value a store in `to` and a load would see.
    Round {
        x: usize,
        to: DType,
    },
    /// `x * scale` in F32: the value an FP8 output of `quantize` rounds to its format.
    Quantize {
        x: usize,
        scale: usize,
    },
}

impl Step {
    /// The registers the step reads.
    pub fn operands(&self) -> Vec<usize> {
        match *self {
            Step::Load { .. } => Vec::new(),
            Step::Unary { x, .. } | Step::Scale { x, .. } | Step::Round { x, .. } => vec![x],
            Step::UnaryGrad { x, dy, .. } => vec![x, dy],
            Step::Binary { a, b, .. } => vec![a, b],
            Step::Quantize { x, scale } => vec![x, scale],
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Step::Load { input } => write!(f, "load in{input}"),
            Step::Unary { op, x } => write!(f, "{} r{x}", op.name()),
            Step::UnaryGrad { op, x, dy } => write!(f, "{} r{x} r{dy}", op.grad_name()),
            Step::Binary { op, a, b } => write!(f, "{} r{a} r{b}", op.name()),
            Step::Scale { x, factor } => write!(f, "scale r{x} {factor:?}"),
            Step::Round { x, to } => write!(f, "round r{x} {to}"),
            Step::Quantize { x, scale } => write!(f, "quantize r{x} r{scale}"),
        }
    }
}

impl FromStr for Step {
    type Err = String;

    fn from_str(s: &str) -> Result<Step, String> {
        let words: Vec<&str> = s.split_whitespace().collect();
        let reg = |w: &str| -> Result<usize, String> {
            w.strip_prefix('r')
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| format!("`{w}` is not a register (r0, r1, ...) in step `{s}`"))
        };
        let step = match words.as_slice() {
            ["load", input] => Step::Load {
                input: input
                    .strip_prefix("in")
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| format!("`{input}` is not an input (in0, ...) in `{s}`"))?,
            },
            ["scale", x, factor] => Step::Scale {
                x: reg(x)?,
                factor: factor
                    .parse()
                    .map_err(|_| format!("`{factor}` is not a number in step `{s}`"))?,
            },
            ["round", x, to] => Step::Round {
                x: reg(x)?,
                to: to.parse()?,
            },
            [name, x] => match UnaryOp::ALL.into_iter().find(|u| u.name() == *name) {
                Some(op) => Step::Unary { op, x: reg(x)? },
                None => return Err(format!("unknown step `{name}` in `{s}`")),
            },
            ["quantize", x, scale] => Step::Quantize {
                x: reg(x)?,
                scale: reg(scale)?,
            },
            [name, a, b] => {
                if let Some(op) = UnaryOp::ALL.into_iter().find(|u| u.grad_name() == *name) {
                    Step::UnaryGrad {
                        op,
                        x: reg(a)?,
                        dy: reg(b)?,
                    }
                } else if let Some(op) = BinaryOp::ALL.into_iter().find(|b| b.name() == *name) {
                    Step::Binary {
                        op,
                        a: reg(a)?,
                        b: reg(b)?,
                    }
                } else {
                    return Err(format!("unknown step `{name}` in `{s}`"));
                }
            }
            _ => return Err(format!("malformed step `{s}`")),
        };
        Ok(step)
    }
}

impl Serialize for Step {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Step {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Step, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl PointwiseBody {
    /// Checks that every register is defined before it is read, every load names an input
    /// and every output a step.
    pub fn check(&self) -> Result<(), String> {
        for (k, step) in self.steps.iter().enumerate() {
            if let Step::Load { input } = step {
                if *input >= self.inputs.len() {
                    return Err(format!("step r{k} loads in{input}, which is not an input"));
                }
            }
            if let Some(r) = step.operands().into_iter().find(|&r| r >= k) {
                return Err(format!("step r{k} reads r{r} before it is defined"));
            }
        }
        for o in &self.outputs {
            if o.step >= self.steps.len() {
                return Err(format!(
                    "output `%{}` stores r{}, which no step defines",
                    o.value, o.step
                ));
            }
        }
        if let Some(a) = &self.amax {
            if a.step >= self.steps.len() {
                return Err(format!(
                    "amax `%{}` is of r{}, which no step defines",
                    a.value, a.step
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for KernelUnit {
    /// `unit fused_3 (micro_step): pointwise over [2, 7, 32]`, then one indented line per
    /// input, step and output (a pointwise unit), or per member.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unit {} ({}): {}",
            self.name,
            self.graph,
            self.kind.name()
        )?;
        match &self.kind {
            UnitKind::Pointwise(body) => {
                writeln!(f, " over {:?}", body.dims)?;
                for (k, input) in body.inputs.iter().enumerate() {
                    writeln!(
                        f,
                        "  in{k} = %{}: {}, {}",
                        input.value, input.dtype, input.index
                    )?;
                }
                for (k, step) in body.steps.iter().enumerate() {
                    writeln!(f, "  r{k} = {step}")?;
                }
                for o in &body.outputs {
                    writeln!(f, "  store %{}: {} = r{}", o.value, o.dtype, o.step)?;
                }
                match &body.amax {
                    Some(UnitAmax {
                        value,
                        step,
                        scale: None,
                    }) => writeln!(f, "  amax %{value}: f32 = max |r{step}|")?,
                    Some(UnitAmax {
                        value,
                        step,
                        scale: Some(s),
                    }) => writeln!(
                        f,
                        "  scale %{value}: f32 = {} scale of max |r{step}|, margin {}",
                        s.to, s.margin
                    )?,
                    None => {}
                }
                Ok(())
            }
            _ => {
                let members: Vec<String> = self.members.iter().map(|m| format!("%{m}")).collect();
                writeln!(f, ": {}", members.join(", "))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_print_and_parse() {
        let steps = [
            Step::Load { input: 2 },
            Step::Unary {
                op: UnaryOp::GeluTanh,
                x: 0,
            },
            Step::UnaryGrad {
                op: UnaryOp::Silu,
                x: 0,
                dy: 1,
            },
            Step::Binary {
                op: BinaryOp::Div,
                a: 1,
                b: 2,
            },
            Step::Scale {
                x: 3,
                factor: 0.125,
            },
            Step::Scale {
                x: 3,
                factor: 1.0 / 3.0,
            },
            Step::Round {
                x: 4,
                to: DType::BF16,
            },
            Step::Quantize { x: 5, scale: 0 },
        ];
        for s in steps {
            assert_eq!(s.to_string().parse::<Step>(), Ok(s), "{s}");
        }
        assert!("frobnicate r0".parse::<Step>().is_err());
        assert!("add r0".parse::<Step>().is_err());
        assert!("round r0 f8".parse::<Step>().is_err());
    }

    #[test]
    fn broadcast_index_maps() {
        let out = Shape::from(vec![2, 3, 4]);
        assert_eq!(
            IndexMap::of(&Shape::from(vec![2, 3, 4]), &out),
            IndexMap::Full
        );
        assert_eq!(IndexMap::of(&Shape::scalar(), &out), IndexMap::Scalar);
        let bias = IndexMap::of(&Shape::from(vec![4]), &out);
        let rows = IndexMap::of(&Shape::from(vec![2, 3, 1]), &out);
        for i in 0..24u64 {
            assert_eq!(bias.element(i), i % 4);
            assert_eq!(rows.element(i), i / 4);
        }
    }

    #[test]
    fn a_body_that_reads_ahead_is_refused() {
        let body = PointwiseBody {
            dims: vec![4],
            inputs: Vec::new(),
            steps: vec![Step::Round {
                x: 0,
                to: DType::F32,
            }],
            outputs: Vec::new(),
            amax: None,
        };
        assert!(body.check().unwrap_err().contains("before it is defined"));
    }
}
