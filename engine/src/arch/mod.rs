//! One file per architecture. Each reads and checks its hyper-parameters from GGUF metadata
//! once, names its tensors verbatim, and implements the layer forward with the router step
//! and the expert step apart, so the shared core can stream experts between them.

pub mod qwen3moe;

/// Architectures this build runs (`bmoe-cli --list-archs`).
pub const SUPPORTED: &[(&str, &str)] = &[("qwen3moe", "Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax top-k routing, renormalised, SiLU-gated split experts, no shared expert")];

/// Errors loading a model for an architecture.
#[derive(Debug, thiserror::Error)]
pub enum ArchError {
    #[error("{file}: architecture '{arch}' is not one this build runs (supported: {supported}); see --list-archs")]
    Unsupported {
        file: String,
        arch: String,
        supported: String,
    },
    #[error("{file}: architecture '{arch}' is not a mixture-of-experts model; bmoe streams MoE experts only")]
    NotMoe { file: String, arch: String },
    #[error("{file}: metadata key '{key}' {what}")]
    Key {
        file: String,
        key: String,
        what: String,
    },
    #[error("{file}: tensor '{tensor}' {what}")]
    Tensor {
        file: String,
        tensor: String,
        what: String,
    },
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    /// `--check-finite` found a NaN or infinity in a layer's intermediate (named as
    /// llama.cpp's eval callback names them).
    #[error("layer {layer} {tensor}: {count} of {total} values are NaN or infinite (first at position {position}); this is the first intermediate --check-finite found broken")]
    NonFinite {
        layer: usize,
        tensor: &'static str,
        position: u32,
        count: usize,
        total: usize,
    },
}
