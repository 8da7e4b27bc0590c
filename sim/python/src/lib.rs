//! `bmoe_sim._native`: the simulator's commands for Python. Each is the very function the
//! `bmoe-sim` binary runs (`bmoe_sim::cli`), its flags parsed by the same clap definitions and
//! judged by the same checks, writing the same bytes: the binary's stdout and stderr are
//! captured, the files it writes are written by the same code, and the numbers behind them come
//! back as Python values. So a Python result cannot drift from the CLI's; the pytest suite
//! (tests/) compares them with the binary's outputs byte for byte all the same.
//!
//! The Python package around this module (python/bmoe_sim) turns keyword arguments into those
//! flags and lists into NumPy arrays and pandas frames. Besides the CLI's commands, `replay`
//! and `whatif` take an eviction policy written as a Python class (`policy.rs`), handed to the
//! core's cache as an object: no registry involved.
//!
//! Nothing here panics on bad input: a bad flag, path, policy or trace is a Python exception
//! whose message names what was wrong (`errors.rs`).

mod errors;
mod policy;
mod rows;
mod trace;

use bmoe_core::config::MIB;
use bmoe_core::policy::EvictionPolicy;
use bmoe_core::telemetry::csv::summary_pairs;
use bmoe_sim::cli::{self, Cli, Cmd, ReplayOutcome, ReplayRun};
use bmoe_sim::SimError;
use clap::Parser;
use errors::{sim_error, PolicyError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::io::Write;

/// The process environment, as the binary reads it (`BMOE_*` fallbacks of the shared flags).
fn environment() -> Vec<(String, String)> {
    std::env::vars().collect()
}

/// Captured output as text (the simulator writes UTF-8; anything else is kept, replaced).
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// `bmoe-sim SUB ARGS...` parsed by the binary's own definitions; a usage error is a
/// `ValueError` carrying clap's message (the flag and the accepted values).
fn parse(sub: &str, args: Vec<String>) -> PyResult<Cmd> {
    let argv = ["bmoe-sim".to_string(), sub.to_string()]
        .into_iter()
        .chain(args);
    Cli::try_parse_from(argv)
        .map(|c| c.cmd)
        .map_err(|e| errors::usage(sub, &e.render().to_string()))
}

fn wrong_command(sub: &str) -> PyErr {
    PyRuntimeError::new_err(format!(
        "bmoe-sim {sub}: the flags parsed as another command"
    ))
}

/// `bmoe-sim ARGS...` in-process, exactly as the binary runs it: (exit code, stdout, stderr).
/// Every subcommand, including those the package has no function for (`diff`, `bench`,
/// `fuzz`, `bars`).
#[pyfunction(name = "cli")]
fn run_cli(py: Python<'_>, args: Vec<String>) -> (i32, String, String) {
    let env = environment();
    py.detach(move || {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let argv = std::iter::once("bmoe-sim".to_string()).chain(args);
        let code = cli::run(argv, &env, &mut out, &mut err);
        (code, text(out), text(err))
    })
}

/// The core's registered eviction policies, in registry order (`--eviction` accepts these).
#[pyfunction]
fn policy_names() -> Vec<&'static str> {
    bmoe_core::policy::POLICY_NAMES.to_vec()
}

/// A replay (`replay` or `whatif`) with the Rust policy the flags name (`policy` None: the
/// GIL is released while it runs) or with a Python policy object (the GIL is held: every
/// callback runs Python).
fn replay_with<'py, F>(
    py: Python<'py>,
    policy: Option<Bound<'py, PyAny>>,
    run: F,
) -> PyResult<Bound<'py, PyDict>>
where
    F: FnOnce(
            &[(String, String)],
            &mut dyn Write,
            &mut dyn Write,
            Option<Box<dyn EvictionPolicy>>,
        ) -> Result<ReplayRun, SimError>
        + Send,
{
    let env = environment();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let result = match policy {
        None => py.detach(|| run(&env, &mut out, &mut err, None)),
        Some(object) => {
            let (policy, failure) = policy::PyPolicy::new(&object)?;
            let result = run(&env, &mut out, &mut err, Some(Box::new(policy)));
            // The policy's own exception explains a failed run better than the cache's
            // complaint about the victim it did not get.
            if let Some(e) = failure.take() {
                return Err(e);
            }
            result
        }
    };
    let run = result.map_err(sim_error)?;
    replay_dict(py, &run, text(out), text(err))
}

/// What a replay returns to Python: its counters, the summary the report prints (the CSV
/// `# summary` trailer's keys), one summary per turn, and the captured output.
fn replay_dict<'py>(
    py: Python<'py>,
    run: &ReplayRun,
    stdout: String,
    stderr: String,
) -> PyResult<Bound<'py, PyDict>> {
    let p = &run.prepared;
    let d = PyDict::new(py);
    d.set_item("stdout", stdout)?;
    d.set_item("stderr", stderr)?;
    d.set_item("profile", &p.profile.name)?;
    d.set_item("seed", run.seed)?;
    d.set_item("policy", p.cfg.eviction.name())?;
    d.set_item(
        "cache_budget_bytes",
        p.cfg.cache_budget_mb.saturating_mul(MIB),
    )?;
    let counters = PyDict::new(py);
    let pairs = |s| -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in summary_pairs(s) {
            d.set_item(k, v)?;
        }
        Ok(d)
    };
    match &run.outcome {
        ReplayOutcome::Tokens(r) => {
            d.set_item("kind", "tokens")?;
            counters.set_item("steps", p.plan.steps.len())?;
            counters.set_item("decode_steps", r.decode_steps)?;
            set_cache(&counters, &r.cache)?;
            counters.set_item("read_bytes", r.read_bytes)?;
            counters.set_item("read_retries", r.read_retries)?;
            counters.set_item("virtual_s", r.end.as_secs_f64())?;
            d.set_item("summary", pairs(&r.summary)?)?;
            let turns = PyList::empty(py);
            for t in &r.turns {
                turns.append(pairs(t)?)?;
            }
            d.set_item("turns", turns)?;
        }
        ReplayOutcome::Batched(r) => {
            d.set_item("kind", "batched")?;
            counters.set_item("steps", r.steps)?;
            set_cache(&counters, &r.cache)?;
            counters.set_item("read_bytes", r.read_bytes)?;
            counters.set_item("decode_steps", r.decode_steps)?;
            counters.set_item("decode_rows", r.decode_rows)?;
            counters.set_item("decode_read_bytes", r.decode_read_bytes)?;
            counters.set_item("decode_routed_bytes", r.decode_routed_bytes)?;
            counters.set_item("decode_routings", r.decode_routings)?;
            counters.set_item("read_retries", r.read_retries)?;
            counters.set_item("virtual_s", r.end.as_secs_f64())?;
            d.set_item("summary", py.None())?;
            d.set_item("turns", PyList::empty(py))?;
        }
    }
    d.set_item("counters", counters)?;
    Ok(d)
}

fn set_cache(d: &Bound<'_, PyDict>, c: &bmoe_core::CacheCounters) -> PyResult<()> {
    d.set_item("lookups", c.hits + c.misses)?;
    d.set_item("hits", c.hits)?;
    d.set_item("misses", c.misses)?;
    d.set_item("evictions", c.evictions)?;
    d.set_item("rereads", c.rereads)?;
    d.set_item("inserts", c.inserts)?;
    d.set_item("bypasses", c.bypasses)
}

/// `bmoe-sim replay ARGS...`; `policy`, when given, is a Python eviction policy object run in
/// place of `--eviction`'s.
#[pyfunction]
#[pyo3(signature = (args, policy=None))]
fn replay<'py>(
    py: Python<'py>,
    args: Vec<String>,
    policy: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let Cmd::Replay(a) = parse("replay", args)? else {
        return Err(wrong_command("replay"));
    };
    replay_with(py, policy, move |env, out, err, p| {
        cli::replay(a, env, out, err, p)
    })
}

/// `bmoe-sim whatif ARGS...`; `policy` as in `replay`.
#[pyfunction]
#[pyo3(signature = (args, policy=None))]
fn whatif<'py>(
    py: Python<'py>,
    args: Vec<String>,
    policy: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let Cmd::Whatif(a) = parse("whatif", args)? else {
        return Err(wrong_command("whatif"));
    };
    replay_with(py, policy, move |env, out, err, p| {
        cli::whatif(a, env, out, err, p)
    })
}

/// `bmoe-sim sweep ARGS...`: every cell's result (`rows::row_dict`) and the text outputs as
/// the binary writes them (`sweep.csv`, `pivot.md`, `per_layer.csv`, `per_layer.md`); with
/// `write`, every output written into `--out` as the binary writes it, charts included, and
/// the binary's table on stdout.
#[pyfunction]
fn sweep<'py>(py: Python<'py>, args: Vec<String>, write: bool) -> PyResult<Bound<'py, PyDict>> {
    let Cmd::Sweep(a) = parse("sweep", args)? else {
        return Err(wrong_command("sweep"));
    };
    let env = environment();
    let (run, out, err) = py
        .detach(|| {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let run = cli::sweep_cells(&a, &env, &mut out, &mut err)?;
            if write {
                cli::sweep_write(&a, &run, &mut out)?;
            }
            Ok::<_, SimError>((run, out, err))
        })
        .map_err(sim_error)?;
    let layer_ids = run.prepared.layout_layer_ids();
    let stats = bmoe_sim::sweep::report::analyse(&run.rows, a.bootstrap as usize, a.seed);
    let files = PyDict::new(py);
    for (name, body) in
        bmoe_sim::sweep::text_outputs(&run.rows, &stats, &layer_ids, run.x, &run.trace_name)
    {
        files.set_item(name, body)?;
    }
    let cells = PyList::empty(py);
    for r in &run.rows {
        let d = rows::row_dict(py, r)?;
        d.set_item("layer_ids", &layer_ids)?;
        d.set_item("trace_name", &run.trace_name)?;
        cells.append(d)?;
    }
    let d = PyDict::new(py);
    d.set_item("stdout", text(out))?;
    d.set_item("stderr", text(err))?;
    d.set_item("profile", &run.prepared.profile.name)?;
    d.set_item("trace_name", &run.trace_name)?;
    d.set_item("layer_ids", layer_ids)?;
    d.set_item("cells", cells)?;
    d.set_item("files", files)?;
    Ok(d)
}

/// The cells `bmoe-sim sweep ARGS...` would run, in its order, each as the flags of a sweep of
/// that one cell: run them anywhere (one process, a Dask cluster), hand the results to
/// `sweep_report` in this order, and the tables are the sweep's, byte for byte.
#[pyfunction]
fn sweep_grid<'py>(py: Python<'py>, args: Vec<String>) -> PyResult<Bound<'py, PyList>> {
    let Cmd::Sweep(a) = parse("sweep", args)? else {
        return Err(wrong_command("sweep"));
    };
    let env = environment();
    let plan = py
        .detach(|| cli::sweep_plan(&a, &env, &mut std::io::sink(), &mut std::io::sink()))
        .map_err(sim_error)?;
    let cells = PyList::empty(py);
    for (predictor, (budget, policy, lanes, overlap)) in plan.cells() {
        let d = PyDict::new(py);
        match &plan.experts_per_layer {
            Some(n) => {
                let i = plan
                    .budgets
                    .iter()
                    .position(|&b| b == budget)
                    .ok_or_else(|| PyRuntimeError::new_err("a cell's budget is not the sweep's"))?;
                d.set_item("experts_per_layer", vec![n[i]])?;
            }
            None => d.set_item("budgets_mb", vec![budget / MIB])?,
        }
        d.set_item("policies", vec![policy])?;
        // A cache-only cell has no lanes or overlap (the flags refuse them): it keeps the
        // sweep's `cache_only` from the flags `sweep_cell` is given.
        if plan.mode == bmoe_sim::sweep::Mode::FullTiming {
            d.set_item("lanes", vec![lanes])?;
            d.set_item("overlap", if overlap { "on" } else { "off" })?;
        }
        d.set_item("predictors", vec![predictor.name()])?;
        cells.append(d)?;
    }
    Ok(cells)
}

/// The sweep's text outputs from cells run apart (`sweep_grid`), in the sweep's order: the
/// same functions the binary writes its files with, over the same rows.
#[pyfunction]
#[pyo3(signature = (cells, layer_ids, x, bootstrap, seed, trace_name))]
fn sweep_report<'py>(
    py: Python<'py>,
    cells: Vec<Bound<'py, PyAny>>,
    layer_ids: Vec<u32>,
    x: &str,
    bootstrap: usize,
    seed: u64,
    trace_name: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let x = bmoe_sim::sweep::report::XAxis::parse(x).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "x={x:?} is not an axis: mib, experts or pct"
        ))
    })?;
    let rows = cells
        .iter()
        .enumerate()
        .map(|(i, c)| rows::row_from(c, i))
        .collect::<PyResult<Vec<_>>>()?;
    let files = py.detach(|| {
        let stats = bmoe_sim::sweep::report::analyse(&rows, bootstrap, seed);
        bmoe_sim::sweep::text_outputs(&rows, &stats, &layer_ids, x, trace_name)
    });
    let d = PyDict::new(py);
    for (name, body) in files {
        d.set_item(name, body)?;
    }
    Ok(d)
}

/// `bmoe-sim stats ARGS...`: the statistics, the summary the binary prints, and with `write`
/// every file written into `--out` as the binary writes it.
#[pyfunction]
fn stats<'py>(py: Python<'py>, args: Vec<String>, write: bool) -> PyResult<Bound<'py, PyDict>> {
    let Cmd::Stats(a) = parse("stats", args)? else {
        return Err(wrong_command("stats"));
    };
    let (s, out) = py
        .detach(|| {
            let mut out = Vec::new();
            cli::stats(&a, write, &mut out).map(|s| (s, out))
        })
        .map_err(sim_error)?;
    let d = PyDict::new(py);
    d.set_item("stdout", text(out))?;
    d.set_item("layer_ids", &s.layer_ids)?;
    d.set_item("n_expert", s.n_expert)?;
    d.set_item("top_k", s.k)?;
    d.set_item("tokens", s.tokens)?;
    d.set_item("turns", s.turns)?;
    d.set_item("used_prefill", s.used_prefill)?;
    d.set_item("routings", s.routings())?;
    d.set_item("popularity", &s.popularity)?;
    d.set_item("stack_distance", &s.stack)?;
    d.set_item("cold", s.cold)?;
    let curve: Vec<f64> = (1..=s.stack.len()).map(|c| s.lru_hit_at(c)).collect();
    d.set_item("lru_hit_curve", curve)?;
    d.set_item("overlap", &s.overlap)?;
    d.set_item("working_set", &s.working_set)?;
    Ok(d)
}

/// `bmoe-sim convert ARGS...`: the route trace written to `--out`, and what it holds.
#[pyfunction]
fn convert<'py>(py: Python<'py>, args: Vec<String>) -> PyResult<Bound<'py, PyDict>> {
    let Cmd::Convert(a) = parse("convert", args)? else {
        return Err(wrong_command("convert"));
    };
    let (c, out) = py
        .detach(|| {
            let mut out = Vec::new();
            cli::convert(&a, &mut out).map(|c| (c, out))
        })
        .map_err(sim_error)?;
    let d = PyDict::new(py);
    d.set_item("stdout", text(out))?;
    d.set_item("out", a.out.display().to_string())?;
    d.set_item("tokens", c.tokens)?;
    d.set_item("routings", c.routings)?;
    d.set_item("layers", c.layers)?;
    d.set_item("n_expert", c.n_expert)?;
    d.set_item("top_k", c.top_k)?;
    Ok(d)
}

/// `bmoe-sim calibrate ARGS...`: the fitted profile (written to `--out`, and as its JSON
/// text), the fit's notes, the self-check of each run, and the binary's exit code.
#[pyfunction]
fn calibrate<'py>(py: Python<'py>, args: Vec<String>) -> PyResult<Bound<'py, PyDict>> {
    let Cmd::Calibrate(a) = parse("calibrate", args)? else {
        return Err(wrong_command("calibrate"));
    };
    let ((c, code), out, err) = py
        .detach(|| {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            cli::calibrate(&a, &mut out, &mut err).map(|r| (r, out, err))
        })
        .map_err(sim_error)?;
    let d = PyDict::new(py);
    d.set_item("stdout", text(out))?;
    d.set_item("stderr", text(err))?;
    d.set_item("exit_code", code)?;
    d.set_item("profile_json", c.profile.to_json())?;
    d.set_item("notes", &c.notes)?;
    let checks = PyList::empty(py);
    for s in &c.self_check {
        let check = PyDict::new(py);
        check.set_item("run", &s.run)?;
        check.set_item("tok_s_predicted", s.tok_s_predicted)?;
        check.set_item("tok_s_measured", s.tok_s_measured)?;
        check.set_item("wall_p90_ms_predicted", s.wall_p90_ms_predicted)?;
        check.set_item("wall_p90_ms_measured", s.wall_p90_ms_measured)?;
        check.set_item("misses", s.misses())?;
        check.set_item("line", s.line())?;
        checks.append(check)?;
    }
    d.set_item("self_check", checks)?;
    Ok(d)
}

/// The bmoe simulator's commands, over the same core and the same functions as the
/// `bmoe-sim` binary (the `bmoe_sim` package wraps them).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_cli, m)?)?;
    m.add_function(wrap_pyfunction!(policy_names, m)?)?;
    m.add_function(wrap_pyfunction!(trace::load_trace, m)?)?;
    m.add_function(wrap_pyfunction!(replay, m)?)?;
    m.add_function(wrap_pyfunction!(whatif, m)?)?;
    m.add_function(wrap_pyfunction!(sweep, m)?)?;
    m.add_function(wrap_pyfunction!(sweep_grid, m)?)?;
    m.add_function(wrap_pyfunction!(sweep_report, m)?)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(convert, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate, m)?)?;
    m.add_class::<trace::Trace>()?;
    m.add("PolicyError", m.py().get_type::<PolicyError>())?;
    Ok(())
}
