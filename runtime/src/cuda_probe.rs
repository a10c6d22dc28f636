//! Is there a CUDA device here? Asked of the driver library directly, before anything that
//! would panic without one: the CUDA bindings abort when `libcuda` is missing, so the probe
//! opens it itself and turns every way of not having a GPU into a [`NoCuda`] reason.

use std::ffi::{c_char, c_int};

/// A CUDA device the driver reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    pub name: String,
    /// Compute capability, e.g. (9, 0) for an H100.
    pub capability: (i32, i32),
    /// The driver's CUDA version, e.g. 13000 for 13.0.
    pub driver_version: i32,
    pub count: usize,
    /// The device's memory in bytes (`cuDeviceTotalMem`).
    pub total_memory: u64,
}

impl std::fmt::Display for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (sm_{}{}, CUDA driver {}.{}{})",
            self.name,
            self.capability.0,
            self.capability.1,
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10,
            if self.count > 1 {
                format!(", {} devices", self.count)
            } else {
                String::new()
            }
        )
    }
}

/// Why no CUDA device can be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoCuda {
    #[error("no CUDA driver: {0} could not be loaded (is the NVIDIA driver installed?)")]
    NoDriver(String),
    #[error("the CUDA driver failed to start: {call} returned error {code}")]
    Driver { call: &'static str, code: i32 },
    #[error("the CUDA driver found no device")]
    NoDevice,
}

type CuInit = unsafe extern "C" fn(c_int) -> c_int;
type CuCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type CuAttr = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type CuVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` / `_MINOR`.
const CC_MAJOR: c_int = 75;
const CC_MINOR: c_int = 76;

/// The first CUDA device, or why there is none. The driver is asked once per process; the
/// library stays loaded (the driver keeps state from `cuInit` that unloading would orphan),
/// and later calls return the first answer.
pub fn probe() -> Result<CudaDevice, NoCuda> {
    static ANSWER: std::sync::OnceLock<Result<CudaDevice, NoCuda>> = std::sync::OnceLock::new();
    ANSWER.get_or_init(ask_driver).clone()
}

/// The driver library, loaded once and never unloaded.
fn driver_library() -> Option<&'static libloading::Library> {
    static LIBRARY: std::sync::OnceLock<Option<libloading::Library>> = std::sync::OnceLock::new();
    LIBRARY
        .get_or_init(|| {
            // SAFETY: loading the driver library runs its initializers, which is what any
            // CUDA program does.
            DRIVER_NAMES
                .iter()
                .find_map(|&n| unsafe { libloading::Library::new(n) }.ok())
        })
        .as_ref()
}

/// The names the driver library is looked for under.
const DRIVER_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

fn ask_driver() -> Result<CudaDevice, NoCuda> {
    let names = DRIVER_NAMES;
    let lib = driver_library().ok_or_else(|| NoCuda::NoDriver(names[0].into()))?;
    let missing = |name: &str| NoCuda::NoDriver(format!("{} (it lacks `{name}`)", names[0]));
    // SAFETY: each symbol is looked up with its documented driver-API signature.
    unsafe {
        let init = lib
            .get::<CuInit>(b"cuInit\0")
            .map_err(|_| missing("cuInit"))?;
        let count = lib
            .get::<CuCount>(b"cuDeviceGetCount\0")
            .map_err(|_| missing("cuDeviceGetCount"))?;
        let get = lib
            .get::<CuGet>(b"cuDeviceGet\0")
            .map_err(|_| missing("cuDeviceGet"))?;
        let name = lib
            .get::<CuName>(b"cuDeviceGetName\0")
            .map_err(|_| missing("cuDeviceGetName"))?;
        let attr = lib
            .get::<CuAttr>(b"cuDeviceGetAttribute\0")
            .map_err(|_| missing("cuDeviceGetAttribute"))?;
        let version = lib
            .get::<CuVersion>(b"cuDriverGetVersion\0")
            .map_err(|_| missing("cuDriverGetVersion"))?;
        let total_mem = lib
            .get::<CuTotalMem>(b"cuDeviceTotalMem_v2\0")
            .map_err(|_| missing("cuDeviceTotalMem_v2"))?;
        let check = |call: &'static str, code: c_int| {
            if code == 0 {
                Ok(())
            } else {
                Err(NoCuda::Driver { call, code })
            }
        };
        check("cuInit", init(0))?;
        let mut n: c_int = 0;
        check("cuDeviceGetCount", count(&mut n))?;
        if n <= 0 {
            return Err(NoCuda::NoDevice);
        }
        let mut dev: c_int = 0;
        check("cuDeviceGet", get(&mut dev, 0))?;
        let mut buf = [0 as c_char; 256];
        check(
            "cuDeviceGetName",
            name(buf.as_mut_ptr(), buf.len() as c_int, dev),
        )?;
        let device_name = std::ffi::CStr::from_ptr(buf.as_ptr())
            .to_string_lossy()
            .into_owned();
        let (mut major, mut minor) = (0, 0);
        check("cuDeviceGetAttribute", attr(&mut major, CC_MAJOR, dev))?;
        check("cuDeviceGetAttribute", attr(&mut minor, CC_MINOR, dev))?;
        let mut driver: c_int = 0;
        check("cuDriverGetVersion", version(&mut driver))?;
        let mut memory: usize = 0;
        check("cuDeviceTotalMem_v2", total_mem(&mut memory, dev))?;
        Ok(CudaDevice {
            name: device_name,
            capability: (major, minor),
            driver_version: driver,
            count: n as usize,
            total_memory: memory as u64,
        })
    }
}
