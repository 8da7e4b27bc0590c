//! `load_trace`: a route trace read and checked as every command reads it
//! (`bmoe_sim::cli::load_trace`: a malformed file is refused with its line and field), with
//! its preamble's properties and its rows as columns the package turns into NumPy arrays.

use crate::errors::sim_error;
use bmoe_core::records::Phase;
use bmoe_core::telemetry::route_trace::RouteTrace;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::Arc;

/// A route trace (route_trace v1), parsed.
#[pyclass(frozen, module = "bmoe_sim._native")]
pub struct Trace {
    path: PathBuf,
    trace: Arc<RouteTrace>,
}

/// Read and check the route trace at `path`.
#[pyfunction]
pub fn load_trace(py: Python<'_>, path: PathBuf) -> PyResult<Trace> {
    let trace = py
        .detach(|| bmoe_sim::cli::load_trace(&path))
        .map_err(sim_error)?;
    Ok(Trace {
        path,
        trace: Arc::new(trace),
    })
}

#[pymethods]
impl Trace {
    /// The file it was read from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// The preamble: model, arch, n_layer, n_expert, top_k (n_expert_used), gating, the MoE
    /// layers (model layer ids, expert and dense bytes), notes and any other key.
    #[getter]
    fn preamble<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = &self.trace.preamble;
        let d = PyDict::new(py);
        d.set_item("model", &p.model)?;
        d.set_item("arch", &p.arch)?;
        d.set_item("n_layer", p.n_layer)?;
        d.set_item("n_expert", p.n_expert)?;
        d.set_item("top_k", p.n_expert_used)?;
        d.set_item("gating", p.gating.to_string())?;
        d.set_item(
            "moe_layers",
            p.layers.iter().map(|l| l.layer).collect::<Vec<_>>(),
        )?;
        d.set_item(
            "expert_bytes",
            p.layers.iter().map(|l| l.expert_bytes).collect::<Vec<_>>(),
        )?;
        d.set_item(
            "dense_bytes",
            p.layers.iter().map(|l| l.dense_bytes).collect::<Vec<_>>(),
        )?;
        d.set_item("notes", &p.notes)?;
        let extra = PyDict::new(py);
        for (k, v) in &p.extra {
            extra.set_item(k, v)?;
        }
        d.set_item("extra", extra)?;
        Ok(d)
    }

    /// Counts: rows, cells (one token's routing at one MoE layer: its top-k rows), tokens by phase,
    /// turns; and what the file records (a speculative run's group column, a batched run's seq
    /// column, predictions).
    #[getter]
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = &self.trace;
        let (mut prefill, mut decode, mut turns, mut last) = (0u64, 0u64, 0u64, None);
        for step in t.steps() {
            match step.phase {
                Phase::Prefill => prefill += 1,
                Phase::Decode => decode += 1,
            }
            if last != Some(step.turn) {
                turns += 1;
                last = Some(step.turn);
            }
        }
        let d = PyDict::new(py);
        d.set_item("rows", t.n_rows())?;
        d.set_item("cells", t.cells.len())?;
        d.set_item("prefill_tokens", prefill)?;
        d.set_item("decode_tokens", decode)?;
        d.set_item("turns", turns)?;
        d.set_item("batched", t.has_seq_column())?;
        d.set_item("speculative", t.has_group_column())?;
        d.set_item("predictions", t.pred_columns().horizons)?;
        Ok(d)
    }

    /// Every row as columns (lists of equal length): turn, phase (0 prefill, 1 decode), step,
    /// moe_layer (index into the preamble's MoE layers), slot, expert, weight (NaN when
    /// unknown), residency, expert_bytes, dropped.
    fn columns<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = &self.trace;
        let n = t.n_rows();
        let (mut turn, mut phase, mut step, mut layer, mut slot) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut expert, mut weight, mut residency, mut bytes, mut dropped) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for c in &t.cells {
            for (i, s) in t.cell_slots(c).iter().enumerate() {
                turn.push(c.turn);
                phase.push(u16::from(c.phase == Phase::Decode));
                step.push(c.step);
                layer.push(c.moe_layer);
                slot.push(i as u32);
                expert.push(s.expert);
                weight.push(s.weight);
                residency.push(u16::from(s.residency));
                bytes.push(s.expert_bytes);
                dropped.push(s.dropped);
            }
        }
        let d = PyDict::new(py);
        d.set_item("turn", turn)?;
        d.set_item("phase", phase)?;
        d.set_item("step", step)?;
        d.set_item("moe_layer", layer)?;
        d.set_item("slot", slot)?;
        d.set_item("expert", expert)?;
        d.set_item("weight", weight)?;
        d.set_item("residency", residency)?;
        d.set_item("expert_bytes", bytes)?;
        d.set_item("dropped", dropped)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let p = &self.trace.preamble;
        format!(
            "Trace({:?}: {} {}, {} MoE layers x {} experts, top-{}, {} cells)",
            self.path.display().to_string(),
            p.model,
            p.arch,
            p.layers.len(),
            p.n_expert,
            p.n_expert_used,
            self.trace.cells.len()
        )
    }
}
