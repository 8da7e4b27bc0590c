//! Every architecture the engine runs, held to the same promises as qwen3moe (issue 17), on
//! tiny files our `gen --arch` writes:
//!
//! - **parity** with llama.cpp (llama-cpp-python), teacher-forced logits position by position
//!   on ≥ 100 positions: our F32, F16 and Q8_0 files, the F32 file rewritten by the PyPI `gguf`
//!   writer, and llama.cpp's own quantizations (`llama-quantize` Q8_0 and Q4_K_M) of it, whose
//!   tensor types our `gen --type q4_k_m` must also match, each from three generator seeds.
//!   Thresholds as `parity.rs`: F32 — top-1 at every position and cosine ≥ 0.9999, on every
//!   seed; the others — top-1 (near-ties allowed) with cosine ≥ 0.999 on ≥ 98 % of the
//!   positions pooled over the seeds (see `SEEDS`). The llama.cpp work runs in a few python
//!   processes per architecture and seed.
//! - **parity on other tools' shapes** (issue 32), for the hybrid families qwen35moe and
//!   lfm2moe: F32 files the PyPI `gguf` writer makes in shapes unlike our presets
//!   (`scripts/gguf_write_hybrid.py`), and llama-quantize's F16, Q8_0, Q4_K_M and Q4_0 of them,
//!   to the same thresholds but for the kinds `CHAOTIC` and `SIGMOID_NEAR_TIES` name, whose
//!   lower bars say why.
//! - **byte identity** G1–G4 and G6 (`streaming.rs`): every lossless streaming setting gives the
//!   resident run's tokens and text.
//! - **replay**: `bmoe-sim replay` of the engine's route trace reproduces its hits, misses and
//!   bytes exactly, plain and with `--drop-cold-experts` and `--n-expert-used`, and the trace
//!   names the architecture's gating.

use bmoe_gates::llama::{ours, parity, py_batch, python_ready, type_mismatches, Parity, PROMPT};
use bmoe_gates::{model, run, scratch_dir};
use std::path::{Path, PathBuf};

/// The architectures besides qwen3moe (whose own gates are `parity.rs`, `streaming.rs`,
/// `sim_engine.rs`), with the gating each records.
const ARCHS: &[(&str, &str)] = &[
    ("qwen2moe", "softmax_topk"),
    ("gemma4", "softmax_topk_norm"),
    ("gpt-oss", "topk_softmax"),
    ("qwen35moe", "softmax_topk_norm"),
    ("lfm2moe", "sigmoid_topk_norm"),
    ("deepseek2", "softmax_topk"),
    ("llama", "softmax_topk_norm"),
    ("bailingmoe3", "sigmoid_topk_norm*2.5"),
    ("deepseek4", "sqrtsoftplus_topk_norm*1.5"),
];

/// [`ARCHS`], or those `BMOE_ARCHS` names (comma-separated: a developer's quicker run of one
/// family; CI runs them all).
fn archs() -> Vec<(&'static str, &'static str)> {
    let only = std::env::var("BMOE_ARCHS").unwrap_or_default();
    ARCHS
        .iter()
        .copied()
        .filter(|(a, _)| only.is_empty() || only.split(',').any(|o| o.trim() == *a))
        .collect()
}

/// lfm2moe's 4-bit files held to 97 % instead of 98 % (measured 2026-12-07, seeds 11-13
/// pooled: llama-quantize's Q4_K_M 97.8 %, Q4_0 98.0 % ours and theirs): every position off is
/// a single position at cos 0.990-0.998 whose router margin is under 6e-3 (its sigmoid scores
/// sit closer together than a softmax family's, so 4-bit rounding swaps a chosen expert at a
/// near-tie more often); its F32, F16, Q8_0 and our Q4_K_M hold 98 %. A wrong kernel or graph
/// moves every position.
///
/// bailingmoe3's llama-quantize Q4_K_M likewise (measured 2026-12-07, seeds 11-13 pooled:
/// 97.8 %; ours 99.6 %, Q8_0 99.1 %, F32/F16 100 %): each run of positions off starts at a
/// router margin of 5e-5 to 5e-3 (sigmoid scores, renormalised and × 2.5) and lasts a few
/// positions (52-56 on seed 13), the flipped expert's output carried on by the KDA layers'
/// state, where attention would dilute it.
///
/// deepseek4's quantized files held to 85 % (measured 2026-12-07, seeds 11-13 pooled: ours
/// Q8_0 93.7 %, Q4_K_M 90.9 %, llama-quantize's 93.7 % and 88.3 %; F32, F16 and the gguf-py
/// rewrite 99.8-100 %). Every tensor quantized alone keeps the file exact to 1 − cos < 5e-7;
/// quantized together, last-bit differences in attention's arithmetic land activations on
/// other Q8_0 levels and the four hyper-connection streams carry them on. llama.cpp agrees with
/// itself no better: its flash-attention path against its default one gives the same logits on
/// the F32 file (cosine 1.000000) and 70.2 %, 71.3 %, 74.3 % of positions on the Q8_0 files of
/// seeds 11-13, 68.3 % on seed 11's Q4_K_M.
const SIGMOID_NEAR_TIES: &[(&str, f64)] = &[
    ("lfm2moe llama-quantize q4_k_m", 0.97),
    ("lfm2moe ours q4_0", 0.97),
    ("lfm2moe llama-quantize q4_0", 0.97),
    ("bailingmoe3 llama-quantize q4_k_m", 0.97),
    ("deepseek4 ours q8_0", 0.85),
    ("deepseek4 ours q4_k_m", 0.85),
    ("deepseek4 llama-quantize q8_0", 0.85),
    ("deepseek4 llama-quantize q4_k_m", 0.85),
];

/// Further weight types an architecture's files come in, held to parity ours and
/// llama-quantize's (gpt-oss ships MXFP4 experts with Q8_0 elsewhere; the hybrids' issue asks
/// for Q4_0 too).
const EXTRA_TYPES: &[(&str, &str)] = &[
    ("gpt-oss", "mxfp4_moe"),
    ("qwen35moe", "q4_0"),
    ("lfm2moe", "q4_0"),
];

const SHORT: &str = "The cache of experts keeps what the router asked for";

/// The tiny file of `arch` with weight types `ty` (expert FFN 512, so K-quants apply),
/// generated with `seed`.
fn tiny(arch: &str, ty: &str, seed: u64) -> PathBuf {
    let seed = seed.to_string();
    model(
        &format!("arch-{arch}-{ty}-s{seed}"),
        &[
            "--arch",
            arch,
            "--preset",
            "tiny",
            "--seed",
            &seed,
            "--expert-ffn",
            "512",
            "--type",
            ty,
        ],
    )
}

/// The generator seeds of the parity files. A lossy file's positions off are pooled over all
/// of them: about 0.9 % of positions are off on average (routing flips that last-bit
/// differences tip, which reach later positions through attention; docs/models.md), so one
/// seed's 268 positions exceed the 98 % bar by chance a few per cent of the time, and which
/// seed does is luck. Lossless files are held to their bar on every seed.
const SEEDS: [u64; 3] = [11, 12, 13];

/// The parity files of `arch` generated with `seed`: ours in every type, the F32 file
/// rewritten by the gguf writer, llama-quantize's quantizations of it (and of the
/// architecture's extra types) — (kind, path, exact). Our Q4_K_M's tensor types are checked
/// against llama-quantize's on the way (into `failures`).
fn parity_files(
    arch: &str,
    seed: u64,
    dir: &Path,
    failures: &mut Vec<String>,
) -> Vec<(String, PathBuf, bool)> {
    let f32_file = tiny(arch, "f32", seed);
    // Other tools' files of the same weights: the gguf writer's copy, llama-quantize's.
    let rewritten = dir.join(format!("{arch}-s{seed}-gguf-py.gguf"));
    let theirs_q8 = dir.join(format!("{arch}-s{seed}-llama-quantize-q8_0.gguf"));
    let theirs_q4 = dir.join(format!("{arch}-s{seed}-llama-quantize-q4_k_m.gguf"));
    py_batch(
        dir,
        &format!("{arch}-s{seed}-files"),
        &[
            serde_json::json!({"op": "rewrite", "args": [&f32_file, &rewritten]}),
            serde_json::json!({"op": "quantize", "args": [&f32_file, &theirs_q8, "q8_0"]}),
            serde_json::json!({"op": "quantize", "args": [&f32_file, &theirs_q4, "q4_k_m"]}),
        ],
    );
    // Our q4_k_m has llama-quantize's types, tensor by tensor.
    let ours_q4 = tiny(arch, "q4_k_m", seed);
    failures.extend(type_mismatches(
        &theirs_q4,
        &ours_q4,
        &format!("{arch} q4_k_m (seed {seed})"),
    ));
    let mut files: Vec<(String, PathBuf, bool)> = vec![
        (format!("{arch} ours f32"), f32_file, true),
        (format!("{arch} ours f16"), tiny(arch, "f16", seed), false),
        (format!("{arch} ours q8_0"), tiny(arch, "q8_0", seed), false),
        (format!("{arch} ours q4_k_m"), ours_q4, false),
        (format!("{arch} gguf-py f32"), rewritten, true),
        (format!("{arch} llama-quantize q8_0"), theirs_q8, false),
        (format!("{arch} llama-quantize q4_k_m"), theirs_q4, false),
    ];
    for &(_, ty) in EXTRA_TYPES.iter().filter(|(a, _)| *a == arch) {
        let theirs = dir.join(format!("{arch}-s{seed}-llama-quantize-{ty}.gguf"));
        py_batch(
            dir,
            &format!("{arch}-s{seed}-{ty}-file"),
            &[serde_json::json!({"op": "quantize", "args": [&files[0].1, &theirs, ty]})],
        );
        files.push((format!("{arch} ours {ty}"), tiny(arch, ty, seed), false));
        files.push((format!("{arch} llama-quantize {ty}"), theirs, false));
    }
    files
}

/// Holds the parity files of `arch` (`files(seed, failures)` for each of `SEEDS`) to
/// llama.cpp's logits on the same files, into `failures`: an exact file on every seed, a lossy
/// one on ≥ 98 % of its positions pooled over the seeds (the module doc's thresholds), or on
/// the share `lower_bars` names for its kind.
fn hold_to_llama_cpp(
    arch: &str,
    dir: &Path,
    lower_bars: &[(&str, f64)],
    failures: &mut Vec<String>,
    mut files_of: impl FnMut(u64, &mut Vec<String>) -> Vec<(String, PathBuf, bool)>,
) {
    // Per file kind (its tag without the seed): positions, positions judged good, and
    // whether it must be exact.
    let mut pooled: Vec<(String, usize, f64, bool)> = Vec::new();
    for seed in SEEDS {
        let files = files_of(seed, failures);
        let mut jobs = Vec::new();
        let mut results = Vec::new();
        for (i, (kind, file, exact)) in files.iter().enumerate() {
            let stem = format!("{arch}-s{seed}-{i}");
            let mine = dir.join(format!("{stem}.ours.f32"));
            ours(file, &mine);
            let ids = format!("{}.json", mine.display());
            let side: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&ids).unwrap()).unwrap();
            let n_vocab = side["n_vocab"].as_u64().unwrap().to_string();
            let reference = dir.join(format!("{stem}.ref.f32"));
            let result = dir.join(format!("{stem}.cmp.json"));
            jobs.push(serde_json::json!({"op": "logits", "args": [file, ids, &reference]}));
            jobs.push(serde_json::json!({"op": "compare", "out": &result,
                "args": [&mine, &reference, n_vocab]}));
            results.push((kind.clone(), result, *exact));
        }
        py_batch(dir, &format!("{arch}-s{seed}-logits"), &jobs);
        // The seed's models and logits go once compared (their comparisons stay): a gate
        // over every family would hold several GB at once, and a full disk fails it.
        for (i, (_, file, _)) in files.iter().enumerate() {
            let stem = format!("{arch}-s{seed}-{i}");
            let _ = std::fs::remove_file(file);
            let _ = std::fs::remove_file(dir.join(format!("{stem}.ours.f32")));
            let _ = std::fs::remove_file(dir.join(format!("{stem}.ref.f32")));
        }
        for (kind, result, exact) in &results {
            let tag = format!("{kind} (seed {seed})");
            let Parity {
                rows,
                cos_min,
                top1,
                good,
            } = parity(&std::fs::read_to_string(result).unwrap(), &tag);
            if rows < 100 {
                failures.push(format!("{tag}: {rows} positions, fewer than 100"));
            } else if *exact && (top1 < 1.0 || cos_min < 0.9999) {
                failures.push(format!(
                    "{tag}: F32 needs top-1 at every position and cosine >= 0.9999: top-1 {:.1}%, cos min {cos_min:.6}",
                    100.0 * top1
                ));
            }
            match pooled.iter_mut().find(|p| &p.0 == kind) {
                Some(p) => {
                    p.1 += rows;
                    p.2 += good * rows as f64;
                }
                None => pooled.push((kind.clone(), rows, good * rows as f64, *exact)),
            }
        }
    }
    for (kind, rows, good, exact) in &pooled {
        let share = good / (*rows).max(1) as f64;
        eprintln!(
            "parity {kind}: {:.1}% of {rows} positions over seeds {SEEDS:?} good",
            100.0 * share
        );
        let bar = lower_bars
            .iter()
            .find(|(k, _)| k == kind)
            .map_or(0.98, |&(_, b)| b);
        if !exact && share < bar {
            failures.push(format!(
                "{kind}: top-1 agreement with cosine >= 0.999 on {:.1}% of {rows} positions over seeds {SEEDS:?}, below {:.0}%",
                100.0 * share,
                100.0 * bar
            ));
        }
    }
}

#[test]
fn every_architecture_matches_llama_cpp() {
    if !python_ready() {
        return;
    }
    let dir = scratch_dir("arch-parity");
    let mut failures = Vec::new();
    for (arch, _) in archs() {
        hold_to_llama_cpp(
            arch,
            &dir,
            SIGMOID_NEAR_TIES,
            &mut failures,
            |seed, failures| parity_files(arch, seed, &dir, failures),
        );
    }
    // On stdout as well: it survives a runner's cut of a long stderr.
    println!("{}", failures.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The families with the shape `llama_parity.py write` gives their gguf-py files
/// (`scripts/gguf_write_hybrid.py`: other widths, head counts and ratios, layer patterns,
/// expert counts and top-k, recurrent and latent dimensions, gating than `gen`'s presets).
const GGUF_PY_SHAPES: &[(&str, &str)] = &[
    ("qwen35moe", "wide"),
    ("lfm2moe", "wide"),
    ("deepseek2", "wide"),
    ("llama", "wide"),
    ("bailingmoe3", "wide"),
    ("deepseek4", "wide"),
];

/// llama.cpp's file types the gguf-py files are quantized to, besides the F32 original.
const GGUF_PY_TYPES: &[&str] = &["f16", "q8_0", "q4_k_m", "q4_0"];

/// The types of `arch`'s gguf-py file. bailingmoe3's is held in F32 and F16 only: its F32
/// matches llama.cpp to cosine 1.000000 and F16 on every position (seeds 11-13), but its
/// quantizations measure the chaos of its routing, not the graph (2026-12-07, pooled: Q8_0
/// 94.4 %, Q4_K_M 88.1 %, seeds ranging 79-100 %): every file is bit-exact or within
/// 1 − cos ≈ 2e-4 of llama.cpp until a position whose router margin is 1e-5 to 1e-4, after
/// which the flipped expert's output lives on in the KDA states (gate lower bound −3: slow
/// forgetting) for a run of positions. No shape we tried fixed it (router gain, 12 experts,
/// renormalised × 2.5, a query LoRA, lower bounds −5 and −7: 79-97 %). Its quantized kernels
/// are held on our tiny files instead (the archs table: 97.8-99.6 %).
///
/// deepseek4's is held in F32, F16 and Q8_0 (the last at 95 %, [`CHAOTIC`]): measured
/// 2026-12-07, seeds 11-13 pooled, F32 100 %, F16 99.6 %, Q8_0 96.0 %, Q4_K_M 71.1 %, Q4_0
/// 77.2 %. Each tensor kind quantized alone to Q4_K_M keeps seed 11 exact at its first
/// positions (cosine 1.000000); all of them together part from position 0 (1 − cos 6e-4) and
/// its four streams carry it on, and llama.cpp's flash-attention path agrees with its own
/// default one on 71.3 % of that Q4_K_M file's positions (cos_min 0.54). Its quantized
/// kernels are held on our tiny files instead (the archs table).
fn gguf_py_types(arch: &str) -> &'static [&'static str] {
    match arch {
        "bailingmoe3" => &["f16"],
        "deepseek4" => &["f16", "q8_0"],
        _ => GGUF_PY_TYPES,
    }
}

/// The gguf-py files held to 95 % instead of 98 % (docs/architectures.md, each family's
/// "Parity"; measured 2026-12-06, seeds 11-13 pooled): the bar sits under the agreement of
/// llama.cpp's own two CPU paths with each other on these files (below), which 98 % exceeds; a
/// wrong kernel or graph moves every position, far under either. qwen35moe Q4_K_M 96.5 %: the two engines' logits drift apart with the
/// position (1 − cos, averaged over 54 positions, from 1e-4 to 9e-4 on seed 11), through the
/// DeltaNet state and attention, until routing flips at margins of 1e-2 to 1e-1. lfm2moe
/// Q4_K_M 96.8 % and Q4_0 97.8 %: single positions at cos 0.97-0.99 with a router margin
/// under 6e-3 (sigmoid near-ties, as its tiny file's); its Q4_K_M seed 11 differs from
/// position 0 (1 − cos 2e-4) because the reference's `plain_kernels` runs llama.cpp's Q4_K
/// `vec_dot`, not the repacked gemv whose float order ours follows (we equal llama.cpp's default
/// path there bit for bit), amplified by Q8_K rounding ties in that file's half-filled
/// embedding. On all three files llama.cpp's two paths agree with each other no better than
/// with us (lfm2moe Q4_K_M 96.9 %, Q4_0 96.4 %, qwen35moe Q4_K_M 96.8 % pooled): the lfm2moe "gguf-py" paragraph of docs/architectures.md.
///
/// deepseek2's gguf-py file (sigmoid routing, renormalised and scaled by 1.8, over 12 experts
/// top-3; measured 2026-12-07, seeds 11-13 pooled): Q8_0 97.4 %, Q4_K_M 96.3 %, Q4_0 96.9 %,
/// every position off at a router margin of 1e-5 to 5e-3 (the median is ~5e-3), while its F32
/// and F16 agree to cosine 0.9999996; the engines part only where an activation lands on
/// another Q8_0 level (about one value in 20,000) next to such a tie. A softmax variant of the
/// same shape holds 98.4-99.1 %. llama.cpp's repacked path aborts on these files here, so its
/// self-agreement could not be measured.
///
/// deepseek4's gguf-py Q8_0 (96.0 % pooled, 2026-12-07): as its tiny files' ([`gguf_py_types`]
/// and `SIGMOID_NEAR_TIES` say why).
const CHAOTIC: &[(&str, f64)] = &[
    ("qwen35moe gguf-py wide llama-quantize q4_k_m", 0.95),
    ("lfm2moe gguf-py wide llama-quantize q4_k_m", 0.95),
    ("lfm2moe gguf-py wide llama-quantize q4_0", 0.95),
    ("deepseek2 gguf-py wide llama-quantize q8_0", 0.95),
    ("deepseek2 gguf-py wide llama-quantize q4_k_m", 0.95),
    ("deepseek2 gguf-py wide llama-quantize q4_0", 0.95),
    ("deepseek4 gguf-py wide llama-quantize q8_0", 0.95),
];

/// The gguf-py files of `arch` for `seed`: the F32 file the PyPI `gguf` writer makes with
/// shape `shape` and our tiny file's tokenizer, and llama-quantize's [`gguf_py_types`] of it —
/// (kind, path, exact).
fn gguf_py_files(arch: &str, shape: &str, seed: u64, dir: &Path) -> Vec<(String, PathBuf, bool)> {
    // Any of our files of the family has the tokenizer; the default one is the quickest made.
    let tokenizer = model(
        &format!("arch-{arch}-default"),
        &["--arch", arch, "--preset", "tiny", "--seed", "7"],
    );
    let f32_file = dir.join(format!("{arch}-{shape}-s{seed}-gguf-py.gguf"));
    let mut jobs = vec![serde_json::json!({"op": "write",
        "args": [arch, shape, &tokenizer, &f32_file, seed]})];
    let mut files = vec![(
        format!("{arch} gguf-py {shape} f32"),
        f32_file.clone(),
        true,
    )];
    for ty in gguf_py_types(arch) {
        let theirs = dir.join(format!("{arch}-{shape}-s{seed}-llama-quantize-{ty}.gguf"));
        jobs.push(serde_json::json!({"op": "quantize", "args": [&f32_file, &theirs, ty]}));
        files.push((
            format!("{arch} gguf-py {shape} llama-quantize {ty}"),
            theirs,
            false,
        ));
    }
    py_batch(dir, &format!("{arch}-{shape}-s{seed}-files"), &jobs);
    files
}

/// Issues 32's hybrids and 34's deepseek2 and llama MoE on files another tool wrote in shapes our generator
/// never makes: held to llama.cpp as the archs gate holds our files.
#[test]
fn files_written_by_gguf_py_match_llama_cpp() {
    if !python_ready() {
        return;
    }
    let dir = scratch_dir("arch-gguf-py");
    let mut failures = Vec::new();
    for &(arch, shape) in GGUF_PY_SHAPES
        .iter()
        .filter(|(a, _)| archs().iter().any(|(b, _)| a == b))
    {
        hold_to_llama_cpp(arch, &dir, CHAOTIC, &mut failures, |seed, _| {
            gguf_py_files(arch, shape, seed, &dir)
        });
    }
    // On stdout as well: it survives a runner's cut of a long stderr.
    println!("{}", failures.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The resident run's tokens and text on the tiny Q8_0-expert file of `arch`: 48 of them
/// whatever the model samples (`--ignore-eos`), so every setting decodes as many steps.
fn resident(m: &Path) -> (Vec<u32>, String) {
    let r = run(m, &["-p", SHORT, "-n", "48", "--ignore-eos"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("mode: mmap"), "{}", r.stderr);
    assert_eq!(r.outcome.tokens.len(), 48);
    (r.outcome.tokens, r.stdout)
}

#[test]
fn every_architecture_streams_byte_identical_to_resident() {
    for (arch, _) in archs() {
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
            let mut a = vec!["-p", SHORT, "-n", "48", "--ignore-eos", "--moe-stream"];
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
    for (arch, gating) in archs()
        .into_iter()
        .chain([("qwen3moe", "softmax_topk_norm")])
    {
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
