#!/usr/bin/env python3
"""Where a decode step's time goes: a compute_trace v1 or io_trace v1 file (stdlib only).

  decode-analyze.py compute CT.csv [--layers] [--phase decode|prefill|all] [--top N] [--json]
  decode-analyze.py io IO.csv [--adjacent] [--phase decode|prefill|all] [--json]

compute (a `--compute-trace` file, per-op or per-layer granularity):
  - header: model/arch, granularity, steps per phase, traced wall time, mean ms per step;
  - share by op (per-layer files: by segment kind pre/blk/post): ms, ms/step, %, major faults;
  - fault attribution: the share of all major faults each op took, and faults per ms;
  - --layers (always for per-layer files): ms/step, % and faults/step per layer, and for
    per-op files the top ops of each layer (ms/step);
  - the --top N slowest names by total time.
  A step is the rows sharing (turn, phase, step); per-step figures divide by the number of
  steps in the selected phase(s), so an op absent from a step counts as 0 ms there.

io (an `--io-trace` file, one row per flash read):
  - reads and bytes per phase (whole file), demand vs speculative split;
  - latency percentiles (nearest rank; p50/p90/p99/max, µs) overall and per power-of-two
    read_bytes bucket;
  - per lane: reads, MiB, mean latency and serial rate Σread_bytes/Σlatency; the sum of the
    lane rates is a ceiling estimate of the aggregate (the wall span is not in the trace);
  - alignment waste Σ(read_bytes − req_bytes) / Σread_bytes;
  - --adjacent: the coalescing ceiling — within each step, reads sorted by offset merge when
    the next offset ≤ the run's end (offset + read_bytes, the aligned window); the strictly
    contiguous count (offset + req_bytes == next offset) is shown alongside.

Per-phase tables cover the whole file; everything else covers --phase (default decode).
Bad input (missing file, wrong magic line, missing column, non-integer field, no rows)
prints one line on stderr and exits 1.
"""
import argparse
import collections
import json
import math
import re
import signal
import sys

PHASES = {0: "prefill", 1: "decode"}
CT_MAGIC, CT_INT = "# compute_trace v1", ["turn", "phase", "step", "seq", "layer", "wall_ns", "majflt"]
CT_STR = ["op", "name"]
IO_MAGIC = "# io_trace v1"
IO_INT = ["turn", "phase", "step", "layer", "expert", "proj", "lane", "spec", "offset",
          "req_bytes", "read_bytes", "latency_ns"]


class InputError(Exception):
    pass


def load(path, magic, int_cols, str_cols=()):
    """(meta, rows): rows are dicts of the named columns (ints parsed); extra columns ignored."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise InputError(f"{path}: cannot open: {e.strerror}")
    meta, rows, idx, first = {}, [], None, True
    with f:
        try:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if first:
                    if line.strip() != magic:
                        raise InputError(f"{path}:{n}: expected '{magic}' as the first line")
                    first = False
                    continue
                if line.startswith("#"):
                    for kv in line[1:].split():
                        if "=" in kv:
                            k, v = kv.split("=", 1)
                            meta.setdefault(k, v)
                    continue
                if not line.strip():
                    continue
                cells = line.split(",")
                if idx is None:
                    idx = {c.strip(): i for i, c in enumerate(cells)}
                    missing = [c for c in list(int_cols) + list(str_cols) if c not in idx]
                    if missing:
                        raise InputError(f"{path}:{n}: header lacks column(s) {', '.join(missing)}")
                    continue
                if len(cells) < len(idx):
                    raise InputError(f"{path}:{n}: {len(cells)} fields, the header has {len(idx)}")
                row = {c: cells[idx[c]] for c in str_cols}
                for c in int_cols:
                    try:
                        row[c] = int(cells[idx[c]])
                    except ValueError:
                        raise InputError(f"{path}:{n}: column {c}: not an integer: {cells[idx[c]]!r}")
                rows.append(row)
        except UnicodeDecodeError:
            raise InputError(f"{path}: not a UTF-8 text file")
    if first:
        raise InputError(f"{path}:1: empty file, expected '{magic}'")
    if idx is None:
        raise InputError(f"{path}: no header row")
    if not rows:
        raise InputError(f"{path}: no rows")
    return meta, rows


def select(rows, phase):
    want = {"prefill": {0}, "decode": {1}, "all": None}[phase]
    return [r for r in rows if want is None or r["phase"] in want]


def phase_name(p):
    return PHASES.get(p, f"phase{p}")


def table(headers, rows, aligns=None):
    """Plain-text table; numbers right-aligned, text left-aligned (aligns: 'l'/'r' per column)."""
    cells = [[str(c) for c in r] for r in rows]
    w = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    aligns = aligns or ["l"] + ["r"] * (len(headers) - 1)
    fmt = lambda r: "  ".join(c.ljust(w[i]) if aligns[i] == "l" else c.rjust(w[i]) for i, c in enumerate(r))
    return "\n".join(["  " + fmt(headers), "  " + fmt(["-" * x for x in w])] + ["  " + fmt(r) for r in cells])


def pct(a, b):
    return 100.0 * a / b if b else 0.0


# ---------------------------------------------------------------- compute


def segment_kind(name):
    return "blk" if re.fullmatch(r"blk\.\d+", name) else name


def segment_order(name):
    m = re.fullmatch(r"blk\.(\d+)", name)
    return (1, int(m.group(1)), "") if m else ({"pre": 0, "post": 2}.get(name, 3), 0, name)


def group(rows, key):
    """key -> [wall_ns, majflt, rows]"""
    g = collections.defaultdict(lambda: [0, 0, 0])
    for r in rows:
        s = g[key(r)]
        s[0] += r["wall_ns"]
        s[1] += r["majflt"]
        s[2] += 1
    return g


def compute_report(path, rows, meta, a):
    gran = meta.get("granularity") or ("layers" if all(r["op"] == "LAYER" for r in rows) else "op")
    layered = gran == "layers"
    steps_by_phase = collections.Counter(p for (_, p, _) in {(r["turn"], r["phase"], r["step"]) for r in rows})
    sel = select(rows, a.phase)
    if not sel:
        raise InputError(f"{path}: no rows in phase {a.phase}")
    n_steps = len({(r["turn"], r["phase"], r["step"]) for r in sel})
    total_ns = sum(r["wall_ns"] for r in sel)
    total_flt = sum(r["majflt"] for r in sel)
    ms = lambda ns: ns / 1e6
    out = {
        "file": path, "model": meta.get("model"), "arch": meta.get("arch"), "granularity": gran,
        "phase": a.phase, "steps": n_steps, "turns": len({r["turn"] for r in sel}),
        "steps_per_phase": {phase_name(p): n for p, n in sorted(steps_by_phase.items())},
        "total_s": total_ns / 1e9, "ms_per_step": ms(total_ns) / n_steps,
        "majflt": total_flt, "majflt_per_step": total_flt / n_steps,
    }
    kind = (lambda r: segment_kind(r["name"])) if layered else (lambda r: r["op"])
    share = sorted(group(sel, kind).items(), key=lambda kv: (-kv[1][0], kv[0]))
    out["by_" + ("segment" if layered else "op")] = [
        {"key": k, "ms": ms(ns), "ms_per_step": ms(ns) / n_steps, "pct": pct(ns, total_ns),
         "rows": cnt, "majflt": f, "majflt_per_step": f / n_steps,
         "fault_pct": pct(f, total_flt), "majflt_per_ms": f / ms(ns) if ns else 0.0}
        for k, (ns, f, cnt) in share]
    if layered or a.layers:
        out["layers"] = layer_rows(sel, layered, n_steps, total_ns)
        if not layered:
            out["layer_ops"] = layer_ops(sel, n_steps, [k for k, _ in share])
    top = sorted(group(sel, lambda r: (r["name"], r["op"])).items(), key=lambda kv: (-kv[1][0], kv[0]))
    out["top"] = [{"name": nm, "op": op, "ms": ms(ns), "ms_per_step": ms(ns) / n_steps,
                   "pct": pct(ns, total_ns), "rows": cnt, "majflt": f}
                  for (nm, op), (ns, f, cnt) in top[:a.top]]
    return out


def layer_rows(sel, layered, n_steps, total_ns):
    if layered:
        g = group(sel, lambda r: r["name"])
        keys = sorted(g, key=segment_order)
    else:
        g = group(sel, lambda r: r["layer"])
        keys = sorted(g)
    return [{"layer": k if layered else (k if k >= 0 else "none"),
             "ms_per_step": g[k][0] / 1e6 / n_steps, "pct": pct(g[k][0], total_ns),
             "majflt_per_step": g[k][1] / n_steps} for k in keys]


def layer_ops(sel, n_steps, ops_by_time, width=6):
    """Per layer, ms/step of the ops that take the most time inside layers (up to `width`)."""
    in_layers = [r for r in sel if r["layer"] >= 0]
    totals = group(in_layers, lambda r: r["op"])
    ops = [o for o in ops_by_time if o in totals][:width]
    g = group(in_layers, lambda r: (r["layer"], r["op"]))
    layers = sorted({r["layer"] for r in in_layers})
    return {"ops": ops, "other_ops": [o for o in ops_by_time if o in totals][width:],
            "rows": [{"layer": l, **{o: g[(l, o)][0] / 1e6 / n_steps if (l, o) in g else 0.0 for o in ops}}
                     for l in layers]}


def print_compute(o):
    layered = o["granularity"] == "layers"
    print(f"{o['file']}: model {o['model'] or '?'} arch {o['arch'] or '?'}, granularity {o['granularity']}")
    print("steps per phase (whole file): " + ", ".join(f"{p} {n}" for p, n in o["steps_per_phase"].items()))
    print(f"phase {o['phase']}: {o['steps']} steps in {o['turns']} turn(s), {o['total_s']:.3f} s traced, "
          f"{o['ms_per_step']:.3f} ms/step, {o['majflt']} major faults ({o['majflt_per_step']:.2f}/step)")
    share = o["by_segment" if layered else "by_op"]
    what = "segment kind" if layered else "op"
    print(f"\nshare by {what}:")
    print(table([what, "ms", "ms/step", "%", "majflt", "flt/step"],
                [[s["key"], f"{s['ms']:.3f}", f"{s['ms_per_step']:.3f}", f"{s['pct']:.1f}",
                  s["majflt"], f"{s['majflt_per_step']:.2f}"] for s in share]))
    print("\nfault attribution:")
    if o["majflt"] == 0:
        print("  no major faults sampled")
    else:
        hit = sorted((s for s in share if s["majflt"]), key=lambda s: -s["majflt"])
        print(table([what, "majflt", "% faults", "flt/ms"],
                    [[s["key"], s["majflt"], f"{s['fault_pct']:.1f}", f"{s['majflt_per_ms']:.3f}"] for s in hit]))
    if "layers" in o:
        print(f"\nper {'segment' if layered else 'layer'}:")
        print(table(["segment" if layered else "layer", "ms/step", "%", "flt/step"],
                    [[l["layer"], f"{l['ms_per_step']:.3f}", f"{l['pct']:.1f}", f"{l['majflt_per_step']:.2f}"]
                     for l in o["layers"]]))
    if "layer_ops" in o and o["layer_ops"]["rows"]:
        lo = o["layer_ops"]
        print("\nper layer, top ops (ms/step):")
        print(table(["layer"] + lo["ops"], [[r["layer"]] + [f"{r[op]:.3f}" for op in lo["ops"]] for r in lo["rows"]]))
        if lo["other_ops"]:
            print("  (not shown: " + ", ".join(lo["other_ops"]) + ")")
    if not o["top"]:
        return
    print(f"\ntop {len(o['top'])} names by time:")
    print(table(["name", "op", "ms", "ms/step", "%", "rows", "majflt"],
                [[t["name"], t["op"], f"{t['ms']:.3f}", f"{t['ms_per_step']:.3f}", f"{t['pct']:.1f}",
                  t["rows"], t["majflt"]] for t in o["top"]], ["l", "l"] + ["r"] * 5))


# ---------------------------------------------------------------- io


def percentile(sorted_vals, p):
    """Nearest-rank percentile of an ascending list."""
    return sorted_vals[max(0, math.ceil(p / 100.0 * len(sorted_vals)) - 1)]


def lat_stats(rows):
    v = sorted(r["latency_ns"] for r in rows)
    return {"reads": len(v), "p50_us": percentile(v, 50) / 1e3, "p90_us": percentile(v, 90) / 1e3,
            "p99_us": percentile(v, 99) / 1e3, "max_us": v[-1] / 1e3, "mean_us": sum(v) / len(v) / 1e3}


def size_label(lo):
    unit = lambda b: f"{b >> 20}M" if b >= 1 << 20 and not b & ((1 << 20) - 1) else (
        f"{b >> 10}K" if b >= 1024 and not b & 1023 else str(b))
    return f"[{unit(lo)},{unit(lo * 2)})"


def bucket(n):
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def runs(reads):
    """Window-rule runs of offset-sorted reads: each run is a list of reads."""
    out, end = [], None
    for r in reads:
        if out and r["offset"] <= end:
            out[-1].append(r)
            end = max(end, r["offset"] + r["read_bytes"])
        else:
            out.append([r])
            end = r["offset"] + r["read_bytes"]
    return out


def adjacent(rows):
    """Coalescing ceiling per (turn, phase, step); window rule and strict-contiguity rule."""
    steps = collections.defaultdict(list)
    for r in rows:
        steps[(r["turn"], r["phase"], r["step"])].append(r)
    all_runs, exact = [], 0
    for reads in steps.values():
        reads.sort(key=lambda r: (r["offset"], r["read_bytes"]))
        all_runs += runs(reads)
        exact += sum(1 for i, r in enumerate(reads)
                     if not i or reads[i - 1]["offset"] + reads[i - 1]["req_bytes"] != r["offset"])
    # a merged read spans from its first offset to the furthest requested byte
    span = sum(max(r["offset"] + r["req_bytes"] for r in run) - run[0]["offset"] for run in all_runs)
    multi = [run for run in all_runs if len(run) > 1]
    n, m = len(rows), len(all_runs)
    return {"steps": len(steps), "reads": n, "merged_reads": m, "ratio": n / m,
            "mean_merged_kib": span / m / 1024, "runs_of_2plus": len(multi),
            "reads_in_runs_of_2plus": sum(len(run) for run in multi),
            "exact_merged_reads": exact, "exact_ratio": n / exact}


def io_report(path, rows, a):
    out = {"file": path, "phase": a.phase, "phases": {}}
    for p in sorted({r["phase"] for r in rows}):
        rs = [r for r in rows if r["phase"] == p]
        out["phases"][phase_name(p)] = {"reads": len(rs), "mib": sum(r["read_bytes"] for r in rs) / 2**20,
                                        "steps": len({(r["turn"], r["step"]) for r in rs})}
    sel = select(rows, a.phase)
    if not sel:
        raise InputError(f"{path}: no rows in phase {a.phase}")
    read_b = sum(r["read_bytes"] for r in sel)
    out["kind"] = {}
    for s, label in ((0, "demand"), (1, "speculative")):
        rs = [r for r in sel if (r["spec"] != 0) == bool(s)]
        b = sum(r["read_bytes"] for r in rs)
        out["kind"][label] = {"reads": len(rs), "pct_reads": pct(len(rs), len(sel)), "mib": b / 2**20,
                              "pct_bytes": pct(b, read_b),
                              "mean_lat_us": sum(r["latency_ns"] for r in rs) / len(rs) / 1e3 if rs else 0.0}
    out["latency"] = lat_stats(sel)
    buckets = collections.defaultdict(list)
    for r in sel:
        buckets[bucket(r["read_bytes"])].append(r)
    out["by_size"] = [{"bucket": size_label(b), "low_bytes": b, "mib": sum(r["read_bytes"] for r in rs) / 2**20,
                       **lat_stats(rs)} for b, rs in sorted(buckets.items())]
    lanes = collections.defaultdict(list)
    for r in sel:
        lanes[r["lane"]].append(r)
    out["lanes"] = []
    for lane, rs in sorted(lanes.items()):
        b, lat = sum(r["read_bytes"] for r in rs), sum(r["latency_ns"] for r in rs)
        out["lanes"].append({"lane": lane, "reads": len(rs), "mib": b / 2**20, "mean_lat_us": lat / len(rs) / 1e3,
                             "mb_s": b / lat * 1e3 if lat else 0.0})
    out["aggregate_ceiling_mb_s"] = sum(l["mb_s"] for l in out["lanes"])
    out["alignment_waste_pct"] = pct(sum(r["read_bytes"] - r["req_bytes"] for r in sel), read_b)
    out["read_mib"] = read_b / 2**20
    out["req_mib"] = sum(r["req_bytes"] for r in sel) / 2**20
    if a.adjacent:
        out["adjacent"] = adjacent(sel)
    return out


def print_io(o):
    print(f"{o['file']}:")
    print(table(["phase", "reads", "steps", "MiB"],
                [[p, v["reads"], v["steps"], f"{v['mib']:.2f}"] for p, v in o["phases"].items()]))
    print(f"\nphase {o['phase']}: {o['latency']['reads']} reads, {o['read_mib']:.1f} MiB read "
          f"({o['req_mib']:.1f} MiB requested), alignment waste {o['alignment_waste_pct']:.2f}%")
    print(table(["kind", "reads", "% reads", "MiB", "% bytes", "mean µs"],
                [[k, v["reads"], f"{v['pct_reads']:.1f}", f"{v['mib']:.2f}", f"{v['pct_bytes']:.1f}",
                  f"{v['mean_lat_us']:.1f}"] for k, v in o["kind"].items()]))
    print("\nlatency (µs, nearest rank):")
    cols = ["reads", "p50_us", "p90_us", "p99_us", "max_us"]
    fmtrow = lambda label, s: [label] + [s["reads"]] + [f"{s[c]:.1f}" for c in cols[1:]]
    print(table(["read_bytes", "reads", "p50", "p90", "p99", "max"],
                [fmtrow("all", o["latency"])] + [fmtrow(b["bucket"], b) for b in o["by_size"]]))
    print("\nper lane (serial rate = Σread_bytes / Σlatency):")
    print(table(["lane", "reads", "MiB", "mean µs", "MB/s"],
                [[l["lane"], l["reads"], f"{l['mib']:.2f}", f"{l['mean_lat_us']:.1f}", f"{l['mb_s']:.1f}"]
                 for l in o["lanes"]], ["r"] * 5))
    print(f"  aggregate ceiling estimate (Σ lane rates, {len(o['lanes'])} lanes): "
          f"{o['aggregate_ceiling_mb_s']:.1f} MB/s — the trace has no wall span, so this is an upper bound")
    if "adjacent" in o:
        d = o["adjacent"]
        print(f"\ncoalescing ceiling over {d['steps']} steps (next offset ≤ run's offset + read_bytes):")
        print(f"  if adjacent reads were coalesced, {d['reads']} reads would become {d['merged_reads']} "
              f"(×{d['ratio']:.2f} fewer; mean merged size {d['mean_merged_kib']:.1f} KiB; "
              f"{d['reads_in_runs_of_2plus']} reads in {d['runs_of_2plus']} runs of ≥2)")
        print(f"  strictly contiguous (offset + req_bytes == next offset): {d['reads']} → "
              f"{d['exact_merged_reads']} (×{d['exact_ratio']:.2f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compute", help="a compute_trace v1 file")
    c.add_argument("trace")
    c.add_argument("--layers", action="store_true")
    c.add_argument("--top", type=int, default=10)
    i = sub.add_parser("io", help="an io_trace v1 file")
    i.add_argument("trace")
    i.add_argument("--adjacent", action="store_true")
    for p in (c, i):
        p.add_argument("--phase", default="decode", choices=["decode", "prefill", "all"])
        p.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.cmd == "compute" and a.top < 0:
        ap.error("--top must be >= 0")
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends quietly
    try:
        if a.cmd == "compute":
            meta, rows = load(a.trace, CT_MAGIC, CT_INT, CT_STR)
            out = compute_report(a.trace, rows, meta, a)
        else:
            _, rows = load(a.trace, IO_MAGIC, IO_INT)
            out = io_report(a.trace, rows, a)
    except InputError as e:
        print(f"decode-analyze.py: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(out, indent=1))
    elif a.cmd == "compute":
        print_compute(out)
    else:
        print_io(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
