//! `bmoe-sim whatif` through the binary's entry point: a real routing (a slice of the
//! DeepSeek-V2-Lite capture in `../shared/traces`: skipped with a message when absent, a failure
//! under CI=true) priced on another model's layout and another device, mapped onto a smaller
//! routing shape by the stated rule, and refused where the rule cannot apply.

use bmoe_core::gating::Gating;
use bmoe_core::telemetry::route_trace::{
    ProjExtent, RoutePreamble, RouteTrace, RouteTraceWriter, TraceLayer,
};
mod common;
use common::{scratch, shared_trace, sim, slice};
use std::path::Path;

/// A layout file (a route trace with no rows) of a model with `layers` MoE layers (model layer
/// 1 on: layer 0 dense) of `n_expert` experts, top-`k`, three projections per expert.
fn layout(path: &Path, layers: u32, n_expert: u32, k: u32, proj_bytes: u64) {
    let mut offset = 1 << 20;
    let layers = (1..=layers)
        .map(|layer| {
            let proj = (0..3)
                .map(|_| {
                    let p = ProjExtent {
                        shard: 0,
                        offset,
                        stride: proj_bytes,
                    };
                    offset += proj_bytes * u64::from(n_expert);
                    p
                })
                .collect();
            TraceLayer {
                layer,
                expert_bytes: 3 * proj_bytes,
                dense_bytes: 6 << 20,
                proj,
            }
        })
        .collect::<Vec<_>>();
    let pre = RoutePreamble {
        model: "other-model".into(),
        arch: "qwen3moe".into(),
        n_layer: 1 + layers.len() as u32,
        n_expert,
        n_expert_used: k,
        gating: Gating::SOFTMAX_RENORM,
        layers,
        notes: vec!["layout only".into()],
        extra: Vec::new(),
    };
    let f = std::fs::File::create(path).expect("layout file");
    RouteTraceWriter::new(f, &pre)
        .and_then(|w| w.finish())
        .expect("write layout");
}

/// A small route trace of a model named `model` with `layout`'s routing shape (read from that
/// layout file): `tokens` decode tokens, each routing experts `t..t+k` (mod the bank) at every
/// MoE layer.
fn synthetic_trace(path: &Path, layout_path: &Path, model: &str, tokens: i64) {
    use bmoe_core::records::{Phase, RouteRecord, PRED_HORIZON_MAX};
    let mut pre = bmoe_sim::cli::load_layout(layout_path).expect("layout");
    pre.model = model.into();
    pre.arch = "deepseek2".into();
    pre.notes = vec!["synthetic".into()];
    let f = std::fs::File::create(path).expect("trace file");
    let mut w = RouteTraceWriter::new(f, &pre).expect("writer");
    for step in 0..tokens {
        for layer in 0..pre.layers.len() as u32 {
            for slot in 0..pre.n_expert_used {
                w.write(&RouteRecord {
                    turn: 0,
                    phase: Phase::Decode,
                    step,
                    layer,
                    slot,
                    expert: (step as u32 + slot) % pre.n_expert,
                    weight: f32::NAN,
                    residency: 0,
                    expert_bytes: 0,
                    dropped: false,
                    preds: [None; PRED_HORIZON_MAX],
                    row: 0,
                    router_expert: None,
                })
                .expect("row");
            }
        }
    }
    w.finish().expect("finish");
}

/// `key=value` of the `sim:` line.
fn sim_value(out: &str, key: &str) -> u64 {
    let line = out
        .lines()
        .find(|l| l.starts_with("sim: profile="))
        .unwrap_or_else(|| panic!("no sim: line in\n{out}"));
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
}

/// Over `trace`'s decode tokens (all of them when it has none), percent: the share of each
/// token's routed experts the previous token of its turn routed in the same layer, and the
/// per-layer LRU hit rate with `cap` experts cached (warm across turns).
fn reuse_and_lru(trace: &RouteTrace, cap: usize) -> (f64, f64) {
    use bmoe_core::records::Phase;
    let decode = trace.steps().any(|s| s.phase == Phase::Decode);
    let n_layers = trace.preamble.layers.len();
    let (mut shared, mut routed, mut hits, mut lookups) = (0u64, 0u64, 0u64, 0u64);
    let mut lru: Vec<Vec<u32>> = vec![Vec::new(); n_layers];
    let mut prev: Option<(u32, Vec<Vec<u32>>)> = None;
    for step in trace
        .steps()
        .filter(|s| !decode || s.phase == Phase::Decode)
    {
        let mut tok: Vec<Vec<u32>> = vec![Vec::new(); n_layers];
        for cell in step.cells {
            for slot in trace.cell_slots(cell) {
                let ids = &mut tok[cell.moe_layer as usize];
                if !slot.dropped && !ids.contains(&slot.expert) {
                    ids.push(slot.expert);
                }
            }
        }
        if let Some((turn, before)) = &prev {
            if *turn == step.turn {
                for (now, then) in tok.iter().zip(before) {
                    routed += now.len() as u64;
                    shared += now.iter().filter(|e| then.contains(e)).count() as u64;
                }
            }
        }
        for (l, ids) in tok.iter().enumerate() {
            let stack = &mut lru[l];
            let hit: Vec<bool> = ids
                .iter()
                .map(|e| stack.iter().take(cap).any(|x| x == e))
                .collect();
            lookups += ids.len() as u64;
            hits += hit.iter().filter(|h| **h).count() as u64;
            for e in ids {
                stack.retain(|x| x != e);
                stack.insert(0, *e);
            }
        }
        prev = Some((step.turn, tok));
    }
    (
        100.0 * shared as f64 / routed.max(1) as f64,
        100.0 * hits as f64 / lookups.max(1) as f64,
    )
}

#[test]
fn whatif_maps_a_real_routing_onto_a_smaller_model_and_states_its_inputs() {
    let Some(path) = shared_trace("deepseek-v2-lite-puffin.route.csv") else {
        return;
    };
    let dir = scratch("map");
    let text = slice(&std::fs::read_to_string(&path).expect("trace"), 3);
    let trace_path = dir.join("t.route.csv");
    std::fs::write(&trace_path, &text).expect("slice");
    let source = RouteTrace::parse(&text).expect("parses");
    let l_from = source.preamble.layers.len();
    assert_eq!((l_from, source.preamble.n_expert), (26, 64));
    let model = dir.join("small.layout.csv");
    layout(&model, 8, 16, 4, 299_008);
    let args = [
        "whatif",
        "--trace",
        trace_path.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--device",
        "ufs40-phone",
        "--cache-mb",
        "8",
        "--force-cache",
    ];
    let (code, out, err) = sim(&args);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let bytes_line = format!(
        "whatif: bytes     from the layout of other-model in {} (qwen3moe, 8 MoE layers x 16 experts, top-4): 0.855 MiB per expert",
        model.display()
    );
    for want in [
        "whatif: routing   from",
        "whatif: mapping   the trace's 26 MoE layers x 64 experts (top-6) mapped onto the model's 8 x 16 (top-4)",
        bytes_line.as_str(),
        "whatif: time      from device profile ufs40-phone",
        "whatif: budget    8 MiB expert cache (--cache-mb), policy lru",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    // Every token routes 4 experts at each of the model's 8 layers, except a prefill token
    // the trace's last layer did not route (the engine computes only the final row there):
    // the model's last layer skips it too. Counted from the source, independently of the
    // mapping code.
    let mut expected = 0u64;
    for step in source.steps() {
        let has_last = step
            .cells
            .iter()
            .any(|c| c.moe_layer as usize == l_from - 1);
        expected += 4 * if has_last { 8 } else { 7 };
    }
    assert_eq!(sim_value(&out, "lookups"), expected);
    let (hits, misses) = (sim_value(&out, "hits"), sim_value(&out, "misses"));
    assert_eq!(hits + misses, expected);
    // Each miss reads one expert of the model's size (3 x 292 KiB, 4096-aligned), not the trace's.
    assert_eq!(sim_value(&out, "read_bytes"), misses * 3 * 299_008);
    // The same inputs give the same bytes.
    let (code2, out2, _) = sim(&args);
    assert_eq!((code2, &out2), (0, &out));

    // The locality line: the mapped routing's previous-token reuse and its per-layer LRU hit
    // rate at a quarter of the layer (4 of 16), counted here from the mapped routing, and the
    // trace's own beside them.
    let model_pre = bmoe_sim::cli::load_layout(&model).expect("layout");
    let (mapped, _) = bmoe_sim::whatif::map_routing(&source, &model_pre, "m", false).expect("maps");
    let (m_reuse, m_hit) = reuse_and_lru(&mapped, 4);
    let (s_reuse, s_hit) = reuse_and_lru(&source, 16);
    let want = format!(
        "whatif: locality  the mapped routing carries the trace model's locality, not this model's \
         own router's: {m_reuse:.1}% of a token's experts are the previous token's (the trace: \
         {s_reuse:.1}%), a per-layer LRU of 4 experts (a quarter of the layer) hits {m_hit:.1}% \
         (the trace at 16: {s_hit:.1}%)"
    );
    assert!(out.contains(&want), "missing {want:?} in\n{out}");
    assert!(m_reuse > 0.0 && m_hit > 0.0 && s_hit > 0.0, "{want}");

    // A model with more experts than the trace routes over is refused, naming why.
    let wide = dir.join("wide.layout.csv");
    layout(&wide, 8, 128, 8, 300_000);
    let mut refused = args.to_vec();
    refused[4] = wide.to_str().unwrap();
    let (code, _, err) = sim(&refused);
    assert_eq!(code, 1);
    assert!(
        err.contains("128 experts per layer and the trace routes over 64"),
        "{err}"
    );
    assert!(err.contains("--split-experts"), "{err}");

    // With --split-experts it is priced: every token routes 8 distinct experts of the model at
    // each of its 8 layers, and a trace expert routed again keeps its group's first member (all
    // six ranks' first members are taken before any second one), so the mapped routing keeps
    // at least 6/8 of the trace's previous-token reuse (the layers compared differ: 8 of the
    // 26 are mapped, hence the looser bound below).
    let mut split = refused.clone();
    split.push("--split-experts");
    let (code, out, err) = sim(&split);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("(top-8): layer j takes the trace's layer round(j*25/7), expert e becomes the group floor(e*128/64)..floor((e+1)*128/64)"),
        "{out}"
    );
    assert!(out.contains("invented"), "{out}");
    let mut expected = 0u64;
    for step in source.steps() {
        let has_last = step
            .cells
            .iter()
            .any(|c| c.moe_layer as usize == l_from - 1);
        expected += 8 * if has_last { 8 } else { 7 };
    }
    assert_eq!(sim_value(&out, "lookups"), expected);
    let wide_pre = bmoe_sim::cli::load_layout(&wide).expect("layout");
    let (mapped, _) = bmoe_sim::whatif::map_routing(&source, &wide_pre, "m", true).expect("maps");
    for step in mapped.steps() {
        for cell in step.cells {
            let mut ids: Vec<u32> = mapped.cell_slots(cell).iter().map(|s| s.expert).collect();
            assert_eq!(ids.len(), 8);
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), 8, "a mapped routing repeats an expert");
        }
    }
    let (m_reuse, _) = reuse_and_lru(&mapped, 32);
    let (s_reuse, _) = reuse_and_lru(&source, 16);
    assert!(
        m_reuse > 0.5 * s_reuse && m_reuse > 0.0,
        "{m_reuse} vs {s_reuse}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn whatif_on_the_traces_own_shape_is_a_replay_re_priced_with_the_models_layout() {
    let Some(path) = shared_trace("deepseek-v2-lite-puffin.route.csv") else {
        return;
    };
    let dir = scratch("same");
    let text = slice(&std::fs::read_to_string(&path).expect("trace"), 2);
    let trace_path = dir.join("t.route.csv");
    std::fs::write(&trace_path, &text).expect("slice");
    let model = dir.join("same.layout.csv");
    layout(&model, 26, 64, 6, 500_000);
    let common = ["--cache-mb", "40", "--force-cache", "--profile"];
    let (t, m) = (trace_path.to_str().unwrap(), model.to_str().unwrap());
    let (code, replay, err) = sim(&[
        &["replay", "--trace", t, "--layout-from", m][..],
        &common,
        &["laptop-nvme"],
    ]
    .concat());
    assert_eq!(code, 0, "{err}");
    let (code, whatif, err) = sim(&[
        "whatif",
        "--trace",
        t,
        "--model",
        m,
        "--device",
        "laptop-nvme",
        "--cache-mb",
        "40",
        "--force-cache",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(whatif.contains("whatif: mapping   none"), "{whatif}");
    // Past the inputs statement, the same report, byte for byte.
    let report: String = whatif
        .lines()
        .filter(|l| !l.starts_with("whatif:"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(report, replay);
    assert!(sim_value(&replay, "misses") > 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn whatif_on_the_traces_own_shape_names_the_layouts_model_and_file_as_the_bytes_source() {
    // A same-shape whatif keeps the trace's preamble (its report equals `replay --layout-from`),
    // but the bytes come from the layout file: the `whatif: bytes` line must name that file and
    // the model it describes, never the trace's model.
    let dir = scratch("same-source");
    let model = dir.join("other.layout.csv");
    layout(&model, 4, 16, 4, 200_000);
    let trace_path = dir.join("t.route.csv");
    synthetic_trace(&trace_path, &model, "the-traced-model", 12);
    let (code, out, err) = sim(&[
        "whatif",
        "--trace",
        trace_path.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--device",
        "laptop-nvme",
        "--cache-mb",
        "8",
        "--force-cache",
    ]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("whatif: mapping   none"), "{out}");
    let bytes = out
        .lines()
        .find(|l| l.starts_with("whatif: bytes"))
        .unwrap_or_else(|| panic!("no whatif: bytes line in\n{out}"));
    let want = format!(
        "whatif: bytes     from the layout of other-model in {} (qwen3moe, 4 MoE layers x 16 experts, top-4)",
        model.display()
    );
    assert!(bytes.starts_with(&want), "{bytes}\nwanted {want}");
    assert!(!bytes.contains("the-traced-model"), "{bytes}");
    let _ = std::fs::remove_dir_all(&dir);
}
