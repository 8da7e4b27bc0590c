//! Reading GGUF v2/v3 files through a memory map, with every length and offset checked
//! against the file before use. A split model (`name-00001-of-0000N.gguf`) opens from its
//! first shard and is presented as one model whose tensors know their shard.

use super::{GgmlType, GgufError, Value, ValueType, DEFAULT_ALIGNMENT, GGUF_MAGIC};
use memmap2::Mmap;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Deepest array nesting we accept; real files use one level.
const MAX_ARRAY_DEPTH: u32 = 8;
/// Most dimensions a tensor may have (ggml's GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;

/// One tensor as the file describes it, located so its bytes can be `pread` directly.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGUF order: `dims[0]` is the contiguous row length (`ne0`).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Which file of a split model holds the bytes (0 for a single file).
    pub shard: u16,
    /// Absolute byte offset of the tensor's data in its shard.
    pub offset: u64,
    /// Bytes of data.
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Bytes of one row (`dims[0]` elements).
    pub fn row_bytes(&self) -> u64 {
        self.ty.row_bytes(self.dims[0]).unwrap_or(0)
    }
    /// Number of rows (product of all dims but the first).
    pub fn n_rows(&self) -> u64 {
        self.dims[1..].iter().product()
    }
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// An opened GGUF model (one file, or every shard of a split set).
pub struct GgufFile {
    shards: Vec<Shard>,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path())
            .field("shards", &self.shards.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// The parsed header of one file.
struct Parsed {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    /// (name, dims, type, relative offset)
    tensors: Vec<(String, Vec<u64>, GgmlType, u64)>,
    data_start: u64,
}

/// A bounds-checked cursor over one file's bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: u64,
    file: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, field: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let len = self.buf.len() as u64;
        let end = self.pos.checked_add(n).filter(|&e| e <= len);
        match end {
            Some(end) => {
                let s = &self.buf[self.pos as usize..end as usize];
                self.pos = end;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                file: self.file.to_path_buf(),
                field: field(),
                offset: self.pos,
                needed: n,
                file_len: len,
            }),
        }
    }
    fn remaining(&self) -> u64 {
        self.buf.len() as u64 - self.pos
    }
    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(
            self.take(4, field)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(
            self.take(8, field)?.try_into().expect("8 bytes"),
        ))
    }
    fn string(&mut self, field: &dyn Fn() -> String) -> Result<String, GgufError> {
        let n = self.u64(&|| format!("{} (string length)", field()))?;
        if n > self.remaining() {
            return Err(GgufError::invalid(
                self.file,
                field(),
                format!(
                    "string length {n} runs past the end of the file ({} bytes left)",
                    self.remaining()
                ),
            ));
        }
        let bytes = self.take(n, field)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| GgufError::invalid(self.file, field(), "string is not valid UTF-8"))
    }
    fn value(
        &mut self,
        ty: ValueType,
        field: &dyn Fn() -> String,
        depth: u32,
    ) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.take(1, field)?[0]),
            ValueType::I8 => Value::I8(self.take(1, field)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(
                self.take(2, field)?.try_into().expect("2"),
            )),
            ValueType::I16 => Value::I16(i16::from_le_bytes(
                self.take(2, field)?.try_into().expect("2"),
            )),
            ValueType::U32 => Value::U32(self.u32(field)?),
            ValueType::I32 => Value::I32(self.u32(field)? as i32),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32(field)?)),
            ValueType::U64 => Value::U64(self.u64(field)?),
            ValueType::I64 => Value::I64(self.u64(field)? as i64),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64(field)?)),
            ValueType::Bool => {
                let b = self.take(1, field)?[0];
                if b > 1 {
                    return Err(GgufError::invalid(
                        self.file,
                        field(),
                        format!("bool byte is {b}, expected 0 or 1"),
                    ));
                }
                Value::Bool(b == 1)
            }
            ValueType::String => Value::String(self.string(field)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::invalid(
                        self.file,
                        field(),
                        format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
                    ));
                }
                let et_id = self.u32(&|| format!("{} (array element type)", field()))?;
                let et = ValueType::from_id(et_id).ok_or_else(|| {
                    GgufError::invalid(
                        self.file,
                        field(),
                        format!("unknown array element type {et_id}, expected 0..=12"),
                    )
                })?;
                let n = self.u64(&|| format!("{} (array length)", field()))?;
                let max = self.remaining() / et.min_encoded_bytes();
                if n > max {
                    return Err(GgufError::invalid(
                        self.file,
                        field(),
                        format!(
                            "array of {n} {et:?} values cannot fit in the {} bytes left in the file",
                            self.remaining()
                        ),
                    ));
                }
                let mut items = Vec::with_capacity(n as usize);
                for i in 0..n {
                    items.push(self.value(et, &|| format!("{}[{i}]", field()), depth + 1)?);
                }
                Value::Array(et, items)
            }
        })
    }
}

fn parse(file: &Path, buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { buf, pos: 0, file };
    let magic = c.u32(&|| "magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            file: file.to_path_buf(),
            found: magic,
        });
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(GgufError::BadVersion {
            file: file.to_path_buf(),
            found: version,
        });
    }
    let n_tensors = c.u64(&|| "tensor_count".into())?;
    let n_kv = c.u64(&|| "metadata_kv_count".into())?;
    // Each KV needs at least a key length, a type and a 1-byte value; each tensor info at
    // least a name length, dim count, one dim, type and offset.
    if n_kv > c.remaining() / 13 {
        return Err(GgufError::invalid(
            file,
            "metadata_kv_count",
            format!("{n_kv} entries cannot fit in a file of {} bytes", buf.len()),
        ));
    }
    if n_tensors > c.remaining() / 32 {
        return Err(GgufError::invalid(
            file,
            "tensor_count",
            format!(
                "{n_tensors} tensors cannot fit in a file of {} bytes",
                buf.len()
            ),
        ));
    }
    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut seen = HashSet::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata[{i}].key"))?;
        let tid = c.u32(&|| format!("metadata '{key}' type"))?;
        let ty = ValueType::from_id(tid).ok_or_else(|| {
            GgufError::invalid(
                file,
                format!("metadata '{key}'"),
                format!("unknown value type {tid}, expected 0..=12"),
            )
        })?;
        let v = c.value(ty, &|| format!("metadata '{key}'"), 0)?;
        if !seen.insert(key.clone()) {
            return Err(GgufError::invalid(
                file,
                format!("metadata '{key}'"),
                "key appears twice",
            ));
        }
        metadata.push((key, v));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => {
            let a = v.as_u64().unwrap_or(0);
            if a == 0 || !a.is_power_of_two() || a > 1 << 20 {
                return Err(GgufError::invalid(
                    file,
                    "general.alignment",
                    format!("{v} is not a power of two in 1..=1048576"),
                ));
            }
            a
        }
    };
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("tensor_info[{i}].name"))?;
        let nd = c.u32(&|| format!("tensor '{name}' n_dims"))?;
        if nd == 0 || nd > MAX_DIMS {
            return Err(GgufError::invalid(
                file,
                format!("tensor '{name}' n_dims"),
                format!("{nd}, expected 1..={MAX_DIMS}"),
            ));
        }
        let mut dims = Vec::with_capacity(nd as usize);
        for d in 0..nd {
            let v = c.u64(&|| format!("tensor '{name}' dims[{d}]"))?;
            if v == 0 {
                return Err(GgufError::invalid(
                    file,
                    format!("tensor '{name}' dims[{d}]"),
                    "dimension is 0",
                ));
            }
            dims.push(v);
        }
        let tid = c.u32(&|| format!("tensor '{name}' type"))?;
        let ty = GgmlType::from_id(tid).ok_or_else(|| GgufError::UnsupportedType {
            file: file.to_path_buf(),
            tensor: name.clone(),
            ty: format!("id {tid}"),
            what: "is not a ggml type this build knows".into(),
        })?;
        let off = c.u64(&|| format!("tensor '{name}' offset"))?;
        if !names.insert(name.clone()) {
            return Err(GgufError::invalid(
                file,
                format!("tensor '{name}'"),
                "name appears twice",
            ));
        }
        tensors.push((name, dims, ty, off));
    }
    let data_start = c.pos.div_ceil(alignment) * alignment;
    Ok(Parsed {
        version,
        alignment,
        metadata,
        tensors,
        data_start,
    })
}

fn map_file(path: &Path) -> Result<Mmap, GgufError> {
    let f = File::open(path).map_err(|e| GgufError::Open {
        file: path.to_path_buf(),
        source: e,
    })?;
    // SAFETY: the mapping is read-only; a file truncated under us by another process is
    // outside what any reader can defend against (SIGBUS), as with every mmap user.
    unsafe { Mmap::map(&f) }.map_err(|e| GgufError::Open {
        file: path.to_path_buf(),
        source: e,
    })
}

/// `name-00001-of-00003.gguf` → (prefix "name", count 3), if the path follows the pattern.
fn split_pattern(path: &Path) -> Option<(String, u32)> {
    let stem = path.file_name()?.to_str()?.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, _no) = head.rsplit_once('-')?;
    Some((prefix.to_string(), count.parse().ok()?))
}

fn shard_path(first: &Path, prefix: &str, index: u32, count: u32) -> PathBuf {
    let name = format!("{prefix}-{index:05}-of-{count:05}.gguf");
    first.with_file_name(name)
}

impl GgufFile {
    /// Open a model. A split model opens from any shard path following the
    /// `-0000k-of-0000N.gguf` pattern, or from its first shard; every shard must be present.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let map = map_file(path)?;
        let parsed = parse(path, &map)?;
        let get = |k: &str| parsed.metadata.iter().find(|(n, _)| n == k).map(|(_, v)| v);
        let split_count = get("split.count").and_then(|v| v.as_u64()).unwrap_or(1);
        let mut shards = vec![(path.to_path_buf(), map, parsed)];
        if split_count > 1 {
            if split_count > 4096 {
                return Err(GgufError::invalid(
                    path,
                    "split.count",
                    format!("{split_count}, expected at most 4096"),
                ));
            }
            let count = split_count as u32;
            let (prefix, named_count) = split_pattern(path).ok_or_else(|| {
                GgufError::invalid(path, "split.count", format!("{count} shards, but the file name does not follow name-0000k-of-{count:05}.gguf"))
            })?;
            if named_count != count {
                return Err(GgufError::invalid(
                    path,
                    "split.count",
                    format!("{count}, but the file name says {named_count}"),
                ));
            }
            let first_no = shards[0]
                .2
                .metadata
                .iter()
                .find(|(k, _)| k == "split.no")
                .and_then(|(_, v)| v.as_u64())
                .unwrap_or(0);
            let mut all = Vec::with_capacity(count as usize);
            for i in 0..count {
                if i as u64 == first_no {
                    all.push(None);
                    continue;
                }
                let p = shard_path(path, &prefix, i + 1, count);
                if !p.exists() {
                    return Err(GgufError::MissingShard {
                        file: path.to_path_buf(),
                        index: i + 1,
                        count,
                        expected: p,
                    });
                }
                let m = map_file(&p)?;
                let pr = parse(&p, &m)?;
                let no = pr
                    .metadata
                    .iter()
                    .find(|(k, _)| k == "split.no")
                    .and_then(|(_, v)| v.as_u64());
                if no != Some(i as u64) {
                    return Err(GgufError::invalid(
                        &p,
                        "split.no",
                        format!("{no:?}, expected {i}"),
                    ));
                }
                all.push(Some((p, m, pr)));
            }
            let first = shards.pop().expect("first shard");
            if first_no >= count as u64 {
                return Err(GgufError::invalid(
                    path,
                    "split.no",
                    format!("{first_no}, expected below split.count {count}"),
                ));
            }
            all[first_no as usize] = Some(first);
            shards = all
                .into_iter()
                .map(|s| s.expect("every shard filled"))
                .collect();
        }
        Self::assemble(shards)
    }

    fn assemble(shards: Vec<(PathBuf, Mmap, Parsed)>) -> Result<GgufFile, GgufError> {
        let version = shards[0].2.version;
        let alignment = shards[0].2.alignment;
        let mut metadata = Vec::new();
        let mut tensors = Vec::new();
        let mut tensor_index = HashMap::new();
        let mut out_shards = Vec::with_capacity(shards.len());
        for (si, (path, map, parsed)) in shards.into_iter().enumerate() {
            if si == 0 {
                metadata = parsed.metadata;
            }
            let file_len = map.len() as u64;
            let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(parsed.tensors.len());
            for (name, dims, ty, rel) in parsed.tensors {
                let field = format!("tensor '{name}'");
                let n_el = dims
                    .iter()
                    .try_fold(1u64, |a, &d| a.checked_mul(d))
                    .ok_or_else(|| {
                        GgufError::invalid(
                            &path,
                            &field,
                            format!("dimensions {dims:?} overflow when multiplied"),
                        )
                    })?;
                if dims[0] % ty.block_size() != 0 {
                    return Err(GgufError::invalid(
                        &path,
                        &field,
                        format!(
                            "row length {} is not a multiple of {}'s block size {}",
                            dims[0],
                            ty,
                            ty.block_size()
                        ),
                    ));
                }
                let n_bytes = (n_el / ty.block_size())
                    .checked_mul(ty.type_size())
                    .ok_or_else(|| {
                        GgufError::invalid(
                            &path,
                            &field,
                            format!("byte size of dimensions {dims:?} overflows"),
                        )
                    })?;
                if rel % alignment != 0 {
                    return Err(GgufError::invalid(
                        &path,
                        format!("{field} offset"),
                        format!("{rel} is not a multiple of the alignment {alignment}"),
                    ));
                }
                let offset = parsed
                    .data_start
                    .checked_add(rel)
                    .filter(|o| *o <= file_len);
                let end = offset
                    .and_then(|o| o.checked_add(n_bytes))
                    .filter(|e| *e <= file_len);
                let (offset, _end) = match (offset, end) {
                    (Some(o), Some(e)) => (o, e),
                    _ => {
                        return Err(GgufError::Truncated {
                            file: path.clone(),
                            field: format!("{field} data"),
                            offset: parsed.data_start.saturating_add(rel),
                            needed: n_bytes,
                            file_len,
                        })
                    }
                };
                if tensor_index.contains_key(&name) {
                    return Err(GgufError::invalid(
                        &path,
                        &field,
                        "name appears in two shards",
                    ));
                }
                spans.push((offset, n_bytes, tensors.len()));
                tensor_index.insert(name.clone(), tensors.len());
                tensors.push(TensorInfo {
                    name,
                    dims,
                    ty,
                    shard: si as u16,
                    offset,
                    n_bytes,
                });
            }
            spans.sort_unstable();
            for w in spans.windows(2) {
                let (a, b) = (&w[0], &w[1]);
                if a.0 + a.1 > b.0 {
                    return Err(GgufError::invalid(
                        &path,
                        format!("tensor '{}'", tensors[b.2].name),
                        format!(
                            "data at offset {} overlaps tensor '{}' ({}..{})",
                            b.0,
                            tensors[a.2].name,
                            a.0,
                            a.0 + a.1
                        ),
                    ));
                }
            }
            out_shards.push(Shard { path, map });
        }
        let index = metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        Ok(GgufFile {
            shards: out_shards,
            version,
            alignment,
            metadata,
            index,
            tensors,
            tensor_index,
        })
    }

    /// Path of the first shard.
    pub fn path(&self) -> &Path {
        &self.shards[0].path
    }
    /// Paths of every shard, in shard order.
    pub fn shard_paths(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }
    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// All metadata in file order (of the first shard).
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }
    /// `general.architecture`, if present.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(|v| v.as_str())
    }
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    /// The tensor's bytes, from the memory map.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let m = &self.shards[t.shard as usize].map;
        &m[t.offset as usize..(t.offset + t.n_bytes) as usize]
    }
    /// The memory map of one shard (for residency probes and madvise).
    pub fn shard_map(&self, shard: usize) -> &[u8] {
        &self.shards[shard].map
    }
    /// Total bytes of every shard.
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.map.len() as u64).sum()
    }
}
