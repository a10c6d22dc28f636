//! FP8 nodes. `amax_history` (delayed scaling): a thread per history, one launch for a batch
//! unit of them (`fp8_amax_history`).
//! `fp8_scale`: per-block maxima of `|x|` (`fp8_amax_<t>`), then the scale
//! (`fp8_scale_finalize`). `quantize`: the cast with per-block maxima (`fp8_quantize_<t>_<f>`),
//! then the amax (`fp8_amax_finalize`) where something reads it. `fp8_matmul`: the two
//! dequantization factors (`fp8_dequantization`, 8 bytes of an arena buffer the product's scale
//! pointers point at, made with those of every later product whose scales exist by then), a
//! transposed copy of each operand the IR does not store contiguous along
//! the inner dim (cuBLASLt's FP8 products take only the "TN" form: the backward's `dX = dY W`
//! and `dW = Xᵀ dY`, and `x W` of a weight stored `[in, out]`), then one cuBLASLt FP8 product
//! (`crate::cuda::lower::gemm::fp8_matmul`). The copies are arena buffers, shared by the later
//! products that read the same elements and live until the last of them, so they show in the
//! program's allocation, and in its listing as `strided_copy_b1` launches for the first such
//! product's node, just before its `gemm`.

use super::Kernel;
use crate::cuda::kernel_id::KernelId;
use crate::cuda::lower::ops::{row_threads, BLOCK};
use crate::cuda::lower::{copies, gemm, LowerError, RunLowering};
use crate::cuda::program::{Arg, Command, Field, Fp8Scales, Place, Table};
use castor_ir::fp8::Fp8Format;
use castor_ir::{DType, Node, Op, Value};

/// The most blocks (and so partial maxima) of an amax: each thread takes 8 elements at least.
const MAX_BLOCKS: usize = 1024;

/// The CPU twin's divisor of a scale, 2^margin in F64 (infinite past 2^1023).
fn margin_divisor(margin: usize) -> f64 {
    2f64.powi(margin.min(1024) as i32)
}

/// The grid of an amax or quantize launch over `n` elements.
fn amax_grid(n: usize) -> (u32, u32, u32) {
    let blocks = n.div_ceil(BLOCK as usize * 8).clamp(1, MAX_BLOCKS);
    (blocks as u32, 1, 1)
}

impl RunLowering<'_, '_> {
    /// The FP8 format of an FP8 dtype attribute, and the dtype of `x`, which the kernels take
    /// in F32, F16 or BF16.
    fn fp8_operands(&self, y: Value, x: Value, to: DType) -> Result<(Fp8Format, DType), LowerError> {
        let format = Fp8Format::of(to)
            .ok_or_else(|| self.err(y, format!("{to} is not an FP8 dtype")))?;
        let dtype = self.g.ty(x).dtype;
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(self.err(y, format!("no FP8 kernel reads {dtype} values")));
        }
        Ok((format, dtype))
    }

    /// The one-block kernel that reduces `count` per-block maxima at `partials` into `v`: the
    /// amax itself (`scale: None`), or the `fp8_scale` of it for format `to` with its margin.
    /// The quantize and amax kernels, the fused pointwise units and the norms' FP8 tails all
    /// end this way.
    pub(crate) fn finish_amax(
        &mut self,
        v: Value,
        partials: Place,
        count: u32,
        scale: Option<(DType, usize)>,
    ) -> Result<(), LowerError> {
        let out = self.out(v)?;
        let threads = (row_threads(count as usize, 1024), 1, 1);
        let mut args = vec![
            ("partials", Arg::Ptr(partials)),
            ("count", Arg::I32(count as i32)),
        ];
        let kernel = match scale {
            None => {
                args.push(("amax", Arg::Ptr(out)));
                Kernel::AmaxFinalize
            }
            Some((to, margin)) => {
                let format = Fp8Format::of(to)
                    .ok_or_else(|| self.err(v, format!("{to} is not an FP8 dtype")))?;
                args.extend([
                    ("largest", Arg::F64(f64::from(format.max()))),
                    ("divisor", Arg::F64(margin_divisor(margin))),
                    ("scale", Arg::Ptr(out)),
                ]);
                Kernel::ScaleFinalize
            }
        };
        self.launch(v, KernelId::Fp8(kernel), (1, 1, 1), threads, args)
    }

    /// Whether something reads `v`, or the run returns or stores it.
    pub(crate) fn is_read(&self, v: Value) -> bool {
        !self.users[v.index()].is_empty()
            || self.g.outputs().contains(&v)
            || self.stored.contains_key(self.g.name(v))
    }

    pub(crate) fn fp8_scale(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let (x, y) = (node.inputs[0], node.outputs[0]);
        let Op::Fp8Scale { to, margin } = node.op else {
            return Err(self.err(y, "not an fp8_scale node"));
        };
        let (_, dtype) = self.fp8_operands(y, x, to)?;
        let count = g.ty(x).shape.numel().unwrap_or(0);
        let grid = amax_grid(count);
        let partials = self.scratch(u64::from(grid.0) * 4);
        let px = self.at(x)?;
        self.launch(
            y,
            KernelId::Fp8(Kernel::Amax { dtype }),
            grid,
            (BLOCK, 1, 1),
            vec![
                ("x", Arg::Ptr(px)),
                ("n", Arg::I64(count as i64)),
                ("partials", Arg::Ptr(partials)),
            ],
        )?;
        self.finish_amax(y, partials, grid.0, Some((to, margin)))
    }

    pub(crate) fn quantize(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let (x, scale) = (node.inputs[0], node.inputs[1]);
        let (q, amax) = (node.outputs[0], node.outputs[1]);
        let Op::Quantize { to } = node.op else {
            return Err(self.err(q, "not a quantize node"));
        };
        let (format, dtype) = self.fp8_operands(q, x, to)?;
        let count = g.ty(x).shape.numel().unwrap_or(0);
        let grid = amax_grid(count);
        // The amax only where something reads it (delayed scaling records it).
        let partials = self
            .is_read(amax)
            .then(|| self.scratch(u64::from(grid.0) * 4));
        let (px, ps, pq) = (self.at(x)?, self.at(scale)?, self.out(q)?);
        self.launch(
            q,
            KernelId::Fp8(Kernel::Quantize { dtype, to: format }),
            grid,
            (BLOCK, 1, 1),
            vec![
                ("x", Arg::Ptr(px)),
                ("n", Arg::I64(count as i64)),
                ("scale", Arg::Ptr(ps)),
                ("q", Arg::Ptr(pq)),
                ("partials", partials.map_or(Arg::Null, Arg::Ptr)),
            ],
        )?;
        match partials {
            Some(p) => self.finish_amax(amax, p, grid.0, None),
            None => Ok(()),
        }
    }

    /// Steps of delayed scaling, one launch for all of `members` (an `amax_history` node, or
    /// a batch unit of them): a thread per history shifts it and computes the next scale
    /// (histories are short: Transformer Engine's default is 16).
    pub(crate) fn amax_histories(&mut self, members: &[Node]) -> Result<(), LowerError> {
        let g = self.g;
        let mut rows = Vec::with_capacity(members.len());
        let mut at = None;
        for &n in members {
            let node = g.node(n);
            let (history, scale, amax) = (node.inputs[0], node.inputs[1], node.inputs[2]);
            let (history_next, scale_next) = (node.outputs[0], node.outputs[1]);
            let Op::AmaxHistory { to, margin } = node.op else {
                return Err(self.err(history_next, "not an amax_history node"));
            };
            let format = Fp8Format::of(to)
                .ok_or_else(|| self.err(history_next, format!("{to} is not an FP8 dtype")))?;
            let length = g.ty(history).shape.numel().unwrap_or(0);
            rows.push(vec![
                Field::Ptr(self.at(history)?),
                Field::Ptr(self.at(scale)?),
                Field::Ptr(self.at(amax)?),
                Field::Ptr(self.out(history_next)?),
                Field::Ptr(self.out(scale_next)?),
                Field::F64(f64::from(format.max())),
                Field::F64(margin_divisor(margin)),
                Field::I32(length as i32),
                Field::I32(0),
            ]);
            at = Some(history_next);
        }
        let Some(at) = at else {
            return Ok(());
        };
        let count = rows.len();
        let table = self.l.table(Table::Rows(rows));
        let threads = row_threads(count, BLOCK);
        self.launch(
            at,
            KernelId::Fp8(Kernel::AmaxHistory),
            (count.div_ceil(threads as usize) as u32, 1, 1),
            (threads, 1, 1),
            vec![
                ("histories", Arg::Table(table)),
                ("count", Arg::I32(count as i32)),
            ],
        )
    }

    pub(crate) fn fp8_matmul(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        // The scales (operands 2 and 3) reach the product through its dequantization factors.
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let y = node.outputs[0];
        let Op::Fp8MatMul {
            transpose_a,
            transpose_b,
        } = node.op
        else {
            return Err(self.err(y, "not an fp8_matmul node"));
        };
        // a as [.., M, K] and b as [.., N, K].
        let (pa, a_shape) = self.inner_last(n, a, transpose_a)?;
        let (pb, b_shape) = self.inner_last(n, b, !transpose_b)?;
        let factors = match self.fp8_factors.get(&n) {
            Some(&f) => f,
            None => self.dequantization_batch(n)?,
        };
        let c = self.out(y)?;
        let dt = |v: Value| g.ty(v).dtype;
        let gm = gemm::fp8_matmul(
            g.name(y),
            (pa, &a_shape, dt(a)),
            (pb, &b_shape, dt(b)),
            (c, dt(y)),
            // cuBLAS's A is the IR's b (factors[1]), its B the IR's a (factors[0]).
            Fp8Scales {
                a_scale: factors.plus(4),
                b_scale: factors,
                fast_accum: false,
            },
        )
        .map_err(|m| self.err(y, m))?;
        self.commands.push(Command::Gemm(gm));
        Ok(())
    }

    /// The dequantization factors of FP8 product `n` and of every later product of the run
    /// whose two scales are made by now (sources, or values made before `n`): one
    /// `fp8_dequantization` launch, into one arena buffer of 8 bytes a product that lives until
    /// the last of them. Under delayed scaling every scale is state, so the first product
    /// makes the factors of all; under current scaling the products that share an operand's
    /// scale share a launch.
    fn dequantization_batch(&mut self, n: Node) -> Result<Place, LowerError> {
        let g = self.g;
        let here = self.unit_of[n.index()];
        let ready = |v: Value| self.unit_of[g.value(v).producer.index()] < here;
        let group: Vec<Node> = g
            .nodes()
            .filter(|&(m, node)| {
                m >= n
                    && matches!(node.op, Op::Fp8MatMul { .. })
                    && !self.fp8_factors.contains_key(&m)
                    && ready(node.inputs[2])
                    && ready(node.inputs[3])
            })
            .map(|(m, _)| m)
            .collect();
        let y = g.node(n).outputs[0];
        if group.first() != Some(&n) {
            return Err(self.err(y, "an FP8 product's scales are not made before it"));
        }
        let end = group.iter().map(|m| self.unit_of[m.index()]).max().unwrap_or(here);
        let buffer = self.arena(8 * group.len() as u64, end);
        let mut rows = Vec::with_capacity(group.len());
        for (i, &m) in group.iter().enumerate() {
            let node = g.node(m);
            let factors = buffer.plus(8 * i as u64);
            rows.push(vec![
                Field::Ptr(self.at(node.inputs[2])?),
                Field::Ptr(self.at(node.inputs[3])?),
                Field::Ptr(factors),
            ]);
            self.fp8_factors.insert(m, factors);
        }
        let table = self.l.table(Table::Rows(rows));
        let threads = row_threads(group.len(), BLOCK);
        self.launch(
            y,
            KernelId::Fp8(Kernel::Dequantization),
            (group.len().div_ceil(threads as usize) as u32, 1, 1),
            (threads, 1, 1),
            vec![
                ("products", Arg::Table(table)),
                ("count", Arg::I32(group.len() as i32)),
            ],
        )?;
        Ok(buffer)
    }

    /// The place and shape of `v` with its last two dims swapped when `swap`, else as it is.
    /// The swapped copy is a strided copy (launched for product `n`) into an arena buffer that
    /// every later product of the run reading the same elements swapped shares, so it lives
    /// until the last of them (LLaMA's q, k and v weight gradients read one copy of their
    /// input, as the gate and up projections' do).
    fn inner_last(
        &mut self,
        n: Node,
        v: Value,
        swap: bool,
    ) -> Result<(Place, castor_ir::Shape), LowerError> {
        let g = self.g;
        let y = g.node(n).outputs[0];
        let ty = g.ty(v).clone();
        let src = self.at(v)?;
        if !swap {
            return Ok((src, ty.shape));
        }
        let dims = ty.shape.dims();
        let r = dims.len();
        if r < 2 {
            return Err(self.err(y, "an FP8 product's operand is not a matrix"));
        }
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        let swapped = castor_ir::Shape::from(perm.iter().map(|&p| dims[p]).collect::<Vec<_>>());
        let key = self.swap_key(v);
        if let Some(&dst) = self.fp8_swapped.get(&key) {
            return Ok((dst, swapped));
        }
        // The products from here on that read these elements swapped.
        let end = g
            .nodes()
            .filter(|&(m, node)| m >= n && swapped_operands(&node.op, &node.inputs).iter().any(|&o| g.ty(o).shape == ty.shape && self.swap_key(o) == key))
            .map(|(m, _)| self.unit_of[m.index()])
            .max()
            .unwrap_or(self.unit);
        let layout = copies::transpose(dims, &perm).map_err(|m| self.err(y, m))?;
        let bytes = crate::cuda::lower::bytes_of(&ty, g.name(v))?;
        let dst = self.arena(bytes, end);
        self.strided_copy(y, ty.dtype, src, dst, layout)?;
        self.fp8_swapped.insert(key, dst);
        Ok((dst, swapped))
    }

    /// What identifies the elements `v` reads: its buffer's value and the view of it.
    fn swap_key(&self, v: Value) -> (Value, i64, Vec<usize>, Vec<i64>) {
        let (root, view) = self.source(v);
        (root, view.offset, view.dims, view.strides)
    }
}

/// The operands of an `fp8_matmul` that its product reads swapped (cuBLASLt's "TN" form wants
/// both with the inner dim last): `a` when transposed, `b` when not.
fn swapped_operands(op: &Op, inputs: &[Value]) -> Vec<Value> {
    match *op {
        Op::Fp8MatMul {
            transpose_a,
            transpose_b,
        } => {
            let mut out = Vec::new();
            if transpose_a {
                out.push(inputs[0]);
            }
            if !transpose_b {
                out.push(inputs[1]);
            }
            out
        }
        _ => Vec::new(),
    }
}
