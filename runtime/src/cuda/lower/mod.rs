//! Lowering: a graph or training plan to a [`Program`] of device commands.
//!
//! Per graph (one [`Run`]):
//! 1. **Units.** The fusion pass's kernel units (a plan's own, checked by
//!    [`castor_passes::fusion::schedule`]; for a single graph, the pass run on it) each run
//!    where their last member stands: pointwise units as kernels printed from their typed
//!    bodies (`pointwise.rs`), norm units as norm kernels with their absorbed add, optimizer
//!    batches as one multi-tensor launch. Every other non-source node is a unit of its own.
//!    Values made and read only inside a unit get no buffer.
//! 2. **Places.** Sources and values written to state live in persistent slots (updates are in
//!    place when that is safe, else computed in the arena and copied at the end of the run);
//!    graph outputs get slots of their own so they outlive the arena's next use; a `reshape`
//!    is a view of its operand; everything else, and each kernel's scratch (norm statistics
//!    kept for the backward, partial sums), is an arena buffer with a live range in units.
//! 3. **Arena.** The ranges are placed by the memory planner's best fit
//!    ([`castor_passes::memory::place_buffers`]), all 256-byte aligned.
//! 4. **Commands.** Each unit becomes kernel launches of a kernel family's `.cu` files
//!    (`super::families`) or of a generated module, a cuBLAS product, copies or memsets (see
//!    `ops.rs`).

pub(crate) mod copies;
pub(crate) mod gemm;
mod lowerer;
pub(crate) mod ops;
mod places;
pub(crate) mod views;

pub(crate) use lowerer::bytes_of;
use lowerer::Lowerer;
pub(crate) use views::{layout_views, Storage};

use super::kernel_id::KernelId;
use super::program::{Arg, Command, ErrorFlag, FlagKind, Place, Program, Run, SlotKind};
use castor_ir::{DType, Graph, KernelUnit, Node, Op, StateRole, TrainingPlan, UnitKind, Value};
use castor_passes::fusion::{self, UnitSchedule};
use std::collections::HashMap;

/// Why a graph cannot run on the CUDA executor.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("node `%{node}`: {message}")]
pub struct LowerError {
    pub node: String,
    pub message: String,
}

/// FP8 values on CUDA are made by `quantize` (`families/fp8`), read by `fp8_matmul`
/// (cuBLASLt's FP8 products), moved by layout ops as bytes, or bound as sources: any other
/// op with an FP8 operand or result (a plain `cast` to FP8, a pointwise op on FP8 values) has
/// no CUDA kernel and is refused before lowering starts, naming its first result (the CPU
/// executor runs it).
pub(crate) fn refuse_fp8(g: &Graph) -> Result<(), LowerError> {
    for (_, node) in g.nodes() {
        let fp8_op = matches!(
            node.op,
            Op::Quantize { .. }
                | Op::Fp8MatMul { .. }
                | Op::Input
                | Op::Param
                | Op::State
                | Op::Reshape { .. }
                | Op::Transpose { .. }
                | Op::Slice { .. }
                | Op::Split { .. }
                | Op::Concat { .. }
                | Op::BroadcastTo { .. }
        );
        let fp8 = node
            .inputs
            .iter()
            .chain(&node.outputs)
            .map(|&v| g.ty(v))
            .find(|t| t.dtype.is_fp8());
        if let (false, Some(ty), Some(&y)) = (fp8_op, fp8, node.outputs.first()) {
            return Err(LowerError {
                node: g.name(y).into(),
                message: format!(
                    "`{}` with a {ty} value has no CUDA kernel: on CUDA, FP8 values are made by \
                     `quantize` and read by `fp8_matmul` (the CPU executor runs it)",
                    node.op.mnemonic()
                ),
            });
        }
    }
    Ok(())
}

/// A launch's arguments by kernel parameter name.
pub(crate) type Args = Vec<(&'static str, Arg)>;

/// Names of the runs of a lowered training plan.
pub const ZERO_GRADS: &str = "zero_grads";
pub const MICRO_STEP: &str = "micro_step";
pub const OPTIMIZER_STEP: &str = "optimizer_step";
/// The run of a lowered single graph.
pub const FORWARD: &str = "graph";

/// Lowers a training plan: runs `zero_grads` (only when gradients accumulate over several
/// micro-batches), `micro_step` and `optimizer_step`, sharing the state slots.
pub fn lower_plan(plan: &TrainingPlan) -> Result<Program, LowerError> {
    lower_step(
        plan,
        &plan.micro_step,
        plan.units_of(MICRO_STEP),
        plan.units_of(OPTIMIZER_STEP),
    )
}

/// Lowers `plan` with `micro_step` (and its kernel units) in place of its own micro step:
/// what the memory model lowers for a candidate the remat pass weighs.
pub fn lower_step(
    plan: &TrainingPlan,
    micro_step: &Graph,
    micro_units: Vec<KernelUnit>,
    optimizer_units: Vec<KernelUnit>,
) -> Result<Program, LowerError> {
    let mut l = Lowerer::default();
    for spec in &plan.state {
        l.slot(&spec.name, SlotKind::Bound(spec.ty.clone()), &spec.name)?;
    }
    if plan.settings.grad_accum > 1 {
        let mut commands = Vec::new();
        for spec in plan.state.iter().filter(|s| s.role == StateRole::Gradient) {
            let slot = l.slot(&spec.name, SlotKind::Bound(spec.ty.clone()), &spec.name)?;
            commands.push(Command::Memset {
                dst: Place::Slot { slot, offset: 0 },
                bytes: bytes_of(&spec.ty, &spec.name)?,
                byte: 0,
            });
        }
        l.program.runs.push(Run {
            name: ZERO_GRADS.into(),
            commands,
            ..Run::default()
        });
    }
    let stored = |writes: &[castor_ir::Write]| -> HashMap<String, String> {
        writes
            .iter()
            .map(|w| (w.output.clone(), w.state.clone()))
            .collect()
    };
    l.lower_run(
        micro_step,
        MICRO_STEP,
        micro_units,
        &stored(&plan.micro_step_writes),
    )?;
    l.lower_run(
        &plan.optimizer_step,
        OPTIMIZER_STEP,
        optimizer_units,
        &stored(&plan.optimizer_step_writes),
    )?;
    Ok(l.program)
}

/// Lowers one graph (a forward pass, a test graph): inputs are input slots, params and state
/// bound slots, every output a slot of its own. Its kernel units are the fusion pass's.
pub fn lower_graph(graph: &Graph) -> Result<Program, LowerError> {
    let mut l = Lowerer::default();
    let units = fusion::kernel_units(graph, FORWARD);
    l.lower_run(graph, FORWARD, units, &HashMap::new())?;
    Ok(l.program)
}

/// The schedule of `units` over `g`, or why they cannot run.
pub(crate) fn unit_schedule(g: &Graph, units: Vec<KernelUnit>) -> Result<UnitSchedule, LowerError> {
    fusion::schedule(g, units).map_err(|e| LowerError {
        node: g.name.clone(),
        message: e.to_string(),
    })
}

/// The module holding every generated (fused pointwise) kernel of a program.
pub const GENERATED_MODULE: &str = "fused.cu";

/// A value's location while lowering.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Loc {
    Unset,
    /// Made and read inside one fused kernel: no buffer.
    InKernel,
    At(Place),
}

/// Statistics a forward kernel keeps for its backward (norm mean/rstd, cross-entropy row max
/// and inverse sum and count), found by the backward through its operands.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Saved {
    pub(crate) a: Place,
    pub(crate) b: Place,
    pub(crate) count: Option<Place>,
}

pub(crate) struct RunLowering<'l, 'g> {
    pub(crate) l: &'l mut Lowerer,
    pub(crate) g: &'g Graph,
    pub(crate) run: String,
    pub(crate) stored: &'g HashMap<String, String>,
    pub(crate) users: Vec<Vec<Node>>,
    /// Each node's place in the run (sources: 0); a kernel unit's members share one.
    pub(crate) unit_of: Vec<usize>,
    /// The kernel units (see [`castor_passes::fusion`]), each run at its last member.
    pub(crate) schedule: UnitSchedule,
    /// Per value: the last unit that reads it or any view of it (for view roots).
    pub(crate) end_of: Vec<usize>,
    /// Per value: the value whose buffer it shares (itself unless a view).
    pub(crate) root: Vec<Value>,
    /// Per layout result: the buffer (a value with its own storage) and the view of it.
    pub(crate) views: Vec<Option<(Value, copies::View)>>,
    pub(crate) storage: Vec<Storage>,
    pub(crate) loc: Vec<Loc>,
    /// Arena requests: (bytes, first unit, last unit).
    pub(crate) buffers: Vec<(u64, usize, usize)>,
    pub(crate) commands: Vec<Command>,
    /// Values computed in the arena that must be copied into their state slot at the end.
    pub(crate) late_writes: Vec<(Place, Place, u64)>,
    pub(crate) saved: HashMap<(Value, Value), Saved>,
    /// The unit of the backward node that reads a forward node's saved statistics.
    pub(crate) saved_until: HashMap<(Value, Value), usize>,
    pub(crate) flags: Vec<ErrorFlag>,
    pub(crate) tables_before: usize,
    pub(crate) unit: usize,
    pub(crate) units: usize,
    /// The micro step's gradient reductions that run on the side stream: by node, the side
    /// event each records and the unit before which the compute stream joins it.
    pub(crate) side: HashMap<Node, (usize, usize)>,
    /// Side events issued and not joined yet, with their join units.
    pub(crate) pending: Vec<(usize, usize)>,
    /// The dequantization factors of the FP8 products whose factors are made already (by an
    /// earlier product's batch), by product node.
    pub(crate) fp8_factors: HashMap<Node, Place>,
    /// FP8 operands copied with their last two dims swapped, by the elements they hold (buffer
    /// value, view offset, dims and strides), each an arena buffer live until its last reader.
    pub(crate) fp8_swapped: HashMap<(Value, i64, Vec<usize>, Vec<i64>), Place>,
}

impl<'l, 'g> RunLowering<'l, 'g> {
    fn new(
        l: &'l mut Lowerer,
        g: &'g Graph,
        run: &str,
        schedule: UnitSchedule,
        stored: &'g HashMap<String, String>,
    ) -> Result<Self, LowerError> {
        let users = g.users();
        let unit_of = schedule.step_of.clone();
        let units = schedule.steps;
        // Layout results as views of the buffer they read: kept virtual when only other
        // layout ops read them (the chain is copied once, composed), aliased when their
        // elements are contiguous, else copied into a buffer of their own.
        let (views, storage) = layout_views(g, &users, stored);
        let root: Vec<Value> = (0..g.num_values())
            .map(|i| match (&views[i], storage[i]) {
                (Some((r, _)), s) if s.is_view() => *r,
                _ => Value(i as u32),
            })
            .collect();
        let mut end_of = vec![0usize; g.num_values()];
        for (v, data) in g.values() {
            let produced = unit_of[data.producer.index()];
            let read = users[v.index()]
                .iter()
                .map(|u| unit_of[u.index()])
                .max()
                .unwrap_or(produced);
            let r = root[v.index()].index();
            end_of[r] = end_of[r].max(read).max(produced);
        }
        // Forward statistics live until their backward reads them.
        let mut saved_until = HashMap::new();
        for (n, node) in g.nodes() {
            let key = match node.op {
                Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. } => {
                    (node.inputs[0], node.inputs[1])
                }
                Op::CrossEntropyGrad { .. } => (node.inputs[0], node.inputs[1]),
                Op::LinearCrossEntropyGrad { .. } => (node.inputs[0], node.inputs[2]),
                _ => continue,
            };
            let e = saved_until.entry(key).or_insert(0usize);
            *e = (*e).max(unit_of[n.index()]);
        }
        // A gradient's reduction in the micro step runs on the side stream, overlapping the
        // rest of the backward. The compute stream joins it before the first unit that reads
        // its result or the next reduction's (one in flight at a time), so its operand is
        // kept alive until then and nothing else reuses that memory meanwhile.
        let mut side = HashMap::new();
        if run == MICRO_STEP {
            let reductions: Vec<Node> = g
                .nodes()
                .filter(|(_, d)| matches!(d.op, Op::AllReduce { .. } | Op::ReduceScatter { .. }))
                .map(|(n, _)| n)
                .collect();
            for (k, &n) in reductions.iter().enumerate() {
                let out = g.node(n).outputs[0];
                let first_reader = users[out.index()]
                    .iter()
                    .map(|u| unit_of[u.index()])
                    .min()
                    .unwrap_or(units + 1);
                let next = reductions
                    .get(k + 1)
                    .map_or(units + 1, |m| unit_of[m.index()]);
                let join = first_reader.min(next).min(units + 1);
                let src = root[g.node(n).inputs[0].index()].index();
                end_of[src] = end_of[src].max(join.min(units));
                side.insert(n, (k, join));
            }
        }
        let tables_before = l.program.tables.len();
        Ok(RunLowering {
            l,
            g,
            run: run.into(),
            stored,
            users,
            unit_of,
            schedule,
            end_of,
            root,
            views,
            storage,
            loc: vec![Loc::Unset; g.num_values()],
            buffers: Vec::new(),
            commands: Vec::new(),
            late_writes: Vec::new(),
            saved: HashMap::new(),
            saved_until,
            flags: Vec::new(),
            tables_before,
            unit: 0,
            units,
            side,
            pending: Vec::new(),
            fp8_factors: HashMap::new(),
            fp8_swapped: HashMap::new(),
        })
    }

    /// Joins the side events due by unit `unit` (all of them at the end of the run).
    pub(crate) fn join_side(&mut self, unit: usize) {
        let (due, rest): (Vec<_>, Vec<_>) = self.pending.iter().partition(|(_, j)| *j <= unit);
        self.pending = rest;
        if !due.is_empty() {
            let events = due.into_iter().map(|(k, _)| k).collect();
            self.commands.push(Command::Join { events });
        }
    }

    pub(crate) fn err(&self, v: Value, message: impl Into<String>) -> LowerError {
        LowerError {
            node: self.g.name(v).into(),
            message: message.into(),
        }
    }

    /// Slots for sources (params, state, inputs) and param copies.
    fn assign_sources(&mut self) -> Result<(), LowerError> {
        let g = self.g;
        for (_, node) in g.nodes() {
            let v = match node.outputs.first() {
                Some(&v) => v,
                None => continue,
            };
            let name = g.name(v).to_string();
            let ty = g.ty(v).clone();
            let slot = match node.op {
                Op::Param | Op::State => self.l.slot(&name, SlotKind::Bound(ty), &name)?,
                Op::Input => self.l.slot(&name, SlotKind::Input(ty), &name)?,
                Op::ParamCopy { to } => self.param_copy(node.inputs[0], v, to)?,
                _ => continue,
            };
            self.loc[v.index()] = Loc::At(Place::Slot { slot, offset: 0 });
        }
        Ok(())
    }

    /// The slot of a parameter's working copy; the prologue fills it from the master (a
    /// training plan's optimizer rewrites it with every update).
    fn param_copy(&mut self, master: Value, copy: Value, to: DType) -> Result<usize, LowerError> {
        let g = self.g;
        let name = g.name(copy).to_string();
        if let Some(&s) = self.l.copies.get(&name) {
            return Ok(s);
        }
        let ty = g.ty(copy).clone();
        let slot = self.l.slot(&name, SlotKind::Bound(ty.clone()), &name)?;
        let master_name = g.name(master).to_string();
        let mslot = self.l.slot(
            &master_name,
            SlotKind::Bound(g.ty(master).clone()),
            &master_name,
        )?;
        let n = ty.shape.numel().unwrap_or(0);
        let from = g.ty(master).dtype;
        if from != to {
            let cmd = self.l.kernel(
                &name,
                KernelId::Layout(crate::cuda::families::layout::Kernel::Cast { from, to }),
                grid_1d(n, 256),
                (256, 1, 1),
                0,
                vec![
                    (
                        "x",
                        Arg::Ptr(Place::Slot {
                            slot: mslot,
                            offset: 0,
                        }),
                    ),
                    ("y", Arg::Ptr(Place::Slot { slot, offset: 0 })),
                    ("n", Arg::I64(n as i64)),
                ],
            )?;
            self.l.program.prologue.push(cmd);
        } else {
            self.l.program.prologue.push(Command::Copy {
                dst: Place::Slot { slot, offset: 0 },
                src: Place::Slot {
                    slot: mslot,
                    offset: 0,
                },
                bytes: bytes_of(&ty, &name)?,
            });
        }
        self.l.copies.insert(name, slot);
        Ok(slot)
    }

    fn emit_all(&mut self) -> Result<(), LowerError> {
        let g = self.g;
        for (n, node) in g.nodes() {
            if node.op.is_source() {
                continue;
            }
            self.unit = self.unit_of[n.index()];
            self.join_side(self.unit);
            if let Some(ui) = self.schedule.unit_of[n.index()] {
                if self.schedule.members[ui].last() == Some(&n) {
                    let members = self.schedule.members[ui].clone();
                    match &self.schedule.units[ui].kind {
                        UnitKind::Pointwise(body) => {
                            let body = body.clone();
                            let name = format!("{}_{}", self.run, self.schedule.units[ui].name);
                            self.pointwise(&members, &body, &name)?;
                        }
                        UnitKind::OptimizerBatch => self.optimizer(&members)?,
                        UnitKind::AmaxHistoryBatch => self.amax_histories(&members)?,
                        UnitKind::NormPrologue => {
                            if let Some((&n, prologue)) = members.split_last() {
                                self.norm_unit(n, prologue, None)?
                            }
                        }
                        UnitKind::NormFp8 => self.norm_fp8_unit(&members)?,
                        UnitKind::NormEpilogue => self.norm_grad_unit(
                            members[0],
                            Some((members[1], members.get(2).copied())),
                        )?,
                    }
                }
                continue;
            }
            self.node(n)?;
        }
        Ok(())
    }

    /// An error flag (an `int` slot reset to `INT_MAX` before the run).
    pub(crate) fn flag(
        &mut self,
        node: Value,
        what: &'static str,
        indices: Place,
        limit: usize,
        ignore: Option<i64>,
    ) -> Place {
        self.chunk_flag(node, what, (indices, 0), limit, ignore)
    }

    /// An error flag for key-padding flags in rows of `keys` bytes at `flags`, which must be
    /// right-padded ([`FlagKind::RightPadded`]): one per mask and run (every layer's passes
    /// read the same mask, and report it by the first pass's node).
    pub(crate) fn padding_flag(&mut self, node: Value, flags: Place, keys: usize) -> Place {
        let same = |f: &&ErrorFlag| {
            f.kind == FlagKind::RightPadded && f.indices == flags && f.limit == keys
        };
        if let Some(f) = self.flags.iter().find(same) {
            return f.place;
        }
        let name = format!("{}.flag.{}.padding", self.run, self.g.name(node));
        let slot = self.l.internal(&name, 4);
        let place = Place::Slot { slot, offset: 0 };
        self.flags.push(ErrorFlag {
            node: self.g.name(node).into(),
            kind: FlagKind::RightPadded,
            what: "key-padding flag",
            place,
            indices: flags,
            limit: keys,
            ignore: None,
            first: 0,
        });
        place
    }

    /// An error flag for the indices of one chunk, which starts at position `first` of the
    /// whole index tensor: a flag of its own, whose reported positions count from `first`.
    pub(crate) fn chunk_flag(
        &mut self,
        node: Value,
        what: &'static str,
        (indices, first): (Place, usize),
        limit: usize,
        ignore: Option<i64>,
    ) -> Place {
        let mut name = format!("{}.flag.{}", self.run, self.g.name(node));
        if first > 0 {
            name.push_str(&format!(".from{first}"));
        }
        let slot = self.l.internal(&name, 4);
        let place = Place::Slot { slot, offset: 0 };
        self.flags.push(ErrorFlag {
            node: self.g.name(node).into(),
            kind: FlagKind::Range,
            what,
            place,
            indices,
            limit,
            ignore,
            first,
        });
        place
    }

    pub(crate) fn launch(
        &mut self,
        v: Value,
        kernel: KernelId,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Args,
    ) -> Result<(), LowerError> {
        self.launch_shared(v, kernel, grid, block, 0, args)
    }

    /// [`Self::launch`] with dynamic shared memory.
    pub(crate) fn launch_shared(
        &mut self,
        v: Value,
        kernel: KernelId,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        args: Args,
    ) -> Result<(), LowerError> {
        let node = self.g.name(v).to_string();
        let cmd = self
            .l
            .kernel(&node, kernel, grid, block, shared_bytes, args)?;
        self.commands.push(cmd);
        Ok(())
    }
}

/// A sliding attention window as a kernel argument: its length, 0 for none.
pub(crate) fn window_arg(window: Option<usize>) -> i32 {
    window.map_or(0, |w| w.min(i32::MAX as usize) as i32)
}

/// A 1-D grid-stride launch over `work` items.
pub(crate) fn grid_1d(work: usize, block: u32) -> (u32, u32, u32) {
    let blocks = work.div_ceil(block as usize).clamp(1, 65_535 * 4);
    (blocks as u32, 1, 1)
}

/// One block per row (grid-stride over rows).
pub(crate) fn grid_rows(rows: usize) -> (u32, u32, u32) {
    (rows.clamp(1, 65_535 * 4) as u32, 1, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(args: Args) -> Result<Command, LowerError> {
        Lowerer::default().kernel(
            "x",
            KernelId::Layout(crate::cuda::families::layout::Kernel::Fill { bytes: 4 }),
            (1, 1, 1),
            (32, 1, 1),
            0,
            args,
        )
    }

    /// Launch arguments are given by the kernel's parameter names and kinds, and put in the
    /// kernel's order.
    #[test]
    fn launches_take_their_arguments_by_name() {
        let dst = Arg::Ptr(Place::Arena { offset: 0 });
        let ok = fill(vec![
            ("value", Arg::U32(7)),
            ("dst", dst.clone()),
            ("n", Arg::I64(1)),
        ])
        .unwrap();
        let Command::Launch(l) = ok else {
            panic!("not a launch")
        };
        assert_eq!(l.args, vec![dst.clone(), Arg::I64(1), Arg::U32(7)]);
        let e = fill(vec![
            ("dst", dst.clone()),
            ("n", Arg::I64(1)),
            ("valu", Arg::U32(7)),
        ])
        .unwrap_err();
        assert!(e.message.contains("no parameter `valu`"), "{e}");
        let e = fill(vec![("dst", dst.clone()), ("n", Arg::I64(1))]).unwrap_err();
        assert!(e.message.contains("`value` is not given"), "{e}");
        let e = fill(vec![
            ("dst", dst),
            ("n", Arg::I32(1)),
            ("value", Arg::U32(7)),
        ])
        .unwrap_err();
        assert!(e.message.contains("takes `n` as an i64"), "{e}");
    }
}
