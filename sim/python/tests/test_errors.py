"""Bad input is a Python exception whose message names what was wrong; nothing panics."""

from __future__ import annotations

import pytest

import bmoe_sim
from bmoe_sim.policies import Lru
from conftest import TINY


def test_a_missing_trace_is_a_file_not_found_error_naming_it(tmp_path):
    missing = tmp_path / "nope.route.csv"
    with pytest.raises(FileNotFoundError, match="nope.route.csv"):
        bmoe_sim.load_trace(missing)
    with pytest.raises(FileNotFoundError, match="nope.route.csv"):
        bmoe_sim.replay(missing, cache_mb=4, force_cache=True)
    with pytest.raises(FileNotFoundError, match="nope.route.csv"):
        bmoe_sim.sweep(missing)
    with pytest.raises(OSError):
        bmoe_sim.load_trace(tmp_path)  # a directory


def test_a_malformed_trace_is_a_value_error_naming_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.route.csv"
    text = TINY.read_text().splitlines()
    header = next(i for i, l in enumerate(text) if l.startswith("turn,"))
    text[header + 3] = "0,0,0,0,2,99,0.5,0,313344,0"  # expert 99 of 16
    bad.write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match=r"bad\.route\.csv.*line"):
        bmoe_sim.load_trace(bad)
    with pytest.raises(ValueError, match="bad.route.csv"):
        bmoe_sim.stats(bad)
    (tmp_path / "empty.csv").write_text("hello\n")
    with pytest.raises(ValueError, match="empty.csv"):
        bmoe_sim.replay(tmp_path / "empty.csv", cache_mb=4, force_cache=True)


def test_a_bad_policy_name_flag_or_value_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"unknown policy 'fifo'.*lru.*sieve"):
        bmoe_sim.replay(TINY, cache_mb=4, policy="fifo")
    with pytest.raises(ValueError, match="fifo"):
        bmoe_sim.sweep(TINY, policies=["lru", "fifo"])
    with pytest.raises(ValueError, match="--no-such-flag"):
        bmoe_sim.replay(TINY, cache_mb=4, no_such_flag=3)
    with pytest.raises(ValueError, match="--cache-mb"):
        bmoe_sim.replay(TINY, cache_mb="lots")
    with pytest.raises(ValueError, match="profile"):
        bmoe_sim.replay(TINY, cache_mb=4, force_cache=True, profile="no-such-phone")
    with pytest.raises(ValueError, match="x="):
        bmoe_sim.sweep_table([{"trace_name": "t", "layer_ids": [0]}], x="furlongs")
    with pytest.raises(ValueError, match="placements"):
        bmoe_sim.sweep(TINY, placements=["file"])
    with pytest.raises(TypeError, match="flag value"):
        bmoe_sim.replay(TINY, cache_mb=[True])


def test_a_policy_object_without_the_five_methods_is_a_type_error_naming_the_method():
    class Half:
        def init(self, layout):
            pass

        def on_insert(self, index):
            pass

    with pytest.raises(TypeError, match=r"Half has no method on_hit\(\)"):
        bmoe_sim.replay(TINY, cache_mb=4, force_cache=True, policy=Half())
    with pytest.raises(ValueError, match="eviction"):
        bmoe_sim.replay(TINY, cache_mb=4, force_cache=True, policy=Lru(), eviction="lfu")


def test_a_policy_name_that_cannot_go_into_the_preamble_is_refused():
    class Spaced(Lru):
        name = "my lru"

    with pytest.raises(ValueError, match='"my lru"' ):
        bmoe_sim.replay(TINY, cache_mb=4, force_cache=True, policy=Spaced())


def test_a_policy_that_raises_stops_the_run_with_its_exception_as_the_cause():
    class Broken(Lru):
        name = "broken"

        def on_hit(self, index):
            raise KeyError(f"no {index}")

    with pytest.raises(bmoe_sim.PolicyError, match=r"py:broken: on_hit\(\d+\) raised") as e:
        bmoe_sim.replay(TINY, cache_mb=4, force_cache=True, policy=Broken())
    assert isinstance(e.value.__cause__, KeyError)


def test_a_policy_answering_no_key_or_a_wrong_one_is_refused_by_name():
    class Words(Lru):
        def victim(self, is_evictable):
            return "the oldest"

    with pytest.raises(bmoe_sim.PolicyError, match=r"victim\(is_evictable\) returned 'the oldest'"):
        bmoe_sim.replay(TINY, cache_mb=4, force_cache=True, policy=Words())

    class Absent(Lru):
        name = "absent"

        def victim(self, is_evictable):
            return next(i for i in range(64) if i not in self.order)

    with pytest.raises(RuntimeError, match="py:absent named victim"):
        bmoe_sim.replay(TINY, cache_mb=4, force_cache=True, policy=Absent())

    class Never(Lru):
        def victim(self, is_evictable):
            return None

    with pytest.raises(RuntimeError, match="found no victim"):
        bmoe_sim.replay(TINY, cache_mb=4, force_cache=True, policy=Never())
