"""Eviction policies written in Python, for ``bmoe_sim.replay(..., policy=...)``.

A policy is any object with the five methods of the core's ``EvictionPolicy`` trait, which the
core's cache calls exactly as it calls a Rust policy's:

- ``init(layout)``: once, before anything else. ``layout`` is a dict: ``n_keys`` and
  ``layers``, one dict per MoE layer (``moe_layer``, ``model_layer``, ``n_expert``,
  ``key_base``, ``expert_bytes``). A key is ``key_base + expert``, in ``[0, n_keys)``.
- ``on_insert(index)``: the key became resident.
- ``on_hit(index)``: the key was looked up and found resident.
- ``on_remove(index)``: the key left the cache (evicted, or discarded after a failed read).
- ``victim(is_evictable)``: the resident key to evict next, or ``None`` when there is none;
  ``is_evictable(index)`` says whether the cache may evict a key now (a pinned one may not).
  It answers only during this call.

Optional, as the trait's defaults are (docs/simulator.md, "A policy written in Python"):
``on_capacity(capacity)``, ``on_step_begin(step)``, ``on_layer_begin(moe_layer)``,
``on_access(index, resident, access)`` and, with ``filters_admission = True``,
``admit(index, victim, access)`` (``False`` bypasses the miss).

``name`` (a class attribute), when a string, names the policy in the CSV preamble's
``eviction=`` and in the reports, prefixed ``py:``; the class name otherwise. It must be
deterministic, as the core's are: no unseeded randomness, no iteration over a set of ints
whose order you did not choose.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional


class Lru:
    """The globally least recently used key, as the core's ``lru``: it gives the same hits,
    misses and evictions (tests/test_policy.py), and is the template of a Python policy."""

    name = "lru"

    def init(self, layout: dict) -> None:
        # Oldest first: a hit or an insert moves the key to the end.
        self.order: "OrderedDict[int, None]" = OrderedDict()

    def on_insert(self, index: int) -> None:
        self.order[index] = None
        self.order.move_to_end(index)

    def on_hit(self, index: int) -> None:
        self.order.move_to_end(index)

    def on_remove(self, index: int) -> None:
        self.order.pop(index, None)

    def victim(self, is_evictable: Callable[[int], bool]) -> Optional[int]:
        for index in self.order:
            if is_evictable(index):
                return index
        return None
