//! A lowered graph: the exact sequence of device commands one run performs, as plain data.
//!
//! The lowering ([`super::lower`]) decides everything: which kernel runs each node, with
//! which launch shape and arguments, where every buffer lives (an offset in the one arena,
//! or a persistent slot), which matrix products cuBLAS runs and how. The device layer
//! ([`super::device`]) only resolves addresses and issues the commands. Keeping the program
//! as data means it is built, inspected and checked (argument lists against the kernels'
//! C signatures, buffers against their sizes) on machines without a GPU.

use super::kernel_id::KernelId;
use castor_ir::{DType, TensorType};

/// Where a buffer is: an offset into the arena, or into a persistent slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    /// Transient: `offset` bytes into the arena.
    Arena { offset: u64 },
    /// `offset` bytes into persistent slot `slot` (a state entry, a bound tensor, an input).
    Slot { slot: usize, offset: u64 },
    /// `offset` bytes into arena buffer `buffer` before the arena is placed: only inside the
    /// lowering, which resolves every one to [`Place::Arena`]; a program holds none (the
    /// device's check and the emulator refuse one).
    Buffer { buffer: BufferId, offset: u64 },
}

/// An arena buffer of a run being lowered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferId(pub u32);

impl Place {
    /// The place `bytes` further on.
    pub fn plus(self, bytes: u64) -> Place {
        match self {
            Place::Arena { offset } => Place::Arena {
                offset: offset + bytes,
            },
            Place::Buffer { buffer, offset } => Place::Buffer {
                buffer,
                offset: offset + bytes,
            },
            Place::Slot { slot, offset } => Place::Slot {
                slot,
                offset: offset + bytes,
            },
        }
    }
}

/// One persistent buffer: a state entry, a bound parameter, a graph input, or a small
/// buffer the program itself needs (error flags, the loss, RoPE tables).
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    pub name: String,
    pub bytes: u64,
    pub kind: SlotKind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum SlotKind {
    /// Bound by name before the first run (state, parameters), with this type.
    Bound(TensorType),
    /// Copied from the host before every run (the batch, the learning rate).
    Input(TensorType),
    /// The program's own: zeroed once at load.
    Internal,
    /// The program's own, with these bytes uploaded once at load (RoPE tables).
    Constant(Vec<u8>),
}

/// A by-value kernel argument describing a strided copy (`CopyLayout` in `layout.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CopyLayout {
    /// The copied block's shape, outermost first; unused dims are 1.
    pub shape: [i64; MAX_RANK],
    /// Element strides of the source along each dim (0 broadcasts).
    pub src_stride: [i64; MAX_RANK],
    /// Element strides of the destination along each dim.
    pub dst_stride: [i64; MAX_RANK],
    pub src_offset: i64,
    pub dst_offset: i64,
    pub rank: i32,
    pub pad: i32,
}

/// The most dims a strided copy describes.
pub const MAX_RANK: usize = 8;

/// One kernel argument, in the kernel's parameter order.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// A device pointer.
    Ptr(Place),
    /// A null pointer (an optional operand not used).
    Null,
    I32(i32),
    I64(i64),
    U16(u16),
    U32(u32),
    U64(u64),
    F64(f64),
    /// The device address of table `index` of [`Program::tables`].
    Table(usize),
    /// A strided-copy description, by value.
    Layout(CopyLayout),
}

/// One field of a device table (the per-tensor structs of the multi-tensor kernels).
#[derive(Clone, Debug, PartialEq)]
pub enum Field {
    Ptr(Place),
    Null,
    I32(i32),
    I64(i64),
    F64(f64),
}

impl Field {
    pub fn bytes(&self) -> usize {
        match self {
            Field::I32(_) => 4,
            _ => 8,
        }
    }
}

/// A constant table in device memory.
#[derive(Clone, Debug, PartialEq)]
pub enum Table {
    /// Rows of fields, each row laid out as its C struct (fields in order, naturally aligned;
    /// every struct here is made of 8-byte fields or pairs of 4-byte ones, so there is no
    /// padding to insert).
    Rows(Vec<Vec<Field>>),
    /// The chunk rows of a multi-tensor kernel, `{i32 tensor, i32 len, i64 start}` for each
    /// piece of at most `chunk` elements of each tensor in turn, kept as the tensors' sizes:
    /// a 70B-parameter model has millions of such rows, which are only made when the table is
    /// encoded for a device.
    Chunks { numels: Vec<u64>, chunk: u64 },
}

impl Default for Table {
    fn default() -> Table {
        Table::Rows(Vec::new())
    }
}

impl Table {
    /// The chunk table of tensors of `numels` elements.
    pub fn chunks(numels: Vec<u64>, chunk: u64) -> Table {
        Table::Chunks {
            numels,
            chunk: chunk.max(1),
        }
    }

    /// Rows in the table.
    pub fn len(&self) -> usize {
        match self {
            Table::Rows(rows) => rows.len(),
            Table::Chunks { numels, chunk } => {
                numels.iter().map(|n| n.div_ceil(*chunk) as usize).sum()
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the encoded table.
    pub fn byte_len(&self) -> usize {
        match self {
            Table::Rows(rows) => rows.iter().flatten().map(Field::bytes).sum(),
            Table::Chunks { .. } => 16 * self.len(),
        }
    }

    /// The fields of every row (none for a chunk table, which holds no address).
    pub fn fields(&self) -> impl Iterator<Item = &Field> {
        let rows: &[Vec<Field>] = match self {
            Table::Rows(rows) => rows,
            Table::Chunks { .. } => &[],
        };
        rows.iter().flatten()
    }

    /// The fields of every row, to rewrite places.
    pub fn fields_mut(&mut self) -> impl Iterator<Item = &mut Field> {
        let rows: &mut [Vec<Field>] = match self {
            Table::Rows(rows) => rows,
            Table::Chunks { .. } => &mut [],
        };
        rows.iter_mut().flatten()
    }

    /// The table as bytes, with `address` resolving places.
    pub fn encode(&self, address: &dyn Fn(Place) -> u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.byte_len());
        match self {
            Table::Rows(rows) => {
                for f in rows.iter().flatten() {
                    match f {
                        Field::Ptr(p) => out.extend(address(*p).to_le_bytes()),
                        Field::Null => out.extend(0u64.to_le_bytes()),
                        Field::I32(x) => out.extend(x.to_le_bytes()),
                        Field::I64(x) => out.extend(x.to_le_bytes()),
                        Field::F64(x) => out.extend(x.to_le_bytes()),
                    }
                }
            }
            Table::Chunks { numels, chunk } => {
                for (t, &numel) in numels.iter().enumerate() {
                    let mut start = 0u64;
                    while start < numel {
                        let len = (*chunk).min(numel - start);
                        out.extend((t as i32).to_le_bytes());
                        out.extend((len as i32).to_le_bytes());
                        out.extend((start as i64).to_le_bytes());
                        start += len;
                    }
                }
            }
        }
        out
    }
}

/// How cuBLAS computes a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmCompute {
    /// F32 accumulation, F32 multiplies (TF32 tensor cores off).
    F32,
    /// F32 accumulation with TF32 multiplies (the `tf32` policy only).
    Tf32,
}

/// A batched matrix product in cuBLAS's column-major terms:
/// `C[i] = op(A[i]) · op(B[i])` for `i < batch`, `C` being `m x n` with leading dimension
/// `ldc`. The lowering maps the IR's row-major `a @ b` to `Cᵀ = bᵀ · aᵀ` (so cuBLAS's `A`
/// is the IR's `b`).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemm {
    pub node: String,
    pub a: Place,
    pub b: Place,
    pub c: Place,
    pub a_dtype: DType,
    pub b_dtype: DType,
    pub c_dtype: DType,
    pub transa: bool,
    pub transb: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub lda: i64,
    pub ldb: i64,
    pub ldc: i64,
    /// Element strides between batch entries (0: the same matrix for every entry).
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_c: i64,
    pub batch: i32,
    pub compute: GemmCompute,
    /// `C += op(A) op(B)` (cuBLAS's beta = 1) instead of `C = op(A) op(B)`: a product summed
    /// over chunks (the fused classifier's weight gradient).
    pub accumulate: bool,
    /// cuBLAS's alpha, the F32 product's factor before the epilogue and the store: 1 but for a
    /// product that absorbed a scale (`matmul_scaled`).
    pub alpha: f32,
    /// What the product does in its accumulator before storing C (a cuBLASLt epilogue).
    pub epilogue: Epilogue,
    /// An FP8 product (cuBLASLt): its operands' dequantization factors in device memory.
    pub fp8: Option<Fp8Scales>,
}

/// The scale pointers of an FP8 product, `C = (a_scale · b_scale) · op(A) op(B)` with the sum
/// in F32 (cuBLASLt's `D = scale_A · scale_B · op(A) op(B)` for a BF16, F16 or F32 D, which
/// has no D scale or amax). Each points at one F32 in device memory, written on the device
/// before the product (`fp8_dequantization` in `fp8.cu`: the reciprocal of the operand's
/// quantization scale), so a captured graph reads each step's scales.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Scales {
    /// `CUBLASLT_MATMUL_DESC_A_SCALE_POINTER`: A's factor.
    pub a_scale: Place,
    /// `CUBLASLT_MATMUL_DESC_B_SCALE_POINTER`: B's factor.
    pub b_scale: Place,
    /// `CUBLASLT_MATMUL_DESC_FAST_ACCUM`. Off in castor's products: with it on, Hopper's FP8
    /// tensor cores keep partial sums in their own reduced-precision accumulator over the
    /// whole inner dimension; off, cuBLASLt promotes them to F32 at intervals, which is the
    /// F32 sum the CPU executor computes (Transformer Engine turns it on for forward products
    /// only, trading accuracy for speed; castor's gradients and loss are checked against the
    /// CPU executor, so it is off everywhere).
    pub fast_accum: bool,
}

impl Fp8Scales {
    /// The scale pointers: name, place (one F32 each).
    pub fn buffers(&self) -> [(&'static str, Place); 2] {
        [("a_scale", self.a_scale), ("b_scale", self.b_scale)]
    }
}

/// The byte offset of `p` in its buffer (buffers start 256-byte aligned).
fn offset_of(p: Place) -> u64 {
    match p {
        Place::Arena { offset } | Place::Slot { offset, .. } | Place::Buffer { offset, .. } => {
            offset
        }
    }
}

/// The multiple cuBLASLt's FP8 products need, in bytes, of every pointer and leading
/// dimension and of the inner and output dimensions (its Tensor Core rules, which the FP8
/// kernels require).
pub const FP8_ALIGN: u64 = 16;

/// A cuBLASLt epilogue: work done on the F32 accumulator of a single product (`batch` 1)
/// before C is stored, so it costs no pass over memory and C is rounded once. Vectors hold
/// one value per row of C in cuBLAS's column-major terms (`m` values: one per output column
/// of the IR's row-major product); the auxiliary matrix has C's shape, type and `ldc`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Epilogue {
    /// `C = acc`.
    #[default]
    None,
    /// `C = acc + bias` (`BIAS`; the bias in C's type).
    Bias { bias: Place },
    /// `aux = acc + bias`, `C = gelu_tanh(acc + bias)` (`GELU_AUX_BIAS`).
    BiasGelu { bias: Place, aux: Place },
    /// `C = gelu_tanh'(aux) · acc` (`DGELU`). Not `DGELU_BGRAD`: its bias gradient has C's
    /// type, and castor's are F32 (a `BiasGradA`/`BiasGradB` product sums them).
    GeluGrad { aux: Place },
    /// `C = acc`, `bias_grad` (F32, `m` values) = the sum of `op(A)` over the inner dim
    /// (`BGRADA`: A holds the output gradient of a weight gradient).
    BiasGradA { bias_grad: Place },
    /// `C = acc`, `bias_grad` (F32, `n` values) = the sum of `op(B)` over the inner dim
    /// (`BGRADB`).
    BiasGradB { bias_grad: Place },
}

/// How an epilogue buffer is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EpilogueUse {
    /// A vector of `m` values (bias or bias gradient).
    Vector,
    /// A vector of `n` values (the bias gradient of B).
    VectorN,
    /// A matrix shaped and laid out as C.
    Matrix,
}

impl Epilogue {
    /// Its buffers: name, place, shape, element type, written (else read).
    pub fn buffers(&self, c_dtype: DType) -> Vec<(&'static str, Place, EpilogueUse, DType, bool)> {
        match *self {
            Epilogue::None => vec![],
            Epilogue::Bias { bias } => vec![("bias", bias, EpilogueUse::Vector, c_dtype, false)],
            Epilogue::BiasGelu { bias, aux } => vec![
                ("bias", bias, EpilogueUse::Vector, c_dtype, false),
                ("aux", aux, EpilogueUse::Matrix, c_dtype, true),
            ],
            Epilogue::GeluGrad { aux } => vec![("aux", aux, EpilogueUse::Matrix, c_dtype, false)],
            Epilogue::BiasGradA { bias_grad } => {
                vec![(
                    "bias_grad",
                    bias_grad,
                    EpilogueUse::Vector,
                    DType::F32,
                    true,
                )]
            }
            Epilogue::BiasGradB { bias_grad } => {
                vec![(
                    "bias_grad",
                    bias_grad,
                    EpilogueUse::VectorN,
                    DType::F32,
                    true,
                )]
            }
        }
    }

    /// The same epilogue with every place mapped by `f`.
    pub fn map(self, f: &dyn Fn(Place) -> Place) -> Epilogue {
        match self {
            Epilogue::None => Epilogue::None,
            Epilogue::Bias { bias } => Epilogue::Bias { bias: f(bias) },
            Epilogue::BiasGelu { bias, aux } => Epilogue::BiasGelu {
                bias: f(bias),
                aux: f(aux),
            },
            Epilogue::GeluGrad { aux } => Epilogue::GeluGrad { aux: f(aux) },
            Epilogue::BiasGradA { bias_grad } => Epilogue::BiasGradA {
                bias_grad: f(bias_grad),
            },
            Epilogue::BiasGradB { bias_grad } => Epilogue::BiasGradB {
                bias_grad: f(bias_grad),
            },
        }
    }

    /// cuBLASLt's name for it, as the listing prints it.
    pub fn name(&self) -> &'static str {
        match self {
            Epilogue::None => "default",
            Epilogue::Bias { .. } => "bias",
            Epilogue::BiasGelu { .. } => "gelu_aux_bias",
            Epilogue::GeluGrad { .. } => "dgelu",
            Epilogue::BiasGradA { .. } => "bgrada",
            Epilogue::BiasGradB { .. } => "bgradb",
        }
    }
}

impl Gemm {
    /// The epilogue's buffers with their extents in bytes, or why cuBLASLt refuses them: an
    /// epilogue needs a single product (`batch` 1) that overwrites C.
    pub fn epilogue_extents(&self) -> Result<Vec<(&'static str, Place, u64, bool)>, String> {
        if self.epilogue == Epilogue::None {
            return Ok(vec![]);
        }
        if self.batch != 1 || self.accumulate {
            return Err(format!(
                "the {} epilogue needs one product that overwrites C (batch {}, accumulate {})",
                self.epilogue.name(),
                self.batch,
                self.accumulate
            ));
        }
        let (m, n) = (self.m.max(0) as u64, self.n.max(0) as u64);
        Ok(self
            .epilogue
            .buffers(self.c_dtype)
            .into_iter()
            .map(|(name, place, usage, dtype, written)| {
                let elems = match usage {
                    EpilogueUse::Vector => m,
                    EpilogueUse::VectorN => n,
                    EpilogueUse::Matrix if m * n == 0 => 0,
                    EpilogueUse::Matrix => (n - 1) * self.ldc.max(0) as u64 + m,
                };
                (name, place, elems * dtype.size_bytes() as u64, written)
            })
            .collect())
    }

    /// The operands' extents in bytes, `(a, b, c)` from their places in column-major terms,
    /// or why cuBLAS refuses the call: `cublasGemmEx`'s type table for the 32-bit compute
    /// types (A and B of one type, C of that type or F32, F32 operands only into F32, TF32
    /// only for F32), negative sizes or strides, leading dimensions below the rows an operand
    /// stores, and batch entries whose outputs overlap. The device checks every product with
    /// it before issuing, and the emulator before computing.
    pub fn check(&self) -> Result<(u64, u64, u64), String> {
        let g = self;
        if let Some(scales) = &g.fp8 {
            g.check_fp8(scales)?;
            return g.extents();
        }
        let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
        let types_ok = float(g.a_dtype)
            && float(g.c_dtype)
            && g.a_dtype == g.b_dtype
            && (g.c_dtype == g.a_dtype || g.c_dtype == DType::F32)
            && (g.a_dtype != DType::F32 || g.c_dtype == DType::F32)
            && (g.compute != GemmCompute::Tf32 || g.a_dtype == DType::F32);
        if !types_ok {
            return Err(format!(
                "cuBLAS has no product of {} x {} into {} with {:?} compute",
                g.a_dtype, g.b_dtype, g.c_dtype, g.compute
            ));
        }
        g.extents()
    }

    /// cuBLASLt's rules for an FP8 product (cuBLAS's `cublasLtMatmul` documentation): FP8
    /// A and B (not both E5M2) into BF16, F16 or F32 with F32 compute; A transposed and B
    /// not (the "TN" form: both operands contiguous along the inner dim); every pointer and
    /// leading dimension a multiple of 16 bytes, the inner dim `k` and `m` (the IR product's
    /// output columns) multiples of 16. castor's FP8 products are single products (`batch` 1, no epilogue,
    /// alpha 1, C overwritten).
    fn check_fp8(&self, scales: &Fp8Scales) -> Result<(), String> {
        let g = self;
        let out_ok = matches!(g.c_dtype, DType::BF16 | DType::F16 | DType::F32);
        let both_e5m2 = g.a_dtype == DType::F8E5M2 && g.b_dtype == DType::F8E5M2;
        if !g.a_dtype.is_fp8() || !g.b_dtype.is_fp8() || both_e5m2 || !out_ok {
            return Err(format!(
                "cuBLASLt has no FP8 product of {} x {} into {}",
                g.a_dtype, g.b_dtype, g.c_dtype
            ));
        }
        if g.compute != GemmCompute::F32 {
            return Err("cuBLASLt's FP8 products compute in F32".into());
        }
        if !g.transa || g.transb {
            return Err(format!(
                "cuBLASLt's FP8 products take A transposed and B not (the \"TN\" form, both \
                 operands contiguous along the inner dim), found transa={} transb={}",
                g.transa, g.transb
            ));
        }
        if g.batch != 1 || g.accumulate || g.epilogue != Epilogue::None || g.alpha != 1.0 {
            return Err(format!(
                "an FP8 product is one product that overwrites C, without epilogue or alpha \
                 (batch {}, accumulate {}, epilogue {}, alpha {})",
                g.batch,
                g.accumulate,
                g.epilogue.name(),
                g.alpha
            ));
        }
        let c_size = g.c_dtype.size_bytes() as u64;
        for (name, place) in [("A", g.a), ("B", g.b), ("C", g.c)] {
            if !offset_of(place).is_multiple_of(FP8_ALIGN) {
                return Err(format!(
                    "{name} starts {} bytes into its buffer: cuBLASLt's FP8 products need \
                     16-byte aligned operands",
                    offset_of(place)
                ));
            }
        }
        for (name, place) in scales.buffers() {
            if !offset_of(place).is_multiple_of(4) {
                return Err(format!("the {name} pointer is not 4-byte aligned"));
            }
        }
        for (what, value, bytes) in [
            ("k (the inner dim)", i64::from(g.k), 1),
            ("m (the output's columns)", i64::from(g.m), 1),
            ("lda", g.lda, 1),
            ("ldb", g.ldb, 1),
            ("ldc", g.ldc, c_size),
        ] {
            if !(value.max(0) as u64 * bytes).is_multiple_of(FP8_ALIGN) {
                return Err(format!(
                    "{what} = {value}: cuBLASLt's FP8 products need it a multiple of {}",
                    FP8_ALIGN / bytes
                ));
            }
        }
        Ok(())
    }

    /// The operands' extents in bytes, `(a, b, c)`, or why cuBLAS refuses their sizes.
    fn extents(&self) -> Result<(u64, u64, u64), String> {
        let g = self;
        let (m, n, k, batch) = (
            i128::from(g.m),
            i128::from(g.n),
            i128::from(g.k),
            i128::from(g.batch),
        );
        if m < 0 || n < 0 || k < 0 || batch < 0 {
            return Err(format!("negative size m={m} n={n} k={k} batch={batch}"));
        }
        // (rows, cols) as stored, leading dimension, batch stride, element size.
        let operand = |name: &str, rows: i128, cols: i128, ld: i64, stride: i64, d: DType| {
            let (ld, stride) = (i128::from(ld), i128::from(stride));
            if ld < rows.max(1) {
                return Err(format!(
                    "ld{name} = {ld} is less than the {rows} rows {name} stores (cuBLAS refuses the call)"
                ));
            }
            if stride < 0 {
                return Err(format!("stride_{name} = {stride} is negative"));
            }
            let one = if rows == 0 || cols == 0 {
                0
            } else {
                (cols - 1) * ld + rows
            };
            let elems = if one == 0 || batch == 0 {
                0
            } else {
                (batch - 1) * stride + one
            };
            u64::try_from(elems * d.size_bytes() as i128)
                .map_err(|_| format!("operand {name} spans more than 2^64 bytes"))
        };
        let (ar, ac) = if g.transa { (k, m) } else { (m, k) };
        let (br, bc) = if g.transb { (n, k) } else { (k, n) };
        let extents = (
            operand("a", ar, ac, g.lda, g.stride_a, g.a_dtype)?,
            operand("b", br, bc, g.ldb, g.stride_b, g.b_dtype)?,
            operand("c", m, n, g.ldc, g.stride_c, g.c_dtype)?,
        );
        let ldc_n = i128::from(g.ldc) * n;
        if batch > 1 && i128::from(g.stride_c) < ldc_n && m * n > 0 {
            return Err(format!(
                "stride_c {} < ldc * n = {ldc_n}: the batch entries' outputs overlap",
                g.stride_c
            ));
        }
        Ok(extents)
    }
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// The node (value name) this launch belongs to, for errors and profiles.
    pub node: String,
    /// Index into [`Program::modules`].
    pub module: usize,
    /// The hand-written kernel it runs, typed; `None` for a kernel the lowering generated.
    pub kernel: Option<KernelId>,
    /// The entry point's name in its module: `kernel`'s [`KernelId::entry`], or the generated
    /// kernel's name. What the device loads and the listing prints.
    pub entry: String,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
    pub args: Vec<Arg>,
}

/// One device command.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    Launch(Launch),
    Gemm(Gemm),
    /// Device-to-device copy.
    Copy {
        dst: Place,
        src: Place,
        bytes: u64,
    },
    /// Sets `bytes` bytes to `byte`.
    Memset {
        dst: Place,
        bytes: u64,
        byte: u8,
    },
    /// A collective of a data-parallel group (`op`: all-reduce, reduce-scatter, all-gather,
    /// or a rank's shard) of `dtype` values, `src_bytes` read at `src`, `dst_bytes` written
    /// at `dst`: NCCL's work (`cuda::nccl`), issued by the device layer of a rank that holds
    /// a communicator.
    Collective {
        node: String,
        op: castor_ir::Op,
        dtype: castor_ir::DType,
        src: Place,
        dst: Place,
        src_bytes: u64,
        dst_bytes: u64,
        /// `Some(k)`: issued on the side stream, after everything issued so far on the
        /// compute stream, its completion recorded as side event `k` (a gradient's reduction,
        /// overlapping the rest of the backward); `None`: on the compute stream, in order.
        side: Option<usize>,
    },
    /// The compute stream waits for side events `events`: before the first command that
    /// reads a side collective's result or reuses its operand's memory, and at the end of
    /// the run.
    Join {
        events: Vec<usize>,
    },
    /// A fused attention pass run by cuDNN (`super::sdpa`), or by its fallback commands where
    /// cuDNN does not run it.
    Sdpa(Box<super::sdpa::Sdpa>),
}

/// A CUDA C module to compile with NVRTC: a file of `kernels/` or the generated kernels.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Module {
    /// The name the PTX cache files it under (the file name, or the generated kernel's).
    pub name: String,
    pub source: String,
    /// The generated kernels it defines (empty for a file of `kernels/`, whose entry points
    /// `crate::cuda::families::files()` lists).
    pub generated: Vec<GeneratedKernel>,
}

/// A generated pointwise kernel, `entry(const T* in0, .., T* out0, .., i64 n)`: each output
/// holds `n` elements, each input what [`InputExtent`] says. The emulator checks launches
/// against this (the C signature gives the dtypes, not how much a broadcast operand holds).
#[derive(Clone, Debug, PartialEq)]
pub struct GeneratedKernel {
    pub entry: String,
    pub inputs: Vec<InputExtent>,
    /// The kernel takes an amax: its last pointer holds one partial maximum per block.
    pub partials: bool,
}

/// The elements a generated kernel's input holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputExtent {
    /// As many as the output (`n`, the launch's last argument).
    Full,
    /// A fixed count (a broadcast operand; 1 for a scalar).
    Elements(u64),
}

/// A graph output the host can read back.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    pub name: String,
    pub ty: TensorType,
    pub place: Place,
}

/// A check the kernels report through an `int` flag that the host initializes to `INT_MAX`
/// and reads back with the outputs: the smallest bad position, if any.
#[derive(Clone, Debug, PartialEq)]
pub struct ErrorFlag {
    pub node: String,
    pub kind: FlagKind,
    /// What was out of range: `"token id"`, `"label"` (for [`FlagKind::Range`]).
    pub what: &'static str,
    pub place: Place,
    /// The tensor the position refers to: the index tensor, or the key-padding flags.
    pub indices: Place,
    /// The range the indices must be in, or the keys of a row of flags.
    pub limit: usize,
    /// An index value allowed outside the range (cross-entropy's `ignore_index`).
    pub ignore: Option<i64>,
    /// Positions of the whole index tensor before `indices` (a chunk's first row): added to
    /// the position the kernel reports.
    pub first: usize,
}

/// What an [`ErrorFlag`] checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlagKind {
    /// I64 indices in `[0, limit)` (token ids, labels).
    Range,
    /// Key-padding flags in rows of `limit` bytes that cuDNN's sequence lengths express: each
    /// row keeps its first keys and drops the rest, keeping at least one
    /// (`attention_key_lengths`, which reports `row * limit + key`: key 0 for a row that keeps
    /// none, else a key kept after a dropped one).
    RightPadded,
}

/// One sequence of commands the host launches as a unit (captured once as a CUDA graph and
/// replayed): a graph of the plan, or the zeroing of accumulated gradients.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Run {
    pub name: String,
    pub commands: Vec<Command>,
    /// The graph's outputs, each in a slot (so they outlive the arena's next use).
    pub outputs: Vec<Output>,
    /// Flags to reset before and read after the run.
    pub error_flags: Vec<ErrorFlag>,
}

impl Run {
    /// The commands one replay issues: each command, a cuDNN attention's prelude with it (its
    /// fallback runs only instead of it).
    pub fn issued(&self) -> impl Iterator<Item = &Command> {
        self.commands.iter().flat_map(|c| {
            let prelude = match c {
                Command::Sdpa(call) => call.prelude.as_slice(),
                _ => &[],
            };
            std::iter::once(c).chain(prelude)
        })
    }
}

/// A lowered plan or graph.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Program {
    pub modules: Vec<Module>,
    pub slots: Vec<Slot>,
    pub tables: Vec<Table>,
    /// Bytes of the one transient arena (every offset is 256-byte aligned). Runs never
    /// overlap in time, so each places its buffers from offset 0.
    pub arena_bytes: u64,
    /// The arena's lower bound (the most bytes live at once in any run) and the placement
    /// order that won in the run that sets its size.
    pub arena_lower_bound: u64,
    pub arena_order: Option<castor_passes::memory::PlacementOrder>,
    /// Bytes of workspace the products may use (cuBLAS's 32 MiB), and cuDNN's attention
    /// plans (a backward's score matrices: [`super::sdpa::backward_workspace`]).
    pub workspace_bytes: u64,
    /// Run once after the state is loaded (working copies from masters, constant tables).
    pub prologue: Vec<Command>,
    pub runs: Vec<Run>,
}

/// The least cuBLAS workspace a program with products gets (cuBLAS may fail with
/// `CUBLAS_STATUS_ALLOC_FAILED` below 16 KiB).
pub const MIN_WORKSPACE: u64 = 1 << 20;

/// The workspace the products get: cuBLAS's recommended 32 MiB on Hopper. A program that
/// sets more aside for cuDNN's attention backward still gives cuBLAS and cuBLASLt no more,
/// so that their algorithm choices do not depend on the attention.
pub const PRODUCT_WORKSPACE: u64 = 32 << 20;

/// The device bytes of one allocation of `bytes`: 256-byte aligned and at least 256, as the
/// device layer allocates every buffer.
pub fn allocated(bytes: u64) -> u64 {
    super::align(bytes).max(256)
}

/// What the device allocates for a program, by kind ([`Program::allocation`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    pub arena: u64,
    /// Bound slots: the state table (masters, working copies, gradients, moments, control).
    pub state: u64,
    /// Batch inputs and the learning rate.
    pub inputs: u64,
    /// Graph outputs and error flags.
    pub internal: u64,
    /// Constant tables uploaded at load (RoPE).
    pub constants: u64,
    /// Device tables of the multi-tensor kernels.
    pub tables: u64,
    pub workspace: u64,
}

impl Allocation {
    pub fn total(&self) -> u64 {
        self.arena
            + self.state
            + self.inputs
            + self.internal
            + self.constants
            + self.tables
            + self.workspace
    }
}

impl Program {
    /// The slot named `name`.
    pub fn slot(&self, name: &str) -> Option<usize> {
        self.slots.iter().position(|s| s.name == name)
    }

    /// The run named `name`.
    pub fn run(&self, name: &str) -> Option<usize> {
        self.runs.iter().position(|r| r.name == name)
    }

    /// What the device allocates for this program, by kind: one allocation for the arena,
    /// one per slot and table, and the cuBLAS workspace when there are products.
    pub fn allocation(&self) -> Allocation {
        let mut a = Allocation {
            arena: allocated(self.arena_bytes),
            ..Allocation::default()
        };
        for s in &self.slots {
            let bytes = allocated(s.bytes);
            match s.kind {
                SlotKind::Bound(_) => a.state += bytes,
                SlotKind::Input(_) => a.inputs += bytes,
                SlotKind::Internal => a.internal += bytes,
                SlotKind::Constant(_) => a.constants += bytes,
            }
        }
        a.tables = self
            .tables
            .iter()
            .map(|t| allocated(t.byte_len() as u64))
            .sum();
        // cuDNN's attention plans share the products' workspace (one stream: never at once).
        if self
            .all_commands()
            .any(|c| matches!(c, Command::Gemm(_) | Command::Sdpa(_)))
        {
            a.workspace = allocated(self.workspace_bytes).max(MIN_WORKSPACE);
        }
        a
    }

    /// Every command of the prologue and the runs (a cuDNN attention's prelude and fallback
    /// commands after it).
    pub fn all_commands(&self) -> impl Iterator<Item = &Command> {
        self.prologue
            .iter()
            .chain(self.runs.iter().flat_map(|r| r.commands.iter()))
            .flat_map(|c| {
                let nested: Vec<&Command> = match c {
                    Command::Sdpa(call) => call.nested().collect(),
                    _ => Vec::new(),
                };
                std::iter::once(c).chain(nested)
            })
    }
}

impl Place {
    /// `s3+256` (slot 3, byte 256) or `a+4096` (the arena).
    fn short(self) -> String {
        match self {
            Place::Arena { offset } => format!("a+{offset}"),
            Place::Buffer { buffer, offset } => format!("unplaced b{}+{offset}", buffer.0),
            Place::Slot { slot, offset: 0 } => format!("s{slot}"),
            Place::Slot { slot, offset } => format!("s{slot}+{offset}"),
        }
    }
}

impl Arg {
    fn short(&self) -> String {
        match self {
            Arg::Ptr(p) => p.short(),
            Arg::Null => "null".into(),
            Arg::I32(x) => x.to_string(),
            Arg::I64(x) => x.to_string(),
            Arg::U16(x) => format!("{x:#06x}"),
            Arg::U32(x) => format!("{x:#010x}"),
            Arg::U64(x) => format!("{x:#x}"),
            Arg::F64(x) => format!("{x:?}"),
            Arg::Table(i) => format!("table{i}"),
            Arg::Layout(l) => {
                let r = l.rank.clamp(0, MAX_RANK as i32) as usize;
                format!(
                    "copy{:?} src{:?}@{} dst{:?}@{}",
                    &l.shape[..r],
                    &l.src_stride[..r],
                    l.src_offset,
                    &l.dst_stride[..r],
                    l.dst_offset
                )
            }
        }
    }
}

impl Command {
    /// One line: what runs, on which buffers, for which node.
    pub fn describe(&self) -> String {
        match self {
            Command::Launch(l) => format!(
                "launch {}<<<{:?}, {:?}>>>({})  # %{}",
                l.entry,
                l.grid,
                l.block,
                l.args.iter().map(Arg::short).collect::<Vec<_>>().join(", "),
                l.node
            ),
            Command::Gemm(g) => format!(
                "gemm {}{} x {}{} -> {} m={} n={} k={} batch={} A={} lda={} sA={} B={} ldb={} \
                 sB={} C={} ldc={} sC={} {}{}{}{}{}  # %{}",
                g.a_dtype.name(),
                if g.transa { "ᵀ" } else { "" },
                g.b_dtype.name(),
                if g.transb { "ᵀ" } else { "" },
                g.c_dtype.name(),
                g.m,
                g.n,
                g.k,
                g.batch,
                g.a.short(),
                g.lda,
                g.stride_a,
                g.b.short(),
                g.ldb,
                g.stride_b,
                g.c.short(),
                g.ldc,
                g.stride_c,
                match g.compute {
                    GemmCompute::F32 => "f32",
                    GemmCompute::Tf32 => "tf32",
                },
                if g.alpha == 1.0 {
                    String::new()
                } else {
                    format!(" alpha={}", g.alpha)
                },
                // C read and added to (cuBLAS's beta = 1), not overwritten.
                if g.accumulate { " beta=1" } else { "" },
                match g.epilogue {
                    Epilogue::None => String::new(),
                    e => format!(
                        " epilogue={}({})",
                        e.name(),
                        e.buffers(g.c_dtype)
                            .iter()
                            .map(|(name, p, ..)| format!("{name}={}", p.short()))
                            .collect::<Vec<_>>()
                            .join(" ")
                    ),
                },
                match &g.fp8 {
                    None => String::new(),
                    Some(f) => format!(
                        " fp8(a_scale={} b_scale={} fast_accum={})",
                        f.a_scale.short(),
                        f.b_scale.short(),
                        if f.fast_accum { "on" } else { "off" }
                    ),
                },
                g.node
            ),
            Command::Copy { dst, src, bytes } => {
                format!("copy {bytes} bytes {} -> {}", src.short(), dst.short())
            }
            Command::Memset { dst, bytes, byte } => {
                format!("memset {bytes} bytes at {} to {byte:#04x}", dst.short())
            }
            Command::Collective {
                node,
                op,
                dtype,
                src,
                dst,
                src_bytes,
                dst_bytes,
                side,
            } => format!(
                "nccl {} {dtype} {src_bytes} bytes {} -> {dst_bytes} bytes {}{}  # {node}",
                op.mnemonic(),
                src.short(),
                dst.short(),
                side.map_or(String::new(), |k| format!(" on the side stream, event {k}"))
            ),
            Command::Join { events } => format!("join side events {events:?}"),
            Command::Sdpa(c) => {
                let p = &c.problem;
                let tensors: Vec<String> = c
                    .places()
                    .iter()
                    .map(|(role, place)| format!("{role}={}", place.short()))
                    .collect();
                format!(
                    "cudnn attention {} {} heads {}/{} rows {}x{} dim {}{}{} ({})  # %{}",
                    match c.pass {
                        super::sdpa::SdpaPass::Forward => "forward",
                        super::sdpa::SdpaPass::Backward => "backward",
                    },
                    p.dtype,
                    p.heads_q,
                    p.heads_kv,
                    p.rows_q,
                    p.rows_kv,
                    p.head_dim,
                    if p.causal { " causal" } else { "" },
                    p.window.map_or(String::new(), |w| format!(" window {w}")),
                    tensors.join(" "),
                    c.node
                )
            }
        }
    }
}

impl Program {
    /// The whole program as text: modules, slots, tables, then each run's commands in order
    /// (`compile --emit cuda`; the lowering's snapshot tests).
    pub fn listing(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# {} modules, {} slots, {} tables; arena {} bytes, cuBLAS workspace {} bytes",
            self.modules.len(),
            self.slots.len(),
            self.tables.len(),
            self.arena_bytes,
            self.workspace_bytes
        );
        for (i, m) in self.modules.iter().enumerate() {
            let entries = crate::cuda::families::file(&m.name)
                .map_or(m.generated.len(), |f| f.entry_points.len());
            let _ = writeln!(s, "module {i} {} ({entries} entry points)", m.name);
        }
        for (i, sl) in self.slots.iter().enumerate() {
            let kind = match &sl.kind {
                SlotKind::Bound(t) => format!("bound {t}"),
                SlotKind::Input(t) => format!("input {t}"),
                SlotKind::Internal => "internal".into(),
                SlotKind::Constant(_) => "constant".into(),
            };
            let _ = writeln!(s, "slot s{i} {} ({} bytes, {kind})", sl.name, sl.bytes);
        }
        for (i, t) in self.tables.iter().enumerate() {
            let _ = writeln!(s, "table{i}: {} rows", t.len());
        }
        let mut section = |name: &str, commands: &[Command]| {
            let _ = writeln!(s, "\n{name}:");
            for c in commands {
                let _ = writeln!(s, "  {}", c.describe());
                if let Command::Sdpa(call) = c {
                    for p in &call.prelude {
                        let _ = writeln!(s, "    first: {}", p.describe());
                    }
                    if let Some(why) = &call.unsupported {
                        let _ = writeln!(s, "    cuDNN cannot run it ({why}); castor's kernels:");
                        for f in &call.fallback {
                            let _ = writeln!(s, "      {}", f.describe());
                        }
                    } else if call.fallback.is_empty() {
                        let _ = writeln!(s, "    (cuDNN required: no fallback)");
                    } else {
                        let _ = writeln!(s, "    where cuDNN does not run it, castor's kernels:");
                        for f in &call.fallback {
                            let _ = writeln!(s, "      {}", f.describe());
                        }
                    }
                }
            }
        };
        section("prologue", &self.prologue);
        for r in &self.runs {
            section(&format!("run {}", r.name), &r.commands);
        }
        s
    }
}

#[cfg(test)]
mod table_tests {
    use super::Table;

    /// A chunk table encodes `{tensor, len, start}` per piece, tensor by tensor, and its row
    /// and byte counts agree with the encoding.
    #[test]
    fn chunk_tables_encode_their_rows() {
        let t = Table::chunks(vec![5, 0, 8], 4);
        let bytes = t.encode(&|_| 0);
        let rows: Vec<(i32, i32, i64)> = bytes
            .chunks(16)
            .map(|r| {
                let i = |a: usize| i32::from_le_bytes(r[a..a + 4].try_into().unwrap());
                (i(0), i(4), i64::from_le_bytes(r[8..16].try_into().unwrap()))
            })
            .collect();
        assert_eq!(rows, vec![(0, 4, 0), (0, 1, 4), (2, 4, 0), (2, 4, 4)]);
        assert_eq!((t.len(), t.byte_len()), (4, bytes.len()));
        assert_eq!(t.fields().count(), 0);
    }
}
