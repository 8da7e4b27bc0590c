//! Parity with llama.cpp (issue 3): teacher-forced logits on a fixed prompt, position by
//! position, on files we write (`bmoe-cli gen`) and on files other tools wrote (the PyPI
//! `gguf` writer; llama.cpp's own quantizer), through the PyPI `llama-cpp-python` package.
//!
//! Random-weight models are chaotic, so greedy text is not compared: logits are.
//! Thresholds (issue 3): F32 — top-1 agrees at every position, cosine ≥ 0.9999; quantized —
//! on ≥ 98 % of positions the top-1 agrees and the cosine is ≥ 0.999, where a disagreement on a
//! near-tie (the reference's own logits for the two tokens within 0.5 % of its logit range) is
//! not counted; strict top-1 agreement is printed beside it. Exact agreement is not
//! possible in general: llama.cpp's own one-token and batched paths disagree by as much on the
//! same file (a one-ulp difference crosses a Q8 rounding boundary and the model amplifies it),
//! so a chaotic flip at a position or two is the noise floor, not a defect.

use bmoe_gates::{model, run, scratch_dir};
use std::path::{Path, PathBuf};
use std::process::Command;

/// ~110 tokens of English, so that one chaotic top-1 flip costs under 1 % of the positions.
const PROMPT: &str = "Phileas Fogg rose, and the cache of experts answered: streaming is the plan for tonight. \
The router asks for eight experts at every layer; the ones already resident cost nothing, the others \
are read from flash while the attention of the next layer waits. Passepartout counted the reads, \
wrote them down in a small notebook, and found that the same experts came back again and again, \
as if the model had favourite words for every sentence it was asked to finish before the train left.";

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

fn py(args: &[&str]) -> String {
    let o = Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .expect("run python3");
    assert!(
        o.status.success(),
        "llama_parity.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

struct Parity {
    rows: usize,
    cos_min: f64,
    top1: f64,
    /// Fraction of positions where the top-1 agrees (up to a near-tie: the reference ranks our
    /// choice within 0.5 % of its logit range of its own best) and the cosine is ≥ 0.999.
    good: f64,
}

fn compare(m: &Path, tag: &str) -> Parity {
    let dir = scratch_dir("parity");
    let ours = dir.join(format!("{tag}.ours.f32"));
    let r = run(
        m,
        &[
            "-p",
            PROMPT,
            "-n",
            "8",
            "--logits-out",
            ours.to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let ids = format!("{}.json", ours.display());
    let refp = dir.join(format!("{tag}.ref.f32"));
    py(&["logits", m.to_str().unwrap(), &ids, refp.to_str().unwrap()]);
    let side: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ids).unwrap()).unwrap();
    let nv = side["n_vocab"].as_u64().unwrap().to_string();
    let out = py(&[
        "compare",
        ours.to_str().unwrap(),
        refp.to_str().unwrap(),
        &nv,
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let cos: Vec<f64> = v["cos"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_f64().unwrap())
        .collect();
    let top: Vec<bool> = v["top1_tie"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_bool().unwrap())
        .collect();
    let good = cos
        .iter()
        .zip(&top)
        .filter(|(c, t)| **t && **c >= 0.999)
        .count() as f64
        / cos.len().max(1) as f64;
    let p = Parity {
        rows: v["rows"].as_u64().unwrap() as usize,
        cos_min: v["cos_min"].as_f64().unwrap(),
        top1: v["top1_agree"].as_f64().unwrap(),
        good,
    };
    eprintln!(
        "parity {tag}: {} positions, cos_min {:.6}, strict top-1 agreement {:.1}%, top-1 (near-ties allowed) and cos >= 0.999 on {:.1}%",
        p.rows,
        p.cos_min,
        100.0 * p.top1,
        100.0 * p.good
    );
    p
}

fn gen(tag: &str, ty: &str) -> PathBuf {
    // Expert FFN 512 so K-quants apply to every expert projection.
    model(
        tag,
        &[
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

fn assert_f32(p: &Parity) {
    assert!(p.rows >= 100, "{} positions", p.rows);
    assert_eq!(p.top1, 1.0, "F32: top-1 must agree at every position");
    assert!(p.cos_min >= 0.9999, "F32: cosine {} < 0.9999", p.cos_min);
}

fn assert_quant(p: &Parity) {
    assert!(p.rows >= 100, "{} positions", p.rows);
    assert!(
        p.good >= 0.98,
        "top-1 agreement with cosine >= 0.999 on {:.1}% of positions, below 98%",
        100.0 * p.good
    );
}

#[test]
fn ours_f32_matches_llama_cpp() {
    if python_ready() {
        assert_f32(&compare(&gen("par-f32", "f32"), "f32"));
    }
}

#[test]
fn ours_f16_matches_llama_cpp() {
    if python_ready() {
        assert_quant(&compare(&gen("par-f16", "f16"), "f16"));
    }
}

#[test]
fn ours_q8_0_matches_llama_cpp() {
    if python_ready() {
        assert_quant(&compare(&gen("par-q8", "q8_0"), "q8_0"));
    }
}

#[test]
fn ours_q4_k_m_matches_llama_cpp() {
    if python_ready() {
        assert_quant(&compare(&gen("par-q4km", "q4_k_m"), "q4_k_m"));
    }
}

#[test]
fn gguf_py_rewritten_file_matches_llama_cpp() {
    if python_ready() {
        let src = gen("par-f32-src", "f32");
        let out = scratch_dir("parity").join("gguf-py.gguf");
        py(&["rewrite", src.to_str().unwrap(), out.to_str().unwrap()]);
        assert_f32(&compare(&out, "gguf-py-f32"));
    }
}

#[test]
fn llama_quantize_files_match_llama_cpp() {
    if python_ready() {
        let src = gen("par-f32-q", "f32");
        for ty in ["q8_0", "q4_k_m", "f16"] {
            let out = scratch_dir("parity").join(format!("llama-quantize-{ty}.gguf"));
            py(&["quantize", src.to_str().unwrap(), out.to_str().unwrap(), ty]);
            assert_quant(&compare(&out, &format!("llama-quantize-{ty}")));
        }
    }
}
