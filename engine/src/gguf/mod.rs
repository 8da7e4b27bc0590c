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

pub use reader::{GgufFile, TensorInfo};
pub use types::GgmlType;
pub use value::{Value, ValueType};
pub use writer::{GgufWriter, TensorSpec};

use std::path::PathBuf;

/// GGUF magic, `"GGUF"` read as a little-endian u32.
pub const GGUF_MAGIC: u32 = 0x4655_4747;
/// Alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Every way a GGUF file can be wrong. Each variant names the file and the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{file}: cannot open: {source}")]
    Open {
        file: PathBuf,
        source: std::io::Error,
    },
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
