//! From a precision-assigned loss graph to a [`TrainingPlan`], as a pipeline of plan passes.
//!
//! The plan starts as the loss graph (the micro step's forward part) and grows pass by pass:
//!
//! 0. `classifier` fuses the LM head's product and its cross-entropy into one chunked op
//!    under `--classifier fused` (`classifier.rs`);
//! 1. `autodiff` appends the backward pass, seeded with `loss_scale / grad_accum` (so gradients
//!    come out scaled, and averaged over micro-batches);
//!    Then `classifier_step` merges a fused head with its gradient (each chunk's logits once
//!    per step) and `epilogue` moves bias adds, GELUs and bias gradients into their products'
//!    epilogues under `--epilogues fused` (`epilogue.rs`);
//! 2. `accumulate` writes each trainable parameter's F32 gradient into its `grad.<name>` state
//!    (added to it when gradients accumulate over several micro-batches);
//! 3. `optimizer` builds the state table (masters, working copies, gradients, moments, control)
//!    and the optimizer step: the global gradient norm of the unscaled gradients (its
//!    finiteness is the found-inf flag), one fused AdamW, SGD or Lion op per parameter buffer
//!    (unscale, clip, update master and moments, write the working copy), the step count
//!    unless skipped, the loss-scale update; under `--update-in-backward` it then moves each
//!    update into the micro step right after its gradient (`in_backward.rs`);
//!    `fp8_scaling` makes the amax histories and scales of `--precision fp8:delayed` state,
//!    written back after every micro-batch (`fp8_scaling.rs`); `fp8_weights` moves the casts
//!    of the weights to FP8 from the micro step into the optimizer step, after each update
//!    (`fp8_weights.rs`);
//!    `nf4` stores a QLoRA base in NF4 (`nf4.rs`); `parallel` makes the plan one rank's of a
//!    data-parallel group under `--world-size`: gradients averaged across ranks as they
//!    complete, and under `--zero` the moments (and gradients) sharded (`parallel.rs`);
//! 4. `remat` rewrites the micro step under `--remat`, the budget measured against the whole
//!    step's planned peak;
//! 5. `fusion` records what runs as one kernel in each graph (pointwise groups with their
//!    typed bodies, norms with an absorbed add, optimizer batches) as the plan's kernel units.
//!
//! Every decision that depends on the step's data is a graph op, so nothing is decided on the
//! host. Like the precision [`crate::Pipeline`], the training pipeline verifies both graphs
//! after every pass (in debug builds, tests and with `--verify`) and keeps the IR text after a
//! named pass (`--dump-after`); the finished plan is checked against its contract.

mod classifier;
mod epilogue;
mod fp8_scaling;
mod fp8_weights;
mod gradients;
mod in_backward;
mod nf4;
mod optimizer;
pub(crate) mod parallel;

use crate::memory::{MemoryModel, NodeLevel};
use crate::{PassError, PassReport};
use castor_ir::{text, verify, Graph, TrainSettings, TrainingPlan, Value, PLAN_FORMAT};
use std::sync::Arc;
use wildmatch::WildMatch;

/// A plan under construction: the plan so far, the loss graph it was started from, and the
/// parameters' roles decided from the settings.
pub struct PlanBuild {
    pub plan: TrainingPlan,
    /// The precision-assigned loss graph: the micro step's first `plan.forward_nodes` nodes
    /// until `epilogue` fuses some of them; its sources (parameters, copies) stay the micro
    /// step's.
    pub forward: Graph,
    /// Every parameter of the loss graph, in order.
    params: Vec<Value>,
    /// The parameters that are trained (not frozen).
    trainable: Vec<Value>,
    /// Trained without weight decay.
    no_decay: Vec<Value>,
    /// How the executor lays out the step's memory (the remat budget is checked against it).
    pub memory: Arc<dyn MemoryModel>,
}

impl PlanBuild {
    /// A plan whose micro step is the loss graph (first output: the scalar loss) and which has
    /// no optimizer step or state yet. `--freeze` and `--no-decay` globs must each match a
    /// parameter.
    pub fn new(forward: &Graph, settings: TrainSettings) -> Result<PlanBuild, PassError> {
        if settings.grad_accum == 0 {
            return Err(bad("--grad-accum must be at least 1".into()));
        }
        // With adapters, they alone are trained: the rest is the frozen base, stored once in
        // the dtype the step reads it in.
        let based;
        let forward = if settings.lora.is_some() {
            based = frozen_base(forward)?;
            &based
        } else {
            forward
        };
        let params: Vec<Value> = forward.params().collect();
        let mut frozen = matching(forward, &params, &settings.frozen, "--freeze")?;
        if settings.lora.is_some() {
            frozen.extend(
                params
                    .iter()
                    .copied()
                    .filter(|&p| !forward.has_origin(p, castor_ir::Origin::Adapter)),
            );
        }
        let no_decay = matching(forward, &params, &settings.no_decay, "--no-decay")?;
        let trainable: Vec<Value> = params
            .iter()
            .copied()
            .filter(|p| !frozen.contains(p))
            .collect();
        if trainable.is_empty() {
            return Err(bad("every parameter is frozen: nothing to train".into()));
        }
        let mut micro_step = forward.clone();
        micro_step.name = "micro_step".into();
        Ok(PlanBuild {
            plan: TrainingPlan {
                format: PLAN_FORMAT.into(),
                settings,
                micro_step,
                forward_nodes: forward.num_nodes(),
                micro_step_writes: Vec::new(),
                optimizer_step: Graph::new("optimizer_step"),
                optimizer_step_writes: Vec::new(),
                state: Vec::new(),
                kernel_units: Vec::new(),
            },
            forward: forward.clone(),
            params,
            trainable,
            no_decay,
            memory: Arc::new(NodeLevel),
        })
    }

    fn frozen(&self) -> usize {
        self.params.len() - self.trainable.len()
    }

    /// Whether parameter `p` is trained.
    fn is_trained(&self, p: Value) -> bool {
        self.trainable.contains(&p)
    }
}

/// `forward` with every base parameter (not an adapter) that the step reads only through
/// working copies of one dtype turned into a parameter of that dtype, the copies removed: a
/// frozen base needs no F32 master, since nothing updates it. The checkpoint is rounded to
/// that dtype once, when the state is initialized, as the copies were rounded from it.
fn frozen_base(forward: &Graph) -> Result<Graph, PassError> {
    let users = forward.users();
    let internal = |message: String| PassError::Internal {
        pass: "lora",
        message,
    };
    // Per base parameter read only by copies to one dtype: that dtype.
    let mut low: Vec<Option<castor_ir::DType>> = vec![None; forward.num_values()];
    for p in forward.params() {
        if forward.has_origin(p, castor_ir::Origin::Adapter) || forward.outputs().contains(&p) {
            continue;
        }
        let copies: Vec<castor_ir::DType> = users[p.index()]
            .iter()
            .filter_map(|&u| match forward.node(u).op {
                castor_ir::Op::ParamCopy { to } => Some(to),
                _ => None,
            })
            .collect();
        if !copies.is_empty()
            && copies.len() == users[p.index()].len()
            && copies.iter().all(|&d| d == copies[0])
        {
            low[p.index()] = Some(copies[0]);
        }
    }
    let mut out = Graph::empty_like(forward);
    let mut map: Vec<Option<Value>> = vec![None; forward.num_values()];
    for (n, node) in forward.nodes() {
        let first = node.outputs.first().copied();
        if let (castor_ir::Op::ParamCopy { .. }, Some(&p)) = (&node.op, node.inputs.first()) {
            if low[p.index()].is_some() {
                if let Some(copy) = first {
                    map[copy.index()] = map[p.index()];
                }
                continue;
            }
        }
        let ins = node
            .inputs
            .iter()
            .map(|&v| {
                map[v.index()].ok_or_else(|| internal(format!("`%{}` unmapped", forward.name(v))))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let outs = node
            .outputs
            .iter()
            .map(|&v| {
                let mut ty = forward.ty(v).clone();
                if let Some(d) = low[v.index()] {
                    ty.dtype = d;
                }
                (forward.name(v).to_string(), ty)
            })
            .collect();
        let copy = out.push_copy(forward, n, ins, outs)?;
        for (&old, &new) in node.outputs.iter().zip(&out.node(copy).outputs) {
            map[old.index()] = Some(new);
        }
    }
    set_mapped_outputs(forward, &mut out, &map).map_err(internal)?;
    Ok(out)
}

/// One step of the training build.
pub trait PlanPass {
    /// The name used by `--dump-after` and in reports.
    fn name(&self) -> &'static str;
    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError>;
}

/// The training build's passes, in order.
pub struct TrainingPipeline {
    passes: Vec<Box<dyn PlanPass>>,
    verify_each: bool,
    dump_after: Option<String>,
    memory: Arc<dyn MemoryModel>,
}

/// The plan, each pass's report, and the requested dump.
pub struct TrainingOutput {
    pub plan: TrainingPlan,
    pub reports: Vec<(&'static str, PassReport)>,
    /// Both graphs' IR text after the pass named by [`TrainingPipeline::dump_after`].
    pub dump: Option<String>,
    /// The model's parameter buffers, and how many of them are trained. Counted before the
    /// passes run: ZeRO turns sharded masters into state reads and the update in the backward
    /// adds writes, so neither the graphs nor the state table count parameters once.
    pub parameters: usize,
    pub trained: usize,
}

impl Default for TrainingPipeline {
    /// classifier, autodiff, classifier_step, epilogue, accumulate, optimizer, fp8_scaling,
    /// fp8_weights, nf4, parallel, remat, fusion.
    fn default() -> Self {
        TrainingPipeline::new(vec![
            Box::new(classifier::FuseClassifier),
            Box::new(gradients::Differentiate),
            Box::new(classifier::ClassifierStep),
            Box::new(epilogue::FuseEpilogues),
            Box::new(gradients::Accumulate),
            Box::new(optimizer::OptimizerStep),
            Box::new(fp8_scaling::DelayedScaling),
            Box::new(fp8_weights::Fp8WeightCopies),
            Box::new(nf4::Nf4Base),
            Box::new(parallel::DataParallel),
            Box::new(Rematerialize),
            Box::new(Fuse),
        ])
    }
}

impl TrainingPipeline {
    pub fn new(passes: Vec<Box<dyn PlanPass>>) -> Self {
        TrainingPipeline {
            passes,
            verify_each: cfg!(debug_assertions),
            dump_after: None,
            memory: Arc::new(NodeLevel),
        }
    }

    /// The memory model the remat budget is checked against (default: [`NodeLevel`]; the
    /// command line gives the CUDA executor's).
    pub fn memory_model(mut self, model: Arc<dyn MemoryModel>) -> Self {
        self.memory = model;
        self
    }

    pub fn pass_names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Verify both graphs after every pass (on by default in debug builds and tests).
    pub fn verify_each(mut self, on: bool) -> Self {
        self.verify_each = on;
        self
    }

    /// Keep the plan's IR text after the pass called `name`.
    pub fn dump_after(mut self, name: Option<&str>) -> Result<Self, PassError> {
        if let Some(n) = name {
            if !self.passes.iter().any(|p| p.name() == n) {
                return Err(PassError::UnknownPass {
                    name: n.to_string(),
                    available: self.pass_names().join(", "),
                });
            }
        }
        self.dump_after = name.map(str::to_string);
        Ok(self)
    }

    /// [`Self::run`], with the plan summed up in one line.
    pub fn build(
        &self,
        forward: &Graph,
        settings: TrainSettings,
    ) -> Result<(TrainingPlan, PassReport), PassError> {
        let out = self.run(forward, settings)?;
        let report = PassReport::new(plan_summary(&out));
        Ok((out.plan, report))
    }

    /// Builds the plan of `forward` (first output: the scalar loss; dtypes assigned by the
    /// precision passes) and checks it against the plan contract.
    pub fn run(
        &self,
        forward: &Graph,
        settings: TrainSettings,
    ) -> Result<TrainingOutput, PassError> {
        let mut build = PlanBuild::new(forward, settings)?;
        let (parameters, trained) = (build.params.len(), build.trainable.len());
        build.memory = Arc::clone(&self.memory);
        let mut reports = Vec::new();
        let mut dump = None;
        for pass in &self.passes {
            let report = pass.run(&mut build)?;
            let plan = &build.plan;
            if self.verify_each {
                for g in [&plan.micro_step, &plan.optimizer_step] {
                    verify(g).map_err(|source| PassError::Verify {
                        pass: pass.name().to_string(),
                        source,
                    })?;
                }
            }
            if self.dump_after.as_deref() == Some(pass.name()) {
                let mut text = text::print(&plan.micro_step);
                // The optimizer step exists from the `optimizer` pass on.
                if plan.optimizer_step.num_nodes() > 0 {
                    text.push('\n');
                    text.push_str(&text::print(&plan.optimizer_step));
                }
                dump = Some(text);
            }
            reports.push((pass.name(), report));
        }
        build
            .plan
            .check()
            .map_err(|e| internal("training", format!("the plan is inconsistent: {e}")))?;
        Ok(TrainingOutput {
            plan: build.plan,
            reports,
            dump,
            parameters,
            trained,
        })
    }
}

/// Builds the training plan for `forward` with the default pipeline; the report sums up the
/// plan in one line.
pub fn build_training_plan(
    forward: &Graph,
    settings: TrainSettings,
) -> Result<(TrainingPlan, PassReport), PassError> {
    TrainingPipeline::default().build(forward, settings)
}

/// `training plan: 6 of 6 parameter buffers trained; micro step 31 nodes (2 fused into 1
/// kernel(s)), optimizer step 35 nodes[; remat ...]`.
fn plan_summary(out: &TrainingOutput) -> String {
    let (plan, reports) = (&out.plan, &out.reports);
    let (params, trained) = (out.parameters, out.trained);
    let (fused, kernels) = crate::fusion::fused_counts(&plan.units_of("micro_step"));
    let mut s = format!(
        "training plan: {trained} of {params} parameter buffers trained{}; micro step {} nodes{} ({fused} fused into {} kernel(s)), optimizer step {} nodes",
        if trained < params {
            format!(" ({} frozen)", params - trained)
        } else {
            String::new()
        },
        plan.micro_step.num_nodes(),
        if plan.settings.grad_accum > 1 {
            format!(" (x{} per step)", plan.settings.grad_accum)
        } else {
            String::new()
        },
        kernels,
        plan.optimizer_step.num_nodes()
    );
    if plan.settings.unpadded {
        s.push_str("; unpadded rows (no attention mask)");
    }
    // The passes a flag asked for say what they did (a fused classifier that stayed eager
    // says why).
    for (pass, asked) in [
        ("classifier", !plan.settings.classifier.is_eager()),
        ("epilogue", !plan.settings.epilogues.is_eager()),
        ("remat", !plan.settings.remat.is_none()),
    ] {
        if let Some((_, r)) = reports.iter().find(|(n, _)| asked && *n == pass) {
            s.push_str("; ");
            s.push_str(&r.summary);
        }
    }
    s
}

/// `remat`: recomputation in the micro step's backward part, the budget measured against the
/// whole step's planned peak (state, micro step, optimizer step) under the build's memory
/// model.
struct Rematerialize;

impl PlanPass for Rematerialize {
    fn name(&self) -> &'static str {
        "remat"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let plan = &build.plan;
        let ctx = crate::remat::RematContext::of_plan(
            plan,
            crate::cost::GpuSpec::default(),
            build.memory.as_ref(),
        );
        let out = crate::remat::rematerialize(&plan.micro_step, plan.settings.remat, &ctx)?;
        drop(ctx);
        build.plan.micro_step = out.graph;
        Ok(PassReport::new(out.summary))
    }
}

/// `fusion`: what runs as one kernel in each graph, recorded as the plan's kernel units.
struct Fuse;

impl PlanPass for Fuse {
    fn name(&self) -> &'static str {
        "fusion"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let plan = &mut build.plan;
        let mut units = crate::fusion::kernel_units(&plan.micro_step, "micro_step");
        let (fused, kernels) = crate::fusion::fused_counts(&units);
        units.extend(crate::fusion::kernel_units(
            &plan.optimizer_step,
            "optimizer_step",
        ));
        let report = format!(
            "micro step {} nodes{}: {fused} pointwise node(s) fused into {kernels} kernel(s); {} kernel unit(s) in all",
            plan.micro_step.num_nodes(),
            if plan.settings.grad_accum > 1 {
                format!(" (x{} per step)", plan.settings.grad_accum)
            } else {
                String::new()
            },
            units.len()
        );
        plan.kernel_units = units;
        Ok(PassReport::new(report))
    }
}

/// Parameters whose names match one of `globs`; a glob that matches nothing is an error (a
/// typo would otherwise silently train or decay everything).
fn matching(
    g: &Graph,
    params: &[Value],
    globs: &[String],
    flag: &str,
) -> Result<Vec<Value>, PassError> {
    let mut out = Vec::new();
    for glob in globs {
        let w = WildMatch::new(glob);
        let hits: Vec<Value> = params
            .iter()
            .copied()
            .filter(|&p| w.matches(g.name(p)))
            .collect();
        if hits.is_empty() {
            let suggestions = crate::names::suggest(glob, params.iter().map(|&p| g.name(p)));
            return Err(bad(format!(
                "{flag} `{glob}` matches no parameter; did you mean {}?",
                suggestions
                    .iter()
                    .map(|s| format!("`{s}`"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )));
        }
        for p in hits {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// Gives `out`, a graph rebuilt from `g` with `map` from `g`'s values to its own, `g`'s
/// outputs; an unmapped output is the rebuilding pass's bug.
fn set_mapped_outputs(g: &Graph, out: &mut Graph, map: &[Option<Value>]) -> Result<(), String> {
    let outputs = g
        .outputs()
        .iter()
        .map(|v| map[v.index()].ok_or_else(|| format!("the output `%{}` is unmapped", g.name(*v))))
        .collect::<Result<_, _>>()?;
    out.set_outputs(outputs);
    Ok(())
}

fn bad(message: String) -> PassError {
    PassError::Training(message)
}

fn internal(pass: &'static str, message: String) -> PassError {
    PassError::Internal { pass, message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use castor_ir::{LossScaling, OptimizerKind, Precision, Remat};

    fn settings() -> TrainSettings {
        TrainSettings {
            precision: Precision::Fp32,
            objective: "first-output".into(),
            batch: 1,
            seq: 2,
            grad_accum: 2,
            optimizer: OptimizerKind::Sgd(castor_ir::SgdHparams {
                momentum: 0.9,
                weight_decay: 0.0,
            }),
            max_grad_norm: 0.0,
            loss_scaling: LossScaling::None,
            frozen: vec![],
            no_decay: vec![],
            param_grads_in_compute_dtype: false,
            optimizer_state: castor_ir::DType::F32,
            update_in_backward: false,
            remat: Remat::None,
            classifier: castor_ir::Classifier::Eager,
            epilogues: castor_ir::Epilogues::Eager,
            lora: None,
            parallel: Default::default(),
            packed: false,
            unpadded: false,
            dropout: Default::default(),
        }
    }

    fn loss_graph() -> Graph {
        castor_ir::text::parse(
            "graph g {
               %x: f32[2,3] = input
               %w: f32[3,3] = param
               %y: f32[2,3] = matmul(%x, %w) {transpose_a=false, transpose_b=false, acc=f32}
               %t: f32[2,3] = tanh(%y)
               %loss: f32[] = sum(%t) {axes=[0,1], keepdim=false, acc=f32}
               return %loss
             }",
        )
        .unwrap()
    }

    /// Turns the micro step's first operation into one with a wrong result type.
    struct Breaks;

    impl PlanPass for Breaks {
        fn name(&self) -> &'static str {
            "breaks"
        }

        fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
            let y = build.plan.micro_step.lookup("y").unwrap();
            build.plan.micro_step.retype(y, castor_ir::DType::BF16);
            build
                .plan
                .micro_step
                .set_acc(build.plan.micro_step.value(y).producer, None);
            let t = build.plan.micro_step.lookup("t").unwrap();
            build.plan.micro_step.retype(t, castor_ir::DType::F16);
            Ok(PassReport::new("broke it"))
        }
    }

    #[test]
    fn every_pass_reports_and_can_be_dumped() {
        let names = TrainingPipeline::default().pass_names();
        assert_eq!(
            names,
            [
                "classifier",
                "autodiff",
                "classifier_step",
                "epilogue",
                "accumulate",
                "optimizer",
                "fp8_scaling",
                "fp8_weights",
                "nf4",
                "parallel",
                "remat",
                "fusion"
            ]
        );
        for name in names {
            let out = TrainingPipeline::default()
                .dump_after(Some(name))
                .unwrap()
                .run(&loss_graph(), settings())
                .unwrap();
            assert_eq!(out.reports.len(), 12);
            let dump = out.dump.unwrap();
            assert!(dump.starts_with("graph micro_step {"), "{name}: {dump}");
            // Accumulation over two micro-batches adds the gradient to its state.
            assert_eq!(
                dump.contains("%grad.w.sum"),
                !matches!(
                    name,
                    "classifier" | "autodiff" | "classifier_step" | "epilogue"
                ),
                "{name}: {dump}"
            );
            assert_eq!(
                dump.contains("graph optimizer_step {"),
                !matches!(
                    name,
                    "classifier" | "autodiff" | "classifier_step" | "epilogue" | "accumulate"
                ),
                "{name}: {dump}"
            );
        }
        let err = TrainingPipeline::default()
            .dump_after(Some("autocast"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains(
                "autodiff, classifier_step, epilogue, accumulate, optimizer, fp8_scaling, fp8_weights, nf4, parallel, remat, fusion"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_pass_that_breaks_the_graph_is_named() {
        let pipeline =
            TrainingPipeline::new(vec![Box::new(gradients::Differentiate), Box::new(Breaks)])
                .verify_each(true);
        let err = pipeline.run(&loss_graph(), settings()).err().unwrap();
        assert!(
            matches!(&err, PassError::Verify { pass, .. } if pass == "breaks"),
            "{err}"
        );
    }
}
