"""A policy written as a Python class runs in the core's cache exactly as a Rust one: the
Python LRU of bmoe_sim.policies gives the hits, misses and evictions of the core's `lru` on
both real traces, at budgets that make it evict."""

from __future__ import annotations

import pytest

import bmoe_sim
from bmoe_sim.policies import Lru
from conftest import DEEPSEEK, MIXTRAL, TINY, experts_mb, shared_trace

COUNTS = ("lookups", "hits", "misses", "evictions", "rereads", "inserts", "read_bytes", "steps")


def both(trace, **flags):
    rust = bmoe_sim.replay(trace, policy="lru", force_cache=True, **flags)
    python = bmoe_sim.replay(trace, policy=Lru(), force_cache=True, **flags)
    return rust, python


def same_counts(rust, python):
    assert {k: python.counters[k] for k in COUNTS} == {k: rust.counters[k] for k in COUNTS}
    # Everything the report and the CSV trailers count follows from the same cache decisions,
    # and the modelled times from the same reads.
    assert python.summary == rust.summary
    assert python.turns == rust.turns
    assert rust.policy == "lru" and python.policy == "py:lru"


@pytest.mark.parametrize("name,per_layer", [(DEEPSEEK, 6), (DEEPSEEK, 24), (MIXTRAL, 3), (MIXTRAL, 5)])
def test_a_python_lru_counts_what_the_core_lru_counts_on_a_real_trace(name, per_layer):
    trace = bmoe_sim.load_trace(shared_trace(name))
    rust, python = both(trace, cache_mb=experts_mb(trace, per_layer), overlap=True, io_threads=4)
    assert rust.counters["evictions"] > 1000, "the budget must make the policy choose, often"
    same_counts(rust, python)


def test_a_python_lru_writes_the_core_lrus_rows(tmp_path):
    rust, python = both(TINY, cache_mb=4, csv=str(tmp_path / "rust.csv"))
    rust2, python2 = both(TINY, cache_mb=4, route_trace=str(tmp_path / "r.route.csv"))
    same_counts(rust, python)
    python = bmoe_sim.replay(TINY, policy=Lru(), force_cache=True, cache_mb=4, csv=str(tmp_path / "py.csv"))
    # Row for row the same file, but for the preamble's eviction= that names the policy run.
    rows = lambda p: [l for l in p.read_text().splitlines() if "eviction=" not in l]  # noqa: E731
    assert rows(tmp_path / "rust.csv") == rows(tmp_path / "py.csv")
    assert "eviction=py:lru" in (tmp_path / "py.csv").read_text()


class Recording(Lru):
    """The LRU, recording what the cache calls."""

    name = "recording"

    def init(self, layout):
        super().init(layout)
        self.layout = layout
        self.calls = {"on_insert": 0, "on_hit": 0, "on_remove": 0, "victim": 0}
        self.resident = set()

    def on_insert(self, index):
        assert index not in self.resident
        self.resident.add(index)
        self.calls["on_insert"] += 1
        super().on_insert(index)

    def on_hit(self, index):
        assert index in self.resident
        self.calls["on_hit"] += 1
        super().on_hit(index)

    def on_remove(self, index):
        self.resident.remove(index)
        self.calls["on_remove"] += 1
        super().on_remove(index)

    def victim(self, is_evictable):
        self.calls["victim"] += 1
        self.kept = is_evictable
        return super().victim(is_evictable)


def test_the_cache_calls_a_python_policy_as_its_contract_says():
    p = Recording()
    r = bmoe_sim.replay(TINY, policy=p, force_cache=True, cache_mb=4)
    layout = p.layout
    assert layout["n_keys"] == 4 * 16
    assert [l["key_base"] for l in layout["layers"]] == [0, 16, 32, 48]
    assert [l["expert_bytes"] for l in layout["layers"]] == [313344] * 4
    c = r.counters
    assert p.calls["on_insert"] == c["inserts"]
    assert p.calls["on_remove"] == c["evictions"]
    assert p.calls["victim"] == c["evictions"]
    assert p.calls["on_hit"] == c["hits"]
    with pytest.raises(RuntimeError, match="only during the victim"):
        p.kept(0)


# --- context and admission -------------------------------------------------------------------
# scripts/sim-check.py holds the independent recounts of the core's context policies; its own
# classes, adapted to the cache's calls, run here as Python policies and must count exactly
# what the core's `next-use` (layer boundaries, every lookup) and `tinylfu` (capacity, every
# lookup, admission) count.


def sim_check():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("sim_check", REPO / "scripts" / "sim-check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Keyed:
    """A sim-check.py policy (keys as (moe_layer, expert)) behind the cache's key indices."""

    def init(self, layout):
        self.key = []
        for layer in layout["layers"]:
            self.key += [(layer["moe_layer"], e) for e in range(layer["n_expert"])]
        self.index = {k: i for i, k in enumerate(self.key)}
        self.n_expert = layout["layers"][0]["n_expert"]
        self.n_layers = len(layout["layers"])

    def on_insert(self, index):
        self.p.insert(self.key[index])

    def on_hit(self, index):
        self.p.hit(self.key[index])

    def on_remove(self, index):
        self.p.remove(self.key[index])

    def victim(self, is_evictable):
        k = self.p.victim(lambda k: is_evictable(self.index[k]))
        return None if k is None else self.index[k]


class PyNextUse(Keyed):
    name = "next-use"

    def init(self, layout):
        super().init(layout)
        self.p = sim_check().NextUse(self.n_expert, self.n_layers)

    def on_layer_begin(self, moe_layer):
        self.p.layer_begin(moe_layer)

    def on_access(self, index, resident, access):
        assert access["uses"] >= 1
        self.p.access(self.key[index], resident)


class PyTinyLfu(Keyed):
    name = "tinylfu"
    filters_admission = True

    def init(self, layout):
        super().init(layout)
        self.check = sim_check()

    def on_capacity(self, capacity):
        assert capacity["experts"] == capacity["min_experts"]
        self.p = self.check.TinyLFU(self.check.LRU(self.n_expert), self.n_expert, capacity["min_experts"])

    def on_access(self, index, resident, access):
        self.p.access(self.key[index], resident)

    def admit(self, index, victim, access):
        return self.p.admit(self.key[index], None if victim is None else self.key[victim])


@pytest.mark.parametrize("core,make", [("next-use", PyNextUse), ("tinylfu", PyTinyLfu)])
def test_a_python_policy_with_context_and_admission_counts_what_the_core_counts(core, make):
    trace = bmoe_sim.load_trace(shared_trace(MIXTRAL))
    flags = dict(cache_mb=experts_mb(trace, 3), force_cache=True)
    rust = bmoe_sim.replay(trace, policy=core, **flags)
    python = bmoe_sim.replay(trace, policy=make(), **flags)
    keys = COUNTS + ("bypasses",)
    assert {k: python.counters[k] for k in keys} == {k: rust.counters[k] for k in keys}
    assert rust.counters["evictions"] > 1000
    if core == "tinylfu":
        assert rust.counters["bypasses"] > 1000, "the filter must refuse misses, often"


def test_a_policy_that_says_it_filters_must_have_admit():
    class NoAdmit(Lru):
        filters_admission = True

    with pytest.raises(TypeError, match="admit"):
        bmoe_sim.replay(TINY, policy=NoAdmit(), force_cache=True, cache_mb=4)
