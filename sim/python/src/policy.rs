//! An eviction policy written as a Python class, run by the core's cache.
//!
//! `PyPolicy` implements the core's `EvictionPolicy` by forwarding each of its five calls to
//! the Python object's method of the same name: `init(layout)`, `on_insert(index)`,
//! `on_hit(index)`, `on_remove(index)`, `victim(is_evictable)`. The cache calls them exactly
//! as it calls a Rust policy's (same order, same keys), so a Python policy that orders keys as
//! a Rust one does gives the same hits, misses and evictions (tests/test_policy.py: a Python
//! LRU against `lru` on both real traces). It runs with the GIL held, one Python call per
//! cache event: slower, by the factor docs/simulator.md ("Python") states.
//!
//! The trait's context and admission calls (issue 36) are forwarded too when the object has
//! them, each optional, as the trait's defaults are: `on_capacity(capacity)` (a dict:
//! `budget_bytes`, `experts` — `None` when the experts' sizes differ — and `min_experts`),
//! `on_step_begin(step)` (`turn`, `phase` — `"prefill"` or `"decode"` — and `n_rows`),
//! `on_layer_begin(moe_layer)`, `on_access(index, resident, access)` (`access`: `uses`,
//! `top_rank`, `weight_sum`, `weight_max`, the routing behind the lookup) and, when its
//! attribute `filters_admission` is true (a bool or a method answering one, read once),
//! `admit(index, victim, access)`: `False` bypasses the miss. A method the object lacks costs
//! nothing; one it has is one more Python call per event.
//!
//! The trait's calls cannot fail, and Python's can. The first exception a method raises is
//! kept (as a `PolicyError` naming the call, caused by the exception), no method is called
//! after it, and `victim` answers `None`, which stops the run at the next eviction with the
//! cache's own error; the caller (`replay_with`) then raises the kept exception instead. A
//! victim that is not an evictable resident key is refused by the cache itself, with its name.

use crate::errors::PolicyError;
use bmoe_core::policy::{AccessContext, CacheCapacity, EvictionPolicy, StepContext};
use bmoe_core::records::Phase;
use bmoe_core::ExpertLayout;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::cell::Cell;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// The methods a Python policy must have, in the trait's order.
const METHODS: [&str; 5] = ["init", "on_insert", "on_hit", "on_remove", "victim"];

/// The context and admission methods it may have (`OPTIONAL[j]` is `optional[j]`).
const OPTIONAL: [&str; 5] = [
    "on_capacity",
    "on_step_begin",
    "on_layer_begin",
    "on_access",
    "admit",
];
const ON_CAPACITY: usize = 0;
const ON_STEP_BEGIN: usize = 1;
const ON_LAYER_BEGIN: usize = 2;
const ON_ACCESS: usize = 3;
const ADMIT: usize = 4;

/// Where a policy's first exception waits for the caller.
#[derive(Clone, Default)]
pub struct Failure(Arc<Mutex<Option<PyErr>>>);

impl Failure {
    /// The kept exception, if any.
    pub fn take(&self) -> Option<PyErr> {
        self.0.lock().ok().and_then(|mut e| e.take())
    }

    fn is_set(&self) -> bool {
        self.0.lock().map_or(true, |e| e.is_some())
    }

    fn keep(&self, e: PyErr) {
        if let Ok(mut slot) = self.0.lock() {
            slot.get_or_insert(e);
        }
    }
}

/// A Python object's policy methods, bound once (a lookup per call would cost more than the
/// call).
pub struct PyPolicy {
    name: &'static str,
    methods: [Py<PyAny>; 5],
    optional: [Option<Py<PyAny>>; 5],
    /// The object's `filters_admission`, read once (false without one).
    filters: bool,
    failure: Failure,
}

impl PyPolicy {
    /// Bind `object`'s five methods and its name (`name` if it is a string, else its class's
    /// name), refusing an object that lacks one.
    pub fn new(object: &Bound<'_, PyAny>) -> PyResult<(PyPolicy, Failure)> {
        let class = object.get_type().name()?.to_string();
        let mut bound = Vec::with_capacity(METHODS.len());
        for m in METHODS {
            let method = object
                .getattr(m)
                .ok()
                .filter(|f| f.is_callable())
                .ok_or_else(|| {
                    PyTypeError::new_err(format!(
                        "policy object of class {class} has no method {m}(): an eviction policy \
                         needs init(layout), on_insert(index), on_hit(index), on_remove(index) \
                         and victim(is_evictable), or pass a core policy's name: {}",
                        bmoe_core::policy::POLICY_NAMES.join(", ")
                    ))
                })?;
            bound.push(method.unbind());
        }
        let methods: [Py<PyAny>; 5] = bound
            .try_into()
            .map_err(|_| PyRuntimeError::new_err("policy methods: wrong count"))?;
        let own = match object.getattr("name") {
            Ok(n) if n.is_instance_of::<pyo3::types::PyString>() => n.extract::<String>()?,
            _ => class.clone(),
        };
        let optional = OPTIONAL.map(|m| {
            object
                .getattr(m)
                .ok()
                .filter(|f| f.is_callable())
                .map(Bound::unbind)
        });
        let filters = match object.getattr("filters_admission") {
            Ok(f) if f.is_callable() => f.call0()?.is_truthy()?,
            Ok(f) => f.is_truthy()?,
            Err(_) => false,
        };
        if filters && optional[ADMIT].is_none() {
            return Err(PyTypeError::new_err(format!(
                "policy object of class {class} says filters_admission but has no method \
                 admit(index, victim, access): the cache asks it whether to admit each miss"
            )));
        }
        let failure = Failure::default();
        let policy = PyPolicy {
            name: intern(&checked_name(&own)?),
            methods,
            optional,
            filters,
            failure: failure.clone(),
        };
        Ok((policy, failure))
    }

    /// Call method `i` with `args` (`index`, when given, is the key they carry, for the
    /// message), keeping the first exception; `None` once one was raised.
    fn call<'py>(
        &self,
        py: Python<'py>,
        i: usize,
        args: impl pyo3::call::PyCallArgs<'py>,
        index: Option<u32>,
    ) -> Option<Bound<'py, PyAny>> {
        if self.failure.is_set() {
            return None;
        }
        match self.methods[i].bind(py).call1(args) {
            Ok(v) => Some(v),
            Err(e) => {
                let call = match (i, index) {
                    (_, Some(k)) => format!("{}({k})", METHODS[i]),
                    (0, None) => "init(layout)".to_string(),
                    _ => format!("{}(is_evictable)", METHODS[i]),
                };
                self.fail(py, &call, Some(e), "raised");
                None
            }
        }
    }

    /// Call optional method `j`, when the object has it, as `call` does; `None` when it has
    /// not or once an exception was raised. `call` names it in a message.
    fn call_optional<'py>(
        &self,
        py: Python<'py>,
        j: usize,
        args: impl pyo3::call::PyCallArgs<'py>,
        call: impl FnOnce() -> String,
    ) -> Option<Bound<'py, PyAny>> {
        let method = self.optional[j].as_ref()?;
        if self.failure.is_set() {
            return None;
        }
        match method.bind(py).call1(args) {
            Ok(v) => Some(v),
            Err(e) => {
                self.fail(py, &call(), Some(e), "raised");
                None
            }
        }
    }

    /// Keep a `PolicyError` naming the call, caused by `cause`.
    fn fail(&self, py: Python<'_>, call: &str, cause: Option<PyErr>, what: &str) {
        let detail = cause
            .as_ref()
            .map_or(String::new(), |c| format!(": {}", c.value(py)));
        let e = PolicyError::new_err(format!("policy {}: {call} {what}{detail}", self.name));
        if let Some(c) = cause {
            e.set_cause(py, Some(c));
        }
        self.failure.keep(e);
    }
}

/// A policy name fit for the CSV preamble's `eviction=` (one word), prefixed `py:` so it is
/// never taken for a core policy's.
fn checked_name(name: &str) -> PyResult<String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c));
    if !ok {
        return Err(PyValueError::new_err(format!(
            "policy name {name:?}: it goes into the CSV preamble's eviction= and the reports, \
             so 1 to 64 characters of ASCII letters, digits and - _ . :"
        )));
    }
    Ok(format!("py:{name}"))
}

/// `name` as the `&'static str` the trait's `name()` returns: each distinct name is kept once
/// for the life of the process (a handful of short strings).
fn intern(name: &str) -> &'static str {
    static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut names = match NAMES.lock() {
        Ok(n) => n,
        Err(poisoned) => poisoned.into_inner(),
    };
    if let Some(n) = names.iter().find(|n| **n == name) {
        return n;
    }
    let leaked: &'static str = Box::leak(name.to_string().into_boxed_str());
    names.push(leaked);
    leaked
}

/// The layout as `init` receives it: the key count and, per MoE layer, its model layer, its
/// experts, its first key (`key_base`: a key is `key_base + expert`) and its expert bytes.
fn layout_dict<'py>(py: Python<'py>, layout: &ExpertLayout) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("n_keys", layout.n_keys())?;
    let layers = PyList::empty(py);
    let mut base = 0u32;
    for (m, l) in layout.layers().iter().enumerate() {
        let layer = PyDict::new(py);
        layer.set_item("moe_layer", m)?;
        layer.set_item("model_layer", l.model_layer)?;
        layer.set_item("n_expert", l.n_expert)?;
        layer.set_item("key_base", base)?;
        layer.set_item("expert_bytes", layout.expert_bytes(m as u16))?;
        layers.append(layer)?;
        base += l.n_expert;
    }
    d.set_item("layers", layers)?;
    Ok(d)
}

/// The routing behind a lookup, as `on_access` and `admit` receive it.
fn access_dict<'py>(py: Python<'py>, a: &AccessContext) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("uses", a.uses)?;
    d.set_item("top_rank", a.top_rank)?;
    d.set_item("weight_sum", a.weight_sum)?;
    d.set_item("weight_max", a.weight_max)?;
    Ok(d)
}

impl EvictionPolicy for PyPolicy {
    fn name(&self) -> &'static str {
        self.name
    }

    fn init(&mut self, layout: &ExpertLayout) {
        Python::attach(|py| match layout_dict(py, layout) {
            Ok(d) => {
                self.call(py, 0, (d,), None);
            }
            Err(e) => self.fail(py, "init(layout)", Some(e), "could not be given its layout"),
        });
    }

    fn on_insert(&mut self, index: u32) {
        Python::attach(|py| {
            self.call(py, 1, (index,), Some(index));
        });
    }

    fn on_hit(&mut self, index: u32) {
        Python::attach(|py| {
            self.call(py, 2, (index,), Some(index));
        });
    }

    fn on_remove(&mut self, index: u32) {
        Python::attach(|py| {
            self.call(py, 3, (index,), Some(index));
        });
    }

    fn on_capacity(&mut self, capacity: &CacheCapacity) {
        if self.optional[ON_CAPACITY].is_none() {
            return;
        }
        Python::attach(|py| {
            let d = PyDict::new(py);
            let built = d
                .set_item("budget_bytes", capacity.budget_bytes)
                .and_then(|()| d.set_item("experts", capacity.experts))
                .and_then(|()| d.set_item("min_experts", capacity.min_experts));
            match built {
                Ok(()) => {
                    self.call_optional(py, ON_CAPACITY, (d,), || "on_capacity(capacity)".into());
                }
                Err(e) => self.fail(
                    py,
                    "on_capacity(capacity)",
                    Some(e),
                    "could not be given it",
                ),
            }
        });
    }

    fn on_step_begin(&mut self, step: &StepContext) {
        if self.optional[ON_STEP_BEGIN].is_none() {
            return;
        }
        Python::attach(|py| {
            let d = PyDict::new(py);
            let phase = match step.phase {
                Phase::Prefill => "prefill",
                Phase::Decode => "decode",
            };
            let built = d
                .set_item("turn", step.turn)
                .and_then(|()| d.set_item("phase", phase))
                .and_then(|()| d.set_item("n_rows", step.n_rows));
            match built {
                Ok(()) => {
                    self.call_optional(py, ON_STEP_BEGIN, (d,), || "on_step_begin(step)".into());
                }
                Err(e) => self.fail(py, "on_step_begin(step)", Some(e), "could not be given it"),
            }
        });
    }

    fn on_layer_begin(&mut self, moe_layer: u16) {
        if self.optional[ON_LAYER_BEGIN].is_none() {
            return;
        }
        Python::attach(|py| {
            self.call_optional(py, ON_LAYER_BEGIN, (moe_layer,), || {
                format!("on_layer_begin({moe_layer})")
            });
        });
    }

    fn on_access(&mut self, index: u32, resident: bool, access: &AccessContext) {
        if self.optional[ON_ACCESS].is_none() {
            return;
        }
        Python::attach(|py| match access_dict(py, access) {
            Ok(d) => {
                self.call_optional(py, ON_ACCESS, (index, resident, d), || {
                    format!("on_access({index})")
                });
            }
            Err(e) => self.fail(py, "on_access", Some(e), "could not be given its access"),
        });
    }

    fn filters_admission(&self) -> bool {
        self.filters
    }

    fn admit(&mut self, index: u32, victim: Option<u32>, access: &AccessContext) -> bool {
        Python::attach(|py| {
            let d = match access_dict(py, access) {
                Ok(d) => d,
                Err(e) => {
                    self.fail(py, "admit", Some(e), "could not be given its access");
                    return true;
                }
            };
            let Some(answer) =
                self.call_optional(py, ADMIT, (index, victim, d), || format!("admit({index})"))
            else {
                // No answer (an exception was kept): admit, as the trait's default does; the
                // run stops at the next eviction and raises the kept exception.
                return true;
            };
            match answer.is_truthy() {
                Ok(v) => v,
                Err(e) => {
                    self.fail(
                        py,
                        &format!("admit({index})"),
                        Some(e),
                        "returned no truth value",
                    );
                    true
                }
            }
        })
    }

    fn victim(&self, is_evictable: &dyn Fn(u32) -> bool) -> Option<u32> {
        Python::attach(|py| {
            if self.failure.is_set() {
                return None;
            }
            let scope = match Evictable::scoped(py, is_evictable) {
                Ok(s) => s,
                Err(e) => {
                    self.fail(py, "victim(is_evictable)", Some(e), "could not be called");
                    return None;
                }
            };
            let answer = self.call(py, 4, (scope.object.clone(),), None);
            drop(scope);
            let answer = answer?;
            if answer.is_none() {
                return None;
            }
            match answer.extract::<u32>() {
                Ok(v) => Some(v),
                Err(_) => {
                    let shown = answer
                        .repr()
                        .map_or_else(|_| "?".to_string(), |r| r.to_string());
                    self.fail(
                        py,
                        "victim(is_evictable)",
                        None,
                        &format!(
                            "returned {shown}: expected a key index (an int in [0, n_keys)) or None"
                        ),
                    );
                    None
                }
            }
        })
    }
}

/// The `is_evictable` a Python `victim` receives: a callable answering, for a key index,
/// whether the cache may evict it now (resident keys that are pinned may not). It answers only
/// while the `victim` call it was given to runs; after that it raises `RuntimeError` (a policy
/// must not keep it).
#[pyclass(unsendable, module = "bmoe_sim._native")]
pub struct Evictable {
    /// The cache's predicate, set only for the duration of one `victim` call.
    predicate: Cell<Option<Predicate>>,
}

/// The cache's `is_evictable`, its borrow's lifetime erased (see `Evictable::scoped`).
type Predicate = NonNull<dyn Fn(u32) -> bool>;

#[pymethods]
impl Evictable {
    fn __call__(&self, index: i64) -> PyResult<bool> {
        let Some(f) = self.predicate.get() else {
            return Err(PyRuntimeError::new_err(
                "is_evictable answers only during the victim() call it was given to",
            ));
        };
        let Ok(index) = u32::try_from(index) else {
            return Ok(false);
        };
        // SAFETY: `predicate` is `Some` only between `Evictable::scoped` and the drop of its
        // `Scope`, which both happen inside one `victim(&self, is_evictable)` call, so the
        // closure behind the pointer is alive (borrowed by that call) whenever this runs.
        // The class is `unsendable`: no other thread can reach it.
        Ok(unsafe { f.as_ref() }(index))
    }
}

/// An `Evictable` answering for `is_evictable` until dropped.
struct Scope<'py> {
    object: Bound<'py, Evictable>,
}

impl Evictable {
    fn scoped<'py>(py: Python<'py>, is_evictable: &dyn Fn(u32) -> bool) -> PyResult<Scope<'py>> {
        let borrowed: NonNull<dyn Fn(u32) -> bool + '_> = NonNull::from(is_evictable);
        // SAFETY: only the lifetime is erased; `Scope::drop` clears the pointer before the
        // borrow it came from ends (see `__call__`).
        let erased: Predicate = unsafe { std::mem::transmute(borrowed) };
        let object = Bound::new(
            py,
            Evictable {
                predicate: Cell::new(Some(erased)),
            },
        )?;
        Ok(Scope { object })
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        self.object.borrow().predicate.set(None);
    }
}
