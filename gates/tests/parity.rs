//! Parity with llama.cpp (issues 3, 16): teacher-forced logits on a fixed prompt, position by
//! position, on files we write (`bmoe-cli gen`, every `--type` preset) and on files other tools
//! wrote (the PyPI `gguf` writer; llama.cpp's own quantizer with each of its presets, on shapes
//! whose rows are and are not multiples of 256), through the PyPI `llama-cpp-python` package.
//!
//! Random-weight models are chaotic, so greedy text is not compared: logits are.
//! Thresholds (issue 3): F32 — top-1 agrees at every position, cosine ≥ 0.9999; quantized —
//! on ≥ 98 % of positions the top-1 agrees and the cosine is ≥ 0.999, where a disagreement on a
//! near-tie (the reference's own logits for the two tokens within 0.5 % of its logit range) is
//! not counted; strict top-1 agreement is printed beside it. Exact agreement is not
//! possible in general: llama.cpp's own one-token and batched paths disagree by as much on the
//! same file (a one-ulp difference crosses a Q8 rounding boundary and the model amplifies it),
//! so a chaotic flip at a position or two is the noise floor, not a defect.

use bmoe_gates::llama::{
    ours, parity, py_batch, py_batch_spawn, py_wait, python_ready, script, type_mismatches, Parity,
};
use bmoe_gates::{model, scratch_dir};
use std::path::{Path, PathBuf};
use std::process::Command;

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

fn n_vocab(ids_json: &Path) -> String {
    let side: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ids_json).unwrap()).unwrap();
    side["n_vocab"].as_u64().unwrap().to_string()
}

fn compare(m: &Path, tag: &str) -> Parity {
    let dir = scratch_dir("parity");
    let ours_path = dir.join(format!("{tag}.ours.f32"));
    ours(m, &ours_path);
    let ids = format!("{}.json", ours_path.display());
    let refp = dir.join(format!("{tag}.ref.f32"));
    py(&["logits", m.to_str().unwrap(), &ids, refp.to_str().unwrap()]);
    let nv = n_vocab(Path::new(&ids));
    let out = py(&[
        "compare",
        ours_path.to_str().unwrap(),
        refp.to_str().unwrap(),
        &nv,
    ]);
    parity(&out, tag)
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
fn gguf_py_rewritten_file_matches_llama_cpp() {
    if python_ready() {
        let src = gen("par-f32-src", "f32");
        let out = scratch_dir("parity").join("gguf-py.gguf");
        py(&["rewrite", src.to_str().unwrap(), out.to_str().unwrap()]);
        assert_f32(&compare(&out, "gguf-py-f32"));
    }
}

/// The presets `gen --type` writes with llama-quantize's per-tensor choices (issue 16), and F16.
const PRESETS: &[&str] = &[
    "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_0", "q4_1", "q4_k_s", "q4_k_m", "q5_0", "q5_1",
    "q5_k_s", "q5_k_m", "q6_k", "q8_0", "iq4_nl", "iq4_xs", "f16",
];

/// Two shapes: tiny with every row a multiple of 256 (so the 256-value types everywhere) and
/// tiny-odd with none (so every 256-value type replaced by its 32-value stand-in, as in
/// gpt-oss-like widths). Tiny as the other parity tests take it (expert FFN 512). (Fewer
/// experts or more layers make a random model more chaotic: with top-2 of 4 experts and 8
/// layers even F16 files flip top-1 on near-ties more often than the gate allows.)
const SHAPES: &[(&str, &[&str])] = &[
    ("tiny", &["--preset", "tiny", "--expert-ffn", "512"]),
    ("tiny-odd", &["--preset", "tiny-odd"]),
];

/// The presets with rules by layer (first sixteenth or eighth, first 2 or 4 `attn_v`, every
/// third layer), checked for types only on a 16-layer model where those rules differ.
const LAYER_PRESETS: &[&str] = &["q3_k_m", "q4_k_s", "q4_k_m", "q5_k_m", "iq4_xs"];

/// A 16-layer shape, small otherwise (2 experts of 256).
const DEEP: &[&str] = &[
    "--preset",
    "tiny",
    "--layers",
    "16",
    "--experts",
    "2",
    "--top-k",
    "1",
    "--expert-ffn",
    "256",
];

/// Every preset, on both shapes, from both quantizers: `llama-quantize` (llama.cpp's
/// `llama_model_quantize` on our F32 file) and our `gen --type`. Per file: llama.cpp and bmoe
/// agree on the logits (the quantized-file gate above), and our file has, tensor by tensor,
/// the types llama-quantize chose. All llama.cpp work runs in two python processes.
#[test]
fn every_preset_matches_llama_cpp_and_llama_quantize() {
    if !python_ready() {
        return;
    }
    let dir = scratch_dir("parity-presets");
    let t0 = std::time::Instant::now();
    let phase = |what: &str| {
        eprintln!(
            "parity presets: {what} after {:.1} s",
            t0.elapsed().as_secs_f64()
        )
    };
    let path = |s: &str| dir.join(s);
    // llama.cpp's quantizations of our F32 files, in one batch that runs while we write our
    // own files and compute their logits (the machine has 2 cores; each side uses about one).
    let gen_args = |base: &[&'static str], ty: &'static str| -> Vec<&'static str> {
        let mut a = base.to_vec();
        a.extend_from_slice(&["--seed", "11", "--type", ty]);
        a
    };
    let mut jobs = Vec::new();
    let mut sources = Vec::new();
    // (tag, llama-quantize's file, shape key, gen arguments of ours, in the logits gate)
    let mut planned = Vec::new();
    let shapes = SHAPES
        .iter()
        .map(|(shape, args)| (*shape, *args, PRESETS, true))
        .chain([("deep", DEEP, LAYER_PRESETS, false)]);
    for (shape, args, presets, logits) in shapes {
        let src = model(&format!("par-{shape}-f32"), &gen_args(args, "f32"));
        sources.push(src.clone());
        for preset in presets {
            let theirs = path(&format!("llama-quantize-{shape}-{preset}.gguf"));
            jobs.push(serde_json::json!({"op": "quantize",
                "args": [src.to_str().unwrap(), theirs.to_str().unwrap(), preset]}));
            planned.push((
                format!("{shape} {preset}"),
                theirs,
                shape,
                gen_args(args, preset),
                logits,
            ));
        }
    }
    let quantizer = py_batch_spawn(&dir, "quantize", &jobs);
    // Files in the logits gate: (tag, path); type checks on every pair.
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    let mut type_pairs: Vec<(String, PathBuf, PathBuf)> = Vec::new();
    for (tag, theirs, shape, args, logits) in planned {
        let preset = args.last().copied().unwrap_or_default();
        let mine = model(&format!("par-{shape}-{preset}"), &args);
        if logits {
            files.push((format!("llama-quantize {tag}"), theirs.clone()));
            files.push((format!("ours {tag}"), mine.clone()));
        }
        type_pairs.push((tag, theirs, mine));
    }
    phase("our files written");
    let mut ours_done = Vec::new();
    for (i, (tag, file)) in files.iter().enumerate() {
        if tag.starts_with("ours") {
            ours(file, &path(&format!("{i}.ours.f32")));
            ours_done.push(i);
        }
    }
    phase("our files' logits computed");
    py_wait(quantizer, "quantize");
    phase("llama-quantize files written");

    // Our types are llama-quantize's, tensor by tensor.
    let mut failures = Vec::new();
    for (tag, theirs, mine) in &type_pairs {
        failures.extend(type_mismatches(theirs, mine, tag));
    }

    // Logits: ours now, llama.cpp's and the comparisons in one batch.
    let mut jobs = Vec::new();
    let mut results = Vec::new();
    for (i, (tag, file)) in files.iter().enumerate() {
        let mine = path(&format!("{i}.ours.f32"));
        if !ours_done.contains(&i) {
            ours(file, &mine);
        }
        let ids = format!("{}.json", mine.display());
        let theirs = path(&format!("{i}.ref.f32"));
        let result = path(&format!("{i}.cmp.json"));
        jobs.push(serde_json::json!({"op": "logits",
            "args": [file.to_str().unwrap(), ids, theirs.to_str().unwrap()]}));
        jobs.push(
            serde_json::json!({"op": "compare", "out": result.to_str().unwrap(),
            "args": [mine.to_str().unwrap(), theirs.to_str().unwrap(), n_vocab(Path::new(&ids))]}),
        );
        results.push((tag.clone(), result));
    }
    phase("our logits of llama-quantize's files computed");
    py_batch(&dir, "logits", &jobs);
    phase("llama.cpp's logits computed");
    for (tag, result) in &results {
        let p = parity(&std::fs::read_to_string(result).unwrap(), tag);
        if p.rows < 100 || p.good < 0.98 {
            failures.push(format!(
                "{tag}: top-1 agreement with cosine >= 0.999 on {:.1}% of {} positions (cos min {:.6}), below 98%",
                100.0 * p.good,
                p.rows,
                p.cos_min
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Hundreds of MiB of models: keep them only when something failed.
    let _ = std::fs::remove_dir_all(&dir);
    for (_, theirs, mine) in &type_pairs {
        let _ = std::fs::remove_file(theirs);
        let _ = std::fs::remove_file(mine);
    }
    for src in &sources {
        let _ = std::fs::remove_file(src);
    }
}
