"""Fixtures of the bmoe_sim tests: the bmoe-sim binary the results are compared with, the
traces (the repository's, and the real ones in ../shared, skipped with a message when absent
and a failure under CI=true), and a runner for the binary."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
IN_CI = os.environ.get("CI") in ("true", "1")


def missing(what: str) -> None:
    """Skip for a missing input, or fail under CI=true (CI must run everything)."""
    if IN_CI:
        pytest.fail(f"CI=true but {what}")
    pytest.skip(what)


def need(module: str):
    """Import an optional package (pandas, distributed), or skip (fail under CI=true)."""
    try:
        return __import__(module)
    except ImportError:
        missing(f"{module} is not installed (pip install -r scripts/requirements-test.txt)")


@pytest.fixture(scope="session")
def sim_bin() -> Path:
    """The bmoe-sim binary: $BMOE_SIM_BIN, else the workspace's target/{debug,release}."""
    given = os.environ.get("BMOE_SIM_BIN")
    candidates = [Path(given)] if given else [REPO / "target" / p / "bmoe-sim" for p in ("debug", "release")]
    for c in candidates:
        if c.is_file():
            return c
    missing(f"no bmoe-sim binary at {', '.join(map(str, candidates))} (cargo build -p bmoe-sim, or set BMOE_SIM_BIN)")


def shared_trace(name: str) -> Path:
    """``../shared/traces/NAME`` beside the project (or ``$BMOE_SHARED_DIR/traces/NAME``)."""
    base = Path(os.environ.get("BMOE_SHARED_DIR", REPO.parent / "shared"))
    p = base / "traces" / name
    if not p.exists():
        missing(f"the shared trace {p} is not there")
    return p


DEEPSEEK = "deepseek-v2-lite-puffin.route.csv"
MIXTRAL = "mixtral-8x7b-humaneval.route.csv"
TINY = REPO / "traces" / "tiny-s1-cache4.route.csv"
TINY_OVERLAP = REPO / "traces" / "tiny-s1-cache8-overlap.route.csv"


def run_bin(sim_bin: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    """The binary with ``args`` in ``cwd``: its exit code and raw stdout/stderr bytes."""
    return subprocess.run([str(sim_bin), *map(str, args)], cwd=cwd, capture_output=True, check=False)


def experts_mb(trace, per_layer: int) -> int:
    """A budget of ``per_layer`` experts in every MoE layer, in whole MiB."""
    return per_layer * len(trace.moe_layers) * max(trace.expert_bytes) // 2**20
