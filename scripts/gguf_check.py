#!/usr/bin/env python3
"""Describe a GGUF file as JSON using the PyPI `gguf` package (llama.cpp's gguf-py), an
reader independent of ours, so a Rust test can compare the two field by field.

Usage: gguf_check.py FILE [--first N]

Output (stdout, one JSON object):
  version, alignment, data_offset
  tensors:  [{name, type (ggml name), shape (GGUF order, ne0 first), offset (absolute),
              n_bytes}]
  metadata_keys: the metadata keys in file order
  metadata: {key: {type, value}}; `type` is gguf-py's GGUFValueType name.
            Arrays are summarised: {type: "ARRAY", element_type, len, first: [up to N
            items, nested arrays summarised the same way], fnv1a64}, where fnv1a64 is the
            64-bit FNV-1a hash (16 hex digits) of the array's bytes exactly as stored after
            its type tag: element type (u32), length (u64), then the encoded elements.
            Non-finite floats are the strings "nan", "inf", "-inf".
Exit status 2 when the gguf package is missing, 1 when the file cannot be read.
"""

import argparse
import json
import math
import sys

try:
    import gguf
    from gguf import GGUFReader, GGUFValueType
except ImportError as e:  # pragma: no cover - environment dependent
    print(f"gguf_check.py: the gguf package is not installed ({e}); pip install gguf",
          file=sys.stderr)
    sys.exit(2)

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


def fnv1a64(data: bytes) -> str:
    h = FNV_OFFSET
    for b in data:
        h ^= b
        h = (h * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def number(x):
    """A numpy scalar as a JSON-safe Python value."""
    v = x.item()
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def decode(parts, i, vtype):
    """Decode one value starting at parts[i]; return (python value, next index).

    gguf-py splits a field into numpy parts: a string is (length, bytes), a scalar is one
    part, an array is (element type, length) followed by each element's parts.
    Arrays decode to ("ARRAY", element type name, [items]).
    """
    if vtype == GGUFValueType.STRING:
        return bytes(parts[i + 1]).decode("utf-8", errors="replace"), i + 2
    if vtype == GGUFValueType.ARRAY:
        etype = GGUFValueType(int(parts[i][0]))
        n = int(parts[i + 1][0])
        i += 2
        items = []
        for _ in range(n):
            v, i = decode(parts, i, etype)
            items.append(v)
        return ("ARRAY", etype.name, items), i
    if vtype == GGUFValueType.BOOL:
        return bool(parts[i][0]), i + 1
    return number(parts[i][0]), i + 1


def summarise(v, first, raw=None):
    if isinstance(v, tuple) and v[0] == "ARRAY":
        _, etype, items = v
        out = {
            "type": "ARRAY",
            "element_type": etype,
            "len": len(items),
            "first": [summarise(x, first) for x in items[:first]],
        }
        if raw is not None:
            out["fnv1a64"] = fnv1a64(raw)
        return out
    return v


def describe(path, first):
    r = GGUFReader(path)
    metadata = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue  # gguf-py's pseudo-fields for the header
        vtype = GGUFValueType(int(field.parts[2][0]))
        value, end = decode(field.parts, 3, vtype)
        if end != len(field.parts):
            raise ValueError(f"{key}: decoded {end} of {len(field.parts)} parts")
        if vtype == GGUFValueType.ARRAY:
            raw = b"".join(bytes(p.tobytes()) for p in field.parts[3:])
            metadata[key] = summarise(value, first, raw)
        else:
            metadata[key] = {"type": vtype.name, "value": value}
    tensors = [
        {
            "name": t.name,
            "type": gguf.GGMLQuantizationType(t.tensor_type).name,
            "shape": [int(d) for d in t.shape],
            "offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        for t in r.tensors
    ]
    version = int(r.fields["GGUF.version"].parts[0][0])
    return {
        "file": str(path),
        "version": version,
        "alignment": int(r.alignment),
        "data_offset": int(r.data_offset),
        "tensors": tensors,
        "metadata_keys": list(metadata),
        "metadata": metadata,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--first", type=int, default=8, help="array items to print (default 8)")
    args = ap.parse_args()
    try:
        out = describe(args.file, args.first)
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"gguf_check.py: {args.file}: {e}", file=sys.stderr)
        sys.exit(1)
    json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
