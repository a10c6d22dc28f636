//! Choosing where a command runs: `--device auto|cpu|cuda|emulate`.

use crate::commands::eval::Device;
use crate::CliError;
use castor_runtime::cuda_probe;

/// The executor a command runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selected {
    Cpu,
    /// The first CUDA device, described for people.
    Cuda(String),
    /// The CUDA program, run by the host emulator.
    Emulated,
}

/// Resolves `--device` with the driver probe and says which executor runs (one `device:`
/// line on stderr): `cuda` is an error (exit code 5) saying what the probe found when there
/// is no usable device; `auto` takes CUDA when the driver reports a device and says why it
/// runs on the CPU otherwise.
pub fn select(device: Device) -> anyhow::Result<Selected> {
    let (selected, said) = resolve(device)?;
    if let Some(line) = said {
        crate::errln!("device: {line}");
    }
    Ok(selected)
}

/// [`select`] without its line: the executor, and what `select` would say about it (nothing
/// for an explicit `--device cpu`). For a command that reports the device itself.
pub fn resolve(device: Device) -> anyhow::Result<(Selected, Option<String>)> {
    match device {
        Device::Cpu => Ok((Selected::Cpu, None)),
        Device::Emulate => Ok((
            Selected::Emulated,
            Some("emulate (the CUDA program, run on the host by the emulator)".into()),
        )),
        Device::Cuda => match cuda_probe::probe() {
            Ok(d) => Ok((Selected::Cuda(d.to_string()), Some(format!("cuda ({d})")))),
            Err(e) => Err(CliError::DeviceUnavailable(format!(
                "--device cuda: {e}; use --device cpu"
            ))
            .into()),
        },
        Device::Auto => match cuda_probe::probe() {
            Ok(d) => Ok((Selected::Cuda(d.to_string()), Some(format!("cuda ({d})")))),
            Err(e) => Ok((Selected::Cpu, Some(format!("cpu ({e})")))),
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
