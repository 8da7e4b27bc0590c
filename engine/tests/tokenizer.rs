//! The tokenizer against llama.cpp's own test vectors: for every vocabulary-only GGUF in
//! `../shared/data/vocab` whose tokenizer this build reads (byte-level BPE `gpt2`,
//! SentencePiece-style `llama` and `gemma4`), every test string must encode to exactly the
//! expected ids and decode back to itself.

use bmoe_engine::gguf::GgufFile;
use bmoe_engine::testdata::shared_path;
use bmoe_engine::tokenizer::{StreamDecoder, Tokenizer};

const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// The test strings of a `.inp` file and the expected ids of the `.out` file beside it.
fn load_vectors(gguf: &std::path::Path) -> Vec<(String, Vec<u32>)> {
    let inp_path = format!("{}.inp", gguf.display());
    let out_path = format!("{}.out", gguf.display());
    let inp = std::fs::read_to_string(&inp_path).expect("read .inp");
    let out = std::fs::read_to_string(&out_path).expect("read .out");
    let mut strings: Vec<&str> = inp.split(SEPARATOR).collect();
    // The file ends with a separator, which leaves one empty piece after it.
    if inp.ends_with(SEPARATOR) {
        strings.pop();
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| t.parse::<u32>().expect("id"))
                .collect()
        })
        .collect();
    assert_eq!(
        strings.len(),
        ids.len(),
        "{inp_path}: {} strings but {} id lines",
        strings.len(),
        ids.len()
    );
    strings.into_iter().map(String::from).zip(ids).collect()
}

fn tokenizer_model(file: &GgufFile) -> Option<&str> {
    file.get("tokenizer.ggml.model").and_then(|v| v.as_str())
}

/// Every vocabulary of a tokenizer model in `models` must pass all its vectors; returns the
/// files checked.
fn check_vectors(models: &[&str]) -> Vec<std::path::PathBuf> {
    let Some(dir) = shared_path("data/vocab") else {
        return Vec::new();
    };
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .expect("read vocab dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    paths.sort();
    let mut checked = Vec::new();
    let mut failures = Vec::new();
    for path in &paths {
        let file = GgufFile::open(path).expect("open vocab gguf");
        if !tokenizer_model(&file).is_some_and(|m| models.contains(&m)) {
            continue;
        }
        let tok = Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let vectors = load_vectors(path);
        let mut n_ok = 0;
        for (text, expected) in &vectors {
            // llama.cpp's test tokenizes without BOS and without parsing special tokens.
            let got = tok.encode_with(text, false, false).expect("encode");
            let back = tok.decode(&got);
            if &got != expected {
                failures.push(format!(
                    "{}: {text:?}\n  expected {expected:?}\n  got      {got:?}",
                    path.display()
                ));
            } else if &back != text {
                failures.push(format!(
                    "{}: {text:?} decodes back as {back:?}",
                    path.display()
                ));
            } else {
                n_ok += 1;
            }
            // Streaming one id at a time gives the same text (with the SentencePiece space
            // prefix, which only a whole decode drops).
            let mut stream = StreamDecoder::new();
            let mut streamed = String::new();
            for &id in &got {
                streamed.push_str(&stream.push(&tok, id));
            }
            streamed.push_str(&stream.flush());
            let prefixed = tok.model_name() == "llama" && !text.is_empty();
            assert_eq!(
                streamed,
                if prefixed { format!(" {back}") } else { back },
                "{}: stream decode of {text:?}",
                path.display()
            );
        }
        eprintln!(
            "{}: model={} pre={} {n_ok}/{} vectors pass",
            path.file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default(),
            tok.model_name(),
            tok.pre(),
            vectors.len()
        );
        checked.push(path.clone());
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    checked
}

#[test]
fn every_bpe_vocab_matches_llama_cpp_vectors() {
    if shared_path("data/vocab").is_none() {
        return;
    }
    let checked = check_vectors(&["gpt2"]);
    assert!(!checked.is_empty(), "no gpt2-type vocabulary found");
}

#[test]
fn sentencepiece_vocabs_match_llama_cpp_vectors() {
    if shared_path("data/vocab").is_none() {
        return;
    }
    let checked = check_vectors(&["llama", "gemma4"]);
    let names: Vec<String> = checked
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    for want in ["ggml-vocab-llama-spm.gguf", "ggml-vocab-gemma-4.gguf"] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} not checked: {names:?}"
        );
    }
}

#[test]
fn qwen_special_ids_and_chatml_prompt() {
    let Some(path) = shared_path("data/vocab/ggml-vocab-qwen2.gguf") else {
        return;
    };
    let file = GgufFile::open(&path).expect("open");
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    assert_eq!(tok.n_vocab(), 151936);
    assert_eq!(tok.eos(), Some(151643));
    assert_eq!(tok.eot(), Some(151645), "<|im_end|> is Qwen's end of turn");
    assert!(tok.is_eog(151643) && tok.is_eog(151645) && !tok.is_eog(151644));
    assert!(!tok.add_bos());
    assert_eq!(tok.bos_text(), "<|endoftext|>");
    let prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    let ids = tok.encode(prompt, true).expect("encode");
    assert_eq!(ids.first(), Some(&151644));
    assert_eq!(ids.iter().filter(|&&i| i == 151645).count(), 1);
    assert_eq!(tok.decode(&ids), prompt);
    let plain = tok.encode(prompt, false).expect("encode");
    assert!(!plain.contains(&151644) && !plain.contains(&151645));
    assert_eq!(tok.decode(&plain), prompt);
}

#[test]
fn llama3_adds_bos_by_default() {
    let Some(path) = shared_path("data/vocab/ggml-vocab-llama-bpe.gguf") else {
        return;
    };
    let file = GgufFile::open(&path).expect("open");
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    assert!(
        tok.add_bos(),
        "llama-bpe prepends BOS unless the file says otherwise"
    );
    assert_eq!(tok.bos(), Some(128000));
    assert_eq!(tok.bos_text(), "<|begin_of_text|>");
    assert_eq!(tok.eos_text(), "<|end_of_text|>");
    assert_eq!(tok.eot(), Some(128009), "<|eot_id|>");
    let ids = tok.encode("Hello world", false).expect("encode");
    assert_eq!(ids, vec![128000, 9906, 1917]);
    let ids = tok
        .encode("<|start_header_id|>user<|end_header_id|>", true)
        .expect("encode");
    assert_eq!(ids[1], 128006);
}

mod builtin {
    use bmoe_engine::chat::{ChatTemplate, Message, ThinkCtl};
    use bmoe_engine::gguf::{GgufFile, GgufWriter};
    use bmoe_engine::tokenizer::{StreamDecoder, Tokenizer};
    use bmoe_engine::vocab::{builtin_vocab, train_builtin_vocab, vocab_from_file};

    const ENGLISH: &str = "The engineer opened the cabinet, checked the cables one by one, and \
        wrote in her notebook that the second machine had failed because its fan was blocked. \
        Tomorrow she will replace the filter, restart the service, and measure the temperature \
        again before lunch. \"Is it safe?\" asked the manager. \"Quite safe,\" she replied.\n";

    fn temp_path(name: &str) -> std::path::PathBuf {
        bmoe_engine::testdata::scratch_dir("tokenizer").join(name)
    }

    #[test]
    fn training_is_deterministic() {
        let started = std::time::Instant::now();
        let a = train_builtin_vocab().expect("train");
        eprintln!(
            "built-in vocab trained in {:.2} s",
            started.elapsed().as_secs_f64()
        );
        let b = train_builtin_vocab().expect("train");
        assert_eq!(a, b, "two trainings of the built-in vocabulary differ");
        // A digest to compare across processes (and machines): FNV-1a over tokens and merges.
        let mut digest: u64 = 0xcbf2_9ce4_8422_2325;
        for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"] {
            let items = a
                .iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| v.as_str_array())
                .expect("strings");
            for item in items {
                for b in item.bytes().chain([0u8]) {
                    digest = (digest ^ b as u64).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
        eprintln!("built-in vocab digest {digest:016x}");
        let tokens = a
            .iter()
            .find(|(k, _)| k == "tokenizer.ggml.tokens")
            .and_then(|(_, v)| v.as_str_array())
            .expect("tokens");
        assert_eq!(tokens.len(), 4096);
        assert_eq!(
            &tokens[4091..],
            &[
                "<|endoftext|>",
                "<|im_start|>",
                "<|im_end|>",
                "<think>",
                "</think>"
            ]
        );
    }

    #[test]
    fn builtin_vocab_through_a_gguf_file_tokenizes_english() {
        let kv = builtin_vocab().expect("builtin vocab");
        let path = temp_path("builtin-vocab.gguf");
        GgufWriter::write_file(&path, &kv, &[]).expect("write gguf");
        let file = GgufFile::open(&path).expect("open gguf");
        let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
        assert_eq!(tok.n_vocab(), 4096);
        assert_eq!(tok.pre(), "qwen2");
        assert!(!tok.add_bos());
        assert_eq!(tok.eos(), tok.token_id("<|im_end|>"));
        assert_eq!(tok.eot(), tok.token_id("<|im_end|>"));
        assert!(tok.is_eog(tok.token_id("<|im_end|>").expect("im_end")));

        let ids = tok.encode(ENGLISH, false).expect("encode");
        assert_eq!(tok.decode(&ids), ENGLISH);
        let words = ENGLISH.split_whitespace().count();
        let per_word = ids.len() as f64 / words as f64;
        eprintln!(
            "built-in vocab: {} tokens for {words} words = {per_word:.2} tokens/word, {:.2} bytes/token",
            ids.len(),
            ENGLISH.len() as f64 / ids.len() as f64
        );
        // A 4k BPE trained on a 19th-century novel, on modern English it never saw: common
        // words whole, rarer ones in two or three pieces. Raw bytes would be ~5.5 per word.
        assert!(per_word < 2.0, "{per_word:.2} tokens per word");

        let code =
            "fn main() {\n    let x: Vec<u32> = (0..10).collect();\n    println!(\"{x:?}\");\n}\n";
        let ids = tok.encode(code, false).expect("encode");
        assert_eq!(tok.decode(&ids), code);
        let odd = "Ünïcode ✓ 😀 日本語 tab\there\r\n";
        let ids = tok.encode(odd, false).expect("encode");
        let mut stream = StreamDecoder::new();
        let streamed: String = ids.iter().map(|&i| stream.push(&tok, i)).collect();
        assert_eq!(streamed, odd);

        // The chat template renders, and its specials tokenize whole.
        let template = file
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .expect("chat template");
        let chat = ChatTemplate::new(template, "<|endoftext|>", "<|im_end|>").expect("template");
        let prompt = chat
            .render(&[Message::new("user", "Hello there.")], true, Some(false))
            .expect("render");
        assert_eq!(
            prompt,
            "<|im_start|>user\nHello there.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        assert_eq!(chat.think_control(), ThinkCtl::Template);
        let ids = tok.encode(&prompt, true).expect("encode");
        for special in ["<|im_start|>", "<|im_end|>", "<think>", "</think>"] {
            let id = tok.token_id(special).expect("special id");
            assert!(ids.contains(&id), "{special} not matched whole");
        }
        assert_eq!(tok.decode(&ids), prompt);
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn vocab_from_gguf_copies_tokenizer_keys() {
        let kv = builtin_vocab().expect("builtin vocab");
        let path = temp_path("copy-source.gguf");
        let mut with_other = kv.clone();
        with_other.insert(
            0,
            (
                "general.architecture".to_string(),
                bmoe_engine::gguf::Value::String("qwen3moe".into()),
            ),
        );
        GgufWriter::write_file(&path, &with_other, &[]).expect("write");
        let copied = vocab_from_file(&path).expect("copy");
        assert_eq!(
            copied, kv,
            "all tokenizer.* keys, in order, and nothing else"
        );
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn vocab_from_real_gguf_builds_the_same_tokenizer() {
        let Some(path) = bmoe_engine::testdata::shared_path("data/vocab/ggml-vocab-qwen35.gguf")
        else {
            return;
        };
        let kv = vocab_from_file(&path).expect("copy");
        let from_kv = Tokenizer::from_metadata(&kv).expect("tokenizer from kv");
        let from_file = Tokenizer::from_gguf(&GgufFile::open(&path).expect("open")).expect("tok");
        let text = "Hello world, this is a test of 123 things.";
        assert_eq!(
            from_kv.encode(text, true).expect("encode"),
            from_file.encode(text, true).expect("encode")
        );
    }

    #[test]
    fn vocab_from_tokenizer_json_matches_the_gguf_vocab() {
        // Export the built-in vocabulary as a tokenizer.json and convert it back.
        let kv = builtin_vocab().expect("builtin vocab");
        let get = |k: &str| kv.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
        let tokens = get("tokenizer.ggml.tokens").expect("tokens");
        let tokens = tokens.as_str_array().expect("strings");
        let merges = get("tokenizer.ggml.merges").expect("merges");
        let merges = merges.as_str_array().expect("strings");
        let n_normal = tokens.len() - 5;
        let vocab: serde_json::Map<String, serde_json::Value> = tokens[..n_normal]
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), serde_json::json!(i)))
            .collect();
        let added: Vec<serde_json::Value> = tokens[n_normal..]
            .iter()
            .enumerate()
            .map(|(i, t)| {
                serde_json::json!({"id": n_normal + i, "content": t, "special": !t.contains("think"),
                    "single_word": false, "lstrip": false, "rstrip": false, "normalized": false})
            })
            .collect();
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
                 "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
            ]},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges}
        });
        let dir = temp_path("json-vocab");
        std::fs::create_dir_all(&dir).expect("dir");
        let json_path = dir.join("tokenizer.json");
        std::fs::write(&json_path, serde_json::to_string(&json).expect("json")).expect("write");
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"bos_token": null, "eos_token": "<|im_end|>", "add_bos_token": false}"#,
        )
        .expect("write config");

        let converted = vocab_from_file(&json_path).expect("convert");
        let conv = |k: &str| {
            converted
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(conv("tokenizer.ggml.pre"), get("tokenizer.ggml.pre"));
        assert_eq!(conv("tokenizer.ggml.tokens"), get("tokenizer.ggml.tokens"));
        assert_eq!(
            conv("tokenizer.ggml.token_type"),
            get("tokenizer.ggml.token_type")
        );
        assert_eq!(conv("tokenizer.ggml.merges"), get("tokenizer.ggml.merges"));
        assert_eq!(
            conv("tokenizer.ggml.eos_token_id"),
            get("tokenizer.ggml.eos_token_id")
        );

        // And the tokenizer.json itself loads and agrees with the GGUF-built tokenizer.
        let from_json = Tokenizer::from_json_file(&json_path).expect("from json");
        let from_kv = Tokenizer::from_metadata(&kv).expect("from kv");
        let text = "<|im_start|>user\nWho is Phileas Fogg?<|im_end|>\n<think>";
        assert_eq!(
            from_json.encode(text, true).expect("encode"),
            from_kv.encode(text, true).expect("encode")
        );
        assert_eq!(from_json.eos(), from_kv.eos());
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Special tokens, BOS and the space prefix of the SentencePiece-style vocabularies, with the
/// ids llama-cpp-python 0.3.36 gives (`Llama(vocab_only=True).tokenize(text, add_bos, special)`).
#[test]
fn sentencepiece_specials_match_llama_cpp() {
    let Some(gemma) = shared_path("data/vocab/ggml-vocab-gemma-4.gguf") else {
        return;
    };
    let tok = Tokenizer::from_gguf(&GgufFile::open(&gemma).expect("open")).expect("tokenizer");
    assert!(tok.add_bos());
    assert_eq!((tok.bos(), tok.eos()), (Some(2), Some(1)));
    assert_eq!(tok.eot(), Some(106), "<turn|> ends a gemma-4 turn");
    assert!(tok.is_eog(1) && tok.is_eog(106) && tok.is_eog(50));
    let chat = "<|turn>user\nHi there<turn|>\n<|turn>model\n";
    assert_eq!(
        tok.encode(chat, true).expect("encode"),
        [2, 105, 2364, 107, 10979, 993, 106, 107, 105, 4368, 107]
    );
    assert_eq!(
        tok.encode_with(chat, false, false).expect("encode"),
        [
            236820, 236909, 887, 236813, 2364, 107, 10979, 993, 236820, 887, 111038, 107, 236820,
            236909, 887, 236813, 4368, 107
        ]
    );
    // `<|"|>` is USER_DEFINED (always whole); `<|tool_response>` became CONTROL as an
    // end-of-generation marker, so it is whole only when specials are parsed.
    let tool = "<|tool_response>x <|\"|> y";
    assert_eq!(
        tok.encode(tool, true).expect("encode"),
        [2, 50, 236781, 236743, 52, 570]
    );
    assert_eq!(
        tok.encode_with(tool, false, false).expect("encode"),
        [236820, 236909, 13205, 236779, 6275, 236813, 236781, 236743, 52, 570]
    );
    assert_eq!(tok.encode(" lead", true).expect("encode"), [2, 2080]);

    let Some(spm) = shared_path("data/vocab/ggml-vocab-llama-spm.gguf") else {
        return;
    };
    let tok = Tokenizer::from_gguf(&GgufFile::open(&spm).expect("open")).expect("tokenizer");
    let inst = "<s>[INST] Hi [/INST]</s> ok";
    assert_eq!(
        tok.encode(inst, true).expect("encode"),
        [1, 1, 518, 25580, 29962, 6324, 518, 29914, 25580, 29962, 2, 29871, 3431]
    );
    assert_eq!(
        tok.encode_with(inst, false, false).expect("encode"),
        [
            529, 29879, 24566, 25580, 29962, 6324, 518, 29914, 25580, 29962, 829, 29879, 29958,
            3431
        ]
    );
    assert_eq!(tok.encode(" lead", true).expect("encode"), [1, 29871, 3275]);
    assert_eq!(
        tok.encode_with("a<unk>b", false, true).expect("encode"),
        [263, 0, 289]
    );
    assert_eq!(
        tok.encode_with("a<unk>b", false, false).expect("encode"),
        [263, 29966, 2960, 29958, 29890]
    );
    assert_eq!(tok.decode(&[29871, 3275]), " lead");
}
