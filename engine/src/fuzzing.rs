//! Fuzz target bodies, their seed corpora and a deterministic mutator.
//!
//! Each target is a plain function over bytes, so the same body runs under libFuzzer
//! (`fuzz/fuzz_targets/*.rs`, `scripts/fuzz.sh TARGET SECONDS`, nightly) and under a normal
//! `cargo test` on stable (`engine/tests/fuzz.rs`: every seed plus thousands of seeded
//! mutations), so CI smoke-tests the targets without nightly or cargo-fuzz.
//!
//! A body returns normally for any input: a parse error is an answer, not a failure. It
//! panics only when a property breaks — a reader accepting something it then cannot stand
//! behind (a tensor outside its file, a trace our own writer writes back differently or not
//! readably), or a render that escapes its bounds. Seeds are made from real files: the
//! committed `traces/`, the reference traces and chat templates in `../shared`, and small
//! GGUF files written by our writer at run time (no model files are committed).

use crate::gguf::{GgmlType, GgufFile, GgufWriter, TensorSpec, Value, ValueType};
use bmoe_core::records::{IoRecord, RouteRecord};
use bmoe_core::telemetry::io_trace::{parse_io_trace, IoTraceWriter};
use bmoe_core::telemetry::route_trace::{RouteTrace, RouteTraceWriter};
use bmoe_core::telemetry::MetricsCsv;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::Path;

/// The fuzz targets, by the name `scripts/fuzz.sh` and `fuzz/` use.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Gguf,
    RouteTrace,
    IoTrace,
    MetricsCsv,
    ChatTemplate,
}

impl Target {
    pub const ALL: [Target; 5] = [
        Target::Gguf,
        Target::RouteTrace,
        Target::IoTrace,
        Target::MetricsCsv,
        Target::ChatTemplate,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::RouteTrace => "route_trace",
            Target::IoTrace => "io_trace",
            Target::MetricsCsv => "metrics_csv",
            Target::ChatTemplate => "chat_template",
        }
    }

    pub fn from_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Run the target's body on `data`.
    pub fn run(self, data: &[u8]) {
        match self {
            Target::Gguf => gguf(data),
            Target::RouteTrace => route_trace(data),
            Target::IoTrace => io_trace(data),
            Target::MetricsCsv => metrics_csv(data),
            Target::ChatTemplate => chat_template(data),
        }
    }
}

/// The GGUF reader: any bytes parse to a model or a typed error naming the file. A model it
/// accepts keeps every promise `GgufFile` documents, checked here independently of the
/// reader: each tensor's bytes are inside the file, whole rows, disjoint from every other
/// tensor, and `inspect` can describe it.
pub fn gguf(data: &[u8]) {
    let f = match GgufFile::from_bytes("fuzz.gguf", data.to_vec()) {
        Ok(f) => f,
        Err(e) => {
            assert!(
                e.to_string().starts_with("fuzz.gguf: "),
                "unnamed error: {e}"
            );
            return;
        }
    };
    let file_len = data.len() as u64;
    let mut spans: Vec<(u64, u64)> = Vec::with_capacity(f.tensors().len());
    for t in f.tensors() {
        assert_eq!(t.shard, 0);
        let end = t.offset.checked_add(t.n_bytes).expect("extent overflows");
        assert!(
            end <= file_len,
            "tensor {} ends at {end} > {file_len}",
            t.name
        );
        assert_eq!(t.offset % f.alignment(), 0, "tensor {} misaligned", t.name);
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
        assert_eq!(
            t.ty.row_bytes(t.dims[0]).map(|r| r * t.n_rows()),
            Some(t.n_bytes),
            "tensor {}: bytes are not whole rows",
            t.name
        );
        if let Some(n) = t.n_slices().filter(|&n| n > 0) {
            let last = t.slice_extent(n - 1).expect("last slice");
            assert!(last.offset + last.len <= end);
        }
        if t.n_bytes > 0 {
            spans.push((t.offset, end));
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "tensors overlap: {w:?}");
    }
    let _ = crate::inspect::inspect(&f);
    let _ = crate::inspect::inspect_json(&f);
}

fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

fn write_route_trace(t: &RouteTrace, records: &[RouteRecord]) -> String {
    let mut w = RouteTraceWriter::with_predictions(Vec::new(), &t.preamble, t.pred_columns())
        .expect("a parsed trace's preamble can be written");
    for r in records {
        w.write(r).expect("a parsed trace's record can be written");
    }
    String::from_utf8(w.finish().expect("in memory")).expect("the writer writes UTF-8")
}

/// The route trace reader against our writer: a trace the reader accepts is written back,
/// that text must be accepted too, and writing it again must give the same bytes (one
/// normalisation, e.g. weights to 6 decimals, then a fixed point).
pub fn route_trace(data: &[u8]) {
    let Some(text) = text(data) else { return };
    let Ok(first) = RouteTrace::parse(text) else {
        return;
    };
    let records: Vec<RouteRecord> = first.records().collect();
    assert_eq!(records.len(), first.n_rows());
    let written = write_route_trace(&first, &records);
    let second = RouteTrace::parse(&written)
        .unwrap_or_else(|e| panic!("our own rewrite of an accepted trace is refused: {e}"));
    let again: Vec<RouteRecord> = second.records().collect();
    assert_eq!(again.len(), records.len());
    assert_eq!(
        write_route_trace(&second, &again),
        written,
        "writing a trace is not a fixed point"
    );
}

/// The io trace reader against our writer: records read are written back and read again,
/// unchanged (every field is an integer).
pub fn io_trace(data: &[u8]) {
    let Some(text) = text(data) else { return };
    let Ok(records) = parse_io_trace(text) else {
        return;
    };
    let mut w = IoTraceWriter::new(Vec::new()).expect("in memory");
    for r in &records {
        w.write(r).expect("in memory");
    }
    let written = String::from_utf8(w.finish().expect("in memory")).expect("UTF-8");
    let back: Vec<IoRecord> = parse_io_trace(&written)
        .unwrap_or_else(|e| panic!("our own rewrite of an accepted io trace is refused: {e}"));
    assert_eq!(back, records, "io trace round trip");
}

/// The metrics CSV reader: an accepted file's accessors are consistent with each other.
pub fn metrics_csv(data: &[u8]) {
    let Some(text) = text(data) else { return };
    let Ok(m) = MetricsCsv::parse(text) else {
        return;
    };
    assert_eq!(m.rows.len(), m.row_lines.len());
    assert!(!m.columns.is_empty());
    for c in &m.columns {
        let v = m.column_values(c).expect("a header column has values");
        assert_eq!(v.len(), m.rows.len(), "column {c}");
    }
    let mut last = 0;
    for &l in &m.row_lines {
        assert!(l > last, "row lines increase");
        last = l;
    }
    if let Some(s) = m.summary() {
        for (k, _) in &s.0 {
            let _ = s.get_f64(k);
        }
    }
}

/// The chat-template renderer with whatever template the bytes hold: compile, then render a
/// short conversation three ways. Errors are answers; the body only requires that the
/// renderer returns (fuel and the recursion limit bound it) without panicking.
pub fn chat_template(data: &[u8]) {
    let Some(source) = text(data) else { return };
    let now = crate::chat::CivilTime {
        year: 2025,
        month: 3,
        day: 14,
        hour: 15,
        minute: 9,
        second: 26,
    };
    let Ok(t) = crate::chat::ChatTemplate::with_fixed_time(source, "<s>", "</s>", now) else {
        return;
    };
    let chat = [
        crate::chat::Message::new("system", "Be brief."),
        crate::chat::Message::new("user", "What is 17 * 3?"),
        crate::chat::Message::new("assistant", "51.").with_reasoning("17 + 17 + 17"),
        crate::chat::Message::new("user", "Thanks <ok> & done"),
    ];
    for (gen, think) in [(true, Some(true)), (true, Some(false)), (false, None)] {
        let _ = t.render(&chat, gen, think);
    }
}

/// Seed inputs for `target`: `(name, bytes)`. `project` is the repository root (for
/// `traces/`), `shared` the reference data beside it when present, `scratch` a directory the
/// GGUF seeds are written through (our writer writes files). Seeds are cut to at most
/// `MAX_SEED_BYTES` at a line boundary, so the fuzzer spends its time on variety.
pub fn seeds(
    target: Target,
    project: &Path,
    shared: Option<&Path>,
    scratch: &Path,
) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    match target {
        Target::Gguf => {
            for (name, meta, tensors) in gguf_seed_models() {
                let p = scratch.join(format!("{name}.gguf"));
                GgufWriter::write_file(&p, &meta, &tensors).map_err(std::io::Error::other)?;
                out.push((name.to_string(), std::fs::read(&p)?));
                std::fs::remove_file(&p)?;
            }
        }
        Target::RouteTrace | Target::IoTrace | Target::MetricsCsv => {
            let suffix = |n: &str| match target {
                Target::RouteTrace => n.ends_with(".route.csv"),
                Target::IoTrace => n.ends_with(".io.csv"),
                _ => n.ends_with(".csv") && !n.ends_with(".route.csv") && !n.ends_with(".io.csv"),
            };
            let mut dirs = vec![project.join("traces")];
            if let Some(s) = shared {
                dirs.push(s.join("traces"));
            }
            for d in dirs {
                let mut names: Vec<_> = std::fs::read_dir(&d)?
                    .filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(suffix))
                    .collect();
                names.sort();
                for p in names {
                    let bytes = std::fs::read(&p)?;
                    let name = p
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    // The file's head at two sizes, each cut back to the last line that
                    // leaves it readable (a route trace must end on a whole step).
                    for (tag, max) in [("", MAX_SEED_BYTES), ("-head", MAX_SEED_BYTES / 8)] {
                        let mut seed = cut_at_line(&bytes, max);
                        for _ in 0..2000 {
                            if accepts(target, &seed) {
                                break;
                            }
                            seed = drop_last_line(&seed);
                        }
                        if accepts(target, &seed) {
                            out.push((format!("{name}{tag}"), seed));
                        }
                    }
                }
            }
        }
        Target::ChatTemplate => {
            out.push((
                "bmoe-builtin".to_string(),
                crate::vocab::BUILTIN_CHAT_TEMPLATE.as_bytes().to_vec(),
            ));
            for (name, t) in HOSTILE_TEMPLATES {
                out.push((name.to_string(), t.as_bytes().to_vec()));
            }
            if let Some(s) = shared {
                let mut names: Vec<_> = std::fs::read_dir(s.join("data/templates"))?
                    .filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
                    .collect();
                names.sort();
                for p in names {
                    let name = p
                        .file_stem()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    out.push((name, std::fs::read(&p)?));
                }
            }
        }
    }
    Ok(out)
}

/// Largest seed: a whole route trace parses in well under a millisecond at this size.
pub const MAX_SEED_BYTES: usize = 16 << 10;

/// Templates written to hurt: unbounded loops and recursion, deep nesting.
pub const HOSTILE_TEMPLATES: &[(&str, &str)] = &[
    ("hostile-loop", "{% for i in range(387420489) %}{{ i }}{% endfor %}"),
    (
        "hostile-nested-loops",
        "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}.{% endfor %}{% endfor %}{% endfor %}",
    ),
    (
        "hostile-recursion",
        "{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 2) }}{% endmacro %}{{ f(0) }}",
    ),
    ("hostile-string", "{{ 'x' * 100000 }}{{ messages | tojson }}"),
    (
        "hostile-undefined-loops",
        "{% for m in messages %}{% for i in range(100000) %}{% for j in raffor %}{00) %}.{% endfor %}{% endfor %}{% endfor %}",
    ),
    ("hostile-nesting", "{% if a %}{% if b %}{% if c %}{% if d %}{{ ((((((((1)))))))) }}{% endif %}{% endif %}{% endif %}{% endif %}"),
];

/// Whether the reader of `target` accepts `bytes`.
fn accepts(target: Target, bytes: &[u8]) -> bool {
    let Some(t) = text(bytes) else { return false };
    match target {
        Target::RouteTrace => RouteTrace::parse(t).is_ok(),
        Target::IoTrace => parse_io_trace(t).is_ok(),
        Target::MetricsCsv => MetricsCsv::parse(t).is_ok(),
        Target::Gguf | Target::ChatTemplate => true,
    }
}

/// `bytes` without its last line.
fn drop_last_line(bytes: &[u8]) -> Vec<u8> {
    let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let end = body.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    bytes[..end].to_vec()
}

/// `bytes` cut after the last newline at or before `max` bytes (whole when shorter).
fn cut_at_line(bytes: &[u8], max: usize) -> Vec<u8> {
    if bytes.len() <= max {
        return bytes.to_vec();
    }
    let end = bytes[..max]
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(max, |i| i + 1);
    bytes[..end].to_vec()
}

type SeedModel = (
    &'static str,
    Vec<(String, Value)>,
    Vec<(TensorSpec, Vec<u8>)>,
);

/// Small models covering what the reader handles: every value type, nested arrays, several
/// tensor types, a stacked expert tensor, a non-default alignment, split keys, no tensors.
fn gguf_seed_models() -> Vec<SeedModel> {
    let bytes = |n: usize, salt: u8| -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
            .collect()
    };
    let tensor = |name: &str, dims: &[u64], ty: GgmlType, salt: u8| {
        let spec = TensorSpec::new(name.to_string(), dims, ty);
        let n = spec.n_bytes().unwrap_or(0) as usize;
        (spec, bytes(n, salt))
    };
    let s = |v: &str| Value::String(v.to_string());
    let rich_meta = vec![
        ("general.architecture".to_string(), s("qwen3moe")),
        ("general.name".to_string(), s("fuzz seed")),
        ("qwen3moe.block_count".to_string(), Value::U32(1)),
        ("qwen3moe.expert_count".to_string(), Value::U32(4)),
        ("qwen3moe.expert_used_count".to_string(), Value::U32(2)),
        ("t.u8".to_string(), Value::U8(7)),
        ("t.i8".to_string(), Value::I8(-7)),
        ("t.u16".to_string(), Value::U16(65_000)),
        ("t.i16".to_string(), Value::I16(-300)),
        ("t.i32".to_string(), Value::I32(-2)),
        ("t.f32".to_string(), Value::F32(0.5)),
        ("t.bool".to_string(), Value::Bool(true)),
        ("t.u64".to_string(), Value::U64(u64::MAX)),
        ("t.i64".to_string(), Value::I64(-1)),
        ("t.f64".to_string(), Value::F64(2.5)),
        (
            "tokenizer.ggml.tokens".to_string(),
            Value::strings(["<s>", "</s>", "a", "b", "ab"]),
        ),
        (
            "t.nested".to_string(),
            Value::Array(
                ValueType::Array,
                vec![
                    Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(2)]),
                    Value::Array(ValueType::I32, vec![]),
                ],
            ),
        ),
    ];
    let moe_tensors = vec![
        tensor("token_embd.weight", &[32, 5], GgmlType::F32, 1),
        tensor("blk.0.attn_norm.weight", &[32], GgmlType::F32, 2),
        tensor("blk.0.ffn_gate_inp.weight", &[32, 4], GgmlType::F16, 3),
        tensor("blk.0.ffn_gate_exps.weight", &[32, 8, 4], GgmlType::Q8_0, 4),
        tensor("blk.0.ffn_up_exps.weight", &[32, 8, 4], GgmlType::Q4_0, 5),
        tensor(
            "blk.0.ffn_down_exps.weight",
            &[256, 1, 4],
            GgmlType::Q4_K,
            6,
        ),
        tensor("output.weight", &[32, 5], GgmlType::BF16, 7),
    ];
    let mut aligned_meta = vec![
        ("general.architecture".to_string(), s("llama")),
        ("general.alignment".to_string(), Value::U32(64)),
    ];
    aligned_meta.push(("t.strs".to_string(), Value::strings(["x", "", "yz"])));
    let split_meta = vec![
        ("general.architecture".to_string(), s("qwen3moe")),
        ("split.no".to_string(), Value::U16(0)),
        ("split.count".to_string(), Value::U16(1)),
        ("split.tensors.count".to_string(), Value::I32(2)),
    ];
    vec![
        ("moe", rich_meta, moe_tensors),
        (
            "aligned64",
            aligned_meta,
            vec![
                tensor("a", &[256, 2], GgmlType::Q6_K, 8),
                tensor("b", &[256, 1, 2], GgmlType::Q5_K, 9),
            ],
        ),
        (
            "split1",
            split_meta,
            vec![
                tensor("a", &[8], GgmlType::F32, 10),
                tensor("b", &[32, 2], GgmlType::Q8_0, 11),
            ],
        ),
        (
            "empty",
            vec![("general.architecture".to_string(), s("x"))],
            Vec::new(),
        ),
    ]
}

/// One deterministic mutation of `input`, drawn from `rng`: byte flips, cuts, inserted or
/// duplicated bytes and lines, and numbers replaced by extremes — what libFuzzer does at
/// random, shaped for text formats and length-prefixed binaries alike.
pub fn mutate(input: &[u8], rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut b = input.to_vec();
    let rounds = 1 + rng.gen_range(0..3);
    for _ in 0..rounds {
        let n = b.len();
        match rng.gen_range(0..10) {
            0 if n > 0 => {
                let i = rng.gen_range(0..n);
                b[i] ^= 1 << rng.gen_range(0..8);
            }
            1 if n > 0 => {
                let i = rng.gen_range(0..n);
                b[i] = rng.gen();
            }
            2 => b.truncate(rng.gen_range(0..=n)),
            3 => {
                let at = rng.gen_range(0..=n);
                let len = rng.gen_range(1..16);
                let junk: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                b.splice(at..at, junk);
            }
            4 if n > 0 => {
                // Duplicate or delete a line.
                let lines: Vec<usize> = std::iter::once(0)
                    .chain(
                        b.iter()
                            .enumerate()
                            .filter(|(_, &c)| c == b'\n')
                            .map(|(i, _)| i + 1),
                    )
                    .filter(|&i| i < n)
                    .collect();
                let start = lines[rng.gen_range(0..lines.len())];
                let end = b[start..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(n, |i| start + i + 1);
                if rng.gen_bool(0.5) {
                    let line = b[start..end].to_vec();
                    b.splice(end..end, line);
                } else {
                    b.drain(start..end);
                }
            }
            5 if n > 0 => {
                // Replace a run of digits with an extreme number.
                let i = rng.gen_range(0..n);
                if let Some(s) = (i..n).find(|&j| b[j].is_ascii_digit()) {
                    let e = (s..n).find(|&j| !b[j].is_ascii_digit()).unwrap_or(n);
                    let extreme = [
                        "0",
                        "-1",
                        "4294967296",
                        "18446744073709551615",
                        "18446744073709551616",
                        "nan",
                        "inf",
                        "1e308",
                        "",
                        "65535",
                    ];
                    let v = extreme[rng.gen_range(0..extreme.len())].as_bytes();
                    b.splice(s..e, v.iter().copied());
                }
            }
            6 if n >= 8 => {
                // Overwrite 8 bytes with an extreme little-endian integer (binary lengths).
                let i = rng.gen_range(0..=n - 8);
                let v: u64 = [0, 1, u64::MAX, u64::MAX / 2, 1 << 32, 1 << 40, rng.gen()]
                    [rng.gen_range(0..7)];
                b[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            7 if n > 0 => {
                // Insert a delimiter the formats care about.
                let at = rng.gen_range(0..=n);
                let d: &[u8] = [
                    &b","[..],
                    b"\n",
                    b"#",
                    b"=",
                    b" ",
                    b"{{",
                    b"{%",
                    b"%}",
                    b"}}",
                    b"\r",
                ][rng.gen_range(0..10)];
                b.splice(at..at, d.iter().copied());
            }
            8 if n > 1 => {
                // Copy a chunk from one place to another.
                let s = rng.gen_range(0..n);
                let len = rng.gen_range(1..=(n - s).min(64));
                let chunk = b[s..s + len].to_vec();
                let at = rng.gen_range(0..=n);
                b.splice(at..at, chunk);
            }
            _ => {
                if n > 0 {
                    let i = rng.gen_range(0..n);
                    b.remove(i);
                }
            }
        }
    }
    b
}

/// `count` mutations of every seed, drawn from one seeded stream: the same inputs every run.
pub fn mutations(seeds: &[(String, Vec<u8>)], count: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    if seeds.is_empty() {
        return Vec::new();
    }
    (0..count)
        .map(|_| {
            let s = &seeds[rng.gen_range(0..seeds.len())].1;
            mutate(s, &mut rng)
        })
        .collect()
}
