//! Human-readable summaries shared by the commands: the model, the training plan's settings,
//! its memory anatomy and cost, and warnings about the checkpoint.

use castor_ir::{Graph, StateRole};
use castor_models::{Model, ModelConfig};
use std::fmt::Write;

pub use castor_ir::thousands;

/// A byte count people read at a glance and can check exactly: `8,000,000 bytes (7.63 MiB)`.
pub fn counted_bytes(bytes: u64) -> String {
    format!(
        "{} bytes ({})",
        thousands(bytes),
        castor_ir::human_bytes(bytes)
    )
}

/// The model's key dimensions in one line.
pub fn config_line(config: &ModelConfig) -> String {
    match config {
        ModelConfig::Gpt2(c) => format!(
            "layers {}, hidden {}, heads {}, mlp {}, vocab {}, positions {}, {}",
            c.n_layer, c.n_embd, c.n_head, c.n_inner, c.vocab_size, c.n_positions, c.activation
        ),
        ModelConfig::Bert(c) => format!(
            "layers {}, hidden {}, heads {}, mlp {}, vocab {}, positions {}, token types {}, {}",
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.intermediate_size,
            c.vocab_size,
            c.max_position_embeddings,
            c.type_vocab_size,
            c.hidden_act
        ),
        ModelConfig::Llama(c) => {
            let mut line = format!(
                "layers {}, hidden {}, heads {} (kv {}), head dim {}, mlp {}, vocab {}, rope theta {}, {}",
                c.num_hidden_layers,
                c.hidden_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.intermediate_size,
                c.vocab_size,
                c.rope_theta,
                c.hidden_act
            );
            match c.rope_scaling {
                castor_ir::RopeScaling::None => {}
                castor_ir::RopeScaling::Linear { factor } => {
                    line += &format!(", rope scaling linear x{factor}")
                }
                castor_ir::RopeScaling::Llama3 {
                    factor, original, ..
                } => line += &format!(", rope scaling llama3 x{factor} from {original} positions"),
            }
            if let Some(w) = c.sliding_window {
                line += &format!(", sliding window {}", w.size);
                if w.first_layer > 0 {
                    line += &format!(" from layer {}", w.first_layer);
                }
            }
            line
        }
    }
}

/// The `inspect` summary of a model and its forward graph.
pub fn model_summary(
    source: &str,
    model: &Model,
    graph: &Graph,
    batch: usize,
    seq: usize,
) -> String {
    let mut s = String::new();
    let prefix = if model.prefix().is_empty() {
        "no prefix".to_string()
    } else {
        format!("prefix `{}`", model.prefix())
    };
    let _ = writeln!(s, "model       {source}");
    let _ = writeln!(
        s,
        "family      {} ({}, head: {}, {prefix})",
        model.family().model_type(),
        model.architecture(),
        model.head()
    );
    let _ = writeln!(s, "config      {}", config_line(&model.config().model));
    match model.checkpoint() {
        Some(ck) => {
            let dtype = model
                .checkpoint_dtype()
                .map(|d| d.to_string())
                .unwrap_or_else(|| "mixed".into());
            let _ = writeln!(
                s,
                "checkpoint  {} file{}, {} tensors, stored {dtype}; headers validated against files and config",
                ck.files().len(),
                if ck.files().len() == 1 { "" } else { "s" },
                ck.len()
            );
        }
        None => {
            let _ = writeln!(s, "checkpoint  none (config only: shapes, no weights)");
        }
    }
    let _ = writeln!(
        s,
        "parameters  {} (tied weights counted once)",
        thousands(model.parameter_count())
    );
    let counts = graph.class_counts();
    let total: usize = counts.iter().map(|(_, n)| n).sum();
    let by_class: Vec<String> = counts.iter().map(|(c, n)| format!("{c} {n}")).collect();
    let _ = writeln!(
        s,
        "graph       batch {batch} x seq {seq}: {total} ops ({}), {} inputs, {} parameters",
        by_class.join(", "),
        graph.inputs().count(),
        graph.params().count()
    );
    let report = model.report();
    if !report.ignored_buffers.is_empty() {
        let _ = writeln!(
            s,
            "ignored     buffers: {}",
            report.ignored_buffers.join(", ")
        );
    }
    if !report.tied_copies.is_empty() {
        let _ = writeln!(
            s,
            "tied        stored copies of tied weights: {}",
            report.tied_copies.join(", ")
        );
    }
    s
}

/// Warns (stderr) about shape-deciding config fields left to their defaults and checkpoint
/// tensors the architecture does not read: every command that
/// loads a model says so, as transformers' "Some weights of the checkpoint were not used".
pub fn warn_unused(model: &Model) {
    // A shape-deciding field config.json leaves out is said first: a checkpoint made with
    // another value fails to load, and a bare config builds a model of the default's size.
    for d in &model.config().defaulted {
        crate::errln!("warning: {d}");
    }
    let initialized = &model.report().initialized;
    if !initialized.is_empty() {
        crate::errln!(
            "note: {} is a new head for this checkpoint: {} initialized (normal with \
             initializer_range, zero biases), train it before use: {}",
            model.architecture(),
            initialized.len(),
            initialized.join(", ")
        );
    }
    let unused = &model.report().unused;
    if !unused.is_empty() {
        crate::errln!(
            "warning: {} checkpoint tensor(s) not used by {}: {}",
            unused.len(),
            model.architecture(),
            unused.join(", ")
        );
    }
}

/// A byte token for people: printable ASCII as itself, anything else as `·`.
pub fn printable_byte(id: u32) -> String {
    match u8::try_from(id) {
        Ok(b) if (0x20..0x7f).contains(&b) => (b as char).to_string(),
        _ => "·".to_string(),
    }
}

/// The optimizer of a plan in one phrase.
pub fn optimizer_text(s: &castor_ir::TrainSettings) -> String {
    use castor_ir::{AdafactorHparams, AdamWHparams, LionHparams, OptimizerKind, SgdHparams};
    let optimizer = match s.optimizer {
        OptimizerKind::AdamW(AdamWHparams {
            beta1,
            beta2,
            eps,
            weight_decay,
        }) => format!("AdamW (betas {beta1}, {beta2}; eps {eps:e}; weight decay {weight_decay})"),
        OptimizerKind::AdamW8bit(AdamWHparams {
            beta1,
            beta2,
            eps,
            weight_decay,
        }) => format!(
            "8-bit AdamW (betas {beta1}, {beta2}; eps {eps:e}; weight decay {weight_decay}; \
             moments in blocks of {} 8-bit codes from {} values up)",
            castor_ir::quant::QUANT_BLOCK,
            castor_ir::quant::MIN_QUANTIZED_NUMEL
        ),
        OptimizerKind::Sgd(SgdHparams {
            momentum,
            weight_decay,
        }) => format!("SGD (momentum {momentum}; weight decay {weight_decay})"),
        OptimizerKind::Lion(LionHparams {
            beta1,
            beta2,
            weight_decay,
        }) => format!("Lion (betas {beta1}, {beta2}; weight decay {weight_decay})"),
        OptimizerKind::Adafactor(AdafactorHparams {
            beta1,
            decay_rate,
            clip_threshold,
            weight_decay,
            relative_step,
            warmup_init,
            ..
        }) => format!(
            "Adafactor ({}; first moment {}; decay rate {decay_rate}; clip threshold \
             {clip_threshold}; weight decay {weight_decay})",
            match (relative_step, warmup_init) {
                (true, false) => "relative step",
                (true, true) => "relative step with warm-up",
                (false, _) => "the given learning rate",
            },
            beta1.map_or("none".to_string(), |b| b.to_string()),
        ),
    };
    let clip = if s.max_grad_norm > 0.0 {
        format!(", clip global norm at {}", s.max_grad_norm)
    } else {
        String::new()
    };
    let state = if s.optimizer_state == castor_ir::DType::F32 {
        String::new()
    } else {
        format!(", moments in {}", s.optimizer_state)
    };
    format!(
        "{optimizer} on F32 master weights{state}{clip}; objective {}; {} micro-batch(es) per step",
        s.objective, s.grad_accum
    )
}

/// What a plan's optimizer state holds, per trained parameter.
fn state_text(s: &castor_ir::TrainSettings) -> String {
    use castor_ir::OptimizerKind;
    let d = s.optimizer_state;
    match &s.optimizer {
        OptimizerKind::AdamW(_) => format!("AdamW moments m, v in {d}"),
        OptimizerKind::AdamW8bit(_) => format!(
            "8-bit AdamW moments m, v: a byte each plus an F32 maximum per {} values; F32 below {} values",
            castor_ir::quant::QUANT_BLOCK,
            castor_ir::quant::MIN_QUANTIZED_NUMEL
        ),
        OptimizerKind::Sgd(_) => format!("SGD momentum in {d}"),
        OptimizerKind::Lion(_) => format!("Lion moment exp_avg in {d}"),
        OptimizerKind::Adafactor(hp) => format!(
            "Adafactor: {}row and column second moments per matrix, full ones per vector, in {d}",
            if hp.beta1.is_some() { "first moment, " } else { "" }
        ),
    }
}

/// The loss scaling of a plan in one phrase.
pub fn loss_scaling_text(s: &castor_ir::TrainSettings) -> String {
    use castor_ir::LossScaling;
    match &s.loss_scaling {
        LossScaling::None => "none".to_string(),
        LossScaling::Static { scale } => format!("static {scale}"),
        LossScaling::Dynamic {
            init_scale,
            growth_interval,
            hysteresis,
            max_scale,
            min_scale,
            ..
        } => format!(
            "dynamic: init {init_scale}, x2 after {growth_interval} clean steps, x0.5 on overflow \
             (hysteresis {hysteresis}), max {max_scale}, error below {min_scale}"
        ),
    }
}

/// The memory anatomy of a training plan beside the 18 bytes/parameter rule of mixed-precision
/// AdamW (2 low-precision weights + 4 F32 master + 4 gradients + 8 moments); bytes exact and
/// in the unit of the total (GiB for real models). `settings` names what the optimizer state
/// holds.
pub fn anatomy_lines(
    a: &castor_passes::memory::Anatomy,
    settings: &castor_ir::TrainSettings,
) -> Vec<String> {
    let (unit, unit_name) = crate::plot::unit_for(a.total().max(1));
    let per = |b: u64| {
        if a.params > 0 {
            format!("{:>7.2}", b as f64 / a.params as f64)
        } else {
            format!("{:>7}", "-")
        }
    };
    let row = |what: &str, b: u64, rule: &str, note: &str| {
        format!(
            "  {what:<34} {:>19} {:>9.2} {} {rule:>6}  {note}",
            thousands(b),
            b as f64 / unit,
            per(b)
        )
        .trim_end()
        .to_string()
    };
    let m = &a.memory;
    let over = if m.lower_bound > 0 {
        (m.arena_bytes as f64 / m.lower_bound as f64 - 1.0) * 100.0
    } else {
        0.0
    };
    let mut lines = vec![
        format!(
            "  {:<34} {:>19} {:>9} {:>7} {:>6}",
            "memory anatomy", "bytes", unit_name, "B/param", "rule"
        ),
        row(
            "low-precision weights",
            a.low_precision_weights,
            "2",
            &fp8_copies_note(a.fp8_copies),
        ),
        row("F32 master weights", a.master_weights, "4", ""),
        row("gradients", a.gradients, "4", ""),
        row(
            "optimizer state",
            a.optimizer_state,
            "8",
            &state_text(settings),
        ),
        row("step and loss-scale state", a.control, "", ""),
        row(
            "saved activations",
            a.saved_activations,
            "",
            "forward values the backward reads (inside the arena)",
        ),
        row(
            "transient peak (arena)",
            m.arena_bytes,
            "",
            &format!(
                "lower bound {} (+{over:.1}%), {}; {}",
                thousands(m.lower_bound),
                m.order.describe(),
                m.model
            ),
        ),
        row("cuBLAS workspace", m.workspace, "", ""),
        row(
            crate::anatomy::OTHER_BUFFERS,
            m.other,
            "",
            "batch, graph outputs, flags, tables, allocation rounding",
        ),
        row("total", a.total(), "18", "+ activations by the rule"),
    ];
    // Only fp8:delayed has the scaling's row, after the control state.
    if a.fp8_scaling > 0 {
        let scaling = row(
            StateRole::Fp8Scaling.describe(),
            a.fp8_scaling,
            "",
            "FP8 delayed scaling: a scale and an amax history per cast",
        );
        lines.insert(6, scaling);
    }
    // Only a plan with a frozen base (LoRA) has the row.
    if a.frozen_weights > 0 {
        let frozen = row(
            "frozen base weights",
            a.frozen_weights,
            "",
            &format!(
                "not trained: stored once, in the dtype the step reads{}",
                match fp8_copies_note(a.fp8_frozen) {
                    n if n.is_empty() => n,
                    n => format!("; {n}"),
                }
            ),
        );
        lines.insert(3, frozen);
    }
    lines
}

/// The note on a row that holds `bytes` of FP8 weight copies (1 byte per weight, with a scale
/// each), empty when it holds none.
fn fp8_copies_note(bytes: u64) -> String {
    match bytes {
        0 => String::new(),
        b => format!(
            "{} bytes of FP8 weight copies and their scales",
            thousands(b)
        ),
    }
}

/// The cost model's lines: FLOPs per token against 6N + 6·L·C·T, step time, MFU. Without the
/// model's shape (hand-written IR) the rule and MFU are "n/a"; without a token count, so are
/// the per-token figures.
pub fn cost_lines(c: &castor_passes::cost::StepCost) -> Vec<String> {
    let g = &c.gpu;
    let micro = &c.micro_step;
    let per_tok = |f: f64| f * c.grad_accum as f64 / c.tokens.max(1) as f64 / 1e6;
    // Frozen parameters (a LoRA base) count 4 FLOPs per token: no weight gradient.
    let frozen = match c.frozen_params {
        0 => String::new(),
        f => format!(", of which {} frozen at 4N", thousands(f)),
    };
    let rule = match (&c.shape, c.flops_per_token_rule()) {
        (Some(s), Some(rule)) => format!(
            "{:.1} MFLOP (N {}{frozen}, L {}, C {}, T {})",
            rule / 1e6,
            thousands(c.params),
            s.layers,
            s.width,
            s.seq
        ),
        _ => format!(
            "n/a (N {}; the graph records no model shape)",
            thousands(c.params)
        ),
    };
    let flops = if c.tokens == 0 {
        format!("  FLOPs/token  n/a (no token count: the graph records no batch and sequence); 6N+6LCT {rule}")
    } else {
        format!(
            "  FLOPs/token  {:.1} MFLOP (contractions {:.1}, other ops {:.1}, recompute {:.1}, optimizer {:.3}) vs 6N+6LCT {rule}",
            c.flops_per_token() / 1e6,
            per_tok(micro.contractions.flops - micro.recompute_contractions.flops),
            per_tok(
                micro.total.flops
                    - micro.contractions.flops
                    - (micro.recompute.flops - micro.recompute_contractions.flops)
            ),
            per_tok(micro.recompute.flops),
            c.optimizer_step.total.flops / c.tokens as f64 / 1e6,
        )
    };
    let secs = c.seconds();
    let tokens_per_s = if c.tokens > 0 && secs > 0.0 {
        format!("{:.0} tokens/s", c.tokens as f64 / secs)
    } else {
        "tokens/s n/a".into()
    };
    let mfu = match c.mfu() {
        Some(m) => format!(
            "{:.1}% estimated (6N+6LCT per token{} over the roofline step time, of {:.0} TFLOP/s; every kernel at peak, no fusion credit)",
            m * 100.0,
            if c.frozen_params > 0 { ", 4N for the frozen," } else { "" },
            g.low_precision_flops / 1e12
        ),
        None => "n/a (needs the model's shape and a token count)".into(),
    };
    // Fused attention skips the pairs a causal mask drops, as the rule's 6LCT does; eager
    // attention's products compute every pair.
    let attention = if micro.fused_attention {
        "castor's fused attention computes only the (query, key) pairs its mask keeps: under a \
         causal mask the half that 6LCT counts"
    } else {
        "castor's eager attention runs the full T x T products, 12·L·C·T with no causal halving"
    };
    let mut lines = vec![
        format!(
            "  target GPU   {}: {:.0} TFLOP/s bf16/fp16, {:.0} tf32, {:.0} fp32; {:.2} TB/s",
            g.name,
            g.low_precision_flops / 1e12,
            g.tf32_flops / 1e12,
            g.f32_flops / 1e12,
            g.memory_bandwidth / 1e12
        ),
        flops,
        format!(
            "               ({attention}; counts norm, softmax and pointwise FLOPs; embedding \
             lookups are gathers, which 6N counts as products)"
        ),
        format!(
            "  step time    {:.3} ms estimated (micro step {:.3} ms x{}, of which recompute {:.3} ms; optimizer {:.3} ms); {tokens_per_s}",
            secs * 1e3,
            micro.total.seconds * 1e3,
            c.grad_accum,
            micro.recompute.seconds * 1e3,
            c.optimizer_step.total.seconds * 1e3,
        ),
        format!("  MFU          {mfu}"),
    ];
    if c.world_size > 1 {
        let link = &g.interconnect;
        let (over, bw) = if c.world_size <= link.gpus_per_node {
            ("within a node", link.link_bandwidth)
        } else {
            ("across nodes", link.network_bandwidth)
        };
        lines.push(format!(
            "  network      {:.3} ms of collectives a step, counted above: {} ranks {over} at {:.0} \
             GB/s a GPU (ring); micro step {:.3} ms x{} (where the IR places them: each \
             gradient's reduction as the backward completes it, ZeRO-3's gathers before each \
             use), optimizer {:.3} ms; with the collectives on their own stream, overlapping \
             compute, the step is {:.3} ms",
            c.communication_seconds() * 1e3,
            c.world_size,
            bw / 1e9,
            c.micro_step.communication.seconds * 1e3,
            c.grad_accum,
            c.optimizer_step.communication.seconds * 1e3,
            c.overlapped_seconds() * 1e3,
        ));
    }
    lines
}

/// One FP8 cast under delayed scaling (`--precision fp8:delayed`), as its state stands.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayedCast {
    /// The cast's FP8 value (`<product>.x_fp8`, `<product>.dy_fp8`).
    pub cast: String,
    /// The scale the next cast reads.
    pub scale: f32,
    /// The amax history, newest first.
    pub history: Vec<f32>,
}

/// Every delayed-scaling cast of `plan` with its state, found through the micro step's
/// `amax_history` nodes; `state` looks up a state entry's values. Empty unless the plan
/// scales by histories.
pub fn delayed_casts(
    plan: &castor_ir::TrainingPlan,
    state: impl Fn(&str) -> Option<Vec<f32>>,
) -> Vec<DelayedCast> {
    let g = &plan.micro_step;
    g.nodes()
        .filter(|(_, n)| matches!(n.op, castor_ir::Op::AmaxHistory { .. }))
        .filter_map(|(_, n)| {
            let cast = g.node(g.value(n.inputs[2]).producer).outputs[0];
            Some(DelayedCast {
                cast: g.name(cast).to_string(),
                scale: *state(g.name(n.inputs[1]))?.first()?,
                history: state(g.name(n.inputs[0]))?,
            })
        })
        .collect()
}

/// One line on the delayed scales at the end of a run: their range, and the range of the
/// largest amax each history holds.
pub fn delayed_scaling_line(casts: &[DelayedCast]) -> Option<String> {
    let range = |v: &mut dyn Iterator<Item = f32>| {
        v.fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        })
    };
    let first = casts.first()?;
    let (lo, hi) = range(&mut casts.iter().map(|c| c.scale));
    let (alo, ahi) = range(&mut casts.iter().map(|c| largest(&c.history)));
    Some(format!(
        "fp8 scales  {} casts with amax histories of {}: scales {lo:.3e} ..= {hi:.3e}, largest \
         amaxes {alo:.3e} ..= {ahi:.3e}",
        casts.len(),
        first.history.len()
    ))
}

/// The largest amax of a history (NaN if it holds one).
pub fn largest(history: &[f32]) -> f32 {
    history.iter().fold(0.0f32, |m, &v| {
        if m.is_nan() || v.is_nan() {
            f32::NAN
        } else {
            m.max(v)
        }
    })
}
