//! Prefetch gates (features.md §4): speculation may change when expert bytes arrive, never what
//! a token computes.
//!
//! G5a `--prefetch 1` and `--prefetch 2` over an evicting cache are byte-identical to the run
//! without prefetch, and did prefetch. G5b the same under `--overlap`.

use bmoe_gates::{run, tiny};

const PROMPT: &str = "The cache of experts keeps what the router asked for";
const N: &str = "48";

fn streamed(args: &[&str]) -> bmoe_gates::Run {
    let mut a = vec![
        "-p",
        PROMPT,
        "-n",
        N,
        "--moe-stream",
        "--cache-mb",
        "4",
        "--force-cache",
    ];
    a.extend_from_slice(args);
    let r = run(&tiny(), &a);
    assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
    r
}

fn line<'a>(stderr: &'a str, prefix: &str) -> Option<&'a str> {
    stderr.lines().find(|l| l.starts_with(prefix))
}

fn gate(extra: &[&str]) {
    let base = streamed(extra);
    assert_eq!(base.outcome.tokens.len(), 48, "48 greedy tokens");
    assert!(
        line(&base.stderr, "moe-prefetch:").is_none(),
        "no prefetch line without --prefetch: {}",
        base.stderr
    );
    let base_evictions = base
        .outcome
        .summary
        .as_ref()
        .expect("summary")
        .counters
        .evictions;
    assert!(base_evictions > 0, "a 4 MiB cache must evict on tiny");
    for k in ["1", "2"] {
        let mut a = extra.to_vec();
        a.extend_from_slice(&["--prefetch", k]);
        let r = streamed(&a);
        assert_eq!(
            r.outcome.tokens, base.outcome.tokens,
            "--prefetch {k} {extra:?} changed the tokens"
        );
        assert_eq!(
            r.stdout, base.stdout,
            "--prefetch {k} {extra:?} changed the text"
        );
        let s = r.outcome.summary.as_ref().expect("summary");
        let c = &s.counters;
        assert!(
            c.spec_experts > 0,
            "--prefetch {k} {extra:?} prefetched nothing"
        );
        assert!(c.spec_useful <= c.spec_experts);
        assert!(c.spec_read_bytes > 0 && c.spec_read_bytes <= s.totals.read_bytes);
        let l = line(&r.stderr, "moe-prefetch:")
            .unwrap_or_else(|| panic!("no moe-prefetch: line: {}", r.stderr));
        assert!(
            l.contains(&format!(
                "{}/{} experts useful",
                c.spec_useful, c.spec_experts
            )),
            "{l}"
        );
        eprintln!("--prefetch {k} {extra:?}: {l}");
    }
}

#[test]
fn g5a_prefetch_is_byte_identical_and_prefetches() {
    gate(&[]);
}

#[test]
fn g5b_prefetch_with_overlap_is_byte_identical_and_prefetches() {
    gate(&["--overlap"]);
    gate(&["--overlap", "--io-threads", "4"]);
}
