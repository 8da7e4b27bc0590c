//! The tokenizer vocabulary a synthetic model carries: either the built-in one, trained here
//! from the public-domain corpus in `engine/assets/` (a user on a fresh machine has no real
//! vocabulary at hand), or one copied from a real GGUF vocabulary or `tokenizer.json`.
//!
//! Either way the result is the GGUF metadata entries (`tokenizer.ggml.*` and
//! `tokenizer.chat_template`) that `bmoe-cli gen` writes and [`crate::tokenizer::Tokenizer`]
//! reads back. The built-in vocabulary is a byte-level BPE of 4096 tokens with the Qwen2 split
//! regex and Qwen3's special tokens, so the generated model tokenizes, templates and streams
//! like a qwen3moe model. Training is deterministic (same corpus, same bytes) and takes well
//! under a second in release; nothing is cached on disk.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::DecoderWrapper;

use crate::gguf::{GgufError, GgufFile, Value, ValueType};
use crate::tokenizer::{
    pre_tokenizer_for, TokenizerError, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
};

/// GGUF metadata entries of a vocabulary, in the order they should be written.
pub type VocabKv = Vec<(String, Value)>;

/// Total size of the built-in vocabulary, special tokens included.
pub const BUILTIN_VOCAB_SIZE: usize = 4096;

/// The built-in chat template: ChatML with a thinking span, Qwen3 semantics
/// (`enable_thinking=false` puts an empty `<think>\n\n</think>\n\n` in the generation prompt).
pub const BUILTIN_CHAT_TEMPLATE: &str = include_str!("../assets/chat_template.jinja");

/// The training corpus: (file name, text). Sources and licences in `engine/assets/README.md`.
const CORPUS: &[(&str, &str)] = &[
    (
        "around-the-world-in-eighty-days.txt",
        include_str!("../assets/corpus/around-the-world-in-eighty-days.txt"),
    ),
    (
        "code-samples.txt",
        include_str!("../assets/corpus/code-samples.txt"),
    ),
];

/// Special tokens appended after the trained tokens, with their GGUF token type: the ChatML
/// markers are CONTROL, the think tags USER_DEFINED (always matched, rendered in output), as in
/// Qwen3's vocabulary.
const SPECIALS: &[(&str, i32)] = &[
    ("<|endoftext|>", TOKEN_TYPE_CONTROL),
    ("<|im_start|>", TOKEN_TYPE_CONTROL),
    ("<|im_end|>", TOKEN_TYPE_CONTROL),
    ("<think>", TOKEN_TYPE_USER_DEFINED),
    ("</think>", TOKEN_TYPE_USER_DEFINED),
];

/// Every way building a vocabulary can fail.
#[derive(Debug, thiserror::Error)]
pub enum VocabError {
    #[error("training the built-in vocabulary failed: {message}")]
    Train { message: String },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: has no tokenizer.ggml.tokens: not a vocabulary")]
    NoVocabulary { path: PathBuf },
    #[error("{path}: {field}: {what}")]
    Unsupported {
        path: PathBuf,
        field: String,
        what: String,
    },
}

/// The built-in vocabulary's metadata entries. Trained once per process (about half a second
/// in release) and then cloned.
pub fn builtin_vocab() -> Result<VocabKv, VocabError> {
    static CACHE: OnceLock<Result<VocabKv, String>> = OnceLock::new();
    CACHE
        .get_or_init(|| train_builtin_vocab().map_err(|e| e.to_string()))
        .clone()
        .map_err(|message| VocabError::Train { message })
}

/// Train the built-in vocabulary from the corpus, every call (no cache): the determinism
/// test trains twice and compares.
pub fn train_builtin_vocab() -> Result<VocabKv, VocabError> {
    let n_trained = BUILTIN_VOCAB_SIZE - SPECIALS.len();
    let mut hf: tokenizers::TokenizerImpl<
        BPE,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        DecoderWrapper,
    > = tokenizers::TokenizerImpl::new(BPE::default());
    hf.with_pre_tokenizer(Some(pre_tokenizer_for("qwen2")?));
    hf.with_decoder(Some(DecoderWrapper::from(
        tokenizers::decoders::byte_level::ByteLevel::default(),
    )));
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(n_trained)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let train_err = |e: tokenizers::Error| VocabError::Train {
        message: e.to_string(),
    };
    hf.train(&mut trainer, CORPUS.iter().map(|(_, text)| *text))
        .map_err(train_err)?;

    // Read the trained model back as tokenizers serializes it: vocab and ranked merges.
    let model_json = serde_json::to_value(hf.get_model()).map_err(|e| VocabError::Train {
        message: format!("cannot serialize the trained model: {e}"),
    })?;
    let (mut tokens, merges) =
        bpe_from_json(&model_json).map_err(|what| VocabError::Train { message: what })?;
    if tokens.len() > n_trained {
        return Err(VocabError::Train {
            message: format!(
                "trainer produced {} tokens, asked for {n_trained}",
                tokens.len()
            ),
        });
    }
    let mut types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
    for (text, ty) in SPECIALS {
        tokens.push((*text).to_string());
        types.push(*ty);
    }
    let id_of = |text: &str| -> Result<u32, VocabError> {
        tokens
            .iter()
            .position(|t| t == text)
            .map(|p| p as u32)
            .ok_or_else(|| VocabError::Train {
                message: format!("special token {text} missing"),
            })
    };
    let endoftext = id_of("<|endoftext|>")?;
    let im_end = id_of("<|im_end|>")?;

    Ok(vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), Value::strings(&tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::strings(&merges)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(endoftext)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(im_end)),
        ("tokenizer.ggml.eot_token_id".into(), Value::U32(im_end)),
        (
            "tokenizer.ggml.padding_token_id".into(),
            Value::U32(endoftext),
        ),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(BUILTIN_CHAT_TEMPLATE.into()),
        ),
    ])
}

/// Tokens by id and merges as `"left right"` from a serialized `tokenizers` BPE model
/// (`{"vocab": {token: id}, "merges": [[l, r]] or ["l r"]}`). Ids must be `0..n` without gaps.
fn bpe_from_json(model: &serde_json::Value) -> Result<(Vec<String>, Vec<String>), String> {
    let vocab = model
        .get("vocab")
        .and_then(|v| v.as_object())
        .ok_or("model.vocab is missing or not an object")?;
    let mut tokens: Vec<Option<String>> = vec![None; vocab.len()];
    for (text, id) in vocab {
        let id =
            id.as_u64()
                .ok_or_else(|| format!("model.vocab[{text:?}] is not an id"))? as usize;
        let slot = tokens
            .get_mut(id)
            .ok_or_else(|| format!("model.vocab[{text:?}] = {id} leaves a gap in the ids"))?;
        if slot.is_some() {
            return Err(format!("model.vocab: id {id} is used twice"));
        }
        *slot = Some(text.clone());
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| t.ok_or_else(|| format!("model.vocab: id {id} is missing")))
        .collect::<Result<_, _>>()?;
    let merges = model
        .get("merges")
        .and_then(|v| v.as_array())
        .ok_or("model.merges is missing or not an array")?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if let Some(s) = m.as_str() {
                return Ok(s.to_string());
            }
            match m.as_array().map(|a| a.as_slice()) {
                Some([l, r]) => match (l.as_str(), r.as_str()) {
                    (Some(l), Some(r)) => Ok(format!("{l} {r}")),
                    _ => Err(format!("model.merges[{i}] is not a pair of strings")),
                },
                _ => Err(format!("model.merges[{i}] is not a pair of strings")),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((tokens, merges))
}

/// The vocabulary of an existing file: a GGUF (every `tokenizer.*` entry is copied, in file
/// order) or a Hugging Face `tokenizer.json` of a byte-level BPE (converted to the same
/// entries; `tokenizer_config.json` beside it supplies BOS/EOS, `add_bos_token` and the chat
/// template when present). The pre-tokenizer of a `tokenizer.json` is recognised by its split
/// regex; an unknown one is an error naming it.
pub fn vocab_from_file(path: impl AsRef<Path>) -> Result<VocabKv, VocabError> {
    let path = path.as_ref();
    let mut magic = [0u8; 4];
    let is_gguf = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .map(|_| &magic == b"GGUF")
        .unwrap_or(false);
    if is_gguf {
        let file = GgufFile::open(path)?;
        let kv: VocabKv = file
            .metadata()
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned()
            .collect();
        if !kv.iter().any(|(k, _)| k == "tokenizer.ggml.tokens") {
            return Err(VocabError::NoVocabulary {
                path: path.to_path_buf(),
            });
        }
        return Ok(kv);
    }
    vocab_from_tokenizer_json(path)
}

/// Hugging Face split regexes (as written in `tokenizer.json`) and the GGUF pre name for each.
const HF_PRE_PATTERNS: &[(&str, &str)] = &[
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen2",
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "llama-bpe",
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen35",
    ),
    (crate::tokenizer::QWEN2_RE, "qwen2"),
];

fn vocab_from_tokenizer_json(path: &Path) -> Result<VocabKv, VocabError> {
    let file_err = |message: String| VocabError::File {
        path: path.to_path_buf(),
        message,
    };
    let unsupported = |field: &str, what: String| VocabError::Unsupported {
        path: path.to_path_buf(),
        field: field.to_string(),
        what,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_err(e.to_string()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| file_err(format!("not JSON: {e}")))?;
    let model = json
        .get("model")
        .ok_or_else(|| unsupported("model", "missing".into()))?;
    let model_type = model.get("type").and_then(|t| t.as_str()).unwrap_or("BPE");
    if model_type != "BPE" {
        return Err(unsupported(
            "model.type",
            format!("{model_type:?}: only byte-level BPE converts to a gpt2 vocabulary"),
        ));
    }
    let pre =
        detect_pre(json.get("pre_tokenizer")).map_err(|what| unsupported("pre_tokenizer", what))?;
    let (mut tokens, merges) = bpe_from_json(model).map_err(|what| unsupported("model", what))?;
    let mut types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
    if let Some(added) = json.get("added_tokens").and_then(|a| a.as_array()) {
        for (i, tok) in added.iter().enumerate() {
            let field = format!("added_tokens[{i}]");
            let id = tok
                .get("id")
                .and_then(|v| v.as_u64())
                .ok_or_else(|| unsupported(&field, "no id".into()))? as usize;
            let content = tok
                .get("content")
                .and_then(|v| v.as_str())
                .ok_or_else(|| unsupported(&field, "no content".into()))?;
            let special = tok
                .get("special")
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
            if id > tokens.len() + added.len() {
                return Err(unsupported(
                    &field,
                    format!("id {id} is far past the vocabulary"),
                ));
            }
            while tokens.len() <= id {
                tokens.push(format!("[PAD{}]", tokens.len()));
                types.push(TOKEN_TYPE_USER_DEFINED);
            }
            tokens[id] = content.to_string();
            types[id] = if special {
                TOKEN_TYPE_CONTROL
            } else {
                TOKEN_TYPE_USER_DEFINED
            };
        }
    }

    let mut kv: VocabKv = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), Value::strings(&tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::strings(&merges)),
    ];

    let config_path = path.with_file_name("tokenizer_config.json");
    if let Ok(text) = std::fs::read_to_string(&config_path) {
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| VocabError::File {
                path: config_path.clone(),
                message: format!("not JSON: {e}"),
            })?;
        let id_of = |key: &str| -> Option<u32> {
            let v = config.get(key)?;
            let s = v.as_str().or_else(|| v.get("content")?.as_str())?;
            tokens.iter().position(|t| t == s).map(|p| p as u32)
        };
        if let Some(id) = id_of("bos_token") {
            kv.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(id)));
        }
        if let Some(id) = id_of("eos_token") {
            kv.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(id)));
        }
        if let Some(id) = id_of("pad_token") {
            kv.push(("tokenizer.ggml.padding_token_id".into(), Value::U32(id)));
        }
        if let Some(b) = config.get("add_bos_token").and_then(|v| v.as_bool()) {
            kv.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(b)));
        }
        if let Some(t) = config.get("chat_template").and_then(|v| v.as_str()) {
            kv.push(("tokenizer.chat_template".into(), Value::String(t.into())));
        }
    }
    Ok(kv)
}

/// The GGUF pre name of a `tokenizer.json` pre-tokenizer: a Split with a known regex followed
/// by ByteLevel, or a bare ByteLevel that uses GPT-2's regex.
fn detect_pre(pre: Option<&serde_json::Value>) -> Result<&'static str, String> {
    let pre = pre.ok_or("missing")?;
    let steps: Vec<&serde_json::Value> = match pre.get("type").and_then(|t| t.as_str()) {
        Some("Sequence") => pre
            .get("pretokenizers")
            .and_then(|p| p.as_array())
            .map(|a| a.iter().collect())
            .ok_or("Sequence without pretokenizers")?,
        Some(_) => vec![pre],
        None => return Err("no type".into()),
    };
    let mut pattern: Option<&str> = None;
    let mut byte_level_regex = false;
    let mut byte_level = false;
    for step in steps {
        match step.get("type").and_then(|t| t.as_str()) {
            Some("Split") => {
                let p = step
                    .get("pattern")
                    .and_then(|p| p.get("Regex").or_else(|| p.get("String")))
                    .and_then(|p| p.as_str())
                    .ok_or("Split without a pattern")?;
                if pattern.is_some() {
                    return Err("more than one Split: no GGUF pre name is known for it".into());
                }
                pattern = Some(p);
            }
            Some("ByteLevel") => {
                byte_level = true;
                byte_level_regex = step
                    .get("use_regex")
                    .and_then(|u| u.as_bool())
                    .unwrap_or(true);
            }
            Some(other) => return Err(format!("step {other:?} has no GGUF equivalent here")),
            None => return Err("a step without a type".into()),
        }
    }
    if !byte_level {
        return Err("no ByteLevel step: not a byte-level BPE".into());
    }
    match pattern {
        None if byte_level_regex => Ok("gpt-2"),
        None => Err("ByteLevel without a split regex".into()),
        Some(p) if !byte_level_regex => HF_PRE_PATTERNS
            .iter()
            .find(|(known, _)| *known == p)
            .map(|(_, name)| *name)
            .ok_or_else(|| format!("split regex {p:?} matches no known pre-tokenizer")),
        Some(_) => Err("Split followed by a ByteLevel that splits again".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detect_pre_recognises_hf_layouts() {
        let qwen = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": HF_PRE_PATTERNS[0].0}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
        ]});
        assert_eq!(detect_pre(Some(&qwen)), Ok("qwen2"));
        let gpt2 = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        assert_eq!(detect_pre(Some(&gpt2)), Ok("gpt-2"));
        let odd = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\d+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "use_regex": false}
        ]});
        let err = detect_pre(Some(&odd)).unwrap_err();
        assert!(err.contains("\\\\d+"), "{err}");
        let meta = serde_json::json!({"type": "Metaspace"});
        assert!(detect_pre(Some(&meta)).is_err());
    }

    #[test]
    fn bpe_from_json_rejects_gaps_and_accepts_both_merge_forms() {
        let ok = serde_json::json!({"vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]});
        let (t, m) = bpe_from_json(&ok).unwrap();
        assert_eq!(t, vec!["a", "b", "ab"]);
        assert_eq!(m, vec!["a b"]);
        let old = serde_json::json!({"vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]});
        assert_eq!(bpe_from_json(&old).unwrap().1, vec!["a b"]);
        let gap = serde_json::json!({"vocab": {"a": 0, "b": 5}, "merges": []});
        assert!(bpe_from_json(&gap).is_err());
    }
}
