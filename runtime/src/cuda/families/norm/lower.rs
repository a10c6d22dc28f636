//! Layer and RMS norms: `norm.cu`'s forward (with a fused residual add, and with the FP8 cast
//! or scale of its output fused behind), statistics-only recomputation, and backward with its
//! weight-gradient reduction.
use super::{Kernel, Pass};
use crate::cuda::program::{Arg, Place};
use crate::cuda::lower::ops::{row_threads, BLOCK, ROW_BLOCK};
use crate::cuda::lower::{grid_1d, grid_rows, LowerError, RunLowering, Saved};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{DType, Node, Op, Value};

/// `norm.cu`'s weight-gradient block: NW_COLS lanes, NW_LANES threads each (the reduction's
/// too).
const WEIGHT_BLOCK: (u32, u32, u32) = (32, 8, 1);
/// Columns one weight-gradient block takes: each lane 8 (UNIT, a 16-byte load of each operand).
const WEIGHT_BLOCK_COLUMNS: usize = 32 * 8;

impl RunLowering<'_, '_> {
    /// A norm node, with the residual add that makes its input when `prologue` is `[add]`
    /// (the kernel reads the add's operands, `x` and `res`, and writes their sum, `sum_out`)
    /// or `[cast, add]` (the cast's operand read narrow, as `x_low`, in place of `x`), and
    /// the FP8 cast or scale of its output when `fp8_tail` names it (a
    /// [`castor_ir::UnitKind::NormFp8`] unit: the `*_fwd_fp8` kernel takes the output's amax
    /// per block and, for a `quantize`, writes its E4M3 cast; then `fp8_amax_finalize` makes
    /// the cast's amax, where it is read, or `fp8_scale_finalize` the scale).
    pub(crate) fn norm_unit(
        &mut self,
        n: Node,
        prologue: &[Node],
        fp8_tail: Option<Node>,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let (rms, eps) = match node.op {
            Op::LayerNorm { eps } => (false, eps),
            Op::RmsNorm { eps } => (true, eps),
            _ => return Err(self.err(node.outputs[0], "not a norm")),
        };
        let ins = node.inputs.clone();
        self.norm(node.outputs[0], &ins, rms, eps, prologue, fp8_tail)
    }

    /// A [`castor_ir::UnitKind::NormFp8`] unit: `[norm, tail]`, or a prologue's members
    /// before the norm.
    pub(crate) fn norm_fp8_unit(&mut self, members: &[Node]) -> Result<(), LowerError> {
        match *members {
            [ref prologue @ .., n, tail] if prologue.len() <= 2 => {
                self.norm_unit(n, prologue, Some(tail))
            }
            _ => {
                let v = self.g.node(members[0]).outputs[0];
                Err(self.err(v, "a norm_fp8 unit has two or three members"))
            }
        }
    }

    /// A norm-gradient node, with the add of another gradient to its input gradient when
    /// `epilogue` names it: the kernel adds `dadd` and writes the add's result, and with the
    /// cast of that result to the output gradient's dtype when named: `dx_low`.
    pub(crate) fn norm_grad_unit(
        &mut self,
        n: Node,
        epilogue: Option<(Node, Option<Node>)>,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let (rms, eps) = match node.op {
            Op::LayerNormGrad { eps } => (false, eps),
            Op::RmsNormGrad { eps } => (true, eps),
            _ => return Err(self.err(node.outputs[0], "not a norm gradient")),
        };
        let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
        self.norm_grad(&ins, &outs, rms, eps, epilogue)
    }

    fn norm(
        &mut self,
        y: Value,
        ins: &[Value],
        rms: bool,
        eps: f64,
        prologue: &[Node],
        fp8_tail: Option<Node>,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let x = ins[0];
        let h = g.ty(x).shape.last();
        let rows = g.ty(x).shape.numel().unwrap_or(0) / h.max(1);
        for &w in &ins[1..] {
            if g.ty(w).dtype != DType::F32 {
                return Err(self.err(y, "norm weights and biases must be f32 on CUDA"));
            }
        }
        let key = (x, ins[1]);
        let until = self.saved_until.get(&key).copied().unwrap_or(self.unit);
        let mean = if rms {
            None
        } else {
            Some(self.arena(rows as u64 * 4, until))
        };
        let rstd = self.arena(rows as u64 * 4, until);
        self.saved.insert(
            key,
            Saved {
                a: mean.unwrap_or(rstd),
                b: rstd,
                count: None,
            },
        );
        // The add's operands: `x` and `res`, or with a cast `x_low` (the cast's narrow operand,
        // which the kernel widens as it loads; the widened copy is never stored) and `res`.
        let (xp, x_low, res, sum_out) = match *prologue {
            [] => (Arg::Ptr(self.at(x)?), Arg::Null, Arg::Null, Arg::Null),
            [add] => {
                let a = g.node(add).inputs.clone();
                let sum = Arg::Ptr(self.out(x)?);
                (Arg::Ptr(self.at(a[0])?), Arg::Null, Arg::Ptr(self.at(a[1])?), sum)
            }
            [cast, add] => {
                let (narrow, wide) = (g.node(cast).inputs[0], g.node(cast).outputs[0]);
                let a = &g.node(add).inputs;
                let Some(other) = a.iter().copied().find(|&v| v != wide) else {
                    return Err(self.err(x, "a prologue cast whose add does not read it once"));
                };
                self.loc[wide.index()] = crate::cuda::lower::Loc::InKernel;
                let (low, res) = (Arg::Ptr(self.at(narrow)?), Arg::Ptr(self.at(other)?));
                (Arg::Null, low, res, Arg::Ptr(self.out(x)?))
            }
            _ => return Err(self.err(x, "a norm prologue of more than a cast and an add")),
        };
        let w = self.at(ins[1])?;
        // Under an FP8 tail the output is stored only where something outside the unit reads
        // it (current scaling's cast does; delayed scaling's products read only the cast).
        let out = match fp8_tail {
            Some(t)
                if self.users[y.index()].as_slice() == [t]
                    && !g.outputs().contains(&y)
                    && !self.stored.contains_key(g.name(y)) =>
            {
                self.loc[y.index()] = crate::cuda::lower::Loc::InKernel;
                Arg::Null
            }
            _ => Arg::Ptr(self.out(y)?),
        };
        let grid = grid_rows(rows);
        let mut args = vec![
            ("x", xp),
            ("x_low", x_low),
            ("res", res),
            ("sum_out", sum_out),
            ("w", Arg::Ptr(w)),
            ("y", out),
            ("rstd_out", Arg::Ptr(rstd)),
            ("rows", Arg::I64(rows as i64)),
            ("h", Arg::I32(h as i32)),
            ("eps", Arg::F64(eps)),
        ];
        if let (false, Some(m)) = (rms, mean) {
            let b = self.at(ins[2])?;
            args.extend([("b", Arg::Ptr(b)), ("mean_out", Arg::Ptr(m))]);
        }
        let partials = match fp8_tail {
            Some(t) => {
                let partials = self.scratch(u64::from(grid.0) * 4);
                args.extend(self.fp8_tail_args(t, partials)?);
                Some(partials)
            }
            None => None,
        };
        self.launch(
            y,
            KernelId::Norm(Kernel::Norm {
                rms,
                pass: if fp8_tail.is_some() {
                    Pass::ForwardFp8
                } else {
                    Pass::Forward
                },
                input: g.ty(x).dtype,
                output: g.ty(y).dtype,
            }),
            grid,
            (norm_block(h), 1, 1),
            args,
        )?;
        match (fp8_tail, partials) {
            (Some(t), Some(p)) => self.fp8_tail_finalize(t, p, grid.0),
            _ => Ok(()),
        }
    }

    /// The `scale`, `q` and `partials` arguments of a `*_fwd_fp8` launch for its tail: a
    /// `quantize`'s scale and FP8 output, or none for an `fp8_scale` (the amax alone).
    fn fp8_tail_args(
        &mut self,
        tail: Node,
        partials: Place,
    ) -> Result<Vec<(&'static str, Arg)>, LowerError> {
        let node = self.g.node(tail);
        let (scale, q) = match node.op {
            Op::Quantize { .. } => {
                let (s, q) = (node.inputs[1], node.outputs[0]);
                (Arg::Ptr(self.at(s)?), Arg::Ptr(self.out(q)?))
            }
            _ => (Arg::Null, Arg::Null),
        };
        Ok(vec![
            ("scale", scale),
            ("q", q),
            ("partials", Arg::Ptr(partials)),
        ])
    }

    /// What the tail makes of the `count` partial maxima: a `quantize`'s amax where something
    /// reads it, or an `fp8_scale`'s scale.
    fn fp8_tail_finalize(
        &mut self,
        tail: Node,
        partials: Place,
        count: u32,
    ) -> Result<(), LowerError> {
        let node = self.g.node(tail);
        match node.op {
            Op::Quantize { .. } if self.is_read(node.outputs[1]) => {
                self.finish_amax(node.outputs[1], partials, count, None)
            }
            Op::Quantize { .. } => Ok(()),
            Op::Fp8Scale { to, margin } => {
                self.finish_amax(node.outputs[0], partials, count, Some((to, margin)))
            }
            _ => Err(self.err(node.outputs[0], "not an FP8 tail of a norm")),
        }
    }

    /// Saved statistics of the forward `(x, weight)`, or recomputed by a forward launch into
    /// scratch when the graph has no such forward node.
    fn norm_stats(
        &mut self,
        ins: &[Value],
        y_dtype: DType,
        rms: bool,
        eps: f64,
        at: Value,
    ) -> Result<Saved, LowerError> {
        if let Some(s) = self.saved.get(&(ins[0], ins[1])) {
            return Ok(*s);
        }
        let g = self.g;
        let x = ins[0];
        let h = g.ty(x).shape.last();
        let rows = g.ty(x).shape.numel().unwrap_or(0) / h.max(1);
        let mean = self.scratch(rows as u64 * 4);
        let rstd = self.scratch(rows as u64 * 4);
        let (xp, w) = (self.at(x)?, self.at(ins[1])?);
        // A null `y` makes the kernel compute the statistics only: it then reads neither the
        // weight nor the bias, which the backward does not have.
        let mut args = vec![
            ("x", Arg::Ptr(xp)),
            ("x_low", Arg::Null),
            ("res", Arg::Null),
            ("sum_out", Arg::Null),
            ("w", Arg::Ptr(w)),
            ("y", Arg::Null),
            ("rstd_out", Arg::Ptr(rstd)),
            ("rows", Arg::I64(rows as i64)),
            ("h", Arg::I32(h as i32)),
            ("eps", Arg::F64(eps)),
        ];
        if !rms {
            args.extend([("b", Arg::Null), ("mean_out", Arg::Ptr(mean))]);
        }
        self.launch(
            at,
            KernelId::Norm(Kernel::Norm {
                rms,
                pass: Pass::Forward,
                input: g.ty(x).dtype,
                output: y_dtype,
            }),
            grid_rows(rows),
            (norm_block(h), 1, 1),
            args,
        )?;
        Ok(Saved {
            a: if rms { rstd } else { mean },
            b: rstd,
            count: None,
        })
    }

    fn norm_grad(
        &mut self,
        ins: &[Value],
        outs: &[Value],
        rms: bool,
        eps: f64,
        epilogue: Option<(Node, Option<Node>)>,
    ) -> Result<(), LowerError> {
        let g = self.g;
        let (x, w, dy) = (ins[0], ins[1], ins[2]);
        let dx = outs[0];
        let (ti, to) = (g.ty(x).dtype, g.ty(dy).dtype);
        if g.ty(dx).dtype != ti {
            return Err(self.err(dx, "a norm's input gradient must have the input's dtype"));
        }
        let h = g.ty(x).shape.last();
        let rows = g.ty(x).shape.numel().unwrap_or(0) / h.max(1);
        let stats = self.norm_stats(ins, to, rms, eps, dx)?;
        let norm = |pass| KernelId::Norm(Kernel::Norm {
            rms,
            pass,
            input: ti,
            output: to,
        });
        let (xp, wp, dyp) = (self.at(x)?, self.at(w)?, self.at(dy)?);
        // Weight gradients first: the input gradient may be written over dy.
        // Row groups as a two-stage column sum's: the same count of threads, from the shape.
        let per_group = crate::cuda::families::reduce::lower::rows_per_group(1, rows, h);
        let groups = rows.div_ceil(per_group).max(1);
        let dw_part = self.scratch((groups * h * 8) as u64);
        let db_part = if rms {
            None
        } else {
            Some(self.scratch((groups * h * 8) as u64))
        };
        // The weight and bias gradients the graph reads, in F32 (a narrower one through a
        // scratch sum and a cast); null where nothing reads one.
        let mut sums = Vec::new();
        let mut casts = Vec::new();
        for k in 0..if rms { 1 } else { 2 } {
            let Some(&out) = outs.get(k + 1) else {
                sums.push(Arg::Null);
                continue;
            };
            if self.users[out.index()].is_empty()
                && !g.outputs().contains(&out)
                && !self.stored.contains_key(g.name(out))
            {
                sums.push(Arg::Null);
                continue;
            }
            let target = if g.ty(out).dtype == DType::F32 {
                self.out(out)?
            } else {
                let t = self.scratch(h as u64 * 4);
                casts.push((out, t));
                t
            };
            sums.push(Arg::Ptr(target));
        }
        // One counter per column block, zero between launches.
        let column_blocks = h.div_ceil(WEIGHT_BLOCK_COLUMNS);
        let done = self.l.handoff_counters(column_blocks);
        let mut args = vec![
            ("s", Arg::Ptr(xp)),
            ("dy", Arg::Ptr(dyp)),
            ("rstd", Arg::Ptr(stats.b)),
            ("dw_part", Arg::Ptr(dw_part)),
            ("dw", sums[0].clone()),
            ("done", Arg::Ptr(done)),
            ("rows", Arg::I64(rows as i64)),
            ("h", Arg::I32(h as i32)),
            ("rows_per_group", Arg::I32(per_group as i32)),
        ];
        if let Some(p) = db_part {
            args.extend([
                ("mean", Arg::Ptr(stats.a)),
                ("db_part", Arg::Ptr(p)),
                ("db", sums[1].clone()),
            ]);
        }
        if groups > 65_535 {
            return Err(self.err(dx, "too many rows for the norm weight-gradient launch"));
        }
        self.launch(
            dx,
            norm(Pass::BackwardWeight),
            (column_blocks as u32, groups as u32, 1),
            WEIGHT_BLOCK,
            args,
        )?;
        for (out, target) in casts {
            let o = self.out(out)?;
            self.launch(
                out,
                KernelId::Layout(crate::cuda::families::layout::Kernel::Cast {
                    from: DType::F32,
                    to: g.ty(out).dtype,
                }),
                grid_1d(h, BLOCK),
                (BLOCK, 1, 1),
                vec![
                    ("x", Arg::Ptr(target)),
                    ("y", Arg::Ptr(o)),
                    ("n", Arg::I64(h as i64)),
                ],
            )?;
        }
        // With an epilogue the kernel writes the add's result and dx itself is never stored.
        let (dadd, dxp, dx_low) = match epilogue {
            Some((add, cast)) => {
                let a = g.node(add);
                let other = a.inputs.iter().copied().find(|&v| v != dx);
                let other = other.ok_or_else(|| self.err(dx, "an epilogue add of dx to itself"))?;
                self.loc[dx.index()] = crate::cuda::lower::Loc::InKernel;
                let low = match cast {
                    Some(c) => Arg::Ptr(self.out(g.node(c).outputs[0])?),
                    None => Arg::Null,
                };
                (Arg::Ptr(self.at(other)?), self.out(a.outputs[0])?, low)
            }
            None => (Arg::Null, self.out(dx)?, Arg::Null),
        };
        let mut args = vec![
            ("s", Arg::Ptr(xp)),
            ("dy", Arg::Ptr(dyp)),
            ("w", Arg::Ptr(wp)),
            ("rstd", Arg::Ptr(stats.b)),
            ("dadd", dadd),
            ("dx", Arg::Ptr(dxp)),
            ("dx_low", dx_low),
            ("rows", Arg::I64(rows as i64)),
            ("h", Arg::I32(h as i32)),
        ];
        if !rms {
            args.push(("mean", Arg::Ptr(stats.a)));
        }
        self.launch(
            dx,
            norm(Pass::Backward),
            grid_rows(rows),
            (norm_block(h), 1, 1),
            args,
        )
    }
}

/// Threads per row block of the norms: for rows of whole 8-element units, a thread for each
/// unit (the kernels' one-read path, up to h = 8192: 3 warps for GPT-2's 768, 8 for
/// LLaMA-3.2-1B's 2048); else the general loop's block.
fn norm_block(h: usize) -> u32 {
    let units = h / 8;
    if h.is_multiple_of(8) && units <= 1024 {
        (units.div_ceil(32) * 32).clamp(32, 1024) as u32
    } else if h > 8192 {
        1024
    } else {
        row_threads(h, ROW_BLOCK)
    }
}
