//! One safetensors file: memory-mapped, header validated up front, tensors read on demand.
//!
//! Checkpoints are large and untrusted. Opening a file maps it and parses only the header, but
//! checks every entry against the file before anything is read: the 8-byte length against the
//! file size, each dtype, each shape (element count overflow), each `data_offsets` pair
//! against the data region and against the byte length its dtype and shape need, overlaps
//! between tensors and duplicate names. After that, reading a tensor is a bounds-safe slice of
//! the map that touches only that tensor's pages.
//!
//! The parser is our own rather than `safetensors::SafeTensors` so that every error names the
//! file and the tensor; the `safetensors` crate provides the dtype vocabulary ([`Dtype`]) and,
//! in tests, the writer.

use crate::error::{dims, ModelError};
use castor_ir::fp8::Fp8Format;
use castor_ir::{DType, Tensor};
use half::{bf16, f16};
use memmap2::Mmap;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

pub use safetensors::Dtype;

/// Headers larger than this are refused (the `safetensors` crate's own limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Where one tensor lives in its file, as the header says (validated).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range within the data region (after the header).
    pub data_offsets: (usize, usize),
}

impl TensorInfo {
    /// The IR dtype castor reads this tensor as, if it can.
    pub fn ir_dtype(&self) -> Option<DType> {
        ir_dtype(self.dtype)
    }

    pub fn numel(&self) -> usize {
        // Validated not to overflow when the header was read.
        self.shape.iter().product()
    }
}

/// The IR dtype of a safetensors dtype, for the ones castor reads. `F8_E4M3` is OCP E4M3
/// (PyTorch's `float8_e4m3fn`), `F8_E5M2` is E5M2; the AMD `FNUZ` variants are not read.
pub fn ir_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::I64 => Some(DType::I64),
        Dtype::I32 => Some(DType::I32),
        Dtype::BOOL => Some(DType::Bool),
        Dtype::U8 => Some(DType::U8),
        Dtype::F8_E4M3 => Some(DType::F8E4M3),
        Dtype::F8_E5M2 => Some(DType::F8E5M2),
        _ => None,
    }
}

/// A memory-mapped, validated safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    map: Bytes,
    /// Offset of the data region: 8 + header length.
    data_start: usize,
    tensors: BTreeMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
}

impl fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// A file's bytes: mapped from disk, or built in memory.
enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl SafetensorsFile {
    /// Safetensors bytes built in memory (arrays handed over by a caller), checked as a file
    /// is; `name` stands for the path in messages.
    pub fn from_bytes(
        name: impl Into<PathBuf>,
        bytes: Vec<u8>,
    ) -> Result<SafetensorsFile, ModelError> {
        let path = name.into();
        if bytes.len() < 8 {
            return Err(ModelError::Header {
                file: path,
                message: format!(
                    "{} bytes, shorter than the 8-byte header length",
                    bytes.len()
                ),
            });
        }
        let (data_start, tensors, metadata) = parse_header(&path, &bytes)?;
        Ok(SafetensorsFile {
            path,
            map: Bytes::Owned(bytes),
            data_start,
            tensors,
            metadata,
        })
    }

    /// Maps the file and validates its header; reads no tensor data.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile, ModelError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| ModelError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let header_err = |message: String| ModelError::Header {
            file: path.clone(),
            message,
        };
        if len < 8 {
            return Err(header_err(format!(
                "the file is {len} bytes long, shorter than the 8-byte header length"
            )));
        }
        // SAFETY: the map is read-only and private to this value. As with every mmap-based
        // reader (safetensors, transformers), the file must not be truncated or rewritten
        // while it is open; all reads below are bounds-checked against the map's length.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (data_start, tensors, metadata) = parse_header(&path, &map)?;
        Ok(SafetensorsFile {
            path,
            map: Bytes::Mapped(map),
            data_start,
            tensors,
            metadata,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// The header's free-form `__metadata__`.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The raw little-endian bytes of one tensor.
    pub fn bytes(&self, name: &str) -> Result<&[u8], ModelError> {
        let info = self.info_or_err(name)?;
        let (s, e) = info.data_offsets;
        // Validated at open; `get` keeps this panic-free regardless.
        self.map
            .get(self.data_start + s..self.data_start + e)
            .ok_or_else(|| self.entry_err(name, "data_offsets out of range".into()))
    }

    /// A float tensor as F32, widening F16, BF16 and FP8 exactly (FP8 as
    /// [`Fp8Format::decode`]: E5M2's infinities and NaNs kept).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let info = self.info_or_err(name)?;
        let bytes = self.bytes(name)?;
        match info.dtype {
            Dtype::F32 => Ok(bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            Dtype::F16 => Ok(bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            Dtype::BF16 => Ok(bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            Dtype::F8_E4M3 => Ok(bytes.iter().map(|&b| Fp8Format::E4M3.decode(b)).collect()),
            Dtype::F8_E5M2 => Ok(bytes.iter().map(|&b| Fp8Format::E5M2.decode(b)).collect()),
            other => Err(self.dtype_err(name, other, "F32")),
        }
    }

    /// An integer tensor (I64 or I32) as i64.
    pub fn read_i64(&self, name: &str) -> Result<Vec<i64>, ModelError> {
        let info = self.info_or_err(name)?;
        let bytes = self.bytes(name)?;
        match info.dtype {
            Dtype::I64 => Ok(bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect()),
            Dtype::I32 => Ok(bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect()),
            other => Err(self.dtype_err(name, other, "I64")),
        }
    }

    /// The tensor as an IR host tensor of its stored dtype (F16, BF16 and FP8 values are held
    /// as exactly widened F32, as [`Tensor`] does).
    pub fn tensor(&self, name: &str) -> Result<Tensor, ModelError> {
        let info = self.info_or_err(name)?;
        let shape = info.shape.clone();
        match info.dtype {
            Dtype::F32 | Dtype::F16 | Dtype::BF16 => {
                let dtype = info.ir_dtype().unwrap_or(DType::F32);
                Ok(Tensor::from_f32(dtype, shape, self.read_f32(name)?))
            }
            Dtype::I64 | Dtype::I32 => {
                let dtype = info.ir_dtype().unwrap_or(DType::I64);
                Ok(Tensor::from_i64(dtype, shape, self.read_i64(name)?))
            }
            Dtype::BOOL => {
                let data = self.bytes(name)?.iter().map(|&b| b != 0).collect();
                Ok(Tensor::from_bool(shape, data))
            }
            Dtype::U8 => Ok(Tensor::from_u8(shape, self.bytes(name)?.to_vec())),
            Dtype::F8_E4M3 => Ok(Tensor::from_fp8_bytes(
                DType::F8E4M3,
                shape,
                self.bytes(name)?,
            )),
            Dtype::F8_E5M2 => Ok(Tensor::from_fp8_bytes(
                DType::F8E5M2,
                shape,
                self.bytes(name)?,
            )),
            other => Err(self.dtype_err(name, other, "an IR tensor")),
        }
    }

    /// A float tensor as an F32 IR tensor (the master copy of a parameter).
    pub fn tensor_f32(&self, name: &str) -> Result<Tensor, ModelError> {
        let shape = self.info_or_err(name)?.shape.clone();
        Ok(Tensor::from_f32(DType::F32, shape, self.read_f32(name)?))
    }

    fn info_or_err(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::TensorNotFound {
                path: self.path.clone(),
                tensor: name.to_string(),
            })
    }

    fn entry_err(&self, name: &str, message: String) -> ModelError {
        ModelError::TensorEntry {
            file: self.path.clone(),
            tensor: name.to_string(),
            message,
        }
    }

    fn dtype_err(&self, name: &str, found: Dtype, wanted: &str) -> ModelError {
        ModelError::UnsupportedDtype {
            file: self.path.clone(),
            tensor: name.to_string(),
            found: format!("{found:?}"),
            wanted: wanted.to_string(),
        }
    }
}

type Parsed = (
    usize,
    BTreeMap<String, TensorInfo>,
    BTreeMap<String, String>,
);

/// A validated header, from [`parse_bytes`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Offset of the data region in the file: 8 + header length.
    pub data_start: usize,
    pub tensors: BTreeMap<String, TensorInfo>,
    pub metadata: BTreeMap<String, String>,
}

/// Validates a whole safetensors file held in memory exactly as [`SafetensorsFile::open`]
/// validates a mapped one (`name` is used in messages). Every tensor's `data_offsets`, shifted
/// by `data_start`, then lie inside `bytes`. The entry point of the fuzz target.
pub fn parse_bytes(name: &str, bytes: &[u8]) -> Result<Header, ModelError> {
    if bytes.len() < 8 {
        return Err(ModelError::Header {
            file: PathBuf::from(name),
            message: format!(
                "the file is {} bytes long, shorter than the 8-byte header length",
                bytes.len()
            ),
        });
    }
    let (data_start, tensors, metadata) = parse_header(Path::new(name), bytes)?;
    Ok(Header {
        data_start,
        tensors,
        metadata,
    })
}

/// Parses and validates the header of a file whose bytes are `buf`.
fn parse_header(path: &Path, buf: &[u8]) -> Result<Parsed, ModelError> {
    let header_err = |message: String| ModelError::Header {
        file: path.to_path_buf(),
        message,
    };
    let entry_err = |tensor: &str, message: String| ModelError::TensorEntry {
        file: path.to_path_buf(),
        tensor: tensor.to_string(),
        message,
    };
    let file_len = buf.len() as u64;
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(
        buf.get(..8)
            .ok_or_else(|| header_err("file too short".into()))?,
    );
    let n = u64::from_le_bytes(len8);
    if n > file_len - 8 {
        return Err(header_err(format!(
            "header length {n} (from the first 8 bytes) exceeds the {} bytes that follow them \
             in a file of {file_len} bytes",
            file_len - 8
        )));
    }
    if n > MAX_HEADER_BYTES {
        return Err(header_err(format!(
            "header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes"
        )));
    }
    let data_start = 8 + n as usize;
    let data_len = buf.len() - data_start;
    let json = buf
        .get(8..data_start)
        .ok_or_else(|| header_err("file too short".into()))?;
    if let Err(e) = std::str::from_utf8(json) {
        return Err(header_err(format!(
            "expected UTF-8 JSON text, found an invalid byte at header offset {}",
            e.valid_up_to()
        )));
    }
    let entries: Entries = serde_json::from_slice(json)
        .map_err(|e| header_err(format!("the header is not a JSON object of tensors: {e}")))?;

    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (name, value) in entries.0 {
        if name == "__metadata__" {
            metadata = serde_json::from_value(value).map_err(|e| {
                header_err(format!("`__metadata__` must map strings to strings: {e}"))
            })?;
            continue;
        }
        if tensors.contains_key(&name) {
            return Err(entry_err(
                &name,
                "the header lists this name twice (expected each tensor once)".into(),
            ));
        }
        let raw = raw_entry(&value).map_err(|m| entry_err(&name, m))?;
        let info = validate_entry(&raw, data_len).map_err(|m| entry_err(&name, m))?;
        tensors.insert(name, info);
    }

    // Overlaps: sort non-empty ranges by start; each must begin at or after the previous end.
    let mut ranges: Vec<(&str, (usize, usize))> = tensors
        .iter()
        .filter(|(_, t)| t.data_offsets.0 < t.data_offsets.1)
        .map(|(n, t)| (n.as_str(), t.data_offsets))
        .collect();
    ranges.sort_by_key(|&(_, r)| r);
    for pair in ranges.windows(2) {
        let ((a, ra), (b, rb)) = (pair[0], pair[1]);
        if rb.0 < ra.1 {
            return Err(entry_err(
                b,
                format!(
                    "data_offsets [{}, {}] overlap tensor `{a}` at [{}, {}]",
                    rb.0, rb.1, ra.0, ra.1
                ),
            ));
        }
    }
    Ok((data_start, tensors, metadata))
}

/// One header entry, its fields typed but not yet checked against the file.
struct RawEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// Reads `{"dtype": ..., "shape": [...], "data_offsets": [start, end]}`, saying which field
/// is wrong, what it should be and what it is.
fn raw_entry(value: &serde_json::Value) -> Result<RawEntry, String> {
    use serde_json::Value;
    let obj = value.as_object().ok_or_else(|| {
        format!(
            "expected an object with `dtype`, `shape` and `data_offsets`, found {}",
            short(value)
        )
    })?;
    if let Some(key) = obj
        .keys()
        .find(|k| !matches!(k.as_str(), "dtype" | "shape" | "data_offsets"))
    {
        return Err(format!(
            "unknown field `{key}` (expected `dtype`, `shape` and `data_offsets`)"
        ));
    }
    let field = |key: &str| obj.get(key).ok_or_else(|| format!("missing field `{key}`"));
    let dtype_value = field("dtype")?;
    let dtype: Dtype = match dtype_value {
        Value::String(_) => serde_json::from_value(dtype_value.clone()).ok(),
        _ => None,
    }
    .ok_or_else(|| {
        format!(
            "`dtype`: expected a safetensors dtype (F32, F16, BF16, I64, I32, BOOL, ...), \
             found {}",
            short(dtype_value)
        )
    })?;
    let uints = |v: &Value| -> Option<Vec<usize>> {
        v.as_array()?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect()
    };
    let shape_value = field("shape")?;
    let shape = uints(shape_value).ok_or_else(|| {
        format!(
            "`shape`: expected a list of non-negative integers, found {}",
            short(shape_value)
        )
    })?;
    let offsets_value = field("data_offsets")?;
    let data_offsets = match uints(offsets_value).as_deref() {
        Some(&[s, e]) => (s, e),
        _ => {
            return Err(format!(
                "`data_offsets`: expected [start, end] (two non-negative integers), found {}",
                short(offsets_value)
            ))
        }
    };
    Ok(RawEntry {
        dtype,
        shape,
        data_offsets,
    })
}

/// A JSON value, cut short for messages.
fn short(v: &serde_json::Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        let cut = (0..=77).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        format!("{}...", &s[..cut])
    } else {
        s
    }
}

fn validate_entry(raw: &RawEntry, data_len: usize) -> Result<TensorInfo, String> {
    let too_many = || {
        format!(
            "shape {}: the product of its dims overflows a 64-bit byte count",
            dims(&raw.shape)
        )
    };
    let numel = raw
        .shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(too_many)?;
    let bits = numel
        .checked_mul(raw.dtype.bitsize())
        .ok_or_else(too_many)?;
    if bits % 8 != 0 {
        return Err(format!(
            "{numel} elements of {:?} do not fill whole bytes",
            raw.dtype
        ));
    }
    let need = bits / 8;
    let (s, e) = raw.data_offsets;
    if s > e {
        return Err(format!("data_offsets [{s}, {e}] end before they start"));
    }
    if e > data_len {
        return Err(format!(
            "data_offsets [{s}, {e}] reach past the end of the data region ({data_len} bytes)"
        ));
    }
    if e - s != need {
        return Err(format!(
            "data_offsets [{s}, {e}] hold {} bytes, but {:?} {} needs {need}",
            e - s,
            raw.dtype,
            dims(&raw.shape)
        ));
    }
    Ok(TensorInfo {
        dtype: raw.dtype,
        shape: raw.shape.clone(),
        data_offsets: raw.data_offsets,
    })
}

/// A JSON object's entries in file order, duplicates kept (serde_json's maps drop them).
pub(crate) struct Entries(pub Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, serde_json::Value>()? {
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V)
    }
}
