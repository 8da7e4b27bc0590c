//! The tokenizer against llama.cpp's own test vectors: for every vocabulary-only GGUF in
//! `../shared/data/vocab` whose tokenizer is byte-level BPE, every test string must encode to
//! exactly the expected ids and decode back to itself.

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

fn is_gpt2_vocab(file: &GgufFile) -> bool {
    file.get("tokenizer.ggml.model").and_then(|v| v.as_str()) == Some("gpt2")
}

#[test]
fn every_bpe_vocab_matches_llama_cpp_vectors() {
    let Some(dir) = shared_path("data/vocab") else {
        return;
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
        if !is_gpt2_vocab(&file) {
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
            // Streaming one id at a time gives the same text.
            let mut stream = StreamDecoder::new();
            let mut streamed = String::new();
            for &id in &got {
                streamed.push_str(&stream.push(&tok, id));
            }
            streamed.push_str(&stream.finish());
            assert_eq!(
                streamed,
                back,
                "{}: stream decode of {text:?}",
                path.display()
            );
        }
        eprintln!(
            "{}: pre={} {n_ok}/{} vectors pass",
            path.file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default(),
            tok.pre(),
            vectors.len()
        );
        checked.push(path.clone());
    }
    assert!(
        !checked.is_empty(),
        "no gpt2-type vocabulary found in {}",
        dir.display()
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
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
    assert_eq!(tok.eot(), Some(128009), "<|eot_id|>");
    let ids = tok.encode("Hello world", false).expect("encode");
    assert_eq!(ids, vec![128000, 9906, 1917]);
    let ids = tok
        .encode("<|start_header_id|>user<|end_header_id|>", true)
        .expect("encode");
    assert_eq!(ids[1], 128006);
}
