//! The roofline of the program that runs: the plan's graphs costed as the CUDA lowering runs
//! them, kernel unit by kernel unit, rather than node by node.
//!
//! A unit (a fused pointwise group, a norm with its fused residual add, a multi-tensor
//! optimizer batch, a fused attention, a cuBLAS product, any other kernel) takes
//! `max(Σ flops / peak, bytes / bandwidth)`: its members' FLOPs at the peak of the unit that
//! runs each (tensor cores by operand dtype), and the bytes it moves, which are only the values
//! it reads from outside and writes for others, plus the scratch traffic of its chunked ops
//! ([`scratch_bytes`]); values inside a fused kernel move nothing. The copies an FP8 product
//! makes of its operands (cuBLASLt's "TN" form) are kernels of their own: their traffic adds
//! its time to the product's. So does the read of a weight gradient's output gradient by the
//! kernel that sums its bias gradient, where that sum is not in the product's epilogue
//! ([`bias_grad_apart_bytes`]).
//! Layout ops the lowering turns into views (never stored, or aliased) cost nothing. Each
//! command of the lowered program then adds [`LAUNCH_SECONDS`], the gap between kernels
//! inside a CUDA graph.

use super::families::layout::Kernel as LayoutKernel;
use super::kernel_id::KernelId;
use super::lower::{layout_views, lower_plan, unit_schedule, LowerError};
use super::lower::{MICRO_STEP, OPTIMIZER_STEP};
use super::program::{Arg, Command, Program};
use castor_ir::{Graph, Op, OpClass, TrainingPlan, Value};
use castor_passes::cost::{bias_grad_apart_bytes, node_flops, scratch_bytes, GpuSpec, StepCost};
use castor_passes::fusion::UnitSchedule;
use std::collections::{HashMap, HashSet};

/// Seconds per command of a run replayed as a CUDA graph: the launch-to-launch gap between
/// dependent kernels, about a microsecond on Hopper.
pub const LAUNCH_SECONDS: f64 = 1e-6;

/// One run's roofline.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RunRoofline {
    /// Units that do work (views excluded).
    pub units: usize,
    /// Commands of the lowered run (launches, cuBLAS products, copies, memsets).
    pub commands: usize,
    pub flops: f64,
    pub bytes: f64,
    /// Σ per unit of max(compute, memory), then the launch gaps.
    pub seconds: f64,
}

/// The step's program-level roofline.
#[derive(Clone, Debug)]
pub struct ProgramRoofline {
    pub micro_step: RunRoofline,
    pub optimizer_step: RunRoofline,
    pub grad_accum: usize,
    pub tokens: u64,
    /// 6N + 6·L·C·T per token, when the model's shape is known.
    pub rule_flops_per_token: Option<f64>,
    pub gpu: GpuSpec,
}

impl ProgramRoofline {
    pub fn seconds(&self) -> f64 {
        self.micro_step.seconds * self.grad_accum as f64 + self.optimizer_step.seconds
    }

    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.seconds().max(f64::MIN_POSITIVE)
    }

    /// 6N + 6·L·C·T per token over the program's step time, as a fraction of the BF16
    /// tensor-core peak (the node-level figure's definition).
    pub fn mfu(&self) -> Option<f64> {
        let rule = self.rule_flops_per_token?;
        (self.tokens > 0 && self.seconds() > 0.0)
            .then(|| rule * self.tokens as f64 / self.seconds() / self.gpu.low_precision_flops)
    }
}

/// The roofline of `plan` as `lower_plan` runs it on `gpu`.
pub fn program_roofline(plan: &TrainingPlan, gpu: &GpuSpec) -> Result<ProgramRoofline, LowerError> {
    roofline_of(plan, &lower_plan(plan)?, gpu)
}

/// The roofline of `plan` given its lowered `program`, over the plan's kernel units.
pub fn roofline_of(
    plan: &TrainingPlan,
    program: &Program,
    gpu: &GpuSpec,
) -> Result<ProgramRoofline, LowerError> {
    let stored = |writes: &[castor_ir::Write]| -> HashMap<String, String> {
        writes
            .iter()
            .map(|w| (w.output.clone(), w.state.clone()))
            .collect()
    };
    let step = StepCost::of_plan(plan, gpu);
    Ok(ProgramRoofline {
        micro_step: run_roofline(
            &plan.micro_step,
            &unit_schedule(&plan.micro_step, plan.units_of(MICRO_STEP))?,
            &stored(&plan.micro_step_writes),
            program,
            MICRO_STEP,
            gpu,
        ),
        optimizer_step: run_roofline(
            &plan.optimizer_step,
            &unit_schedule(&plan.optimizer_step, plan.units_of(OPTIMIZER_STEP))?,
            &stored(&plan.optimizer_step_writes),
            program,
            OPTIMIZER_STEP,
            gpu,
        ),
        grad_accum: plan.settings.grad_accum.max(1),
        tokens: step.tokens,
        rule_flops_per_token: step.flops_per_token_rule(),
        gpu: gpu.clone(),
    })
}

fn value_bytes(g: &Graph, v: Value) -> f64 {
    g.ty(v).size_bytes().unwrap_or(0) as f64
}

/// The roofline's kernel units of a plan's program, as a kernel profile is set beside them:
/// each unit's seconds, and the unit of each value its nodes compute, by run and value name
/// (the run and node that a lowered command carries). A unit lowered to several commands
/// under several node names (a fused classifier's products and row kernels, a norm's
/// backward and its weight gradient) is one unit here, so that its time is counted once.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UnitTimes {
    /// Each unit's seconds; launch gaps are not included.
    pub seconds: Vec<f64>,
    /// `(run, value name)` to its unit's index in `seconds`.
    pub unit_of: HashMap<(String, String), usize>,
}

impl UnitTimes {
    /// The unit computing value `node` in run `run`, if a working unit does.
    pub fn unit(&self, run: &str, node: &str) -> Option<usize> {
        self.unit_of
            .get(&(run.to_string(), node.to_string()))
            .copied()
    }
}

/// The kernel units of `plan`'s program with their roofline seconds: what a profiled
/// command's kind is compared with.
pub fn unit_times(plan: &TrainingPlan, gpu: &GpuSpec) -> Result<UnitTimes, LowerError> {
    let program = lower_plan(plan)?;
    let stored = |writes: &[castor_ir::Write]| -> HashMap<String, String> {
        writes
            .iter()
            .map(|w| (w.output.clone(), w.state.clone()))
            .collect()
    };
    let mut out = UnitTimes::default();
    for (g, run, writes) in [
        (&plan.micro_step, MICRO_STEP, &plan.micro_step_writes),
        (
            &plan.optimizer_step,
            OPTIMIZER_STEP,
            &plan.optimizer_step_writes,
        ),
    ] {
        let units = unit_schedule(g, plan.units_of(run))?;
        let (_, per_unit) = costed_units(g, &units, &stored(writes), &program, run, gpu);
        for (names, seconds) in per_unit {
            let unit = out.seconds.len();
            out.seconds.push(seconds);
            for name in names {
                out.unit_of.insert((run.to_string(), name), unit);
            }
        }
    }
    Ok(out)
}

/// One graph's units, costed; `run` names its commands in `program`.
pub(crate) fn run_roofline(
    g: &Graph,
    units: &UnitSchedule,
    stored: &HashMap<String, String>,
    program: &Program,
    run: &str,
    gpu: &GpuSpec,
) -> RunRoofline {
    costed_units(g, units, stored, program, run, gpu).0
}

/// [`run_roofline`], and each working unit's value names with its seconds.
fn costed_units(
    g: &Graph,
    units: &UnitSchedule,
    stored: &HashMap<String, String>,
    program: &Program,
    run: &str,
    gpu: &GpuSpec,
) -> (RunRoofline, Vec<(Vec<String>, f64)>) {
    let users = g.users();
    let (views, storage) = layout_views(g, &users, stored);
    // The buffer each value's elements are in.
    let root = |v: Value| match (&views[v.index()], storage[v.index()]) {
        (Some((r, _)), s) if s.is_view() => *r,
        _ => v,
    };
    let outputs: HashSet<Value> = g.outputs().iter().copied().collect();
    // Per unit: compute seconds, FLOPs, the values it reads from outside, the values it writes.
    let n = units.steps;
    let mut compute = vec![0f64; n];
    let mut flops = vec![0f64; n];
    let mut reads: Vec<HashSet<Value>> = vec![HashSet::new(); n];
    let mut writes: Vec<HashSet<Value>> = vec![HashSet::new(); n];
    let mut works = vec![false; n];
    let mut names: Vec<Vec<String>> = vec![Vec::new(); n];
    // Traffic inside a unit's kernels (the fused classifier's chunks).
    let mut scratch = vec![0f64; n];
    // Traffic of kernels that run before or after a unit's product rather than under it: the
    // FP8 operand copies, a bias gradient's sum apart from its product.
    let mut serial = vec![0f64; n];
    for (node_id, node) in g.nodes() {
        // Working copies are state: the prologue fills them and the optimizer's update
        // rewrites them, so a run reads them as it reads any other state.
        if node.op.is_source() || matches!(node.op, Op::ParamCopy { .. }) {
            continue;
        }
        let u = units.step_of[node_id.index()];
        // A layout op moves nothing when its results are views, or when its operands were
        // written into its result in place (`Storage::Into`).
        let is_view = node.op.class() == OpClass::Layout
            && node.outputs.iter().all(|&v| {
                storage[v.index()].is_view() || node.inputs.iter().all(|&x| root(x) == v)
            });
        if is_view {
            continue;
        }
        works[u] = true;
        names[u].extend(node.outputs.iter().map(|&v| g.name(v).to_string()));
        let f = node_flops(g, node);
        flops[u] += f;
        serial[u] += bias_grad_apart_bytes(g, node);
        scratch[u] += scratch_bytes(g, node);
        compute[u] += if node.op.class() == OpClass::Communication {
            // The wire bounds a collective: the whole value's bytes over the interconnect.
            let moved = match node.op {
                Op::ReduceScatter { .. } => value_bytes(g, node.inputs[0]),
                _ => value_bytes(g, node.outputs[0]),
            };
            gpu.interconnect.seconds(&node.op, moved)
        } else {
            f / gpu.peak_for(g, node)
        };
        for &v in &node.inputs {
            if units.step_of[g.value(v).producer.index()] != u {
                reads[u].insert(v);
            }
        }
        for &v in &node.outputs {
            let read_outside = users[v.index()]
                .iter()
                .any(|r| units.step_of[r.index()] != u);
            if read_outside || outputs.contains(&v) || stored.contains_key(g.name(v)) {
                writes[u].insert(v);
            }
        }
    }
    // The FP8 products' operand copies (cuBLASLt's "TN" form), which the lowering adds: a
    // read and a write of each copied element, by kernels of their own that run before the
    // product (so their time adds to the product's rather than hiding under it).
    for (u, bytes) in fp8_operand_copies(g, units, program, run) {
        serial[u] += bytes;
    }
    let mut out = RunRoofline {
        commands: program
            .run(run)
            .map_or(0, |r| program.runs[r].issued().count()),
        ..RunRoofline::default()
    };
    let mut per_unit = Vec::new();
    for u in (1..n).filter(|&u| works[u]) {
        let bytes: f64 = reads[u]
            .iter()
            .chain(&writes[u])
            .map(|&v| value_bytes(g, v))
            .sum::<f64>()
            + scratch[u];
        let seconds =
            compute[u].max(bytes / gpu.memory_bandwidth) + serial[u] / gpu.memory_bandwidth;
        out.units += 1;
        out.flops += flops[u];
        out.bytes += bytes + serial[u];
        out.seconds += seconds;
        per_unit.push((std::mem::take(&mut names[u]), seconds));
    }
    out.seconds += out.commands as f64 * LAUNCH_SECONDS;
    (out, per_unit)
}

/// The bytes each unit's FP8 products move copying their operands into the "TN" form: the
/// `strided_copy` launches the lowering makes for an `fp8_matmul` node, each a read and a
/// write of its elements.
fn fp8_operand_copies(
    g: &Graph,
    units: &UnitSchedule,
    program: &Program,
    run: &str,
) -> Vec<(usize, f64)> {
    let Some(r) = program.run(run) else {
        return Vec::new();
    };
    program.runs[r]
        .commands
        .iter()
        .filter_map(|c| match c {
            Command::Launch(l) => Some(l),
            _ => None,
        })
        .filter_map(|l| {
            let Some(KernelId::Layout(LayoutKernel::StridedCopy { bytes })) = l.kernel else {
                return None;
            };
            let node = g.value(g.lookup(&l.node)?).producer;
            if !matches!(g.node(node).op, Op::Fp8MatMul { .. }) {
                return None;
            }
            let names = super::families::signature(&l.entry).ok()?.names();
            let n = names.iter().position(|&p| p == "n")?;
            let Arg::I64(n) = l.args[n] else {
                return None;
            };
            Some((
                units.step_of[node.index()],
                2.0 * n as f64 * f64::from(bytes),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::lower::lower_graph;

    /// Two pointwise ops fused into one kernel move the input and the output once: half the
    /// bytes the node-level model counts (each node reading and writing).
    #[test]
    fn a_fused_group_moves_only_what_crosses_its_boundary() {
        let src = "graph g {\n  %x: f32[1048576] = input\n  %e: f32[1048576] = exp(%x)\n  %y: f32[1048576] = scale(%e) {factor=2.0}\n  return %y\n}\n";
        let g = castor_ir::text::parse(src).unwrap();
        let program = lower_graph(&g).unwrap();
        let gpu = GpuSpec::default();
        let units = castor_passes::fusion::schedule_of(&g).unwrap();
        let r = run_roofline(
            &g,
            &units,
            &HashMap::new(),
            &program,
            &program.runs[0].name,
            &gpu,
        );
        let elements = 1_048_576f64 * 4.0;
        assert_eq!(r.units, 1);
        assert_eq!(r.bytes, 2.0 * elements);
        let node_level: f64 = g
            .nodes()
            .filter(|(_, n)| !n.op.is_source())
            .map(|(id, _)| castor_passes::cost::node_cost(&g, id, &gpu).bytes)
            .sum();
        assert_eq!(node_level, 4.0 * elements);
        let expected = 2.0 * elements / gpu.memory_bandwidth + r.commands as f64 * LAUNCH_SECONDS;
        assert!(
            (r.seconds - expected).abs() < 1e-12,
            "{} vs {expected}",
            r.seconds
        );
    }
}
