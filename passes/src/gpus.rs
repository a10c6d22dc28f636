//! GPUs the cost model and the fit verdict know by name (`--gpu H100`, `--gpu a100-40gb`).
//!
//! Dense peak rates and memory from the vendors' datasheets. BF16/F16 is the tensor-core rate
//! with F32 accumulation (what castor's contractions use), which on GeForce cards is half the
//! F16-accumulate rate. Memory is the nominal size of the card (`80 GB` is 80 GiB of HBM); the
//! driver and the CUDA context take a few hundred MiB of it.

use crate::cost::{GpuSpec, Interconnect};

const GIB: u64 = 1 << 30;

/// `(names people write, the spec)`; the first name is the canonical one.
fn table() -> Vec<(&'static [&'static str], GpuSpec)> {
    let spec = |name: &str, low: f64, tf32: f64, f32: f64, tb_s: f64, gib: u64| GpuSpec {
        name: name.to_string(),
        low_precision_flops: low * 1e12,
        fp8_flops: None,
        tf32_flops: tf32 * 1e12,
        f32_flops: f32 * 1e12,
        memory_bandwidth: tb_s * 1e12,
        memory_bytes: Some(gib * GIB),
        // PCIe cards: the default (PCIe 4.0 x16, 100 Gb/s Ethernet); SXM parts set theirs.
        interconnect: Interconnect::default(),
    };
    // SXM parts in HGX servers: NVLink per GPU and direction, one InfiniBand NIC per GPU.
    let sxm = |s: GpuSpec, link_gb_s: f64, nic_gbit_s: f64| GpuSpec {
        interconnect: Interconnect::nvlink(link_gb_s, nic_gbit_s),
        ..s
    };
    // Hopper and Ada: FP8 tensor cores (dense, F32 accumulation; GeForce at half the
    // F16-accumulate rate, as its BF16 rate above).
    let fp8 = |s: GpuSpec, tflops: f64| GpuSpec {
        fp8_flops: Some(tflops * 1e12),
        ..s
    };
    // PCIe 5.0 x16.
    let pcie5 = |s: GpuSpec| GpuSpec {
        interconnect: Interconnect {
            link_bandwidth: 50e9,
            ..Interconnect::default()
        },
        ..s
    };
    vec![
        (&["h100", "h100-sxm", "h100-80gb"], GpuSpec::h100_sxm()),
        (
            &["h100-pcie"],
            fp8(
                pcie5(spec("H100 PCIe 80 GB", 756.0, 378.0, 51.0, 2.0, 80)),
                1513.0,
            ),
        ),
        (
            &["h200", "h200-sxm"],
            fp8(
                sxm(
                    spec("H200 SXM 141 GB", 989.0, 495.0, 67.0, 4.8, 141),
                    450.0,
                    400.0,
                ),
                1979.0,
            ),
        ),
        (
            &["a100", "a100-80gb", "a100-sxm"],
            sxm(
                spec("A100 SXM 80 GB", 312.0, 156.0, 19.5, 2.039, 80),
                300.0,
                200.0,
            ),
        ),
        (
            &["a100-40gb", "a100-40"],
            sxm(
                spec("A100 40 GB", 312.0, 156.0, 19.5, 1.555, 40),
                300.0,
                200.0,
            ),
        ),
        (
            &["l40s"],
            fp8(
                pcie5(spec("L40S 48 GB", 362.0, 183.0, 91.6, 0.864, 48)),
                733.0,
            ),
        ),
        (
            &["l4"],
            fp8(spec("L4 24 GB", 121.0, 60.0, 30.3, 0.3, 24), 242.0),
        ),
        (
            &["a10", "a10g"],
            spec("A10 24 GB", 125.0, 62.5, 31.2, 0.6, 24),
        ),
        (
            &["rtx-4090", "4090"],
            fp8(spec("RTX 4090 24 GB", 165.2, 82.6, 82.6, 1.008, 24), 330.3),
        ),
        (
            &["rtx-3090", "3090"],
            spec("RTX 3090 24 GB", 71.0, 35.6, 35.6, 0.936, 24),
        ),
    ]
}

/// `H100 SXM`, `h100-sxm` and `H100_SXM` are one name.
fn normalize(name: &str) -> String {
    name.chars()
        .filter(|c| !matches!(c, ' ' | '-' | '_'))
        .flat_map(char::to_lowercase)
        .collect()
}

/// The GPU called `name` (case, spaces, dashes and underscores ignored).
pub fn find(name: &str) -> Option<GpuSpec> {
    let wanted = normalize(name);
    table()
        .into_iter()
        .find_map(|(names, spec)| names.iter().any(|n| normalize(n) == wanted).then_some(spec))
}

/// The GPU a device reports itself as (`NVIDIA H100 80GB HBM3`, `NVIDIA H200`): the first
/// known GPU one of whose names the device's name contains, the longest names tried first.
pub fn of_device(device: &str) -> Option<GpuSpec> {
    let device = normalize(device);
    let mut candidates: Vec<(String, GpuSpec)> = table()
        .into_iter()
        .flat_map(|(names, spec)| names.iter().map(move |n| (normalize(n), spec.clone())))
        .collect();
    candidates.sort_by_key(|(n, _)| std::cmp::Reverse(n.len()));
    candidates
        .into_iter()
        .find(|(n, _)| device.contains(n.as_str()))
        .map(|(_, spec)| spec)
}

/// The canonical names, for help and errors.
pub fn names() -> Vec<&'static str> {
    table().into_iter().map(|(names, _)| names[0]).collect()
}

/// Every known GPU.
pub fn all() -> Vec<GpuSpec> {
    table().into_iter().map(|(_, spec)| spec).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_matched_by_the_names_in_theirs() {
        let h200 = of_device("NVIDIA H200").unwrap();
        assert!(h200.name.contains("H200"), "{}", h200.name);
        let h100 = of_device("NVIDIA H100 80GB HBM3").unwrap();
        assert!(h100.name.contains("H100"), "{}", h100.name);
        assert!(of_device("a toaster").is_none());
    }

    #[test]
    fn names_are_found_in_any_spelling() {
        for (name, memory) in [
            ("H100", 80),
            ("h100-sxm", 80),
            ("H200", 141),
            ("A100_40GB", 40),
            ("a100-80gb", 80),
            ("L4", 24),
            ("RTX 4090", 24),
        ] {
            let spec = find(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(spec.memory_bytes, Some(memory * GIB), "{name}");
        }
        assert!(find("tpu").is_none());
        // Every canonical name finds its own entry.
        for (n, spec) in names().into_iter().zip(all()) {
            assert_eq!(find(n), Some(spec));
        }
    }
}
