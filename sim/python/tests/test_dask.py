"""A sweep over traces x policies x budgets is independent cells: run on Dask's distributed
LocalCluster (two worker processes), the cells give the serial sweep's tables byte for byte.
Dask schedules; bmoe_sim only says what the cells are (sweep_grid), runs one (sweep_cell) and
makes the tables from them (sweep_table)."""

from __future__ import annotations

import functools

import bmoe_sim
from conftest import DEEPSEEK, MIXTRAL, TINY, need, shared_trace

# What every trace is swept over; the budgets in experts per MoE layer of each trace.
FLAGS = dict(policies=["lru", "sieve", "belady"], lanes=[4], overlap="on", bootstrap=200, seed=7, x="experts")
BUDGETS = {TINY.name: [4, 8], DEEPSEEK: [6, 18], MIXTRAL: [2, 4]}


def run_cell(job):
    """One cell on a worker: (trace, its flags, the cell)."""
    trace, flags, cell = job
    return bmoe_sim.sweep_cell(trace, cell, **flags)


def test_a_sweep_on_a_dask_cluster_equals_the_serial_sweep():
    distributed = need("distributed")
    traces = [str(TINY), str(shared_trace(DEEPSEEK)), str(shared_trace(MIXTRAL))]
    jobs = []
    for t in traces:
        flags = {**FLAGS, "experts_per_layer": BUDGETS[t.rsplit("/", 1)[-1]]}
        jobs += [(t, flags, cell) for cell in bmoe_sim.sweep_grid(t, **flags)]
    assert len(jobs) == 3 * 2 * 3
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster, distributed.Client(cluster) as client:
        results = client.gather(client.map(run_cell, jobs))
        workers = set(client.run(lambda: __import__("os").getpid()).values())
    assert len(workers) == 2
    for t in traces:
        flags = {**FLAGS, "experts_per_layer": BUDGETS[t.rsplit("/", 1)[-1]]}
        cells = [r for (trace, _, _), r in zip(jobs, results) if trace == t]
        table = bmoe_sim.sweep_table(cells, bootstrap=flags["bootstrap"], seed=flags["seed"], x=flags["x"])
        serial = bmoe_sim.sweep(t, jobs=1, **flags)
        assert table.files == serial.files, t
        assert table.rows == serial.rows
        assert [c["policy"] for c in cells] == [r["policy"] for r in serial.rows]


def test_cells_from_the_grid_are_the_sweeps_cells_in_its_order():
    flags = dict(experts_per_layer=[4, 6], policies=["lfu", "belady"], predictors=["none", "prefetch:1"], overlap="both", lanes=[1])
    grid = bmoe_sim.sweep_grid(TINY, **flags)
    serial = bmoe_sim.sweep(TINY, **flags)
    # Belady only without a predictor, as the sweep runs it.
    assert len(grid) == len(serial.cells) == 2 * 2 * 2 + 2 * 1 * 2
    cells = list(map(functools.partial(bmoe_sim.sweep_cell, TINY, **flags), grid))
    assert cells == serial.cells
    assert bmoe_sim.sweep_table(cells).files == serial.files


def test_a_cache_only_grid_runs_cell_by_cell_as_the_cache_only_sweep():
    # --cache-only: one cell per budget and policy (no lanes or overlap), and the tables equal.
    flags = dict(experts_per_layer=[4, 8], policies=["lru", "tinylfu", "belady"], cache_only=True, bootstrap=0)
    grid = bmoe_sim.sweep_grid(TINY, **flags)
    assert len(grid) == 2 * 3
    assert all("lanes" not in c and "overlap" not in c for c in grid)
    serial = bmoe_sim.sweep(TINY, **flags)
    cells = [bmoe_sim.sweep_cell(TINY, c, **flags) for c in grid]
    assert cells == serial.cells
    assert all(c["tok_s"] is None and c["read_bytes"] is None for c in cells)
    assert bmoe_sim.sweep_table(cells).files == serial.files
    # The cache-only counts are the full-timing ones.
    timed = bmoe_sim.sweep(TINY, **{**flags, "cache_only": False, "lanes": [1], "overlap": "off"})
    key = lambda c: (c["budget_bytes"], c["policy"], c["hits"], c["misses"], c["evictions"], c["bypasses"])  # noqa: E731
    assert list(map(key, cells)) == list(map(key, timed.cells))
