//! Typed names of the hand-written kernels: a launch says which kernel it runs as a
//! [`KernelId`] (family, then the family's own `Kernel`: variant, dtypes), the entry-point
//! name the device loads is derived from it ([`KernelId::entry`]), and the emulator's
//! contracts match on it. Each family defines its `Kernel` in its folder
//! (`families/<family>/mod.rs`); the `families!` list makes the enum. No code takes a kernel
//! name apart; the test below holds that every entry point of every kernel file is the name
//! of exactly one id. The helpers here spell the dtype parts of entry names.

use castor_ir::DType;

pub use crate::cuda::families::KernelId;

/// The float dtypes kernels are built for.
pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Every (input, output) pair of float dtypes.
pub fn float_pairs() -> impl Iterator<Item = (DType, DType)> {
    FLOATS.into_iter().flat_map(|a| FLOATS.map(|b| (a, b)))
}

/// `bf16` for (BF16, BF16), `f32_bf16` for (F32, BF16).
pub fn io(input: DType, output: DType) -> String {
    if input == output {
        input.name().to_string()
    } else {
        format!("{}_{}", input.name(), output.name())
    }
}

/// `fwd` or `bwd`.
pub fn direction(backward: bool) -> &'static str {
    if backward {
        "bwd"
    } else {
        "fwd"
    }
}

impl KernelId {
    /// The id whose entry point is `entry`, among the ids of every family over every dtype.
    /// For code that starts from a kernel file's entry list (the kernel tests); the lowering
    /// and the emulator hold ids.
    pub fn from_entry(entry: &str) -> Option<KernelId> {
        KernelId::candidates()
            .into_iter()
            .find(|k| k.entry() == entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Every entry point of every kernel file is the name of exactly one id, and no two ids
    /// share a name: the typed ids and the files agree.
    #[test]
    fn every_entry_point_is_the_name_of_exactly_one_id() {
        let mut names: HashMap<String, KernelId> = HashMap::new();
        for id in KernelId::candidates() {
            if let Some(other) = names.insert(id.entry(), id) {
                panic!("{other:?} and {id:?} are both `{}`", id.entry());
            }
        }
        let mut missing = Vec::new();
        for file in crate::cuda::families::files() {
            for &e in file.entry_points {
                match KernelId::from_entry(e) {
                    Some(id) => assert_eq!(id.entry(), e),
                    None => missing.push(format!("{} ({})", e, file.name)),
                }
            }
        }
        assert!(missing.is_empty(), "entry points with no id: {missing:?}");
    }
}
