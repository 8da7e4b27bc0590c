//! `inspect` on generated files: the expert arithmetic, the tokenizer summary, the tensor
//! table, and the problems it must flag.

use super::common::*;
use bmoe_engine::gguf::{
    GgmlType, GgufFile, GgufSplitWriter, GgufWriter, TensorSpec, Value, ValueType,
};
use bmoe_engine::inspect::{analyze, inspect, inspect_json};

const N_EXPERT: u64 = 4;

/// qwen3moe-shaped: layer 0 dense, layers 1 and 2 MoE with 4 experts; layer 2's down
/// projection is F16 where layer 1's is Q8_0.
fn moe_model(expert_count: u64, used: Value) -> Model {
    let s = |n: &str, d: &[u64], t| TensorSpec::new(n, d, t);
    let mut tokens: Vec<String> = (0..10).map(|i| format!("t{i}")).collect();
    tokens[1] = "<s>".into();
    tokens[2] = "</s>".into();
    let meta = vec![
        (
            "general.architecture".to_string(),
            Value::String("qwen3moe".into()),
        ),
        ("qwen3moe.block_count".into(), Value::U32(3)),
        ("qwen3moe.embedding_length".into(), Value::U32(256)),
        ("qwen3moe.expert_feed_forward_length".into(), Value::U32(64)),
        (
            "qwen3moe.expert_count".into(),
            Value::U32(expert_count as u32),
        ),
        ("qwen3moe.expert_used_count".into(), used),
        ("qwen3moe.rope.freq_base".into(), Value::F32(1e6)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), Value::strings(&tokens)),
        (
            "tokenizer.ggml.merges".into(),
            Value::strings(["a b", "c d", "ab cd"]),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.padding_token_id".into(), Value::U32(99)),
        (
            "tokenizer.chat_template".into(),
            Value::String("{{ messages }}".into()),
        ),
    ];
    let specs = vec![
        s("token_embd.weight", &[256, 10], GgmlType::F32),
        s("blk.0.ffn_up.weight", &[256, 64], GgmlType::Q8_0),
        s("blk.1.ffn_gate_inp.weight", &[256, N_EXPERT], GgmlType::F32),
        s(
            "blk.1.ffn_gate_exps.weight",
            &[256, 64, N_EXPERT],
            GgmlType::Q4_K,
        ),
        s(
            "blk.1.ffn_up_exps.weight",
            &[256, 64, N_EXPERT],
            GgmlType::Q4_K,
        ),
        s(
            "blk.1.ffn_down_exps.weight",
            &[64, 256, N_EXPERT],
            GgmlType::Q8_0,
        ),
        s(
            "blk.2.ffn_down_exps.weight",
            &[64, 256, N_EXPERT],
            GgmlType::F16,
        ),
        s(
            "blk.2.ffn_up_exps.weight",
            &[256, 64, N_EXPERT],
            GgmlType::Q4_K,
        ),
        s(
            "blk.2.ffn_gate_exps.weight",
            &[256, 64, N_EXPERT],
            GgmlType::Q4_K,
        ),
        s("output_norm.weight", &[256], GgmlType::F32),
    ];
    let tensors = specs
        .into_iter()
        .map(|sp| {
            let n = sp.n_bytes().expect("valid") as usize;
            (sp, vec![7u8; n])
        })
        .collect();
    (meta, tensors)
}

// Per-expert bytes from block geometry: Q4_K rows of 256 are 144 bytes, Q8_0 rows of 64
// are 2 × 34, F16 rows of 64 are 128.
const GATE_UP: u64 = 144 * 64;
const DOWN_Q8: u64 = 2 * 34 * 256;
const DOWN_F16: u64 = 128 * 256;
const L1: u64 = 2 * GATE_UP + DOWN_Q8;
const L2: u64 = 2 * GATE_UP + DOWN_F16;
const DENSE: u64 = 256 * 10 * 4 + 8 * 34 * 64 + 256 * N_EXPERT * 4 + 256 * 4;

#[test]
fn expert_arithmetic() {
    let dir = scratch("inspect");
    let (meta, tensors) = moe_model(N_EXPERT, Value::U32(2));
    let path = dir.join("moe.gguf");
    GgufWriter::write_file(&path, &meta, &tensors).expect("write");
    let f = GgufFile::open(&path).expect("open");
    let r = analyze(&f);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.layers.len(), 2);
    let l1 = &r.layers[0];
    assert_eq!(
        (l1.layer, l1.n_expert, l1.n_expert_used),
        (1, N_EXPERT, Some(2))
    );
    let names: Vec<&str> = l1.projections.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["gate", "up", "down"]);
    let per: Vec<u64> = l1.projections.iter().map(|p| p.per_expert_bytes).collect();
    assert_eq!(per, [GATE_UP, GATE_UP, DOWN_Q8]);
    assert_eq!(l1.expert_bytes, L1);
    // Layer 2's tensors were written down, up, gate: still reported gate, up, down.
    let l2 = &r.layers[1];
    let names: Vec<&str> = l2.projections.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["gate", "up", "down"]);
    assert_eq!(l2.expert_bytes, L2);
    // Each projection's expert 0 starts where the tensor does.
    for p in l1.projections.iter().chain(&l2.projections) {
        let t = f.tensor(&p.tensor).expect("tensor");
        assert_eq!((p.shard, p.offset), (t.shard, t.offset));
        assert_eq!(p.per_expert_bytes * N_EXPERT, t.n_bytes);
        assert_eq!(p.row_bytes * p.rows_per_expert, p.per_expert_bytes);
    }
    assert_eq!(r.dense_bytes, DENSE);
    assert_eq!(r.expert_bytes_total, N_EXPERT * (L1 + L2));
    assert_eq!(r.cache_cycle_bytes, Some(2 * (L1 + L2)));
    assert_eq!(r.layer_demand, Some((2, 2 * L2)));
    let total: u64 = f.tensors().iter().map(|t| t.n_bytes).sum();
    assert_eq!(r.dense_bytes + r.expert_bytes_total, total);

    // Tokenizer summary.
    let t = &r.tokenizer;
    assert_eq!(
        (t.model.as_deref(), t.pre.as_deref()),
        (Some("gpt2"), Some("qwen2"))
    );
    assert_eq!((t.vocab_size, t.merges), (Some(10), Some(3)));
    assert_eq!(
        t.special,
        [
            ("bos".to_string(), 1, Some("<s>".to_string())),
            ("eos".to_string(), 2, Some("</s>".to_string())),
            ("padding".to_string(), 99, None),
        ]
    );
    assert_eq!(t.chat_template_bytes, Some(14));

    // The text report carries the same facts.
    let text = inspect(&f);
    for want in [
        "architecture: qwen3moe",
        "version:      3",
        "alignment:    32",
        "qwen3moe.expert_count = 4",
        "qwen3moe.rope.freq_base = 1000000",
        "vocab size:    10",
        "merges:        3",
        "bos token:     1 \"<s>\"",
        "padding token: 99 (outside the vocabulary)",
        "chat template: present (14 bytes)",
        &format!("gate Q4_K {GATE_UP} + up Q4_K {GATE_UP} + down Q8_0 {DOWN_Q8} = {L1} B"),
        &format!("dense (resident):     {DENSE} B"),
        &format!("cache_cycle (1 token worst case): {} B", 2 * (L1 + L2)),
        &format!("layer_demand (widest layer 2):  {} B", 2 * L2),
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("blk.2.ffn_down_exps.weight"))
        .expect("table row");
    let t2 = f.tensor("blk.2.ffn_down_exps.weight").expect("tensor");
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[1], "F16");
    assert_eq!(cols[2..5].join(" "), "[64, 256, 4]");
    assert_eq!(
        cols[5..],
        [
            t2.shard.to_string(),
            t2.offset.to_string(),
            t2.n_bytes.to_string()
        ]
    );
    assert!(!text.contains("problems:"));
    // The types section: every type once, with its tensor count; no unsupported type here.
    let types: Vec<&str> = text
        .lines()
        .skip_while(|l| *l != "types:")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .collect();
    let n_tensors: u64 = types
        .iter()
        .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(n_tensors as usize, f.tensors().len(), "{types:?}");
    assert!(
        types.iter().any(|l| l.trim_start().starts_with("Q4_K")),
        "{types:?}"
    );
    assert!(!text.contains("no kernel"), "{text}");

    // And so does the JSON.
    let j = inspect_json(&f);
    assert_eq!(j["architecture"], "qwen3moe");
    assert_eq!(j["file_bytes"].as_u64(), Some(f.file_bytes()));
    assert_eq!(j["dense_bytes"].as_u64(), Some(DENSE));
    assert_eq!(j["cache_cycle_bytes"].as_u64(), Some(2 * (L1 + L2)));
    assert_eq!(j["layer_demand_bytes"].as_u64(), Some(2 * L2));
    assert_eq!(j["layer_demand_layer"].as_u64(), Some(2));
    assert_eq!(
        j["moe_layers"][0]["projections"][2]["per_expert_bytes"].as_u64(),
        Some(DOWN_Q8)
    );
    assert_eq!(
        j["hyperparameters"]["qwen3moe.expert_used_count"].as_u64(),
        Some(2)
    );
    assert_eq!(j["tokenizer"]["special"]["eos"]["token"], "</s>");
    assert_eq!(j["tokenizer"]["chat_template"], true);
    assert_eq!(j["tensors"].as_array().map(|a| a.len()), Some(10));
    assert_eq!(j["tensors"][6]["shape"], serde_json::json!([64, 256, 4]));
    assert_eq!(j["problems"].as_array().map(|a| a.len()), Some(0));
    let bytes: u64 = j["types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(bytes, DENSE + N_EXPERT * (L1 + L2));
    assert!(j["types"]
        .as_array()
        .unwrap()
        .iter()
        .all(|u| u["kernel"] == true));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn per_layer_expert_used_count_and_split_shards() {
    let dir = scratch("inspect-split");
    let used = Value::Array(
        ValueType::U32,
        vec![Value::U32(0), Value::U32(1), Value::U32(3)],
    );
    let (meta, tensors) = moe_model(N_EXPERT, used);
    let paths = GgufSplitWriter::write_files(dir.join("moe"), &meta, &tensors, 4).expect("write");
    let f = GgufFile::open(&paths[0]).expect("open");
    let r = analyze(&f);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.cache_cycle_bytes, Some(L1 + 3 * L2));
    assert_eq!(r.layer_demand, Some((2, 3 * L2)));
    assert_eq!(r.shards.len(), 3);
    let text = inspect(&f);
    assert!(text.contains("shards:       3"), "{text}");
    assert!(text.contains("moe-00003-of-00003.gguf"), "{text}");
    let j = inspect_json(&f);
    assert_eq!(j["shards"].as_array().map(|a| a.len()), Some(3));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mismatches_are_reported() {
    let dir = scratch("inspect-bad");
    // The metadata claims 2 experts; the tensors stack 4 (which does split evenly into 2,
    // so the arithmetic goes on, flagged), and no experts-used count at all.
    let (mut meta, tensors) = moe_model(2, Value::U32(2));
    meta.retain(|(k, _)| k != "qwen3moe.expert_used_count");
    let path = dir.join("bad.gguf");
    GgufWriter::write_file(&path, &meta, &tensors).expect("write");
    let f = GgufFile::open(&path).expect("open");
    let r = analyze(&f);
    assert!(
        r.problems.iter().any(|p| p.contains(
            "blk.1.ffn_gate_exps.weight: outermost dimension 4 differs from expert_count 2"
        )),
        "{:?}",
        r.problems
    );
    assert!(
        r.problems.iter().any(|p| p.contains("expert_used_count")),
        "{:?}",
        r.problems
    );
    assert_eq!(r.cache_cycle_bytes, None);
    let text = inspect(&f);
    assert!(
        text.contains("problems:") && text.contains("cache_cycle: unknown"),
        "{text}"
    );
    // 3 experts claimed: 4 stacked slices do not split into 3.
    let (meta, tensors) = moe_model(3, Value::U32(2));
    GgufWriter::write_file(&path, &meta, &tensors).expect("write");
    let r = analyze(&GgufFile::open(&path).expect("open"));
    assert!(
        r.problems
            .iter()
            .any(|p| p.contains("do not split into 3 experts")),
        "{:?}",
        r.problems
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_dense_model_has_no_expert_section() {
    let f = GgufFile::from_bytes("dense.gguf", valid().bytes()).expect("valid");
    let r = analyze(&f);
    assert!(r.layers.is_empty());
    assert_eq!(r.dense_bytes, 64 + 68 + 288);
    assert_eq!(r.cache_cycle_bytes, None);
    let text = inspect(&f);
    assert!(
        !text.contains("experts:") && !text.contains("cache_cycle"),
        "{text}"
    );
    assert!(text.contains("architecture: qwen3moe"));
}
