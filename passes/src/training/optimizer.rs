//! `optimizer`: the state table (masters, working copies, gradients, moments, control) and the
//! optimizer step: the global gradient norm of the unscaled gradients (its finiteness is the
//! found-inf flag), one fused AdamW, SGD or Adafactor op per parameter buffer (unscale, clip,
//! update master and moments, write the working copy), the step count unless the step was
//! skipped, and the loss-scale update.

use super::{PlanBuild, PlanPass};
use crate::autodiff::grad_name;
use crate::{PassError, PassReport};
use castor_ir::{
    adafactor_moments, quant, ControlState, DType, Graph, GraphBuilder, LossScaling, Op,
    OptimizerKind, Shape, StateInit, StateRole, StateSpec, TensorType, TrainSettings, Value,
    WeightDecay, Write, GRAD_NORM, LEARNING_RATE,
};

pub(super) struct OptimizerStep;

impl PlanPass for OptimizerStep {
    fn name(&self) -> &'static str {
        "optimizer"
    }

    fn run(&self, build: &mut PlanBuild) -> Result<PassReport, PassError> {
        let fwd = &build.forward;
        let settings = &build.plan.settings;
        let (params, trainable) = (&build.params, &build.trainable);
        let mut state = Vec::new();
        for &p in params {
            // A base under adapters is stored once; a parameter `--freeze` names keeps its
            // F32 master, which a full checkpoint saves as it was loaded.
            let role = match build.is_trained(p) || settings.lora.is_none() {
                true => StateRole::Master,
                false => StateRole::Frozen,
            };
            state.push(StateSpec {
                shard_of: None,
                name: fwd.name(p).to_string(),
                ty: fwd.ty(p).clone(),
                role,
                init: StateInit::Checkpoint(fwd.name(p).to_string()),
            });
        }
        let copies = working_copies(fwd);
        for (master, copy) in &copies {
            state.push(StateSpec {
                shard_of: None,
                name: fwd.name(*copy).to_string(),
                ty: fwd.ty(*copy).clone(),
                role: StateRole::WorkingCopy,
                init: StateInit::CopyOf(fwd.name(*master).to_string()),
            });
        }
        for &p in trainable {
            state.push(StateSpec {
                shard_of: None,
                name: grad_name(fwd.name(p)),
                ty: TensorType::new(DType::F32, fwd.ty(p).shape.clone()),
                role: StateRole::Gradient,
                init: StateInit::Zeros,
            });
        }
        for &p in trainable {
            for (name, ty) in moments(settings, fwd.name(p), &fwd.ty(p).shape) {
                state.push(StateSpec {
                    shard_of: None,
                    name,
                    ty,
                    role: StateRole::OptimizerState,
                    init: StateInit::Zeros,
                });
            }
        }
        // The code maps every 8-bit update reads, once for the plan.
        if trainable
            .iter()
            .any(|&p| quantized(settings, &fwd.ty(p).shape))
        {
            state.push(StateSpec {
                shard_of: None,
                name: CODE_MAPS.into(),
                ty: code_maps_type(),
                role: StateRole::OptimizerState,
                init: StateInit::Values(quant::code_maps().into_iter().map(f64::from).collect()),
            });
        }
        // Every control entry, the counters included when they stay unused, so the state table
        // has one shape whatever the loss scaling.
        for c in ControlState::ALL {
            state.push(StateSpec {
                shard_of: None,
                name: c.name().into(),
                ty: c.ty(),
                role: StateRole::Control,
                init: StateInit::Values(c.initial(&settings.loss_scaling)),
            });
        }

        let (graph, writes) = optimizer_graph(fwd, settings, trainable, &build.no_decay, &copies)?;
        let report = format!(
            "{} update(s) of {} parameter buffer(s){}; state: {} entries; optimizer step {} nodes",
            match settings.optimizer {
                OptimizerKind::AdamW(_) => "AdamW",
                OptimizerKind::AdamW8bit(_) => "8-bit AdamW",
                OptimizerKind::Sgd(_) => "SGD",
                OptimizerKind::Lion(_) => "Lion",
                OptimizerKind::Adafactor(_) => "Adafactor",
            },
            trainable.len(),
            match build.frozen() {
                0 => String::new(),
                f => format!(" ({f} frozen)"),
            },
            state.len(),
            graph.num_nodes()
        );
        build.plan.state = state;
        build.plan.optimizer_step = graph;
        build.plan.optimizer_step_writes = writes;
        if build.plan.settings.update_in_backward {
            let moved = super::in_backward::apply(build)?;
            return Ok(PassReport::new(format!("{report}; {moved}")));
        }
        Ok(PassReport::new(report))
    }
}

/// The optimizer state of the parameter `name`: each moment's state name and type, in the
/// order its update op takes them.
fn moments(settings: &TrainSettings, name: &str, shape: &Shape) -> Vec<(String, TensorType)> {
    let state = settings.optimizer_state;
    let full = |m: &str| (m.to_string(), TensorType::new(state, shape.clone()));
    let named: Vec<(String, TensorType)> = match &settings.optimizer {
        OptimizerKind::AdamW8bit(_) if quantized(settings, shape) => {
            let codes = TensorType::new(DType::U8, shape.clone());
            let blocks = quant::quant_blocks(shape.numel().unwrap_or(0));
            let absmax = TensorType::new(DType::F32, Shape::from(vec![blocks]));
            vec![
                ("adamw8bit.m".into(), codes.clone()),
                ("adamw8bit.m_absmax".into(), absmax.clone()),
                ("adamw8bit.v".into(), codes),
                ("adamw8bit.v_absmax".into(), absmax),
            ]
        }
        OptimizerKind::AdamW(_) | OptimizerKind::AdamW8bit(_) => {
            vec![full("adamw.m"), full("adamw.v")]
        }
        OptimizerKind::Sgd(_) => vec![full("sgd.momentum")],
        OptimizerKind::Lion(_) => vec![full("lion.exp_avg")],
        OptimizerKind::Adafactor(hp) => {
            let mut m: Vec<(String, TensorType)> = hp
                .beta1
                .map(|_| full("adafactor.exp_avg"))
                .into_iter()
                .collect();
            let second = adafactor_moments(shape);
            let names: &[&str] = if second.len() == 2 {
                &["adafactor.exp_avg_sq_row", "adafactor.exp_avg_sq_col"]
            } else {
                &["adafactor.exp_avg_sq"]
            };
            m.extend(
                names
                    .iter()
                    .zip(second)
                    .map(|(n, s)| (n.to_string(), TensorType::new(state, s))),
            );
            m
        }
    };
    named
        .into_iter()
        .map(|(m, ty)| (format!("{m}.{name}"), ty))
        .collect()
}

/// True when the parameter of `shape` keeps 8-bit moments: under AdamW8bit, from
/// [`quant::MIN_QUANTIZED_NUMEL`] values up, as bitsandbytes' `min_8bit_size`.
fn quantized(settings: &TrainSettings, shape: &Shape) -> bool {
    matches!(settings.optimizer, OptimizerKind::AdamW8bit(_))
        && shape.numel().unwrap_or(0) >= quant::MIN_QUANTIZED_NUMEL
}

/// `(master, copy)` for every `param_copy` in the forward graph.
fn working_copies(g: &Graph) -> Vec<(Value, Value)> {
    g.nodes()
        .filter(|(_, n)| matches!(n.op, Op::ParamCopy { .. }))
        .map(|(_, n)| (n.inputs[0], n.outputs[0]))
        .collect()
}

fn optimizer_graph(
    fwd: &Graph,
    settings: &TrainSettings,
    trainable: &[Value],
    no_decay: &[Value],
    copies: &[(Value, Value)],
) -> Result<(Graph, Vec<Write>), PassError> {
    let scalar = TensorType::new(DType::F32, Shape::scalar());
    let mut b = GraphBuilder::new("optimizer_step");
    let lr = b.input(LEARNING_RATE, scalar)?;
    let step = b.state(ControlState::Step.name(), ControlState::Step.ty())?;
    let scale = b.state(ControlState::LossScale.name(), ControlState::LossScale.ty())?;
    let mut grads = Vec::new();
    for &p in trainable {
        let ty = TensorType::new(DType::F32, fwd.ty(p).shape.clone());
        grads.push(b.state(&grad_name(fwd.name(p)), ty)?);
    }
    let mut operands = grads.clone();
    operands.push(scale);
    let norm = b.op(GRAD_NORM, Op::GradNorm, &operands)?;
    if b.graph().name(norm) != GRAD_NORM {
        return Err(internal("the gradient norm could not take its name".into()));
    }

    let mut outputs = vec![norm];
    let mut writes = Vec::new();
    let mut write = |b: &mut GraphBuilder, v: Value, state: &str| -> Result<(), PassError> {
        let name = format!("{state}.next");
        b.rename(v, &name)?;
        outputs.push(v);
        writes.push(Write {
            output: name,
            state: state.to_string(),
        });
        Ok(())
    };
    let mut code_maps = None;
    for (&p, &grad) in trainable.iter().zip(&grads) {
        let pname = fwd.name(p);
        let master = b.param(pname, fwd.ty(p).clone())?;
        let mut ins = vec![master, grad];
        let moments = moments(settings, pname, &fwd.ty(p).shape);
        for (m, ty) in &moments {
            ins.push(b.state(m, ty.clone())?);
        }
        let quantized = quantized(settings, &fwd.ty(p).shape);
        if quantized {
            let maps = match code_maps {
                Some(maps) => maps,
                None => *code_maps.insert(b.state(CODE_MAPS, code_maps_type())?),
            };
            ins.push(maps);
        }
        ins.extend([lr, step, scale, norm]);
        let copy = copies.iter().find(|(m, _)| *m == p).map(|&(_, c)| c);
        let decay = !no_decay.contains(&p);
        let (max_grad_norm, copy_dtype) = (settings.max_grad_norm, copy.map(|c| fwd.ty(c).dtype));
        let op = match settings.optimizer {
            OptimizerKind::AdamW8bit(hp) if quantized => Op::AdamW8bit {
                hp: hp.with_decay(decay),
                max_grad_norm,
                quant_block: quant::QUANT_BLOCK,
                copy: copy_dtype,
            },
            OptimizerKind::AdamW(hp) | OptimizerKind::AdamW8bit(hp) => Op::AdamW {
                hp: hp.with_decay(decay),
                max_grad_norm,
                copy: copy_dtype,
            },
            OptimizerKind::Sgd(hp) => Op::Sgd {
                hp: hp.with_decay(decay),
                max_grad_norm,
                copy: copy_dtype,
            },
            OptimizerKind::Lion(hp) => Op::Lion {
                hp: hp.with_decay(decay),
                max_grad_norm,
                copy: copy_dtype,
            },
            OptimizerKind::Adafactor(hp) => Op::Adafactor {
                hp: hp.with_decay(decay),
                max_grad_norm,
                copy: copy_dtype,
            },
        };
        let n_out = 1 + moments.len() + usize::from(copy.is_some());
        let outs = b.op_multi(&format!("update.{pname}"), op, &ins)?;
        if outs.len() != n_out {
            return Err(internal(format!(
                "the update of `{pname}` has {} results",
                outs.len()
            )));
        }
        write(&mut b, outs[0], pname)?;
        for ((m, _), &v) in moments.iter().zip(&outs[1..]) {
            write(&mut b, v, m)?;
        }
        if let Some(c) = copy {
            write(&mut b, outs[n_out - 1], fwd.name(c))?;
        }
    }
    let next_step = b.op("count_step", Op::CountStep, &[step, norm])?;
    write(&mut b, next_step, ControlState::Step.name())?;
    if let LossScaling::Dynamic {
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        max_scale,
        ..
    } = settings.loss_scaling
    {
        let counters = b.state(
            ControlState::LossScaleCounters.name(),
            ControlState::LossScaleCounters.ty(),
        )?;
        let op = Op::LossScaleUpdate {
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            max_scale,
        };
        let outs = b.op_multi("loss_scale_update", op, &[scale, counters, norm])?;
        write(&mut b, outs[0], ControlState::LossScale.name())?;
        write(&mut b, outs[1], ControlState::LossScaleCounters.name())?;
    }
    b.set_outputs(outputs);
    Ok((b.finish(), writes))
}

/// The state entry holding the 8-bit updates' code maps (signed, unsigned).
pub const CODE_MAPS: &str = "adamw8bit.code_maps";

fn code_maps_type() -> TensorType {
    TensorType::new(DType::F32, Shape::from(vec![2, quant::CODES]))
}

fn internal(message: String) -> PassError {
    PassError::Internal {
        pass: "optimizer",
        message,
    }
}
