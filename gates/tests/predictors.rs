//! Expert-prediction gates (features.md §4–§6): the probe changes nothing, predicted prefetch
//! changes only when bytes arrive, route-ahead past every layer is a no-op and at depth 1
//! commits and generates, and integrated (sync) speculation is byte-identical.
//!
//! G9a  `--predict-log` is byte-identical to the plain run and reads exactly the same bytes
//!      with the same hits (serial and overlap).
//! G9b  the probe scored routings, the control reads 100.0%, the stale gate is well above the
//!      chance overlap k/n_expert.
//! G10a `--predict-prefetch` (spec-max 0, 2, 8) is byte-identical to no prefetch over an
//!      evicting and a roomier cache, with and without overlap.
//! G10b it did speculate: prefetched > 0, useful > 0, a `[stale-gate]` line.
//! G14a `--route-ahead` past every layer passes every decode routing through and is
//!      byte-identical, reads included.
//! G14b `--route-ahead 1` commits routings, generates, reports its agreement, and its early
//!      reads are (nearly) all used; also with `--drop-cold-experts` and `--overlap`.
//! G5c  `--prefetch-sync` (with `--prefetch` and `--predict-prefetch`) is byte-identical and
//!      prefetched.

use bmoe_gates::{run, tiny};

const PROMPT: &str = "The cache of experts keeps what the router asked for";
const N: &str = "48";
/// The tiny preset: 4 MoE layers, 16 experts, top-4.
const TINY_LAYERS: u64 = 4;
const TINY_EXPERTS: f64 = 16.0;
const TINY_K: f64 = 4.0;

fn streamed(cache_mb: &str, args: &[&str]) -> bmoe_gates::Run {
    let mut a = vec![
        "-p",
        PROMPT,
        "-n",
        N,
        "--moe-stream",
        "--cache-mb",
        cache_mb,
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

fn summary(r: &bmoe_gates::Run) -> &bmoe_core::telemetry::summary::RunSummary {
    r.outcome.summary.as_ref().expect("summary")
}

fn assert_same_output(r: &bmoe_gates::Run, base: &bmoe_gates::Run, what: &str) {
    assert_eq!(
        r.outcome.tokens, base.outcome.tokens,
        "{what} changed the tokens"
    );
    assert_eq!(r.stdout, base.stdout, "{what} changed the text");
}

#[test]
fn g9a_predict_log_changes_nothing_read_or_computed() {
    for extra in [&[][..], &["--overlap"][..]] {
        let base = streamed("4", extra);
        let mut a = extra.to_vec();
        a.push("--predict-log");
        let r = streamed("4", &a);
        assert_same_output(&r, &base, &format!("--predict-log {extra:?}"));
        let (s, b) = (summary(&r), summary(&base));
        assert_eq!(s.totals.read_bytes, b.totals.read_bytes, "{extra:?}");
        assert_eq!(s.counters.evictions, b.counters.evictions, "{extra:?}");
        assert_eq!(
            s.counters.cache_hit_pct, b.counters.cache_hit_pct,
            "{extra:?}"
        );
        assert_eq!(s.counters.spec_experts, 0, "the probe reads nothing ahead");
        assert!(line(&base.stderr, "moe-predict:").is_none());
    }
}

#[test]
fn g9b_the_probe_scores_and_its_control_is_exact() {
    let r = streamed("4", &["--predict-log"]);
    let p = summary(&r)
        .counters
        .predict
        .clone()
        .expect("--predict-log reports");
    // One decode step per generated token (the contract's count: -n N is N decode steps).
    let decode_tokens = summary(&r).tokens();
    assert!(decode_tokens > 2, "the run must decode a few tokens");
    // Every decode routing but the first token's is graded by the control and prev-token.
    assert_eq!(p.ctrl.rows, (decode_tokens - 1) * TINY_LAYERS);
    assert_eq!(p.prev.rows, p.ctrl.rows);
    assert_eq!(p.ctrl.hit_slots, p.ctrl.slots, "control must be 100%");
    assert_eq!(p.ctrl.exact_rows, p.ctrl.rows);
    // The stale gate cannot rank layer 0 or the first token.
    assert_eq!(p.stale.rows, (decode_tokens - 1) * (TINY_LAYERS - 1));
    assert_eq!(p.unscored, TINY_LAYERS + (decode_tokens - 1));
    assert_eq!(p.stale2.rows, (decode_tokens - 1) * (TINY_LAYERS - 2));
    let chance = TINY_K / TINY_EXPERTS;
    assert!(
        p.stale.hit_frac() > 1.5 * chance,
        "stale gate {} is not well above chance {chance}",
        p.stale.hit_frac()
    );
    let l = line(&r.stderr, "moe-predict: stale-gate")
        .unwrap_or_else(|| panic!("no moe-predict line: {}", r.stderr));
    assert!(l.contains("fresh-gate control 100.0% (100.0%)"), "{l}");
    assert!(r
        .stderr
        .contains("  layer   stale    prev   ctrl   routings"));
    eprintln!("{l}");
}

#[test]
fn g10a_predict_prefetch_is_byte_identical() {
    for cache in ["4", "16"] {
        for extra in [&[][..], &["--overlap"][..]] {
            let base = streamed(cache, extra);
            for spec in ["0", "2", "8"] {
                let mut a = extra.to_vec();
                a.extend_from_slice(&["--predict-prefetch", "--predict-spec-max", spec]);
                let r = streamed(cache, &a);
                assert_same_output(
                    &r,
                    &base,
                    &format!("--predict-prefetch spec-max {spec} cache {cache} {extra:?}"),
                );
                if spec == "0" {
                    assert_eq!(summary(&r).counters.spec_read_bytes, 0, "retention only");
                }
            }
        }
    }
    // The evicting budget really evicts (so retention and speculation had work to do).
    assert!(summary(&streamed("4", &[])).counters.evictions > 0);
}

#[test]
fn g10b_predict_prefetch_speculates_and_is_used() {
    for extra in [&[][..], &["--overlap"][..]] {
        let mut a = extra.to_vec();
        a.push("--predict-prefetch");
        let r = streamed("4", &a);
        let s = summary(&r);
        let c = &s.counters;
        assert!(c.spec_experts > 0, "{extra:?} prefetched nothing");
        assert!(c.spec_useful > 0, "{extra:?}: no prefetch was used");
        assert!(c.spec_useful <= c.spec_experts);
        assert!(c.spec_read_bytes > 0 && c.spec_read_bytes <= s.totals.read_bytes);
        let l = line(&r.stderr, "moe-prefetch:")
            .unwrap_or_else(|| panic!("no moe-prefetch line: {}", r.stderr));
        assert!(l.ends_with("[stale-gate]"), "{l}");
        assert!(
            l.contains(&format!(
                "{}/{} experts useful",
                c.spec_useful, c.spec_experts
            )),
            "{l}"
        );
        eprintln!("--predict-prefetch {extra:?}: {l}");
    }
}

#[test]
fn g14a_route_ahead_past_every_layer_passes_through() {
    for extra in [&[][..], &["--overlap"][..]] {
        let base = streamed("4", extra);
        let mut a = extra.to_vec();
        a.extend_from_slice(&["--route-ahead", "8"]);
        let r = streamed("4", &a);
        assert_same_output(&r, &base, &format!("--route-ahead 8 {extra:?}"));
        let (s, b) = (summary(&r), summary(&base));
        // One decode step per generated token (the contract's count: -n N is N decode steps).
        let decode_tokens = summary(&r).tokens();
        assert_eq!(s.counters.ra_committed, 0);
        assert_eq!(s.counters.ra_passthrough, decode_tokens * TINY_LAYERS);
        assert_eq!(s.totals.read_bytes, b.totals.read_bytes);
        assert_eq!(s.counters.spec_experts, 0);
        let l = line(&r.stderr, "moe-route-ahead:").expect("route-ahead line");
        assert!(
            l.contains(&format!(
                "0 routings committed, {} passed through",
                decode_tokens * TINY_LAYERS
            )),
            "{l}"
        );
    }
}

#[test]
fn g14b_route_ahead_commits_and_generates() {
    for extra in [
        &[][..],
        &["--overlap"][..],
        &["--drop-cold-experts", "0.5"][..],
    ] {
        let mut a = extra.to_vec();
        a.extend_from_slice(&["--route-ahead", "1"]);
        let r = streamed("4", &a);
        assert!(r.outcome.tokens.len() > 1, "{extra:?} generated nothing");
        let c = &summary(&r).counters;
        assert!(c.ra_committed > 0, "{extra:?} committed nothing");
        assert!(c.ra_agreed_slots <= c.ra_slots && c.ra_slots > 0);
        assert!(c.ra_agreed_slots > 0, "a stale gate agrees somewhere");
        assert!(c.spec_experts > 0, "{extra:?}: no early reads");
        if extra.is_empty() || extra == ["--overlap"] {
            // The early reads are the committed routing itself.
            assert!(
                c.spec_useful * 10 >= c.spec_experts * 9,
                "{extra:?}: {}/{} early reads used",
                c.spec_useful,
                c.spec_experts
            );
        }
        let l = line(&r.stderr, "moe-route-ahead:").expect("route-ahead line");
        assert!(
            l.contains(&format!(
                "{} routings committed, {} passed through",
                c.ra_committed, c.ra_passthrough
            )),
            "{l}"
        );
        assert!(l.contains("agreed with the router on"), "{l}");
        let p = line(&r.stderr, "moe-prefetch:").expect("prefetch line");
        assert!(p.ends_with("[route-ahead]"), "{p}");
        eprintln!("--route-ahead 1 {extra:?}: {l}\n{p}");
    }
}

#[test]
fn g5c_prefetch_sync_is_byte_identical_and_prefetches() {
    for extra in [&[][..], &["--overlap"][..]] {
        let base = streamed("4", extra);
        for pred in [&["--prefetch", "1"][..], &["--predict-prefetch"][..]] {
            let mut a = extra.to_vec();
            a.extend_from_slice(pred);
            a.push("--prefetch-sync");
            let r = streamed("4", &a);
            assert_same_output(&r, &base, &format!("{pred:?} --prefetch-sync {extra:?}"));
            let c = &summary(&r).counters;
            assert!(
                c.spec_experts > 0,
                "{pred:?} --prefetch-sync prefetched nothing"
            );
            assert!(c.spec_useful > 0);
        }
    }
}

/// The engine's `predict` is the router's arithmetic: from == target reproduces the routing bit
/// for bit (ids, weights), a later target ranks a different layer's experts, and a `from` that
/// is not the layer routed last is declined.
#[test]
fn engine_predict_reproduces_the_router_for_the_control() {
    use bmoe_engine::arch::RouteOut;
    use bmoe_engine::gguf::GgufFile;
    use std::sync::Arc;

    let file = Arc::new(GgufFile::open(tiny()).expect("open tiny"));
    let model = bmoe_engine::arch::load_model(file, bmoe_engine::dense::DenseMode::Mmap, 1)
        .expect("load tiny");
    let n_layer = model.dims().n_layer;
    let k = model.dims().n_expert_used;
    let mut st = model.new_state(64);
    let mut ro = RouteOut::default();
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    // A 3-token prefill and then one decode row: the kept input is the batch's last row.
    for (tokens, positions) in [(&[11u32, 12, 13][..], &[0u32, 1, 2][..]), (&[14], &[3])] {
        let last = tokens.len() as u32 - 1;
        model.begin(&mut st, tokens, positions, &[last]).unwrap();
        for l in 0..n_layer {
            model.dense(&mut st, l).unwrap();
            assert!(
                !model
                    .predict(&mut st, l, l, k, &mut ids, &mut weights)
                    .unwrap(),
                "layer {l} is not routed yet"
            );
            model.route(&mut st, l, &mut ro).unwrap();
            let r = ro.rows.len() - 1;
            assert!(model
                .predict(&mut st, l, l, k, &mut ids, &mut weights)
                .unwrap());
            assert_eq!(ids, ro.ids[r * k..(r + 1) * k], "layer {l} control ids");
            let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&weights),
                bits(&ro.weights[r * k..(r + 1) * k]),
                "layer {l} control weights"
            );
            if l + 1 < n_layer {
                assert!(model
                    .predict(&mut st, l, l + 1, k, &mut ids, &mut weights)
                    .unwrap());
                assert_eq!(ids.len(), k);
                let sum: f32 = weights.iter().sum();
                assert!((sum - 1.0).abs() < 1e-4, "renormalised: {sum}");
            }
            assert!(!model
                .predict(&mut st, l, n_layer, k, &mut ids, &mut weights)
                .unwrap());
            model.finish_layer(&mut st, l).unwrap();
        }
    }
}
