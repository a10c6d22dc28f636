//! cuDNN's fused attention on the device: the library found and checked before anything can
//! panic ([`probe`]), a handle on castor's stream, the operation graphs of `super::super::sdpa`
//! turned into backend descriptors one for one, engines chosen by cuDNN's heuristics and the
//! first plan that builds kept ([`Cudnn::plan`]), and a plan run on its tensors
//! ([`Cudnn::execute`]). A small wrapper of castor's own over the backend API's raw calls
//! (`cudarc::cudnn::sys`), in the manner of cudnn-frontend's SDPA nodes.
//!
//! Invariants: nothing calls into cuDNN before [`probe`] succeeded (cudarc's bindings abort
//! the process when the library or a symbol is missing); plans are built at load, outside
//! any CUDA-graph capture, and hold the by-value scalars they were built with, so a captured
//! execution reads them at the same addresses on every replay.

use super::cudnn_api::{self, api};
use crate::cuda::sdpa::{self, Binding, DqForm, ElemType, OpSpec, Pointwise, Sdpa};
use castor_ir::DType;
use cudarc::cudnn::sys;
use std::collections::HashMap;
use std::ffi::c_void;

/// The environment variable naming a folder that holds `libcudnn.so.9` (a toolkit's `lib` or
/// the `nvidia-cudnn-cu13` wheel's `nvidia/cudnn/lib`).
pub const CUDNN_DIR_VAR: &str = "CASTOR_CUDNN_DIR";

/// The oldest cuDNN with the fused attention graphs built here (sliding windows from 9.2).
const MIN_VERSION: usize = 90200;

/// Finds libcudnn (the folder `CASTOR_CUDNN_DIR` names, else `libcudnn.so.9` on the loader
/// path), loads it for every later call ([`cudnn_api`]) and returns its version
/// (`major * 10000 + minor * 100 + patch`), or why it cannot be used.
pub fn probe() -> Result<usize, String> {
    let dir = std::env::var_os(CUDNN_DIR_VAR).map(std::path::PathBuf::from);
    let api = cudnn_api::load(dir.as_deref())?;
    // SAFETY: cudnnGetVersion takes nothing and exists in every cuDNN.
    let version = unsafe { (api.get_version)() };
    if version < MIN_VERSION {
        return Err(format!(
            "cuDNN {} is too old for its fused attention graphs here (9.2 or newer)",
            version_name(version)
        ));
    }
    if (91000..91002).contains(&version) {
        return Err(format!(
            "cuDNN {} has known fused-attention bugs (use 9.10.2 or newer)",
            version_name(version)
        ));
    }
    Ok(version)
}

/// `90600` as `9.6.0`.
pub fn version_name(v: usize) -> String {
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

/// A cuDNN status as text, with the library's own last message.
fn check(status: sys::cudnnStatus_t, call: &str) -> Result<(), String> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let mut buf = [0 as std::ffi::c_char; 512];
    // SAFETY: the buffer is writable for its length.
    unsafe { (api().get_last_error_string)(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: cuDNN wrote a NUL-terminated string (or left the buffer zeroed).
    let last = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    Err(format!(
        "{call} returned {status:?}{}",
        if last.is_empty() {
            String::new()
        } else {
            format!(": {last}")
        }
    ))
}

/// A backend descriptor, destroyed when dropped.
struct Desc(sys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor and destroyed once.
        unsafe { (api().destroy_descriptor)(self.0) };
    }
}

use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendAttributeType_t as T;
use sys::cudnnBackendDescriptorType_t as D;

impl Desc {
    fn new(kind: D) -> Result<Desc, String> {
        let mut d = std::ptr::null_mut();
        // SAFETY: `d` receives a new descriptor.
        check(
            unsafe { (api().create_descriptor)(kind, &mut d) },
            &format!("cudnnBackendCreateDescriptor({kind:?})"),
        )?;
        Ok(Desc(d))
    }

    /// Sets attribute `name` to the `values`, whose element type `ty` names.
    fn set<V>(&self, name: A, ty: T, values: &[V]) -> Result<(), String> {
        // SAFETY: `values` holds `len` elements of the type `ty` names, read during the call.
        check(
            unsafe {
                (api().set_attribute)(
                    self.0,
                    name,
                    ty,
                    values.len() as i64,
                    values.as_ptr().cast::<c_void>(),
                )
            },
            &format!("setting {name:?}"),
        )
    }

    fn descs(&self, name: A, descs: &[&Desc]) -> Result<(), String> {
        let raw: Vec<sys::cudnnBackendDescriptor_t> = descs.iter().map(|d| d.0).collect();
        self.set(name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw)
    }

    fn finalize(&self, what: &str) -> Result<(), String> {
        // SAFETY: a live descriptor whose attributes were set.
        check(unsafe { (api().finalize)(self.0) }, what)
    }
}

fn data_type(e: ElemType, io: DType) -> sys::cudnnDataType_t {
    use sys::cudnnDataType_t::*;
    match e {
        ElemType::Io if io == DType::F16 => CUDNN_DATA_HALF,
        ElemType::Io => CUDNN_DATA_BFLOAT16,
        ElemType::F32 => CUDNN_DATA_FLOAT,
        ElemType::I32 => CUDNN_DATA_INT32,
        ElemType::Bool => CUDNN_DATA_BOOLEAN,
    }
}

fn mode(p: Pointwise) -> sys::cudnnPointwiseMode_t {
    use sys::cudnnPointwiseMode_t::*;
    match p {
        Pointwise::Add => CUDNN_POINTWISE_ADD,
        Pointwise::Sub => CUDNN_POINTWISE_SUB,
        Pointwise::Mul => CUDNN_POINTWISE_MUL,
        Pointwise::Div => CUDNN_POINTWISE_DIV,
        Pointwise::Exp => CUDNN_POINTWISE_EXP,
        Pointwise::Log => CUDNN_POINTWISE_LOG,
        Pointwise::CmpGe => CUDNN_POINTWISE_CMP_GE,
        Pointwise::CmpGt => CUDNN_POINTWISE_CMP_GT,
        Pointwise::CmpLt => CUDNN_POINTWISE_CMP_LT,
        Pointwise::LogicalAnd => CUDNN_POINTWISE_LOGICAL_AND,
        Pointwise::BinarySelect => CUDNN_POINTWISE_BINARY_SELECT,
        Pointwise::GenIndex { .. } => CUDNN_POINTWISE_GEN_INDEX,
        Pointwise::Identity => CUDNN_POINTWISE_IDENTITY,
    }
}

/// A built plan: its descriptor, the graph it runs (for the variant pack), the scalars it
/// reads by value, and which engine runs it.
pub(super) struct Plan {
    plan: Desc,
    graph: sdpa::Graph,
    /// The by-value scalars, in graph order: the addresses the plan reads (the vector is never
    /// resized after the plan is built, so they stay put).
    scalars: Vec<f32>,
    pub(super) deterministic: bool,
    /// How a backward's graph produces dQ (a forward's is `Direct`).
    pub(super) dq_form: DqForm,
    /// The engine, for the device line: `engine 8 (heuristics' 1st)`, and the heuristics'
    /// first plan that built when it was passed over as nondeterministic, and the graph's dQ
    /// accumulator where it has one.
    pub(super) engine: String,
}

/// Set to 1, the backward's graph sums dQ in an F32 accumulator ([`DqForm::Accumulated`], the
/// graph of cuDNN's flash backward, which cudnn-frontend builds by default on Hopper and
/// PyTorch runs) and the engine choice takes the heuristics' first plan that builds whether or
/// not it is deterministic: what the deterministic backward costs, measurable. Replays are then
/// no longer bit-identical.
pub const ANY_ENGINE_ENV: &str = "CASTOR_CUDNN_NONDETERMINISTIC";

/// Whether [`ANY_ENGINE_ENV`] asks for the heuristics' first engine: unset or `0` no, `1`
/// yes, anything else an error naming it.
pub(super) fn any_engine_requested() -> Result<bool, String> {
    sdpa::env_switch(ANY_ENGINE_ENV)
}

/// An engine's place in the heuristics' lists, for the device line.
fn engine_name(index: Option<i64>, mode: &str, rank: usize) -> String {
    let index = index.map_or("?".to_string(), |i| i.to_string());
    let nth = match rank {
        1 => "1st".to_string(),
        2 => "2nd".to_string(),
        3 => "3rd".to_string(),
        n => format!("{n}th"),
    };
    // The possessive: "heuristics' 1st", "fallback list's 2nd".
    let of = if mode.ends_with('s') { "'" } else { "'s" };
    format!("engine {index} ({mode}{of} {nth})")
}

/// An engine's name for the device line, with the first engine passed over because its plan
/// needed more workspace than the program's (a larger workspace would let it run).
fn passed_over(name: String, too_big: &Option<(String, i64)>, workspace: u64) -> String {
    match too_big {
        Some((first, bytes)) => format!(
            "{name}; {first} was passed over: it needs {bytes} bytes of workspace, the program \
             has {workspace}"
        ),
        None => name,
    }
}

#[cfg(test)]
#[test]
fn an_engine_passed_over_for_its_workspace_is_named() {
    let big = Some((engine_name(Some(9), "heuristics", 1), 1 << 30));
    assert_eq!(
        passed_over(engine_name(Some(3), "heuristics", 2), &big, 32 << 20),
        "engine 3 (heuristics' 2nd); engine 9 (heuristics' 1st) was passed over: it needs \
         1073741824 bytes of workspace, the program has 33554432"
    );
    assert_eq!(passed_over("engine 3".into(), &None, 1), "engine 3");
    assert_eq!(
        engine_name(None, "fallback list", 11),
        "engine ? (fallback list's 11th)"
    );
}

/// Plans are shared by calls with the same problem and layout.
type PlanKey = (sdpa::SdpaPass, sdpa::SdpaProblem, Vec<[i64; 4]>);

fn key(call: &Sdpa) -> PlanKey {
    let mut strides = vec![
        call.q.strides,
        call.k.strides,
        call.v.strides,
        call.o.strides,
    ];
    if let Some(g) = &call.grads {
        strides.extend([g.d_o.strides, g.dq.strides, g.dk.strides, g.dv.strides]);
    }
    (call.pass, call.problem, strides)
}

/// cuDNN on castor's stream: a handle and the plans built for a program.
pub(super) struct Cudnn {
    handle: sys::cudnnHandle_t,
    pub(super) version: usize,
    /// Take the heuristics' first engine whatever its determinism ([`ANY_ENGINE_ENV`]).
    pub(super) any_engine: bool,
    plans: HashMap<PlanKey, Plan>,
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created by cudnnCreate, destroyed once, after every plan of it.
        unsafe { (api().destroy)(self.handle) };
    }
}

impl Cudnn {
    /// A handle on the current context (after [`probe`]).
    pub(super) fn new(version: usize, any_engine: bool) -> Result<Cudnn, String> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: the library is present (probed); `handle` receives a new handle.
        check(unsafe { (api().create)(&mut handle) }, "cudnnCreate")?;
        Ok(Cudnn {
            handle,
            version,
            any_engine,
            plans: HashMap::new(),
        })
    }

    /// Builds (once per problem and layout) the plan of `call` that fits `workspace` bytes.
    pub(super) fn plan(&mut self, call: &Sdpa, workspace: u64) -> Result<&Plan, String> {
        let k = key(call);
        if !self.plans.contains_key(&k) {
            let plan = self.build(call, workspace)?;
            self.plans.insert(k.clone(), plan);
        }
        Ok(&self.plans[&k])
    }

    /// The plan built for `call`, if any.
    pub(super) fn built(&self, call: &Sdpa) -> Option<&Plan> {
        self.plans.get(&key(call))
    }

    fn build(&self, call: &Sdpa, workspace: u64) -> Result<Plan, String> {
        let dq_form = if self.any_engine && call.pass == sdpa::SdpaPass::Backward {
            DqForm::Accumulated
        } else {
            DqForm::Direct
        };
        let graph = sdpa::graph(call, dq_form, self.version)?;
        graph
            .check()
            .map_err(|e| format!("the attention graph: {e}"))?;
        let io = call.problem.dtype;
        let mut scalars = Vec::new();
        let mut tensors = Vec::with_capacity(graph.tensors.len());
        for t in &graph.tensors {
            let d = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
            d.set(
                A::CUDNN_ATTR_TENSOR_DATA_TYPE,
                T::CUDNN_TYPE_DATA_TYPE,
                &[data_type(t.elem, io)],
            )?;
            d.set(
                A::CUDNN_ATTR_TENSOR_DIMENSIONS,
                T::CUDNN_TYPE_INT64,
                &t.dims,
            )?;
            d.set(
                A::CUDNN_ATTR_TENSOR_STRIDES,
                T::CUDNN_TYPE_INT64,
                &t.strides,
            )?;
            d.set(
                A::CUDNN_ATTR_TENSOR_UNIQUE_ID,
                T::CUDNN_TYPE_INT64,
                &[t.uid],
            )?;
            d.set(
                A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
                T::CUDNN_TYPE_INT64,
                &[16i64],
            )?;
            match t.binding {
                Binding::Virtual => d.set(
                    A::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
                    T::CUDNN_TYPE_BOOLEAN,
                    &[true],
                )?,
                Binding::Scalar(v) => {
                    d.set(
                        A::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
                        T::CUDNN_TYPE_BOOLEAN,
                        &[true],
                    )?;
                    scalars.push(v);
                }
                Binding::Operand(_) => {}
            }
            d.finalize(&format!("the tensor `{}`", t.name))?;
            tensors.push(d);
        }
        let mut ops = Vec::with_capacity(graph.ops.len());
        // Operation descriptors keep their sub-descriptors alive until the graph is built.
        let mut parts = Vec::new();
        for op in &graph.ops {
            let d = match op {
                OpSpec::Matmul { a, b, c, overrides } => {
                    let mm = Desc::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
                    mm.set(
                        A::CUDNN_ATTR_MATMUL_COMP_TYPE,
                        T::CUDNN_TYPE_DATA_TYPE,
                        &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
                    )?;
                    mm.finalize("a matmul descriptor")?;
                    let d = Desc::new(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
                    d.descs(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[&tensors[*a]])?;
                    d.descs(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[&tensors[*b]])?;
                    d.descs(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[&tensors[*c]])?;
                    d.descs(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&mm])?;
                    // A padded graph's products take M, N or K per batch from the sequence
                    // lengths, as cudnn-frontend's SDPA nodes set them.
                    for (attr, t) in [
                        (
                            A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC,
                            overrides.m,
                        ),
                        (
                            A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC,
                            overrides.n,
                        ),
                        (
                            A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC,
                            overrides.k,
                        ),
                    ] {
                        if let Some(t) = t {
                            d.descs(attr, &[&tensors[t]])?;
                        }
                    }
                    parts.push(mm);
                    d
                }
                OpSpec::Pointwise {
                    mode: m,
                    inputs,
                    y,
                    compute,
                } => {
                    let pw = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
                    pw.set(
                        A::CUDNN_ATTR_POINTWISE_MODE,
                        T::CUDNN_TYPE_POINTWISE_MODE,
                        &[mode(*m)],
                    )?;
                    pw.set(
                        A::CUDNN_ATTR_POINTWISE_MATH_PREC,
                        T::CUDNN_TYPE_DATA_TYPE,
                        &[data_type(*compute, io)],
                    )?;
                    if let Pointwise::GenIndex { axis } = m {
                        pw.set(A::CUDNN_ATTR_POINTWISE_AXIS, T::CUDNN_TYPE_INT64, &[*axis])?;
                    }
                    pw.finalize("a pointwise descriptor")?;
                    let d = Desc::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
                    d.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
                    d.descs(
                        A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
                        &[&tensors[inputs[0]]],
                    )?;
                    if let Some(&b) = inputs.get(1) {
                        d.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[&tensors[b]])?;
                    }
                    if let Some(&t) = inputs.get(2) {
                        d.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &[&tensors[t]])?;
                    }
                    d.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[&tensors[*y]])?;
                    d.set(
                        A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1,
                        T::CUDNN_TYPE_FLOAT,
                        &[1f32],
                    )?;
                    d.set(
                        A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2,
                        T::CUDNN_TYPE_FLOAT,
                        &[1f32],
                    )?;
                    parts.push(pw);
                    d
                }
                OpSpec::Reduce { max, x, y } => {
                    let r = Desc::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
                    r.set(
                        A::CUDNN_ATTR_REDUCTION_COMP_TYPE,
                        T::CUDNN_TYPE_DATA_TYPE,
                        &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
                    )?;
                    let op = if *max {
                        sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX
                    } else {
                        sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD
                    };
                    r.set(
                        A::CUDNN_ATTR_REDUCTION_OPERATOR,
                        T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
                        &[op],
                    )?;
                    if self.version >= 91100 {
                        r.set(
                            A::CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC,
                            T::CUDNN_TYPE_BOOLEAN,
                            &[true],
                        )?;
                    }
                    r.finalize("a reduction descriptor")?;
                    let d = Desc::new(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
                    d.descs(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&r])?;
                    d.descs(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[&tensors[*x]])?;
                    d.descs(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[&tensors[*y]])?;
                    parts.push(r);
                    d
                }
                OpSpec::Reshape { x, y } => {
                    let d = Desc::new(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
                    d.descs(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[&tensors[*x]])?;
                    d.descs(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[&tensors[*y]])?;
                    d
                }
            };
            d.finalize("an operation descriptor")?;
            ops.push(d);
        }
        let op_graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        op_graph.descs(
            A::CUDNN_ATTR_OPERATIONGRAPH_OPS,
            &ops.iter().collect::<Vec<_>>(),
        )?;
        op_graph.set(
            A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
            T::CUDNN_TYPE_HANDLE,
            &[self.handle],
        )?;
        op_graph.finalize("the operation graph")?;
        let (plan, deterministic, engine) = self.choose(&op_graph, workspace)?;
        let engine = match dq_form {
            DqForm::Accumulated => format!("{engine}, dQ summed in an F32 accumulator"),
            DqForm::Direct => engine,
        };
        Ok(Plan {
            plan,
            graph,
            scalars,
            deterministic,
            dq_form,
            engine,
        })
    }

    /// The first engine configuration, by cuDNN's heuristics (mode A, then the fallback list),
    /// whose plan builds within `workspace` bytes, preferring deterministic engines (unless
    /// [`ANY_ENGINE_ENV`] is 1); with whether it is deterministic and its name.
    fn choose(&self, op_graph: &Desc, workspace: u64) -> Result<(Desc, bool, String), String> {
        let any_engine = self.any_engine;
        let mut last = "cuDNN's heuristics proposed no engine".to_string();
        let mut nondeterministic: Option<(Desc, String)> = None;
        // The first engine passed over for its workspace, which the device line names.
        let mut too_big: Option<(String, i64)> = None;
        let mut least = i64::MAX;
        for (heur_mode, mode) in [
            (sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A, "heuristics"),
            (
                sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
                "fallback list",
            ),
        ] {
            let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
            heur.descs(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[op_graph])?;
            heur.set(
                A::CUDNN_ATTR_ENGINEHEUR_MODE,
                T::CUDNN_TYPE_HEUR_MODE,
                &[heur_mode],
            )?;
            if let Err(e) = heur.finalize("the engine heuristics") {
                last = e;
                continue;
            }
            let mut count = 0i64;
            // SAFETY: asks for the count only (no elements written).
            check(
                unsafe {
                    (api().get_attribute)(
                        heur.0,
                        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                        0,
                        &mut count,
                        std::ptr::null_mut(),
                    )
                },
                "counting the heuristics' results",
            )?;
            let configs: Vec<Desc> = (0..count)
                .map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
                .collect::<Result<_, _>>()?;
            let mut raw: Vec<sys::cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
            let mut got = 0i64;
            // SAFETY: `raw` holds `count` created engine-config descriptors cuDNN fills.
            check(
                unsafe {
                    (api().get_attribute)(
                        heur.0,
                        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                        count,
                        &mut got,
                        raw.as_mut_ptr().cast::<c_void>(),
                    )
                },
                "reading the heuristics' results",
            )?;
            for (rank, config) in configs.iter().take(got.max(0) as usize).enumerate() {
                let engine = self.engine(config);
                let deterministic = !engine.as_ref().is_some_and(|e| self.nondeterministic(e));
                let name = engine_name(
                    engine.as_ref().and_then(|e| self.global_index(e)),
                    mode,
                    rank + 1,
                );
                let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
                plan.set(
                    A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                    T::CUDNN_TYPE_HANDLE,
                    &[self.handle],
                )?;
                plan.descs(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[config])?;
                if let Err(e) = plan.finalize("an execution plan") {
                    last = e;
                    continue;
                }
                let mut bytes = 0i64;
                let mut n = 0i64;
                // SAFETY: one INT64 written into `bytes`.
                check(
                    unsafe {
                        (api().get_attribute)(
                            plan.0,
                            A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                            T::CUDNN_TYPE_INT64,
                            1,
                            &mut n,
                            (&mut bytes as *mut i64).cast::<c_void>(),
                        )
                    },
                    "reading the plan's workspace size",
                )?;
                if bytes as u64 > workspace {
                    // The least any plan that builds needs: what the program would have to set
                    // aside.
                    least = least.min(bytes);
                    last = format!(
                        "the plans that build need at least {least} bytes of workspace, more \
                         than the program's {workspace}"
                    );
                    too_big.get_or_insert((name, bytes));
                    continue;
                }
                if deterministic || any_engine {
                    let name = match &nondeterministic {
                        Some((_, first)) => {
                            format!("{name}; the first that builds, {first}, is nondeterministic")
                        }
                        None => name,
                    };
                    return Ok((plan, deterministic, passed_over(name, &too_big, workspace)));
                }
                nondeterministic.get_or_insert((plan, name));
            }
        }
        match nondeterministic {
            Some((plan, name)) => Ok((plan, false, passed_over(name, &too_big, workspace))),
            None => Err(last),
        }
    }

    /// The engine of `config`.
    fn engine(&self, config: &Desc) -> Option<Desc> {
        let engine = Desc::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR).ok()?;
        let mut n = 0i64;
        let mut raw = [engine.0];
        // SAFETY: one descriptor written into the created engine descriptor.
        let got = unsafe {
            (api().get_attribute)(
                config.0,
                A::CUDNN_ATTR_ENGINECFG_ENGINE,
                T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                1,
                &mut n,
                raw.as_mut_ptr().cast::<c_void>(),
            )
        };
        (got == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS).then_some(engine)
    }

    /// cuDNN's global index of `engine` (what its API log and the frontend call the engine).
    fn global_index(&self, engine: &Desc) -> Option<i64> {
        let (mut index, mut n) = (0i64, 0i64);
        // SAFETY: one INT64 written into `index`.
        let got = unsafe {
            (api().get_attribute)(
                engine.0,
                A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX,
                T::CUDNN_TYPE_INT64,
                1,
                &mut n,
                (&mut index as *mut i64).cast::<c_void>(),
            )
        };
        (got == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS && n == 1).then_some(index)
    }

    /// Whether `engine` says its results depend on timing.
    fn nondeterministic(&self, engine: &Desc) -> bool {
        // Read as plain integers: a newer cuDNN may return notes this binding has no name for.
        let mut notes = [0u32; 16];
        let mut count = 0i64;
        // SAFETY: at most 16 four-byte notes written into `notes`.
        let ok = unsafe {
            (api().get_attribute)(
                engine.0,
                A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                T::CUDNN_TYPE_NUMERICAL_NOTE,
                notes.len() as i64,
                &mut count,
                notes.as_mut_ptr().cast::<c_void>(),
            )
        };
        ok == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS
            && notes[..count.clamp(0, 16) as usize].contains(
                &(sys::cudnnBackendNumericalNote_t::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC as u32),
            )
    }

    /// What must be zeroed before `call`'s plan runs: the F32 dQ accumulator of an
    /// accumulating backward, where cuDNN predates 9.6 (from 9.6 on the plan zeroes it itself,
    /// as cudnn-frontend relies on).
    pub(super) fn zeroed_first(&self, call: &Sdpa) -> Option<(crate::cuda::program::Place, u64)> {
        let plan = self.built(call)?;
        let grads = call.grads.as_ref()?;
        (plan.dq_form == DqForm::Accumulated && self.version < 90600)
            .then(|| (grads.dq_accum, call.dq_accum_bytes()))
    }

    /// Runs `call`'s plan on `stream`: `address` gives each place's device address.
    ///
    /// # Safety
    /// Every place of `call` addresses live device memory of the context the handle was made
    /// in, as large as the call's extents; `workspace` holds the plan's workspace bytes.
    pub(super) unsafe fn execute(
        &self,
        call: &Sdpa,
        address: &dyn Fn(crate::cuda::program::Place) -> u64,
        workspace: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), String> {
        let plan = self
            .built(call)
            .ok_or_else(|| format!("no cuDNN plan was built for %{}", call.node))?;
        let places = call.places();
        let mut uids = Vec::new();
        let mut pointers: Vec<*mut c_void> = Vec::new();
        let mut scalar = plan.scalars.iter();
        for (i, binding) in plan.graph.bound() {
            let pointer = match binding {
                Binding::Operand(role) => {
                    let place = places
                        .iter()
                        .find(|(r, _)| *r == role)
                        .map(|(_, p)| *p)
                        .ok_or_else(|| format!("the call has no `{role}` tensor"))?;
                    std::ptr::without_provenance_mut(address(place) as usize)
                }
                Binding::Scalar(_) => {
                    let value = scalar.next().ok_or("a scalar without its value")?;
                    (value as *const f32).cast_mut().cast::<c_void>()
                }
                Binding::Virtual => continue,
            };
            uids.push(plan.graph.tensors[i].uid);
            pointers.push(pointer);
        }
        let pack = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        let ws: *mut c_void = std::ptr::without_provenance_mut(workspace as usize);
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            T::CUDNN_TYPE_VOID_PTR,
            &[ws],
        )?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            T::CUDNN_TYPE_VOID_PTR,
            &pointers,
        )?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            T::CUDNN_TYPE_INT64,
            &uids,
        )?;
        pack.finalize("the variant pack")?;
        // SAFETY: the handle is live; the stream is this context's (cuDNN's own stream type
        // is the same opaque CUstream).
        check(
            unsafe { (api().set_stream)(self.handle, stream as sys::cudaStream_t) },
            "cudnnSetStream",
        )?;
        // SAFETY: the plan and pack are live and finalized; the caller vouches for the memory.
        check(
            unsafe { (api().execute)(self.handle, plan.plan.0, pack.0) },
            &format!("cudnnBackendExecute for %{}", call.node),
        )
    }
}
