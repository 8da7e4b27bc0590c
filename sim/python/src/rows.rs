//! A sweep cell's result (`bmoe_sim::sweep::Row`) as a Python dict and back, every field
//! kept exactly (integers as ints, floats as the same f64s), so cells run apart — in other
//! processes, on a Dask cluster — and brought back give `sweep_report` the rows a sweep would
//! have had, and the same table bytes. A cache-only cell (`cache_only=True`) models no time:
//! its timing fields (`read_bytes` to `mgmt_s_per_tok`, a turn's `tokens` and `decode_s`) are
//! `None`.

use bmoe_sim::sweep::{Row, Timing, TurnStat, TurnTime};
use pyo3::exceptions::{PyKeyError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// `r` as a dict of its fields; `per_layer` a list of `[routings, hits]`, `per_turn` a list
/// of `[routings, hits, tokens, decode_s]`.
pub fn row_dict<'py>(py: Python<'py>, r: &Row) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("predictor", &r.predictor)?;
    d.set_item("budget_bytes", r.budget_bytes)?;
    d.set_item("experts_per_layer", r.experts_per_layer)?;
    d.set_item("bank_frac", r.bank_frac)?;
    d.set_item("policy", &r.policy)?;
    d.set_item("lanes", r.lanes)?;
    d.set_item("overlap", r.overlap)?;
    d.set_item("lookups", r.lookups)?;
    d.set_item("hits", r.hits)?;
    d.set_item("misses", r.misses)?;
    d.set_item("evictions", r.evictions)?;
    d.set_item("rereads", r.rereads)?;
    d.set_item("inserts", r.inserts)?;
    d.set_item("bypasses", r.bypasses)?;
    let t = r.timing.as_ref();
    d.set_item("read_bytes", t.map(|t| t.read_bytes))?;
    d.set_item("spec_experts", t.map(|t| t.spec_experts))?;
    d.set_item("spec_useful", t.map(|t| t.spec_useful))?;
    d.set_item("spec_read_bytes", t.map(|t| t.spec_read_bytes))?;
    d.set_item("tokens", t.map(|t| t.tokens))?;
    d.set_item("tok_s", t.map(|t| t.tok_s))?;
    d.set_item("s_per_tok", t.map(|t| t.s_per_tok))?;
    d.set_item("compute_s_per_tok", t.map(|t| t.compute_s_per_tok))?;
    d.set_item("io_s_per_tok", t.map(|t| t.io_s_per_tok))?;
    d.set_item("stall_s_per_tok", t.map(|t| t.stall_s_per_tok))?;
    d.set_item("mgmt_s_per_tok", t.map(|t| t.mgmt_s_per_tok))?;
    let per_layer = PyList::empty(py);
    for &(routings, hits) in &r.per_layer {
        per_layer.append(vec![routings, hits])?;
    }
    d.set_item("per_layer", per_layer)?;
    let per_turn = PyList::empty(py);
    for t in &r.per_turn {
        per_turn.append((
            t.routings,
            t.hits,
            t.time.map(|x| x.tokens),
            t.time.map(|x| x.decode_s),
        ))?;
    }
    d.set_item("per_turn", per_turn)?;
    Ok(d)
}

/// Field `key` of cell `i`, named in the error when absent or of the wrong type.
fn field<'py, T: FromPyObjectOwned<'py>>(
    d: &Bound<'py, PyAny>,
    key: &str,
    i: usize,
) -> PyResult<T> {
    let v = d
        .get_item(key)
        .map_err(|_| PyKeyError::new_err(format!("sweep cell {i}: no field {key:?}")))?;
    v.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        PyTypeError::new_err(format!(
            "sweep cell {i}: field {key:?}: {}",
            e.value(d.py())
        ))
    })
}

/// The row `row_dict` made (cell `i` of a list, for messages).
pub fn row_from(d: &Bound<'_, PyAny>, i: usize) -> PyResult<Row> {
    let per_layer = field::<Vec<Bound<'_, PyAny>>>(d, "per_layer", i)?
        .iter()
        .map(|l| Ok((item(l, 0, "per_layer", i)?, item(l, 1, "per_layer", i)?)))
        .collect::<PyResult<Vec<(u64, u64)>>>()?;
    let per_turn = field::<Vec<Bound<'_, PyAny>>>(d, "per_turn", i)?
        .iter()
        .map(|t| {
            let tokens: Option<u64> = item(t, 2, "per_turn", i)?;
            let decode_s: Option<f64> = item(t, 3, "per_turn", i)?;
            Ok(TurnStat {
                routings: item(t, 0, "per_turn", i)?,
                hits: item(t, 1, "per_turn", i)?,
                time: tokens
                    .zip(decode_s)
                    .map(|(tokens, decode_s)| TurnTime { tokens, decode_s }),
            })
        })
        .collect::<PyResult<Vec<TurnStat>>>()?;
    Ok(Row {
        predictor: field(d, "predictor", i)?,
        budget_bytes: field(d, "budget_bytes", i)?,
        experts_per_layer: field(d, "experts_per_layer", i)?,
        bank_frac: field(d, "bank_frac", i)?,
        policy: field(d, "policy", i)?,
        lanes: field(d, "lanes", i)?,
        overlap: field(d, "overlap", i)?,
        lookups: field(d, "lookups", i)?,
        hits: field(d, "hits", i)?,
        misses: field(d, "misses", i)?,
        evictions: field(d, "evictions", i)?,
        rereads: field(d, "rereads", i)?,
        inserts: field(d, "inserts", i)?,
        bypasses: field(d, "bypasses", i)?,
        timing: timing_from(d, i)?,
        per_layer,
        per_turn,
    })
}

/// A cell's timing fields: all numbers (a full-timing cell) or all `None` (cache-only).
fn timing_from(d: &Bound<'_, PyAny>, i: usize) -> PyResult<Option<Timing>> {
    if field::<Option<f64>>(d, "tok_s", i)?.is_none() {
        return Ok(None);
    }
    Ok(Some(Timing {
        read_bytes: field(d, "read_bytes", i)?,
        spec_experts: field(d, "spec_experts", i)?,
        spec_useful: field(d, "spec_useful", i)?,
        spec_read_bytes: field(d, "spec_read_bytes", i)?,
        tokens: field(d, "tokens", i)?,
        tok_s: field(d, "tok_s", i)?,
        s_per_tok: field(d, "s_per_tok", i)?,
        compute_s_per_tok: field(d, "compute_s_per_tok", i)?,
        io_s_per_tok: field(d, "io_s_per_tok", i)?,
        stall_s_per_tok: field(d, "stall_s_per_tok", i)?,
        mgmt_s_per_tok: field(d, "mgmt_s_per_tok", i)?,
    }))
}

/// Element `k` of an entry of list `key` of cell `i` (a list or a tuple).
fn item<'py, T: FromPyObjectOwned<'py>>(
    entry: &Bound<'py, PyAny>,
    k: usize,
    key: &str,
    i: usize,
) -> PyResult<T> {
    entry
        .get_item(k)
        .ok()
        .and_then(|v| v.extract::<T>().ok())
        .ok_or_else(|| {
            PyTypeError::new_err(format!(
                "sweep cell {i}: an entry of {key:?} has no number at index {k}: {}",
                entry
                    .repr()
                    .map_or_else(|_| "?".to_string(), |r| r.to_string())
            ))
        })
}
