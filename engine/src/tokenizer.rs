//! Text ⇄ token ids for the models we run, built from the `tokenizer.ggml.*` metadata of a GGUF
//! file (or a Hugging Face `tokenizer.json`), on top of the `tokenizers` crate.
//!
//! Why not just `tokenizers`: a GGUF file carries the vocabulary, the merges and a *name* for the
//! pre-tokenizer (`tokenizer.ggml.pre`), not the pre-tokenizer itself. We map that name to the
//! split regexes llama.cpp uses for it (`llama-vocab.cpp`), so a model tokenizes here exactly as
//! it does there. Special-token handling also follows llama.cpp: CONTROL tokens (`<|im_start|>`)
//! are matched whole only when the caller asks for it (`parse_special`), USER_DEFINED tokens
//! (`<think>`) always are, and decoding renders every token's text.
//!
//! SentencePiece-style vocabularies (`tokenizer.ggml.model` `llama`, merged by score, and
//! `gemma4`, merged by rank on raw UTF-8 with `▁` for spaces) run on our own merge loop in
//! [`crate::spm`], as llama.cpp runs them; the special-token partition, BOS and the leading
//! space are handled here for both kinds.
//!
//! [`StreamDecoder`] turns a stream of ids into text that is always valid UTF-8, holding back
//! the bytes of a character a token split in two until the rest arrives.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, DecoderWrapper, SplitDelimiterBehavior};

use crate::gguf::{GgufFile, Value};
use crate::spm::{Merging, SpmVocab};

/// GGUF token type of an ordinary vocabulary entry.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
/// GGUF token type of the unknown token (`<unk>`).
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
/// GGUF token type of a control token (`<|im_start|>`, `<|endoftext|>`): matched in text only
/// when the caller parses special tokens.
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type of a user-defined token (`<think>`): always matched whole.
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Token texts that end a generation when the vocabulary marks them CONTROL, in the order the
/// end-of-turn token is chosen when the file names none (`tokenizer.ggml.eot_token_id`).
const EOG_NAMES: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<turn|>",
    "<|return|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|tool_response>",
];

/// Every way building or using a tokenizer can fail.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer metadata: required key {key} is missing")]
    MissingKey { key: String },
    #[error("tokenizer metadata: {key} has the wrong type, expected {expected}")]
    WrongType { key: String, expected: &'static str },
    #[error("tokenizer model '{model}' (tokenizer.ggml.model) is not supported: this build reads byte-level BPE ('gpt2') and SentencePiece-style ('llama', 'gemma4')")]
    UnsupportedModel { model: String },
    #[error("unknown pre-tokenizer type '{pre}' (tokenizer.ggml.pre); supported: {supported}")]
    UnknownPre { pre: String, supported: String },
    #[error(
        "tokenizer metadata: {key} has {found} entries, but tokenizer.ggml.tokens has {expected}"
    )]
    LengthMismatch {
        key: String,
        found: usize,
        expected: usize,
    },
    #[error("tokenizer metadata: merge {index} ({merge:?}) is not of the form \"left right\"")]
    BadMerge { index: usize, merge: String },
    #[error("tokenizer metadata: {key} = {id} is outside the vocabulary of {n_vocab} tokens")]
    SpecialOutOfRange {
        key: String,
        id: u64,
        n_vocab: usize,
    },
    #[error("tokenizer metadata: the vocabulary is empty")]
    EmptyVocab,
    #[error("cannot build the tokenizer: {message}")]
    Build { message: String },
    #[error("{path}: cannot load tokenizer: {message}")]
    File { path: PathBuf, message: String },
    #[error("cannot encode text: {message}")]
    Encode { message: String },
}

/// How a token behaves in encoding and decoding.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TokenKind {
    /// Ordinary BPE token: its text is byte-level encoded.
    Normal,
    /// Control token: matched in input only with `parse_special`; its text is literal.
    Control,
    /// User-defined token: always matched in input; its text is literal.
    UserDefined,
}

/// The pre-tokenizer families we know, keyed by `tokenizer.ggml.pre`. Each is the list of split
/// regexes llama.cpp applies one after another (each later regex splits the pieces of the one
/// before), followed by GPT-2 byte-level encoding.
struct PreSpec {
    names: &'static [&'static str],
    regexes: &'static [&'static str],
    /// The whole pre-token is looked up in the vocabulary before any merge (llama.cpp
    /// `ignore_merges`, Hugging Face `BPE.ignore_merges`).
    ignore_merges: bool,
    /// BOS is prepended when the file does not say (`tokenizer.ggml.add_bos_token` absent).
    add_bos_default: bool,
}

const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The split regex of Qwen2/Qwen3 (`qwen2`), also used by the built-in vocabulary.
pub const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const GPT4O_RE: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const PRE_SPECS: &[PreSpec] = &[
    PreSpec {
        names: &["default"],
        regexes: &[
            r"[\p{P}\$\+<=>\^~\|]+",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            r"\p{N}+",
            r"[0-9][0-9][0-9]",
        ],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreSpec {
        names: &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ],
        regexes: &[LLAMA3_RE],
        ignore_merges: true,
        add_bos_default: true,
    },
    PreSpec {
        names: &["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"],
        regexes: &[LLAMA3_RE],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreSpec {
        names: &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ],
        regexes: &[GPT2_RE],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreSpec {
        names: &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        regexes: &[
            r"\p{N}",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        ],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreSpec {
        names: &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "stablelm2",
            "megrez",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        regexes: &[QWEN2_RE],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreSpec {
        // o200k (gpt-oss, llama4): the split regex of its tokenizer.json, which llama.cpp
        // rewrites without `(?i:…)` and case classes; the `tokenizers` crate runs the original.
        names: &["gpt-4o", "llama4", "kanana2", "talkie"],
        regexes: &[GPT4O_RE],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreSpec {
        names: &["qwen35"],
        regexes: &[QWEN35_RE],
        ignore_merges: false,
        add_bos_default: false,
    },
];

fn pre_spec(pre: &str) -> Option<&'static PreSpec> {
    PRE_SPECS.iter().find(|s| s.names.contains(&pre))
}

fn supported_pre_names() -> String {
    PRE_SPECS
        .iter()
        .flat_map(|s| s.names.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Build the `tokenizers` pre-tokenizer for a named pre-tokenizer type: its split regexes in
/// order, then byte-level encoding (no regex of its own, no prefix space).
pub fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let spec = pre_spec(pre).ok_or_else(|| TokenizerError::UnknownPre {
        pre: pre.to_string(),
        supported: supported_pre_names(),
    })?;
    build_pre_tokenizer(spec.regexes)
}

fn build_pre_tokenizer(regexes: &[&str]) -> Result<PreTokenizerWrapper, TokenizerError> {
    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(regexes.len() + 1);
    for re in regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Build {
            message: format!("split regex {re:?}: {e}"),
        })?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    Ok(Sequence::new(steps).into())
}

/// GPT-2's byte → printable character table (index = byte).
fn byte_to_char_table() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = ['\0'; 256];
        let mut next_unprintable = 256u32;
        for b in 0..256u32 {
            let printable = (0x21..=0x7e).contains(&b)
                || (0xa1..=0xac).contains(&b)
                || (0xae..=0xff).contains(&b);
            let c = if printable {
                b
            } else {
                let c = next_unprintable;
                next_unprintable += 1;
                c
            };
            table[b as usize] = char::from_u32(c).unwrap_or('\u{fffd}');
        }
        table
    })
}

/// GPT-2's printable character → byte table, the inverse of [`byte_to_char_table`].
fn char_to_byte_map() -> &'static HashMap<char, u8> {
    static MAP: OnceLock<HashMap<char, u8>> = OnceLock::new();
    MAP.get_or_init(|| {
        byte_to_char_table()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect()
    })
}

/// Byte-level encode raw bytes into the printable form BPE vocabularies store.
pub fn byte_level_encode(bytes: &[u8]) -> String {
    let table = byte_to_char_table();
    bytes.iter().map(|&b| table[b as usize]).collect()
}

/// Byte-level decode a vocabulary string into raw bytes. A character outside the table (a
/// malformed vocabulary) is kept as its own UTF-8 bytes rather than dropped.
pub fn byte_level_decode(text: &str) -> Vec<u8> {
    let map = char_to_byte_map();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// A tokenizer for one model: encode text to ids, decode ids to text, and the special ids a
/// generation loop needs. Immutable after construction and `Sync`, so one instance serves all
/// threads.
pub struct Tokenizer {
    model: Model,
    /// Per id: how the token behaves. Its length is the vocabulary size.
    kinds: Vec<TokenKind>,
    /// Tokens our partition matches whole, longest text first: CONTROL tokens under
    /// `parse_special` only; for SentencePiece-style vocabularies also USER_DEFINED ones
    /// always (for byte-level BPE the `tokenizers` library matches those).
    specials: Vec<Special>,
    /// Normal tokens' texts are byte-level encoded (true for every GGUF BPE vocabulary).
    byte_level: bool,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    eog: HashSet<u32>,
    pre: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("n_vocab", &self.kinds.len())
            .field("model", &self.model.name())
            .field("pre", &self.pre)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

/// Read access to `tokenizer.*` metadata, from a GGUF file or from a list of entries.
pub trait TokenizerMetadata {
    /// The value stored under `key`, if any.
    fn meta(&self, key: &str) -> Option<&Value>;
}

impl TokenizerMetadata for GgufFile {
    fn meta(&self, key: &str) -> Option<&Value> {
        self.get(key)
    }
}

impl TokenizerMetadata for [(String, Value)] {
    fn meta(&self, key: &str) -> Option<&Value> {
        self.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

impl TokenizerMetadata for Vec<(String, Value)> {
    fn meta(&self, key: &str) -> Option<&Value> {
        self.as_slice().meta(key)
    }
}

fn required<'a, M: TokenizerMetadata + ?Sized>(
    meta: &'a M,
    key: &str,
) -> Result<&'a Value, TokenizerError> {
    meta.meta(key).ok_or_else(|| TokenizerError::MissingKey {
        key: key.to_string(),
    })
}

fn string_array<'a>(value: &'a Value, key: &str) -> Result<Vec<&'a str>, TokenizerError> {
    value
        .as_str_array()
        .ok_or_else(|| TokenizerError::WrongType {
            key: key.to_string(),
            expected: "array of strings",
        })
}

fn optional_id<M: TokenizerMetadata + ?Sized>(
    meta: &M,
    key: &str,
    n_vocab: usize,
) -> Result<Option<u32>, TokenizerError> {
    let Some(value) = meta.meta(key) else {
        return Ok(None);
    };
    let id = value.as_u64().ok_or_else(|| TokenizerError::WrongType {
        key: key.to_string(),
        expected: "non-negative integer",
    })?;
    if id >= n_vocab as u64 {
        return Err(TokenizerError::SpecialOutOfRange {
            key: key.to_string(),
            id,
            n_vocab,
        });
    }
    Ok(Some(id as u32))
}

impl Tokenizer {
    /// Build the tokenizer of a GGUF model from its `tokenizer.ggml.*` metadata.
    ///
    /// Requires `tokenizer.ggml.model = "gpt2"` (byte-level BPE), `tokens`, `merges`, and a
    /// `pre` this build knows (absent means `default`, as in llama.cpp); `token_type` is
    /// optional (all normal). An unknown pre-tokenizer, a merge that is not `"left right"`, or
    /// a special id outside the vocabulary is an error naming the key.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        Self::from_metadata(file)
    }

    /// Same as [`Tokenizer::from_gguf`], over any source of `tokenizer.*` entries (for example
    /// the entries [`crate::vocab::builtin_vocab`] returns, before they are written to a file).
    pub fn from_metadata<M: TokenizerMetadata + ?Sized>(
        meta: &M,
    ) -> Result<Tokenizer, TokenizerError> {
        let model_key = "tokenizer.ggml.model";
        let model =
            required(meta, model_key)?
                .as_str()
                .ok_or_else(|| TokenizerError::WrongType {
                    key: model_key.to_string(),
                    expected: "string",
                })?;
        if model == "llama" || model == "gemma4" {
            return Self::from_spm_metadata(meta, model);
        }
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel {
                model: model.to_string(),
            });
        }
        let pre_key = "tokenizer.ggml.pre";
        let pre = match meta.meta(pre_key) {
            None => "default",
            Some(v) => v.as_str().ok_or_else(|| TokenizerError::WrongType {
                key: pre_key.to_string(),
                expected: "string",
            })?,
        };
        let spec = pre_spec(pre).ok_or_else(|| TokenizerError::UnknownPre {
            pre: pre.to_string(),
            supported: supported_pre_names(),
        })?;

        let tokens = read_tokens(meta)?;
        let n_vocab = tokens.len();

        let kinds: Vec<TokenKind> = read_token_types(meta, n_vocab)?
            .into_iter()
            .map(kind_of_type)
            .collect();

        let merges = read_merges(meta)?;

        // The vocabulary map for BPE. On a duplicated text the first id wins; every id still
        // decodes through `kinds` and the model's reverse map.
        let mut vocab = tokenizers::models::bpe::Vocab::with_capacity(n_vocab);
        for (id, t) in tokens.iter().enumerate() {
            vocab.entry((*t).to_string()).or_insert(id as u32);
        }

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(spec.ignore_merges)
            .build()
            .map_err(|e| TokenizerError::Build {
                message: format!("BPE model: {e}"),
            })?;
        let mut hf = tokenizers::Tokenizer::new(bpe);
        hf.with_pre_tokenizer(Some(build_pre_tokenizer(spec.regexes)?));
        hf.with_decoder(Some(DecoderWrapper::from(
            tokenizers::decoders::byte_level::ByteLevel::default(),
        )));
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&kinds)
            .filter(|(_, k)| **k != TokenKind::Normal)
            .map(|(t, k)| {
                AddedToken::from((*t).to_string(), *k == TokenKind::Control).normalized(false)
            })
            .collect();
        hf.add_tokens(&added);
        // CONTROL tokens are matched by our own partition (only under `parse_special`); the
        // library must treat them as text everywhere else.
        hf.set_encode_special_tokens(true);

        let ids = SpecialIds::read(meta, n_vocab, spec.add_bos_default)?;
        let owned_tokens: Vec<String> = tokens.iter().map(|s| s.to_string()).collect();
        Self::assemble(
            Model::Bpe(Box::new(hf)),
            kinds,
            &owned_tokens,
            true,
            ids,
            pre.to_string(),
        )
    }

    /// A SentencePiece-style vocabulary: `llama` (scores, `tokenizer.ggml.scores`; a space
    /// before the text unless `tokenizer.ggml.add_space_prefix` is false) or `gemma4` (merge
    /// ranks, `tokenizer.ggml.merges`; no space prefix; BOS always, as llama.cpp forces it).
    fn from_spm_metadata<M: TokenizerMetadata + ?Sized>(
        meta: &M,
        model: &str,
    ) -> Result<Tokenizer, TokenizerError> {
        let tokens = read_tokens(meta)?;
        let n_vocab = tokens.len();
        let texts: Vec<String> = tokens.iter().map(|s| s.to_string()).collect();
        let types = read_token_types(meta, n_vocab)?;
        let gemma = model == "gemma4";
        let merging = if gemma {
            SpmVocab::ranks(&texts, &read_merges(meta)?)
        } else {
            let key = "tokenizer.ggml.scores";
            let wrong = || TokenizerError::WrongType {
                key: key.to_string(),
                expected: "array of floats",
            };
            let items = required(meta, key)?.as_array().ok_or_else(wrong)?;
            if items.len() != n_vocab {
                return Err(TokenizerError::LengthMismatch {
                    key: key.to_string(),
                    found: items.len(),
                    expected: n_vocab,
                });
            }
            let scores = items
                .iter()
                .map(|v| v.as_f64().map(|f| f as f32).ok_or_else(wrong))
                .collect::<Result<Vec<f32>, _>>()?;
            Merging::Scores(scores)
        };
        let prefix_key = "tokenizer.ggml.add_space_prefix";
        let add_space_prefix = match meta.meta(prefix_key) {
            None => !gemma,
            Some(v) => v.as_bool().ok_or_else(|| TokenizerError::WrongType {
                key: prefix_key.to_string(),
                expected: "bool",
            })?,
        };
        let mut ids = SpecialIds::read(meta, n_vocab, true)?;
        if gemma {
            ids.add_bos = true;
        }
        // The unknown token (`<unk>`) is matched whole under `parse_special`, as llama.cpp's
        // partition does, and renders as its text.
        let kinds = types
            .iter()
            .map(|&t| match t {
                TOKEN_TYPE_UNKNOWN => TokenKind::Control,
                t => kind_of_type(t),
            })
            .collect();
        let vocab = Box::new(SpmVocab::new(texts.clone(), &types, merging));
        Self::assemble(
            Model::Spm {
                vocab,
                add_space_prefix,
            },
            kinds,
            &texts,
            false,
            ids,
            model.to_string(),
        )
    }

    /// Load a Hugging Face `tokenizer.json`. Special ids come from a `tokenizer_config.json`
    /// beside it when present (`bos_token`, `eos_token`, `add_bos_token`); otherwise BOS is
    /// unknown and EOS/EOT are found by name among the special added tokens.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Tokenizer, TokenizerError> {
        let path = path.as_ref();
        let file_err = |message: String| TokenizerError::File {
            path: path.to_path_buf(),
            message,
        };
        let mut hf = tokenizers::Tokenizer::from_file(path).map_err(|e| file_err(e.to_string()))?;
        let n_vocab = hf.get_vocab_size(true);
        if n_vocab == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        let mut texts = vec![String::new(); n_vocab];
        for (text, id) in hf.get_vocab(true) {
            if let Some(slot) = texts.get_mut(id as usize) {
                *slot = text;
            }
        }
        let mut kinds = vec![TokenKind::Normal; n_vocab];
        for (id, tok) in hf.get_added_tokens_decoder() {
            if let Some(k) = kinds.get_mut(id as usize) {
                *k = if tok.special {
                    TokenKind::Control
                } else {
                    TokenKind::UserDefined
                };
            }
        }
        hf.set_encode_special_tokens(true);
        let byte_level = matches!(hf.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));

        let mut ids = SpecialIds::default();
        let config = path.with_file_name("tokenizer_config.json");
        if let Ok(text) = std::fs::read_to_string(&config) {
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| TokenizerError::File {
                    path: config.clone(),
                    message: e.to_string(),
                })?;
            let token_of = |key: &str| -> Option<u32> {
                let v = json.get(key)?;
                let s = v.as_str().or_else(|| v.get("content")?.as_str())?;
                hf.token_to_id(s)
            };
            ids.bos = token_of("bos_token");
            ids.eos = token_of("eos_token");
            ids.pad = token_of("pad_token");
            ids.add_bos = json
                .get("add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
        }
        Self::assemble(
            Model::Bpe(Box::new(hf)),
            kinds,
            &texts,
            byte_level,
            ids,
            "tokenizer.json".into(),
        )
    }

    fn assemble(
        model: Model,
        mut kinds: Vec<TokenKind>,
        texts: &[String],
        byte_level: bool,
        ids: SpecialIds,
        pre: String,
    ) -> Result<Tokenizer, TokenizerError> {
        // End of generation: EOS, the named EOT, and every CONTROL token whose text is one of
        // the well-known end-of-turn markers. The first such name in `EOG_NAMES` order becomes
        // EOT when the file names none.
        let mut eog = HashSet::new();
        if let Some(e) = ids.eos {
            eog.insert(e);
        }
        let mut eot = ids.eot;
        for name in EOG_NAMES {
            let Some(id) = model.token_id(name) else {
                continue;
            };
            let is_control = kinds.get(id as usize) == Some(&TokenKind::Control);
            // llama.cpp marks these names end-of-generation whatever their type and makes
            // them CONTROL; we do so for SentencePiece-style vocabularies (gemma-4's
            // `<|tool_response>` is USER_DEFINED in the file), and keep byte-level BPE as it was.
            let spm = matches!(model, Model::Spm { .. });
            if (is_control || spm) && texts.get(id as usize).map(String::as_str) == Some(*name) {
                if let Some(k) = kinds.get_mut(id as usize) {
                    *k = TokenKind::Control;
                }
                eog.insert(id);
                if eot.is_none() {
                    eot = Some(id);
                }
            }
        }
        if let Some(e) = eot {
            eog.insert(e);
            // An end-of-turn token must never be produced by ordinary text.
            if let Some(k @ TokenKind::Normal) = kinds.get_mut(e as usize) {
                *k = TokenKind::Control;
            }
        }

        let user_defined_too = matches!(model, Model::Spm { .. });
        let mut specials: Vec<Special> = kinds
            .iter()
            .enumerate()
            .filter(|(id, _)| !texts[*id].is_empty())
            .filter_map(|(id, k)| {
                let always = match k {
                    TokenKind::Control => false,
                    TokenKind::UserDefined if user_defined_too => true,
                    _ => return None,
                };
                Some(Special {
                    text: texts[id].clone(),
                    id: id as u32,
                    always,
                })
            })
            .collect();
        // Longest first, as llama.cpp partitions; ties by id so the order is deterministic.
        specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));

        Ok(Tokenizer {
            model,
            kinds,
            specials,
            byte_level,
            bos: ids.bos,
            eos: ids.eos,
            eot,
            pad: ids.pad,
            add_bos: ids.add_bos && ids.bos.is_some(),
            eog,
            pre,
        })
    }

    /// Encode `text`, prepending BOS when the vocabulary asks for it
    /// (`tokenizer.ggml.add_bos_token`, or the pre-tokenizer's default as in llama.cpp).
    /// With `parse_special`, CONTROL token texts in `text` (`<|im_start|>`) become their ids;
    /// without it they are tokenized as ordinary text. USER_DEFINED tokens always match.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, self.add_bos, parse_special)
    }

    /// Encode `text`, prepending BOS only if `add_bos` (and the vocabulary has one).
    pub fn encode_with(
        &self,
        text: &str,
        add_bos: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos {
            if let Some(b) = self.bos {
                out.push(b);
            }
        }
        // Text right after a special token (or at the start) gets the SentencePiece space
        // prefix, as llama.cpp does.
        let mut after_special = true;
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    self.encode_plain(t, after_special, &mut out)?;
                    after_special = false;
                }
            }
        }
        Ok(out)
    }

    fn encode_plain(
        &self,
        text: &str,
        after_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        match &self.model {
            Model::Bpe(hf) => {
                let enc = hf
                    .encode_fast(text, false)
                    .map_err(|e| TokenizerError::Encode {
                        message: e.to_string(),
                    })?;
                out.extend_from_slice(enc.get_ids());
            }
            Model::Spm {
                vocab,
                add_space_prefix,
            } => {
                let mut escaped = String::with_capacity(text.len() + 4);
                if *add_space_prefix && after_special {
                    escaped.push('\u{2581}');
                }
                escaped.push_str(&text.replace(' ', "\u{2581}"));
                vocab.encode(&escaped, out);
            }
        }
        Ok(())
    }

    /// Split `text` at every special token our partition matches (see `specials`), longest
    /// tokens first (llama.cpp's partition).
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = vec![Fragment::Text(text)];
        for Special {
            text: special,
            id,
            always,
        } in &self.specials
        {
            if !(parse_special || *always) || !text.contains(special.as_str()) {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                match f {
                    Fragment::Token(_) => next.push(f),
                    Fragment::Text(mut rest) => {
                        while let Some(pos) = rest.find(special.as_str()) {
                            if pos > 0 {
                                next.push(Fragment::Text(&rest[..pos]));
                            }
                            next.push(Fragment::Token(*id));
                            rest = &rest[pos + special.len()..];
                        }
                        if !rest.is_empty() {
                            next.push(Fragment::Text(rest));
                        }
                    }
                }
            }
            fragments = next;
        }
        fragments
    }

    /// The raw bytes a token stands for: byte-level decoded for ordinary tokens, the literal
    /// text for CONTROL and USER_DEFINED tokens. Empty for an id outside the vocabulary. A
    /// token may end in the middle of a UTF-8 character; see [`StreamDecoder`].
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(kind) = self.kinds.get(id as usize) else {
            return Vec::new();
        };
        match &self.model {
            Model::Bpe(hf) => {
                let Some(text) = hf.id_to_token(id) else {
                    return Vec::new();
                };
                match kind {
                    TokenKind::Normal if self.byte_level => byte_level_decode(&text),
                    TokenKind::Normal => hf
                        .decode(&[id], false)
                        .map(String::into_bytes)
                        .unwrap_or_default(),
                    TokenKind::Control | TokenKind::UserDefined => text.into_bytes(),
                }
            }
            Model::Spm { vocab, .. } => match kind {
                TokenKind::Normal => vocab.piece_bytes(id),
                TokenKind::Control | TokenKind::UserDefined => vocab
                    .text(id)
                    .map(|t| t.as_bytes().to_vec())
                    .unwrap_or_default(),
            },
        }
    }

    /// Decode ids to text, special tokens included; bytes that are not valid UTF-8 become
    /// U+FFFD. Ids outside the vocabulary contribute nothing. A vocabulary that puts a space
    /// before the text (`llama` SentencePiece) loses it again from the first token, as
    /// llama.cpp's detokenizer does; a stream decoded token by token keeps it.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_bytes(id);
            let strip = i == 0
                && self.kinds.get(id as usize) == Some(&TokenKind::Normal)
                && matches!(
                    self.model,
                    Model::Spm {
                        add_space_prefix: true,
                        ..
                    }
                )
                && piece.first() == Some(&b' ');
            bytes.extend_from_slice(if strip { &piece[1..] } else { &piece });
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// The vocabulary size (ids are `0..n_vocab`).
    pub fn n_vocab(&self) -> usize {
        self.kinds.len()
    }

    /// Beginning-of-sequence id, if the vocabulary has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence id, if the vocabulary has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The text of the BOS token (for a chat template's `bos_token`), empty when there is none.
    pub fn bos_text(&self) -> String {
        self.special_text(self.bos)
    }

    /// The text of the EOS token (for a chat template's `eos_token`), empty when there is none.
    pub fn eos_text(&self) -> String {
        self.special_text(self.eos)
    }

    fn special_text(&self, id: Option<u32>) -> String {
        id.map(|id| String::from_utf8_lossy(&self.token_bytes(id)).into_owned())
            .unwrap_or_default()
    }

    /// End-of-turn id (`<|im_end|>` for Qwen, `<|eot_id|>` for Llama 3), if any.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// Padding id, if the vocabulary has one.
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// Whether [`Tokenizer::encode`] prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The pre-tokenizer name this tokenizer was built with.
    pub fn pre(&self) -> &str {
        &self.pre
    }

    /// Whether `id` ends a generation (EOS, EOT, or a CONTROL end-of-turn marker).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eog.iter().copied().collect();
        v.sort_unstable();
        v
    }

    /// How token `id` behaves, or `None` outside the vocabulary.
    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// The id of a token by its vocabulary text (byte-level form for ordinary tokens, literal
    /// for special ones), e.g. `token_id("<|im_end|>")`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.model.token_id(text)
    }

    /// The underlying `tokenizers` tokenizer of a byte-level BPE vocabulary (CONTROL tokens
    /// are registered as special added tokens with `encode_special_tokens` on); `None` for a
    /// SentencePiece-style one, which runs on our own merge loop.
    pub fn inner(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.model {
            Model::Bpe(hf) => Some(hf.as_ref()),
            Model::Spm { .. } => None,
        }
    }

    /// The tokenizer model: `gpt2` (byte-level BPE), `llama` or `gemma4`.
    pub fn model_name(&self) -> &'static str {
        self.model.name()
    }
}

/// The merge machinery under a [`Tokenizer`].
enum Model {
    /// Byte-level BPE on the `tokenizers` library.
    Bpe(Box<tokenizers::Tokenizer>),
    /// SentencePiece-style, on [`crate::spm`].
    Spm {
        vocab: Box<SpmVocab>,
        /// Put `▁` before text that starts the input or follows a special token.
        add_space_prefix: bool,
    },
}

impl Model {
    fn token_id(&self, text: &str) -> Option<u32> {
        match self {
            Model::Bpe(hf) => hf.token_to_id(text),
            Model::Spm { vocab, .. } => vocab.id(text),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Model::Bpe(_) => "gpt2",
            Model::Spm { vocab, .. } => vocab.model_name(),
        }
    }
}

/// A token the partition matches whole.
struct Special {
    text: String,
    id: u32,
    /// Matched even without `parse_special` (USER_DEFINED).
    always: bool,
}

/// `tokenizer.ggml.tokens`: at least one, and few enough for 32-bit ids.
fn read_tokens<M: TokenizerMetadata + ?Sized>(meta: &M) -> Result<Vec<&str>, TokenizerError> {
    let key = "tokenizer.ggml.tokens";
    let tokens = string_array(required(meta, key)?, key)?;
    if tokens.is_empty() {
        return Err(TokenizerError::EmptyVocab);
    }
    if tokens.len() > u32::MAX as usize {
        return Err(TokenizerError::Build {
            message: format!("{} tokens do not fit 32-bit ids", tokens.len()),
        });
    }
    Ok(tokens)
}

/// `tokenizer.ggml.token_type`, one GGUF token type per token (all normal when absent).
fn read_token_types<M: TokenizerMetadata + ?Sized>(
    meta: &M,
    n_vocab: usize,
) -> Result<Vec<i32>, TokenizerError> {
    let key = "tokenizer.ggml.token_type";
    let Some(v) = meta.meta(key) else {
        return Ok(vec![TOKEN_TYPE_NORMAL; n_vocab]);
    };
    let wrong = || TokenizerError::WrongType {
        key: key.to_string(),
        expected: "array of integers",
    };
    let items = v.as_array().ok_or_else(wrong)?;
    if items.len() != n_vocab {
        return Err(TokenizerError::LengthMismatch {
            key: key.to_string(),
            found: items.len(),
            expected: n_vocab,
        });
    }
    items
        .iter()
        .map(|t| t.as_i64().map(|t| t as i32).ok_or_else(wrong))
        .collect()
}

fn kind_of_type(t: i32) -> TokenKind {
    match t {
        TOKEN_TYPE_CONTROL => TokenKind::Control,
        TOKEN_TYPE_USER_DEFINED => TokenKind::UserDefined,
        _ => TokenKind::Normal,
    }
}

/// `tokenizer.ggml.merges` as (left, right) pairs. llama.cpp splits each at the first space
/// after the first byte, so a left side that is itself a space survives.
fn read_merges<M: TokenizerMetadata + ?Sized>(
    meta: &M,
) -> Result<Vec<(String, String)>, TokenizerError> {
    let key = "tokenizer.ggml.merges";
    let raw = string_array(required(meta, key)?, key)?;
    let mut merges = Vec::with_capacity(raw.len());
    for (index, m) in raw.iter().enumerate() {
        let split_at = m
            .as_bytes()
            .iter()
            .skip(1)
            .position(|&b| b == b' ')
            .map(|p| p + 1)
            .ok_or_else(|| TokenizerError::BadMerge {
                index,
                merge: m.to_string(),
            })?;
        merges.push((m[..split_at].to_string(), m[split_at + 1..].to_string()));
    }
    Ok(merges)
}

#[derive(Default)]
struct SpecialIds {
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
}

impl SpecialIds {
    /// The `tokenizer.ggml.*_token_id` keys and `add_bos_token` (else `add_bos_default`).
    fn read<M: TokenizerMetadata + ?Sized>(
        meta: &M,
        n_vocab: usize,
        add_bos_default: bool,
    ) -> Result<SpecialIds, TokenizerError> {
        let add_bos_key = "tokenizer.ggml.add_bos_token";
        Ok(SpecialIds {
            bos: optional_id(meta, "tokenizer.ggml.bos_token_id", n_vocab)?,
            eos: optional_id(meta, "tokenizer.ggml.eos_token_id", n_vocab)?,
            pad: optional_id(meta, "tokenizer.ggml.padding_token_id", n_vocab)?,
            eot: optional_id(meta, "tokenizer.ggml.eot_token_id", n_vocab)?,
            add_bos: match meta.meta(add_bos_key) {
                None => add_bos_default,
                Some(v) => v.as_bool().ok_or_else(|| TokenizerError::WrongType {
                    key: add_bos_key.to_string(),
                    expected: "bool",
                })?,
            },
        })
    }
}

enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// Turns generated ids into text one at a time, returning only complete UTF-8: the bytes of a
/// character split across tokens are held until the rest arrives. Bytes that can never become
/// valid UTF-8 are emitted as U+FFFD, so nothing is held forever.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one token; return the text that is now complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        let bytes = tokenizer.token_bytes(id);
        self.push_bytes(&bytes)
    }

    /// Add raw bytes; return the text that is now complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix is valid UTF-8 by the error's contract.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: keep it for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes that no continuation can fix.
                        Some(bad) => {
                            out.push('\u{fffd}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// End of stream: whatever is still held, with an incomplete character as U+FFFD.
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_round_trips_every_byte() {
        let all: Vec<u8> = (0..=255u8).collect();
        let enc = byte_level_encode(&all);
        assert_eq!(enc.chars().count(), 256);
        assert_eq!(byte_level_decode(&enc), all);
        assert_eq!(byte_level_encode(b" "), "\u{120}");
        assert_eq!(byte_level_encode(b"\n"), "\u{10a}");
        assert_eq!(byte_level_encode(b"a"), "a");
    }

    #[test]
    fn stream_decoder_holds_split_characters() {
        let mut d = StreamDecoder::new();
        let snow = "é☃😀".as_bytes().to_vec();
        let mut out = String::new();
        for b in &snow {
            out.push_str(&d.push_bytes(&[*b]));
        }
        assert_eq!(out, "é☃😀");
        assert_eq!(d.pending_bytes(), 0);
        assert_eq!(d.push_bytes(&[0xe2, 0x98]), "");
        assert_eq!(d.pending_bytes(), 2);
        assert_eq!(d.push_bytes(&[0x83, b'x']), "☃x");
    }

    #[test]
    fn gpt4o_splits_as_o200k_does() {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let pre = pre_tokenizer_for("gpt-4o").unwrap();
        let mut s = PreTokenizedString::from("Hello WORLD's DON'T camelCase 1234567 foo/bar\n\nx");
        pre.pre_tokenize(&mut s).unwrap();
        let pieces: Vec<String> = s
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(p, _, _)| byte_level_decode(p).into_iter().map(char::from).collect())
            .collect();
        // Case runs split words (a capitalised word, an all-caps one with its contraction,
        // camelCase in two), digits go in threes, a leading punctuation mark joins the word.
        assert_eq!(
            pieces,
            [
                "Hello", " WORLD's", " DON'T", " camel", "Case", " ", "123", "456", "7", " foo",
                "/bar", "\n\n", "x"
            ]
        );
    }

    #[test]
    fn stream_decoder_replaces_invalid_bytes() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push_bytes(&[b'a', 0xff, b'b']), "a\u{fffd}b");
        assert_eq!(d.push_bytes(&[0xf0, 0x9f]), "");
        assert_eq!(d.flush(), "\u{fffd}");
    }

    fn tiny_meta(pre: &str) -> Vec<(String, Value)> {
        // A vocabulary of every byte, a couple of merges and three special tokens.
        let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_level_encode(&[b])).collect();
        tokens.push("he".into());
        tokens.push("hel".into());
        tokens.push("<|im_end|>".into());
        tokens.push("<think>".into());
        tokens.push("<|endoftext|>".into());
        let mut types = vec![Value::I32(1); 258];
        types.push(Value::I32(3));
        types.push(Value::I32(4));
        types.push(Value::I32(3));
        vec![
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
            ("tokenizer.ggml.tokens".into(), Value::strings(&tokens)),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(crate::gguf::ValueType::I32, types),
            ),
            (
                "tokenizer.ggml.merges".into(),
                Value::strings(["h e", "he l"]),
            ),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(260)),
        ]
    }

    #[test]
    fn special_tokens_follow_parse_special() {
        let t = Tokenizer::from_metadata(&tiny_meta("qwen2")).expect("tokenizer");
        assert_eq!(t.n_vocab(), 261);
        assert_eq!(t.encode("hel", false).unwrap(), vec![257]);
        // CONTROL: whole only with parse_special.
        assert_eq!(t.encode("<|im_end|>", true).unwrap(), vec![258]);
        let as_text = t.encode("<|im_end|>", false).unwrap();
        assert!(as_text.len() > 1 && !as_text.contains(&258));
        assert_eq!(t.decode(&as_text), "<|im_end|>");
        // USER_DEFINED: always whole.
        assert_eq!(t.encode("<think>", false).unwrap(), vec![259]);
        assert_eq!(t.eot(), Some(258));
        assert!(t.is_eog(258) && t.is_eog(260) && !t.is_eog(259));
        assert_eq!(t.decode(&[256, 258]), "he<|im_end|>");
        assert_eq!(t.token_id("<think>"), Some(259));
        assert!(!t.add_bos());
    }

    #[test]
    fn unknown_pre_is_named() {
        let err = Tokenizer::from_metadata(&tiny_meta("martian")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("'martian'") && msg.contains("qwen2"), "{msg}");
    }

    #[test]
    fn bad_merge_and_bad_special_are_errors() {
        let mut m = tiny_meta("qwen2");
        m[4].1 = Value::strings(["he"]);
        assert!(matches!(
            Tokenizer::from_metadata(&m),
            Err(TokenizerError::BadMerge { index: 0, .. })
        ));
        let mut m = tiny_meta("qwen2");
        m[5].1 = Value::U32(9999);
        assert!(matches!(
            Tokenizer::from_metadata(&m),
            Err(TokenizerError::SpecialOutOfRange { .. })
        ));
    }
}
