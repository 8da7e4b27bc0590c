//! Writing GGUF v3 files, streamed: the header and tensor table go first, then each
//! tensor's bytes in declaration order, so a model of any size is written with the memory
//! of one tensor. A model can also be written as N shards named and keyed exactly as
//! llama.cpp's `gguf-split` does, which our reader (and llama.cpp) open as one model.

use super::{
    split_path, GgmlType, GgufError, Value, DEFAULT_ALIGNMENT, GGUF_MAGIC, KEY_SPLIT_COUNT,
    KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT, MAX_ALIGNMENT, MAX_SHARDS,
};
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Most dimensions a tensor may have (ggml's GGML_MAX_DIMS).
const MAX_DIMS: usize = 4;

/// A tensor to be written: its name, GGUF-order dimensions and type.
#[derive(Clone, Debug, PartialEq)]
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
    /// Bytes of data, or `None` if the shape is not 1..=4 dimensions of a whole number of
    /// blocks per row, or its size overflows.
    pub fn n_bytes(&self) -> Option<u64> {
        if self.dims.is_empty() || self.dims.len() > MAX_DIMS {
            return None;
        }
        let rows = self.dims[1..]
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))?;
        let n = self.ty.row_bytes(self.dims[0])?.checked_mul(rows)?;
        // The element count must fit ggml's int64 too.
        self.dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&e| e <= i64::MAX as u64)?;
        Some(n)
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
    Value::encode_str(buf, s);
}

/// Whether every element of every (nested) array has its array's declared type, and
/// nesting stays within what the reader accepts.
fn well_typed(v: &Value, depth: u32) -> bool {
    match v {
        Value::Array(t, items) => {
            depth < 8
                && items
                    .iter()
                    .all(|x| x.value_type() == *t && well_typed(x, depth + 1))
        }
        _ => true,
    }
}

fn write_err(path: &Path) -> impl Fn(std::io::Error) -> GgufError + '_ {
    move |e| GgufError::Write {
        file: path.to_path_buf(),
        source: e,
    }
}

/// The alignment `metadata` asks for, checked as the reader will check it.
fn alignment_of(path: &Path, metadata: &[(String, Value)]) -> Result<u64, GgufError> {
    match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some((_, Value::U32(a))) if a.is_power_of_two() && u64::from(*a) <= MAX_ALIGNMENT => {
            Ok(u64::from(*a))
        }
        Some((_, v)) => Err(GgufError::invalid(
            path,
            "metadata 'general.alignment'",
            format!(
                "{v} of type {:?}, expected a U32 power of two in 1..={MAX_ALIGNMENT}",
                v.value_type()
            ),
        )),
    }
}

/// Check a tensor list: valid shapes, unique names (also against `seen`). Returns each
/// tensor's byte size.
fn check_specs(
    path: &Path,
    specs: &[TensorSpec],
    seen: &mut HashSet<String>,
) -> Result<Vec<u64>, GgufError> {
    specs
        .iter()
        .map(|s| {
            let n = s.n_bytes().ok_or_else(|| {
                GgufError::invalid(
                    path,
                    format!("tensor '{}' dims", s.name),
                    format!(
                        "{:?} of {}, expected 1..=4 dimensions with dims[0] a multiple of {}",
                        s.dims,
                        s.ty,
                        s.ty.block_size()
                    ),
                )
            })?;
            if !seen.insert(s.name.clone()) {
                return Err(GgufError::invalid(
                    path,
                    format!("tensor '{}'", s.name),
                    "name given twice, expected unique names",
                ));
            }
            Ok(n)
        })
        .collect()
}

impl GgufWriter {
    /// Create `path` and write the header, metadata and tensor table. `general.alignment`,
    /// when present in `metadata`, sets the alignment (a U32 power of two; default 32).
    /// Fails before creating the file on duplicate keys or tensor names, arrays whose
    /// elements do not match their declared type, or shapes that are not whole blocks.
    pub fn create(
        path: impl AsRef<Path>,
        metadata: &[(String, Value)],
        specs: Vec<TensorSpec>,
    ) -> Result<GgufWriter, GgufError> {
        let path = path.as_ref().to_path_buf();
        let alignment = alignment_of(&path, metadata)?;
        let mut keys = HashSet::new();
        for (k, v) in metadata {
            if !well_typed(v, 0) {
                return Err(GgufError::invalid(
                    &path,
                    format!("metadata '{k}'"),
                    "array elements differ from the declared element type, or nest deeper than 8",
                ));
            }
            if !keys.insert(k.as_str()) {
                return Err(GgufError::invalid(
                    &path,
                    format!("metadata '{k}'"),
                    "key given twice, expected unique keys",
                ));
            }
        }
        let sizes = check_specs(&path, &specs, &mut HashSet::new())?;
        let mut head = Vec::new();
        head.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(specs.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut head, k);
            head.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            v.encode_into(&mut head);
        }
        let mut rel = 0u64;
        for (s, &n) in specs.iter().zip(&sizes) {
            put_str(&mut head, &s.name);
            head.extend_from_slice(&(s.dims.len() as u32).to_le_bytes());
            for d in &s.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&s.ty.id().to_le_bytes());
            head.extend_from_slice(&rel.to_le_bytes());
            rel = n
                .div_ceil(alignment)
                .checked_mul(alignment)
                .and_then(|p| rel.checked_add(p))
                .ok_or_else(|| {
                    GgufError::invalid(&path, "tensor data", "total size overflows u64")
                })?;
        }
        let pad = (head.len() as u64).div_ceil(alignment) * alignment - head.len() as u64;
        head.resize(head.len() + pad as usize, 0);
        let file = File::create(&path).map_err(write_err(&path))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        out.write_all(&head).map_err(write_err(&path))?;
        Ok(GgufWriter {
            pos: head.len() as u64,
            path,
            out,
            specs,
            next: 0,
            alignment,
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
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
                format!(
                    "more tensors written than the {} declared",
                    self.specs.len()
                ),
            )
        })?;
        let n = spec.n_bytes().unwrap_or(0);
        if data.len() as u64 != n {
            return Err(GgufError::invalid(
                &self.path,
                format!("tensor '{}' data", spec.name),
                format!(
                    "{} bytes given, its shape {:?} of {} needs {n}",
                    data.len(),
                    spec.dims,
                    spec.ty
                ),
            ));
        }
        self.out.write_all(data).map_err(write_err(&self.path))?;
        let padded = n.div_ceil(self.alignment) * self.alignment;
        let zeros = [0u8; 64];
        let mut left = padded - n;
        while left > 0 {
            let k = left.min(zeros.len() as u64);
            self.out
                .write_all(&zeros[..k as usize])
                .map_err(write_err(&self.path))?;
            left -= k;
        }
        self.pos += padded;
        self.next += 1;
        Ok(())
    }

    /// Flush and close; fails if a declared tensor was not written. Returns the file's size.
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
        self.out.flush().map_err(write_err(&self.path))?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(write_err(&self.path))?;
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

/// Group tensors, in order, into shards as `gguf-split` does: a new shard starts when the
/// current one holds `max_tensors` tensors, or when adding the next tensor would take the
/// current shard's (32-byte padded) data past `max_bytes`. Never returns an empty shard.
pub fn plan_split(
    specs: Vec<TensorSpec>,
    max_tensors: usize,
    max_bytes: Option<u64>,
) -> Vec<Vec<TensorSpec>> {
    let mut shards: Vec<Vec<TensorSpec>> = vec![Vec::new()];
    let mut bytes = 0u64;
    for s in specs {
        let n = s
            .n_bytes()
            .unwrap_or(0)
            .div_ceil(DEFAULT_ALIGNMENT)
            .saturating_mul(DEFAULT_ALIGNMENT);
        let cur = shards.len() - 1;
        let full = shards[cur].len() >= max_tensors.max(1)
            || max_bytes.is_some_and(|m| bytes.saturating_add(n) > m);
        if full && !shards[cur].is_empty() {
            shards.push(Vec::new());
            bytes = 0;
        }
        bytes = bytes.saturating_add(n);
        let last = shards.len() - 1;
        shards[last].push(s);
    }
    shards
}

/// A model being written as `count` shards `prefix-0000k-of-0000N.gguf`. The first shard
/// holds all the metadata plus the split keys; the others hold only the split keys
/// (`split.no` u16, `split.count` u16, `split.tensors.count` i32), as `gguf-split` writes
/// them. Tensors are written in order over all shards, like [`GgufWriter`].
pub struct GgufSplitWriter {
    prefix: PathBuf,
    metadata: Vec<(String, Value)>,
    shards: Vec<Vec<TensorSpec>>,
    total_tensors: usize,
    /// Index of the shard `current` writes.
    shard: usize,
    current: Option<GgufWriter>,
    paths: Vec<PathBuf>,
    bytes: u64,
}

impl GgufSplitWriter {
    /// Validate everything, then create the first shard. `shards[i]` lists the tensors of
    /// shard `i` (see [`plan_split`]); `metadata` must not carry `split.*` keys.
    pub fn create(
        prefix: impl AsRef<Path>,
        metadata: &[(String, Value)],
        shards: Vec<Vec<TensorSpec>>,
    ) -> Result<GgufSplitWriter, GgufError> {
        let prefix = prefix.as_ref().to_path_buf();
        let count = shards.len();
        let first = split_path(&prefix, 0, count.max(1) as u32);
        if count == 0 || count > MAX_SHARDS as usize {
            return Err(GgufError::invalid(
                &first,
                format!("metadata '{KEY_SPLIT_COUNT}'"),
                format!("{count} shards, expected 1..={MAX_SHARDS}"),
            ));
        }
        if let Some((k, _)) = metadata.iter().find(|(k, _)| k.starts_with("split.")) {
            return Err(GgufError::invalid(
                &first,
                format!("metadata '{k}'"),
                "split keys are written by the split writer, expected none in the metadata",
            ));
        }
        let mut seen = HashSet::new();
        for s in &shards {
            check_specs(&first, s, &mut seen)?;
        }
        let total_tensors = seen.len();
        if total_tensors > i32::MAX as usize {
            return Err(GgufError::invalid(
                &first,
                format!("metadata '{KEY_SPLIT_TENSORS_COUNT}'"),
                format!("{total_tensors} tensors, expected at most {}", i32::MAX),
            ));
        }
        let mut w = GgufSplitWriter {
            prefix,
            metadata: metadata.to_vec(),
            shards,
            total_tensors,
            shard: 0,
            current: None,
            paths: Vec::with_capacity(count),
            bytes: 0,
        };
        w.open_shard(0)?;
        w.skip_full_shards()?;
        Ok(w)
    }

    fn split_keys(&self, index: usize) -> [(String, Value); 3] {
        [
            (KEY_SPLIT_NO.to_string(), Value::U16(index as u16)),
            (
                KEY_SPLIT_COUNT.to_string(),
                Value::U16(self.shards.len() as u16),
            ),
            (
                KEY_SPLIT_TENSORS_COUNT.to_string(),
                Value::I32(self.total_tensors as i32),
            ),
        ]
    }

    fn open_shard(&mut self, index: usize) -> Result<(), GgufError> {
        let path = split_path(&self.prefix, index as u32, self.shards.len() as u32);
        let mut meta = if index == 0 {
            self.metadata.clone()
        } else {
            Vec::new()
        };
        meta.extend(self.split_keys(index));
        let specs = std::mem::take(&mut self.shards[index]);
        self.current = Some(GgufWriter::create(&path, &meta, specs)?);
        self.paths.push(path);
        self.shard = index;
        Ok(())
    }

    /// Finish the current shard while it has nothing left to write and another follows.
    fn skip_full_shards(&mut self) -> Result<(), GgufError> {
        while self.shard + 1 < self.shards.len()
            && self
                .current
                .as_ref()
                .is_some_and(|w| w.next_spec().is_none())
        {
            if let Some(w) = self.current.take() {
                self.bytes += w.finish()?;
            }
            self.open_shard(self.shard + 1)?;
        }
        Ok(())
    }

    /// The tensor the next [`GgufSplitWriter::write_tensor`] call must supply.
    pub fn next_spec(&self) -> Option<&TensorSpec> {
        self.current.as_ref().and_then(|w| w.next_spec())
    }

    /// Write the next tensor's bytes (see [`GgufWriter::write_tensor`]).
    pub fn write_tensor(&mut self, data: &[u8]) -> Result<(), GgufError> {
        match self.current.as_mut() {
            Some(w) => w.write_tensor(data)?,
            None => {
                return Err(GgufError::invalid(
                    &self.prefix,
                    "tensor data",
                    "the split writer already failed",
                ))
            }
        }
        self.skip_full_shards()
    }

    /// Finish every shard; fails if a declared tensor was not written. Returns the shard
    /// paths in order and their total size.
    pub fn finish(mut self) -> Result<(Vec<PathBuf>, u64), GgufError> {
        self.skip_full_shards()?;
        if let Some(w) = self.current.take() {
            self.bytes += w.finish()?;
        }
        Ok((self.paths, self.bytes))
    }

    /// Write a whole split model at once (tests, small models): tensors are grouped by
    /// [`plan_split`] with at most `max_tensors` per shard.
    pub fn write_files(
        prefix: impl AsRef<Path>,
        metadata: &[(String, Value)],
        tensors: &[(TensorSpec, Vec<u8>)],
        max_tensors: usize,
    ) -> Result<Vec<PathBuf>, GgufError> {
        let plan = plan_split(
            tensors.iter().map(|t| t.0.clone()).collect(),
            max_tensors,
            None,
        );
        let mut w = GgufSplitWriter::create(prefix, metadata, plan)?;
        for (_, d) in tensors {
            w.write_tensor(d)?;
        }
        Ok(w.finish()?.0)
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
