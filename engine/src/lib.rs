//! bmoe-engine: the real instantiation of bmoe-core — GGUF files, CPU kernels, our own
//! forward pass per architecture, O_DIRECT flash lanes — behind the `bmoe-cli` binary.

pub mod gguf;
pub mod inspect;
pub mod testdata;
