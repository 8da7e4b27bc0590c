#!/usr/bin/env python3
"""Independent references for bmoe's parity checks, through the PyPI packages
`llama-cpp-python` (llama.cpp compiled by pip) and `gguf`.

  llama_parity.py logits MODEL IDS_JSON OUT_F32   teacher-forced logits of the token ids in
                                                  IDS_JSON["token_ids"], one row per position
                                                  (KV cache f32, flash attention off)
  llama_parity.py logits-repacked MODEL IDS_JSON OUT_F32
                                                  the same with llama.cpp's extra buffer types
                                                  (weight repacking) on, as its own tools run:
                                                  the path bmoe's Q4_0 / Q4_K order follows (see
                                                  plain_kernels). A diagnostic for CPUs without
                                                  AMX; not in a batch after plain logits
  llama_parity.py mtp-logits MODEL IDS_JSON OUT_F32
                                                  llama.cpp's own MTP ("NextN") head logits of a
                                                  qwen35moe file with an MTP block: row p is the
                                                  head fed x_p and the trunk's h_{p-1} (zeros at
                                                  p = 0), one row per position, as `logits` writes
  llama_parity.py quantize IN OUT TYPE            llama.cpp's own quantizer (llama-quantize),
                                                  TYPE any of its presets (f16, q8_0, q4_k_m,
                                                  q3_k_s, iq4_xs, ...: LLAMA_FTYPE_MOSTLY_<TYPE>)
  llama_parity.py rewrite IN OUT                  copy a GGUF through the gguf package's writer
                                                  (another tool's file layout, same weights)
  llama_parity.py write ARCH SHAPE TOK.gguf OUT SEED
                                                  a random-weight F32 qwen35moe, lfm2moe,
                                                  deepseek2 or llama (Mixtral) file of a shape
                                                  unlike our presets (SHAPE: wide), written by the
                                                  gguf package's writer, with TOK.gguf's
                                                  tokenizer (scripts/gguf_write_hybrid.py)
  llama_parity.py compare A.f32 B.f32 N_VOCAB     per-position cosine and top-1 agreement, as JSON
                                                  (strict, and up to a near-tie of 0.5 % of the
                                                  reference's logit range)
  llama_parity.py batch JOBS.json                 many of the above in one process (one start-up
                                                  and one library load for a whole gate): a list
                                                  of {"op": "quantize"|"logits"|"mtp-logits"|
                                                  "write"|"compare", "args": [...]} run in order;
                                                  a job's stdout goes to its "out" file when one
                                                  is given

Only the standard library plus those packages and numpy.
"""
import json
import os
import sys


def plain_kernels(llama_cpp):
    """Load models without llama.cpp's extra buffer types (weight repacking, AMX): the reference
    is then each format's own dot products, the same on every CPU. On a CPU that advertises AMX
    where the VM does not let a process use it (Sapphire Rapids under KVM here), the AMX path
    faults inside libggml-cpu (a segfault on Q2_K and Q4_K files). `Llama` takes its model
    parameters from `llama_model_default_params()`, so that is where the flag is set.

    The cost: without the CPU_REPACK buffer type no Q4_0 or Q4_K weight is repacked, so llama.cpp
    runs `ggml_vec_dot_q4_0_q8_0` / `ggml_vec_dot_q4_K_q8_K` here, while bmoe's Q4_0 and Q4_K
    kernels follow the float order of the repacked gemv its default x86 path runs. On those
    formats this reference differs from ours in the last bits by construction (measured in
    docs/architectures.md, lfm2moe's "gguf-py" paragraph)."""
    import llama_cpp.llama as high_level

    if getattr(high_level.llama_cpp.llama_model_default_params, "bmoe_plain", False):
        return  # already set (a batch loads many models)
    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    params.bmoe_plain = True
    high_level.llama_cpp.llama_model_default_params = params


def reference_llama(llama_cpp, model, n_tokens):
    """The target context every logits reference here runs on."""
    # One token per graph (n_ubatch=1): llama.cpp's decode kernels. Its batched graphs take
    # other kernels for some products, and on this CPU the two disagree with each other by as
    # much as a cosine of 0.9967 at a position of a llama-quantize Q4_K_M file (its ubatch-1
    # and ubatch-8 runs against its one-batch run: 0.996726 and 0.999946), which is the
    # tolerance the gates hold bmoe to; bmoe's batched prefill agrees with the ubatch-1 run to
    # 0.99989 there. The one-token path is the reference every CPU computes alike.
    return llama_cpp.Llama(
        model_path=model,
        n_ctx=max(64, n_tokens + 8),
        n_batch=max(64, n_tokens + 8),
        n_ubatch=1,
        # One thread: on these tiny models a token's graph is too small to split, and two
        # threads spin at every op's barrier — 1.3-2.9 s against 0.47 s for a 268-token
        # qwen3moe reference with another process on the second core (AMD EPYC, 2026-12-08),
        # and the logits are bit-identical (ggml splits a product by rows, each row on one
        # thread: checked on an F32 and a qwen35moe Q4_K_M file).
        n_threads=1,
        n_threads_batch=1,
        logits_all=True,
        verbose=False,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
        flash_attn=False,
    )


def cmd_logits(model, ids_json, out, plain=True):
    import llama_cpp
    import numpy as np

    if plain:
        plain_kernels(llama_cpp)
    ids = json.load(open(ids_json))["token_ids"]
    llm = reference_llama(llama_cpp, model, len(ids))
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    scores.tofile(out)
    print(json.dumps({"rows": int(scores.shape[0]), "n_vocab": int(scores.shape[1])}))


def cmd_logits_repacked(model, ids_json, out):
    import llama_cpp.llama as high_level

    if getattr(high_level.llama_cpp.llama_model_default_params, "bmoe_plain", False):
        sys.exit("llama_parity.py: logits-repacked after plain logits in one process; run it alone")
    cmd_logits(model, ids_json, out, plain=False)


def nextn_api(llama_cpp):
    """llama.cpp's staging NextN calls (src/llama-ext.h, what common/speculative.cpp drives MTP
    with): C++ functions, exported from libllama only under their mangled names, bound here
    from the library handle llama_cpp itself loaded."""
    import ctypes

    lib = llama_cpp.llama_cpp._lib
    set_nextn = lib._Z26llama_set_embeddings_nextnP13llama_contextbb
    set_nextn.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool]
    set_nextn.restype = None
    get_nextn_ith = lib._Z30llama_get_embeddings_nextn_ithP13llama_contexti
    get_nextn_ith.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    get_nextn_ith.restype = ctypes.POINTER(ctypes.c_float)
    return set_nextn, get_nextn_ith


def cmd_mtp_logits(model, ids_json, out):
    """llama.cpp's MTP head (qwen35moe's `graph_mtp`, LLM_GRAPH_TYPE_DECODER_MTP) teacher-forced
    over the token ids, the way common/speculative.cpp's draft-mtp `process()` feeds it: the
    target runs over all N tokens with unmasked NextN rows, giving h_p (the output-normed final
    hidden state) of every position; a second context of type MTP on the same model then takes
    row p = (x_p, h_{p-1}) at position p, h_{-1} = zeros (speculative.cpp's `pending_h` starts
    zeroed), and row p of OUT is that row's logits: the head's guess at x_{p+1}, the token the
    target's own row p predicts from h_p."""
    import ctypes

    import llama_cpp
    import llama_cpp.llama as high_level
    import numpy as np

    plain_kernels(llama_cpp)
    set_nextn, get_nextn_ith = nextn_api(llama_cpp)
    ids = json.load(open(ids_json))["token_ids"]
    # The MTP block's tensors load only with `load_mtp` (skipped otherwise); `Llama` takes its
    # model parameters from `llama_model_default_params()`, so set it there for this one load.
    default = high_level.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.load_mtp = True
        return p

    high_level.llama_cpp.llama_model_default_params = params
    try:
        llm = reference_llama(llama_cpp, model, len(ids))
    finally:
        high_level.llama_cpp.llama_model_default_params = default
    if llama_cpp.llama_model_n_layer_nextn(llm.model) < 1:
        sys.exit(f"llama_parity.py: {model} has no MTP block (nextn_predict_layers)")
    n, n_vocab = len(ids), llm.n_vocab()
    n_embd = llama_cpp.llama_model_n_embd_out(llm.model)

    # 1. The target: the same context and one-token graphs as `logits`; unmasked, NextN rows
    # are kept for every token of the batch (one decode: n_batch >= N), indexed by position.
    set_nextn(llm.ctx, True, False)
    llm.eval(ids)
    h = np.zeros((n, n_embd), dtype=np.float32)
    for p in range(n):
        row = get_nextn_ith(llm.ctx, p)
        if not row:
            sys.exit(f"llama_parity.py: no NextN row {p} from the target")
        h[p] = np.ctypeslib.as_array(row, shape=(n_embd,))
    h_prev = np.vstack([np.zeros((1, n_embd), dtype=np.float32), h[:-1]])

    # 2. The MTP context, as common_speculative_init_result makes it: the target's parameters,
    # ctx_type MTP, no recurrent-state snapshots, the target as ctx_other (which llama.cpp
    # keeps only for the architectures that need it, not qwen35moe). Its KV cache holds the
    # MTP layer alone, filled row by row here as process() fills it.
    cparams = type(llm.context_params).from_buffer_copy(llm.context_params)
    cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
    cparams.n_rs_seq = 0
    cparams.ctx_other = llm.ctx
    ctx = llama_cpp.llama_init_from_model(llm.model, cparams)
    if not ctx:
        sys.exit(f"llama_parity.py: llama.cpp made no MTP context for {model}")
    batch = None
    try:
        set_nextn(ctx, True, True)  # as the draft-mtp driver sets its draft context
        batch = llama_cpp.llama_batch_ext_init(ctx)
        logits = np.zeros((n, n_vocab), dtype=np.float32)
        # One row per llama_process call (one token per graph, as the target runs): what
        # common_batch::get() builds for process()'s (token, h) pairs, one entry at a time.
        # (The whole batch in one call, split by n_ubatch=1, gives the same bytes.)
        for p, tok in enumerate(ids):
            llama_cpp.llama_batch_ext_clear(batch)
            idx = llama_cpp.llama_batch_ext_add_token(batch, 0, tok)
            pos = (llama_cpp.llama_pos * 4)(p, 0, 0, 0)  # common_batch's { pos, 0, 0, 0 }
            embd = llama_cpp.llama_embd(
                h_prev[p].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
            if (idx != 0 or not llama_cpp.llama_batch_ext_set_pos(batch, idx, pos)
                    or not llama_cpp.llama_batch_ext_set_embd_token(batch, idx, embd)
                    or not llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)):
                sys.exit(f"llama_parity.py: could not build the MTP batch at row {p}")
            rc = llama_cpp.llama_process(ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
            if rc != 0:
                sys.exit(f"llama_parity.py: llama_process (MTP context) returned {rc} at row {p}")
            logits[p] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, idx),
                                              shape=(n_vocab,))
    finally:
        if batch is not None:
            llama_cpp.llama_batch_ext_free(batch)
        llama_cpp.llama_free(ctx)
    logits.tofile(out)
    print(json.dumps({"rows": int(logits.shape[0]), "n_vocab": int(logits.shape[1])}))


def cmd_quantize(inp, out, ty):
    import llama_cpp

    name = f"LLAMA_FTYPE_MOSTLY_{ty.upper()}"
    if not hasattr(llama_cpp, name):
        sys.exit(f"llama_parity.py: llama.cpp has no file type {ty} ({name})")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(inp.encode(), out.encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize failed with {rc}")


def field_kv(gguf, field):
    """A GGUFReader field as (value, type, sub_type), as `GGUFWriter.add_key_value` takes it."""
    vt = field.types[0]
    if vt == gguf.GGUFValueType.ARRAY:
        et = field.types[1]
        if et == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data], vt, et
        return [field.parts[i].tolist()[0] for i in field.data], vt, et
    if vt == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8"), vt, None
    return field.parts[field.data[0]].tolist()[0], vt, None


def cmd_rewrite(inp, out):
    import gguf

    r = gguf.GGUFReader(inp)
    arch = r.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    w = gguf.GGUFWriter(out, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val, vt, et = field_kv(gguf, field)
        w.add_key_value(name, val, vt, sub_type=et)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def cmd_write(arch, shape, tokenizer_source, out, seed):
    import gguf

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gguf_write_hybrid

    r = gguf.GGUFReader(tokenizer_source)
    tokenizer = [(name, *field_kv(gguf, field)) for name, field in r.fields.items()
                 if name.startswith("tokenizer.")]
    gguf_write_hybrid.write(arch, shape, tokenizer, out, int(seed))


TIE = 0.005


def cmd_compare(a, b, n_vocab):
    import numpy as np

    a_path = a
    n_vocab = int(n_vocab)
    x = np.fromfile(a, dtype=np.float32).reshape(-1, n_vocab)
    y = np.fromfile(b, dtype=np.float32).reshape(-1, n_vocab)
    n = min(len(x), len(y))
    x, y = x[:n].astype(np.float64), y[:n].astype(np.float64)
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    a, b = x.argmax(1), y.argmax(1)
    top = a == b
    # A near-tie: the reference ranks our top-1 within TIE of its own best, as a fraction of its
    # logit range. On random-weight models the top two logits are often that close, and a
    # one-ulp difference anywhere upstream decides between them (llama.cpp's own one-token and
    # batched paths disagree there too).
    rows = np.arange(n)
    gap = (y[rows, b] - y[rows, a]) / (y.max(1) - y.min(1))
    tie = top | (gap <= TIE)
    out = {"rows": n, "cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
           "top1_agree": float(top.mean()), "top1_tie_agree": float(tie.mean()),
           "tie_margin": TIE, "cos": [float(c) for c in cos],
           "top1": [bool(t) for t in top], "top1_tie": [bool(t) for t in tie]}
    # bmoe's sidecar beside A (`--logits-out A` writes A.json) says how close each position's
    # routing came to a tie; passed through for the gate, which excuses routing near-ties.
    side = a_path + ".json"
    if os.path.exists(side):
        margins = json.load(open(side)).get("router_margin")
        if margins is not None:
            out["router_margin"] = margins[:n]
    print(json.dumps(out))


COMMANDS = {"logits": cmd_logits, "logits-repacked": cmd_logits_repacked,
            "mtp-logits": cmd_mtp_logits, "quantize": cmd_quantize, "rewrite": cmd_rewrite,
            "write": cmd_write, "compare": cmd_compare}


def cmd_batch(jobs_json):
    import contextlib

    for i, job in enumerate(json.load(open(jobs_json))):
        out = job.get("out")
        try:
            with contextlib.ExitStack() as stack:
                if out:
                    stack.enter_context(contextlib.redirect_stdout(open(out, "w")))
                COMMANDS[job["op"]](*[str(a) for a in job["args"]])
        except SystemExit as e:
            sys.exit(f"llama_parity.py: batch job {i} {job}: {e}")


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    cmd, args = sys.argv[1], sys.argv[2:]
    {**COMMANDS, "batch": cmd_batch}[cmd](*args)


if __name__ == "__main__":
    main()
