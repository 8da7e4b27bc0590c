//! Writing GGUF v3 files, streamed: the header and tensor table go first, then each
//! tensor's bytes in declaration order, so a model of any size is written with the memory
//! of one tensor.

use super::{GgmlType, GgufError, Value, DEFAULT_ALIGNMENT, GGUF_MAGIC};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// A tensor to be written: its name, GGUF-order dimensions and type.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, dims: &[u64], ty: GgmlType) -> Self {
        TensorSpec {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
        }
    }
    /// Bytes of data, or `None` if the shape is not a whole number of blocks.
    pub fn n_bytes(&self) -> Option<u64> {
        let rows: u64 = self.dims[1..].iter().product();
        self.ty.row_bytes(self.dims[0])?.checked_mul(rows)
    }
}

/// A GGUF file being written. Create it with every tensor declared, then call
/// [`GgufWriter::write_tensor`] once per tensor, in order, then [`GgufWriter::finish`].
pub struct GgufWriter {
    path: PathBuf,
    out: BufWriter<File>,
    specs: Vec<TensorSpec>,
    next: usize,
    pos: u64,
    alignment: u64,
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.push(*x as u8),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(*x as u8),
        Value::String(s) => put_str(buf, s),
        Value::Array(t, items) => {
            buf.extend_from_slice(&(*t as u32).to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(buf, it);
            }
        }
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
    }
}

impl GgufWriter {
    /// Create `path` and write the header, metadata and tensor table. `general.alignment`,
    /// when present in `metadata`, sets the alignment (default 32).
    pub fn create(
        path: impl AsRef<Path>,
        metadata: &[(String, Value)],
        specs: Vec<TensorSpec>,
    ) -> Result<GgufWriter, GgufError> {
        let path = path.as_ref().to_path_buf();
        let alignment = metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(GgufError::invalid(
                &path,
                "general.alignment",
                format!("{alignment} is not a power of two"),
            ));
        }
        for (i, (k, v)) in metadata.iter().enumerate() {
            if let Value::Array(t, items) = v {
                if items.iter().any(|x| x.value_type() != *t) {
                    return Err(GgufError::invalid(
                        &path,
                        format!("metadata '{k}'"),
                        "array elements differ from the declared element type",
                    ));
                }
            }
            if metadata[..i].iter().any(|(k2, _)| k2 == k) {
                return Err(GgufError::invalid(
                    &path,
                    format!("metadata '{k}'"),
                    "key given twice",
                ));
            }
        }
        let mut head = Vec::new();
        head.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(specs.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut head, k);
            head.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut head, v);
        }
        let mut rel = 0u64;
        for s in &specs {
            let n = s.n_bytes().ok_or_else(|| {
                GgufError::invalid(
                    &path,
                    format!("tensor '{}'", s.name),
                    format!(
                        "shape {:?} is not a whole number of {} blocks",
                        s.dims, s.ty
                    ),
                )
            })?;
            put_str(&mut head, &s.name);
            head.extend_from_slice(&(s.dims.len() as u32).to_le_bytes());
            for d in &s.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&s.ty.id().to_le_bytes());
            head.extend_from_slice(&rel.to_le_bytes());
            rel += n.div_ceil(alignment) * alignment;
        }
        let pad = (head.len() as u64).div_ceil(alignment) * alignment - head.len() as u64;
        head.resize(head.len() + pad as usize, 0);
        let file = File::create(&path).map_err(|e| GgufError::Write {
            file: path.clone(),
            source: e,
        })?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        out.write_all(&head).map_err(|e| GgufError::Write {
            file: path.clone(),
            source: e,
        })?;
        Ok(GgufWriter {
            pos: head.len() as u64,
            path,
            out,
            specs,
            next: 0,
            alignment,
        })
    }

    /// The tensor the next [`GgufWriter::write_tensor`] call must supply.
    pub fn next_spec(&self) -> Option<&TensorSpec> {
        self.specs.get(self.next)
    }

    /// Write the next tensor's bytes; their length must match its declared shape and type.
    pub fn write_tensor(&mut self, data: &[u8]) -> Result<(), GgufError> {
        let spec = self.specs.get(self.next).ok_or_else(|| {
            GgufError::invalid(
                &self.path,
                "tensor data",
                "more tensors written than declared",
            )
        })?;
        let n = spec.n_bytes().unwrap_or(0);
        if data.len() as u64 != n {
            return Err(GgufError::invalid(
                &self.path,
                format!("tensor '{}'", spec.name),
                format!(
                    "{} bytes given, its shape {:?} of {} needs {n}",
                    data.len(),
                    spec.dims,
                    spec.ty
                ),
            ));
        }
        let w = |e| GgufError::Write {
            file: self.path.clone(),
            source: e,
        };
        self.out.write_all(data).map_err(w)?;
        let padded = n.div_ceil(self.alignment) * self.alignment;
        self.out
            .write_all(&vec![0u8; (padded - n) as usize])
            .map_err(|e| GgufError::Write {
                file: self.path.clone(),
                source: e,
            })?;
        self.pos += padded;
        self.next += 1;
        Ok(())
    }

    /// Flush and close; fails if a declared tensor was not written.
    pub fn finish(mut self) -> Result<u64, GgufError> {
        if self.next != self.specs.len() {
            return Err(GgufError::invalid(
                &self.path,
                "tensor data",
                format!(
                    "{} of {} declared tensors written",
                    self.next,
                    self.specs.len()
                ),
            ));
        }
        self.out.flush().map_err(|e| GgufError::Write {
            file: self.path.clone(),
            source: e,
        })?;
        let f = self.out.get_ref();
        f.sync_all().ok();
        Ok(self.pos)
    }

    /// Write a whole file at once (tests, small models).
    pub fn write_file(
        path: impl AsRef<Path>,
        metadata: &[(String, Value)],
        tensors: &[(TensorSpec, Vec<u8>)],
    ) -> Result<u64, GgufError> {
        let mut w = GgufWriter::create(
            path,
            metadata,
            tensors.iter().map(|t| t.0.clone()).collect(),
        )?;
        for (_, d) in tensors {
            w.write_tensor(d)?;
        }
        w.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufFile, ValueType};

    #[test]
    fn write_then_read_round_trips() {
        let dir = std::env::temp_dir().join(format!("bmoe-gguf-rt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.gguf");
        let meta = vec![
            (
                "general.architecture".to_string(),
                Value::String("qwen3moe".into()),
            ),
            ("x.u8".to_string(), Value::U8(7)),
            (
                "x.arr".to_string(),
                Value::Array(
                    ValueType::Array,
                    vec![Value::Array(
                        ValueType::I32,
                        vec![Value::I32(-1), Value::I32(2)],
                    )],
                ),
            ),
            ("x.f64".to_string(), Value::F64(1.5)),
        ];
        let t1 = (
            TensorSpec::new("a", &[64, 3], GgmlType::Q8_0),
            (0..(2 * 34 * 3)).map(|i| i as u8).collect::<Vec<_>>(),
        );
        let t2 = (TensorSpec::new("b", &[5], GgmlType::F32), vec![1u8; 20]);
        GgufWriter::write_file(&p, &meta, &[t1.clone(), t2.clone()]).unwrap();
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.metadata(), &meta[..]);
        assert_eq!(f.tensor_data(f.tensor("a").unwrap()), &t1.1[..]);
        assert_eq!(f.tensor_data(f.tensor("b").unwrap()), &t2.1[..]);
        std::fs::remove_dir_all(&dir).ok();
    }
}
