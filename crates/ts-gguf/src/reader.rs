//! GGUF header parser. Every count, length, offset, dimension and type id is
//! checked against the bytes that remain before it is used, so a corrupt or
//! hostile file yields a [`GgufError`] and never a panic or an allocation
//! sized by an unchecked field.
//!
//! Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor
//! count, u64 metadata count, the metadata key/values, the tensor infos (name,
//! u32 n_dims, u64 dims, u32 type, u64 offset), padding to `general.alignment`,
//! then the data section that tensor offsets are relative to.

use crate::types::GgmlType;
use crate::value::{Array, Value, ValueType};
use crate::{GgufError, Metadata, TensorInfo};
use std::collections::HashSet;

pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions.
pub const MAX_DIMS: u32 = 4;
/// Arrays of arrays deeper than this are refused (no real file nests past 2).
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// Bytes a tensor info takes at least: name length, n_dims, type, offset.
const MIN_TENSOR_INFO_SIZE: u64 = 8 + 4 + 4 + 8;
/// Bytes a key/value takes at least: key length, value type, a 1-byte value.
const MIN_KV_SIZE: u64 = 8 + 4 + 1;

/// A parsed GGUF header: everything but the tensor data.
#[derive(Clone, Debug)]
pub struct Gguf {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and of every tensor offset.
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    /// Bytes from `data_offset` to the end of the input.
    pub data_len: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                offset: self.pos as u64,
                what: what(),
                needed: n,
                left: self.remaining(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        Ok(self.take(N as u64, what)?.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let at = self.pos as u64;
        let len = self.u64(&|| format!("{} (string length)", what()))?;
        if len > self.remaining() {
            return Err(GgufError::BadLength { offset: at, what: what(), len, left: self.remaining() });
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 { offset: at, what: what() })
    }

    /// Reads a count and checks that `count` elements of at least `min_size`
    /// bytes each can fit in what remains, so it can size an allocation.
    fn count(&mut self, min_size: u64, what: &dyn Fn() -> String) -> Result<usize, GgufError> {
        let at = self.pos as u64;
        let n = self.u64(what)?;
        match n.checked_mul(min_size) {
            Some(need) if need <= self.remaining() => Ok(n as usize),
            _ => Err(GgufError::BadLength { offset: at, what: what(), len: n, left: self.remaining() }),
        }
    }
}

/// Parses a GGUF header from the start of `buf`, which must hold the whole
/// file (or at least the header, for [`Gguf::data_len`] to be meaningful).
pub fn parse(buf: &[u8]) -> Result<Gguf, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array(&|| "magic".into())?;
    if &magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = c.count(MIN_TENSOR_INFO_SIZE, &|| "tensor count".into())?;
    let n_kv = c.count(MIN_KV_SIZE, &|| "metadata count".into())?;

    let mut metadata = Metadata::default();
    for i in 0..n_kv {
        let at = c.pos as u64;
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let type_id = c.u32(&|| format!("type of metadata '{key}'"))?;
        let vt = ValueType::from_id(type_id).ok_or_else(|| GgufError::BadValueType {
            offset: at,
            key: key.clone(),
            type_id,
        })?;
        let value = read_value(&mut c, vt, &key, 0)?;
        if metadata.get(&key).is_some() {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => *a as u64,
        Some(v) => return Err(GgufError::BadAlignment(v.summary(4))),
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut names = HashSet::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let t = read_tensor_info(&mut c, i, alignment)?;
        if !names.insert(t.name.clone()) {
            return Err(GgufError::DuplicateTensor(t.name));
        }
        tensors.push(t);
    }

    let header_end = c.pos as u64;
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    if n_tensors > 0 && data_offset > file_len {
        return Err(GgufError::Truncated {
            offset: header_end,
            what: "padding before the data section".into(),
            needed: data_offset - header_end,
            left: file_len - header_end,
        });
    }
    let data_len = file_len.saturating_sub(data_offset);
    check_tensor_extents(&tensors, data_offset, data_len)?;

    Ok(Gguf { version, metadata, tensors, alignment, data_offset, data_len })
}

fn read_value(c: &mut Cursor, vt: ValueType, key: &str, depth: u32) -> Result<Value, GgufError> {
    let what = || format!("value of metadata '{key}'");
    Ok(match vt {
        ValueType::U8 => Value::U8(c.array::<1>(&what)?[0]),
        ValueType::I8 => Value::I8(c.array::<1>(&what)?[0] as i8),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array(&what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array(&what)?)),
        ValueType::U32 => Value::U32(u32::from_le_bytes(c.array(&what)?)),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array(&what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array(&what)?)),
        ValueType::U64 => Value::U64(u64::from_le_bytes(c.array(&what)?)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array(&what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array(&what)?)),
        ValueType::Bool => Value::Bool(read_bool(c, key)?),
        ValueType::String => Value::String(c.string(&what)?),
        ValueType::Array => Value::Array(read_array(c, key, depth)?),
    })
}

fn read_bool(c: &mut Cursor, key: &str) -> Result<bool, GgufError> {
    let at = c.pos as u64;
    match c.array::<1>(&|| format!("value of metadata '{key}'"))?[0] {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(GgufError::BadBool { offset: at, key: key.into(), byte: b }),
    }
}

fn read_array(c: &mut Cursor, key: &str, depth: u32) -> Result<Array, GgufError> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::ArrayTooDeep { key: key.into(), max: MAX_ARRAY_DEPTH });
    }
    let at = c.pos as u64;
    let type_id = c.u32(&|| format!("element type of array '{key}'"))?;
    let et =
        ValueType::from_id(type_id).ok_or_else(|| GgufError::BadValueType { offset: at, key: key.into(), type_id })?;
    let n = c.count(et.min_encoded_size(), &|| format!("length of array '{key}'"))?;
    let what = || format!("elements of array '{key}'");

    macro_rules! fixed {
        ($variant:ident, $t:ty) => {{
            let bytes = c.take((n * size_of::<$t>()) as u64, &what)?;
            Array::$variant(
                bytes.chunks_exact(size_of::<$t>()).map(|b| <$t>::from_le_bytes(b.try_into().unwrap())).collect(),
            )
        }};
    }
    Ok(match et {
        ValueType::U8 => Array::U8(c.take(n as u64, &what)?.to_vec()),
        ValueType::I8 => Array::I8(c.take(n as u64, &what)?.iter().map(|&b| b as i8).collect()),
        ValueType::U16 => fixed!(U16, u16),
        ValueType::I16 => fixed!(I16, i16),
        ValueType::U32 => fixed!(U32, u32),
        ValueType::I32 => fixed!(I32, i32),
        ValueType::F32 => fixed!(F32, f32),
        ValueType::U64 => fixed!(U64, u64),
        ValueType::I64 => fixed!(I64, i64),
        ValueType::F64 => fixed!(F64, f64),
        ValueType::Bool => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_bool(c, key)?);
            }
            Array::Bool(v)
        }
        ValueType::String => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(c.string(&|| format!("element {i} of array '{key}'"))?);
            }
            Array::String(v)
        }
        ValueType::Array => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            Array::Array(v)
        }
    })
}

fn read_tensor_info(c: &mut Cursor, index: usize, alignment: u64) -> Result<TensorInfo, GgufError> {
    let name = c.string(&|| format!("name of tensor #{index}"))?;
    let n_dims = c.u32(&|| format!("dimension count of tensor '{name}'"))?;
    if n_dims > MAX_DIMS {
        return Err(GgufError::BadTensor { name, problem: format!("{n_dims} dimensions (at most {MAX_DIMS})") });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(c.u64(&|| format!("dimensions of tensor '{name}'"))?);
    }
    let type_id = c.u32(&|| format!("type of tensor '{name}'"))?;
    let offset = c.u64(&|| format!("offset of tensor '{name}'"))?;

    let ggml_type =
        GgmlType::from_id(type_id).map_err(|e| GgufError::BadTensor { name: name.clone(), problem: e.to_string() })?;
    let bad = |problem: String| GgufError::BadTensor { name: name.clone(), problem };
    if let Some(d) = dims.iter().find(|&&d| d > i64::MAX as u64) {
        return Err(bad(format!("dimension {d} is negative or too large")));
    }
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d).filter(|&n| n <= i64::MAX as u64))
        .ok_or_else(|| bad(format!("dimensions {dims:?} overflow the element count")))?;
    let row = dims.first().copied().unwrap_or(1);
    if row % ggml_type.block_size() != 0 {
        return Err(bad(format!(
            "first dimension {row} is not a multiple of the {} block size {}",
            ggml_type,
            ggml_type.block_size()
        )));
    }
    let n_bytes = ggml_type
        .bytes_for(n_elements)
        .ok_or_else(|| bad(format!("size of {n_elements} {ggml_type} elements overflows")))?;
    if offset % alignment != 0 {
        return Err(bad(format!("data offset {offset} is not a multiple of the alignment {alignment}")));
    }
    Ok(TensorInfo { name, dims, ggml_type, offset, n_elements, n_bytes })
}

/// Every tensor lies inside the data section and no two overlap.
fn check_tensor_extents(tensors: &[TensorInfo], data_offset: u64, data_len: u64) -> Result<(), GgufError> {
    for t in tensors {
        let end = t.offset.checked_add(t.n_bytes);
        if end.is_none_or(|e| e > data_len) {
            return Err(GgufError::TensorOutOfBounds {
                name: t.name.clone(),
                start: data_offset.saturating_add(t.offset),
                len: t.n_bytes,
                file_len: data_offset + data_len,
            });
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        if w[0].offset + w[0].n_bytes > w[1].offset {
            return Err(GgufError::TensorsOverlap(w[0].name.clone(), w[1].name.clone()));
        }
    }
    Ok(())
}
