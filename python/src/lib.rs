//! `castor._castor`: the native half of the Python package.
//!
//! Every function takes the command's flags as an argument vector, parsed by the CLI's own
//! clap definitions, and calls the same library function the CLI's command calls
//! (`castor::commands::*`); the Python half (python/castor/__init__.py) turns keyword
//! arguments into that vector. So a flag, its default and its validation exist once.
//!
//! Errors come back as the exception classes of `castor._errors`, chosen by
//! [`castor::ErrorKind`] (the same classification that picks the CLI's exit code). A panic
//! is caught at the boundary and raised as `castor.CastorError`, never as pyo3's
//! `PanicException`. The GIL is released while castor works.

use castor::commands::{compile, eval, generate, inspect, merge, train};
use castor::given::Given;
use castor::ErrorKind;
use clap::{CommandFactory, FromArgMatches, Parser};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

#[derive(Parser)]
#[command(name = "castor.inspect", no_binary_name = true)]
struct InspectCli {
    #[command(flatten)]
    args: inspect::Args,
}

#[derive(Parser)]
#[command(name = "castor.compile", no_binary_name = true)]
struct CompileCli {
    #[command(flatten)]
    args: compile::Args,
}

#[derive(Parser)]
#[command(name = "castor.eval", no_binary_name = true)]
struct EvalCli {
    #[command(flatten)]
    args: eval::Args,
}

#[derive(Parser)]
#[command(name = "castor.train", no_binary_name = true)]
struct TrainCli {
    #[command(flatten)]
    args: train::Args,
}

#[derive(Parser)]
#[command(name = "castor.generate", no_binary_name = true)]
struct GenerateCli {
    #[command(flatten)]
    args: generate::Args,
}

#[derive(Parser)]
#[command(name = "castor.merge", no_binary_name = true)]
struct MergeCli {
    #[command(flatten)]
    args: merge::Args,
}

/// What crosses back to Python as an exception: castor's error, or a usage error of the
/// flags.
enum Failure {
    Castor(anyhow::Error),
    Usage(String),
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Failure {
        Failure::Castor(e)
    }
}

impl Failure {
    fn into_py(self, py: Python<'_>) -> PyErr {
        let (class, message, code) = match self {
            Failure::Usage(m) => ("UsageError", m, castor::codes::USAGE),
            Failure::Castor(e) => {
                let kind = ErrorKind::of(&e);
                (class_of(kind), castor::error_message(&e), kind.exit_code())
            }
        };
        let raised = py
            .import("castor._errors")
            .and_then(|m| m.getattr(class))
            .and_then(|c| c.call1((message.clone(), code)));
        match raised {
            Ok(exception) => PyErr::from_value(exception),
            Err(e) => e,
        }
    }
}

/// The exception class of an error kind (python/castor/_errors.py).
fn class_of(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Checkpoint => "CheckpointError",
        ErrorKind::Config => "ConfigError",
        ErrorKind::Ir => "IRError",
        ErrorKind::Policy => "PolicyError",
        ErrorKind::Input => "InputError",
        ErrorKind::Device => "DeviceError",
        ErrorKind::Execution => "ExecutionError",
        ErrorKind::Output => "OutputError",
        ErrorKind::Internal => "CastorError",
    }
}

/// Parses `argv` with the CLI's definition of the command; a bad flag is a usage error
/// that names it.
fn parse<C: CommandFactory + FromArgMatches>(
    argv: Vec<String>,
) -> Result<(C, clap::ArgMatches), Failure> {
    let usage = |e: clap::Error| {
        let text = e.render().to_string();
        let first = text.lines().next().unwrap_or_default();
        Failure::Usage(format!(
            "{} (keyword arguments are the CLI's flags: keep_f32=[...] is --keep-f32)",
            first.trim_start_matches("error: ")
        ))
    };
    let matches = C::command().try_get_matches_from(argv).map_err(usage)?;
    let parsed = C::from_arg_matches(&matches).map_err(usage)?;
    Ok((parsed, matches))
}

/// Runs `f` without the GIL, turning a panic into an internal error.
fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, Failure> + Send,
) -> Result<T, Failure> {
    py.detach(|| match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Err(Failure::Castor(anyhow::anyhow!(
                "internal error (a bug in castor, please report it): {what}"
            )))
        }
    })
}

/// `castor inspect` on `argv`: (the report, the model's facts).
#[pyfunction]
fn _inspect(py: Python<'_>, argv: Vec<String>) -> PyResult<(String, Py<PyDict>)> {
    let facts = detached(py, || {
        let (cli, _) = parse::<InspectCli>(argv)?;
        let inspected = inspect::inspect(&cli.args)?;
        let model = &inspected.model;
        let config_text = std::fs::read_to_string(&model.config().file)
            .map_err(|e| anyhow::anyhow!("cannot read `{}`: {e}", model.config().file.display()))?;
        let files: Vec<String> = model
            .checkpoint()
            .map(|c| {
                c.files()
                    .iter()
                    .map(|f| f.path().display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        Ok((
            inspected.report,
            model.family().model_type().to_string(),
            model.architecture().to_string(),
            model.parameter_count(),
            config_text,
            files,
            model.checkpoint_dtype().map(|d| d.to_string()),
        ))
    })
    .map_err(|f| f.into_py(py))?;
    let (report, family, architecture, parameters, config, files, dtype) = facts;
    let d = PyDict::new(py);
    d.set_item("family", family)?;
    d.set_item("architecture", architecture)?;
    d.set_item("num_parameters", parameters)?;
    d.set_item(
        "config",
        py.import("json")?.call_method1("loads", (config,))?,
    )?;
    d.set_item("files", files)?;
    d.set_item("dtype", dtype)?;
    Ok((report, d.unbind()))
}

/// `castor compile` on `argv`: the plan (nothing is printed or written but `--report`).
#[pyfunction]
fn _compile(py: Python<'_>, argv: Vec<String>) -> PyResult<Plan> {
    detached(py, || {
        let (cli, matches) = parse::<CompileCli>(argv)?;
        compile::check_outputs(&cli.args)?;
        Ok(Plan {
            inner: compile::compile(&cli.args, &Given::new(matches))?,
        })
    })
    .map_err(|f| f.into_py(py))
}

/// One input array: name, safetensors dtype name (`I64`, `I32`, `F32`, ...), shape, bytes.
type Array = (String, String, Vec<usize>, Vec<u8>);

/// One output array: name, shape, F32 little-endian bytes.
type Output = (String, Vec<usize>, Py<PyBytes>);

/// `castor eval` on `argv` with the batch given as arrays: each output's name, shape and
/// F32 bytes.
#[pyfunction]
fn _eval(py: Python<'_>, argv: Vec<String>, arrays: Vec<Array>) -> PyResult<Vec<Output>> {
    let outputs = detached(py, || {
        let (mut cli, _) = parse::<EvalCli>(argv)?;
        let bytes = safetensors_bytes(arrays)?;
        let file = castor::models::SafetensorsFile::from_bytes("the input arrays", bytes)
            .map_err(anyhow::Error::from)?;
        cli.args.input = None;
        let e = eval::evaluate(&cli.args, Some(&file))?;
        Ok(e.outputs
            .into_iter()
            .map(|(name, t)| (name, t.shape().dims().to_vec(), f32_bytes(&t)))
            .collect::<Vec<_>>())
    })
    .map_err(|f| f.into_py(py))?;
    Ok(outputs
        .into_iter()
        .map(|(n, s, b)| (n, s, PyBytes::new(py, &b).unbind()))
        .collect())
}

/// The arrays as one safetensors file in memory.
fn safetensors_bytes(arrays: Vec<Array>) -> Result<Vec<u8>, Failure> {
    use safetensors::tensor::{Dtype, TensorView};
    let mut views = Vec::new();
    for (name, dtype, shape, bytes) in &arrays {
        let dtype = match dtype.as_str() {
            "I64" => Dtype::I64,
            "I32" => Dtype::I32,
            "I16" => Dtype::I16,
            "I8" => Dtype::I8,
            "U8" => Dtype::U8,
            "BOOL" => Dtype::BOOL,
            "F64" => Dtype::F64,
            "F32" => Dtype::F32,
            "F16" => Dtype::F16,
            other => {
                return Err(Failure::Castor(
                    castor::CliError::InvalidInput(format!(
                        "`{name}`: arrays of {other} cannot be a model input (give integers)"
                    ))
                    .into(),
                ))
            }
        };
        let view = TensorView::new(dtype, shape.clone(), bytes).map_err(|e| {
            Failure::Castor(castor::CliError::InvalidInput(format!("`{name}`: {e}")).into())
        })?;
        views.push((name.clone(), view));
    }
    safetensors::serialize(views, None).map_err(|e| {
        Failure::Castor(castor::CliError::InvalidInput(format!("the input arrays: {e}")).into())
    })
}

/// `castor train` on `argv`. `callback(dict)` sees every logged step; a KeyboardInterrupt
/// (or an exception in the callback) finishes the step, saves as Ctrl-C does and is raised
/// after the run. Returns the run's figures as a dict.
#[pyfunction]
#[pyo3(signature = (argv, callback=None))]
fn _train(py: Python<'_>, argv: Vec<String>, callback: Option<Py<PyAny>>) -> PyResult<Py<PyDict>> {
    // The first exception seen during the run; it stops the run and is raised at its end.
    let raised: Arc<Mutex<Option<PyErr>>> = Arc::new(Mutex::new(None));
    let keep = |e: PyErr, raised: &Mutex<Option<PyErr>>| {
        if let Ok(mut slot) = raised.lock() {
            slot.get_or_insert(e);
        }
    };
    let on_step_raised = raised.clone();
    let stop_raised = raised.clone();
    let outcome = detached(py, move || {
        let (cli, matches) = parse::<TrainCli>(argv)?;
        let on_step: castor::training::step_loop::StepHook =
            Box::new(move |line: &serde_json::Value| {
                let Some(callback) = &callback else { return };
                Python::attach(|py| {
                    let result = py
                        .import("json")
                        .and_then(|json| json.call_method1("loads", (line.to_string(),)))
                        .and_then(|record| callback.call1(py, (record,)));
                    if let Err(e) = result {
                        keep(e, &on_step_raised);
                    }
                });
            });
        let stop = Box::new(move || {
            Python::attach(|py| {
                // Ctrl-C reaches Python's handler, which only flags it: look.
                if let Err(e) = py.check_signals() {
                    keep(e, &stop_raised);
                }
            });
            stop_raised.lock().map(|s| s.is_some()).unwrap_or(true)
        });
        let hooks = train::Hooks {
            on_step: Some(on_step),
            stop: Some(stop),
        };
        Ok(train::train(cli.args, &Given::new(matches), hooks)?)
    });
    if let Some(e) = raised.lock().ok().and_then(|mut s| s.take()) {
        return Err(e);
    }
    let o = outcome.map_err(|f| f.into_py(py))?;
    let d = PyDict::new(py);
    d.set_item("step", o.step)?;
    d.set_item("steps_done", o.steps_done)?;
    d.set_item("final_loss", o.final_loss)?;
    d.set_item("validation", o.validation)?;
    d.set_item("skipped", o.skipped)?;
    d.set_item("seconds", o.seconds)?;
    d.set_item("tokens_per_second", o.tokens_per_second)?;
    d.set_item("interrupted", o.interrupted)?;
    d.set_item("saved", o.saved.map(|p| p.display().to_string()))?;
    d.set_item("losses", o.losses)?;
    Ok(d.unbind())
}

/// A compiled plan: what `castor compile` decided, for one model and one set of flags.
#[pyclass(module = "castor", frozen)]
struct Plan {
    inner: compile::Compiled,
}

/// One node's precision decision, as `castor compile --explain` prints it.
#[pyclass(module = "castor", frozen)]
struct Decision {
    #[pyo3(get)]
    node: String,
    #[pyo3(get)]
    op: String,
    #[pyo3(get)]
    op_class: String,
    #[pyo3(get)]
    reads: Vec<(String, String)>,
    #[pyo3(get)]
    accumulates: Option<String>,
    #[pyo3(get)]
    writes: Vec<String>,
    #[pyo3(get)]
    why: String,
    /// The decision as `--explain` prints it.
    text: String,
}

#[pymethods]
impl Decision {
    fn __repr__(&self) -> String {
        format!(
            "Decision(node={:?}, op={:?}, op_class={:?}, writes={:?})",
            self.node, self.op, self.op_class, self.writes
        )
    }

    /// The decision as `--explain` prints it.
    fn __str__(&self) -> &str {
        &self.text
    }
}

impl Plan {
    fn emitted(&self, emit: compile::Emit) -> PyResult<Option<String>> {
        Python::attach(|py| {
            self.inner
                .emit(emit)
                .map_err(|e| Failure::Castor(e).into_py(py))
        })
    }
}

#[pymethods]
impl Plan {
    /// The report `castor compile` prints for these flags.
    #[getter]
    fn summary(&self) -> &str {
        &self.inner.report
    }

    /// Nodes computing in the low-precision dtype (the N of "converted N/M nodes").
    #[getter]
    fn converted(&self) -> usize {
        self.inner.summary().converted
    }

    /// Nodes with a float result, other than sources, casts and parameter copies (the M).
    #[getter]
    fn total(&self) -> usize {
        self.inner.summary().total
    }

    /// Cast nodes the passes inserted.
    #[getter]
    fn casts(&self) -> usize {
        self.inner.summary().cast_count()
    }

    /// Whether this is a training step (`train=True`, or a flag that implies it).
    #[getter]
    fn is_training(&self) -> bool {
        self.inner.plan.is_some()
    }

    /// The decisions of the nodes whose names match `glob` (`*` and `?`), in graph order.
    fn explain(&self, glob: &str) -> Vec<Decision> {
        castor::passes::decisions(&self.inner.graph, glob)
            .into_iter()
            .map(|d| Decision {
                text: d.to_string(),
                node: d.node,
                op: d.op,
                op_class: d.op_class.to_string(),
                reads: d
                    .reads
                    .into_iter()
                    .map(|(n, t)| (n, t.to_string()))
                    .collect(),
                accumulates: d.accumulates.map(|a| a.to_string()),
                writes: d.writes.into_iter().map(|t| t.to_string()).collect(),
                why: d.why,
            })
            .collect()
    }

    /// The IR text (`--emit ir`): the compiled graph, or the training step's graphs.
    #[getter]
    fn ir(&self) -> PyResult<Option<String>> {
        self.emitted(compile::Emit::Ir)
    }

    /// A Graphviz picture coloured by dtype (`--emit dot`).
    #[getter]
    fn dot(&self) -> PyResult<Option<String>> {
        self.emitted(compile::Emit::Dot)
    }

    /// The training plan as JSON (`--emit plan`, what `castor train --plan` runs), or None.
    #[getter]
    fn json(&self) -> PyResult<Option<String>> {
        self.emitted(compile::Emit::Plan)
    }

    /// The training step's memory by role in bytes, with `total` (the planned peak); None
    /// for a forward pass.
    #[getter]
    fn anatomy(&self) -> Option<BTreeMap<&'static str, u64>> {
        let (_, a) = self.inner.plan.as_ref()?;
        Some(BTreeMap::from([
            ("low_precision_weights", a.low_precision_weights),
            ("master_weights", a.master_weights),
            ("frozen_weights", a.frozen_weights),
            ("gradients", a.gradients),
            ("optimizer_state", a.optimizer_state),
            ("control", a.control),
            ("saved_activations", a.saved_activations),
            ("arena", a.memory.arena_bytes),
            ("workspace", a.memory.workspace),
            ("other", a.memory.other),
            ("total", a.total()),
        ]))
    }

    /// The cost model's estimate of the training step on the target GPU: FLOPs per token,
    /// estimated step time, MFU; None for a forward pass.
    #[getter]
    fn cost(&self, py: Python<'_>) -> PyResult<Option<Py<PyDict>>> {
        let Some(c) = self.inner.cost() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("gpu", &c.gpu.name)?;
        d.set_item("flops_per_token", c.flops_per_token())?;
        d.set_item("flops_per_token_rule", c.flops_per_token_rule())?;
        d.set_item("step_seconds", c.seconds())?;
        d.set_item("tokens_per_step", c.tokens)?;
        d.set_item("mfu", c.mfu())?;
        d.set_item("communication_seconds", c.communication_seconds())?;
        d.set_item("overlapped_step_seconds", c.overlapped_seconds())?;
        d.set_item("world_size", c.world_size)?;
        Ok(Some(d.unbind()))
    }

    /// Writes the plan to `path` (JSON) for `Plan.load`.
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let inner = &self.inner;
        detached(py, || Ok(inner.save(&path)?)).map_err(|f| f.into_py(py))
    }

    /// Reads a plan `Plan.save` wrote.
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf) -> PyResult<Plan> {
        detached(py, || {
            Ok(Plan {
                inner: compile::Compiled::load(&path)?,
            })
        })
        .map_err(|f| f.into_py(py))
    }

    fn __repr__(&self) -> String {
        let s = self.inner.summary();
        format!(
            "<castor.Plan {}: {}>",
            if self.inner.plan.is_some() {
                "training step"
            } else {
                "forward"
            },
            s.headline()
        )
    }
}

/// Where the lines the CLI would print go: `"logging"` (the `castor` logger: warnings and
/// errors at WARNING, everything else at INFO) or `"console"` (stdout and stderr, as the CLI).
#[pyfunction]
fn _set_output(mode: &str) -> PyResult<()> {
    let sink: Option<castor::out::Sink> = match mode {
        "console" => None,
        "logging" => Some(Arc::new(|_stream, line: &str| {
            Python::attach(|py| {
                let (level, text) = match line.split_once(": ") {
                    Some(("warning" | "error", rest)) => (30, rest),
                    _ => (20, line),
                };
                let _ = py
                    .import("logging")
                    .and_then(|l| l.call_method1("getLogger", ("castor",)))
                    .and_then(|logger| logger.call_method1("log", (level, text)));
            })
        })),
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "output goes to \"logging\" or \"console\", not {other:?}"
            )))
        }
    };
    castor::out::redirect(sink);
    Ok(())
}

/// `castor generate` on `argv`: the prompt and its continuation, the new token ids, and why
/// generation stopped.
#[pyfunction]
fn _generate(py: Python<'_>, argv: Vec<String>) -> PyResult<(String, Vec<u32>, String)> {
    detached(py, || {
        let (cli, _) = parse::<GenerateCli>(argv)?;
        let done = generate::generate(&cli.args, &mut |_| {})?;
        Ok((done.text, done.tokens, done.stopped))
    })
    .map_err(|f| f.into_py(py))
}

/// `castor merge` on `argv`.
#[pyfunction]
fn _merge(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    detached(py, || {
        let (cli, _) = parse::<MergeCli>(argv)?;
        Ok(merge::run(cli.args)?)
    })
    .map_err(|f| f.into_py(py))
}

/// An F32 tensor's values as little-endian bytes (what `numpy.frombuffer` reads).
fn f32_bytes(t: &castor::ir::Tensor) -> Vec<u8> {
    t.as_f32()
        .unwrap_or(&[])
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// Every tensor of a checkpoint folder (sharded or not) or of one safetensors file, as
/// (name, shape, F32 little-endian bytes), in name order.
#[pyfunction]
fn _load(py: Python<'_>, path: PathBuf) -> PyResult<Vec<Output>> {
    let tensors = detached(py, || {
        let read = |name: &str, t: Result<castor::ir::Tensor, castor::models::ModelError>| {
            let t = t.map_err(anyhow::Error::from)?;
            Ok::<_, Failure>((name.to_string(), t.shape().dims().to_vec(), f32_bytes(&t)))
        };
        let mut out = Vec::new();
        if path.is_dir() {
            let ckpt = castor::models::Checkpoint::open(&path).map_err(anyhow::Error::from)?;
            let mut names: Vec<&str> = ckpt.names().collect();
            names.sort_unstable();
            for name in names {
                out.push(read(name, ckpt.tensor_f32(name))?);
            }
        } else {
            let file = castor::models::SafetensorsFile::open(&path).map_err(anyhow::Error::from)?;
            let mut names: Vec<String> = file.names().map(str::to_string).collect();
            names.sort_unstable();
            for name in &names {
                out.push(read(name, file.tensor_f32(name))?);
            }
        }
        Ok(out)
    })
    .map_err(|f| f.into_py(py))?;
    Ok(tensors
        .into_iter()
        .map(|(n, s, b)| (n, s, PyBytes::new(py, &b).unbind()))
        .collect())
}

#[pymodule]
fn _castor(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(_inspect, m)?)?;
    m.add_function(wrap_pyfunction!(_compile, m)?)?;
    m.add_function(wrap_pyfunction!(_eval, m)?)?;
    m.add_function(wrap_pyfunction!(_train, m)?)?;
    m.add_function(wrap_pyfunction!(_generate, m)?)?;
    m.add_function(wrap_pyfunction!(_merge, m)?)?;
    m.add_function(wrap_pyfunction!(_load, m)?)?;
    m.add_function(wrap_pyfunction!(_set_output, m)?)?;
    m.add_class::<Plan>()?;
    m.add_class::<Decision>()?;
    Ok(())
}
