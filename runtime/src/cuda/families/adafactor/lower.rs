//! One Adafactor update: the launches of `adafactor.cu` for one parameter (second moments,
//! the row statistics' means, the root-mean-square partials, the rate and clip divisor, the
//! update), state updated in place.
use super::{Kernel, Stage};
use crate::cuda::program::{Arg, Command};
use crate::cuda::lower::{LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{DType, Node, Op};

/// Threads of the reducing launches: `ADAFACTOR_THREADS` in `adafactor.cu`, whose sums the
/// CPU twin reproduces in this shape.
const THREADS: u32 = 256;
/// Elements per root-mean-square partial: `ADAFACTOR_CHUNK`.
const CHUNK: usize = 16_384;
/// Threads per block of the elementwise launches.
const BLOCK: u32 = 256;

impl RunLowering<'_, '_> {
    pub(crate) fn adafactor(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let Op::Adafactor {
            hp: h,
            max_grad_norm,
            copy,
        } = node.op
        else {
            return Err(self.err(node.outputs[0], "not an Adafactor node"));
        };
        let y = node.outputs[0];
        let (ins, outs) = (node.inputs.clone(), node.outputs.clone());
        let n_moments = ins.len() - 6;
        if let Some(&m) = ins[2..2 + n_moments]
            .iter()
            .find(|&&v| g.ty(v).dtype != DType::F32)
        {
            return Err(self.err(
                y,
                format!(
                    "Adafactor moments in {} have no CUDA kernel; store them in f32",
                    g.ty(m).dtype
                ),
            ));
        }
        // State in place: master and moments are written where the plan stores the results,
        // copied there first when that is not where the inputs are.
        let mut state = Vec::new();
        for (i, &o) in [0]
            .iter()
            .chain(&(2..2 + n_moments).collect::<Vec<_>>())
            .zip(&outs)
        {
            let (src, dst) = (self.at(ins[*i])?, self.out(o)?);
            if dst != src {
                let bytes = g.ty(ins[*i]).size_bytes().unwrap_or(0) as u64;
                self.commands.push(Command::Copy { dst, src, bytes });
            }
            state.push(dst);
        }
        let master = state[0];
        let moments = &state[1..];
        let (exp_avg, second) = if h.beta1.is_some() {
            (Some(moments[0]), &moments[1..])
        } else {
            (None, moments)
        };
        let copy_out = copy.map(|_| outs[outs.len() - 1]);
        let grad = self.at(ins[1])?;
        let [lr, step, scale, grad_norm] = [0, 1, 2, 3].map(|k| ins[2 + n_moments + k]);
        let (lr, step, scale, grad_norm) = (
            self.at(lr)?,
            self.at(step)?,
            self.at(scale)?,
            self.at(grad_norm)?,
        );
        let dims = g.ty(ins[0]).shape.dims().to_vec();
        let numel: usize = dims.iter().product();
        let grid = |work: usize, per: u32| {
            (
                work.div_ceil(per as usize).clamp(1, 65_535 * 4) as u32,
                1,
                1,
            )
        };
        let common = |moment: &'static str, p| {
            vec![
                ("grad", Arg::Ptr(grad)),
                (moment, Arg::Ptr(p)),
                ("scale", Arg::Ptr(scale)),
                ("grad_norm", Arg::Ptr(grad_norm)),
                ("max_grad_norm", Arg::F64(max_grad_norm)),
                ("eps1", Arg::F64(h.eps1)),
                ("step", Arg::Ptr(step)),
                ("decay_rate", Arg::F64(h.decay_rate)),
            ]
        };
        // Factored: (row, col, row means, rows, cols); full: v.
        let (row, col, row_mean, v, rows, cols) = match (second, dims.as_slice()) {
            (&[row, col], [.., rows, cols]) => {
                let (rows, cols) = (*rows, *cols);
                let lead = numel / (rows * cols);
                let mut args = common("row", row);
                args.extend([
                    ("n_rows", Arg::I32((lead * rows) as i32)),
                    ("cols", Arg::I32(cols as i32)),
                ]);
                self.launch(
                    y,
                    KernelId::Adafactor(Kernel::Stage(Stage::Rows)),
                    grid(lead * rows, 1),
                    (THREADS, 1, 1),
                    args,
                )?;
                let mut args = common("col", col);
                args.extend([
                    ("lead", Arg::I32(lead as i32)),
                    ("rows", Arg::I32(rows as i32)),
                    ("cols", Arg::I32(cols as i32)),
                ]);
                self.launch(
                    y,
                    KernelId::Adafactor(Kernel::Stage(Stage::Cols)),
                    grid(lead * cols, BLOCK),
                    (BLOCK, 1, 1),
                    args,
                )?;
                let row_mean = self.scratch(lead as u64 * 4);
                self.launch(
                    y,
                    KernelId::Adafactor(Kernel::Stage(Stage::RowMean)),
                    grid(lead, 1),
                    (THREADS, 1, 1),
                    vec![
                        ("row", Arg::Ptr(row)),
                        ("lead", Arg::I32(lead as i32)),
                        ("rows", Arg::I32(rows as i32)),
                        ("grad_norm", Arg::Ptr(grad_norm)),
                        ("row_mean", Arg::Ptr(row_mean)),
                    ],
                )?;
                (
                    Arg::Ptr(row),
                    Arg::Ptr(col),
                    Arg::Ptr(row_mean),
                    Arg::Null,
                    rows,
                    cols,
                )
            }
            (&[v], _) => {
                let mut args = common("v", v);
                args.push(("n", Arg::I64(numel as i64)));
                self.launch(
                    y,
                    KernelId::Adafactor(Kernel::Stage(Stage::Full)),
                    grid(numel, BLOCK),
                    (BLOCK, 1, 1),
                    args,
                )?;
                (Arg::Null, Arg::Null, Arg::Null, Arg::Ptr(v), 1, 1)
            }
            _ => return Err(self.err(y, "Adafactor's moments do not fit its parameter")),
        };
        let n_chunks = numel.div_ceil(CHUNK).max(1);
        let partials = self.scratch(2 * n_chunks as u64 * 8);
        let u_args = |a: &mut Vec<(&'static str, Arg)>| {
            a.extend([
                ("row", row.clone()),
                ("col", col.clone()),
                ("row_mean", row_mean.clone()),
                ("v", v.clone()),
                ("n", Arg::I64(numel as i64)),
                ("rows", Arg::I32(rows as i32)),
                ("cols", Arg::I32(cols as i32)),
                ("scale", Arg::Ptr(scale)),
                ("grad_norm", Arg::Ptr(grad_norm)),
                ("max_grad_norm", Arg::F64(max_grad_norm)),
            ])
        };
        let mut args = vec![
            ("master", Arg::Ptr(master)),
            ("grad", Arg::Ptr(grad)),
            ("partials", Arg::Ptr(partials)),
        ];
        u_args(&mut args);
        self.launch(
            y,
            KernelId::Adafactor(Kernel::Stage(Stage::Partials)),
            grid(n_chunks, 1),
            (THREADS, 1, 1),
            args,
        )?;
        let factors = self.scratch(8);
        let flag = |b: bool| Arg::I32(i32::from(b));
        self.launch(
            y,
            KernelId::Adafactor(Kernel::Stage(Stage::Finalize)),
            (1, 1, 1),
            (1, 1, 1),
            vec![
                ("partials", Arg::Ptr(partials)),
                ("n_chunks", Arg::I32(n_chunks as i32)),
                ("n", Arg::I64(numel as i64)),
                ("lr", Arg::Ptr(lr)),
                ("step", Arg::Ptr(step)),
                ("grad_norm", Arg::Ptr(grad_norm)),
                ("eps2", Arg::F64(h.eps2)),
                ("clip_threshold", Arg::F64(h.clip_threshold)),
                ("relative_step", flag(h.relative_step)),
                ("scale_parameter", flag(h.scale_parameter)),
                ("warmup_init", flag(h.warmup_init)),
                ("factors", Arg::Ptr(factors)),
            ],
        )?;
        let copy_arg = match copy_out {
            Some(c) => Arg::Ptr(self.out(c)?),
            None => Arg::Null,
        };
        let mut args = vec![
            ("master", Arg::Ptr(master)),
            ("grad", Arg::Ptr(grad)),
            ("exp_avg", exp_avg.map_or(Arg::Null, Arg::Ptr)),
            ("copy", copy_arg),
            ("factors", Arg::Ptr(factors)),
            ("beta1", Arg::F64(h.beta1.unwrap_or(0.0))),
            ("weight_decay", Arg::F64(h.weight_decay)),
        ];
        u_args(&mut args);
        let kernel = KernelId::Adafactor(Kernel::Apply {
            copy: copy.unwrap_or(DType::F32),
        });
        self.launch(y, kernel, grid(numel, BLOCK), (BLOCK, 1, 1), args)
    }
}
