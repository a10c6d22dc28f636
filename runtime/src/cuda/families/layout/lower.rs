//! `layout.cu`: layout results as views or one strided copy each, concatenation and padding
//! as copies into place, integer and boolean casts, fills.

use super::Kernel;
use crate::cuda::program::{Arg, Command, CopyLayout, Place, MAX_RANK};
use crate::cuda::lower::ops::BLOCK;
use crate::cuda::lower::{copies, grid_1d, LowerError, RunLowering};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{DType, Node, Op, Value};

impl RunLowering<'_, '_> {
    /// A layout op's result `o` (of operand `x`): nothing when it stays a view read by other
    /// layout ops, an alias of its operand's buffer when its elements are contiguous there,
    /// else one strided copy of the composed view into a buffer of its own.
    pub(crate) fn layout_result(&mut self, o: Value, x: Value) -> Result<(), LowerError> {
        let g = self.g;
        let named = !self.users[o.index()].is_empty()
            || g.outputs().contains(&o)
            || self.stored.contains_key(g.name(o));
        if !named {
            return Ok(()); // a split piece nothing reads
        }
        match (self.storage[o.index()], self.views[o.index()].clone()) {
            (crate::cuda::lower::Storage::Virtual, _) => Ok(()),
            (crate::cuda::lower::Storage::Alias, Some((root, view))) => {
                let bytes = view.offset as u64 * g.ty(o).dtype.size_bytes() as u64;
                let place = self.at(root)?.plus(bytes);
                self.loc[o.index()] = crate::cuda::lower::Loc::At(place);
                Ok(())
            }
            (_, view) => {
                // A reshape that no view expresses copies its operand's elements in order.
                let (root, view) = match view {
                    Some(rv) => rv,
                    None => self.source(x),
                };
                if root == o {
                    // Its producer wrote it in place (`Storage::Into`): nothing to move.
                    return Ok(());
                }
                let l = view.materialize().map_err(|m| self.err(o, m))?;
                let (src, dst) = (self.at(root)?, self.out(o)?);
                self.copy(o, src, dst, l)
            }
        }
    }

    /// A strided copy of elements of `y`'s dtype.
    pub(crate) fn copy(
        &mut self,
        y: Value,
        src: Place,
        dst: Place,
        l: crate::cuda::program::CopyLayout,
    ) -> Result<(), LowerError> {
        self.strided_copy(y, self.g.ty(y).dtype, src, dst, l)
    }

    /// A strided copy of `dtype` elements, launched for node `y`.
    pub(crate) fn strided_copy(
        &mut self,
        y: Value,
        dtype: DType,
        src: Place,
        dst: Place,
        l: crate::cuda::program::CopyLayout,
    ) -> Result<(), LowerError> {
        let (size, l) = match in_units_of_16_bytes(&l, dtype.size_bytes(), src, dst) {
            Some(wide) => (16, wide),
            None => (dtype.size_bytes(), l),
        };
        let n: i64 = l.shape[..l.rank.max(0) as usize].iter().product();
        self.launch(
            y,
            KernelId::Layout(Kernel::StridedCopy { bytes: size as u32 }),
            grid_1d(n as usize, BLOCK),
            (BLOCK, 1, 1),
            vec![
                ("src", Arg::Ptr(src)),
                ("dst", Arg::Ptr(dst)),
                ("n", Arg::I64(n)),
                ("l", Arg::Layout(l)),
            ],
        )
    }

    pub(crate) fn concat(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let y = node.outputs[0];
        let dims = |v: Value| g.ty(v).shape.dims().to_vec();
        let Op::Concat { axis } = &node.op else {
            return Err(self.err(y, "not a concat node"));
        };
        let out_dims = dims(y);
        let dst = self.out(y)?;
        let mut start = 0;
        for &x in &ins {
            let (root, view) = self.source(x);
            if root == y {
                // Written into its slot by its producer (`Storage::Into`).
                start += dims(x)[*axis];
                continue;
            }
            let l = if view.dims == dims(x) {
                view.place_into(&out_dims, *axis, start)
            } else {
                // A reshape read through its operand's view: the slot reshaped to match.
                copies::View::contiguous(&out_dims)
                    .slice(*axis, start, dims(x)[*axis])
                    .reshape(&view.dims)
                    .ok_or_else(|| format!("the slot of `%{}` cannot take its view", g.name(x)))
                    .and_then(|dst| view.copy_to(&dst))
            }
            .map_err(|m| self.err(y, m))?;
            start += dims(x)[*axis];
            let src = self.at(root)?;
            self.copy(y, src, dst, l)?;
        }
        Ok(())
    }

    pub(crate) fn pad(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let y = node.outputs[0];
        let dims = |v: Value| g.ty(v).shape.dims().to_vec();
        let Op::Pad {
            axis,
            before,
            after,
        } = &node.op
        else {
            return Err(self.err(y, "not a pad node"));
        };
        let bytes = crate::cuda::lower::bytes_of(g.ty(y), g.name(y))?;
        let dst = self.out(y)?;
        // Zeros only where the copy below does not write.
        if before + after > 0 {
            self.commands.push(Command::Memset {
                dst,
                bytes,
                byte: 0,
            });
        }
        let (root, view) = self.source(ins[0]);
        let l = view
            .place_into(&dims(y), *axis, *before)
            .map_err(|m| self.err(y, m))?;
        let src = self.at(root)?;
        self.copy(y, src, dst, l)?;
        Ok(())
    }

    pub(crate) fn cast(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let y = node.outputs[0];
        let dt = |v: Value| g.ty(v).dtype;
        let numel = |v: Value| g.ty(v).shape.numel().unwrap_or(0);
        let Op::Cast { to } = &node.op else {
            return Err(self.err(y, "not a cast node"));
        };
        // Float-to-float casts are pointwise kernels; these involve ints or bools.
        let from = dt(ins[0]);
        let n = numel(y);
        let (x, out) = (self.at(ins[0])?, self.out(y)?);
        if from == *to {
            let bytes = crate::cuda::lower::bytes_of(g.ty(y), g.name(y))?;
            self.commands.push(Command::Copy {
                dst: out,
                src: x,
                bytes,
            });
        } else {
            self.launch(
                y,
                KernelId::Layout(Kernel::Cast { from, to: *to }),
                grid_1d(n, BLOCK),
                (BLOCK, 1, 1),
                vec![
                    ("x", Arg::Ptr(x)),
                    ("y", Arg::Ptr(out)),
                    ("n", Arg::I64(n as i64)),
                ],
            )?;
        }
        Ok(())
    }

    pub(crate) fn fill(&mut self, n: Node) -> Result<(), LowerError> {
        let g = self.g;
        let node = g.node(n);
        let y = node.outputs[0];
        let numel = |v: Value| g.ty(v).shape.numel().unwrap_or(0);
        let Op::Full { value, dtype, .. } = &node.op else {
            return Err(self.err(y, "not a fill node"));
        };
        let n = numel(y);
        let (bytes, bits) = match dtype {
            DType::F32 => (4, Arg::U32((*value as f32).to_bits())),
            DType::F16 => (2, Arg::U16(half::f16::from_f64(*value).to_bits())),
            DType::BF16 => (2, Arg::U16(half::bf16::from_f64(*value).to_bits())),
            DType::I64 => (8, Arg::U64(*value as i64 as u64)),
            DType::I32 => (4, Arg::U32(*value as i32 as u32)),
            DType::Bool => (1, Arg::U32(u32::from(*value != 0.0))),
            DType::U8 => (1, Arg::U32(u32::from(*value as u8))),
            DType::F8E4M3 | DType::F8E5M2 => {
                return Err(self.err(y, format!("no CUDA fill of {dtype} values yet")));
            }
        };
        let out = self.out(y)?;
        self.launch(
            y,
            KernelId::Layout(Kernel::Fill { bytes }),
            grid_1d(n, BLOCK),
            (BLOCK, 1, 1),
            vec![
                ("dst", Arg::Ptr(out)),
                ("n", Arg::I64(n as i64)),
                ("value", bits),
            ],
        )?;
        Ok(())
    }
}

/// `l` (a copy of `size`-byte elements) as a copy of 16-byte units, when that is the same
/// copy: the innermost dim contiguous on both sides and a whole number of units long, every
/// other stride (of a dim longer than one), both offsets and both places' byte offsets multiples of 16 bytes (buffers
/// start 256-byte aligned). One thread then moves 16 bytes with one index decomposition
/// instead of one element.
fn in_units_of_16_bytes(l: &CopyLayout, size: usize, src: Place, dst: Place) -> Option<CopyLayout> {
    let rank = l.rank.clamp(0, MAX_RANK as i32) as usize;
    let size = size as i64;
    if rank == 0 || size >= 16 || 16 % size != 0 {
        return None;
    }
    let per = 16 / size;
    let last = rank - 1;
    let aligned = |elements: i64| (elements * size) % 16 == 0;
    let place_aligned = |p: Place| match p {
        Place::Arena { offset } | Place::Slot { offset, .. } | Place::Buffer { offset, .. } => {
            offset % 16 == 0
        }
    };
    let fits = l.src_stride[last] == 1
        && l.dst_stride[last] == 1
        && l.shape[last] % per == 0
        && (0..last)
            .all(|k| l.shape[k] == 1 || aligned(l.src_stride[k]) && aligned(l.dst_stride[k]))
        && aligned(l.src_offset)
        && aligned(l.dst_offset)
        && place_aligned(src)
        && place_aligned(dst);
    if !fits {
        return None;
    }
    let mut wide = *l;
    wide.shape[last] /= per;
    for k in 0..last {
        // A dim of one element never steps: its stride may be anything, and reads as 0.
        let one = l.shape[k] == 1;
        wide.src_stride[k] = if one { 0 } else { l.src_stride[k] / per };
        wide.dst_stride[k] = if one { 0 } else { l.dst_stride[k] / per };
    }
    wide.src_offset /= per;
    wide.dst_offset /= per;
    Some(wide)
}
