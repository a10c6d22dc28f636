//! Where a run's values live: operands' places, each result's place (its state slot, in place
//! when no reader can see the change; its output slot; or an arena buffer live until its last
//! reader), kernel scratch, and at the end of the run the arena placed and every place
//! resolved to an offset.

use super::super::program::{Arg, BufferId, Command, Field, Output, Place, Run, SlotKind};
use super::{bytes_of, copies, Loc, LowerError, RunLowering, Storage};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{Node, Op, Value};
use castor_passes::fusion;
use castor_passes::memory::{place_buffers, Buffer};

impl RunLowering<'_, '_> {
    /// The place of an operand (already made).
    pub(crate) fn at(&self, v: Value) -> Result<Place, LowerError> {
        match self.loc[v.index()] {
            Loc::At(p) => Ok(p),
            _ => Err(self.err(v, "read before it is made (a lowering bug)")),
        }
    }

    /// The place a node writes `v` to: its state slot (in place when safe), its output slot,
    /// a view's root, or a new arena buffer live until its last reader.
    pub(crate) fn out(&mut self, v: Value) -> Result<Place, LowerError> {
        if let Loc::At(p) = self.loc[v.index()] {
            return Ok(p);
        }
        let g = self.g;
        let name = g.name(v).to_string();
        let ty = g.ty(v).clone();
        let bytes = bytes_of(&ty, &name)?;
        let place = if let Some(state) = self.stored.get(&name) {
            let slot = self.l.slot(state, SlotKind::Bound(ty.clone()), &name)?;
            let target = Place::Slot { slot, offset: 0 };
            if self.in_place_is_safe(v, state) {
                target
            } else {
                let p = self.arena(bytes, self.units);
                self.late_writes.push((target, p, bytes));
                p
            }
        } else if g.outputs().contains(&v) {
            let slot = self.l.internal(&format!("{}.out.{name}", self.run), bytes);
            Place::Slot { slot, offset: 0 }
        } else {
            let end = self.end_of[self.root[v.index()].index()];
            self.arena(bytes, end)
        };
        self.loc[v.index()] = Loc::At(place);
        Ok(place)
    }

    /// True when writing `v` straight into `state`'s slot cannot change what any reader of
    /// the old state value sees: no reader after `v`'s unit, and within the unit only
    /// element-for-element readers (pointwise kernels over the same shape, the optimizer and
    /// step kernels and `fp8_amax_history`, which are written for in-place updates).
    pub(crate) fn in_place_is_safe(&self, v: Value, state: &str) -> bool {
        let g = self.g;
        let Some(old) = g.lookup(state) else {
            return true;
        };
        let unit = self.unit_of[g.value(v).producer.index()];
        self.readers(old).into_iter().all(|u| {
            let uu = self.unit_of[u.index()];
            if uu < unit {
                return true;
            }
            if uu > unit {
                return false;
            }
            let node = g.node(u);
            match node.op {
                Op::CountStep | Op::LossScaleUpdate { .. } | Op::AmaxHistory { .. } => true,
                _ if node.op.updates_parameter() => true,
                _ => fusion::is_pointwise(g, u) && g.ty(old).shape == g.ty(node.outputs[0]).shape,
            }
        })
    }

    /// The nodes that read `v`'s buffer: its users, and through layout results that are
    /// views of it (virtual or aliased), the users of those.
    pub(crate) fn readers(&self, v: Value) -> Vec<Node> {
        let g = self.g;
        let mut out = Vec::new();
        let mut todo = vec![v];
        while let Some(x) = todo.pop() {
            for &u in &self.users[x.index()] {
                let views: Vec<Value> = g
                    .node(u)
                    .outputs
                    .iter()
                    .copied()
                    .filter(|o| self.storage[o.index()] != Storage::Own)
                    .collect();
                if views.is_empty() {
                    out.push(u);
                } else {
                    todo.extend(views);
                }
            }
        }
        out
    }

    /// Where `x`'s elements are read from: its buffer's value and the view of it.
    pub(crate) fn source(&self, x: Value) -> (Value, copies::View) {
        match (&self.views[x.index()], self.storage[x.index()]) {
            (Some((r, v)), s) if s.is_view() => (*r, v.clone()),
            _ => (x, copies::View::contiguous(self.g.ty(x).shape.dims())),
        }
    }

    /// A scratch or value buffer in the arena from this unit to `end`.
    pub(crate) fn arena(&mut self, bytes: u64, end: usize) -> Place {
        self.buffers
            .push((bytes.max(1), self.unit, end.max(self.unit)));
        Place::Buffer {
            buffer: BufferId((self.buffers.len() - 1) as u32),
            offset: 0,
        }
    }

    /// Scratch used only inside this unit.
    pub(crate) fn scratch(&mut self, bytes: u64) -> Place {
        self.arena(bytes, self.unit)
    }
    /// Resolves arena tags to offsets, adds the end-of-run copies and the flag resets.
    pub(crate) fn finish(mut self) -> Result<Run, LowerError> {
        self.join_side(usize::MAX);
        for (dst, src, bytes) in std::mem::take(&mut self.late_writes) {
            self.commands.push(Command::Copy { dst, src, bytes });
        }
        let len = self.units + 1;
        let bufs: Vec<Buffer> = self
            .buffers
            .iter()
            .enumerate()
            .map(|(i, &(size, start, end))| Buffer {
                graph: 0,
                value: Value(i as u32),
                size: castor_passes::memory::align(size),
                start,
                end,
                offset: 0,
            })
            .collect();
        let plan = place_buffers(bufs, len);
        if plan.buffers.len() != self.buffers.len() {
            return Err(LowerError {
                node: self.g.name.clone(),
                message: "the arena placement lost a buffer (a lowering bug)".into(),
            });
        }
        let mut offsets = vec![0u64; self.buffers.len()];
        for b in &plan.buffers {
            offsets[b.value.index()] = b.offset;
        }
        let program = &mut self.l.program;
        if plan.arena_bytes >= program.arena_bytes {
            program.arena_bytes = plan.arena_bytes;
            program.arena_lower_bound = plan.lower_bound;
            program.arena_order = Some(plan.order);
        }
        let resolve = |p: Place| -> Place {
            match p {
                // Ids are indices of `self.buffers`, every one placed (checked above).
                Place::Buffer { buffer, offset } => Place::Arena {
                    offset: offsets[buffer.0 as usize] + offset,
                },
                other => other,
            }
        };
        // Flags reset first, as part of the run.
        let mut commands: Vec<Command> = Vec::new();
        for f in &self.flags {
            let cmd = self.l.kernel(
                &f.node,
                KernelId::Layout(crate::cuda::families::layout::Kernel::Fill { bytes: 4 }),
                (1, 1, 1),
                (32, 1, 1),
                0,
                vec![
                    ("dst", Arg::Ptr(f.place)),
                    ("n", Arg::I64(1)),
                    ("value", Arg::U32(i32::MAX as u32)),
                ],
            )?;
            commands.push(cmd);
        }
        commands.append(&mut self.commands);
        for c in &mut commands {
            map_places(c, &resolve);
        }
        for t in &mut self.l.program.tables[self.tables_before..] {
            for f in t.fields_mut() {
                if let Field::Ptr(p) = f {
                    *p = resolve(*p);
                }
            }
        }
        let mut flags = std::mem::take(&mut self.flags);
        for f in &mut flags {
            f.indices = resolve(f.indices);
        }
        let g = self.g;
        let mut outputs = Vec::new();
        for &v in g.outputs() {
            let place = match self.loc[v.index()] {
                Loc::At(p) => resolve(p),
                _ => return Err(self.err(v, "a graph output has no buffer (a lowering bug)")),
            };
            outputs.push(Output {
                name: g.name(v).into(),
                ty: g.ty(v).clone(),
                place,
            });
        }
        Ok(Run {
            name: self.run.clone(),
            commands,
            outputs,
            error_flags: flags,
        })
    }
}

fn map_places(c: &mut Command, f: &dyn Fn(Place) -> Place) {
    match c {
        Command::Launch(l) => {
            for a in &mut l.args {
                if let Arg::Ptr(p) = a {
                    *p = f(*p);
                }
            }
        }
        Command::Gemm(gm) => {
            gm.a = f(gm.a);
            gm.b = f(gm.b);
            gm.c = f(gm.c);
            gm.epilogue = gm.epilogue.map(f);
            if let Some(s) = &mut gm.fp8 {
                s.a_scale = f(s.a_scale);
                s.b_scale = f(s.b_scale);
            }
        }
        Command::Copy { dst, src, .. } => {
            *dst = f(*dst);
            *src = f(*src);
        }
        Command::Memset { dst, .. } => *dst = f(*dst),
        Command::Collective { dst, src, .. } => {
            *dst = f(*dst);
            *src = f(*src);
        }
        Command::Join { .. } => {}
        Command::Sdpa(call) => call.map_places(&mut |p| f(p), &mut |fallback| {
            for c in fallback {
                map_places(c, f);
            }
        }),
    }
}
