#!/usr/bin/env python3
"""Independent count of expert-cache hits over a route trace (stdlib only).

bmoe-sim replays a route trace through the core's ExpertCache; this script reads the same
trace with its own parser and simulates the same global cache by itself, so a gate can
compare the two counts exactly. It shares no code with bmoe.

The model it implements (docs/simulator.md, "Admission rule"):
  - one global cache of BUDGET bytes over every (layer, expert); an expert costs its layer's
    expert_bytes;
  - accesses come in groups, one per (engine step, MoE layer), in step order and then layer
    order; a decode step is one token; a turn's prefill rows are one step over the whole
    prompt (a layer's group is the union of its rows' experts, rows in position order);
    within a group, experts in first-use order (row order, then router rank), each once;
  - admission rule: every expert of a group is looked up first (hits are pinned and, for LRU,
    become most recent); then the misses are admitted in order, each evicting unpinned
    entries (LRU: least recent first; Belady: farthest next use first, ties to the smallest
    key) until it fits; a miss that does not fit beside the pinned entries unpins the group's
    pinned entries first (a new admission wave);
  - the cache persists across turns (a session keeps it warm).

The newer policies (layer-lru, 2q, lecar, arc, s3fifo, sieve; docs/policies.md) are
re-implemented here from their written rules as small classes with the same four events the
core's EvictionPolicy has (insert, hit, remove, victim among the evictable), driven by the same
admission loop. The queue-walking ones (s3fifo, sieve) make their moves inside victim(), as the
papers' loops do; the loop always removes the victim straight after.

Issue 36's policies use three more events, which the loop sends to a class that has them:
layer_begin(layer) at the start of each group (one per engine step and MoE layer), access(key,
resident) on every lookup before hit(), and admit(key, victim) for each miss that fits beside the
pinned entries, before anything is evicted for it (victim = the key victim() would name, None
when the miss fits without evicting). A refused miss is bypassed: counted, read, never inserted.
tinylfu and tinylfu-s3fifo wrap LRU and S3-FIFO in a TinyLFU admission filter (count-min sketch,
doorkeeper, aging; the hash is SplitMix64's finaliser, as docs/policies.md defines it); next-use
evicts the largest expected distance to the next use over the layer cycle, in integer
arithmetic. A victim() that moves things (S3-FIFO) is asked for admit() on a copy.
next-use-hazard is next-use with the next chance's probability read off a hazard table learned
from each expert's last router weight and missed visits; it also hears step_begin(phase) at each
engine step, and access(key, resident, weight_max) with the largest router weight of the key's
rows in the group (nan when the trace has none), from the trace's own weight column.

Usage:
  sim-check.py TRACE [--experts-per-layer 2,4,6 | --budget-bytes N,...]
               [--policy lru,belady,layer-lru,2q,lecar,arc,s3fifo,sieve,tinylfu,tinylfu-s3fifo,
                next-use,next-use-hazard] [--turns N]
Prints one JSON object per (policy, budget).
"""

import argparse
import copy
import csv
import json
import math
import sys
from collections import OrderedDict

INF = float("inf")


def read_trace(path):
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    lines = [l for l in lines if l.strip()]
    if not lines or lines[0].lstrip("\ufeff").strip() != "# route_trace v1":
        sys.exit(f"{path}: not a route_trace v1 file")
    model = {}
    layers = []  # (layer id, expert_bytes) in file order
    body = []
    for line in lines[1:]:
        if line.startswith("#"):
            text = line[1:].strip()
            if text.startswith("note:"):
                continue
            pairs = dict(tok.split("=", 1) for tok in text.split() if "=" in tok)
            if "model" in pairs:
                model = pairs
            elif "layer" in pairs:
                layers.append((int(pairs["layer"]), int(pairs["expert_bytes"])))
            continue
        body.append(line)
    n_expert = int(model["n_expert"])
    pos_of = {lid: i for i, (lid, _) in enumerate(layers)}
    cells = {}
    for row in csv.DictReader(body):
        key = (int(row["turn"]), int(row["phase"]), int(row["step"]), pos_of[int(row["layer"])])
        cells.setdefault(key, []).append((int(row["slot"]), int(row["expert"])))
    return n_expert, [b for _, b in layers], cells


def access_groups(n_layers, cells, tags=None):
    """Groups of (layer_pos, expert), in the order the engine looks them up. When `tags` is a
    list, (turn, phase, step) of each group is appended to it (prefill: step None)."""
    groups = []
    by_turn = {}
    for (turn, phase, step, layer), slots in cells.items():
        by_turn.setdefault(turn, {}).setdefault(phase, {}).setdefault(step, {})[layer] = [
            e for _, e in sorted(slots)
        ]
    for turn in sorted(by_turn):
        phases = by_turn[turn]
        if 0 in phases:  # prefill: one batch over every prompt position
            steps = phases[0]
            for layer in range(n_layers):
                union = []
                for step in sorted(steps):
                    for e in steps[step].get(layer, []):
                        if (layer, e) not in union:
                            union.append((layer, e))
                groups.append(union)
                if tags is not None:
                    tags.append((turn, 0, None))
        for step in sorted(phases.get(1, {})):
            for layer in range(n_layers):
                ids = phases[1][step][layer]
                groups.append([(layer, e) for e in dict.fromkeys(ids)])
                if tags is not None:
                    tags.append((turn, 1, step))
    return groups


def read_weights(path):
    """{(turn, phase, step, layer position): {expert: largest weight of its rows}} from the
    trace's weight column (nan when any of the rows' weights is nan)."""
    with open(path, newline="") as f:
        lines = [l for l in f.read().splitlines() if l.strip()]
    layers = []
    body = []
    for line in lines[1:]:
        if line.startswith("#"):
            pairs = dict(tok.split("=", 1) for tok in line[1:].split() if "=" in tok)
            if "layer" in pairs and "model" not in pairs:
                layers.append(int(pairs["layer"]))
            continue
        body.append(line)
    pos_of = {lid: i for i, lid in enumerate(layers)}
    out = {}
    for row in csv.DictReader(body):
        key = (int(row["turn"]), int(row["phase"]), int(row["step"]), pos_of[int(row["layer"])])
        w = float(row["weight"])
        cell = out.setdefault(key, {})
        e = int(row["expert"])
        old = cell.get(e)
        cell[e] = w if old is None else (math.nan if math.isnan(old) or math.isnan(w)
                                         else max(old, w))
    return out


def group_weights(n_layers, weights):
    """Per group, in `access_groups`' order: {(layer, expert): the largest weight of its rows}
    (over every prompt row in a prefill group; nan when any of them is nan)."""
    def merge(into, cell, layer):
        for e, w in cell.items():
            old = into.get((layer, e))
            into[(layer, e)] = w if old is None else (
                math.nan if math.isnan(old) or math.isnan(w) else max(old, w))

    by_turn = {}
    for (turn, phase, step, layer), cell in weights.items():
        by_turn.setdefault(turn, {}).setdefault(phase, {}).setdefault(step, {})[layer] = cell
    out = []
    for turn in sorted(by_turn):
        phases = by_turn[turn]
        if 0 in phases:
            for layer in range(n_layers):
                union = {}
                for step in sorted(phases[0]):
                    merge(union, phases[0][step].get(layer, {}), layer)
                out.append(union)
        for step in sorted(phases.get(1, {})):
            for layer in range(n_layers):
                one = {}
                merge(one, phases[1][step][layer], layer)
                out.append(one)
    return out


def simulate(groups, expert_bytes, n_expert, budget, policy, on_misses=None):
    """Count one policy over `groups`; `on_misses(g, misses)` sees each group's misses."""
    size = lambda k: expert_bytes[k[0]]
    index = lambda k: k[0] * n_expert + k[1]
    nxt = []
    if policy == "belady":
        last = {}
        nxt = [None] * len(groups)
        for g in range(len(groups) - 1, -1, -1):
            nxt[g] = {k: last.get(k, INF) for k in groups[g]}
            for k in groups[g]:
                last[k] = g
    resident = OrderedDict()  # key -> next use (belady) or None; order = LRU order
    used = 0
    held = set()
    c = {"lookups": 0, "hits": 0, "misses": 0, "evictions": 0, "rereads": 0, "inserts": 0}
    for g, group in enumerate(groups):
        pinned = set()
        misses = []
        for k in group:
            c["lookups"] += 1
            if k in resident:
                c["hits"] += 1
                pinned.add(k)
                if policy == "lru":
                    resident.move_to_end(k)
                else:
                    resident[k] = nxt[g][k]
            else:
                c["misses"] += 1
                if k in held:
                    c["rereads"] += 1
                misses.append(k)
        if on_misses is not None:
            on_misses(g, misses)
        for k in misses:
            if sum(size(p) for p in pinned) + size(k) > budget:
                if not pinned:
                    sys.exit(f"expert {k} does not fit in an empty cache of {budget} bytes")
                pinned.clear()  # the wave is computed and unpinned
            while used + size(k) > budget:
                candidates = [r for r in resident if r not in pinned]
                if policy == "lru":
                    victim = candidates[0]
                else:
                    victim = max(candidates, key=lambda r: (resident[r], -index(r)))
                del resident[victim]
                used -= size(victim)
                c["evictions"] += 1
            resident[k] = nxt[g][k] if policy == "belady" else None
            used += size(k)
            held.add(k)
            pinned.add(k)
            c["inserts"] += 1
    return c


class LayerLRU:
    """Per-layer LRU partitions; the victim comes from the fullest layer (ties: lower layer)."""

    def __init__(self, n_expert):
        self.layers = {}

    def insert(self, k):
        self.layers.setdefault(k[0], OrderedDict())[k] = None

    def hit(self, k):
        self.layers[k[0]].move_to_end(k)

    def remove(self, k):
        del self.layers[k[0]][k]

    def victim(self, ok):
        for l in sorted((l for l in self.layers if self.layers[l]),
                        key=lambda l: (-len(self.layers[l]), l)):
            for k in self.layers[l]:
                if ok(k):
                    return k
        return None


class TwoQ:
    """2Q: FIFO probation A1in, ghost A1out, protected LRU Am; Kin = n/4, Kout = n/2."""

    def __init__(self, n_expert):
        self.a1in, self.am, self.ghost = OrderedDict(), OrderedDict(), OrderedDict()

    def insert(self, k):
        if k in self.ghost:
            del self.ghost[k]
            self.am[k] = None
        else:
            self.a1in[k] = None

    def hit(self, k):
        if k in self.am:
            self.am.move_to_end(k)

    def remove(self, k):
        if k in self.a1in:
            del self.a1in[k]
            self.ghost[k] = None
            kout = max(1, (len(self.a1in) + len(self.am)) // 2)
            while len(self.ghost) > kout:
                self.ghost.popitem(last=False)
        else:
            del self.am[k]

    def victim(self, ok):
        kin = max(1, (len(self.a1in) + len(self.am)) // 4)
        queues = [self.a1in, self.am] if len(self.a1in) > kin else [self.am, self.a1in]
        for q in queues:
            for k in q:
                if ok(k):
                    return k
        return None


class LeCaR:
    """LRU and LFU experts, weights learned from regret; the heavier expert acts (ties: LRU)."""

    def __init__(self, n_expert):
        self.index = lambda k: k[0] * n_expert + k[1]
        self.tick = 0
        self.last, self.freq = {}, {}
        self.resident = set()
        self.w_lru = self.w_lfu = 0.5
        self.hist = {1: OrderedDict(), 2: OrderedDict()}
        self.pending = None

    def _touch(self, k):
        self.tick += 1
        self.freq[k] = self.freq.get(k, 0) + 1
        self.last[k] = self.tick

    def insert(self, k):
        by = 1 if k in self.hist[1] else 2 if k in self.hist[2] else 0
        if by:
            n = max(1, len(self.resident))
            d = 0.005 ** (1.0 / n)
            r = d ** float(self.tick + 1 - self.hist[by][k])
            if by == 1:
                self.w_lfu *= math.exp(0.45 * r)
            else:
                self.w_lru *= math.exp(0.45 * r)
            s = self.w_lru + self.w_lfu
            self.w_lru /= s
            self.w_lfu /= s
            del self.hist[by][k]
        self.resident.add(k)
        self._touch(k)

    def hit(self, k):
        self._touch(k)

    def remove(self, k):
        self.resident.discard(k)
        pending, self.pending = self.pending, None
        if pending and pending[0] == k:
            h = self.hist[pending[1]]
            h[k] = self.tick
            while len(h) > max(1, len(self.resident)):
                h.popitem(last=False)

    def victim(self, ok):
        cands = [k for k in self.resident if ok(k)]
        if not cands:
            self.pending = None
            return None
        by_lru = min(cands, key=lambda k: (self.last[k], self.index(k)))
        by_lfu = min(cands, key=lambda k: (self.freq[k], self.last[k], self.index(k)))
        self.pending = (by_lru, 1) if self.w_lru >= self.w_lfu else (by_lfu, 2)
        return self.pending[0]


class ARC:
    """ARC: LRU lists T1 (seen once) and T2 (hit again), ghosts B1 and B2, target p for T1;
    c = the most keys held at once; p adapts on the admission of a remembered key, after the
    evictions that made room for it; REPLACE takes from T1 when |T1| > p."""

    def __init__(self, n_expert):
        self.t1, self.t2, self.b1, self.b2 = (OrderedDict() for _ in range(4))  # LRU first
        self.p = 0.0
        self.c = 0

    def insert(self, k):
        self.c = max(self.c, len(self.t1) + len(self.t2) + 1)
        c = self.c
        if k in self.b1:
            d = 1.0 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
            self.p = min(self.p + d, float(c))
            del self.b1[k]
            self.t2[k] = None
        elif k in self.b2:
            d = 1.0 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.p = max(self.p - d, 0.0)
            del self.b2[k]
            self.t2[k] = None
        else:
            if len(self.t1) + len(self.b1) >= c and self.b1:
                self.b1.popitem(last=False)
            elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
                self.b2.popitem(last=False)
            self.t1[k] = None

    def hit(self, k):
        if k in self.t1:
            del self.t1[k]
        else:
            del self.t2[k]
        self.t2[k] = None

    def remove(self, k):
        if k in self.t1:
            del self.t1[k]
            self.b1[k] = None
        else:
            del self.t2[k]
            self.b2[k] = None

    def victim(self, ok):
        lists = [self.t1, self.t2] if self.t1 and len(self.t1) > self.p else [self.t2, self.t1]
        for q in lists:
            for k in q:
                if ok(k):
                    return k
        return None


class S3FIFO:
    """S3-FIFO: small FIFO S (10 %), main FIFO M with a 2-bit count and reinsertion, ghost G
    (as many keys as M's 90 %); c = the most keys held at once. Pinned entries are passed over
    where they stand."""

    def __init__(self, n_expert):
        self.s, self.m, self.g = OrderedDict(), OrderedDict(), OrderedDict()  # oldest first
        self.count = {}
        self.c = 0

    def insert(self, k):
        self.c = max(self.c, len(self.s) + len(self.m) + 1)
        self.count[k] = 0
        if k in self.g:
            del self.g[k]
            self.m[k] = None
        else:
            self.s[k] = None

    def hit(self, k):
        self.count[k] = min(self.count[k] + 1, 3)

    def remove(self, k):
        del self.count[k]
        if k in self.s:
            del self.s[k]
            self.g[k] = None
            while 10 * len(self.g) > 9 * self.c:
                self.g.popitem(last=False)
        else:
            del self.m[k]

    def _evict_main(self, ok):
        while True:
            k = next((k for k in self.m if ok(k)), None)
            if k is None or self.count[k] == 0:
                return k
            self.count[k] -= 1
            self.m.move_to_end(k)

    def victim(self, ok):
        if 10 * len(self.s) >= self.c:
            while True:
                t = next((k for k in self.s if ok(k)), None)
                if t is None:
                    break
                if self.count[t] <= 1:
                    return t
                del self.s[t]
                self.m[t] = None
                self.count[t] = 0
                if 10 * len(self.m) > 9 * self.c:
                    break
        return self._evict_main(ok)


class Sieve:
    """SIEVE: one FIFO queue with a visited bit; the hand walks from old to new, clearing set
    bits, and evicts the first unvisited entry; pinned entries are passed over untouched."""

    def __init__(self, n_expert):
        self.newer, self.older = {}, {}  # neighbours towards the head / the tail, or None
        self.head = self.tail = None  # newest, oldest
        self.visited = {}
        self.hand = None  # the next entry to examine; None = the tail

    def insert(self, k):
        self.newer[k], self.older[k] = None, self.head
        if self.head is None:
            self.tail = k
        else:
            self.newer[self.head] = k
        self.head = k
        self.visited[k] = False

    def hit(self, k):
        self.visited[k] = True

    def remove(self, k):
        if self.hand == k:
            self.hand = self.newer[k]
        n, o = self.newer.pop(k), self.older.pop(k)
        if n is None:
            self.head = o
        else:
            self.older[n] = o
        if o is None:
            self.tail = n
        else:
            self.newer[o] = n
        del self.visited[k]

    def victim(self, ok):
        k = self.tail if self.hand is None else self.hand
        for _ in range(2 * len(self.visited)):
            if ok(k):
                if not self.visited[k]:
                    self.hand = k  # removing it moves the hand to its newer neighbour
                    return k
                self.visited[k] = False
            k = self.tail if self.newer[k] is None else self.newer[k]
        return None


class LRU:
    """Global LRU as a policy class (what tinylfu wraps)."""

    def __init__(self, n_expert):
        self.q = OrderedDict()  # least recent first

    def insert(self, k):
        self.q[k] = None

    def hit(self, k):
        self.q.move_to_end(k)

    def remove(self, k):
        del self.q[k]

    def victim(self, ok):
        return next((k for k in self.q if ok(k)), None)


M64 = (1 << 64) - 1
PHI = 0x9E3779B97F4A7C15
PSI = 0xD6E8FEB86659FD93


def mix64(x):
    """SplitMix64's finaliser on a 64-bit word."""
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


class TinyLFU:
    """TinyLFU admission in front of `inner` (docs/policies.md, "tinylfu"): a count-min sketch
    of 4 rows x width 4-bit counters (width = the smallest power of two >= max(16, capacity)),
    a doorkeeper bit per counter, conservative increments, and aging every 10 x capacity
    recorded accesses (counters and additions halved, doorkeeper cleared). A miss that must
    evict is admitted only when its estimate beats the victim's."""

    DEPTH = 4

    def __init__(self, inner, n_expert, capacity):
        self.inner = inner
        self.n_expert = n_expert
        capacity = max(1, capacity)
        self.width = 1
        while self.width < max(16, capacity):
            self.width *= 2
        self.counters = [0] * (self.DEPTH * self.width)
        self.door = [False] * (self.DEPTH * self.width)
        self.additions = 0
        self.sample = 10 * capacity

    def slots(self, k):
        i = k[0] * self.n_expert + k[1]
        return [r * self.width + (mix64((i + 1) * PHI + r * PSI) & (self.width - 1))
                for r in range(self.DEPTH)]

    def estimate(self, k):
        s = self.slots(k)
        return min(self.counters[j] for j in s) + (1 if all(self.door[j] for j in s) else 0)

    def record(self, k):
        s = self.slots(k)
        if all(self.door[j] for j in s):
            m = min(self.counters[j] for j in s)
            if m < 15:
                for j in s:
                    if self.counters[j] == m:
                        self.counters[j] += 1
        else:
            for j in s:
                self.door[j] = True
        self.additions += 1
        if self.additions >= self.sample:
            self.counters = [c >> 1 for c in self.counters]
            self.door = [False] * len(self.door)
            self.additions //= 2

    def insert(self, k):
        self.inner.insert(k)

    def hit(self, k):
        self.inner.hit(k)

    def remove(self, k):
        self.inner.remove(k)

    def victim(self, ok):
        return self.inner.victim(ok)

    def peek_victim(self, ok):
        # S3-FIFO's victim() makes its moves: ask a copy of what it moves (the queues and the
        # counts), as the core's victim() is a query.
        if isinstance(self.inner, S3FIFO):
            probe = copy.copy(self.inner)
            probe.s, probe.m, probe.count = OrderedDict(probe.s), OrderedDict(probe.m), \
                dict(probe.count)
            return probe.victim(ok)
        return self.inner.victim(ok)

    def access(self, k, resident):
        self.record(k)

    def admit(self, k, victim):
        return victim is None or self.estimate(k) > self.estimate(victim)


class NextUse:
    """next-use (docs/policies.md): p[k] in 1/65536, decayed by p >> 2 at each visit of k's layer
    and raised by 65536 >> 2 (at most to 65536) at each lookup; the victim has the largest
    tau*Q + n*((Q - p)*Q // p) (p = 0: infinite), tau = ((layer - current - 1) mod n) + 1, ties
    to the least recent lookup, then the lower key index."""

    Q = 1 << 16
    SHIFT = 2

    def __init__(self, n_expert, n_layers):
        self.n_expert = n_expert
        self.n = n_layers
        self.p = {}
        self.last = {}
        self.tick = 0
        self.current = 0
        self.resident = [set() for _ in range(n_layers)]  # per layer

    def layer_begin(self, layer):
        self.current = layer
        for e in range(self.n_expert):
            k = (layer, e)
            p = self.p.get(k, 0)
            if p:
                self.p[k] = p - (p >> self.SHIFT)

    def access(self, k, resident):
        self.p[k] = min(self.Q, self.p.get(k, 0) + (self.Q >> self.SHIFT))
        self.tick += 1
        self.last[k] = self.tick

    def insert(self, k):
        self.resident[k[0]].add(k)

    def hit(self, k):
        pass

    def remove(self, k):
        self.resident[k[0]].discard(k)

    def distance(self, k):
        p = self.p.get(k, 0)
        if p == 0:
            return M64
        tau = (k[0] - self.current - 1) % self.n + 1
        return tau * self.Q + self.n * ((self.Q - p) * self.Q // p)

    def victim(self, ok):
        # The rule over all resident keys, in two steps for speed: within one layer tau is
        # shared and the distance falls strictly as p grows, so a layer's farthest is its
        # lowest (p, last lookup, expert); then the layers' farthest are compared in full.
        best, best_key = None, None
        p, last = self.p, self.last
        for keys in self.resident:
            cands = [(p.get(k, 0), last.get(k, 0), k[1], k) for k in keys if ok(k)]
            if not cands:
                continue
            k = min(cands)[3]
            rank = (self.distance(k), -last.get(k, 0), -(k[0] * self.n_expert + k[1]))
            if best is None or rank > best:
                best, best_key = rank, k
        return best_key


class NextUseHazard(NextUse):
    """next-use-hazard (docs/policies.md): next-use's p, tau and ties, with the next chance's
    probability h read off a table learned from decode visits: per (bucket of the key's last
    routing: min(3, floor(4 w)) by its largest router weight w, 4 when w is nan; visits of its
    layer missed since, up to 8), the visits seen and the visits at which it was routed; h =
    (4 routed + 1) Q // (4 (seen + 1)). Distance: tau Q + n ((Q - h) Q // p) (p = 0: infinite).
    A visit is counted when the next step or layer begins; prefill visits teach nothing."""

    MAX_GAP = 8
    NEVER = None

    def __init__(self, n_expert, n_layers):
        super().__init__(n_expert, n_layers)
        self.gap = {}  # key -> missed visits (absent: never routed)
        self.bucket = {}
        self.seen = [[0] * (self.MAX_GAP + 1) for _ in range(5)]
        self.routed = [[0] * (self.MAX_GAP + 1) for _ in range(5)]
        self.decode = True
        self.open = None  # (layer, {expert: (bucket, gap)}, routed experts)

    def close_visit(self):
        if self.open is None:
            return
        layer, states, routed = self.open
        for e, (b, g) in states.items():
            self.seen[b][g] += 1
            if e in routed:
                self.routed[b][g] += 1
        self.open = None

    def step_begin(self, phase):
        self.invalidate()
        self.close_visit()
        self.decode = phase == 1

    def layer_begin(self, layer):
        self.invalidate()
        self.close_visit()
        super().layer_begin(layer)
        states = {}
        for e in range(self.n_expert):
            k = (layer, e)
            g = self.gap.get(k)
            if g is not None:
                states[e] = (self.bucket[k], g)
                self.gap[k] = min(g + 1, self.MAX_GAP)
        if self.decode:
            self.open = (layer, states, set())

    def access(self, k, resident, weight_max=math.nan):
        self.invalidate()
        super().access(k, resident)
        self.gap[k] = 0
        self.bucket[k] = 4 if math.isnan(weight_max) else \
            0 if weight_max <= 0 else min(3, int(weight_max * 4))
        if self.open is not None and self.open[0] == k[0]:
            self.open[2].add(k[1])

    def hazard(self, b, g):
        return (4 * self.routed[b][g] + 1) * self.Q // (4 * (self.seen[b][g] + 1))

    def distance(self, k):
        p = self.p.get(k, 0)
        if p == 0 or k not in self.gap:
            return M64
        tau = (k[0] - self.current - 1) % self.n + 1
        h = min(self.hazard(self.bucket[k], self.gap[k]), self.Q)
        return tau * self.Q + self.n * ((self.Q - h) * self.Q // p)

    # Every rank is fixed between two lookups or layer beginnings (the admission of a group's
    # misses), so the resident keys are ranked once per such stretch (`order`, farthest first)
    # and keys inserted during it are ranked on their own (`extra`).
    def invalidate(self):
        self.order = None
        self.extra = []

    def rank(self, k):
        return (self.distance(k), -self.last.get(k, 0), -(k[0] * self.n_expert + k[1]))

    def insert(self, k):
        super().insert(k)
        if getattr(self, "order", None) is not None:
            self.extra.append(k)

    def victim(self, ok):
        if getattr(self, "order", None) is None:
            self.order = sorted((k for keys in self.resident for k in keys), key=self.rank,
                                reverse=True)
            self.extra = []
        best = None
        for k in self.order:
            if k in self.resident[k[0]] and ok(k):
                best = k
                break
        for k in self.extra:
            if k in self.resident[k[0]] and ok(k) and (best is None
                                                       or self.rank(k) > self.rank(best)):
                best = k
        return best


POLICY_CLASSES = {"layer-lru": LayerLRU, "2q": TwoQ, "lecar": LeCaR, "arc": ARC,
                  "s3fifo": S3FIFO, "sieve": Sieve}
# Issue 36's: built from (n_expert, n_layers, capacity in experts).
CONTEXT_POLICIES = {
    "tinylfu": lambda ne, nl, cap: TinyLFU(LRU(ne), ne, cap),
    "tinylfu-s3fifo": lambda ne, nl, cap: TinyLFU(S3FIFO(ne), ne, cap),
    "next-use": lambda ne, nl, cap: NextUse(ne, nl),
    "next-use-hazard": lambda ne, nl, cap: NextUseHazard(ne, nl),
}
# Those that hear each step's phase and each lookup's largest router weight.
ROUTING_POLICIES = {"next-use-hazard"}


def simulate_policy(groups, expert_bytes, n_expert, budget, policy, tags=None, weights=None):
    """The same admission loop as `simulate`, with eviction decided by a policy class; a
    ROUTING_POLICIES class also hears each step's phase (`tags`, from `access_groups`) and
    each lookup's largest weight (`weights`, from `group_weights`)."""
    size = lambda k: expert_bytes[k[0]]
    if policy in CONTEXT_POLICIES:
        uniform = len(set(expert_bytes)) == 1
        capacity = budget // (expert_bytes[0] if uniform else max(expert_bytes))
        pol = CONTEXT_POLICIES[policy](n_expert, len(expert_bytes), capacity)
    else:
        pol = POLICY_CLASSES[policy](n_expert)
    layer_begin = getattr(pol, "layer_begin", None)
    access = getattr(pol, "access", None)
    admit = getattr(pol, "admit", None)
    resident = set()
    used = 0
    held = set()
    c = {"lookups": 0, "hits": 0, "misses": 0, "evictions": 0, "rereads": 0, "inserts": 0,
         "bypasses": 0}
    step_begin = getattr(pol, "step_begin", None) if tags is not None else None
    for g, group in enumerate(groups):
        if step_begin and (g == 0 or tags[g] != tags[g - 1]):
            step_begin(tags[g][1])
        if layer_begin and group:
            layer_begin(group[0][0])
        pinned = set()
        misses = []
        for k in group:
            c["lookups"] += 1
            if access and weights is not None:
                access(k, k in resident, weights[g][k])
            elif access:
                access(k, k in resident)
            if k in resident:
                c["hits"] += 1
                pinned.add(k)
                pol.hit(k)
            else:
                c["misses"] += 1
                if k in held:
                    c["rereads"] += 1
                misses.append(k)
        for k in misses:
            if sum(size(p) for p in pinned) + size(k) > budget:
                if not pinned:
                    sys.exit(f"expert {k} does not fit in an empty cache of {budget} bytes")
                pinned.clear()
            if admit:
                victim = None
                if used + size(k) > budget:
                    victim = pol.peek_victim(lambda r: r in resident and r not in pinned)
                if not admit(k, victim):
                    c["bypasses"] += 1
                    continue
            while used + size(k) > budget:
                victim = pol.victim(lambda r: r in resident and r not in pinned)
                if victim is None or victim not in resident or victim in pinned:
                    sys.exit(f"{policy}: no valid victim with {used} bytes resident")
                resident.discard(victim)
                pol.remove(victim)
                used -= size(victim)
                c["evictions"] += 1
            resident.add(k)
            pol.insert(k)
            used += size(k)
            held.add(k)
            pinned.add(k)
            c["inserts"] += 1
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--experts-per-layer", default="2,4,6",
                    help="budgets as N experts per layer: N x layers x expert_bytes (default 2,4,6)")
    ap.add_argument("--budget-bytes", default=None, help="budgets in bytes (overrides the above)")
    ap.add_argument("--policy", default="lru,belady")
    ap.add_argument("--turns", type=int, default=None, help="only the first N turns (by id)")
    a = ap.parse_args()
    n_expert, expert_bytes, cells = read_trace(a.trace)
    if a.turns is not None:
        keep = sorted({key[0] for key in cells})[: a.turns]
        cells = {key: v for key, v in cells.items() if key[0] in keep}
    tags = []
    groups = access_groups(len(expert_bytes), cells, tags)
    weights = None
    if any(p in ROUTING_POLICIES for p in a.policy.split(",")):
        by_cell = {key: v for key, v in read_weights(a.trace).items() if key in cells}
        weights = group_weights(len(expert_bytes), by_cell)
        if len(weights) != len(groups):
            sys.exit(f"{a.trace}: {len(weights)} weighted groups for {len(groups)} groups")
    if a.budget_bytes:
        budgets = [int(b) for b in a.budget_bytes.split(",")]
    else:
        per = max(expert_bytes)
        budgets = [int(n) * len(expert_bytes) * per for n in a.experts_per_layer.split(",")]
    for policy in a.policy.split(","):
        if policy not in ("lru", "belady") and policy not in POLICY_CLASSES \
                and policy not in CONTEXT_POLICIES:
            sys.exit(f"unknown policy {policy}")
        for b in budgets:
            if policy in ROUTING_POLICIES:
                c = simulate_policy(groups, expert_bytes, n_expert, b, policy, tags, weights)
            elif policy in POLICY_CLASSES or policy in CONTEXT_POLICIES:
                c = simulate_policy(groups, expert_bytes, n_expert, b, policy)
            else:
                c = simulate(groups, expert_bytes, n_expert, b, policy)
            print(json.dumps({"policy": policy, "budget_bytes": b, **c}))


if __name__ == "__main__":
    main()
