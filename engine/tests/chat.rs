//! Our minijinja renderer against jinja2 set up as transformers sets it up: every real chat
//! template in `../shared/data/templates` renders the fixed conversation of
//! `scripts/render-chat-golden.py` byte for byte like the golden files it wrote, and fails
//! where jinja2 failed. Also `think_ctl` on the templates the telemetry contract names.

use std::path::PathBuf;

use bmoe_engine::chat::{ChatFormat, ChatTemplate, CivilTime, Message, ThinkCtl};
use bmoe_engine::testdata::shared_path;
use bmoe_engine::vocab::BUILTIN_CHAT_TEMPLATE;

// Keep in step with scripts/render-chat-golden.py.
const FIXED_NOW: CivilTime = CivilTime {
    year: 2025,
    month: 3,
    day: 14,
    hour: 15,
    minute: 9,
    second: 26,
};
const BOS: &str = "<|bos|>";
const EOS: &str = "<|eos|>";

/// Where jinja2 raises and minijinja renders, and why. Python cannot iterate `None`; minijinja
/// iterates none as empty, so a tool-use-only template that loops over `tools` without a guard
/// fails under transformers when no tools are passed and renders an empty tool list here.
/// minijinja offers no switch for this, and the direction is benign (a prompt instead of an
/// error). Listed exactly, so a change either way fails the test.
const RENDERS_WHERE_JINJA2_RAISES: &[&str] = &[
    "CohereForAI-c4ai-command-r-plus-tool_use",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
];

fn conversation() -> Vec<Message> {
    vec![
        Message::new("system", "You are a careful assistant. Answer briefly."),
        Message::new("user", "What is 17 * 3?"),
        Message::new("assistant", "17 * 3 = 51.")
            .with_reasoning("17 * 3 is 17 + 17 + 17. That is 34 + 17 = 51."),
        Message::new(
            "user",
            "And in Ünïcode — write it as \"fünfzig-eins\"? <ok> & done.",
        ),
    ]
}

fn variant(name: &str) -> (bool, Option<bool>) {
    match name {
        "think" => (true, Some(true)),
        "nothink" => (true, Some(false)),
        "default" => (false, None),
        other => panic!("unknown variant {other} in the manifest"),
    }
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/chat")
}

/// A model template from `../shared`, or our own built-in one (`bmoe-builtin`).
fn load_template(stem: &str) -> Option<ChatTemplate> {
    let source = if stem == "bmoe-builtin" {
        BUILTIN_CHAT_TEMPLATE.to_string()
    } else {
        let path = shared_path(&format!("data/templates/{stem}.jinja"))?;
        std::fs::read_to_string(&path).expect("read template")
    };
    Some(
        ChatTemplate::with_fixed_time(&source, BOS, EOS, FIXED_NOW)
            .unwrap_or_else(|e| panic!("{stem}: {e}")),
    )
}

#[test]
fn templates_render_like_transformers() {
    if shared_path("data/templates").is_none() {
        return;
    }
    let manifest =
        std::fs::read_to_string(golden_dir().join("manifest.tsv")).expect("read manifest.tsv");
    let messages = conversation();
    let mut n_checked = 0;
    let mut n_divergent = 0;
    let mut failures = Vec::new();
    for line in manifest
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let fields: Vec<&str> = line.splitn(4, '\t').collect();
        let [stem, var, status, detail] = fields[..] else {
            panic!("bad manifest line {line:?}");
        };
        let Some(template) = load_template(stem) else {
            return;
        };
        let (agp, think) = variant(var);
        let ours = template.render(&messages, agp, think);
        match status {
            "ok" => {
                let golden_path = golden_dir().join(format!("{stem}.{var}.txt"));
                let golden = std::fs::read_to_string(&golden_path).expect("read golden");
                match ours {
                    Ok(text) if text == golden => {}
                    Ok(text) => {
                        let at = text
                            .bytes()
                            .zip(golden.bytes())
                            .position(|(a, b)| a != b)
                            .unwrap_or(text.len().min(golden.len()));
                        let lo = at.saturating_sub(40);
                        failures.push(format!(
                            "{stem} [{var}]: differs at byte {at}\n  ours:   {:?}\n  golden: {:?}",
                            text.get(lo..(at + 60).min(text.len()))
                                .unwrap_or("<non-utf8 cut>"),
                            golden
                                .get(lo..(at + 60).min(golden.len()))
                                .unwrap_or("<non-utf8 cut>")
                        ));
                    }
                    Err(e) => {
                        failures.push(format!("{stem} [{var}]: we fail, jinja2 renders: {e}"))
                    }
                }
            }
            "error" => {
                let expected_divergence = RENDERS_WHERE_JINJA2_RAISES.contains(&stem)
                    && detail.contains("'NoneType' object is not iterable");
                if expected_divergence {
                    if ours.is_err() {
                        failures.push(format!(
                            "{stem} [{var}]: listed as rendering where jinja2 raises, but we fail too"
                        ));
                    }
                    n_divergent += 1;
                } else if let Ok(text) = ours {
                    failures.push(format!(
                        "{stem} [{var}]: jinja2 fails ({detail}) but we render {} bytes",
                        text.len()
                    ));
                }
            }
            other => panic!("bad status {other}"),
        }
        n_checked += 1;
    }
    eprintln!(
        "{n_checked} template renders checked ({n_divergent} known divergences), {} mismatches",
        failures.len()
    );
    assert!(n_checked > 0);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn think_ctl_of_named_models() {
    let cases = [
        ("bmoe-builtin", ThinkCtl::Template),
        ("Qwen-Qwen3-0.6B", ThinkCtl::Template),
        ("Qwen3.5-4B", ThinkCtl::Template),
        ("google-gemma-4-31B-it", ThinkCtl::Template),
        ("openai-gpt-oss-120b", ThinkCtl::Prefill),
        // A think channel of the format's own (`<|open|>think`), closed and followed by the
        // response channel: a section the turn can start past.
        ("Kimi-K3", ThinkCtl::Prefill),
        // Its system prompt says it: with thinking disabled the response begins right after
        // the `</mm:think>` prefix.
        ("MiniMax-M3", ThinkCtl::Prefill),
        // Harmony-like recipients: reasoning `to=self`, the answer `to=user`.
        ("muse-glimmer", ThinkCtl::Prefill),
        ("LFM2.5-8B-A1B", ThinkCtl::None),
        ("LFM2.5-Instruct", ThinkCtl::Template),
        ("LFM2-8B-A1B", ThinkCtl::Template),
        ("Qwen-Qwen2.5-7B-Instruct", ThinkCtl::Template),
        // This copy of the template closes the span when enable_thinking is false.
        (
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            ThinkCtl::Template,
        ),
        // The original always opens `<think>` in the generation prompt.
        ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", ThinkCtl::None),
    ];
    for (stem, expected) in cases {
        let Some(t) = load_template(stem) else {
            return;
        };
        assert_eq!(t.think_control(), expected, "{stem}");
    }
}

/// `think:false` on a `prefill` model (gpt-oss's harmony template, rendered by our chat module;
/// `gates/tests/gpt_oss.rs` runs it on a gpt-oss model in a session): the template ignores `enable_thinking`, so the
/// turn's prompt is followed by what the template itself writes before a final answer —
/// found by rendering, the analysis channel skipped. `think:true` leaves the channel to the
/// model; `template` and `none` models get nothing appended.
#[test]
fn think_false_starts_a_prefill_model_past_its_reasoning() {
    let Some(t) = load_template("openai-gpt-oss-120b") else {
        return;
    };
    assert_eq!(
        t.answer_prefill().as_deref(),
        Some("<|channel|>final<|message|>")
    );
    let f = ChatFormat::new(t, false);
    assert_eq!(f.think_ctl(), ThinkCtl::Prefill);
    let chat = vec![
        Message::new("user", "What is 17 * 3?"),
        Message::new("assistant", "51."),
        Message::new("user", "And 18 * 3?"),
    ];
    let on = f.prompt(&chat, true).expect("render");
    let off = f.prompt(&chat, false).expect("render");
    assert!(
        on.ends_with("<|start|>user<|message|>And 18 * 3?<|end|><|start|>assistant"),
        "{on}"
    );
    assert_eq!(off, format!("{on}<|channel|>final<|message|>"));
    // The earlier answer sits in the final channel the same way, so a continued chat's render
    // extends what the KV holds.
    assert!(
        off.contains("<|start|>assistant<|channel|>final<|message|>51.<|end|>"),
        "{off}"
    );

    for (stem, ctl) in [
        ("Qwen-Qwen3-0.6B", ThinkCtl::Template),
        ("LFM2.5-8B-A1B", ThinkCtl::None),
    ] {
        let Some(t) = load_template(stem) else {
            return;
        };
        let plain = t.render(&chat, true, Some(false)).expect("render");
        let f = ChatFormat::new(t, true);
        assert_eq!(f.think_ctl(), ctl, "{stem}");
        assert_eq!(f.prompt(&chat, false).expect("render"), plain, "{stem}");
    }
}

#[test]
fn builtin_template_keeps_reasoning_of_the_last_turn_only() {
    let t = load_template("bmoe-builtin").expect("built-in template");
    let chat = vec![
        Message::new("user", "Hi"),
        Message::new("assistant", "Hello.").with_reasoning("Greet."),
        Message::new("user", "Sum 1+1"),
        Message::new("assistant", "2").with_reasoning("\nOne plus one.\n"),
    ];
    assert_eq!(
        t.render(&chat, false, None).expect("render"),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n\
         <|im_start|>user\nSum 1+1<|im_end|>\n\
         <|im_start|>assistant\n<think>\nOne plus one.\n</think>\n\n2<|im_end|>\n"
    );
    // Reasoning left inline in the content is split out the same way.
    let inline = vec![
        Message::new("user", "Sum 1+1"),
        Message::new("assistant", "<think>\nOne plus one.\n</think>\n\n2"),
    ];
    assert!(t
        .render(&inline, false, None)
        .expect("render")
        .ends_with("<|im_start|>assistant\n<think>\nOne plus one.\n</think>\n\n2<|im_end|>\n"));
}

#[test]
#[ignore = "prints think_ctl for every template; run with --ignored --nocapture"]
fn print_think_ctl_of_all_templates() {
    let Some(dir) = shared_path("data/templates") else {
        return;
    };
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .expect("read dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".jinja"))
        .collect();
    names.sort();
    for n in names {
        let stem = n.trim_end_matches(".jinja");
        if let Some(t) = load_template(stem) {
            eprintln!("{stem:55} {}", t.think_control().as_str());
        }
    }
}
