//! The GGUF container: header, metadata, tensor table, and a tensor's bytes
//! through mmap or through positioned reads of a byte range; and a writer.

mod reader;
mod types;
mod value;
mod writer;

pub use reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC, Gguf, MAX_ARRAY_DEPTH, MAX_DIMS, parse};
pub use types::{GgmlType, QK_K, TypeIdError};
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, TensorDataWriter, write_padding};

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Everything that can be wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file: magic is {0:02x?}, expected \"GGUF\"")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (only versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("file truncated at byte {offset}: {what} needs {needed} bytes, {left} left")]
    Truncated { offset: u64, what: String, needed: u64, left: u64 },
    #[error("bad length at byte {offset}: {what} is {len}, but only {left} bytes remain (file truncated or corrupt)")]
    BadLength { offset: u64, what: String, len: u64, left: u64 },
    #[error("{what} at byte {offset} is not valid UTF-8")]
    BadUtf8 { offset: u64, what: String },
    #[error("metadata '{key}' at byte {offset} has unknown value type id {type_id}")]
    BadValueType { offset: u64, key: String, type_id: u32 },
    #[error("metadata '{key}' at byte {offset} has bool byte {byte}, expected 0 or 1")]
    BadBool { offset: u64, key: String, byte: u8 },
    #[error("metadata '{key}' nests arrays deeper than {max} levels")]
    ArrayTooDeep { key: String, max: u32 },
    #[error("metadata key '{0}' appears twice")]
    DuplicateKey(String),
    #[error("general.alignment must be a non-zero power of two u32, found {0}")]
    BadAlignment(String),
    #[error("tensor '{name}': {problem}")]
    BadTensor { name: String, problem: String },
    #[error("tensor name '{0}' appears twice")]
    DuplicateTensor(String),
    #[error("tensor '{name}' data at bytes {start}..+{len} lies past the end of the file ({file_len} bytes)")]
    TensorOutOfBounds { name: String, start: u64, len: u64, file_len: u64 },
    #[error("tensors '{0}' and '{1}' overlap in the data section")]
    TensorsOverlap(String, String),
    #[error("metadata '{0}' is missing")]
    MissingKey(String),
    #[error("metadata '{key}' is {found}, expected {expected}")]
    WrongType { key: String, found: String, expected: &'static str },
    #[error("no tensor named '{0}'")]
    NoTensor(String),
    // The OS error is part of the message, not a `source`: a caller printing the chain would say it twice.
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: read of {len} bytes at offset {offset} failed: {error}")]
    Read { path: PathBuf, offset: u64, len: u64, error: std::io::Error },
    #[error("range {start}..{end} is outside tensor '{name}' ({len} bytes)")]
    BadRange { name: String, start: u64, end: u64, len: u64 },
}

/// One entry of the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the contiguous (row) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the tensor's bytes relative to the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

/// Metadata key/values in file order, with lookup by key.
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    pub fn insert(&mut self, key: String, value: Value) {
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn wrong(key: &str, v: &Value, expected: &'static str) -> GgufError {
        GgufError::WrongType { key: key.into(), found: v.value_type().name().into(), expected }
    }

    fn required(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    /// A non-negative integer of any width; `None` if absent, an error if of another type.
    pub fn u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key).map(|v| v.as_u64().ok_or_else(|| Self::wrong(key, v, "a non-negative integer"))).transpose()
    }

    pub fn f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.get(key).map(|v| v.as_f64().ok_or_else(|| Self::wrong(key, v, "a number"))).transpose()
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key).map(|v| v.as_bool().ok_or_else(|| Self::wrong(key, v, "a bool"))).transpose()
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key).map(|v| v.as_str().ok_or_else(|| Self::wrong(key, v, "a string"))).transpose()
    }

    pub fn array(&self, key: &str) -> Result<Option<&Array>, GgufError> {
        self.get(key).map(|v| v.as_array().ok_or_else(|| Self::wrong(key, v, "an array"))).transpose()
    }

    pub fn req_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.required(key)?;
        v.as_u64().ok_or_else(|| Self::wrong(key, v, "a non-negative integer"))
    }

    pub fn req_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.required(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, v, "a string"))
    }

    /// A string array; an error if absent or of another element type.
    pub fn req_strings(&self, key: &str) -> Result<&[String], GgufError> {
        let v = self.required(key)?;
        v.as_array().and_then(Array::as_strings).ok_or_else(|| Self::wrong(key, v, "an array of strings"))
    }

    /// `general.architecture`, which every model file names.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.req_str("general.architecture")
    }
}

impl Gguf {
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Sum of every tensor's bytes.
    pub fn tensor_bytes_total(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_bytes).sum()
    }
}

/// An open GGUF file: its parsed header, a read-only map of the whole file,
/// and the file handle for positioned reads.
pub struct GgufFile {
    pub path: PathBuf,
    pub header: Gguf,
    file: File,
    map: memmap2::Mmap,
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |error| GgufError::Io { path: path.clone(), error };
        let file = File::open(&path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(io(std::io::Error::other("not a regular file")));
        }
        // SAFETY: the map is read-only; a file truncated by another process
        // while mapped can fault on access, which is the documented mmap
        // contract every GGUF engine accepts.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let header = parse(&map)?;
        Ok(GgufFile { path, header, file, map })
    }

    pub fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.header.tensor(name).ok_or_else(|| GgufError::NoTensor(name.into()))
    }

    /// Absolute file offset of a tensor's first byte.
    pub fn tensor_file_offset(&self, t: &TensorInfo) -> u64 {
        self.header.data_offset + t.offset
    }

    /// A tensor's bytes through the memory map.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = self.tensor_file_offset(t) as usize;
        &self.map[start..start + t.n_bytes as usize]
    }

    /// The whole file as mapped.
    pub fn mapped(&self) -> &[u8] {
        &self.map
    }

    /// Drops the process's pages of the whole pages within `range` of the map (bytes copied
    /// elsewhere and not read here again soon), so that they stop counting in its resident
    /// memory; a later read brings them back from the file.
    pub fn release(&self, range: Range<usize>) {
        const PAGE: usize = 4096;
        let (start, end) = (range.start.next_multiple_of(PAGE), range.end.min(self.map.len()) / PAGE * PAGE);
        if start < end {
            // SAFETY: the map is read-only (no page of it was ever written), so no data is
            // lost: the pages are read from the file again when next touched. A failure only
            // leaves them resident. (On kernels with pages larger than PAGE the start is rounded
            // down: a neighbour's page is released too, and faulted back in when read.)
            let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
        }
    }

    /// Reads `range` (relative to the tensor's start) into `buf` with
    /// positioned reads, without touching the map.
    pub fn read_tensor_range(&self, t: &TensorInfo, range: Range<u64>, buf: &mut [u8]) -> Result<(), GgufError> {
        if range.start > range.end || range.end > t.n_bytes || buf.len() as u64 != range.end - range.start {
            return Err(GgufError::BadRange {
                name: t.name.clone(),
                start: range.start,
                end: range.end,
                len: t.n_bytes,
            });
        }
        let offset = self.tensor_file_offset(t) + range.start;
        self.file.read_exact_at(buf, offset).map_err(|error| GgufError::Read {
            path: self.path.clone(),
            offset,
            len: buf.len() as u64,
            error,
        })
    }

    /// The underlying file, for readers that manage their own I/O (O_DIRECT, pools).
    pub fn file(&self) -> &File {
        &self.file
    }
}
