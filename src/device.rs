//! Choosing where a command runs: `--device auto|cpu|cuda|emulate`.

use crate::commands::eval::Device;
use crate::CliError;
use castor_runtime::{cuda_probe, ExecutorKind};

/// Resolves `--device` with the driver probe and says which executor runs (one `device:`
/// line on stderr): `cuda` is an error (exit code 5) saying what the probe found when there
/// is no usable device; `auto` takes CUDA when the driver reports a device and says why it
/// runs on the CPU otherwise.
pub fn select(device: Device) -> anyhow::Result<ExecutorKind> {
    let (selected, said) = resolve(device)?;
    if let Some(line) = said {
        crate::errln!("device: {line}");
    }
    Ok(selected)
}

/// [`select`] without its line: the executor, and what `select` would say about it (nothing
/// for an explicit `--device cpu`). For a command that reports the device itself.
pub fn resolve(device: Device) -> anyhow::Result<(ExecutorKind, Option<String>)> {
    match device {
        Device::Cpu => Ok((ExecutorKind::Cpu, None)),
        Device::Emulate => Ok((
            ExecutorKind::Emulate,
            Some("emulate (the CUDA program, run on the host by the emulator)".into()),
        )),
        Device::Cuda => match cuda_probe::probe() {
            Ok(d) => Ok((ExecutorKind::Cuda, Some(format!("cuda ({d})")))),
            Err(e) => Err(CliError::DeviceUnavailable(format!(
                "--device cuda: {e}; use --device cpu"
            ))
            .into()),
        },
        Device::Auto => match cuda_probe::probe() {
            Ok(d) => Ok((ExecutorKind::Cuda, Some(format!("cuda ({d})")))),
            Err(e) => Ok((ExecutorKind::Cpu, Some(format!("cpu ({e})")))),
        },
    }
}

/// Why the CPU runs: what the CUDA probe found (or that `--device cpu` asked for it).
pub fn why_cpu() -> String {
    match cuda_probe::probe() {
        Ok(d) => format!("--device cpu; found {d}"),
        Err(e) => e.to_string(),
    }
}
