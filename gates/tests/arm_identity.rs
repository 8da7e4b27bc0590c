//! Cross-architecture identity (issue 31): the static aarch64 phone binary, run under
//! `qemu-aarch64-static` (bit-exact emulation), writes byte for byte the logits, token ids,
//! router margins and text this x86-64 build writes, for every architecture (the hybrids
//! qwen35moe and lfm2moe with their recurrent states too) in F16, Q8_0,
//! Q4_K_M and its preset's types resident, Q4_K_M also streamed (an evicting cache, serial
//! and overlapped), and resident in every other weight type the kernels take.
//!
//! Why it can hold: every SIMD level of both architectures gives the scalar kernels' bits
//! (the per-level tests in `engine/src/kernels`, run under qemu in CI too), and the forward
//! pass's transcendental functions are the same code on every target. A difference here is a
//! bug in one of the two builds; the per-level kernel tests say which kernel.
//!
//! The binary is `target/aarch64-unknown-linux-musl/release/bmoe-cli` (or `BMOE_ARM_CLI`),
//! built by `scripts/build-phone.sh`, which `scripts/test.sh` runs when the ARM tools are
//! installed (`scripts/arm.sh`). Without the binary or qemu the gate skips with a message, and
//! fails under `CI=true`. A binary older than the sources fails: it would compare another tree.

use bmoe_engine::testdata::project_root;
use bmoe_gates::{model, run, scratch_dir};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A prompt long enough that the prefill's experts see batches wide enough for the lanes
/// (prefill) kernels, then 16 generated tokens.
const PROMPT: &str = "The cache of experts keeps what the router asked for, and the flash \
    behind it serves the rest: a phone reads each token's experts as the layer needs them, \
    while the dense weights stay in memory the whole time.";
const N: &str = "16";

/// The emulator, with the binary it runs; `None` (after saying why) when either is missing
/// and this is not CI.
fn arm_cli() -> Option<PathBuf> {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let bin = std::env::var_os("BMOE_ARM_CLI")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            project_root().join("target/aarch64-unknown-linux-musl/release/bmoe-cli")
        });
    let qemu_ok = Command::new("qemu-aarch64-static")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let missing = match (bin.exists(), qemu_ok) {
        (true, true) => None,
        (false, _) => Some(format!(
            "no aarch64 binary at {} (scripts/build-phone.sh builds it)",
            bin.display()
        )),
        (_, false) => Some("no qemu-aarch64-static (scripts/arm.sh installs it)".to_string()),
    };
    if let Some(why) = missing {
        assert!(
            !ci,
            "CI=true: the cross-architecture gate cannot run: {why}"
        );
        eprintln!("skipping the cross-architecture gate: {why}");
        return None;
    }
    assert_fresh(&bin);
    Some(bin)
}

/// Fails when a source file of the engine or the core is newer than the binary.
fn assert_fresh(bin: &Path) {
    let built = std::fs::metadata(bin)
        .and_then(|m| m.modified())
        .expect("binary mtime");
    let mut stack = vec![
        project_root().join("engine/src"),
        project_root().join("shared/src"),
    ];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("read source dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let m = e.metadata().and_then(|m| m.modified()).expect("mtime");
                assert!(
                    m <= built,
                    "{} is newer than the aarch64 binary {}: rebuild it (scripts/build-phone.sh)",
                    p.display(),
                    bin.display()
                );
            }
        }
    }
}

/// The tiny file of `arch` in weight types `ty` (expert FFN 512, so the K-quants apply to the
/// experts; `None`: the preset's own types).
fn tiny(arch: &str, ty: Option<&str>) -> PathBuf {
    let mut args = vec![
        "--arch",
        arch,
        "--preset",
        "tiny",
        "--seed",
        "31",
        "--expert-ffn",
        "512",
    ];
    if let Some(t) = ty {
        args.extend_from_slice(&["--type", t]);
    }
    model(&format!("arm-{arch}-{}", ty.unwrap_or("preset")), &args)
}

/// What a run leaves: the logits bytes, their JSON (token ids, router margins), the text.
#[derive(PartialEq, Eq)]
struct Output {
    logits: Vec<u8>,
    json: String,
    text: String,
}

fn read_output(logits: &Path, text: String) -> Output {
    let json_path = PathBuf::from(format!("{}.json", logits.display()));
    Output {
        logits: std::fs::read(logits).unwrap_or_else(|e| panic!("{}: {e}", logits.display())),
        json: std::fs::read_to_string(&json_path)
            .unwrap_or_else(|e| panic!("{}: {e}", json_path.display())),
        text,
    }
}

/// The same run here (in-process) and on the aarch64 binary under qemu.
fn both(bin: &Path, file: &Path, what: &str, extra: &[&str]) -> (Output, Output) {
    let dir = scratch_dir("arm-identity");
    let tag: String = what
        .chars()
        .map(|c| if c.is_alphanumeric() { c } else { '-' })
        .collect();
    let (x86_logits, arm_logits) = (
        dir.join(format!("{tag}.x86.bin")),
        dir.join(format!("{tag}.arm.bin")),
    );
    let mut args = vec!["-p", PROMPT, "-n", N, "--temp", "0"];
    args.extend_from_slice(extra);
    let mut ours = args.clone();
    ours.extend_from_slice(&["--logits-out", x86_logits.to_str().expect("utf-8")]);
    let r = run(file, &ours);
    assert_eq!(r.code, 0, "{what}: {}", r.stderr);
    let x86 = read_output(&x86_logits, r.stdout);

    let out = Command::new("qemu-aarch64-static")
        .arg(bin)
        .arg("-m")
        .arg(file)
        .args(&args)
        .arg("--logits-out")
        .arg(&arm_logits)
        .output()
        .expect("run qemu-aarch64-static");
    assert!(
        out.status.success(),
        "{what}: the aarch64 binary failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let arm = read_output(
        &arm_logits,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    );
    (x86, arm)
}

/// Where two outputs first differ, for the failure message.
fn first_difference(what: &str, x86: &Output, arm: &Output) -> Option<String> {
    if x86.logits != arm.logits {
        let n = x86.logits.len().min(arm.logits.len());
        let at = (0..n)
            .find(|&i| x86.logits[i] != arm.logits[i])
            .unwrap_or(n);
        return Some(format!(
            "{what}: logits differ from byte {at} (float {}; {} vs {} bytes)",
            at / 4,
            x86.logits.len(),
            arm.logits.len()
        ));
    }
    if x86.json != arm.json {
        return Some(format!(
            "{what}: token ids or router margins differ:\n x86 {}\n arm {}",
            x86.json, arm.json
        ));
    }
    if x86.text != arm.text {
        return Some(format!(
            "{what}: text differs:\n x86 {:?}\n arm {:?}",
            x86.text, arm.text
        ));
    }
    None
}

/// The runs each file gets: resident, and streamed through a 4 MiB cache (a few experts of
/// the 64: every token evicts) serially and overlapped on two lanes.
const STREAMED: &[(&str, &[&str])] = &[
    ("resident", &["--no-moe-stream"]),
    (
        "streamed",
        &["--moe-stream", "--cache-mb", "4", "--force-cache"],
    ),
    (
        "overlapped",
        &[
            "--moe-stream",
            "--cache-mb",
            "4",
            "--force-cache",
            "--overlap",
            "--io-threads",
            "2",
        ],
    ),
];

/// The type whose file also runs streamed and overlapped: the streamer, its lanes and their
/// O_DIRECT reads do not depend on the weight type (the x86 gates hold streamed == resident
/// for every type), while each type's kernels run in the resident runs. One streamed type
/// keeps the gate's qemu time within CI's budget.
const STREAMED_TYPE: Option<&str> = Some("q4_k_m");

/// Every type of `arch` resident, and [`STREAMED_TYPE`] in every run, on both builds; panics
/// with every difference found.
fn check_arch(arch: &str, types: &[Option<&str>]) {
    let Some(bin) = arm_cli() else { return };
    let mut failures = Vec::new();
    for &ty in types {
        let file = tiny(arch, ty);
        let runs = if ty == STREAMED_TYPE {
            STREAMED
        } else {
            &STREAMED[..1]
        };
        for (run_name, extra) in runs {
            let what = format!("{arch} {} {run_name}", ty.unwrap_or("preset types"));
            let (x86, arm) = both(&bin, &file, &what, extra);
            assert!(!x86.logits.is_empty(), "{what}: no logits written");
            match first_difference(&what, &x86, &arm) {
                Some(d) => failures.push(d),
                None => eprintln!("{what}: identical ({} logit bytes)", x86.logits.len()),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The types every architecture is held to.
const TYPES: &[Option<&str>] = &[Some("f16"), Some("q8_0"), Some("q4_k_m"), None];

#[test]
fn qwen3moe_on_aarch64_writes_the_x86_bytes() {
    check_arch("qwen3moe", TYPES);
}

#[test]
fn qwen2moe_on_aarch64_writes_the_x86_bytes() {
    check_arch("qwen2moe", TYPES);
}

#[test]
fn gemma4_on_aarch64_writes_the_x86_bytes() {
    check_arch("gemma4", TYPES);
}

#[test]
fn gpt_oss_on_aarch64_writes_the_x86_bytes() {
    check_arch(
        "gpt-oss",
        &[
            Some("f16"),
            Some("q8_0"),
            Some("q4_k_m"),
            Some("mxfp4_moe"),
            None,
        ],
    );
}

#[test]
fn qwen35moe_on_aarch64_writes_the_x86_bytes() {
    check_arch("qwen35moe", TYPES);
}

#[test]
fn lfm2moe_on_aarch64_writes_the_x86_bytes() {
    check_arch("lfm2moe", TYPES);
}

/// Every other weight format the kernels take, resident, on qwen3moe: each one's NEON kernels
/// on a real forward pass (prefill batches and decode).
#[test]
fn every_weight_type_on_aarch64_writes_the_x86_bytes() {
    let Some(bin) = arm_cli() else { return };
    let mut failures = Vec::new();
    for ty in [
        "f32", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_m", "q5_k_m", "q6_k",
        "iq4_nl", "iq4_xs",
    ] {
        let file = tiny("qwen3moe", Some(ty));
        let what = format!("qwen3moe {ty} resident");
        let (x86, arm) = both(&bin, &file, &what, &["--no-moe-stream"]);
        match first_difference(&what, &x86, &arm) {
            Some(d) => failures.push(d),
            None => eprintln!("{what}: identical"),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The aarch64 binary's `gen` writes the file this build's `gen` writes (the generator is
/// deterministic and its arithmetic the same everywhere), and each SIMD level the phone may
/// have (NEON only, dotprod, i8mm: qemu's CPU models) runs the model to the same logits.
#[test]
fn aarch64_gen_and_every_arm_level_agree_with_x86() {
    let Some(bin) = arm_cli() else { return };
    let dir = scratch_dir("arm-identity-gen");
    let arm_file = dir.join("tiny-arm.gguf");
    let out = Command::new("qemu-aarch64-static")
        .arg(&bin)
        .args(["gen", "--quiet", "--preset", "tiny", "--seed", "7", "--out"])
        .arg(&arm_file)
        .output()
        .expect("run qemu-aarch64-static");
    assert!(
        out.status.success(),
        "aarch64 gen failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let x86_file = bmoe_gates::tiny();
    assert!(
        std::fs::read(&arm_file).unwrap() == std::fs::read(&x86_file).unwrap(),
        "aarch64 gen wrote another file than x86 gen for --preset tiny --seed 7"
    );
    let (x86, _) = both(&bin, &x86_file, "tiny levels (x86)", &["--no-moe-stream"]);
    let mut failures = Vec::new();
    // (qemu CPU model, the level the binary must detect on it)
    for (cpu, level) in [
        ("cortex-a72", "neon"),
        ("cortex-a76", "dotprod"),
        ("max", "i8mm"),
    ] {
        let logits = dir.join(format!("levels-{cpu}.bin"));
        let out = Command::new("qemu-aarch64-static")
            .args(["-cpu", cpu])
            .arg(&bin)
            .arg("-m")
            .arg(&x86_file)
            .args([
                "-p",
                PROMPT,
                "-n",
                N,
                "--temp",
                "0",
                "--no-moe-stream",
                "--logits-out",
            ])
            .arg(&logits)
            .output()
            .expect("run qemu-aarch64-static");
        // A level detected wrongly would run instructions the CPU model lacks: SIGILL.
        assert!(
            out.status.success(),
            "{cpu} (expected level {level}): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let arm = read_output(&logits, String::from_utf8_lossy(&out.stdout).into_owned());
        if let Some(d) = first_difference(&format!("tiny at {level} ({cpu})"), &x86, &arm) {
            failures.push(d);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
