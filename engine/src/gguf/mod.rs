//! The GGUF file layer: reading (memory-mapped, split models presented as one), writing
//! (streamed, so a 17 GB synthetic model never sits in memory), and the ggml type table.
//!
//! Everything a file controls — counts, lengths, offsets, dimensions — is checked against the
//! file before it sizes an allocation or indexes a slice, and every failure is a typed
//! [`GgufError`] naming the file, the field and what was expected.

mod reader;
mod types;
mod value;
mod writer;

pub use reader::{split_path, split_shard_paths, Extent, GgufFile, TensorInfo};
pub use types::GgmlType;
pub use value::{Value, ValueType};
pub use writer::{plan_split, GgufSplitWriter, GgufWriter, TensorSpec};

use std::path::PathBuf;

/// GGUF magic, `"GGUF"` read as a little-endian u32.
pub const GGUF_MAGIC: u32 = 0x4655_4747;
/// Alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Largest `general.alignment` accepted (1 MiB); real files use 32.
pub const MAX_ALIGNMENT: u64 = 1 << 20;
/// Split-model keys, as llama.cpp's `gguf-split` writes them: the shard's 0-based index (u16),
/// the number of shards (u16) and the model's total tensor count over all shards (i32).
pub const KEY_SPLIT_NO: &str = "split.no";
/// See [`KEY_SPLIT_NO`].
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// See [`KEY_SPLIT_NO`].
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";
/// Most shards a split model may have (the `-of-NNNNN` field has five digits, and the count
/// is a u16 in the file).
pub const MAX_SHARDS: u32 = 65_535;

/// Every way a GGUF file can be wrong. Each variant names the file and the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{file}: cannot open: {source}")]
    Open {
        file: PathBuf,
        source: std::io::Error,
    },
    /// The path exists but is a directory, a device or a pipe: nothing to map.
    #[error("{file}: is {kind}, not a GGUF file (pass the model file itself; for a split model, any of its shards)")]
    NotAFile { file: PathBuf, kind: &'static str },
    #[error("{file}: not a GGUF file: magic is {found:#010x}, expected 0x46554747 (\"GGUF\")")]
    BadMagic { file: PathBuf, found: u32 },
    #[error("{file}: unsupported GGUF version {found} (this build reads versions 2 and 3)")]
    BadVersion { file: PathBuf, found: u32 },
    #[error("{file}: truncated: {field} needs {needed} bytes at offset {offset}, but the file has {file_len}")]
    Truncated {
        file: PathBuf,
        field: String,
        offset: u64,
        needed: u64,
        file_len: u64,
    },
    /// A count, length or offset read from the file points past its end. Distinct from
    /// [`GgufError::Truncated`]: here the file may be whole and the value is wrong.
    #[error("{file}: {field} = {value} reaches beyond the file: {expected}")]
    OutOfBounds {
        file: PathBuf,
        field: String,
        value: u64,
        expected: String,
    },
    #[error("{file}: {field}: {what}")]
    Invalid {
        file: PathBuf,
        field: String,
        what: String,
    },
    #[error("{file}: tensor '{tensor}' has type {ty}, which {what}")]
    UnsupportedType {
        file: PathBuf,
        tensor: String,
        ty: String,
        what: String,
    },
    /// `index` is 1-based, as in the shard's file name.
    #[error("{file}: split model: shard {index} of {count} is missing (expected at {expected})")]
    MissingShard {
        file: PathBuf,
        index: u32,
        count: u32,
        expected: PathBuf,
    },
    #[error("{file}: write failed: {source}")]
    Write {
        file: PathBuf,
        source: std::io::Error,
    },
}

impl GgufError {
    /// The field the error is about (`"magic"`, `"metadata 'general.alignment'"`,
    /// `"tensor 'blk.0.ffn_up_exps.weight' offset"`, ...), where the variant has one.
    pub fn field(&self) -> Option<&str> {
        match self {
            GgufError::Truncated { field, .. }
            | GgufError::OutOfBounds { field, .. }
            | GgufError::Invalid { field, .. } => Some(field),
            GgufError::BadMagic { .. } => Some("magic"),
            GgufError::BadVersion { .. } => Some("version"),
            GgufError::MissingShard { .. } => Some(KEY_SPLIT_COUNT),
            GgufError::UnsupportedType { .. }
            | GgufError::Open { .. }
            | GgufError::NotAFile { .. }
            | GgufError::Write { .. } => None,
        }
    }

    pub(crate) fn invalid(
        file: &std::path::Path,
        field: impl Into<String>,
        what: impl Into<String>,
    ) -> Self {
        GgufError::Invalid {
            file: file.to_path_buf(),
            field: field.into(),
            what: what.into(),
        }
    }
}
