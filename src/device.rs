//! Choosing where a command runs: `--device auto|cpu|cuda`.

use crate::commands::eval::Device;
use crate::CliError;
use castor_runtime::cuda_probe;

/// Checks the requested device and says which one runs. Only the CPU executor exists in this
/// build: `cuda` is an error that says what the probe found (no driver, no device, or a
/// device castor cannot use yet); `auto` runs on the CPU and says why.
pub fn select(device: Device) -> anyhow::Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda => {
            let why = match cuda_probe::probe() {
                Ok(d) => format!("found {d}, but this build has no CUDA executor yet"),
                Err(e) => e.to_string(),
            };
            Err(
                CliError::DeviceUnavailable(format!("--device cuda: {why}; use --device cpu"))
                    .into(),
            )
        }
        Device::Auto => {
            eprintln!("device: cpu ({})", why_cpu());
            Ok(())
        }
    }
}

/// Why `auto` runs on the CPU: what the CUDA probe found.
pub fn why_cpu() -> String {
    match cuda_probe::probe() {
        Ok(d) => format!("found {d}; this build has no CUDA executor yet"),
        Err(e) => e.to_string(),
    }
}
