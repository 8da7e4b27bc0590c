//! Reading GGUF v2/v3 files through a memory map (or from bytes in memory), with every
//! count, length and offset checked against the file before it sizes an allocation or
//! indexes a slice. A split model (`name-00001-of-0000N.gguf`) opens from any of its shards
//! and is presented as one model whose tensors know their shard, so the streamer can `pread`
//! any expert's slice of a stacked `*_exps` tensor from the right file.

use super::{
    GgmlType, GgufError, Value, ValueType, DEFAULT_ALIGNMENT, GGUF_MAGIC, KEY_SPLIT_COUNT,
    KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT, MAX_ALIGNMENT, MAX_SHARDS,
};
use memmap2::Mmap;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Deepest array nesting we accept; real files use one level.
const MAX_ARRAY_DEPTH: u32 = 8;
/// Most dimensions a tensor may have (ggml's GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;
/// Items reserved up front for a list whose length the file claims. Past this a list grows
/// only as items actually parse (each consumes file bytes), so a lying count cannot make us
/// allocate more than a small multiple of the file's size.
const PREALLOC_ITEMS: u64 = 4096;

/// Where a run of bytes lives: which shard, the absolute offset in it, and the length.
/// This is what a `pread` needs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Extent {
    pub shard: u16,
    pub offset: u64,
    pub len: u64,
}

/// One tensor as the file describes it, located so its bytes can be `pread` directly.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGUF order: `dims[0]` is the contiguous row length (`ne0`). Never empty
    /// for a tensor read from a file.
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
    /// Product of the dimensions (checked against overflow when the file was read).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Bytes of one row (`dims[0]` elements).
    pub fn row_bytes(&self) -> u64 {
        self.dims
            .first()
            .and_then(|&n| self.ty.row_bytes(n))
            .unwrap_or(0)
    }
    /// Number of rows (product of all dims but the first).
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
    /// The whole tensor's bytes.
    pub fn extent(&self) -> Extent {
        Extent {
            shard: self.shard,
            offset: self.offset,
            len: self.n_bytes,
        }
    }
    /// Number of slices along the outermost dimension: `n_expert` for a stacked
    /// `{n_in, n_out, n_expert}` expert tensor. `None` for a 1-D tensor, which has no
    /// whole-row slices.
    pub fn n_slices(&self) -> Option<u64> {
        if self.dims.len() < 2 {
            return None;
        }
        self.dims.last().copied()
    }
    /// Bytes of one outermost slice (one expert of a stacked tensor): whole rows, so no
    /// quantization block straddles two slices.
    pub fn slice_bytes(&self) -> Option<u64> {
        let n = self.n_slices()?;
        if n == 0 {
            return None;
        }
        Some(self.n_bytes / n)
    }
    /// The bytes of slice `index` along the outermost dimension (expert `index` of a stacked
    /// `*_exps` tensor), or `None` when `index` is out of range or the tensor is 1-D.
    pub fn slice_extent(&self, index: u64) -> Option<Extent> {
        if index >= self.n_slices()? {
            return None;
        }
        let len = self.slice_bytes()?;
        Some(Extent {
            shard: self.shard,
            offset: index.checked_mul(len)?.checked_add(self.offset)?,
            len,
        })
    }
}

/// A shard's bytes: memory-mapped from a file, or owned (parsing from memory).
enum Bytes {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

struct Shard {
    path: PathBuf,
    bytes: Bytes,
    alignment: u64,
    data_start: u64,
}

/// An opened GGUF model (one file, or every shard of a split set).
///
/// Invariants once constructed: every tensor's bytes lie inside its shard, start at a
/// multiple of that shard's alignment, and overlap no other tensor; tensor names are unique
/// over all shards; metadata keys are unique.
pub struct GgufFile {
    shards: Vec<Shard>,
    version: u32,
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

/// A tensor info as read, before it is located in the file.
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    /// Offset relative to the data section.
    rel: u64,
}

/// The parsed header of one file.
struct Parsed {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<RawTensor>,
    data_start: u64,
}

impl Parsed {
    fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
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
        match self.pos.checked_add(n).filter(|&e| e <= len) {
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
    fn array<const N: usize>(&mut self, field: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }
    fn remaining(&self) -> u64 {
        self.buf.len() as u64 - self.pos
    }
    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    /// A length-prefixed UTF-8 string; the length is checked against the bytes left.
    fn string(&mut self, field: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len_field = || format!("{} (string length)", field());
        let n = self.u64(&len_field)?;
        if n > self.remaining() {
            return Err(GgufError::OutOfBounds {
                file: self.file.to_path_buf(),
                field: len_field(),
                value: n,
                expected: format!(
                    "at most {} bytes are left after offset {}",
                    self.remaining(),
                    self.pos
                ),
            });
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
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(field)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(field)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(field)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(field)?)),
            ValueType::U32 => Value::U32(self.u32(field)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(field)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(field)?)),
            ValueType::U64 => Value::U64(self.u64(field)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(field)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(field)?)),
            ValueType::Bool => {
                let [b] = self.array(field)?;
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
                let type_field = || format!("{} (array element type)", field());
                let et_id = self.u32(&type_field)?;
                let et = ValueType::from_id(et_id).ok_or_else(|| {
                    GgufError::invalid(
                        self.file,
                        type_field(),
                        format!("unknown value type {et_id}, expected 0..=12"),
                    )
                })?;
                let len_field = || format!("{} (array length)", field());
                let n = self.u64(&len_field)?;
                let max = self.remaining() / et.min_encoded_bytes();
                if n > max {
                    return Err(GgufError::OutOfBounds {
                        file: self.file.to_path_buf(),
                        field: len_field(),
                        value: n,
                        expected: format!(
                            "at most {max} {et:?} values fit in the {} bytes left after offset {}",
                            self.remaining(),
                            self.pos
                        ),
                    });
                }
                let mut items = Vec::with_capacity(n.min(PREALLOC_ITEMS) as usize);
                for i in 0..n {
                    items.push(self.value(et, &|| format!("{}[{i}]", field()), depth + 1)?);
                }
                Value::Array(et, items)
            }
        })
    }
}

/// Parse the header, metadata and tensor table of one file. Tensors are not located yet.
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
    // Each KV needs at least a key length, a type and a 1-byte value (13 bytes); each tensor
    // info at least a name length, dim count, one dim, type and offset (32 bytes).
    let left = c.remaining();
    if n_kv > left / 13 {
        return Err(GgufError::OutOfBounds {
            file: file.to_path_buf(),
            field: "metadata_kv_count".into(),
            value: n_kv,
            expected: format!(
                "at most {} entries of 13+ bytes fit in the {left} bytes after the header",
                left / 13
            ),
        });
    }
    if n_tensors > left / 32 {
        return Err(GgufError::OutOfBounds {
            file: file.to_path_buf(),
            field: "tensor_count".into(),
            value: n_tensors,
            expected: format!(
                "at most {} tensor infos of 32+ bytes fit in the {left} bytes after the header",
                left / 32
            ),
        });
    }
    let mut metadata = Vec::with_capacity(n_kv.min(PREALLOC_ITEMS) as usize);
    let mut seen = HashSet::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata[{i}] key"))?;
        let type_field = || format!("metadata '{key}' type");
        let tid = c.u32(&type_field)?;
        let ty = ValueType::from_id(tid).ok_or_else(|| {
            GgufError::invalid(
                file,
                type_field(),
                format!("unknown value type {tid}, expected 0..=12"),
            )
        })?;
        let v = c.value(ty, &|| format!("metadata '{key}'"), 0)?;
        if !seen.insert(key.clone()) {
            return Err(GgufError::invalid(
                file,
                format!("metadata '{key}'"),
                format!("key appears twice (again as entry {i}), expected unique keys"),
            ));
        }
        metadata.push((key, v));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        // llama.cpp and gguf-py both insist on u32 here.
        Some((_, Value::U32(a))) if a.is_power_of_two() && u64::from(*a) <= MAX_ALIGNMENT => {
            u64::from(*a)
        }
        Some((_, v)) => {
            return Err(GgufError::invalid(
                file,
                "metadata 'general.alignment'",
                format!(
                    "{v} of type {:?}, expected a U32 power of two in 1..={MAX_ALIGNMENT}",
                    v.value_type()
                ),
            ))
        }
    };
    let mut tensors = Vec::with_capacity(n_tensors.min(PREALLOC_ITEMS) as usize);
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let t = tensor_info(&mut c, i).map_err(|e| match e {
            // An info that cannot be what it claims, read where the count says the last one
            // is: most likely the count is too large and this is padding or tensor data.
            GgufError::Invalid { .. }
            | GgufError::OutOfBounds { .. }
            | GgufError::UnsupportedType { .. }
                if i + 1 == n_tensors =>
            {
                let text = e.to_string();
                let prefix = format!("{}: ", file.display());
                let inner = text.strip_prefix(&prefix).unwrap_or(&text);
                GgufError::invalid(
                    file,
                    "tensor_count",
                    format!(
                        "{n_tensors}, but tensor_info[{i}], the last it counts, does not parse ({inner}): is tensor_count too large?"
                    ),
                )
            }
            e => e,
        })?;
        if !names.insert(t.name.clone()) {
            return Err(GgufError::invalid(
                file,
                format!("tensor '{}'", t.name),
                format!("name appears twice (again as tensor_info[{i}]), expected unique names"),
            ));
        }
        tensors.push(t);
    }
    // Cannot overflow: pos <= file length and alignment <= 1 MiB.
    let table_end = c.pos;
    let data_start = table_end.div_ceil(alignment) * alignment;
    // Every writer (llama.cpp, gguf-py, ours) pads the tensor table with zeros. Anything else
    // there means the table did not end where `tensor_count` says: a count one too small
    // leaves the last tensor info in the "padding" and shifts every tensor's data.
    let pad = &buf[table_end as usize..data_start.min(buf.len() as u64) as usize];
    if let Some(i) = pad.iter().position(|&b| b != 0) {
        return Err(GgufError::invalid(
            file,
            "tensor_count",
            format!(
                "{n_tensors} tensor infos end at offset {table_end}, but the padding up to the data section at {data_start} is not zero (byte {} is {:#04x}); expected zero padding: is tensor_count too small?",
                table_end + i as u64,
                pad[i]
            ),
        ));
    }
    Ok(Parsed {
        version,
        alignment,
        metadata,
        tensors,
        data_start,
    })
}

/// Tensor info number `i` of the table, at the cursor.
fn tensor_info(c: &mut Cursor<'_>, i: u64) -> Result<RawTensor, GgufError> {
    let file = c.file;
    let name = c.string(&|| format!("tensor_info[{i}] name"))?;
    let nd_field = || format!("tensor '{name}' n_dims");
    let nd = c.u32(&nd_field)?;
    if nd == 0 || nd > MAX_DIMS {
        return Err(GgufError::invalid(
            file,
            nd_field(),
            format!("{nd}, expected 1..={MAX_DIMS}"),
        ));
    }
    let mut dims = Vec::with_capacity(nd as usize);
    for d in 0..nd {
        dims.push(c.u64(&|| format!("tensor '{name}' dims[{d}]"))?);
    }
    let tid = c.u32(&|| format!("tensor '{name}' type"))?;
    let ty = GgmlType::from_id(tid).ok_or_else(|| GgufError::UnsupportedType {
        file: file.to_path_buf(),
        tensor: name.clone(),
        ty: format!("id {tid}"),
        what: "is not a ggml type this build knows".into(),
    })?;
    let rel = c.u64(&|| format!("tensor '{name}' offset"))?;
    Ok(RawTensor {
        name,
        dims,
        ty,
        rel,
    })
}

/// Bytes of a tensor of `dims` and `ty`, or the reason it has none.
fn tensor_bytes(dims: &[u64], ty: GgmlType) -> Result<u64, String> {
    let n_el = dims
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| {
            format!("dimensions {dims:?} overflow when multiplied, expected a product below 2^63")
        })?;
    let row_len = dims.first().copied().unwrap_or(1);
    if row_len % ty.block_size() != 0 {
        return Err(format!(
            "row length dims[0] = {row_len} is not a multiple of {ty}'s block size {}",
            ty.block_size()
        ));
    }
    // Checked even when another dimension is 0: a row whose size overflows is no shape
    // (found by the gguf fuzz target: `[2^62, 0]` had 0 bytes but no row size).
    if ty.row_bytes(row_len).is_none() {
        return Err(format!(
            "row length dims[0] = {row_len} of {ty} overflows when sized in bytes"
        ));
    }
    (n_el / ty.block_size())
        .checked_mul(ty.type_size())
        .ok_or_else(|| format!("byte size of dimensions {dims:?} of {ty} overflows"))
}

fn map_file(path: &Path) -> Result<Mmap, GgufError> {
    let open_err = |e| GgufError::Open {
        file: path.to_path_buf(),
        source: e,
    };
    let f = File::open(path).map_err(open_err)?;
    // A directory opens fine and only fails at mmap, as "No such device": say what it is.
    let kind = f.metadata().map_err(open_err)?.file_type();
    if !kind.is_file() {
        return Err(GgufError::NotAFile {
            file: path.to_path_buf(),
            kind: file_kind(kind),
        });
    }
    // SAFETY: the mapping is read-only; a file truncated under us by another process is
    // outside what any reader can defend against (SIGBUS), as with every mmap user.
    unsafe { Mmap::map(&f) }.map_err(open_err)
}

/// What a path that is not a regular file is, for [`GgufError::NotAFile`].
fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// `dir/name-00002-of-00003.gguf` → (`dir/name`, shard number 2, count 3), if the path
/// follows llama.cpp's split naming (`%s-%05d-of-%05d.gguf`, shard numbers from 1).
fn split_pattern(path: &Path) -> Option<(PathBuf, u32, u32)> {
    let stem = path.file_name()?.to_str()?.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = head.rsplit_once('-')?;
    if count.len() != 5 || no.len() != 5 {
        return None;
    }
    Some((
        path.with_file_name(prefix),
        no.parse().ok()?,
        count.parse().ok()?,
    ))
}

/// The split keys of one shard: (`split.no`, `split.count`), or `None` when the file is not
/// part of a split model. Types are checked as llama.cpp's loader checks them.
fn split_keys(file: &Path, p: &Parsed) -> Result<Option<(u32, u32)>, GgufError> {
    let count = match p.get(KEY_SPLIT_COUNT) {
        None => return Ok(None),
        Some(Value::U16(n)) if *n >= 1 => u32::from(*n),
        Some(v) => {
            return Err(GgufError::invalid(
                file,
                format!("metadata '{KEY_SPLIT_COUNT}'"),
                format!(
                    "{v} of type {:?}, expected a U16 in 1..={MAX_SHARDS}",
                    v.value_type()
                ),
            ))
        }
    };
    let no = match p.get(KEY_SPLIT_NO) {
        Some(Value::U16(n)) if u32::from(*n) < count => u32::from(*n),
        None if count == 1 => 0,
        v => {
            return Err(GgufError::invalid(
                file,
                format!("metadata '{KEY_SPLIT_NO}'"),
                format!(
                    "{}, expected a U16 shard index below split.count {count}",
                    v.map(|v| format!("{v} of type {:?}", v.value_type()))
                        .unwrap_or_else(|| "missing".into())
                ),
            ))
        }
    };
    Ok(Some((no, count)))
}

impl GgufFile {
    /// Open a model. A split model opens from any of its shards (named
    /// `name-0000k-of-0000N.gguf`); every shard must be present, or the error is
    /// [`GgufError::MissingShard`].
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let map = map_file(path)?;
        let parsed = parse(path, &map)?;
        let (no, count) = split_keys(path, &parsed)?.unwrap_or((0, 1));
        if count == 1 {
            return Self::assemble(vec![(path.to_path_buf(), Bytes::Map(map), parsed)]);
        }
        let (prefix, named_no, named_count) = split_pattern(path).ok_or_else(|| {
            GgufError::invalid(
                path,
                format!("metadata '{KEY_SPLIT_COUNT}'"),
                format!(
                    "{count} shards, but the file name does not follow name-{:05}-of-{count:05}.gguf",
                    no + 1
                ),
            )
        })?;
        if named_count != count || named_no != no + 1 {
            return Err(GgufError::invalid(
                path,
                format!("metadata '{KEY_SPLIT_NO}'"),
                format!(
                    "shard {} of {count} by its keys, but the file name says shard {named_no} of {named_count}",
                    no + 1
                ),
            ));
        }
        let mut first = Some((path.to_path_buf(), Bytes::Map(map), parsed));
        let mut shards = Vec::with_capacity(count as usize);
        for i in 0..count {
            if i == no {
                if let Some(f) = first.take() {
                    shards.push(f);
                }
                continue;
            }
            let p = split_path(&prefix, i, count);
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
            shards.push((p, Bytes::Map(m), pr));
        }
        Self::assemble(shards)
    }

    /// Parse a single GGUF file held in memory (`name` is used in error messages). A shard
    /// of a split model fails with [`GgufError::MissingShard`]: use
    /// [`GgufFile::from_shard_bytes`].
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::from_shard_bytes(vec![(name.into(), bytes)])
    }

    /// Parse a model held in memory as shards given in shard order, each with the name used
    /// in error messages.
    pub fn from_shard_bytes(shards: Vec<(PathBuf, Vec<u8>)>) -> Result<GgufFile, GgufError> {
        let mut out = Vec::with_capacity(shards.len());
        for (name, bytes) in shards {
            let parsed = parse(&name, &bytes)?;
            out.push((name, Bytes::Owned(bytes), parsed));
        }
        Self::assemble(out)
    }

    /// Check the shards against each other and locate every tensor. `shards` is in shard
    /// order; the metadata of the first is the model's.
    fn assemble(shards: Vec<(PathBuf, Bytes, Parsed)>) -> Result<GgufFile, GgufError> {
        let Some((first_path, _, first)) = shards.first() else {
            return Err(GgufError::invalid(
                Path::new("<none>"),
                "shards",
                "no file given, expected at least one",
            ));
        };
        let first_path = first_path.clone();
        let (_, count) = split_keys(&first_path, first)?.unwrap_or((0, 1));
        let version = first.version;
        let declared_tensors = first.get(KEY_SPLIT_TENSORS_COUNT).cloned();
        if (shards.len() as u64) < u64::from(count) {
            let index = shards.len() as u32;
            let prefix = match split_pattern(&first_path) {
                Some((prefix, _, _)) => prefix,
                None => first_path.with_extension(""),
            };
            let expected = split_path(&prefix, index, count);
            return Err(GgufError::MissingShard {
                file: first_path,
                index: index + 1,
                count,
                expected,
            });
        }
        if shards.len() as u64 > u64::from(count) {
            return Err(GgufError::invalid(
                &first_path,
                format!("metadata '{KEY_SPLIT_COUNT}'"),
                format!("{count}, but {} shards were given", shards.len()),
            ));
        }
        let mut metadata = Vec::new();
        let mut tensors: Vec<TensorInfo> = Vec::new();
        let mut tensor_index = HashMap::new();
        let mut out_shards = Vec::with_capacity(shards.len());
        for (si, (path, bytes, parsed)) in shards.into_iter().enumerate() {
            if count > 1 {
                let (no, c) = split_keys(&path, &parsed)?.ok_or_else(|| {
                    GgufError::invalid(
                        &path,
                        format!("metadata '{KEY_SPLIT_COUNT}'"),
                        format!("missing, expected {count} as in the first shard"),
                    )
                })?;
                if c != count {
                    return Err(GgufError::invalid(
                        &path,
                        format!("metadata '{KEY_SPLIT_COUNT}'"),
                        format!("{c}, expected {count} as in the first shard"),
                    ));
                }
                if no as usize != si {
                    return Err(GgufError::invalid(
                        &path,
                        format!("metadata '{KEY_SPLIT_NO}'"),
                        format!("{no}, expected {si} for shard {} of {count}", si + 1),
                    ));
                }
            }
            let file_len = bytes.len() as u64;
            let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(parsed.tensors.len());
            for RawTensor {
                name,
                dims,
                ty,
                rel,
            } in parsed.tensors
            {
                let field = format!("tensor '{name}'");
                let n_bytes = tensor_bytes(&dims, ty)
                    .map_err(|what| GgufError::invalid(&path, format!("{field} dims"), what))?;
                if rel % parsed.alignment != 0 {
                    return Err(GgufError::invalid(
                        &path,
                        format!("{field} offset"),
                        format!(
                            "{rel} is not a multiple of the alignment {}",
                            parsed.alignment
                        ),
                    ));
                }
                let data_len = file_len.saturating_sub(parsed.data_start);
                if rel > data_len {
                    return Err(GgufError::OutOfBounds {
                        file: path.clone(),
                        field: format!("{field} offset"),
                        value: rel,
                        expected: format!(
                            "at most {data_len}, the data section's length (it starts at {} in a file of {file_len} bytes)",
                            parsed.data_start
                        ),
                    });
                }
                if n_bytes > data_len {
                    return Err(GgufError::OutOfBounds {
                        file: path.clone(),
                        field: format!("{field} size"),
                        value: n_bytes,
                        expected: format!(
                            "at most {data_len} bytes, the data section's length (dims {dims:?} of {ty})"
                        ),
                    });
                }
                // Both terms are at most file_len, so neither sum can overflow.
                let offset = parsed.data_start + rel;
                if offset + n_bytes > file_len {
                    return Err(GgufError::Truncated {
                        file: path.clone(),
                        field: format!("{field} data"),
                        offset,
                        needed: n_bytes,
                        file_len,
                    });
                }
                if tensor_index.contains_key(&name) {
                    return Err(GgufError::invalid(
                        &path,
                        &field,
                        "name appears in two shards, expected unique names",
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
                        format!("tensor '{}' offset", tensors[b.2].name),
                        format!(
                            "data at {}..{} overlaps tensor '{}' at {}..{}, expected disjoint tensors",
                            b.0,
                            b.0 + b.1,
                            tensors[a.2].name,
                            a.0,
                            a.0 + a.1
                        ),
                    ));
                }
            }
            // Writers pad each tensor to the alignment and nothing follows the last one, so
            // the data section ends within one alignment of the last tensor's end. More
            // bytes than that means the data section starts too early: a tensor_count one too
            // small (whose info bytes then sit at its head) shifts every tensor by at least
            // one alignment, and every logit would come out NaN.
            let data_end = spans
                .iter()
                .map(|s| s.0 + s.1)
                .max()
                .unwrap_or(0)
                .max(parsed.data_start);
            let slack = file_len.saturating_sub(data_end);
            if slack >= parsed.alignment {
                return Err(GgufError::invalid(
                    &path,
                    "tensor_count",
                    format!(
                        "the data of its {} tensors ends at offset {data_end}, but the file goes on for {slack} more bytes; expected at most {} bytes of padding after the last tensor: is tensor_count too small, or was the file appended to?",
                        spans.len(),
                        parsed.alignment - 1
                    ),
                ));
            }
            if si == 0 {
                metadata = parsed.metadata;
            }
            out_shards.push(Shard {
                path,
                bytes,
                alignment: parsed.alignment,
                data_start: parsed.data_start,
            });
        }
        if let Some(v) = declared_tensors {
            if v.as_u64() != Some(tensors.len() as u64) || !matches!(v, Value::I32(_)) {
                return Err(GgufError::invalid(
                    &first_path,
                    format!("metadata '{KEY_SPLIT_TENSORS_COUNT}'"),
                    format!(
                        "{v} of type {:?}, expected I32 {} (the tensors found in {} shard(s))",
                        v.value_type(),
                        tensors.len(),
                        out_shards.len()
                    ),
                ));
            }
        }
        let index = metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        Ok(GgufFile {
            shards: out_shards,
            version,
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
    /// Number of shards (1 for a single file).
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }
    /// GGUF version of the first shard (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }
    /// Alignment of the first shard's data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.shards[0].alignment
    }
    /// Alignment of one shard's data (shards other than the first usually carry no
    /// `general.alignment` and use 32). `None` for a shard index out of range.
    pub fn shard_alignment(&self, shard: usize) -> Option<u64> {
        self.shards.get(shard).map(|s| s.alignment)
    }
    /// Absolute offset where one shard's data section starts.
    pub fn shard_data_start(&self, shard: usize) -> Option<u64> {
        self.shards.get(shard).map(|s| s.data_start)
    }
    /// All metadata in file order (of the first shard).
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }
    /// A metadata value as a non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }
    /// A metadata value as a string.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }
    /// `general.architecture`, if present.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }
    /// Every tensor, shard by shard, each in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    /// The tensor's bytes, from the memory map. Empty for a `TensorInfo` that does not
    /// belong to this file.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        self.extent_data(t.extent())
    }
    /// The bytes of an extent (a tensor, or one expert's slice of one), or empty when the
    /// extent is not inside the file.
    pub fn extent_data(&self, e: Extent) -> &[u8] {
        let Some(s) = self.shards.get(e.shard as usize) else {
            return &[];
        };
        let end = e.offset.checked_add(e.len);
        match end {
            Some(end) if end <= s.bytes.len() as u64 => &s.bytes[e.offset as usize..end as usize],
            _ => &[],
        }
    }
    /// The bytes of one shard (the memory map, for residency probes and madvise).
    pub fn shard_map(&self, shard: usize) -> &[u8] {
        self.shards.get(shard).map(|s| &s.bytes[..]).unwrap_or(&[])
    }
    /// Total bytes of every shard.
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.bytes.len() as u64).sum()
    }

    /// `Ok` when `tensor`'s type is in `supported`; otherwise [`GgufError::UnsupportedType`]
    /// naming the tensor, its type and what is supported. The forward pass calls this at
    /// load for every weight it will compute with.
    pub fn check_supported(
        &self,
        tensor: &TensorInfo,
        supported: &[GgmlType],
    ) -> Result<(), GgufError> {
        if supported.contains(&tensor.ty) {
            return Ok(());
        }
        let file = self
            .shards
            .get(tensor.shard as usize)
            .map(|s| s.path.clone())
            .unwrap_or_else(|| self.path().to_path_buf());
        let list: Vec<&str> = supported.iter().map(|t| t.name()).collect();
        Err(GgufError::UnsupportedType {
            file,
            tensor: tensor.name.clone(),
            ty: tensor.ty.name().into(),
            what: format!(
                "has no kernel in this build (supported here: {})",
                if list.is_empty() {
                    "none".to_string()
                } else {
                    list.join(", ")
                }
            ),
        })
    }
}

/// Every file of the model at `path` as its name implies: all `count` shards of a split
/// model named `name-0000k-of-0000N.gguf` (present or not), else `path` alone. Lets a caller
/// know a model's files before opening any of them (outputs are checked against them).
pub fn split_shard_paths(path: &Path) -> Vec<PathBuf> {
    match split_pattern(path) {
        Some((prefix, _, count)) if (1..=MAX_SHARDS).contains(&count) => {
            (0..count).map(|i| split_path(&prefix, i, count)).collect()
        }
        _ => vec![path.to_path_buf()],
    }
}

/// The path of shard `index` (0-based) of a `count`-shard model whose prefix is `prefix`:
/// `prefix-{index+1:05}-of-{count:05}.gguf`, as llama.cpp names them.
pub fn split_path(prefix: &Path, index: u32, count: u32) -> PathBuf {
    let mut name = prefix.as_os_str().to_os_string();
    name.push(format!("-{:05}-of-{count:05}.gguf", index + 1));
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names_follow_llama_cpp() {
        let p = split_path(Path::new("/m/qwen"), 1, 3);
        assert_eq!(p, Path::new("/m/qwen-00002-of-00003.gguf"));
        assert_eq!(split_pattern(&p), Some((PathBuf::from("/m/qwen"), 2, 3)));
        assert_eq!(split_pattern(Path::new("/m/qwen-2-of-3.gguf")), None);
        assert_eq!(split_pattern(Path::new("/m/qwen.gguf")), None);
    }

    #[test]
    fn slices_are_whole_experts() {
        let t = TensorInfo {
            name: "blk.0.ffn_up_exps.weight".into(),
            dims: vec![256, 8, 4],
            ty: GgmlType::Q4_K,
            shard: 1,
            offset: 1024,
            n_bytes: 144 * 8 * 4,
        };
        assert_eq!(t.n_slices(), Some(4));
        assert_eq!(t.slice_bytes(), Some(144 * 8));
        assert_eq!(
            t.slice_extent(3),
            Some(Extent {
                shard: 1,
                offset: 1024 + 3 * 144 * 8,
                len: 144 * 8
            })
        );
        assert_eq!(t.slice_extent(4), None);
        let v = TensorInfo {
            dims: vec![256],
            ..t
        };
        assert_eq!(v.slice_extent(0), None);
    }

    #[test]
    fn tensor_bytes_rejects_bad_shapes() {
        assert_eq!(tensor_bytes(&[64, 3], GgmlType::Q8_0), Ok(2 * 34 * 3));
        assert!(tensor_bytes(&[33], GgmlType::Q8_0).is_err());
        assert!(tensor_bytes(&[1 << 32, 1 << 32], GgmlType::F32).is_err());
        assert_eq!(tensor_bytes(&[0, 5], GgmlType::F32), Ok(0));
        // A huge row of zero rows: zero bytes, but no row size (found by fuzzing).
        assert!(tensor_bytes(&[1 << 62, 0], GgmlType::F32).is_err());
    }
}
