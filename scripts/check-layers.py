#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a cycle.

  check-layers.py [SRC_DIR]          default: shared/src (the crate bmoe-core)
  check-layers.py --graph [SRC_DIR]  also print every module's imports, bottom-up

A module is a top-level file or directory of SRC_DIR (`step.rs`, `telemetry/`); it depends on
another when its non-test code names `crate::<other>` — in a `use` (braced groups included) or
in a path. Code under `#[cfg(test)]` does not count: a test may use any helper. The modules
must form a stack a newcomer reads bottom-up, so any strongly connected group of two or more is
an error, printed with one `file:line` per edge of the cycle. Exit status: 0 clean, 1 cycles,
2 bad usage. Standard library only.
"""
import re
import sys
from pathlib import Path

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def strip_comments(text):
    """The text with comments and string/char literals blanked (line numbers kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"' or (c == "r" and re.match(r'r#*"', text[i:i + 8]) and not _ident_before(text, i)):
            j = _string_end(text, i)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]):
            m = re.match(r"'(\\.|[^\\'])'", text[i:i + 4])
            out.append(" " * m.end())
            i += m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ident_before(text, i):
    return i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")


def _string_end(text, i):
    if text[i] == "r":
        m = re.match(r'r(#*)"', text[i:])
        close = '"' + m.group(1)
        j = text.find(close, i + m.end())
        return len(text) if j < 0 else j + len(close)
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return len(text)


def blank_test_code(text):
    """Blank every item under `#[cfg(test)]` (a `mod tests { ... }`, a test-only fn or use)."""
    chars = list(text)
    for m in re.finditer(r"#\[cfg\(test\)\]", text):
        i = m.end()
        # The item ends at its first `;` before any `{`, or at the `}` matching its first `{`.
        depth, j, started = 0, i, False
        while j < len(text):
            c = text[j]
            if c == ";" and not started:
                j += 1
                break
            if c == "{":
                depth, started = depth + 1, True
            elif c == "}":
                depth -= 1
                if started and depth == 0:
                    j += 1
                    break
            j += 1
        for k in range(m.start(), min(j, len(chars))):
            if chars[k] != "\n":
                chars[k] = " "
    return "".join(chars)


def crate_refs(text):
    """(module, offset) for every `crate::<module>` named, braced `use crate::{a, b::c}` too."""
    for m in re.finditer(r"\bcrate\s*::\s*", text):
        rest = m.end()
        if text.startswith("{", rest):
            depth, j, start = 0, rest, rest + 1
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            # Top-level names of the group: after `{` or a `,` at depth 1.
            depth = 0
            expect = True
            for k in range(rest, j):
                c = text[k]
                if c == "{":
                    depth += 1
                    expect = depth == 1
                elif c == "}":
                    depth -= 1
                elif c == "," and depth == 1:
                    expect = True
                elif expect and depth == 1 and not c.isspace():
                    idm = IDENT.match(text, k)
                    if idm:
                        yield idm.group(0), k
                    expect = False
        else:
            idm = IDENT.match(text, rest)
            if idm:
                yield idm.group(0), rest


def module_of(src, path):
    rel = path.relative_to(src)
    if len(rel.parts) == 1:
        return None if rel.stem in ("lib", "main") else rel.stem
    return rel.parts[0]


def graph(src):
    modules = {module_of(src, p) for p in src.rglob("*.rs")} - {None}
    edges = {}  # (a, b) -> "file:line"
    for p in sorted(src.rglob("*.rs")):
        a = module_of(src, p)
        if a is None:
            continue
        text = blank_test_code(strip_comments(p.read_text(encoding="utf-8")))
        for b, off in crate_refs(text):
            if b in modules and b != a and (a, b) not in edges:
                line = text.count("\n", 0, off) + 1
                edges[(a, b)] = f"{p.relative_to(src.parent)}:{line}"
    return sorted(modules), edges


def sccs(nodes, edges):
    """Tarjan's strongly connected components."""
    succ = {n: sorted(b for (a, b) in edges if a == n) for n in nodes}
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out  # in reverse topological order: dependencies first


def cycle_in(comp, edges):
    """One cycle through the component's first module, as a list of modules."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for a in frontier:
            for (x, b) in sorted(edges):
                if x != a or b not in members:
                    continue
                if b == start:
                    path = [a]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if b not in prev:
                    prev[b] = a
                    nxt.append(b)
        frontier = nxt
    return comp


def main(argv):
    show = "--graph" in argv
    args = [a for a in argv if a != "--graph"]
    if any(a.startswith("-") for a in args) or len(args) > 1:
        print(__doc__, file=sys.stderr)
        return 2
    src = Path(args[0] if args else "shared/src")
    if not src.is_dir():
        print(f"check-layers: {src} is not a directory", file=sys.stderr)
        return 2
    nodes, edges = graph(src)
    comps = sccs(nodes, edges)
    if show:
        for comp in comps:
            for m in comp:
                deps = sorted(b for (a, b) in edges if a == m)
                print(f"{m}: {' '.join(deps) if deps else '-'}")
    bad = [c for c in comps if len(c) > 1]
    if not bad:
        print(f"check-layers: {src}: {len(nodes)} modules, no import cycle")
        return 0
    for comp in bad:
        print(f"check-layers: {src}: an import cycle among {len(comp)} modules: {', '.join(comp)}")
        cyc = cycle_in(comp, edges)
        for a, b in zip(cyc, cyc[1:]):
            print(f"  {a} -> {b}   ({edges[(a, b)]})")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
