"""bmoe_sim gives the bmoe-sim binary's results: every file a call writes is the binary's, byte
for byte, its stdout and stderr are the binary's, and the numbers it returns are those the
binary prints. Each test runs the binary in one directory and the module in another with the
same relative output names (the outputs' paths appear in the text)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import bmoe_sim
from conftest import DEEPSEEK, MIXTRAL, REPO, TINY, TINY_OVERLAP, experts_mb, need, run_bin, shared_trace


def dirs(tmp_path: Path):
    a, b = tmp_path / "binary", tmp_path / "module"
    a.mkdir()
    b.mkdir()
    return a, b


def same_tree(a: Path, b: Path) -> list:
    """Every file under ``a`` and ``b``: the same names and the same bytes."""
    names_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert names_a == names_b
    for n in names_a:
        assert (a / n).read_bytes() == (b / n).read_bytes(), f"{n} differs"
    return names_a


def sim_line(stdout: bytes) -> dict:
    """The binary's ``sim: key=value ...`` line."""
    line = next(l for l in stdout.decode().splitlines() if l.startswith("sim: profile="))
    return dict(kv.split("=", 1) for kv in line[len("sim: ") :].split())


def summaries(csv_path: Path) -> list:
    """The ``# summary`` trailers of a metrics CSV, as dicts of numbers."""
    out = []
    for line in csv_path.read_text().splitlines():
        if line.startswith("# summary "):
            out.append({k: bmoe_sim._number(v) for k, v in (kv.split("=", 1) for kv in line.split()[2:])})
    return out


def check_replay(p, r, a: Path, b: Path, files=("sim.csv", "route.csv", "io.csv")):
    assert p.returncode == 0, p.stderr.decode()
    assert r.stdout.encode() == p.stdout
    assert r.stderr.encode() == p.stderr
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    line = sim_line(p.stdout)
    for k in ("steps", "lookups", "hits", "misses", "evictions", "rereads", "read_bytes"):
        assert r.counters[k] == int(line[k]), k
    assert f"{r.counters['virtual_s']:.6f}" == line["virtual_s"]
    if "sim.csv" in files:
        assert r.turns == summaries(b / "sim.csv")


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo"])
def test_replay_writes_the_binarys_bytes(sim_bin, tmp_path, monkeypatch, policy):
    a, b = dirs(tmp_path)
    p = run_bin(
        sim_bin, "replay", "--trace", TINY, "--cache-mb", "4", "--force-cache", "--eviction", policy,
        "--overlap", "--io-threads", "2", "--csv", "sim.csv", "--route-trace", "route.csv",
        "--io-trace", "io.csv", "--progress", cwd=a,
    )
    monkeypatch.chdir(b)
    r = bmoe_sim.replay(
        TINY, cache_mb=4, force_cache=True, policy=policy, overlap=True, io_threads=2,
        csv="sim.csv", route_trace="route.csv", io_trace="io.csv", progress=True,
    )
    check_replay(p, r, a, b)
    assert r.policy == policy and r.kind == "tokens"
    # One turn: the whole replay's summary is the turn's.
    assert r.summary == r.turns[0]
    assert r.counters["hits"] + r.counters["misses"] == r.counters["lookups"]


@pytest.mark.parametrize("name", [DEEPSEEK, MIXTRAL])
def test_replay_of_a_real_trace_writes_the_binarys_bytes(sim_bin, tmp_path, monkeypatch, name):
    trace = bmoe_sim.load_trace(shared_trace(name))
    mb = experts_mb(trace, 3 if trace.n_expert <= 16 else 12)
    a, b = dirs(tmp_path)
    p = run_bin(
        sim_bin, "replay", "--trace", trace.path, "--cache-mb", mb, "--force-cache", "--eviction", "arc",
        "--overlap", "--io-threads", "4", "--profile", "laptop-nvme", "--csv", "sim.csv", cwd=a,
    )
    monkeypatch.chdir(b)
    r = bmoe_sim.replay(
        trace, cache_mb=mb, force_cache=True, policy="arc", overlap=True, io_threads=4,
        profile="laptop-nvme", csv="sim.csv",
    )
    check_replay(p, r, a, b, files=("sim.csv",))
    assert r.counters["evictions"] > 0, "the budget must make the policy choose"
    assert len(r.turns) == trace.turns


def test_whatif_writes_the_binarys_bytes(sim_bin, tmp_path, monkeypatch):
    a, b = dirs(tmp_path)
    args = dict(cache_mb=8, force_cache=True, csv="sim.csv")
    p = run_bin(
        sim_bin, "whatif", "--trace", TINY, "--model", TINY_OVERLAP, "--device", "ufs40-phone",
        "--cache-mb", "8", "--force-cache", "--csv", "sim.csv", cwd=a,
    )
    monkeypatch.chdir(b)
    r = bmoe_sim.whatif(TINY, model=TINY_OVERLAP, device="ufs40-phone", **args)
    check_replay(p, r, a, b, files=("sim.csv",))
    assert r.stdout.startswith("whatif: routing")
    assert r.profile == "ufs40-phone"


def test_whatif_maps_a_real_routing_as_the_binary_does(sim_bin, tmp_path, monkeypatch):
    mixtral, deepseek = shared_trace(MIXTRAL), shared_trace(DEEPSEEK)
    a, b = dirs(tmp_path)
    p = run_bin(
        sim_bin, "whatif", "--trace", deepseek, "--model", mixtral, "--device", "laptop-nvme",
        "--cache-mb", "20000", "--force-cache", cwd=a,
    )
    monkeypatch.chdir(b)
    r = bmoe_sim.whatif(deepseek, model=mixtral, device="laptop-nvme", cache_mb=20000, force_cache=True)
    check_replay(p, r, a, b, files=())
    assert "whatif: mapping   " in r.stdout and "none:" not in r.stdout.split("whatif: mapping")[1].splitlines()[0]


def test_sweep_writes_the_binarys_files(sim_bin, tmp_path, monkeypatch):
    trace = shared_trace(DEEPSEEK)
    a, b = dirs(tmp_path)
    p = run_bin(
        sim_bin, "sweep", "--trace", trace, "--experts-per-layer", "6,12", "--policies", "lru,lfu,belady",
        "--lanes", "4", "--overlap", "on", "--x", "experts", "--bootstrap", "200", "--out", "sweep", cwd=a,
    )
    assert p.returncode == 0, p.stderr.decode()
    flags = dict(experts_per_layer=[6, 12], policies=["lru", "lfu", "belady"], lanes=[4], overlap="on", x="experts", bootstrap=200)
    monkeypatch.chdir(b)
    s = bmoe_sim.sweep(trace, out="sweep", **flags)
    assert s.stdout.encode() == p.stdout
    assert s.stderr.encode() == p.stderr
    names = same_tree(a / "sweep", b / "sweep")
    assert {"sweep.csv", "pivot.md", "hit_rate.png", "per_layer.svg"} <= {n.name for n in names}
    for name, text in s.files.items():
        assert (a / "sweep" / name).read_text() == text
    # Without a directory: the same tables, nothing written.
    c = tmp_path / "nothing"
    c.mkdir()
    monkeypatch.chdir(c)
    quiet = bmoe_sim.sweep(trace, **flags)
    assert quiet.files == s.files and quiet.rows == s.rows
    assert list(c.iterdir()) == []
    # The numbers: the rows are the file's, and every cell's counts are the rows'.
    assert len(s.rows) == len(s.cells) == 6
    for row, cell in zip(s.rows, s.cells):
        for k in ("lookups", "hits", "misses", "evictions", "rereads", "inserts", "read_bytes", "tokens"):
            assert row[k] == cell[k], k
        assert (row["policy"], row["lanes"], row["overlap"]) == (cell["policy"], cell["lanes"], int(cell["overlap"]))
    assert s.arrays()["hits"].tolist() == [r["hits"] for r in s.rows]
    need("pandas")
    frame = s.to_pandas()
    assert list(frame["policy"]) == ["lru", "lfu", "belady"] * 2
    assert frame["hits"].tolist() == [r["hits"] for r in s.rows]


def test_stats_writes_the_binarys_files(sim_bin, tmp_path, monkeypatch):
    a, b = dirs(tmp_path)
    p = run_bin(sim_bin, "stats", "--trace", TINY, "--out", "stats", cwd=a)
    assert p.returncode == 0, p.stderr.decode()
    monkeypatch.chdir(b)
    s = bmoe_sim.stats(TINY, out="stats")
    assert s.summary.encode() == p.stdout
    same_tree(a / "stats", b / "stats")
    # The arrays are what popularity.csv and reuse.csv say.
    rows = [l.split(",") for l in (a / "stats" / "popularity.csv").read_text().splitlines()[1:]]
    assert s.popularity.shape == (len(s.layer_ids), s.n_expert)
    for layer, expert, routings, _ in rows:
        assert s.popularity[s.layer_ids.index(int(layer)), int(expert)] == int(routings)
    reuse = [l.split(",") for l in (a / "stats" / "reuse.csv").read_text().splitlines()[1:]]
    assert [int(r[1]) for r in reuse[:-1]] == s.stack_distance.tolist()
    assert reuse[-1][:2] == ["cold", str(s.cold)]
    assert int(s.popularity.sum()) == s.routings
    # Without a directory: the summary only, nothing written.
    quiet = bmoe_sim.stats(TINY)
    assert p.stdout.decode().startswith(quiet.summary)
    assert np.array_equal(quiet.popularity, s.popularity)
    need("pandas")
    frames = s.to_pandas()
    header = (a / "stats" / "reuse.csv").read_text().splitlines()[0].split(",")
    assert list(frames["reuse"].columns) == header
    assert frames["reuse"]["routings"].tolist() == s.stack_distance.tolist()
    assert int(frames["popularity"]["routings"].sum()) == s.routings


def test_calibrate_writes_the_binarys_profile(sim_bin, tmp_path, monkeypatch):
    run = REPO / "traces" / "tiny-s1-cache4"
    inputs = [f"{run}.csv", f"{run}.route.csv", f"{run}.io.csv"]
    a, b = dirs(tmp_path)
    p = run_bin(
        sim_bin, "calibrate", "--csv", inputs[0], "--trace", inputs[1], "--io-trace", inputs[2],
        "--out", "p.json", "--name", "tiny", cwd=a,
    )
    assert p.returncode == 0, p.stderr.decode()
    monkeypatch.chdir(b)
    c = bmoe_sim.calibrate(inputs[0], trace=inputs[1], io_trace=inputs[2], out="p.json", name="tiny")
    assert c.stdout.encode() == p.stdout
    assert c.stderr.encode() == p.stderr
    assert c.exit_code == p.returncode
    assert (a / "p.json").read_bytes() == (b / "p.json").read_bytes() == c.profile_json.encode()
    assert c.profile == json.loads((a / "p.json").read_text())
    assert c.profile["name"] == "tiny"
    assert [check["line"] for check in c.self_check] == [
        l[len("calibrate: ") :] for l in p.stdout.decode().splitlines() if l.startswith("calibrate: self-check")
    ]


def test_convert_writes_the_binarys_trace(sim_bin, tmp_path, monkeypatch):
    # A capture in the long CSV layout, made from the tiny trace's decode routings.
    t = bmoe_sim.load_trace(TINY)
    c = t.columns()
    capture = tmp_path / "capture.csv"
    lines = ["turn,step,layer,experts"]
    decode = c["phase"] == 1
    for turn, step, layer in sorted(set(zip(c["turn"][decode], c["step"][decode], c["moe_layer"][decode]))):
        mask = decode & (c["turn"] == turn) & (c["step"] == step) & (c["moe_layer"] == layer)
        lines.append(f"{turn},{step},{t.moe_layers[layer]},{' '.join(map(str, c['expert'][mask]))}")
    capture.write_text("\n".join(lines) + "\n")
    a, b = dirs(tmp_path)
    p = run_bin(sim_bin, "convert", capture, "--expert-bytes", "313344", "--n-expert", "16", "--out", "t.route.csv", "--note", "a, b", cwd=a)
    assert p.returncode == 0, p.stderr.decode()
    monkeypatch.chdir(b)
    r = bmoe_sim.convert(capture, "t.route.csv", expert_bytes=313344, n_expert=16, note=["a, b"])
    assert r["stdout"].encode() == p.stdout
    assert (a / "t.route.csv").read_bytes() == (b / "t.route.csv").read_bytes()
    assert (r["tokens"], r["top_k"], r["n_expert"], r["layers"]) == (t.decode_tokens, 4, 16, 4)
    back = bmoe_sim.load_trace(b / "t.route.csv")
    assert back.cells == t.decode_tokens * 4 and back.rows == r["routings"]


def test_any_command_runs_as_the_binary_does(sim_bin, tmp_path):
    run = REPO / "traces" / "tiny-s1-cache4"
    args = ["diff", f"{run}.csv", f"{run}.csv", "--exact-only"]
    p = run_bin(sim_bin, *args, cwd=tmp_path)
    r = bmoe_sim.cli(*args)
    assert (r.code, r.stdout.encode(), r.stderr.encode()) == (p.returncode, p.stdout, p.stderr)
    bad = bmoe_sim.cli("replay", "--trace", TINY, "--cache-mb", "lots")
    p = run_bin(sim_bin, "replay", "--trace", TINY, "--cache-mb", "lots", cwd=tmp_path)
    assert (bad.code, bad.stderr.encode()) == (p.returncode, p.stderr) and bad.code == 2


def test_a_trace_reads_as_its_file_says():
    t = bmoe_sim.load_trace(TINY)
    lines = [l for l in TINY.read_text().splitlines() if not l.startswith("#")][1:]
    assert t.rows == len(lines)
    assert (t.model, t.arch, t.n_layer, t.n_expert, t.top_k) == ("/tmp/m/t1.gguf", "qwen3moe", 4, 16, 4)
    assert t.moe_layers == [0, 1, 2, 3] and t.expert_bytes == [313344] * 4
    assert t.cells * t.top_k == t.rows
    c = t.columns()
    assert c["expert"].dtype == np.uint32 and len(c["expert"]) == t.rows
    assert [int(x) for x in lines[0].split(",")[:6]] == [c[k][0] for k in ("turn", "phase", "step", "moe_layer", "slot", "expert")]
    assert t.prefill_tokens + t.decode_tokens == len(set(zip(c["turn"], c["phase"], c["step"])))
    need("pandas")
    assert list(t.to_pandas().columns)[:3] == ["turn", "phase", "step"]
