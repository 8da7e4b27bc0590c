"""bmoe_sim: the bmoe simulator from Python, over the same core as the ``bmoe-sim`` binary.

Every function here runs the function the binary runs for the same command
(``bmoe_sim::cli`` in Rust), with its flags given as keyword arguments and parsed by the
binary's own definitions: ``cache_mb=4`` is ``--cache-mb 4``, ``overlap=True`` is
``--overlap``, a list repeats its flag, ``None`` and ``False`` leave it out. So the files a call
writes are the binary's bytes, its ``stdout`` is the binary's, and the numbers it returns are
those behind them; ``tests/`` checks that against the binary itself.

What comes back is plain Python (dicts, lists, numbers, strings) and NumPy arrays, and pandas
DataFrames from ``to_pandas()`` when pandas is installed. A bad path raises
``FileNotFoundError`` (or another ``OSError``), a bad flag, value, policy name or malformed
trace ``ValueError``, each naming what was wrong; a Python policy that raises makes the run
raise ``PolicyError``, caused by the policy's own exception.

A Python eviction policy is any object with ``init(layout)``, ``on_insert(index)``,
``on_hit(index)``, ``on_remove(index)`` and ``victim(is_evictable)`` (the core's
``EvictionPolicy`` trait), passed as ``replay(..., policy=obj)``: see docs/simulator.md,
"Python".
"""

from __future__ import annotations

import csv as _csv
import io as _io
import json as _json
import os as _os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

import numpy as _np

from . import _native
from ._native import PolicyError

__all__ = [
    "PolicyError",
    "Trace",
    "Replay",
    "Sweep",
    "Stats",
    "Calibration",
    "cli",
    "policy_names",
    "load_trace",
    "convert",
    "replay",
    "whatif",
    "sweep",
    "sweep_grid",
    "sweep_cell",
    "sweep_table",
    "stats",
    "calibrate",
]


def _word(value: Any) -> str:
    if isinstance(value, bool):
        raise TypeError(f"a flag value cannot be a bool inside a list: {value!r}")
    if isinstance(value, (str, _os.PathLike)):
        return _os.fspath(value)
    if isinstance(value, (int, float, _np.integer, _np.floating)):
        return str(value)
    raise TypeError(f"a flag value must be a string, a path or a number, not {type(value).__name__}: {value!r}")


def _flags(options: Dict[str, Any]) -> List[str]:
    """Keyword arguments as the binary's flags: ``cache_mb=4`` -> ``--cache-mb 4``."""
    args: List[str] = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                args += [flag, _word(v)]
        else:
            args += [flag, _word(value)]
    return args


def _number(text: str) -> Any:
    """A value as the CLI printed it, as a number when it is one."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _pandas():
    try:
        import pandas
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "to_pandas() needs pandas, which is not installed (pip install pandas); "
            "the same data is available as plain lists and dicts"
        ) from e
    return pandas


def cli(*args: Any) -> "CliResult":
    """``bmoe-sim ARGS...`` in this process, exactly as the binary runs it (any subcommand,
    ``diff``, ``bench``, ``fuzz`` and ``bars`` included): its exit code, stdout and stderr."""
    code, out, err = _native.cli([_word(a) for a in args])
    return CliResult(code, out, err)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def policy_names() -> List[str]:
    """The core's eviction policies, as ``policy=`` (the CLI's ``--eviction``) names them."""
    return list(_native.policy_names())


# --- traces ---------------------------------------------------------------------------------


class Trace:
    """A route trace, read and checked as every command reads it.

    Attributes: ``path``, ``model``, ``arch``, ``n_layer``, ``n_expert``, ``top_k``,
    ``gating``, ``moe_layers`` (model layer ids), ``expert_bytes``, ``dense_bytes`` (per MoE
    layer), ``notes``, ``extra`` (other preamble keys), and the counts ``rows``, ``cells``
    (one token at one MoE layer), ``prefill_tokens``, ``decode_tokens``, ``turns``, ``batched``,
    ``speculative``, ``predictions``. A ``Trace`` can be passed wherever a trace path is.
    """

    def __init__(self, native: Any):
        self._native = native
        self.path = _os.fspath(native.path)
        p = native.preamble
        self.model: str = p["model"]
        self.arch: str = p["arch"]
        self.n_layer: int = p["n_layer"]
        self.n_expert: int = p["n_expert"]
        self.top_k: int = p["top_k"]
        self.gating: str = p["gating"]
        self.moe_layers: List[int] = p["moe_layers"]
        self.expert_bytes: List[int] = p["expert_bytes"]
        self.dense_bytes: List[int] = p["dense_bytes"]
        self.notes: List[str] = p["notes"]
        self.extra: Dict[str, str] = p["extra"]
        c = native.counts
        self.rows: int = c["rows"]
        self.cells: int = c["cells"]
        self.prefill_tokens: int = c["prefill_tokens"]
        self.decode_tokens: int = c["decode_tokens"]
        self.turns: int = c["turns"]
        self.batched: bool = c["batched"]
        self.speculative: bool = c["speculative"]
        self.predictions: int = c["predictions"]

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return repr(self._native)

    def columns(self) -> Dict[str, _np.ndarray]:
        """Every row as NumPy columns: turn, phase (0 prefill, 1 decode), step, moe_layer,
        slot, expert, weight (NaN when unknown), residency, expert_bytes, dropped."""
        types = {
            "turn": _np.uint32,
            "phase": _np.uint8,
            "step": _np.int64,
            "moe_layer": _np.uint16,
            "slot": _np.uint32,
            "expert": _np.uint32,
            "weight": _np.float32,
            "residency": _np.uint8,
            "expert_bytes": _np.uint64,
            "dropped": _np.bool_,
        }
        cols = self._native.columns()
        return {k: _np.asarray(cols[k], dtype=t) for k, t in types.items()}

    def to_pandas(self):
        """The rows as a pandas DataFrame (the columns of ``columns()``)."""
        return _pandas().DataFrame(self.columns())


def load_trace(path: Any) -> Trace:
    """Read and check the route trace at ``path`` (``FileNotFoundError`` when absent,
    ``ValueError`` naming the line and field when malformed)."""
    return Trace(_native.load_trace(_os.fspath(path)))


def convert(input: Any, out: Any, *, expert_bytes: int, **flags: Any) -> Dict[str, Any]:
    """``bmoe-sim convert INPUT --out OUT --expert-bytes B [flags]``: a routing capture (JSONL
    or long CSV) written as a route trace. Returns what it holds (tokens, routings, layers,
    n_expert, top_k), the output path and the binary's stdout."""
    args = [_word(input)] + _flags({"out": out, "expert_bytes": expert_bytes, **flags})
    return dict(_native.convert(args))


# --- replay and whatif -----------------------------------------------------------------------


@dataclass
class Replay:
    """What a ``replay`` or ``whatif`` ran.

    ``counters``: steps, lookups, hits, misses, evictions, rereads, inserts, read_bytes,
    decode_steps, read_retries, virtual_s (batched runs: the ``decode_*`` keys too);
    ``summary``: the report's summary, the CSV ``# summary`` trailer's keys and values (as
    numbers) over the whole replay (``None`` for a batched run); ``turns``: one such summary
    per turn; ``stdout``/``stderr``: the binary's output, byte for byte."""

    kind: str
    policy: str
    profile: str
    seed: int
    cache_budget_bytes: int
    counters: Dict[str, Any]
    summary: Optional[Dict[str, Any]]
    turns: List[Dict[str, Any]]
    stdout: str
    stderr: str

    @property
    def hit_rate(self) -> float:
        lookups = self.counters["lookups"]
        return self.counters["hits"] / lookups if lookups else 0.0

    def turns_frame(self):
        """The per-turn summaries as a pandas DataFrame."""
        return _pandas().DataFrame(self.turns)


def _replay_result(d: Dict[str, Any]) -> Replay:
    numbers = lambda s: {k: _number(v) for k, v in s.items()}  # noqa: E731
    return Replay(
        kind=d["kind"],
        policy=d["policy"],
        profile=d["profile"],
        seed=d["seed"],
        cache_budget_bytes=d["cache_budget_bytes"],
        counters=dict(d["counters"]),
        summary=None if d["summary"] is None else numbers(d["summary"]),
        turns=[numbers(t) for t in d["turns"]],
        stdout=d["stdout"],
        stderr=d["stderr"],
    )


def _policy_flags(policy: Any, flags: Dict[str, Any]):
    """``policy`` as the ``--eviction`` flag (a core policy's name) or as an object."""
    if policy is None or isinstance(policy, str):
        if policy is not None:
            if flags.get("eviction") not in (None, policy):
                raise ValueError(f"policy={policy!r} and eviction={flags['eviction']!r} disagree: give one")
            names = policy_names()
            if policy not in names:
                raise ValueError(
                    f"unknown policy {policy!r}: the core has {', '.join(names)}; or pass an object "
                    "with init(layout), on_insert(index), on_hit(index), on_remove(index) and "
                    "victim(is_evictable)"
                )
            flags = {**flags, "eviction": policy}
        return flags, None
    if flags.get("eviction") is not None:
        raise ValueError("a policy object replaces --eviction: do not give eviction= with it")
    return flags, policy


def replay(trace: Any, *, policy: Any = None, **flags: Any) -> Replay:
    """``bmoe-sim replay --trace TRACE [flags]``: ``cache_mb=4, force_cache=True,
    overlap=True, io_threads=4, profile="laptop-nvme", csv="sim.csv", ...`` (every flag of
    ``bmoe-sim replay --help``). ``policy``: a core policy's name (``--eviction``) or a Python
    policy object run by the core's cache in its place."""
    flags, obj = _policy_flags(policy, flags)
    args = _flags({"trace": trace, **flags})
    return _replay_result(_native.replay(args, obj))


def whatif(trace: Any, *, model: Any, device: str, policy: Any = None, **flags: Any) -> Replay:
    """``bmoe-sim whatif --trace TRACE --model LAYOUT --device DEVICE [flags]``: the recorded
    routing priced with another model's bytes on another device; ``stdout`` starts with the
    binary's ``whatif:`` lines naming every input. ``policy`` as in ``replay``."""
    flags, obj = _policy_flags(policy, flags)
    args = _flags({"trace": trace, "model": model, "device": device, **flags})
    return _replay_result(_native.whatif(args, obj))


# --- sweeps ----------------------------------------------------------------------------------

# sweep.csv's text columns; every other column is a number (empty: None).
_TEXT_COLUMNS = {"predictor", "policy"}


def _table(text: str) -> List[Dict[str, Any]]:
    rows = []
    for r in _csv.DictReader(_io.StringIO(text)):
        rows.append(
            {k: (v if k in _TEXT_COLUMNS else (None if v == "" else _number(v))) for k, v in r.items()}
        )
    return rows


@dataclass
class Sweep:
    """A sweep's results.

    ``rows``: ``sweep.csv``'s rows (one per cell, its columns, typed as the file prints them);
    ``files``: ``sweep.csv``, ``pivot.md``, ``per_layer.csv`` and ``per_layer.md``, the text
    the binary writes; ``cells``: each cell's full result (per MoE layer, per turn), what
    ``sweep_table`` rebuilds the tables from; ``stdout``/``stderr``: the binary's output."""

    rows: List[Dict[str, Any]]
    files: Dict[str, str]
    cells: List[Dict[str, Any]] = field(repr=False)
    stdout: str = ""
    stderr: str = ""

    @property
    def csv(self) -> str:
        return self.files["sweep.csv"]

    @property
    def pivot_md(self) -> str:
        return self.files["pivot.md"]

    def arrays(self) -> Dict[str, _np.ndarray]:
        """``rows`` as one NumPy array per column (NaN where a value does not apply)."""
        if not self.rows:
            return {}
        out = {}
        for k in self.rows[0]:
            values = [r[k] for r in self.rows]
            if k in _TEXT_COLUMNS:
                out[k] = _np.asarray(values)
            else:
                out[k] = _np.asarray([_np.nan if v is None else v for v in values])
        return out

    def to_pandas(self):
        """``rows`` as a pandas DataFrame."""
        return _pandas().DataFrame(self.rows)


def _sweep_args(trace: Any, flags: Dict[str, Any]) -> List[str]:
    return _flags({"trace": trace, **flags})


def sweep(trace: Any, *, out: Any = None, **flags: Any) -> Sweep:
    """``bmoe-sim sweep --trace TRACE [flags]``: ``experts_per_layer=[6, 12]`` or
    ``budgets_mb=[...]``, ``policies=["lru", "belady"]``, ``lanes=[4]``, ``overlap="on"``,
    ``predictors=[...]``, ``jobs=2``, ``x="experts"``, ``bootstrap=1000``, ``seed=0``, ...
    With ``out``, every output is also written there as the binary writes it (charts
    included) and ``stdout`` is the binary's; without it nothing is written."""
    if out is None and flags.get("placements"):
        raise ValueError("placements= writes placement.csv and placement.md: give out= as well")
    args = _sweep_args(trace, {**flags, "out": out})
    d = _native.sweep(args, out is not None)
    files = dict(d["files"])
    return Sweep(
        rows=_table(files["sweep.csv"]),
        files=files,
        cells=list(d["cells"]),
        stdout=d["stdout"],
        stderr=d["stderr"],
    )


def sweep_grid(trace: Any, **flags: Any) -> List[Dict[str, Any]]:
    """The cells ``sweep(trace, **flags)`` runs, in its order, each as the flags of a
    one-cell sweep: give each to ``sweep_cell`` (in this process, on a Dask cluster, anywhere)
    and the results, in this order, to ``sweep_table``."""
    return list(_native.sweep_grid(_sweep_args(trace, flags)))


def sweep_cell(trace: Any, cell: Dict[str, Any], **flags: Any) -> Dict[str, Any]:
    """Run one cell of ``sweep_grid(trace, **flags)`` (``flags`` the same): its full result,
    a plain dict (picklable), for ``sweep_table``."""
    one = {**flags, **cell, "jobs": 1, "bootstrap": 0, "out": None}
    d = _native.sweep(_sweep_args(trace, one), False)
    cells = d["cells"]
    if len(cells) != 1:
        raise ValueError(f"sweep_cell: the cell's flags ran {len(cells)} cells, not one: {cell!r}")
    return cells[0]


def sweep_table(cells: Iterable[Dict[str, Any]], *, bootstrap: int = 1000, seed: int = 0, x: str = "mib") -> Sweep:
    """The sweep's tables from its cells (``sweep_cell``'s results, in ``sweep_grid``'s
    order), with the binary's functions: given the sweep's ``bootstrap``, ``seed`` and ``x``,
    ``files`` and ``rows`` equal ``sweep(...)``'s byte for byte."""
    cells = list(cells)
    if not cells:
        raise ValueError("sweep_table: no cells")
    names = {c.get("trace_name") for c in cells}
    if len(names) != 1:
        raise ValueError(f"sweep_table: cells of several traces ({sorted(map(str, names))}): one table per trace")
    files = dict(
        _native.sweep_report(cells, cells[0]["layer_ids"], x, bootstrap, seed, cells[0]["trace_name"])
    )
    return Sweep(rows=_table(files["sweep.csv"]), files=files, cells=cells)


# --- stats and calibrate ---------------------------------------------------------------------


@dataclass
class Stats:
    """``bmoe-sim stats``: per MoE layer (``layer_ids``) expert ``popularity`` (layers x
    experts routings), the per-layer reuse (stack) distance histogram ``stack_distance`` (its
    cumulative share is ``lru_hit_curve[c-1]``, the hit rate of a per-layer LRU of c experts)
    and ``cold`` first uses, previous-token ``overlap`` by lag and ``working_set`` by window
    (each a dict of arrays), and ``summary``: the Markdown the binary prints."""

    layer_ids: List[int]
    n_expert: int
    top_k: int
    tokens: int
    turns: int
    routings: int
    used_prefill: bool
    popularity: _np.ndarray
    stack_distance: _np.ndarray
    cold: int
    lru_hit_curve: _np.ndarray
    overlap: Dict[str, _np.ndarray]
    working_set: Dict[str, _np.ndarray]
    summary: str

    def to_pandas(self) -> Dict[str, Any]:
        """DataFrames with the columns of the binary's CSVs: ``popularity`` (layer, expert,
        routings), ``reuse`` (stack_distance, routings, lru_hit_rate_at_distance_plus_1),
        ``overlap`` (lag, share, tokens), ``working_set`` (window, experts, windows)."""
        pd = _pandas()
        layers, experts = _np.meshgrid(_np.asarray(self.layer_ids), _np.arange(self.n_expert), indexing="ij")
        return {
            "popularity": pd.DataFrame(
                {"layer": layers.ravel(), "expert": experts.ravel(), "routings": self.popularity.ravel()}
            ),
            "reuse": pd.DataFrame(
                {
                    "stack_distance": _np.arange(len(self.stack_distance)),
                    "routings": self.stack_distance,
                    "lru_hit_rate_at_distance_plus_1": self.lru_hit_curve,
                }
            ),
            "overlap": pd.DataFrame(self.overlap),
            "working_set": pd.DataFrame(self.working_set),
        }


def stats(trace: Any, *, out: Any = None) -> Stats:
    """``bmoe-sim stats --trace TRACE``; with ``out``, its files (CSVs, stats.md, charts)
    written there as the binary writes them."""
    d = _native.stats(_flags({"trace": trace, "out": out}), out is not None)
    overlap = _np.asarray(d["overlap"], dtype=float).reshape(-1, 3)
    working = _np.asarray(d["working_set"], dtype=float).reshape(-1, 3)
    return Stats(
        layer_ids=list(d["layer_ids"]),
        n_expert=d["n_expert"],
        top_k=d["top_k"],
        tokens=d["tokens"],
        turns=d["turns"],
        routings=d["routings"],
        used_prefill=d["used_prefill"],
        popularity=_np.asarray(d["popularity"], dtype=_np.uint64).reshape(len(d["layer_ids"]), -1),
        stack_distance=_np.asarray(d["stack_distance"], dtype=_np.uint64),
        cold=d["cold"],
        lru_hit_curve=_np.asarray(d["lru_hit_curve"], dtype=float),
        overlap={"lag": overlap[:, 0].astype(int), "share": overlap[:, 1], "tokens": overlap[:, 2].astype(int)},
        working_set={
            "window": working[:, 0].astype(int),
            "experts": working[:, 1],
            "windows": working[:, 2].astype(int),
        },
        summary=d["stdout"],
    )


@dataclass
class Calibration:
    """``bmoe-sim calibrate``: the fitted ``profile`` (its JSON, as written to ``out``, and
    parsed), the fit's ``notes``, each run's ``self_check``, the binary's ``exit_code`` (3 when
    ``fail_on_misfit`` and the profile misses its own run) and output."""

    profile: Dict[str, Any]
    profile_json: str
    notes: List[str]
    self_check: List[Dict[str, Any]]
    exit_code: int
    stdout: str
    stderr: str


def calibrate(csv: Any, *, out: Any, trace: Any = None, io_trace: Any = None, **flags: Any) -> Calibration:
    """``bmoe-sim calibrate --csv RUN.csv --out PROFILE.json [--trace ROUTE.csv]
    [--io-trace IO.csv] [flags]``; ``csv``, ``trace`` and ``io_trace`` may be lists (with
    ``sweep=True``: one per run, in order)."""
    d = _native.calibrate(_flags({"csv": csv, "trace": trace, "io_trace": io_trace, "out": out, **flags}))
    return Calibration(
        profile=_json.loads(d["profile_json"]),
        profile_json=d["profile_json"],
        notes=list(d["notes"]),
        self_check=[dict(c) for c in d["self_check"]],
        exit_code=d["exit_code"],
        stdout=d["stdout"],
        stderr=d["stderr"],
    )
