//! Token embeddings: `embedding.cu`'s gather and its deterministic backward (count, scan,
//! fill, accumulate per row).

use super::{BackwardStage, Kernel};
use crate::cuda::program::{Arg, Command};
use crate::cuda::lower::ops::{row_threads, BLOCK};
use crate::cuda::lower::{grid_1d, grid_rows, LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{DType, Node, Value};

impl RunLowering<'_, '_> {
    pub(crate) fn embedding(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let y = node.outputs[0];
        let dt = |v: Value| g.ty(v).dtype;
        let dims = |v: Value| g.ty(v).shape.dims().to_vec();
        let numel = |v: Value| g.ty(v).shape.numel().unwrap_or(0);
        let (table, ids) = (ins[0], ins[1]);
        if dt(ids) != DType::I64 {
            return Err(self.err(y, "token ids must be i64 on the CUDA executor"));
        }
        if dt(table) != dt(y) {
            return Err(self.err(y, "an embedding gathers rows in the table's dtype"));
        }
        let d = dims(table);
        let (v, h) = (d[0], d[1]);
        let rows = numel(ids);
        let (tp, ip) = (self.at(table)?, self.at(ids)?);
        let out = self.out(y)?;
        let bad = self.flag(y, "token id", ip, v, None);
        self.launch(
            y,
            KernelId::Embedding(Kernel::Forward { table: dt(y) }),
            grid_rows(rows),
            (128, 1, 1),
            vec![
                ("table", Arg::Ptr(tp)),
                ("ids", Arg::Ptr(ip)),
                ("out", Arg::Ptr(out)),
                ("n", Arg::I64(rows as i64)),
                ("v", Arg::I64(v as i64)),
                ("h", Arg::I32(h as i32)),
                ("bad", Arg::Ptr(bad)),
            ],
        )?;
        Ok(())
    }

    pub(crate) fn embedding_grad(
        &mut self,
        y: Value,
        ids: Value,
        dy: Value,
        vocab: usize,
        padding: Option<usize>,
    ) -> Result<(), LowerError> {
        let g = self.g;
        if g.ty(ids).dtype != DType::I64 {
            return Err(self.err(y, "token ids must be i64 on the CUDA executor"));
        }
        let n = g.ty(ids).shape.numel().unwrap_or(0);
        let h = g.ty(y).shape.last();
        let counts = self.scratch(vocab as u64 * 4);
        let starts = self.scratch((vocab as u64 + 1) * 4);
        let positions = self.scratch(n.max(1) as u64 * 4);
        let ip = self.at(ids)?;
        let bad = self.flag(y, "token id", ip, vocab, None);
        self.commands.push(Command::Memset {
            dst: counts,
            bytes: vocab as u64 * 4,
            byte: 0,
        });
        self.launch(
            y,
            KernelId::Embedding(Kernel::Backward(BackwardStage::Count)),
            grid_1d(n, BLOCK),
            (BLOCK, 1, 1),
            vec![
                ("ids", Arg::Ptr(ip)),
                ("n", Arg::I64(n as i64)),
                ("v", Arg::I64(vocab as i64)),
                ("counts", Arg::Ptr(counts)),
                ("bad", Arg::Ptr(bad)),
            ],
        )?;
        self.launch(
            y,
            KernelId::Embedding(Kernel::Backward(BackwardStage::Scan)),
            (1, 1, 1),
            (row_threads(vocab, 1024), 1, 1),
            vec![
                ("counts", Arg::Ptr(counts)),
                ("v", Arg::I64(vocab as i64)),
                ("starts", Arg::Ptr(starts)),
            ],
        )?;
        self.launch(
            y,
            KernelId::Embedding(Kernel::Backward(BackwardStage::Fill)),
            (vocab.div_ceil(256).max(1) as u32, 1, 1),
            // One warp per 32 positions (each warp scans a slice of them), up to 32 warps.
            (row_threads(n, 1024), 1, 1),
            vec![
                ("ids", Arg::Ptr(ip)),
                ("n", Arg::I64(n as i64)),
                ("v", Arg::I64(vocab as i64)),
                ("starts", Arg::Ptr(starts)),
                ("positions", Arg::Ptr(positions)),
            ],
        )?;
        let dyp = self.at(dy)?;
        let out = self.out(y)?;
        self.launch(
            y,
            KernelId::Embedding(Kernel::BackwardAccumulate {
                grad: g.ty(dy).dtype,
                out: g.ty(y).dtype,
            }),
            grid_rows(vocab),
            (128, 1, 1),
            vec![
                ("dy", Arg::Ptr(dyp)),
                ("positions", Arg::Ptr(positions)),
                ("starts", Arg::Ptr(starts)),
                ("v", Arg::I64(vocab as i64)),
                ("h", Arg::I32(h as i32)),
                ("dtable", Arg::Ptr(out)),
            ],
        )?;
        // torch's padding_idx: that row gets no gradient (zero bytes are 0.0 in every dtype).
        if let Some(row) = padding.filter(|&p| p < vocab) {
            let bytes = (h * g.ty(y).dtype.size_bytes()) as u64;
            self.commands.push(Command::Memset {
                dst: out.plus(row as u64 * bytes),
                bytes,
                byte: 0,
            });
        }
        Ok(())
    }
}
