use super::args::{arg_bytes, to_words};
use super::check::{check_args, check_program, gemm_params};
use super::*;
use crate::cuda::program::{
    Arg, Command, CopyLayout, Field, Gemm, GemmCompute, Launch, Module, Place, Program, Run, Slot,
    SlotKind, Table, MAX_RANK,
};
use castor_ir::DType;

#[test]
fn out_of_memory_message() {
    let e = CudaError::OutOfMemory {
        needed: 90 << 30,
        free: (79 << 30) + (1 << 29),
        total: 80 << 30,
    };
    assert_eq!(
        e.to_string(),
        "the plan needs 90.00 GiB of device memory but only 79.50 GiB of 80.00 GiB is free; \
         try --remat selective (or full), or a smaller --batch"
    );
}

#[test]
fn cublas_message_names_the_node() {
    let e = CudaError::Cublas {
        node: "h1".into(),
        message: "x".into(),
    };
    assert_eq!(e.to_string(), "cuBLAS failed on node `%h1`: x");
    let e = CudaError::Cublas {
        node: String::new(),
        message: "cublasCreate returned 1".into(),
    };
    assert_eq!(e.to_string(), "cuBLAS failed: cublasCreate returned 1");
}

#[test]
fn argument_bytes_have_the_parameters_sizes() {
    let address = |p: Place| match p {
        Place::Arena { offset } => 0x1000 + offset,
        Place::Slot { slot, offset } => 0x10_0000 * (slot as u64 + 1) + offset,
        Place::Buffer { .. } => 0,
    };
    let table = |i: usize| 0xdead_0000 + i as u64;
    let bytes = |a: &Arg| arg_bytes(a, &address, &table);
    assert_eq!(bytes(&Arg::U16(0xbeef)), vec![0xef, 0xbe]);
    assert_eq!(bytes(&Arg::I32(-2)), (-2i32).to_le_bytes().to_vec());
    assert_eq!(bytes(&Arg::U32(7)).len(), 4);
    assert_eq!(bytes(&Arg::I64(-3)), (-3i64).to_le_bytes().to_vec());
    assert_eq!(bytes(&Arg::U64(9)).len(), 8);
    assert_eq!(bytes(&Arg::F64(0.5)), 0.5f64.to_le_bytes().to_vec());
    assert_eq!(bytes(&Arg::Null), vec![0; 8]);
    assert_eq!(
        bytes(&Arg::Ptr(Place::Arena { offset: 256 })),
        0x1100u64.to_le_bytes().to_vec()
    );
    assert_eq!(
        bytes(&Arg::Ptr(Place::Slot { slot: 1, offset: 8 })),
        0x20_0008u64.to_le_bytes().to_vec()
    );
    assert_eq!(bytes(&Arg::Table(3)), 0xdead_0003u64.to_le_bytes().to_vec());

    let mut l = CopyLayout {
        rank: 3,
        src_offset: 5,
        dst_offset: -6,
        ..CopyLayout::default()
    };
    for d in 0..MAX_RANK {
        l.shape[d] = d as i64 + 1;
        l.src_stride[d] = 10 * d as i64;
        l.dst_stride[d] = -(d as i64);
    }
    let b = bytes(&Arg::Layout(l));
    assert_eq!(b.len(), 216);
    assert_eq!(b.len(), std::mem::size_of::<CopyLayout>());
    // The same bytes as the struct in memory (as the kernel reads it).
    // SAFETY: `CopyLayout` is `repr(C)` plain integers with no padding.
    let raw = unsafe {
        std::slice::from_raw_parts(
            (&l as *const CopyLayout).cast::<u8>(),
            std::mem::size_of::<CopyLayout>(),
        )
    };
    assert_eq!(b, raw);
    assert_eq!(&b[208..212], &3i32.to_le_bytes());
}

#[test]
fn words_keep_the_bytes() {
    let b = [1u8, 2, 3];
    let w = to_words(&b);
    assert_eq!(w.len(), 1);
    // SAFETY: reading the first 3 bytes of an 8-byte word.
    let back = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), 3) };
    assert_eq!(back, &b);
    assert_eq!(to_words(&[0u8; 216]).len(), 27);
}

fn gemm(m: i32, n: i32, k: i32) -> Gemm {
    Gemm {
        node: "mm".into(),
        a: Place::Arena { offset: 0 },
        b: Place::Slot { slot: 0, offset: 0 },
        c: Place::Slot { slot: 1, offset: 0 },
        a_dtype: DType::F16,
        b_dtype: DType::F16,
        c_dtype: DType::F32,
        transa: false,
        transb: false,
        m,
        n,
        k,
        lda: m.max(1) as i64,
        ldb: k.max(1) as i64,
        ldc: m.max(1) as i64,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
        batch: 1,
        compute: GemmCompute::F32,
        accumulate: false,
        alpha: 1.0,
        epilogue: Default::default(),
        fp8: None,
    }
}

#[test]
fn gemm_extents_in_column_major_terms() {
    let g = gemm(4, 3, 2);
    // A 4x2 F16, B 2x3 F16, C 4x3 F32.
    assert_eq!(g.check(), Ok((16, 12, 48)));
    let t = Gemm {
        transa: true,
        lda: 2,
        ..g.clone()
    };
    // A stored 2x4 with lda 2: 8 elements.
    assert_eq!(t.check(), Ok((16, 12, 48)));
    let batched = Gemm {
        batch: 5,
        stride_a: 8,
        stride_b: 0,
        stride_c: 12,
        ..g.clone()
    };
    assert_eq!(
        batched.check(),
        Ok(((4 * 8 + 8) * 2, 12, (4 * 12 + 12) * 4))
    );
    let bad_ld = Gemm {
        lda: 3,
        ..g.clone()
    };
    assert!(bad_ld.check().is_err());
    assert_eq!(gemm(0, 3, 2).check(), Ok((0, 12, 0)));
}

#[test]
fn gemm_types_follow_cublas() {
    assert!(gemm_params(&gemm(2, 2, 2)).is_ok());
    let mixed = Gemm {
        b_dtype: DType::BF16,
        ..gemm(2, 2, 2)
    };
    assert!(matches!(
        gemm_params(&mixed),
        Err(CudaError::Unsupported(_))
    ));
    let tf32_half = Gemm {
        compute: GemmCompute::Tf32,
        ..gemm(2, 2, 2)
    };
    assert!(gemm_params(&tf32_half).is_err());
    let f32_into_half = Gemm {
        a_dtype: DType::F32,
        b_dtype: DType::F32,
        c_dtype: DType::F16,
        ..gemm(2, 2, 2)
    };
    assert!(gemm_params(&f32_into_half).is_err());
    let ints = Gemm {
        a_dtype: DType::I32,
        ..gemm(2, 2, 2)
    };
    assert!(gemm_params(&ints).is_err());
}

/// cuBLASLt's FP8 rules: FP8 operands (not both E5M2) in the "TN" form into BF16, F16 or
/// F32, 16-byte aligned pointers and leading dims, `k` and `m` multiples of 16, one product.
#[test]
fn fp8_products_follow_cublaslt() {
    use crate::cuda::program::Fp8Scales;
    let fp8 = |m: i32, n: i32, k: i32| Gemm {
        a_dtype: DType::F8E4M3,
        b_dtype: DType::F8E5M2,
        c_dtype: DType::BF16,
        transa: true,
        lda: k as i64,
        ldb: k as i64,
        ldc: m as i64,
        fp8: Some(Fp8Scales {
            a_scale: Place::Slot { slot: 2, offset: 4 },
            b_scale: Place::Slot { slot: 2, offset: 0 },
            fast_accum: false,
        }),
        ..gemm(m, n, k)
    };
    let ok = fp8(32, 3, 16);
    assert!(gemm_params(&ok).is_ok());
    // A is k x m stored (transposed), B k x n, C m x n in BF16.
    assert_eq!(ok.check(), Ok((16 * 32, 16 * 3, 32 * 3 * 2)));
    let refused = |g: Gemm, why: &str| {
        let e = g.check().unwrap_err();
        assert!(e.contains(why), "{e}");
        assert!(gemm_params(&g).is_err());
    };
    refused(
        Gemm {
            transa: false,
            lda: 32,
            ..fp8(32, 3, 16)
        },
        "the \"TN\" form",
    );
    refused(
        Gemm {
            b_dtype: DType::F8E5M2,
            a_dtype: DType::F8E5M2,
            ..fp8(32, 3, 16)
        },
        "no FP8 product of f8e5m2 x f8e5m2",
    );
    refused(
        Gemm {
            a_dtype: DType::BF16,
            ..fp8(32, 3, 16)
        },
        "no FP8 product",
    );
    refused(fp8(32, 3, 24), "k (the inner dim) = 24");
    refused(fp8(40, 3, 16), "m (the output's columns) = 40");
    refused(
        Gemm {
            a: Place::Arena { offset: 8 },
            ..fp8(32, 3, 16)
        },
        "A starts 8 bytes into its buffer",
    );
    refused(
        Gemm {
            batch: 2,
            stride_a: 512,
            stride_b: 48,
            stride_c: 96,
            ..fp8(32, 3, 16)
        },
        "one product that overwrites C",
    );
}

fn slot(name: &str, bytes: u64) -> Slot {
    Slot {
        name: name.into(),
        bytes,
        kind: SlotKind::Internal,
    }
}

#[test]
fn programs_are_checked_against_their_buffers() {
    let program = Program {
        slots: vec![slot("x", 8), slot("y", 48)],
        arena_bytes: 256,
        runs: vec![Run {
            name: "step".into(),
            commands: vec![
                Command::Gemm(gemm(4, 3, 2)),
                Command::Copy {
                    dst: Place::Slot {
                        slot: 1,
                        offset: 40,
                    },
                    src: Place::Arena { offset: 0 },
                    bytes: 8,
                },
            ],
            ..Run::default()
        }],
        ..Program::default()
    };
    // B (12 bytes) overruns slot 0 (8 bytes).
    let e = check_program(&program).unwrap_err().to_string();
    assert!(e.contains("run `step` command 0 (node `%mm`)"), "{e}");
    assert!(e.contains("overrun slot 0 (`x`)"), "{e}");

    let mut ok = program.clone();
    ok.slots[0].bytes = 12;
    check_program(&ok).unwrap();

    let mut bad = ok.clone();
    bad.runs[0].commands[1] = Command::Memset {
        dst: Place::Slot { slot: 2, offset: 0 },
        bytes: 1,
        byte: 0,
    };
    let e = check_program(&bad).unwrap_err().to_string();
    assert!(e.contains("slot 2 does not exist"), "{e}");

    let mut bad = ok.clone();
    bad.runs[0].commands.push(Command::Launch(Launch {
        node: "k".into(),
        module: 0,
        kernel: None,
        entry: "f".into(),
        grid: (1, 1, 1),
        block: (32, 1, 1),
        shared_bytes: 0,
        args: vec![],
    }));
    let e = check_program(&bad).unwrap_err().to_string();
    assert!(e.contains("module 0 does not exist"), "{e}");
    bad.modules.push(Module {
        name: "m".into(),
        ..Module::default()
    });
    check_program(&bad).unwrap();
    bad.tables.push(Table::default());
    if let Command::Launch(l) = &mut bad.runs[0].commands[2] {
        l.args = vec![Arg::Table(1)];
    }
    let e = check_program(&bad).unwrap_err().to_string();
    assert!(e.contains("table 1 does not exist"), "{e}");
}

#[test]
fn argument_lists_are_checked_against_parameters() {
    let l = Launch {
        node: "n".into(),
        module: 0,
        kernel: None,
        entry: "k".into(),
        grid: (1, 1, 1),
        block: (1, 1, 1),
        shared_bytes: 0,
        args: vec![Arg::Null, Arg::U16(1), Arg::Layout(CopyLayout::default())],
    };
    check_args(&l, "m", &[8, 2, 216]).unwrap();
    let e = check_args(&l, "m", &[8, 4, 216]).unwrap_err().to_string();
    assert!(e.contains("parameter 1 is 4 bytes"), "{e}");
    let e = check_args(&l, "m", &[8, 2]).unwrap_err().to_string();
    assert!(e.contains("takes 2 parameters, the launch passes 3"), "{e}");
}

/// Opening the device never panics: without a GPU (or a driver, cuBLAS or NVRTC) it is an
/// error naming what is missing.
#[test]
fn device_open_does_not_panic() {
    match Device::open() {
        Ok(d) => println!(
            "device: {} ({}), memory {:?}",
            d.name(),
            d.arch(),
            d.mem_info()
        ),
        Err(e) => println!("no device: {e}"),
    }
}

/// The GPU, or `None` (the test skips, saying why) where there is none; a GPU run
/// (`CASTOR_REQUIRE_GPU=1`) must not skip silently, so there it fails instead.
fn gpu_or_skip() -> Option<Device> {
    match Device::open() {
        Ok(d) => Some(d),
        Err(e) => {
            assert!(
                std::env::var("CASTOR_REQUIRE_GPU").as_deref() != Ok("1"),
                "CASTOR_REQUIRE_GPU=1 but {e}"
            );
            println!("skipped: {e}");
            None
        }
    }
}

/// On a GPU: a small program with a kernel of every argument kind, a product, copies
/// and fills, run through a graph twice with new inputs. Skips without a device.
#[test]
fn device_runs_a_program_on_gpu() {
    let Some(device) = gpu_or_skip() else {
        return;
    };
    let source = r#"
struct CopyLayout {
long long shape[8];
long long src_stride[8];
long long dst_stride[8];
long long src_offset;
long long dst_offset;
int rank;
int pad;
};
struct Row { const float* p; long long n; };
extern "C" __global__ void probe(double* out, const Row* table, CopyLayout l,
                             unsigned short h, int i, long long j, double d,
                             const float* null_ptr) {
if (threadIdx.x != 0 || blockIdx.x != 0) return;
out[0] = (double)h;
out[1] = (double)i;
out[2] = (double)j;
out[3] = d;
out[4] = (double)(l.shape[7] + l.src_stride[1] + l.dst_offset + l.rank);
out[5] = (double)table[1].n + (double)table[1].p[0];
out[6] = null_ptr == 0 ? 1.0 : 0.0;
}
extern "C" __global__ void scale(float* x, int n, float by) {
int k = blockIdx.x * blockDim.x + threadIdx.x;
if (k < n) x[k] *= by;
}
"#;
    // Slots: 0 = probe output (8 doubles), 1 = a (2x3 row-major), 2 = b (3x2 row-major),
    // 3 = c (2x2 row-major), 4 = a constant read through the table.
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut layout = CopyLayout {
        rank: 4,
        dst_offset: 100,
        ..CopyLayout::default()
    };
    layout.shape[7] = 1000;
    layout.src_stride[1] = 20;
    let table = Table::Rows(vec![
        vec![Field::Null, Field::I64(0)],
        vec![
            Field::Ptr(Place::Slot { slot: 4, offset: 0 }),
            Field::I64(7),
        ],
    ]);
    let f32_gemm = |a: Place, b: Place, c: Place| Gemm {
        node: "c".into(),
        // Row-major c[2x2] = a[2x3] @ b[3x2] as column-major cᵀ = bᵀ aᵀ.
        a: b,
        b: a,
        c,
        a_dtype: DType::F32,
        b_dtype: DType::F32,
        c_dtype: DType::F32,
        transa: false,
        transb: false,
        m: 2,
        n: 2,
        k: 3,
        lda: 2,
        ldb: 3,
        ldc: 2,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
        batch: 1,
        compute: GemmCompute::F32,
        accumulate: false,
        alpha: 1.0,
        epilogue: Default::default(),
        fp8: None,
    };
    let program = Program {
        modules: vec![Module {
            name: "device_test".into(),
            source: source.into(),
            ..Module::default()
        }],
        slots: vec![
            slot("out", 64),
            slot("a", 24),
            slot("b", 24),
            slot("c", 16),
            Slot {
                name: "k".into(),
                bytes: 4,
                kind: SlotKind::Constant(f32s(&[0.5])),
            },
        ],
        tables: vec![table],
        arena_bytes: 512,
        arena_lower_bound: 512,
        arena_order: None,
        workspace_bytes: 1 << 20,
        prologue: vec![Command::Memset {
            dst: Place::Slot {
                slot: 0,
                offset: 56,
            },
            bytes: 8,
            byte: 0xff,
        }],
        runs: vec![Run {
            name: "step".into(),
            commands: vec![
                Command::Launch(Launch {
                    node: "probe".into(),
                    module: 0,
                    kernel: None,
                    entry: "probe".into(),
                    grid: (1, 1, 1),
                    block: (32, 1, 1),
                    shared_bytes: 0,
                    args: vec![
                        Arg::Ptr(Place::Slot { slot: 0, offset: 0 }),
                        Arg::Table(0),
                        Arg::Layout(layout),
                        Arg::U16(65000),
                        Arg::I32(-5),
                        Arg::I64(1 << 40),
                        Arg::F64(0.25),
                        Arg::Null,
                    ],
                }),
                // a and b through the arena, then doubled in place there.
                Command::Copy {
                    dst: Place::Arena { offset: 0 },
                    src: Place::Slot { slot: 1, offset: 0 },
                    bytes: 24,
                },
                Command::Copy {
                    dst: Place::Arena { offset: 256 },
                    src: Place::Slot { slot: 2, offset: 0 },
                    bytes: 24,
                },
                Command::Launch(Launch {
                    node: "a2".into(),
                    module: 0,
                    kernel: None,
                    entry: "scale".into(),
                    grid: (1, 1, 1),
                    block: (64, 1, 1),
                    shared_bytes: 0,
                    args: vec![
                        Arg::Ptr(Place::Arena { offset: 0 }),
                        Arg::I32(6),
                        Arg::U32(2.0f32.to_bits()),
                    ],
                }),
                Command::Gemm(f32_gemm(
                    Place::Arena { offset: 0 },
                    Place::Arena { offset: 256 },
                    Place::Slot { slot: 3, offset: 0 },
                )),
            ],
            ..Run::default()
        }],
    };
    let mut loaded = device.load(&program).unwrap();
    loaded.run_prologue().unwrap();
    let f64s = |b: Vec<u8>| -> Vec<f64> {
        b.chunks(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let read_f32 = |l: &Loaded, slot: usize| -> Vec<f32> {
        l.read_slot(slot)
            .unwrap()
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    for step in 0..3 {
        let s = step as f32;
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0].map(|x| x + s);
        let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        loaded.write_slot(1, &f32s(&a)).unwrap();
        loaded.write_slot(2, &f32s(&b)).unwrap();
        loaded.run(0).unwrap();
        let out = f64s(loaded.read_slot(0).unwrap());
        assert_eq!(
            &out[..7],
            &[65000.0, -5.0, (1u64 << 40) as f64, 0.25, 1124.0, 7.5, 1.0]
        );
        assert!(out[7].is_nan(), "the prologue's fill: {}", out[7]);
        // c = (2a) @ b, row-major.
        let a2 = a.map(|x| 2.0 * x);
        let want = [
            a2[0] * b[0] + a2[1] * b[2] + a2[2] * b[4],
            a2[0] * b[1] + a2[1] * b[3] + a2[2] * b[5],
            a2[3] * b[0] + a2[4] * b[2] + a2[5] * b[4],
            a2[3] * b[1] + a2[4] * b[3] + a2[5] * b[5],
        ];
        assert_eq!(read_f32(&loaded, 3), want, "step {step}");
    }
    loaded
        .copy(
            Place::Slot { slot: 3, offset: 0 },
            Place::Slot { slot: 4, offset: 0 },
            4,
        )
        .unwrap();
    assert_eq!(read_f32(&loaded, 3)[0], 0.5);
    assert!(loaded.read(Place::Slot { slot: 3, offset: 8 }, 16).is_err());
    assert!(loaded.write_slot(3, &[0; 4]).is_err());
    drop(loaded);

    let huge = Program {
        arena_bytes: 1 << 50,
        ..Program::default()
    };
    match device.load(&huge) {
        Err(e @ CudaError::OutOfMemory { .. }) => println!("{e}"),
        Err(e) => panic!("expected OutOfMemory, got {e}"),
        Ok(_) => panic!("a petabyte arena loaded"),
    }
}

#[test]
fn nvrtc_newer_than_the_driver_is_refused() {
    use super::open::nvrtc_fits_driver;
    let path = "libnvrtc.so.13";
    assert!(nvrtc_fits_driver((13, 0), 13000, &path).is_ok());
    assert!(nvrtc_fits_driver((13, 0), 13020, &path).is_ok());
    let e = nvrtc_fits_driver((13, 2), 13000, &path).unwrap_err();
    assert!(
        e.starts_with("NVRTC 13.2 (libnvrtc.so.13) is newer than the CUDA driver (13.0)"),
        "{e}"
    );
    assert!(e.contains("nvidia-cuda-nvrtc==13.0.*"), "{e}");
}

/// On a GPU with cuDNN: which of castor's attention graphs cuDNN builds an engine for (256
/// rows, head dim 64, bf16, causal; 12 heads, and 8 query heads on 2 key heads), forward and
/// backward, with and without the key-padding mask (cudnn-frontend's padding mask: sequence
/// lengths), and masked under a sliding window. Without the mask the graph is the one
/// PyTorch's cuDNN attention runs, so it must build; the other graphs' outcomes are printed
/// (castor's kernels run a pass cuDNN refuses, and `--attention cudnn` plans fail on it in
/// `tests/cuda_gpu.rs`). Skips without a device or without cuDNN.
#[test]
fn cudnn_builds_the_unmasked_attention_graphs_on_gpu() {
    use crate::cuda::sdpa::{tests::call, SdpaPass};
    let Some(_device) = gpu_or_skip() else {
        return;
    };
    let version = match super::cudnn::probe() {
        Ok(v) => v,
        Err(e) => {
            println!("skipped: no cuDNN: {e}");
            return;
        }
    };
    let mut cudnn = super::cudnn::Cudnn::new(version, false).expect("a cuDNN handle");
    let mut refused = Vec::new();
    let cases = [(false, None), (true, None), (true, Some(64))];
    for heads in [(12, 12), (8, 2)] {
        for (masked, window) in cases {
            for pass in [SdpaPass::Forward, SdpaPass::Backward] {
                let c = call(pass, heads, true, window, masked);
                let outcome = cudnn.plan(&c, 256 << 20).map(|p| p.engine.clone());
                println!(
                    "cuDNN {}: {pass:?} heads {}/{} causal{}{}: {outcome:?}",
                    super::cudnn::version_name(version),
                    heads.0,
                    heads.1,
                    if masked { " masked" } else { "" },
                    window.map(|w| format!(" window {w}")).unwrap_or_default(),
                );
                if let (false, Err(why)) = (masked, outcome) {
                    refused.push(format!("{pass:?} heads {heads:?}: {why}"));
                }
            }
        }
    }
    assert!(
        refused.is_empty(),
        "unmasked causal graphs refused: {refused:?}"
    );
}
