//! The optimizer step: the gradient norm and the multi-tensor AdamW/SGD launches of
//! `optimizer.cu` and `grad_norm.cu`.
use super::{Kernel, UpdateRule};
use crate::cuda::program::{Arg, Command, Field, Place, Table};
use crate::cuda::lower::ops::{row_threads, BLOCK};
use crate::cuda::lower::{LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{DType, Node, Op, Value};

/// Elements per chunk of the multi-tensor kernels (the grad-norm's F64 partial sums group
/// 16384 elements, as the CPU twin does).
const CHUNK: u64 = 16_384;

impl RunLowering<'_, '_> {
    pub(crate) fn grad_norm(&mut self, y: Value, ins: &[Value]) -> Result<(), LowerError> {
        let g = self.g;
        let Some((&scale, grads)) = ins.split_last() else {
            return Err(self.err(y, "grad_norm has no operands"));
        };
        let mut tensors = Vec::new();
        let mut numels = Vec::new();
        for &gv in grads {
            let code = match g.ty(gv).dtype {
                DType::F32 => 0,
                DType::F16 => 1,
                DType::BF16 => 2,
                other => return Err(self.err(y, format!("a {} gradient", other.name()))),
            };
            let numel = g.ty(gv).shape.numel().unwrap_or(0);
            tensors.push(vec![
                Field::Ptr(self.at(gv)?),
                Field::I64(numel as i64),
                Field::I32(code),
                Field::I32(0),
            ]);
            numels.push(numel as u64);
        }
        let chunks = Table::chunks(numels, CHUNK);
        let n_chunks = chunks.len();
        let tt = self.l.table(Table::Rows(tensors));
        let ct = self.l.table(chunks);
        let partials = self.scratch(n_chunks.max(1) as u64 * 8);
        let sp = self.at(scale)?;
        self.launch(
            y,
            KernelId::Optimizer(Kernel::GradNormPartials),
            (n_chunks.clamp(1, 65_535 * 4) as u32, 1, 1),
            (BLOCK, 1, 1),
            vec![
                ("tensors", Arg::Table(tt)),
                ("chunks", Arg::Table(ct)),
                ("n_chunks", Arg::I32(n_chunks as i32)),
                ("scale", Arg::Ptr(sp)),
                ("partials", Arg::Ptr(partials)),
            ],
        )?;
        let out = self.out(y)?;
        self.launch(
            y,
            KernelId::Optimizer(Kernel::GradNormFinalize),
            (1, 1, 1),
            (row_threads(n_chunks, 1024), 1, 1),
            vec![
                ("partials", Arg::Ptr(partials)),
                ("n_chunks", Arg::I32(n_chunks as i32)),
                ("grad_norm", Arg::Ptr(out)),
                ("found_inf", Arg::Null),
            ],
        )
    }

    /// One multi-tensor launch for a batch of AdamW (or SGD, or Lion) nodes (see
    /// `castor_passes::fusion`'s optimizer batches), at the unit of its last member. The
    /// batch's `fp8_scale` members (the scales of updated masters' FP8 copies) take the
    /// launch's per-chunk maxima of the masters it leaves: one `fp8_scale_finalize` each over
    /// its tensor's chunks.
    pub(crate) fn optimizer(&mut self, members: &[Node]) -> Result<(), LowerError> {
        let g = self.g;
        let (tails, batch): (Vec<Node>, Vec<Node>) = members
            .iter()
            .partition(|&&m| matches!(g.node(m).op, Op::Fp8Scale { .. }));
        let batch = batch.as_slice();
        let Some(&n) = batch.last() else {
            return Ok(());
        };
        let node = g.node(n);
        let y = node.outputs[0];
        // The rule, its hyperparameters as its kernel takes them, and the copies' dtype.
        let (rule, hyperparameters, copy) = match &node.op {
            Op::AdamW {
                hp,
                max_grad_norm,
                copy,
            } => (
                UpdateRule::AdamW,
                vec![
                    ("beta1", Arg::F64(hp.beta1)),
                    ("beta2", Arg::F64(hp.beta2)),
                    ("eps", Arg::F64(hp.eps)),
                    ("max_grad_norm", Arg::F64(*max_grad_norm)),
                ],
                copy,
            ),
            Op::Sgd {
                hp,
                max_grad_norm,
                copy,
            } => (
                UpdateRule::Sgd,
                vec![
                    ("momentum", Arg::F64(hp.momentum)),
                    ("max_grad_norm", Arg::F64(*max_grad_norm)),
                ],
                copy,
            ),
            Op::Lion {
                hp,
                max_grad_norm,
                copy,
            } => (
                UpdateRule::Lion,
                vec![
                    ("beta1", Arg::F64(hp.beta1)),
                    ("beta2", Arg::F64(hp.beta2)),
                    ("max_grad_norm", Arg::F64(*max_grad_norm)),
                ],
                copy,
            ),
            _ => return Err(self.err(y, "not an optimizer node")),
        };
        let moments = rule.moments();
        let state = g.ty(node.inputs[2]).dtype;
        if !matches!(state, DType::F32 | DType::BF16) {
            return Err(self.err(
                y,
                format!("optimizer moments in {state} have no CUDA kernel"),
            ));
        }
        let mut rows = Vec::new();
        let mut numels = Vec::new();
        for &m in batch {
            let md = g.node(m);
            let k = 2 + moments;
            if md.inputs[2..k].iter().any(|&v| g.ty(v).dtype != state) {
                return Err(self.err(y, "one launch's moments must share one dtype"));
            }
            let numel = g.ty(md.inputs[0]).shape.numel().unwrap_or(0);
            // State updated in place: outputs written where the inputs are, copied there first
            // when the plan stores them elsewhere.
            let mut row = Vec::new();
            for i in 0..k {
                if i == 1 {
                    row.push(Field::Ptr(self.at(md.inputs[1])?));
                    continue;
                }
                let out_idx = if i == 0 { 0 } else { i - 1 };
                let src = self.at(md.inputs[i])?;
                let dst = self.out(md.outputs[out_idx])?;
                if dst != src {
                    let bytes = g.ty(md.inputs[i]).size_bytes().unwrap_or(0) as u64;
                    self.commands.push(Command::Copy { dst, src, bytes });
                }
                row.push(Field::Ptr(dst));
            }
            let copy = match md.outputs.get(1 + moments) {
                Some(&c) => Field::Ptr(self.out(c)?),
                None => Field::Null,
            };
            let wd = match &md.op {
                Op::AdamW { hp, .. } => hp.weight_decay,
                Op::Sgd { hp, .. } => hp.weight_decay,
                Op::Lion { hp, .. } => hp.weight_decay,
                _ => 0.0,
            };
            row.extend([copy, Field::I64(numel as i64), Field::F64(wd)]);
            rows.push(row);
            numels.push(numel as u64);
        }
        let k = node.inputs.len();
        let scalars: Vec<Place> = node.inputs[k - 4..]
            .iter()
            .map(|&v| self.at(v))
            .collect::<Result<_, _>>()?;
        // Each tensor's first chunk: a tensor's chunks are consecutive in the table.
        let first_chunk: Vec<usize> = numels
            .iter()
            .scan(0usize, |at, &numel| {
                let first = *at;
                *at += numel.div_ceil(CHUNK) as usize;
                Some(first)
            })
            .collect();
        let chunks = Table::chunks(numels.clone(), CHUNK);
        let n_chunks = chunks.len();
        let amax_partials = (!tails.is_empty()).then(|| self.scratch(n_chunks.max(1) as u64 * 4));
        let tt = self.l.table(Table::Rows(rows));
        let ct = self.l.table(chunks);
        let mut args = vec![
            ("tensors", Arg::Table(tt)),
            ("chunks", Arg::Table(ct)),
            ("n_chunks", Arg::I32(n_chunks as i32)),
        ];
        // The update's last four operands, as the kernels take them.
        args.extend(
            ["lr", "step", "scale", "grad_norm"]
                .into_iter()
                .zip(scalars.into_iter().map(Arg::Ptr)),
        );
        args.extend(hyperparameters);
        args.push(("amax_partials", amax_partials.map_or(Arg::Null, Arg::Ptr)));
        self.launch(
            y,
            KernelId::Optimizer(Kernel::Update {
                rule,
                state,
                copy: copy.unwrap_or(DType::F32),
            }),
            (n_chunks.clamp(1, 65_535 * 4) as u32, 1, 1),
            (BLOCK, 1, 1),
            args,
        )?;
        let Some(partials) = amax_partials else {
            return Ok(());
        };
        for t in tails {
            let tail = g.node(t);
            let Op::Fp8Scale { to, margin } = tail.op else {
                continue;
            };
            let k = batch
                .iter()
                .position(|&m| g.node(m).outputs[0] == tail.inputs[0])
                .ok_or_else(|| self.err(tail.outputs[0], "not the scale of an updated master"))?;
            let count = numels[k].div_ceil(CHUNK) as u32;
            let at = partials.plus(4 * first_chunk[k] as u64);
            self.finish_amax(tail.outputs[0], at, count, Some((to, margin)))?;
        }
        Ok(())
    }
}
