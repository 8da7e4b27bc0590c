//! Byte-identity gates of expert streaming (features.md §1, §2): every lossless setting must
//! produce exactly the resident run's greedy output.
//!
//! G1 resident == streamed, cache off. G2 cache off == cache on at budgets that evict every
//! token and that hold everything. G3 selective == --load-all. G4 --overlap == serial with 1
//! and 4 lanes. G6 every dense mode == resident. G8 slots that span huge pages, in huge and
//! base pages, == resident. G9 a prefill in `--ubatch` steps, an overlapped window and serial
//! waves (a union wider than the cache) == resident, each expert read once per step and layer.

use bmoe_gates::{run, tiny};

const PROMPT: &str = "The cache of experts keeps what the router asked for";
const N: &str = "64";

fn resident() -> (Vec<u32>, String) {
    let r = run(&tiny(), &["-p", PROMPT, "-n", N]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.contains("mode: mmap"),
        "baseline must say it is not streaming: {}",
        r.stderr
    );
    assert_eq!(r.outcome.tokens.len(), 64, "64 greedy tokens");
    (r.outcome.tokens, r.stdout)
}

fn streamed(args: &[&str]) -> bmoe_gates::Run {
    let mut a = vec!["-p", PROMPT, "-n", N, "--moe-stream"];
    a.extend_from_slice(args);
    let r = run(&tiny(), &a);
    assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
    assert!(r.stderr.contains("mode: expert streaming"), "{}", r.stderr);
    r
}

fn assert_same(args: &[&str]) {
    let (tokens, text) = resident();
    let r = streamed(args);
    assert_eq!(
        r.outcome.tokens, tokens,
        "token ids differ from the resident run with {args:?}"
    );
    assert_eq!(
        r.stdout, text,
        "text differs from the resident run with {args:?}"
    );
}

fn summary_value(stderr: &str, prefix: &str) -> String {
    stderr
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} line in {stderr}"))
        .to_string()
}

#[test]
fn g1_resident_equals_streamed_cache_off() {
    assert_same(&["--cache-mb", "0"]);
}

#[test]
fn g2_cache_off_equals_cache_on_evicting_and_holding() {
    // 2 MiB holds ~6 of the 64 experts: every token evicts (the cycle cliff: 0 % hit).
    let r = streamed(&["--cache-mb", "2", "--force-cache"]);
    let (tokens, _) = resident();
    assert_eq!(r.outcome.tokens, tokens);
    let s = r.outcome.summary.expect("summary");
    assert!(
        s.counters.evictions > 100,
        "a 2 MiB cache must evict constantly: {}",
        s.counters.evictions
    );
    // 32 MiB holds every expert: hits must dominate.
    let r = streamed(&["--cache-mb", "32", "--force-cache"]);
    assert_eq!(r.outcome.tokens, tokens);
    let s = r.outcome.summary.expect("summary");
    assert_eq!(s.counters.evictions, 0);
    assert!(
        s.counters.cache_hit_pct > 50.0,
        "{}",
        s.counters.cache_hit_pct
    );
    // A budget between the two.
    assert_same(&["--cache-mb", "8", "--force-cache"]);
}

#[test]
fn g3_selective_equals_load_all() {
    let sel = streamed(&["--cache-mb", "0"]);
    let all = streamed(&["--cache-mb", "0", "--load-all"]);
    assert_eq!(sel.outcome.tokens, all.outcome.tokens);
    let rb = |r: &bmoe_gates::Run| {
        r.outcome
            .summary
            .as_ref()
            .expect("summary")
            .totals
            .read_bytes
    };
    assert!(
        rb(&all) > 2 * rb(&sel),
        "load-all must read the whole bank: {} vs {}",
        rb(&all),
        rb(&sel)
    );
}

#[test]
fn g4_overlap_equals_serial_one_and_four_lanes() {
    for lanes in ["1", "4"] {
        assert_same(&["--cache-mb", "0", "--overlap", "--io-threads", lanes]);
        assert_same(&[
            "--cache-mb",
            "2",
            "--force-cache",
            "--overlap",
            "--io-threads",
            lanes,
        ]);
    }
    let r = streamed(&["--cache-mb", "0", "--overlap", "--io-threads", "4"]);
    assert!(
        summary_value(&r.stderr, "moe-stream:").contains("stall_s/tok="),
        "{}",
        r.stderr
    );
}

/// A cache budget and a read split, on four lanes.
fn split_args<'a>(cache: &'a str, split: &'a str) -> [&'a str; 7] {
    [
        "--cache-mb",
        cache,
        "--force-cache",
        "--io-threads",
        "4",
        "--read-split",
        split,
    ]
}

#[test]
fn g4b_every_read_split_equals_resident() {
    for split in ["auto", "lanes", "off", "64"] {
        for cache in ["0", "2", "32"] {
            assert_same(&split_args(cache, split));
        }
    }
}

#[test]
fn g6_every_dense_mode_equals_resident() {
    for mode in ["mmap", "warm", "anon"] {
        assert_same(&["--cache-mb", "8", "--force-cache", "--dense-weights", mode]);
        let r = streamed(&["--cache-mb", "0", "--dense-weights", mode]);
        assert!(r.stderr.contains(&format!("dense {mode}")), "{}", r.stderr);
    }
}

#[test]
fn g7_anon_with_buffered_expert_reads() {
    assert_same(&[
        "--cache-mb",
        "8",
        "--force-cache",
        "--dense-weights",
        "anon",
        "--no-odirect",
    ]);
}

/// A model whose expert slots (3 MiB: three 1 MiB f16 projections) span a huge page, so the
/// arena lays chunks out 2 MiB aligned with a huge-page head and a base-page tail.
fn big_experts() -> std::path::PathBuf {
    bmoe_gates::model(
        "big-experts",
        &[
            "--preset",
            "tiny",
            "--seed",
            "7",
            "--type",
            "f16",
            "--d-model",
            "512",
            "--expert-ffn",
            "1024",
            "--layers",
            "2",
            "--experts",
            "8",
        ],
    )
}

#[test]
fn g8_huge_page_slots_equal_resident_and_base_pages() {
    let m = big_experts();
    let base = run(&m, &["-p", PROMPT, "-n", "24"]);
    assert_eq!(base.code, 0, "{}", base.stderr);
    // Cache off (staging slots), a cache that evicts (chunks reused), one that holds all, and
    // the same in base pages.
    for args in [
        &["--cache-mb", "0"][..],
        &["--cache-mb", "12", "--force-cache"],
        &["--cache-mb", "64", "--force-cache"],
        &["--cache-mb", "12", "--force-cache", "--no-hugepages"],
        &["--cache-mb", "0", "--no-hugepages", "--overlap"],
    ] {
        let mut a = vec!["-p", PROMPT, "-n", "24", "--moe-stream"];
        a.extend_from_slice(args);
        let r = run(&m, &a);
        assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
        assert_eq!(r.outcome.tokens, base.outcome.tokens, "{args:?}");
        assert_eq!(r.stdout, base.stdout, "{args:?}");
        if args[1] == "12" {
            let s = r.outcome.summary.expect("summary");
            assert!(
                s.counters.evictions > 10,
                "{args:?}: {}",
                s.counters.evictions
            );
        }
    }
}

/// Reads per phase (prefill, decode) in an io trace.
fn reads_by_phase(io_trace: &std::path::Path) -> (usize, usize) {
    let text = std::fs::read_to_string(io_trace).expect("io trace");
    let mut lines = text.lines().filter(|l| !l.starts_with('#'));
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = header
        .iter()
        .position(|&h| h == "phase")
        .expect("phase column");
    let (mut pre, mut dec) = (0, 0);
    for l in lines {
        match l.split(',').nth(col) {
            Some("0") => pre += 1,
            Some("1") => dec += 1,
            other => panic!("phase {other:?} in {l}"),
        }
    }
    (pre, dec)
}

#[test]
fn read_split_auto_reads_whole_where_every_lane_has_an_extent() {
    let m = big_experts();
    let dir = bmoe_gates::scratch_dir("read-split");
    let reads = |cache: &str, split: &str| {
        let trace = dir.join(format!("io-{cache}-{split}.csv"));
        let t = trace.to_str().expect("utf-8");
        let r = run(
            &m,
            &[
                &["-p", PROMPT, "-n", "8", "--moe-stream"][..],
                &split_args(cache, split),
                &["--io-trace", t],
            ]
            .concat(),
        );
        assert_eq!(r.code, 0, "{}", r.stderr);
        let n = reads_by_phase(&trace);
        let _ = std::fs::remove_file(&trace);
        n
    };
    // Cache off: every layer reads its routed experts' 1 MiB extents, at least one per lane,
    // so auto reads them whole — a quarter of the lane pieces — in prefill and decode.
    let (auto, lanes) = (reads("0", "auto"), reads("0", "lanes"));
    assert_eq!(
        (auto.0 * 4, auto.1 * 4),
        lanes,
        "cache off: auto {auto:?}, lanes {lanes:?}"
    );
    assert_eq!(auto, reads("0", "off"));
    // Cache on: a decode step's misses are cut one piece per lane, as with lanes; the
    // prefill's many misses are read whole.
    let (auto, lanes, off) = (
        reads("12", "auto"),
        reads("12", "lanes"),
        reads("12", "off"),
    );
    assert!(auto.1 > 0, "the 12 MiB cache must miss in decode");
    assert_eq!(
        auto.1, lanes.1,
        "cached decode: auto {auto:?}, lanes {lanes:?}"
    );
    assert_eq!(auto.0, off.0, "prefill: auto {auto:?}, off {off:?}");
    assert!(lanes.0 > auto.0);
}

#[test]
fn streaming_is_deterministic_across_thread_counts() {
    let a = streamed(&["--cache-mb", "2", "--force-cache", "-t", "1"]);
    let b = streamed(&["--cache-mb", "2", "--force-cache", "-t", "2"]);
    assert_eq!(a.outcome.tokens, b.outcome.tokens);
}

#[test]
fn budget_below_layer_demand_is_refused_with_the_floor_named() {
    let mut argv = vec![
        "-p",
        PROMPT,
        "-n",
        "4",
        "--moe-stream",
        "--cache-mb",
        "1",
        "--force-cache",
    ];
    let cli = <bmoe_engine::cli::Cli as clap::Parser>::try_parse_from(
        std::iter::once("bmoe-cli")
            .chain(["-m", tiny().to_str().unwrap()])
            .chain(argv.drain(..)),
    )
    .unwrap();
    let (mut o, mut e) = (Vec::new(), Vec::new());
    let err = bmoe_engine::run::generate_with(&cli.run, &tiny(), &mut o, &mut e)
        .expect_err("1 MiB is below the floor");
    let msg = format!("{err:#}");
    assert!(msg.contains("layer_demand"), "{msg}");
}

#[test]
fn failed_reads_stop_the_run_loudly_with_a_nonzero_exit() {
    for (fault, serial) in [
        ("eio:40", true),
        ("short:40", true),
        ("eio:3", false),
        ("short:90", false),
    ] {
        let mut a = vec![
            "-p",
            PROMPT,
            "-n",
            "16",
            "--moe-stream",
            "--cache-mb",
            "0",
            "--inject-read-fault",
            fault,
        ];
        if !serial {
            a.push("--overlap");
        }
        let r = run(&tiny(), &a);
        assert_ne!(
            r.code, 0,
            "{fault}: a failed read must give a non-zero exit"
        );
        assert!(r.stderr.contains("FAILED"), "{fault}: {}", r.stderr);
        assert!(
            r.stderr.contains("not trustworthy"),
            "{fault}: {}",
            r.stderr
        );
        assert!(
            r.outcome.tokens.len() < 16,
            "{fault}: the run must stop, not finish"
        );
    }
}

#[test]
fn n_expert_used_is_the_same_narrowing_resident_and_streamed() {
    let res = run(&tiny(), &["-p", PROMPT, "-n", "32", "--n-expert-used", "2"]);
    assert_eq!(res.code, 0, "{}", res.stderr);
    let full = run(&tiny(), &["-p", PROMPT, "-n", "32"]);
    assert_ne!(
        res.outcome.tokens, full.outcome.tokens,
        "top-2 of 4 must change a random model's output"
    );
    for extra in [
        &["--cache-mb", "0"][..],
        &["--cache-mb", "2", "--force-cache", "--overlap"][..],
    ] {
        let mut a = vec![
            "-p",
            PROMPT,
            "-n",
            "32",
            "--n-expert-used",
            "2",
            "--moe-stream",
        ];
        a.extend_from_slice(extra);
        let s = run(&tiny(), &a);
        assert_eq!(s.code, 0, "{}", s.stderr);
        assert_eq!(s.outcome.tokens, res.outcome.tokens, "{extra:?}");
    }
}

/// Prefill reads from an io trace: per (prefill step, MoE layer, expert, projection) the bytes
/// asked for, and whether any piece (same offset) was read twice.
fn prefill_reads(
    io_trace: &std::path::Path,
) -> (std::collections::BTreeMap<[String; 4], u64>, bool) {
    let text = std::fs::read_to_string(io_trace).expect("io trace");
    let mut lines = text.lines().filter(|l| !l.starts_with('#'));
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| header.iter().position(|&h| h == name).expect(name);
    let (phase, step, layer, expert, proj, offset, req) = (
        col("phase"),
        col("step"),
        col("layer"),
        col("expert"),
        col("proj"),
        col("offset"),
        col("req_bytes"),
    );
    let mut bytes = std::collections::BTreeMap::new();
    let mut pieces = std::collections::BTreeSet::new();
    let mut twice = false;
    for l in lines {
        let f: Vec<&str> = l.split(',').collect();
        if f[phase] == "0" {
            let key = [f[step], f[layer], f[expert], f[proj]].map(str::to_string);
            *bytes.entry(key).or_insert(0) += f[req].parse::<u64>().expect("req_bytes");
            twice |= !pieces.insert((f[step].to_string(), f[offset].to_string()));
        }
    }
    (bytes, twice)
}

#[test]
fn g9_a_prefill_in_steps_and_a_sliding_window_equal_resident_and_read_each_expert_once() {
    let dir = bmoe_gates::scratch_dir("prefill-steps");
    let (tokens, text) = resident();
    let mut steps_seen = Vec::new();
    for (name, args) in [
        // The prompt in 3-token steps, cache off: each step reads its own union.
        (
            "ubatch3",
            &["--overlap", "--cache-mb", "0", "--ubatch", "3"][..],
        ),
        // One step on a 2 MiB cache (~6 experts): the prefill's union per layer is wider, so
        // the overlapped layer slides its window (serial: waves).
        (
            "window",
            &["--overlap", "--cache-mb", "2", "--force-cache"][..],
        ),
        ("waves", &["--cache-mb", "2", "--force-cache"][..]),
    ] {
        let trace = dir.join(format!("io-{name}.csv"));
        let mut a = args.to_vec();
        a.extend_from_slice(&["--io-trace", trace.to_str().expect("utf-8")]);
        let r = streamed(&a);
        assert_eq!(
            r.outcome.tokens, tokens,
            "{name}: token ids differ from resident"
        );
        assert_eq!(r.stdout, text, "{name}: text differs from resident");
        let (bytes, twice) = prefill_reads(&trace);
        let _ = std::fs::remove_file(&trace);
        assert!(!bytes.is_empty(), "{name}: the prefill read nothing");
        assert!(!twice, "{name}: a piece read twice in one prefill step");
        // Every expert's projection of a layer is the same extent: read once, each sums to it.
        let mut per_layer_proj = std::collections::BTreeMap::new();
        for (k, &b) in &bytes {
            per_layer_proj
                .entry((k[1].clone(), k[3].clone()))
                .or_insert_with(std::collections::BTreeSet::new)
                .insert(b);
        }
        assert!(
            per_layer_proj.values().all(|v| v.len() == 1),
            "{name}: an expert's projection read more than once in a prefill step: {per_layer_proj:?}"
        );
        let steps: std::collections::BTreeSet<&String> = bytes.keys().map(|k| &k[0]).collect();
        steps_seen.push(steps.len());
    }
    assert!(
        steps_seen[0] > 1,
        "--ubatch 3 must prefill in several steps"
    );
    assert_eq!(steps_seen[1..], [1, 1]);
}
