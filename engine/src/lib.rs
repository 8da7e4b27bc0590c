//! bmoe-engine: the real instantiation of bmoe-core — GGUF files, CPU kernels, our own
//! forward pass per architecture, O_DIRECT flash lanes — behind the `bmoe-cli` binary.

pub mod arch;
pub mod arena;
pub mod chat;
pub mod chat_tty;
pub mod checksum;
pub mod cli;
pub mod constrain;
pub mod conventions;
pub mod converse;
pub mod cpus;
pub mod dense;
pub mod files;
pub mod finite;
pub mod flash;
pub mod fuzzing;
pub mod gen;
pub mod gguf;
pub mod inspect;
pub mod kernels;
pub mod optrace;
pub mod outputs;
pub mod probe;
pub mod prompt;
pub mod run;
pub mod sample;
pub mod serve;
pub mod session;
pub mod spm;
pub mod stream;
pub mod testdata;
pub mod tokenizer;
pub mod tools;
pub mod vocab;
