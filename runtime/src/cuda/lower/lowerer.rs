//! The program being built, run by run: its slots by name, its modules (hand-written kernel
//! files once each; generated kernels in one module, deduplicated), launches checked against
//! the kernels' signatures, and argument tables.

use super::super::program::{
    Arg, Command, GeneratedKernel, InputExtent, Launch, Module, Place, Program, Slot, SlotKind,
    Table,
};
use super::{unit_schedule, Args, LowerError, RunLowering, GENERATED_MODULE};
use crate::cuda::kernel_id::KernelId;
use castor_ir::{Graph, KernelUnit, PointwiseBody, TensorType};
use std::collections::HashMap;

/// True if `arg` can be passed for a parameter of `kind`.
fn arg_fits(arg: &Arg, kind: castor_kernels::ParamKind) -> bool {
    use castor_kernels::ParamKind as K;
    matches!(
        (arg, kind),
        (Arg::Ptr(_) | Arg::Null | Arg::Table(_), K::Ptr)
            | (Arg::I32(_), K::I32)
            | (Arg::I64(_), K::I64)
            | (Arg::U16(_), K::U16)
            | (Arg::U32(_), K::U32)
            | (Arg::U64(_), K::U64)
            | (Arg::F64(_), K::F64)
            | (Arg::Layout(_), K::Layout)
    )
}

/// The bytes of a value of type `ty`, or an error naming `name` when the size is not static.
pub(crate) fn bytes_of(ty: &TensorType, name: &str) -> Result<u64, LowerError> {
    ty.size_bytes().map(|b| b as u64).ok_or_else(|| LowerError {
        node: name.into(),
        message: format!("{ty} has no static size"),
    })
}

/// What a generated kernel's code is made of: its body without the names of the values it
/// reads and writes (only comments show them) and without the iteration space's size (a
/// launch argument). Two bodies with the same code key print the same kernel.
fn code_of(body: &PointwiseBody) -> PointwiseBody {
    let mut key = body.clone();
    key.dims.clear();
    key.inputs.iter_mut().for_each(|i| i.value.clear());
    key.outputs.iter_mut().for_each(|o| o.value.clear());
    key.amax.iter_mut().for_each(|a| a.value.clear());
    key
}

/// Builds a program run by run.
#[derive(Default)]
pub(crate) struct Lowerer {
    pub(crate) program: Program,
    pub(crate) modules: HashMap<String, usize>,
    /// Param-copy slots already initialized by the prologue.
    pub(crate) copies: HashMap<String, usize>,
    /// Generated kernels by what their code is made of (see [`Lowerer::generated`]), with
    /// their entry points.
    pub(crate) generated: Vec<(PointwiseBody, String)>,
    /// Slots by name.
    pub(crate) slots: HashMap<String, usize>,
}

impl Lowerer {
    /// The slot `name`, created with `kind` if new.
    pub(crate) fn slot(
        &mut self,
        name: &str,
        kind: SlotKind,
        node: &str,
    ) -> Result<usize, LowerError> {
        if let Some(&i) = self.slots.get(name) {
            return Ok(i);
        }
        let bytes = match &kind {
            SlotKind::Bound(ty) | SlotKind::Input(ty) => bytes_of(ty, node)?,
            SlotKind::Constant(b) => b.len() as u64,
            SlotKind::Internal => 0,
        };
        Ok(self.push_slot(name, bytes, kind))
    }

    /// An internal slot of `bytes` bytes.
    pub(crate) fn internal(&mut self, name: &str, bytes: u64) -> usize {
        match self.slots.get(name) {
            Some(&i) => i,
            None => self.push_slot(name, bytes, SlotKind::Internal),
        }
    }

    /// `count` zeroed ints for the block handoffs of one launch (a counter per column block
    /// whose last row group sums the others' partials: `last_to_arrive` in
    /// `castor_common.cuh`). Every such launch shares the one slot, grown to the most any
    /// asks for: launches run one after another on the stream, and each leaves its counters
    /// zero, as the program's load made them.
    pub(crate) fn handoff_counters(&mut self, count: usize) -> Place {
        let bytes = 4 * count.max(1) as u64;
        let slot = self.internal("handoff counters", bytes);
        let s = &mut self.program.slots[slot];
        s.bytes = s.bytes.max(bytes);
        Place::Slot { slot, offset: 0 }
    }

    /// The slot `name`, if it exists.
    pub(crate) fn find_slot(&self, name: &str) -> Option<usize> {
        self.slots.get(name).copied()
    }

    pub(crate) fn push_slot(&mut self, name: &str, bytes: u64, kind: SlotKind) -> usize {
        self.program.slots.push(Slot {
            name: name.into(),
            bytes,
            kind,
        });
        let i = self.program.slots.len() - 1;
        self.slots.insert(name.into(), i);
        i
    }

    /// The module that holds `source`, by name.
    pub(crate) fn module(&mut self, name: &str, source: &str) -> usize {
        if let Some(&i) = self.modules.get(name) {
            return i;
        }
        self.program.modules.push(Module {
            name: name.into(),
            source: source.into(),
            generated: Vec::new(),
        });
        let i = self.program.modules.len() - 1;
        self.modules.insert(name.into(), i);
        i
    }

    /// The module and entry point of a generated kernel. Every generated kernel of the
    /// program goes into one module (one NVRTC compile), and a kernel whose body equals an
    /// earlier one's but for the names of the values it reads and writes (the same group in
    /// every layer) is not added again: its launches use the earlier entry point.
    pub(crate) fn generated(
        &mut self,
        name: &str,
        body: &PointwiseBody,
        source: &str,
        inputs: Vec<InputExtent>,
    ) -> (usize, String) {
        let key = code_of(body);
        let module = match self.modules.get(GENERATED_MODULE) {
            Some(&m) => m,
            None => self.module(GENERATED_MODULE, ""),
        };
        if let Some((_, entry)) = self.generated.iter().find(|(k, _)| *k == key) {
            return (module, entry.clone());
        }
        let m = &mut self.program.modules[module];
        m.source.push_str(source);
        m.source.push('\n');
        m.generated.push(GeneratedKernel {
            entry: name.to_string(),
            inputs,
            partials: body.amax.is_some(),
        });
        self.generated.push((key, name.to_string()));
        (module, name.to_string())
    }

    /// A launch of the hand-written kernel `kernel` with `shared_bytes` of dynamic shared
    /// memory, its arguments given by parameter name (see [`crate::cuda::families::signature`]):
    /// every parameter once, each of its kind.
    pub(crate) fn kernel(
        &mut self,
        node: &str,
        kernel: KernelId,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        args: Args,
    ) -> Result<Command, LowerError> {
        let bad = |message: String| LowerError {
            node: node.into(),
            message,
        };
        let entry = kernel.entry();
        let entry = entry.as_str();
        let file = crate::cuda::families::file_of(entry).ok_or_else(|| {
            bad(format!(
                "no kernel `{entry}` in kernels/ (a dtype combination the kernels do not cover)"
            ))
        })?;
        let sig = crate::cuda::families::signature(entry).map_err(|e| bad(e.to_string()))?;
        for (name, arg) in &args {
            let param = sig.params.iter().find(|p| p.name == *name);
            if let Some(p) = param.filter(|p| !arg_fits(arg, p.kind)) {
                return Err(bad(format!(
                    "`{entry}` takes `{name}` as {}, given {arg:?}",
                    p.kind.name()
                )));
            }
        }
        let args = sig.order(entry, &args).map_err(|e| bad(e.to_string()))?;
        let module = self.module(file.name, file.source);
        Ok(Command::Launch(Launch {
            node: node.into(),
            module,
            kernel: Some(kernel),
            entry: entry.into(),
            grid,
            block,
            shared_bytes,
            args,
        }))
    }

    pub(crate) fn table(&mut self, table: Table) -> usize {
        self.program.tables.push(table);
        self.program.tables.len() - 1
    }

    pub(crate) fn lower_run(
        &mut self,
        g: &Graph,
        run: &str,
        units: Vec<KernelUnit>,
        stored: &HashMap<String, String>,
    ) -> Result<(), LowerError> {
        castor_ir::verify(g).map_err(|e| LowerError {
            node: g.name.clone(),
            message: format!("invalid graph: {e}"),
        })?;
        super::refuse_fp8(g)?;
        let schedule = unit_schedule(g, units)?;
        let mut r = RunLowering::new(self, g, run, schedule, stored)?;
        r.assign_sources()?;
        r.emit_all()?;
        let run = r.finish()?;
        if run.commands.iter().any(|c| matches!(c, Command::Gemm(_))) {
            self.program.workspace_bytes = self
                .program
                .workspace_bytes
                .max(crate::cuda::program::PRODUCT_WORKSPACE);
        }
        self.program.runs.push(run);
        Ok(())
    }
}
