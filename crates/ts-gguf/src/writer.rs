//! GGUF writer: metadata and tensor infos first, then tensor data streamed in
//! table order, so files larger than memory can be written.

use crate::types::GgmlType;
use crate::value::{Array, Value};
use crate::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS, TensorInfo};
use std::io::{self, Write};

/// Collects metadata and the tensor table of a GGUF file to write.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    data_len: u64,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl GgufWriter {
    /// A version-3 file with the default 32-byte alignment.
    pub fn new() -> Self {
        GgufWriter { version: 3, alignment: DEFAULT_ALIGNMENT, metadata: Vec::new(), tensors: Vec::new(), data_len: 0 }
    }

    pub fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Adds (or replaces) a key. `general.alignment` (u32, a power of two) also
    /// sets the alignment used for tensor offsets; set it before adding tensors.
    pub fn set(&mut self, key: &str, value: Value) -> io::Result<()> {
        if key == "general.alignment" {
            match value {
                Value::U32(a) if a != 0 && a.is_power_of_two() => {
                    if !self.tensors.is_empty() {
                        return Err(invalid("set general.alignment before adding tensors".into()));
                    }
                    self.alignment = a as u64
                }
                _ => return Err(invalid("general.alignment must be a power-of-two u32".into())),
            }
        }
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
        Ok(())
    }

    /// Appends a tensor to the table; its data must later be written in this order.
    pub fn add_tensor(&mut self, name: &str, ggml_type: GgmlType, dims: &[u64]) -> io::Result<&TensorInfo> {
        if dims.len() > MAX_DIMS as usize {
            return Err(invalid(format!("tensor '{name}': more than {MAX_DIMS} dimensions")));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(invalid(format!("tensor '{name}' added twice")));
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| invalid(format!("tensor '{name}': element count overflows")))?;
        if dims.first().copied().unwrap_or(1) % ggml_type.block_size() != 0 {
            return Err(invalid(format!(
                "tensor '{name}': first dimension is not a multiple of the {ggml_type} block"
            )));
        }
        let n_bytes =
            ggml_type.bytes_for(n_elements).ok_or_else(|| invalid(format!("tensor '{name}': size overflows")))?;
        let offset = self.data_len;
        self.data_len = (offset + n_bytes).div_ceil(self.alignment) * self.alignment;
        self.tensors.push(TensorInfo {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type,
            offset,
            n_elements,
            n_bytes,
        });
        Ok(self.tensors.last().unwrap())
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Writes the header and returns a writer that takes each tensor's data in order.
    pub fn write_header<W: Write>(self, mut w: W) -> io::Result<TensorDataWriter<W>> {
        let mut head = Vec::new();
        head.extend_from_slice(GGUF_MAGIC);
        head.extend_from_slice(&self.version.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_string(&mut head, k);
            head.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut head, v);
        }
        for t in &self.tensors {
            put_string(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            head.extend_from_slice(&t.offset.to_le_bytes());
        }
        let pad = head.len().next_multiple_of(self.alignment as usize) - head.len();
        head.resize(head.len() + pad, 0);
        w.write_all(&head)?;
        Ok(TensorDataWriter { w, alignment: self.alignment, tensors: self.tensors, next: 0, pos: 0 })
    }

    /// The whole file in memory, for tests and small files.
    pub fn to_bytes(self, data: &[&[u8]]) -> io::Result<Vec<u8>> {
        let mut out = self.write_header(Vec::new())?;
        for d in data {
            out.write_tensor(d)?;
        }
        out.finish()
    }
}

/// Takes tensor data in table order after the header was written.
pub struct TensorDataWriter<W: Write> {
    w: W,
    alignment: u64,
    tensors: Vec<TensorInfo>,
    next: usize,
    pos: u64,
}

impl<W: Write> TensorDataWriter<W> {
    /// The tensor whose data [`write_tensor`](Self::write_tensor) expects next.
    pub fn next_tensor(&self) -> Option<&TensorInfo> {
        self.tensors.get(self.next)
    }

    /// Writes the next tensor's data; `bytes` must be exactly its size.
    pub fn write_tensor(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.write_tensor_parts(&[bytes])
    }

    /// Writes the next tensor's data given in pieces whose total is its size.
    pub fn write_tensor_parts(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        let t = self.tensors.get(self.next).ok_or_else(|| invalid("more tensor data than tensors".into()))?;
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if len != t.n_bytes {
            return Err(invalid(format!("tensor '{}' takes {} bytes, got {len}", t.name, t.n_bytes)));
        }
        debug_assert_eq!(self.pos, t.offset);
        for p in parts {
            self.w.write_all(p)?;
        }
        self.pos += len;
        self.pos += write_padding(&mut self.w, self.pos, self.alignment)?;
        self.next += 1;
        Ok(())
    }

    /// Checks every tensor was written and returns the inner writer, flushed.
    pub fn finish(mut self) -> io::Result<W> {
        if let Some(t) = self.tensors.get(self.next) {
            return Err(invalid(format!("tensor '{}' was never written", t.name)));
        }
        self.w.flush()?;
        Ok(self.w)
    }
}

/// Writes zeros up to the next multiple of `alignment`; returns how many.
pub fn write_padding<W: Write>(w: &mut W, pos: u64, alignment: u64) -> io::Result<u64> {
    let pad = pos.next_multiple_of(alignment) - pos;
    w.write_all(&vec![0u8; pad as usize])?;
    Ok(pad)
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_string(out, s),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&(a.element_type() as u32).to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => out.extend(v.iter().map(|&x| x as u8)),
        Array::Bool(v) => out.extend(v.iter().map(|&x| x as u8)),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::String(v) => v.iter().for_each(|s| put_string(out, s)),
        Array::Array(v) => v.iter().for_each(|inner| put_array(out, inner)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse;

    #[test]
    fn round_trips_every_value_type_and_nested_arrays() {
        let mut w = GgufWriter::new();
        let values = vec![
            ("a.u8", Value::U8(7)),
            ("a.i8", Value::I8(-7)),
            ("a.u16", Value::U16(65000)),
            ("a.i16", Value::I16(-32000)),
            ("a.u32", Value::U32(4_000_000_000)),
            ("a.i32", Value::I32(-2_000_000_000)),
            ("a.f32", Value::F32(1.5)),
            ("a.bool", Value::Bool(true)),
            ("a.str", Value::String("héllo".into())),
            ("a.u64", Value::U64(u64::MAX)),
            ("a.i64", Value::I64(i64::MIN)),
            ("a.f64", Value::F64(-2.25)),
            ("a.strs", Value::Array(Array::String(vec!["x".into(), "".into(), "日本".into()]))),
            (
                "a.nested",
                Value::Array(Array::Array(vec![
                    Array::I32(vec![1, 2, 3]),
                    Array::Array(vec![Array::String(vec!["deep".into()]), Array::Bool(vec![true, false])]),
                    Array::F64(vec![]),
                ])),
            ),
        ];
        for (k, v) in &values {
            w.set(k, v.clone()).unwrap();
        }
        w.set("general.alignment", Value::U32(64)).unwrap();
        w.add_tensor("t0", GgmlType::F32, &[3, 2]).unwrap();
        w.add_tensor("t1", GgmlType::Q8_0, &[64]).unwrap();
        let t0: Vec<u8> = (0..24).collect();
        let t1 = vec![9u8; 68];
        for version in [2, 3] {
            let bytes = w.clone().version(version).to_bytes(&[&t0, &t1]).unwrap();
            let g = parse(&bytes).unwrap();
            assert_eq!(g.version, version);
            assert_eq!(g.alignment, 64);
            for (k, v) in &values {
                assert_eq!(g.metadata.get(k), Some(v), "{k}");
            }
            assert_eq!(g.tensors.len(), 2);
            assert_eq!(g.tensors[1].offset, 64);
            assert_eq!(g.data_offset % 64, 0);
            let d0 = g.data_offset as usize;
            assert_eq!(&bytes[d0..d0 + 24], &t0[..]);
            let d1 = d0 + g.tensors[1].offset as usize;
            assert_eq!(&bytes[d1..d1 + 68], &t1[..]);
        }
    }

    #[test]
    fn refuses_wrong_sized_data() {
        let mut w = GgufWriter::new();
        w.add_tensor("t", GgmlType::F16, &[4]).unwrap();
        assert!(w.clone().to_bytes(&[&[0u8; 7]]).is_err());
        assert!(w.to_bytes(&[]).is_err());
    }
}
