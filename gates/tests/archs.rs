//! Every architecture the engine runs, held to the same promises as qwen3moe (issue 17), on
//! tiny files our `gen --arch` writes:
//!
//! - **parity** with llama.cpp (llama-cpp-python), teacher-forced logits position by position
//!   on ≥ 100 positions: our F32, F16 and Q8_0 files, the F32 file rewritten by the PyPI `gguf`
//!   writer, and llama.cpp's own quantizations (`llama-quantize` Q8_0 and Q4_K_M) of it, whose
//!   tensor types our `gen --type q4_k_m` must also match. Thresholds as `parity.rs`: F32 —
//!   top-1 at every position and cosine ≥ 0.9999; the others — top-1 (near-ties allowed) with
//!   cosine ≥ 0.999 on ≥ 98 % of positions. All llama.cpp work runs in two python processes.
//! - **byte identity** G1–G4 and G6 (`streaming.rs`): every lossless streaming setting gives the
//!   resident run's tokens and text.
//! - **replay**: `bmoe-sim replay` of the engine's route trace reproduces its hits, misses and
//!   bytes exactly, plain and with `--drop-cold-experts` and `--n-expert-used`, and the trace
//!   names the architecture's gating.

use bmoe_engine::gguf::GgufFile;
use bmoe_gates::{model, run, scratch_dir};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The architectures besides qwen3moe (whose own gates are `parity.rs`, `streaming.rs`,
/// `sim_engine.rs`), with the gating each records.
const ARCHS: &[(&str, &str)] = &[("qwen2moe", "softmax_topk")];

const PROMPT: &str = "Phileas Fogg rose, and the cache of experts answered: streaming is the plan for tonight. \
The router asks for eight experts at every layer; the ones already resident cost nothing, the others \
are read from flash while the attention of the next layer waits. Passepartout counted the reads, \
wrote them down in a small notebook, and found that the same experts came back again and again, \
as if the model had favourite words for every sentence it was asked to finish before the train left.";

const SHORT: &str = "The cache of experts keeps what the router asked for";

/// The tiny file of `arch` with weight types `ty` (expert FFN 512, so K-quants apply).
fn tiny(arch: &str, ty: &str) -> PathBuf {
    model(
        &format!("arch-{arch}-{ty}"),
        &[
            "--arch",
            arch,
            "--preset",
            "tiny",
            "--seed",
            "11",
            "--expert-ffn",
            "512",
            "--type",
            ty,
        ],
    )
}

fn python_ready() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import llama_cpp, gguf, numpy"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        if std::env::var("CI").map(|v| v == "true").unwrap_or(false) {
            panic!("CI=true but python3 with llama_cpp, gguf and numpy is missing (scripts/test.sh installs them)");
        }
        eprintln!("skipping llama.cpp parity: python3 with llama-cpp-python, gguf and numpy not installed (pip install -r scripts/requirements-test.txt)");
    }
    ok
}

fn script() -> PathBuf {
    bmoe_engine::testdata::project_root()
        .join("scripts")
        .join("llama_parity.py")
}

fn py_batch(dir: &Path, name: &str, jobs: &[serde_json::Value]) {
    let p = dir.join(format!("{name}.json"));
    std::fs::write(&p, serde_json::to_vec(jobs).unwrap()).unwrap();
    let o = Command::new("python3")
        .arg(script())
        .args(["batch", p.to_str().unwrap()])
        .output()
        .expect("run python3");
    assert!(
        o.status.success(),
        "llama_parity.py batch ({name}) failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Our teacher-forced logits of `m` into `out` (token ids beside it in `out.json`).
fn ours(m: &Path, out: &Path) {
    let r = run(
        m,
        &[
            "-p",
            PROMPT,
            "-n",
            "8",
            "--logits-out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, 0, "{}: {}", m.display(), r.stderr);
}

/// (positions, min cosine, strict top-1 agreement, fraction with top-1 up to a near-tie and
/// cosine ≥ 0.999) from `llama_parity.py compare`.
fn parity(json: &str, tag: &str) -> (usize, f64, f64, f64) {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    let cos: Vec<f64> = v["cos"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_f64().unwrap())
        .collect();
    let good = v["top1_tie"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&cos)
        .filter(|(t, c)| t.as_bool().unwrap() && **c >= 0.999)
        .count() as f64
        / cos.len().max(1) as f64;
    let p = (
        v["rows"].as_u64().unwrap() as usize,
        v["cos_min"].as_f64().unwrap(),
        v["top1_agree"].as_f64().unwrap(),
        good,
    );
    eprintln!(
        "parity {tag}: {} positions, cos_min {:.6}, strict top-1 agreement {:.1}%, top-1 (near-ties allowed) and cos >= 0.999 on {:.1}%",
        p.0,
        p.1,
        100.0 * p.2,
        100.0 * p.3
    );
    p
}

#[test]
fn every_architecture_matches_llama_cpp() {
    if !python_ready() {
        return;
    }
    let dir = scratch_dir("arch-parity");
    let mut failures = Vec::new();
    for (arch, _) in ARCHS {
        let f32_file = tiny(arch, "f32");
        // Other tools' files of the same weights: the gguf writer's copy, llama-quantize's.
        let rewritten = dir.join(format!("{arch}-gguf-py.gguf"));
        let theirs_q8 = dir.join(format!("{arch}-llama-quantize-q8_0.gguf"));
        let theirs_q4 = dir.join(format!("{arch}-llama-quantize-q4_k_m.gguf"));
        py_batch(
            &dir,
            &format!("{arch}-files"),
            &[
                serde_json::json!({"op": "rewrite", "args": [&f32_file, &rewritten]}),
                serde_json::json!({"op": "quantize", "args": [&f32_file, &theirs_q8, "q8_0"]}),
                serde_json::json!({"op": "quantize", "args": [&f32_file, &theirs_q4, "q4_k_m"]}),
            ],
        );
        // Our q4_k_m has llama-quantize's types, tensor by tensor.
        let ours_q4 = tiny(arch, "q4_k_m");
        let (t, m) = (
            GgufFile::open(&theirs_q4).unwrap(),
            GgufFile::open(&ours_q4).unwrap(),
        );
        assert_eq!(t.tensors().len(), m.tensors().len(), "{arch}");
        for ti in t.tensors() {
            let mi = m
                .tensor(&ti.name)
                .unwrap_or_else(|| panic!("{arch}: {}", ti.name));
            if mi.ty != ti.ty {
                failures.push(format!(
                    "{arch} q4_k_m: {} is {} in ours, {} from llama-quantize",
                    ti.name, mi.ty, ti.ty
                ));
            }
        }
        let files: Vec<(String, PathBuf, bool)> = vec![
            (format!("{arch} ours f32"), f32_file, true),
            (format!("{arch} ours f16"), tiny(arch, "f16"), false),
            (format!("{arch} ours q8_0"), tiny(arch, "q8_0"), false),
            (format!("{arch} ours q4_k_m"), ours_q4, false),
            (format!("{arch} gguf-py f32"), rewritten, true),
            (format!("{arch} llama-quantize q8_0"), theirs_q8, false),
            (format!("{arch} llama-quantize q4_k_m"), theirs_q4, false),
        ];
        let mut jobs = Vec::new();
        let mut results = Vec::new();
        for (i, (tag, file, exact)) in files.iter().enumerate() {
            let mine = dir.join(format!("{arch}-{i}.ours.f32"));
            ours(file, &mine);
            let ids = format!("{}.json", mine.display());
            let side: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&ids).unwrap()).unwrap();
            let n_vocab = side["n_vocab"].as_u64().unwrap().to_string();
            let reference = dir.join(format!("{arch}-{i}.ref.f32"));
            let result = dir.join(format!("{arch}-{i}.cmp.json"));
            jobs.push(serde_json::json!({"op": "logits", "args": [file, ids, &reference]}));
            jobs.push(serde_json::json!({"op": "compare", "out": &result,
                "args": [&mine, &reference, n_vocab]}));
            results.push((tag.clone(), result, *exact));
        }
        py_batch(&dir, &format!("{arch}-logits"), &jobs);
        for (tag, result, exact) in &results {
            let (rows, cos_min, top1, good) =
                parity(&std::fs::read_to_string(result).unwrap(), tag);
            if rows < 100 {
                failures.push(format!("{tag}: {rows} positions, fewer than 100"));
            } else if *exact && (top1 < 1.0 || cos_min < 0.9999) {
                failures.push(format!(
                    "{tag}: F32 needs top-1 at every position and cosine >= 0.9999: top-1 {:.1}%, cos min {cos_min:.6}",
                    100.0 * top1
                ));
            } else if good < 0.98 {
                failures.push(format!(
                    "{tag}: top-1 agreement with cosine >= 0.999 on {:.1}% of positions (cos min {cos_min:.6}), below 98%",
                    100.0 * good
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The resident run's tokens and text on the tiny Q8_0-expert file of `arch`.
fn resident(m: &Path) -> (Vec<u32>, String) {
    let r = run(m, &["-p", SHORT, "-n", "48"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("mode: mmap"), "{}", r.stderr);
    assert_eq!(r.outcome.tokens.len(), 48);
    (r.outcome.tokens, r.stdout)
}

#[test]
fn every_architecture_streams_byte_identical_to_resident() {
    for (arch, _) in ARCHS {
        let m = model(
            &format!("arch-{arch}-default"),
            &["--arch", arch, "--preset", "tiny", "--seed", "7"],
        );
        let (tokens, text) = resident(&m);
        // G1 cache off; G2 caches that evict every token, that hold some and that hold all;
        // G3 --load-all; G4 overlap on one and four lanes; G6 every dense mode.
        let settings: &[&[&str]] = &[
            &["--cache-mb", "0"],
            &["--cache-mb", "2", "--force-cache"],
            &["--cache-mb", "8", "--force-cache"],
            &["--cache-mb", "64", "--force-cache"],
            &["--cache-mb", "0", "--load-all"],
            &["--cache-mb", "0", "--overlap", "--io-threads", "1"],
            &[
                "--cache-mb",
                "2",
                "--force-cache",
                "--overlap",
                "--io-threads",
                "4",
            ],
            &[
                "--cache-mb",
                "8",
                "--force-cache",
                "--dense-weights",
                "mmap",
            ],
            &[
                "--cache-mb",
                "8",
                "--force-cache",
                "--dense-weights",
                "warm",
            ],
            &[
                "--cache-mb",
                "8",
                "--force-cache",
                "--dense-weights",
                "anon",
            ],
        ];
        for s in settings {
            let mut a = vec!["-p", SHORT, "-n", "48", "--moe-stream"];
            a.extend_from_slice(s);
            let r = run(&m, &a);
            assert_eq!(r.code, 0, "{arch} {s:?}: {}", r.stderr);
            assert!(
                r.stderr.contains("mode: expert streaming"),
                "{arch}: {}",
                r.stderr
            );
            assert_eq!(r.outcome.tokens, tokens, "{arch} {s:?}: token ids differ");
            assert_eq!(r.stdout, text, "{arch} {s:?}: text differs");
        }
    }
}

#[test]
fn every_architecture_replays_exactly_with_its_gating() {
    let dir = scratch_dir("arch-replay");
    for (arch, gating) in ARCHS.iter().chain(&[("qwen3moe", "softmax_topk_norm")]) {
        let m = model(
            &format!("arch-{arch}-default"),
            &["--arch", arch, "--preset", "tiny", "--seed", "7"],
        );
        for (tag, flags) in [
            ("plain", &["--cache-mb", "4", "--force-cache"][..]),
            (
                "drop",
                &[
                    "--cache-mb",
                    "4",
                    "--force-cache",
                    "--drop-cold-experts",
                    "1.0",
                ][..],
            ),
            (
                "topk",
                &[
                    "--cache-mb",
                    "4",
                    "--force-cache",
                    "--n-expert-used",
                    "2",
                    "--overlap",
                ][..],
            ),
        ] {
            let csv = dir.join(format!("{arch}-{tag}.csv"));
            let route = dir.join(format!("{arch}-{tag}.route.csv"));
            let mut a = vec!["-p", PROMPT, "-n", "24", "--moe-stream"];
            a.extend_from_slice(flags);
            a.extend(["--csv", csv.to_str().unwrap()]);
            a.extend(["--route-trace", route.to_str().unwrap()]);
            let r = run(&m, &a);
            assert_eq!(r.code, 0, "{arch} {tag}: {}", r.stderr);
            let trace = std::fs::read_to_string(&route).unwrap();
            let model_line = trace
                .lines()
                .find(|l| l.starts_with("# model="))
                .expect("model line");
            assert!(
                model_line.contains(&format!("arch={arch}"))
                    && model_line.contains(&format!("gating={gating}")),
                "{arch}: {model_line}"
            );
            let m = bmoe_gates::assert_session_replays_exactly(&csv, &route, flags);
            if tag == "drop" {
                let dropped: u64 = m
                    .summary()
                    .and_then(|s| s.get("experts_dropped"))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                assert!(
                    dropped > 0,
                    "{arch}: --drop-cold-experts 1.0 dropped nothing"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
