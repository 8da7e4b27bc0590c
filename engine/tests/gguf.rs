//! Integration tests of the GGUF file layer: error classes, round trips, split models, the
//! independent gguf-py reader, `inspect`, and the kernels' block formats against llama.cpp's.

#[path = "gguf/common.rs"]
mod common;
#[path = "gguf/errors.rs"]
mod errors;
#[path = "gguf/inspect.rs"]
mod inspect;
#[path = "gguf/llama_kernels.rs"]
mod llama_kernels;
#[path = "gguf/python.rs"]
mod python;
#[path = "gguf/roundtrip.rs"]
mod roundtrip;
#[path = "gguf/split.rs"]
mod split;
