//! Kernel families: one folder per family of CUDA kernels, holding everything about it.
//!
//! - `mod.rs`: what the family computes, its CPU twin, its `.cu` files with their entry points
//!   ([`castor_kernels::KernelFile`]s), and its kernels as typed ids (`Kernel`, with `entry`
//!   and `candidates`);
//! - the `.cu` sources (each includes `castor_common.cuh`, `kernels/common.cuh`);
//! - `lower.rs`: the launches a CUDA program makes for the family's ops;
//! - `contract.rs`: what the emulator lets each launch read and write (`uses`), checked before
//!   the real kernel runs;
//! - `tests.rs`: the kernels, run by the host build, against the CPU twin.
//!
//! Adding a family is a new folder and its line in the [`families!`] list below (the folder's
//! module and the [`KernelId`] variant that holds its `Kernel`). Everything
//! that walks the kernels (the NVRTC check, the signature table, the emulator, the program's
//! module list) reads [`files`].

use crate::cuda::emulate::memory::{Mem, Use};
use crate::cuda::emulate::R;
use crate::cuda::program::Launch;
use castor_kernels::signature::{find, parse_file};
use castor_kernels::{KernelFile, Signature, SignatureError};
use std::collections::HashMap;
use std::sync::OnceLock;

/// Declares each family's module (`name: Variant`), lists its files in [`FAMILIES`], and makes
/// [`KernelId`], whose variant `Variant` holds the family's own `Kernel`: a kernel's name, its
/// candidates and its contract are the family's.
macro_rules! families {
    ($($family:ident: $variant:ident),* $(,)?) => {
        $(pub mod $family;)*

        /// Every family's kernel files.
        pub const FAMILIES: &[&[KernelFile]] = &[$($family::FILES),*];

        /// A hand-written kernel: its family, and which of the family's kernels (variant,
        /// dtypes). A launch carries it; the entry point's name derives from it, and the
        /// emulator finds the kernel's contract by it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum KernelId {
            $($variant($family::Kernel)),*
        }

        impl KernelId {
            /// The entry point's name in its kernel file.
            pub fn entry(&self) -> String {
                match self {
                    $(KernelId::$variant(k) => k.entry()),*
                }
            }

            /// Every id of every family over every dtype and size a kernel could take: a
            /// superset of the kernel files' entry points.
            pub fn candidates() -> Vec<KernelId> {
                let mut ids = Vec::new();
                $(ids.extend($family::Kernel::candidates().into_iter().map(KernelId::$variant));)*
                ids
            }

            /// What launch `l` of this kernel may read and write: its family's contract.
            pub(crate) fn uses(self, m: &Mem, l: &Launch) -> R<Vec<Use>> {
                match self {
                    $(KernelId::$variant(k) => $family::contract::uses(k, m, l)),*
                }
            }
        }

        /// Every entry point the families' kernel tests launch.
        #[cfg(test)]
        pub(crate) fn tested_entries() -> Vec<String> {
            [$($family::tests::entries()),*].concat()
        }
    };
}

families!(
    adafactor: Adafactor,
    adamw8bit: AdamW8bit,
    attention: Attention,
    cross_entropy: CrossEntropy,
    dropout: Dropout,
    elementwise: Elementwise,
    embedding: Embedding,
    fp8: Fp8,
    layout: Layout,
    nf4: Nf4,
    norm: Norm,
    optimizer: Optimizer,
    reduce: Reduce,
    rope: Rope,
    softmax: Softmax,
);

#[cfg(test)]
mod compile;

/// The kernels the fusion pass generates, one per pointwise unit: no files, no entry points.
pub mod pointwise;

/// Every kernel file of every family.
pub fn files() -> impl Iterator<Item = &'static KernelFile> {
    FAMILIES.iter().flat_map(|f| f.iter())
}

/// The kernel file named `name` (`"norm.cu"`).
pub fn file(name: &str) -> Option<&'static KernelFile> {
    files().find(|f| f.name == name)
}

/// The kernel file that defines `entry`.
pub fn file_of(entry: &str) -> Option<&'static KernelFile> {
    files().find(|f| f.entry_points.contains(&entry))
}

/// The signature of entry point `entry`, read from its file's declarations (parsed once).
pub fn signature(entry: &str) -> Result<&'static Signature, SignatureError> {
    static TABLE: OnceLock<HashMap<&'static str, Vec<Signature>>> = OnceLock::new();
    let table = TABLE.get_or_init(|| files().map(|f| (f.name, parse_file(f))).collect());
    let unknown = || SignatureError::UnknownEntry(entry.into());
    let file = file_of(entry).ok_or_else(unknown)?;
    table
        .get(file.name)
        .and_then(|declared| find(declared, entry))
        .ok_or_else(unknown)
}

/// Whether `entry`'s blocks wait for blocks with a lower index (`wait_flag` in `common.cuh`):
/// the host build then runs their blocks in index order, as the device dispatches them, in
/// either thread order ([`castor_kernels::host::Order::ReverseThreads`]).
pub fn waits_for_earlier_blocks(entry: &str) -> bool {
    attention::BLOCK_ORDERED.contains(&entry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use castor_kernels::ParamKind;

    #[test]
    fn entry_points_are_unique_and_found() {
        let mut seen = std::collections::HashSet::new();
        for f in files() {
            assert!(
                f.source.contains("#include \"castor_common.cuh\""),
                "{}",
                f.name
            );
            assert!(
                f.source.starts_with("// "),
                "{} starts with its header comment",
                f.name
            );
            for e in f.entry_points {
                assert!(seen.insert(*e), "{e} is listed twice");
                assert_eq!(file_of(e).map(|f| f.name), Some(f.name));
            }
        }
        assert!(file("cast.cu").is_some());
        let names: std::collections::HashSet<&str> = files().map(|f| f.name).collect();
        assert_eq!(names.len(), files().count(), "file names are unique");
    }

    #[test]
    fn every_entry_point_has_a_signature() {
        for f in files() {
            for e in f.entry_points {
                let s = signature(e).unwrap_or_else(|err| panic!("{err}"));
                assert!(!s.params.is_empty(), "{e}");
            }
        }
    }

    #[test]
    fn families_resolve_to_their_declarations() {
        let names = |e: &str| signature(e).unwrap().names().join(",");
        assert_eq!(
            names("layer_norm_fwd_bf16_f32"),
            "x,x_low,res,sum_out,w,b,y,mean_out,rstd_out,rows,h,eps"
        );
        assert_eq!(
            signature("layer_norm_bwd_weight_f32").unwrap().family,
            "layer_norm_bwd_weight_*"
        );
        assert_eq!(
            signature("attention_fwd_f32").unwrap().family,
            "attention_fwd_f32"
        );
        // `_d##P##pk`: the head-dim tile, then `_packed` or nothing.
        for entry in ["attention_fwd_bf16_d64", "attention_fwd_bf16_d64_packed"] {
            assert_eq!(signature(entry).unwrap().family, "attention_fwd_*_d**");
        }
        let dropout = signature("attention_bwd_f16_d128_packed_dropout").unwrap();
        assert_eq!(dropout.family, "attention_bwd_*_d**_dropout");
        assert_eq!(dropout.params.last().unwrap().name, "keep_scale");
        assert_eq!(names("cast_i64_bool"), "x,y,n");
        assert_eq!(signature("cast_i64_bool").unwrap().file, "layout.cu");
        assert_eq!(names("fill_b4"), "dst,n,value");
        let fill = signature("fill_b4").unwrap();
        assert_eq!(fill.params[2].kind, ParamKind::U32);
        assert_eq!(
            signature("strided_copy_b2").unwrap().params[3].kind,
            ParamKind::Layout
        );
        assert!(matches!(
            signature("nope"),
            Err(SignatureError::UnknownEntry(_))
        ));
    }

    #[test]
    fn arguments_are_ordered_by_name() {
        let s = signature("fill_b4").unwrap();
        assert_eq!(
            s.order("fill_b4", &[("value", 3), ("dst", 1), ("n", 2)]),
            Ok(vec![1, 2, 3])
        );
        assert!(matches!(
            s.order("fill_b4", &[("dst", 1), ("n", 2)]),
            Err(SignatureError::Missing { .. })
        ));
        assert!(matches!(
            s.order(
                "fill_b4",
                &[("dst", 1), ("n", 2), ("value", 3), ("bytes", 4)]
            ),
            Err(SignatureError::UnknownParam { .. })
        ));
        assert!(matches!(
            s.order("fill_b4", &[("dst", 1), ("dst", 1), ("n", 2), ("value", 3)]),
            Err(SignatureError::Twice { .. })
        ));
    }

    #[test]
    fn block_ordered_entries_are_attention_backward_entries() {
        for e in attention::BLOCK_ORDERED {
            assert_eq!(file_of(e).map(|f| f.name), Some("attention.cu"), "{e}");
        }
        assert!(waits_for_earlier_blocks("attention_bwd_bf16_d64"));
        assert!(!waits_for_earlier_blocks("attention_fwd_bf16_d64"));
    }

    #[test]
    fn every_entry_point_of_every_kernel_file_is_tested() {
        let covered: std::collections::BTreeSet<String> = tested_entries().into_iter().collect();
        let mut missing = Vec::new();
        for f in files() {
            for e in f.entry_points {
                if !covered.contains(*e) {
                    missing.push(format!("{}: {e}", f.name));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "untested entry points:\n{}",
            missing.join("\n")
        );
        for e in &covered {
            assert!(file_of(e).is_some(), "{e} is not an entry point");
        }
    }
}
