//! The llama.cpp reference for the parity gates (`parity.rs`, `archs.rs`): the prompt,
//! whether python3 with llama-cpp-python is there, `scripts/llama_parity.py` batches, our
//! teacher-forced logits, and the gate's numbers from a comparison.

use crate::run;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// ~250 tokens of English. A random-weight model's routing sits at a near-tie at a few
/// isolated positions, where one engine's last-bit rounding picks another expert: over the 68
/// files of the presets gate 0.19 % of positions (18 of 9,248), each alone, cos ≥ 0.997. With
/// ~130 positions a file fails the 98 % bar at 3 such positions, which that rate gives some
/// file in ~16 % of runs (it happened). With this prompt (268 positions) the bar needs 6;
/// measured over the 94 files of the parity and archs gates: 0.25 % of positions, at most 4
/// in one file — chance alone fails ~1 % of runs. A wrong kernel moves every position.
pub const PROMPT: &str = "Phileas Fogg rose, and the cache of experts answered: streaming is the plan for tonight. \
The router asks for eight experts at every layer; the ones already resident cost nothing, the others \
are read from flash while the attention of the next layer waits. Passepartout counted the reads, \
wrote them down in a small notebook, and found that the same experts came back again and again, \
as if the model had favourite words for every sentence it was asked to finish before the train left. \
At Suez the consul looked at the notebook and asked why a machine should need to remember anything \
at all. Because memory is small and the book is large, said Passepartout, and because reading a page \
twice costs as much as reading it once; so the clever traveller keeps the pages he will want again \
and lets the others go. The consul shrugged, stamped the passport, and wrote in his own ledger that \
the gentleman and his servant had arrived on time, to the minute, which nobody in the office believed.";

/// Whether python3 with llama_cpp, gguf and numpy is installed: false skips the gate with a
/// message, except under `CI=true`, where it panics.
pub fn python_ready() -> bool {
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

/// `scripts/llama_parity.py`.
pub fn script() -> PathBuf {
    bmoe_engine::testdata::project_root()
        .join("scripts")
        .join("llama_parity.py")
}

/// Runs `llama_parity.py batch` on `jobs` (written to `DIR/NAME.json`).
pub fn py_batch(dir: &Path, name: &str, jobs: &[serde_json::Value]) {
    py_wait(py_batch_spawn(dir, name, jobs), name);
}

/// Starts `llama_parity.py batch` on `jobs` without waiting.
pub fn py_batch_spawn(dir: &Path, name: &str, jobs: &[serde_json::Value]) -> Child {
    let p = dir.join(format!("{name}.json"));
    std::fs::write(&p, serde_json::to_vec(jobs).unwrap()).unwrap();
    Command::new("python3")
        .arg(script())
        .args(["batch", p.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3")
}

/// Waits for a batch started by [`py_batch_spawn`]; its failure fails the test.
pub fn py_wait(child: Child, what: &str) {
    let o = child.wait_with_output().expect("wait for python3");
    if !o.status.success() {
        // On stdout too: a runner that shows a failing test's stderr cut in the middle still
        // shows why (the stderr of a long parity test is mostly its figures).
        let err = String::from_utf8_lossy(&o.stderr);
        let tail: Vec<&str> = err.lines().rev().take(20).collect();
        println!(
            "llama_parity.py batch ({what}) failed ({}):\n{}",
            o.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
        panic!(
            "llama_parity.py batch ({what}) failed ({}):\n{err}",
            o.status
        );
    }
}

/// Our teacher-forced logits for `m` over [`PROMPT`] into `out`, the token ids beside them
/// (`out.json`).
pub fn ours(m: &Path, out: &Path) {
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

/// The gate's numbers for one file.
pub struct Parity {
    pub rows: usize,
    pub cos_min: f64,
    /// Strict top-1 agreement.
    pub top1: f64,
    /// Fraction of positions where the top-1 agrees (up to a near-tie: the reference ranks our
    /// choice within 0.5 % of its logit range of its own best) and the cosine is ≥ 0.999.
    pub good: f64,
}

/// The gate's numbers from `llama_parity.py compare` JSON, printed under `tag`.
pub fn parity(json: &str, tag: &str) -> Parity {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    let cos: Vec<f64> = v["cos"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_f64().unwrap())
        .collect();
    // Per position: top-1 agrees (up to a near-tie) and the cosine is >= 0.999.
    let ok: Vec<bool> = v["top1_tie"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&cos)
        .map(|(t, c)| t.as_bool().unwrap() && *c >= 0.999)
        .collect();
    let good = ok.iter().filter(|&&g| g).count() as f64 / cos.len().max(1) as f64;
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
    // Each position off, with how close our routing came to a tie there (bmoe's router margin
    // from the `--logits-out` sidecar, logit units; `compare` passes it through): a routing
    // flip on a near-tie and a kernel error look alike in the logits, not in the margin.
    let margins = v["router_margin"].as_array();
    let off: Vec<String> = ok
        .iter()
        .zip(&cos)
        .enumerate()
        .filter(|(_, (g, _))| !**g)
        .map(|(i, (_, c))| {
            let m = margins
                .and_then(|m| m.get(i))
                .and_then(|m| m.as_f64())
                .map_or("-".to_string(), |m| format!("{m:.2e}"));
            format!("{i} (cos {c:.4}, router margin {m})")
        })
        .collect();
    if !off.is_empty() {
        let min_margin = margins
            .map(|m| {
                m.iter()
                    .filter_map(|x| x.as_f64())
                    .fold(f64::INFINITY, f64::min)
            })
            .unwrap_or(f64::NAN);
        eprintln!(
            "parity {tag}: positions off: {}; smallest router margin over all positions {min_margin:.2e}",
            off.join(", ")
        );
    }
    p
}

/// Where our file `mine` and llama-quantize's `theirs` of the same weights give a tensor
/// different types, one line each, named by `tag` (empty: the same types throughout). Both
/// must list the same tensors.
pub fn type_mismatches(theirs: &Path, mine: &Path, tag: &str) -> Vec<String> {
    let (t, m) = (
        bmoe_engine::gguf::GgufFile::open(theirs).unwrap(),
        bmoe_engine::gguf::GgufFile::open(mine).unwrap(),
    );
    assert_eq!(t.tensors().len(), m.tensors().len(), "{tag}");
    t.tensors()
        .iter()
        .filter_map(|ti| {
            let mi = m
                .tensor(&ti.name)
                .unwrap_or_else(|| panic!("{tag}: {}", ti.name));
            (mi.ty != ti.ty).then(|| {
                format!(
                    "{tag}: {} is {} in ours, {} from llama-quantize",
                    ti.name, mi.ty, ti.ty
                )
            })
        })
        .collect()
}
