//! Out-of-sample prediction gate (issue 19): the simulator is calibrated on ONE engine run and
//! must predict the decode tok/s of three other configurations — other budgets (together
//! spanning at least 3× the read volume) and other eviction policies — each within the
//! machine's measured run-to-run noise + 10 %.
//!
//! The engine runs the tiny model (`--overlap`, `-t 2`) in four configurations, three times
//! each, interleaved after a warm-up (calibration, then the three predicted ones, rep by rep),
//! so the noise estimate spans the same minutes as the calibration; all runs share one prompt,
//! so every configuration routes the same tokens and the calibration run's route trace, replayed
//! at another budget and policy, reads exactly what that configuration read (checked: `bmoe-sim
//! diff --exact-only` must pass). As in `sim_timing.rs`, the noise is (max − min) / median of the
//! three identical runs, summed over the calibration configuration and the predicted one (the
//! simulation inherits the one's noise and is compared with the other's median); the tolerance
//! is that + 10 %.
//!
//! What makes this a test that can fail: the lanes' cost (the kernels' slowdown while reads are
//! in flight, the lanes' dispatch time while the kernels run). With the fit before issue 19 (one
//! compute rate, the lanes' cost folded in at the calibration run's read volume; `calibrate
//! --single-rate`) the prediction drifts with the read volume. The test prints that fit's errors
//! beside the gated ones, with whether each would be inside the tolerance, so a CI log shows
//! how much the new terms buy. To show the gate failing on a wrong model,
//! `BMOE_SIM_PREDICT_JUDGE=single-rate` gates that fit instead, and `BMOE_SIM_PREDICT_JUDGE=
//! profile:NAME` a given profile (e.g. `profile:origin-12gb-phone`, a device never measured). `.config/nextest.toml` runs this test alone.

use bmoe_core::telemetry::MetricsCsv;
use bmoe_gates::{run, scratch_dir, tiny};
use std::path::Path;

const PROMPT: &str = "The cache of experts keeps what the router asked for, and the streamer reads the rest from flash.";
const TOKENS: &str = "96";

/// Calibration: (MiB, policy).
const CAL: (&str, &str) = ("6", "lru");
/// Predicted: other budgets and policies.
const PREDICTED: [(&str, &str); 3] = [("3", "lfu"), ("8", "lru"), ("12", "lfru")];

/// Allowed error on top of the measured noise.
const MARGIN: f64 = 0.10;

/// `bmoe_gates::sim` over owned arguments.
fn sim(args: &[String]) -> (i32, String, String) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    bmoe_gates::sim(&args)
}

/// Decode tok/s and MiB read per token of a metrics CSV.
fn speed(csv: &Path) -> (f64, f64) {
    let m = MetricsCsv::parse(&std::fs::read_to_string(csv).unwrap()).unwrap();
    let w: Vec<f64> = m.column_values("wall_ms").unwrap();
    let b: Vec<f64> = m.column_values("read_bytes").unwrap();
    let n = w.len() as f64;
    (
        n / (w.iter().sum::<f64>() / 1000.0),
        b.iter().sum::<f64>() / n / (1u64 << 20) as f64,
    )
}

fn median3(mut v: [f64; 3]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[1]
}

fn spread(v: [f64; 3]) -> f64 {
    let (lo, hi) = v
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
    (hi - lo) / median3(v)
}

fn median_index(v: [f64; 3]) -> usize {
    let m = median3(v);
    (0..3).find(|&i| v[i] == m).unwrap_or(0)
}

#[test]
fn calibrated_on_one_run_the_simulator_predicts_other_budgets_and_policies() {
    let dir = scratch_dir("sim-predict");
    let p = |n: &str| dir.join(n).display().to_string();
    let engine = |mb: &str, policy: &str, csv: &str, extra: &[&str]| {
        let mut a = vec![
            "-p",
            PROMPT,
            "-n",
            TOKENS,
            "-t",
            "2",
            "--moe-stream",
            "--overlap",
            "--cache-mb",
            mb,
            "--force-cache",
            "--eviction",
            policy,
            "--csv",
            csv,
        ];
        a.extend_from_slice(extra);
        let r = run(&tiny(), &a);
        assert_eq!(r.code, 0, "{}", r.stderr);
    };
    engine(CAL.0, CAL.1, &p("warmup.csv"), &[]);
    let cal_csv = [0, 1, 2].map(|i| p(&format!("cal{i}.csv")));
    let cal_route = [0, 1, 2].map(|i| p(&format!("cal{i}.route.csv")));
    let cal_io = [0, 1, 2].map(|i| p(&format!("cal{i}.io.csv")));
    let pred_csv = [0, 1, 2].map(|c| [0, 1, 2].map(|i| p(&format!("pred{c}.{i}.csv"))));
    for i in 0..3 {
        engine(
            CAL.0,
            CAL.1,
            &cal_csv[i],
            &["--route-trace", &cal_route[i], "--io-trace", &cal_io[i]],
        );
        for (c, (mb, policy)) in PREDICTED.iter().enumerate() {
            engine(mb, policy, &pred_csv[c][i], &[]);
        }
    }
    let cs = cal_csv.clone().map(|c| speed(Path::new(&c)));
    let cal_tok_s = cs.map(|x| x.0);
    let cpick = median_index(cal_tok_s);
    eprintln!(
        "calibration {} MiB {}: {:.1} / {:.1} / {:.1} tok/s, {:.2} MiB/token, spread {:.1}%",
        CAL.0,
        CAL.1,
        cal_tok_s[0],
        cal_tok_s[1],
        cal_tok_s[2],
        cs[cpick].1,
        100.0 * spread(cal_tok_s)
    );

    // Two profiles from the median calibration run: the gated one, and the single-rate fit
    // (before issue 19) for comparison.
    let calibrate = |out: &str, extra: &[&str]| {
        let mut a: Vec<String> = vec![
            "calibrate".into(),
            "--csv".into(),
            cal_csv[cpick].clone(),
            "--trace".into(),
            cal_route[cpick].clone(),
            "--io-trace".into(),
            cal_io[cpick].clone(),
            "--out".into(),
            out.into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        let (code, out, err) = sim(&a);
        assert_eq!(code, 0, "calibrate: {err}");
        eprintln!("{}", out.trim_end());
    };
    let (prof, single) = (p("profile.json"), p("single-rate.json"));
    calibrate(&prof, &[]);
    calibrate(&single, &["--single-rate"]);

    let judge = std::env::var("BMOE_SIM_PREDICT_JUDGE").unwrap_or_default();
    let judge_single = judge == "single-rate";
    let prof = match judge.strip_prefix("profile:") {
        Some(name) => name.to_string(),
        None => prof,
    };
    if !judge.is_empty() {
        eprintln!("BMOE_SIM_PREDICT_JUDGE={judge}: gating {prof} (a deliberately wrong model)");
    }
    let mut volumes = Vec::new();
    let mut failures = Vec::new();
    for (c, (mb, policy)) in PREDICTED.iter().enumerate() {
        let ms = pred_csv[c].clone().map(|x| speed(Path::new(&x)));
        let tok_s = ms.map(|x| x.0);
        let pick = median_index(tok_s);
        let measured = tok_s[pick];
        volumes.push(ms[pick].1);
        let tol = MARGIN + spread(tok_s) + spread(cal_tok_s);
        let predict = |profile: &str, tag: &str| -> f64 {
            let out = p(&format!("pred{c}.{tag}.sim.csv"));
            let (code, _, err) = sim(&[
                "replay".into(),
                "--trace".into(),
                cal_route[cpick].clone(),
                "--profile".into(),
                profile.into(),
                "--moe-stream".into(),
                "--overlap".into(),
                "--cache-mb".into(),
                mb.to_string(),
                "--force-cache".into(),
                "--eviction".into(),
                policy.to_string(),
                "--csv".into(),
                out.clone(),
            ]);
            assert_eq!(code, 0, "replay: {err}");
            // Counts are exact: the calibration run's routing at this budget and policy reads
            // what this configuration's engine run read.
            let (code, report, _) = sim(&[
                "diff".into(),
                "--exact-only".into(),
                out.clone(),
                pred_csv[c][pick].clone(),
            ]);
            assert_eq!(
                code, 0,
                "{mb} MiB {policy}: the replay's counts differ\n{report}"
            );
            speed(Path::new(&out)).0 / measured - 1.0
        };
        let (mut err, mut err_single) = (predict(&prof, "fit"), predict(&single, "single"));
        if judge_single {
            std::mem::swap(&mut err, &mut err_single);
        }
        eprintln!(
            "{mb} MiB {policy}: {:.2} MiB/token; measured {:.1} / {:.1} / {:.1} tok/s (median {measured:.1}); \
             predicted {:+.1}% (the other fit {:+.1}%{}); tolerance {:.1}% = 10% + noise {:.1}%",
            ms[pick].1,
            tok_s[0],
            tok_s[1],
            tok_s[2],
            100.0 * err,
            100.0 * err_single,
            if err_single.abs() > tol { ", outside" } else { ", inside" },
            100.0 * tol,
            100.0 * (tol - MARGIN)
        );
        if err.abs() > tol {
            failures.push(format!(
                "{mb} MiB {policy}: predicted tok/s {:+.1}% off the median measured run, tolerance {:.1}%",
                100.0 * err,
                100.0 * tol
            ));
        }
    }
    let (lo, hi) = volumes
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
    assert!(
        hi >= 3.0 * lo,
        "the predicted configurations must span 3x the read volume: {volumes:?} MiB/token"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
