"""Random-weight F32 models of the hybrid families qwen35moe, lfm2moe and bailingmoe3 (KDA and
MLA), of deepseek2 (MLA), of llama with routed experts (Mixtral) and of deepseek4 (DeepSeek-V4),
written through the PyPI `gguf` package's `GGUFWriter`: another tool's files, in shapes unlike the
presets of bmoe's own generator (`bmoe-cli gen`, engine/src/gen/qwen35moe.rs, lfm2moe.rs,
deepseek2.rs, llama_moe.rs, bailingmoe3.rs and deepseek4.rs), for the parity gate
(gates/tests/archs.rs). `llama_parity.py write` calls `write` with the tokenizer keys of one of
our files, so llama.cpp and bmoe tokenize the prompt alike.

What differs from `gen --preset tiny` (SHAPES has every number):
  qwen35moe: d_model 512 (tiny 256); 8 query heads of 32 over one KV head (tiny 4 of 64 over
    2); half of each head rotated, in sections 2/2/2/2, so a quarter of the rotated pairs fall
    to the e section and stay put (tiny 3/3/2/0); every third layer attends (tiny every
    second); DeltaNet of 4 value heads of 64 reading one key head, a convolution of 3 (tiny 4
    of 32 reading 2, convolution 4); 6 experts, top-2, split gate/up (tiny 16, top-4, fused);
    a shared expert of 256 (tiny 512); no MTP block (tiny has one); rope base 5e5.
  lfm2moe: d_model 512 as 16 heads of 32 over 4 KV heads (tiny 4 of 64 over 2); attention at
    layers 0, 3 and 4 of 6 (tiny: layer 2 of 4); a convolution of 4 (tiny 3); two dense
    layers of 768 (tiny one of 512); 10 experts, top-3 (tiny 16, top-4); the head tied to the
    embedding (tiny has its own); the per-layer KV head counts as the writer's default INT32
    array (ours: UINT32).
  deepseek2: d_model 384 (tiny 256) as 6 heads (tiny 4) of nope 48 + rope 16 (tiny 64 + 32)
    with values of 80 (tiny 64); a latent of 192 (tiny 256); a query LoRA of 256 (tiny 128,
    d_model / 2); 3 layers (tiny 4), the first dense of 768 (tiny 512); 12 experts, top-3 (tiny
    16, top-4); one shared expert (tiny 2); sigmoid gating with a selection bias, the weights
    renormalised and scaled by 1.8 (tiny: softmax, not renormalised, x 1), the router at twice
    the gain with a bias of std 0.01 as lfm2moe's; YaRN x 8 over 512 positions with a stored
    log multiplier of 0.1 (tiny: no rope scaling). d_model 384 is not a multiple of 256:
    llama-quantize's K-quant presets give the tensors that read the residual stream their
    32-value stand-ins (Q4_K_M: Q5_0), the K-quants where a row is 256 or 768 long (attn_q_b,
    the FFN down projections).
  llama (Mixtral): d_model 384 (tiny 256) as 6 heads of 64 over 3 KV heads (tiny 4 over 2); 5
    layers (tiny 4); 6 experts, top-2 (tiny 16, top-4) of 512; a `rope_freqs` table (tiny has
    none) of Llama 3.1's long-context shape: 1 over the first quarter of the rotated pairs (the
    fast ones), rising geometrically to 8 over the middle half, 8 over the last quarter; rope
    base 1e6 (tiny 1e4); no biases, an untied head, as tiny. As with deepseek2, d_model 384 gives
    the tensors that read the residual stream llama-quantize's 32-value stand-ins (Q4_K_M: Q5_0,
    attn_v in some layers Q8_0); the experts' down projections (rows of 512) take the K-quants
    (Q4_K_M: Q4_K, in some layers Q6_K).
  bailingmoe3: d_model 384 (tiny 256) as 6 heads (tiny 4) for both kinds of layer; 5 layers
    (tiny 4) with latent attention at layers 1 and 4 (tiny: every fourth, layer 3), the others
    Kimi Delta Attention of heads of 64 (as tiny; d_inner 384), a convolution of 3 (tiny 4), a
    gate lower bound of -3 (tiny -5); the per-layer KV head counts as the writer's default
    INT32 array (ours: UINT32); the MLA without a query LoRA, one `attn_q` and no
    `attention.q_lora_rank` key (tiny: a LoRA of 128), nope 48 + rope 16 (tiny 64 + 32) with
    values of 48 (tiny 64), a latent of 192 (tiny 256); two dense layers of 768 (tiny one of
    512); 24 experts, top-3, of 256 (tiny 16, top-4, of 384); two shared experts (tiny one),
    their width 512 stated in `expert_shared_feed_forward_length` (llama.cpp's default, the
    expert FFN times the count, gives the same); sigmoid routing (fixed by the arch) with a
    selection bias, the weights not renormalised and scaled by 1.5 (tiny: renormalised, x 2.5),
    the router at twice the gain with a bias of std 0.01 as deepseek2's; rope base 5e4 (tiny
    1e6); per-layer SwiGLU limits (`swiglu_clamp_exp` 1, 0, 1.5, 1, 2 and `_shexp` 0.8, 1.2, 0,
    0.8, 1, the latter also the dense layers'; tiny none, tiny-odd 1 everywhere). `ssm_a`
    (which multiplies the gate's pre-activation per head) uniform of std 1 as
    gen/bailingmoe3.rs, the dt bias and the convolutions of std 0.5. Under Q4_K_M the rows of
    384 (all that read the residual stream but the head, which takes Q8_0; the KDA
    attn_output), 288 (the MLA attn_output) and 192 (attn_v_b) take the 32-value stand-in Q5_0
    (one KDA layer's attn_v Q8_0), the dense,
    expert and shared down projections (rows of 768, 256, 512) Q4_K or Q6_K; attn_k_b (rows of
    48) falls back to F16 in every quantization; the convolutions, ssm_a and the dt bias stay
    F32.
  deepseek4: d_model 384 (tiny 256); 5 layers (tiny 4) of compression ratios 4, 0, 128, 4, 0
    (tiny 0, 4, 128, 4: here the first layer compressed, two window-only layers, the last one
    of them); 6 heads (tiny 4) of 96 with 32 rotated (tiny 64 with 16); a query LoRA of 192
    (tiny 128); 3 output groups of rank 48 (tiny 2 of 32), so the output LoRA is 144 wide, not
    a multiple of 32 (llama-quantize's Q8_0 keeps attn_output_b in F16); a window of 24 (tiny
    16); an indexer of 8 heads of 64 keeping 6 rows (tiny 2 of 128 keeping 4): many heads, as
    with few the score sum over heads of w_h * ReLU(q_h . k_b) is exactly 0 for many blocks
    and llama.cpp's top-k breaks those ties its own way, and 64 wide because llama.cpp rotates
    the indexer by a Hadamard matrix of 64 or more (narrower heads fail its graph) and a width
    unlike the attention's leaves the attention's keys unrotated; 2 hash layers (tiny 1: here
    one compressed, one window-only); 12 experts, top-3 (tiny 16, top-4), of 256 (as tiny);
    2 shared experts, 512 wide (tiny 1); sqrt-softplus weights not renormalised, x 2.0 (tiny
    renormalised, x 1.5); per-layer SwiGLU limits `swiglu_clamp_exp` 1.5, 0, 1, 2, 0.8 and
    `_shexp` 0, 1.2, 1, 0, 1 (tiny 1 on every layer and no `_shexp`); 10 Sinkhorn iterations
    (tiny 20), a hyper-connection epsilon of 1e-5 (tiny 1e-6); no YaRN (tiny x 4 over 1024 on
    the compressed layers); rope base 5e4 (tiny 1e4), the compressed layers' 8e4 (tiny 1.6e5);
    `compress_ratios` as the writer's default INT32 array, as the converter's `add_array`
    writes it (ours: UINT32); context 8192 (tiny 4096). Scales as gen/deepseek4.rs: the
    hyper-connection `fn` at 0.5 / sqrt(4 * d_model), `base` of std 0.5, `scale` uniform on
    [0.5, 1.5]; the sinks of std 1; the compressors' `ape` of std 0.5; the latent norm and the
    attention compressor's norm at sqrt(0.5) (queries are normed with no weight), the
    indexer compressor's at 1; the router at gain 6 (not doubled) with a selection bias of std
    0.01 on the non-hash layers; `ffn_gate_tid2eid` (I32) K distinct expert ids per token.
qwen35moe, lfm2moe, deepseek2 and bailingmoe3: expert FFN 256 (the gate's tiny files: 512;
bailingmoe3's 384), a multiple of 256, so llama-quantize's K-quants apply to every expert
(deepseek2 and bailingmoe3: to the down projections, their gate and up rows being 384 long). All
six: rms eps 1e-5 (tiny 1e-6).

Weights follow the scheme of our generator (engine/src/gen.rs, module doc), so activations stay
at unit scale through the layers and routing is not a coin toss at every position: uniform
noise of standard deviation 1/sqrt(fan-in); the residual stream in two halves, the embedding
and the experts writing the first ("token") half, the mixers (attention, DeltaNet, KDA, the
short convolution) the second ("context") half; routers reading the token half at (1 - R) * gain and
the context half at 4 * R * gain / (layer + 1)^0.75 (R 0.65, gain 6, as `gen --preset tiny`;
lfm2moe's, deepseek2's and bailingmoe3's at twice that gain with a selection bias of std 0.01,
as gen/lfm2moe.rs says why); q/k norms of 0.5 (deepseek2's and bailingmoe3's latent attention:
the latent norm and the key absorption matrix at sqrt(0.5) each, as gen/deepseek2.rs;
deepseek4's key norm at sqrt(0.5), its queries normed with no weight; llama,
which has no q/k norms: the q and k projections at 0.5 / sqrt(fan-in), as gen/llama.rs), so
attention is near-uniform. Each tensor's
noise comes from its own numpy stream seeded by (seed, crc32 of its name): the file depends on
the seed alone.

Only the standard library, numpy and the gguf package.
"""
import zlib

import numpy as np

ROUTING_CONTEXT = 0.65
ROUTER_GAIN = 6.0
ROUTING_DEPTH = 0.75
ATTN_SHARPNESS = 0.5

SHAPES = {
    ("qwen35moe", "wide"): {
        "n_layer": 6, "full_attention_interval": 3, "d_model": 512,
        "n_head": 8, "n_head_kv": 1, "head_dim": 32, "n_rot": 16, "rope_sections": [2, 2, 2, 2],
        "d_conv": 3, "d_state": 64, "n_k_heads": 1, "n_v_heads": 4,
        "n_expert": 6, "n_expert_used": 2, "n_ff_exp": 256, "n_ff_shexp": 256,
        "fused_gate_up": False, "rope_base": 500000.0, "rms_eps": 1e-5, "n_ctx_train": 2048,
    },
    ("deepseek2", "wide"): {
        "n_layer": 3, "d_model": 384, "n_head": 6,
        "nope": 48, "rope": 16, "v_head": 80, "kv_lora_rank": 192, "q_lora_rank": 256,
        "dense_layers": 1, "n_ff_dense": 768,
        "n_expert": 12, "n_expert_used": 3, "n_ff_exp": 256, "n_shared": 1,
        "sigmoid": True, "weights_norm": True, "weights_scale": 1.8,
        "router_gain": 2.0, "probs_bias": 0.01,
        "yarn_factor": 8.0, "yarn_orig_ctx": 512, "yarn_log_mul": 0.1,
        "rope_base": 10000.0, "rms_eps": 1e-5, "n_ctx_train": 4096,
    },
    ("bailingmoe3", "wide"): {
        "n_layer": 5, "mla_layers": [1, 4], "d_model": 384, "n_head": 6,
        "kda_head_dim": 64, "d_conv": 3, "gate_lower_bound": -3.0,
        "nope": 48, "rope": 16, "v_head": 48, "kv_lora_rank": 192, "q_lora_rank": 0,
        "dense_layers": 2, "n_ff_dense": 768,
        "n_expert": 24, "n_expert_used": 3, "n_ff_exp": 256, "n_shared": 2,
        "weights_norm": False, "weights_scale": 1.5,
        "router_gain": 2.0, "probs_bias": 0.01,
        "rope_base": 50000.0, "rms_eps": 1e-5, "n_ctx_train": 4096,
        # Ling 3.0's converter writes per-layer SwiGLU limit lists; 0 leaves a layer unlimited.
        "swiglu_exp": [1.0, 0.0, 1.5, 1.0, 2.0], "swiglu_shexp": [0.8, 1.2, 0.0, 0.8, 1.0],
    },
    ("llama", "wide"): {
        "n_layer": 5, "d_model": 384, "n_head": 6, "n_head_kv": 3, "head_dim": 64,
        "n_expert": 6, "n_expert_used": 2, "n_ff_exp": 512,
        "rope_freqs": (1.0, 8.0), "rope_base": 1000000.0, "rms_eps": 1e-5, "n_ctx_train": 4096,
    },
    ("deepseek4", "wide"): {
        # Ratio per layer: 0 window only, 4 CSA (+ the indexer), 128 HCA.
        "n_layer": 5, "ratios": [4, 0, 128, 4, 0], "d_model": 384,
        "n_head": 6, "head_dim": 96, "rope": 32, "q_lora_rank": 192,
        "o_groups": 3, "o_lora_rank": 48, "n_swa": 24,
        # Many indexer heads: with few, Σ_h w_h·ReLU(q_h·k_b) is exactly 0 for many blocks and
        # llama.cpp's top-k breaks ties at 0 its own way. 64 wide: llama.cpp rotates the
        # indexer by a Hadamard matrix of 64 or more (a multiple of 64), and a width unlike
        # the attention's 96 leaves the attention's keys unrotated.
        "indexer_heads": 8, "indexer_dim": 64, "indexer_top_k": 6,
        "hash_layers": 2, "hc": 4, "sinkhorn_iters": 10, "hc_eps": 1e-5,
        "n_expert": 12, "n_expert_used": 3, "n_ff_exp": 256, "n_shared": 2,
        "weights_norm": False, "weights_scale": 2.0,
        "swiglu_exp": [1.5, 0.0, 1.0, 2.0, 0.8], "swiglu_shexp": [0.0, 1.2, 1.0, 0.0, 1.0],
        "yarn_factor": 0.0, "rope_base": 50000.0, "compress_rope_base": 80000.0,
        "rms_eps": 1e-5, "n_ctx_train": 8192,
    },
    ("lfm2moe", "wide"): {
        "n_layer": 6, "attn_layers": [0, 3, 4], "d_model": 512,
        "n_head": 16, "n_head_kv": 4, "head_dim": 32, "l_cache": 4,
        "dense_layers": 2, "n_ff_dense": 768,
        "n_expert": 10, "n_expert_used": 3, "n_ff_exp": 256,
        "rope_base": 10000.0, "rms_eps": 1e-5, "n_ctx_train": 2048,
    },
}


class Weights:
    """The tensors of one file, in order (`tensors`): `dims` in GGUF order (row length first),
    arrays in numpy's (reversed) order, as `GGUFWriter.add_tensor` takes them."""

    def __init__(self, seed, d_model):
        self.seed = int(seed)
        self.split = d_model // 2
        self.tensors = []

    def noise(self, name, dims, std):
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        # Uniform on [-sqrt(3), sqrt(3)] has unit variance.
        return (std * np.sqrt(3.0) * rng.uniform(-1.0, 1.0, dims[::-1])).astype(np.float32)

    def rand(self, name, dims, std):
        self.tensors.append((name, self.noise(name, dims, std)))

    def const(self, name, dims, value=1.0):
        self.tensors.append((name, np.full(dims[::-1], value, dtype=np.float32)))

    def uniform(self, name, dims, lo, hi):
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        self.tensors.append((name, rng.uniform(lo, hi, dims[::-1]).astype(np.float32)))

    def expert_ids(self, name, n_used, n_vocab, n_expert):
        """An I32 hash-routing table {n_used, n_vocab}: per token `n_used` distinct expert ids
        in 0..n_expert, at random."""
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        ids = np.argsort(rng.random((n_vocab, n_expert)), axis=1)[:, :n_used]
        self.tensors.append((name, ids.astype(np.int32)))

    def writes(self, name, dims, std, half):
        """A matrix that writes only one half of the residual stream (its output dim is
        dims[1])."""
        w = self.noise(name, dims, std)
        token = np.arange(dims[1]) < self.split
        live = token if half == "token" else ~token
        w[..., ~live, :] = 0.0
        self.tensors.append((name, w))

    def embedding(self, d_model, n_vocab):
        w = self.noise("token_embd.weight", [d_model, n_vocab], 1.0)
        w[:, self.split:] = 0.0
        self.tensors.append(("token_embd.weight", w))

    def router(self, layer, d_model, n_expert, gain):
        tok = (1.0 - ROUTING_CONTEXT) * gain / np.sqrt(self.split)
        ctx = ROUTING_CONTEXT * gain / np.sqrt(d_model - self.split) * 4.0
        ctx /= (layer + 1) ** ROUTING_DEPTH
        name = f"blk.{layer}.ffn_gate_inp.weight"
        w = self.noise(name, [d_model, n_expert], 1.0)
        w[:, : self.split] *= tok
        w[:, self.split:] *= ctx
        self.tensors.append((name, w.astype(np.float32)))


def inv(n):
    return 1.0 / np.sqrt(n)


def qwen35moe(s, w, n_vocab):
    """The metadata of a qwen35moe file, its tensors into `w`: llama.cpp's qwen35moe.cpp
    (`load_arch_hparams`, `load_arch_tensors`)."""
    d, ff, fs, ne = s["d_model"], s["n_ff_exp"], s["n_ff_shexp"], s["n_expert"]
    qd, kvd = s["n_head"] * s["head_dim"], s["n_head_kv"] * s["head_dim"]
    vd, heads = s["n_v_heads"] * s["d_state"], s["n_v_heads"]
    channels = 2 * s["n_k_heads"] * s["d_state"] + vd
    a = "qwen35moe."
    meta = [
        ("u32", a + "context_length", s["n_ctx_train"]),
        ("u32", a + "embedding_length", d),
        ("u32", a + "block_count", s["n_layer"]),
        ("u32", a + "attention.head_count", s["n_head"]),
        ("u32", a + "attention.head_count_kv", s["n_head_kv"]),
        ("u32", a + "attention.key_length", s["head_dim"]),
        ("u32", a + "attention.value_length", s["head_dim"]),
        ("u32", a + "rope.dimension_count", s["n_rot"]),
        ("arr", a + "rope.dimension_sections", s["rope_sections"]),
        ("f32", a + "rope.freq_base", s["rope_base"]),
        ("f32", a + "attention.layer_norm_rms_epsilon", s["rms_eps"]),
        ("u32", a + "expert_count", ne),
        ("u32", a + "expert_used_count", s["n_expert_used"]),
        ("u32", a + "expert_feed_forward_length", ff),
        ("u32", a + "expert_shared_feed_forward_length", fs),
        ("u32", a + "ssm.conv_kernel", s["d_conv"]),
        ("u32", a + "ssm.state_size", s["d_state"]),
        ("u32", a + "ssm.group_count", s["n_k_heads"]),
        ("u32", a + "ssm.time_step_rank", heads),
        ("u32", a + "ssm.inner_size", vd),
        ("u32", a + "full_attention_interval", s["full_attention_interval"]),
    ]
    w.embedding(d, n_vocab)
    for i in range(s["n_layer"]):
        def b(n, i=i):
            return f"blk.{i}.{n}"

        w.const(b("attn_norm.weight"), [d])
        if (i + 1) % s["full_attention_interval"] == 0:
            w.rand(b("attn_q.weight"), [d, 2 * qd], inv(d))
            w.rand(b("attn_k.weight"), [d, kvd], inv(d))
            w.rand(b("attn_v.weight"), [d, kvd], inv(d))
            w.writes(b("attn_output.weight"), [qd, d], inv(qd), "context")
            w.const(b("attn_q_norm.weight"), [s["head_dim"]], ATTN_SHARPNESS)
            w.const(b("attn_k_norm.weight"), [s["head_dim"]], ATTN_SHARPNESS)
        else:
            w.rand(b("attn_qkv.weight"), [d, channels], inv(d))
            w.rand(b("attn_gate.weight"), [d, vd], inv(d))
            w.rand(b("ssm_conv1d.weight"), [s["d_conv"], channels], 0.5)
            w.rand(b("ssm_dt.bias"), [heads], 0.5)
            # -exp(A_log): negative, so every head's state decays.
            w.tensors.append((b("ssm_a"), np.linspace(-1.0, -0.1, heads, dtype=np.float32)))
            w.rand(b("ssm_beta.weight"), [d, heads], inv(d))
            w.rand(b("ssm_alpha.weight"), [d, heads], inv(d))
            w.const(b("ssm_norm.weight"), [s["d_state"]])
            w.writes(b("ssm_out.weight"), [vd, d], inv(vd), "context")
        w.const(b("post_attention_norm.weight"), [d])
        w.router(i, d, ne, ROUTER_GAIN)
        if s["fused_gate_up"]:
            w.rand(b("ffn_gate_up_exps.weight"), [d, 2 * ff, ne], inv(d))
        else:
            w.rand(b("ffn_gate_exps.weight"), [d, ff, ne], inv(d))
            w.rand(b("ffn_up_exps.weight"), [d, ff, ne], inv(d))
        w.writes(b("ffn_down_exps.weight"), [ff, d, ne], inv(ff), "token")
        w.rand(b("ffn_gate_inp_shexp.weight"), [d], inv(d))
        w.rand(b("ffn_gate_shexp.weight"), [d, fs], inv(d))
        w.rand(b("ffn_up_shexp.weight"), [d, fs], inv(d))
        w.writes(b("ffn_down_shexp.weight"), [fs, d], inv(fs), "token")
    w.const("output_norm.weight", [d])
    w.rand("output.weight", [d, n_vocab], inv(d))
    return meta


def lfm2moe(s, w, n_vocab):
    """The metadata of an lfm2moe file, its tensors into `w`: llama.cpp's lfm2moe.cpp."""
    d, ff, fd, ne = s["d_model"], s["n_ff_exp"], s["n_ff_dense"], s["n_expert"]
    kvd, taps = s["n_head_kv"] * s["head_dim"], s["l_cache"]
    a = "lfm2moe."
    kv_heads = [s["n_head_kv"] if i in s["attn_layers"] else 0 for i in range(s["n_layer"])]
    meta = [
        ("u32", a + "context_length", s["n_ctx_train"]),
        ("u32", a + "embedding_length", d),
        ("u32", a + "block_count", s["n_layer"]),
        ("u32", a + "feed_forward_length", fd),
        ("u32", a + "attention.head_count", s["n_head"]),
        ("arr", a + "attention.head_count_kv", kv_heads),
        ("f32", a + "rope.freq_base", s["rope_base"]),
        ("f32", a + "attention.layer_norm_rms_epsilon", s["rms_eps"]),
        ("u32", a + "expert_count", ne),
        ("u32", a + "expert_used_count", s["n_expert_used"]),
        ("u32", a + "expert_feed_forward_length", ff),
        ("u32", a + "leading_dense_block_count", s["dense_layers"]),
        ("u32", a + "expert_gating_func", 2),  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        ("u32", a + "shortconv.l_cache", taps),
    ]
    w.embedding(d, n_vocab)
    for i in range(s["n_layer"]):
        def b(n, i=i):
            return f"blk.{i}.{n}"

        w.const(b("attn_norm.weight"), [d])
        if kv_heads[i]:
            w.rand(b("attn_q.weight"), [d, d], inv(d))
            w.rand(b("attn_k.weight"), [d, kvd], inv(d))
            w.rand(b("attn_v.weight"), [d, kvd], inv(d))
            w.const(b("attn_q_norm.weight"), [s["head_dim"]], ATTN_SHARPNESS)
            w.const(b("attn_k_norm.weight"), [s["head_dim"]], ATTN_SHARPNESS)
            w.writes(b("attn_output.weight"), [d, d], inv(d), "context")
        else:
            w.rand(b("shortconv.in_proj.weight"), [d, 3 * d], inv(d))
            w.rand(b("shortconv.conv.weight"), [taps, d], inv(taps))
            w.writes(b("shortconv.out_proj.weight"), [d, d], inv(d), "context")
        w.const(b("ffn_norm.weight"), [d])
        if i < s["dense_layers"]:
            w.rand(b("ffn_gate.weight"), [d, fd], inv(d))
            w.rand(b("ffn_up.weight"), [d, fd], inv(d))
            w.writes(b("ffn_down.weight"), [fd, d], inv(fd), "token")
            continue
        w.router(i, d, ne, 2.0 * ROUTER_GAIN)
        w.rand(b("exp_probs_b.bias"), [ne], 0.01)
        w.rand(b("ffn_gate_exps.weight"), [d, ff, ne], inv(d))
        w.rand(b("ffn_up_exps.weight"), [d, ff, ne], inv(d))
        w.writes(b("ffn_down_exps.weight"), [ff, d, ne], inv(ff), "token")
    w.const("token_embd_norm.weight", [d])
    return meta


def deepseek2(s, w, n_vocab):
    """The metadata of a deepseek2 file, its tensors into `w`: llama.cpp's deepseek2.cpp, in the
    split MLA form (`attn_k_b`, `attn_v_b`), as gen/deepseek2.rs writes it. One KV head whose
    key is the latent plus the rotary part and whose value is the latent (what llama.cpp sizes
    its latent cache by); the per-head sizes as `key_length_mla` / `value_length_mla`."""
    d, ff, fd, ne = s["d_model"], s["n_ff_exp"], s["n_ff_dense"], s["n_expert"]
    nh, nope, rope, vh = s["n_head"], s["nope"], s["rope"], s["v_head"]
    r, qa, fs = s["kv_lora_rank"], s["q_lora_rank"], s["n_ff_exp"] * s["n_shared"]
    k_mla = nope + rope
    # llama.cpp reads a 26- or 27-layer file as V2-Lite and then never reads q_lora_rank.
    assert not (qa and s["n_layer"] in (26, 27)), "deepseek2: 26/27 layers mean V2-Lite"
    a = "deepseek2."
    meta = [
        ("u32", a + "context_length", s["n_ctx_train"]),
        ("u32", a + "embedding_length", d),
        ("u32", a + "block_count", s["n_layer"]),
        ("u32", a + "feed_forward_length", fd),
        ("u32", a + "attention.head_count", nh),
        ("u32", a + "attention.head_count_kv", 1),
        ("u32", a + "attention.key_length", r + rope),
        ("u32", a + "attention.value_length", r),
        ("u32", a + "attention.key_length_mla", k_mla),
        ("u32", a + "attention.value_length_mla", vh),
        ("u32", a + "attention.q_lora_rank", qa),
        ("u32", a + "attention.kv_lora_rank", r),
        ("u32", a + "rope.dimension_count", rope),
        ("f32", a + "rope.freq_base", s["rope_base"]),
        ("f32", a + "attention.layer_norm_rms_epsilon", s["rms_eps"]),
        ("u32", a + "expert_count", ne),
        ("u32", a + "expert_used_count", s["n_expert_used"]),
        ("u32", a + "expert_feed_forward_length", ff),
        ("u32", a + "expert_shared_count", s["n_shared"]),
        ("u32", a + "leading_dense_block_count", s["dense_layers"]),
        ("f32", a + "expert_weights_scale", s["weights_scale"]),
        ("bool", a + "expert_weights_norm", s["weights_norm"]),
        # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (2) or _SOFTMAX (1).
        ("u32", a + "expert_gating_func", 2 if s["sigmoid"] else 1),
    ]
    if s["yarn_factor"]:
        meta += [
            ("str", a + "rope.scaling.type", "yarn"),
            ("f32", a + "rope.scaling.factor", s["yarn_factor"]),
            ("u32", a + "rope.scaling.original_context_length", s["yarn_orig_ctx"]),
            # As the converter stores it (0.1 × mscale_all_dim); llama.cpp divides by 0.1.
            ("f32", a + "rope.scaling.yarn_log_multiplier", s["yarn_log_mul"]),
        ]
    w.embedding(d, n_vocab)
    for i in range(s["n_layer"]):
        def b(n, i=i):
            return f"blk.{i}.{n}"

        w.const(b("attn_norm.weight"), [d])
        if qa:
            w.const(b("attn_q_a_norm.weight"), [qa])
        # The latent is normed: its gain is the attention's sharpness on the latent side, as
        # the absorption matrix's is on the query side (gen/deepseek2.rs).
        w.const(b("attn_kv_a_norm.weight"), [r], np.sqrt(ATTN_SHARPNESS))
        if qa:
            w.rand(b("attn_q_a.weight"), [d, qa], inv(d))
            w.rand(b("attn_q_b.weight"), [qa, nh * k_mla], inv(qa))
        else:
            w.rand(b("attn_q.weight"), [d, nh * k_mla], inv(d))
        w.rand(b("attn_kv_a_mqa.weight"), [d, r + rope], inv(d))
        w.rand(b("attn_k_b.weight"), [nope, r, nh], inv(nope) * np.sqrt(ATTN_SHARPNESS))
        w.rand(b("attn_v_b.weight"), [r, vh, nh], inv(r))
        w.writes(b("attn_output.weight"), [nh * vh, d], inv(nh * vh), "context")
        w.const(b("ffn_norm.weight"), [d])
        if i < s["dense_layers"]:
            w.rand(b("ffn_gate.weight"), [d, fd], inv(d))
            w.writes(b("ffn_down.weight"), [fd, d], inv(fd), "token")
            w.rand(b("ffn_up.weight"), [d, fd], inv(d))
            continue
        if s["sigmoid"]:
            # Sigmoid gating with a selection bias: the router at twice the gain and a small
            # bias, as lfm2moe's (gen/lfm2moe.rs says why: fewer near-ties at the top-k edge).
            w.router(i, d, ne, s["router_gain"] * ROUTER_GAIN)
            w.rand(b("exp_probs_b.bias"), [ne], s["probs_bias"])
        else:
            w.router(i, d, ne, ROUTER_GAIN)
        w.rand(b("ffn_gate_exps.weight"), [d, ff, ne], inv(d))
        w.rand(b("ffn_up_exps.weight"), [d, ff, ne], inv(d))
        w.writes(b("ffn_down_exps.weight"), [ff, d, ne], inv(ff), "token")
        w.rand(b("ffn_gate_shexp.weight"), [d, fs], inv(d))
        w.rand(b("ffn_up_shexp.weight"), [d, fs], inv(d))
        w.writes(b("ffn_down_shexp.weight"), [fs, d], inv(fs), "token")
    w.const("output_norm.weight", [d])
    w.rand("output.weight", [d, n_vocab], inv(d))
    return meta


def rope_factors(n_pairs, lo, hi):
    """A `rope_freqs` table of Llama 3.1's long-context shape (llama.cpp divides pair i's
    frequency by entry i): `lo` over the first quarter of the pairs (the fast ones), `hi` over
    the last quarter, geometric in between."""
    q = n_pairs // 4
    ramp = np.geomspace(lo, hi, n_pairs - 2 * q + 2)[1:-1]
    return np.concatenate([np.full(q, lo), ramp, np.full(q, hi)]).astype(np.float32)


def llama(s, w, n_vocab):
    """The metadata of a llama file with routed experts (Mixtral), its tensors into `w`:
    llama.cpp's llama.cpp (`load_arch_tensors`), keys as gen/llama_moe.rs writes them. llama.cpp
    sizes Mixtral's experts by `feed_forward_length`, so that is the experts' width; softmax
    gating, top-k renormalised, and the original (adjacent-pair) rope are fixed by the arch."""
    d, ff, ne, hd = s["d_model"], s["n_ff_exp"], s["n_expert"], s["head_dim"]
    qd, kvd = s["n_head"] * hd, s["n_head_kv"] * hd
    a = "llama."
    meta = [
        ("u32", a + "context_length", s["n_ctx_train"]),
        ("u32", a + "embedding_length", d),
        ("u32", a + "block_count", s["n_layer"]),
        ("u32", a + "feed_forward_length", ff),
        ("u32", a + "attention.head_count", s["n_head"]),
        ("u32", a + "attention.head_count_kv", s["n_head_kv"]),
        ("u32", a + "attention.key_length", hd),
        ("u32", a + "attention.value_length", hd),
        ("f32", a + "rope.freq_base", s["rope_base"]),
        ("f32", a + "attention.layer_norm_rms_epsilon", s["rms_eps"]),
        ("u32", a + "expert_count", ne),
        ("u32", a + "expert_used_count", s["n_expert_used"]),
        ("u32", a + "expert_feed_forward_length", ff),
        ("u32", a + "rope.dimension_count", hd),
    ]
    w.embedding(d, n_vocab)
    if s["rope_freqs"]:
        # One table, no layer in its name: llama.cpp gives every layer this one.
        w.tensors.append(("rope_freqs.weight", rope_factors(hd // 2, *s["rope_freqs"])))
    for i in range(s["n_layer"]):
        def b(n, i=i):
            return f"blk.{i}.{n}"

        w.const(b("attn_norm.weight"), [d])
        # No q/k norms: the sharpness scales the q and k projections (gen/llama.rs).
        w.rand(b("attn_q.weight"), [d, qd], inv(d) * ATTN_SHARPNESS)
        w.rand(b("attn_k.weight"), [d, kvd], inv(d) * ATTN_SHARPNESS)
        w.rand(b("attn_v.weight"), [d, kvd], inv(d))
        w.writes(b("attn_output.weight"), [qd, d], inv(qd), "context")
        w.const(b("ffn_norm.weight"), [d])
        w.router(i, d, ne, ROUTER_GAIN)
        w.rand(b("ffn_gate_exps.weight"), [d, ff, ne], inv(d))
        w.rand(b("ffn_up_exps.weight"), [d, ff, ne], inv(d))
        w.writes(b("ffn_down_exps.weight"), [ff, d, ne], inv(ff), "token")
    w.const("output_norm.weight", [d])
    w.rand("output.weight", [d, n_vocab], inv(d))
    return meta


def bailingmoe3(s, w, n_vocab):
    """The metadata of a bailingmoe3 file, its tensors into `w`: llama.cpp's bailingmoe3.cpp
    (`load_arch_hparams`, `load_arch_tensors`), keys and tensor order as gen/bailingmoe3.rs.
    The per-layer KV head count picks the kind: 0 a Kimi Delta Attention layer, 1 a latent
    attention layer (deepseek2's split MLA, one KV head of latent + rope, plus a per-head
    sigmoid output gate `attn_gate`). Both kinds have `attention.head_count` heads."""
    d, ff, fd, ne = s["d_model"], s["n_ff_exp"], s["n_ff_dense"], s["n_expert"]
    nh, nope, rope, vh = s["n_head"], s["nope"], s["rope"], s["v_head"]
    r, qa, fs = s["kv_lora_rank"], s["q_lora_rank"], s["n_ff_exp"] * s["n_shared"]
    hd, taps = s["kda_head_dim"], s["d_conv"]
    di, k_mla = nh * hd, nope + rope
    assert s["gate_lower_bound"] < 0.0, "bailingmoe3: llama.cpp asserts a negative lower bound"
    assert s["dense_layers"] < s["n_layer"] and s["n_shared"] > 0
    a = "bailingmoe3."
    kv_heads = [1 if i in s["mla_layers"] else 0 for i in range(s["n_layer"])]
    meta = [
        ("u32", a + "context_length", s["n_ctx_train"]),
        ("u32", a + "embedding_length", d),
        ("u32", a + "block_count", s["n_layer"]),
        ("u32", a + "feed_forward_length", fd),
        ("u32", a + "attention.head_count", nh),
        ("arr", a + "attention.head_count_kv", kv_heads),
        ("u32", a + "attention.key_length", r + rope),
        ("u32", a + "attention.value_length", r),
        ("u32", a + "attention.key_length_mla", k_mla),
        ("u32", a + "attention.value_length_mla", vh),
        ("u32", a + "attention.kv_lora_rank", r),
        ("u32", a + "rope.dimension_count", rope),
        ("f32", a + "rope.freq_base", s["rope_base"]),
        ("f32", a + "attention.layer_norm_rms_epsilon", s["rms_eps"]),
        ("u32", a + "expert_count", ne),
        ("u32", a + "expert_used_count", s["n_expert_used"]),
        ("u32", a + "expert_feed_forward_length", ff),
        ("u32", a + "expert_shared_feed_forward_length", fs),
        ("u32", a + "expert_shared_count", s["n_shared"]),
        ("u32", a + "leading_dense_block_count", s["dense_layers"]),
        ("f32", a + "expert_weights_scale", s["weights_scale"]),
        ("bool", a + "expert_weights_norm", s["weights_norm"]),
        ("u32", a + "expert_gating_func", 2),  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        ("u32", a + "ssm.conv_kernel", taps),
        ("u32", a + "kda.head_dim", hd),
        ("bool", a + "kda.safe_gate", True),
        ("f32", a + "kda.gate_lower_bound", s["gate_lower_bound"]),
    ]
    if qa:
        # Optional in llama.cpp (and ours): without it, one attn_q.
        meta.append(("u32", a + "attention.q_lora_rank", qa))
    if "swiglu_exp" in s:
        meta.append(("arr", a + "swiglu_clamp_exp", s["swiglu_exp"]))
        meta.append(("arr", a + "swiglu_clamp_shexp", s["swiglu_shexp"]))
    w.embedding(d, n_vocab)
    for i in range(s["n_layer"]):
        def b(n, i=i):
            return f"blk.{i}.{n}"

        w.const(b("attn_norm.weight"), [d])
        if not kv_heads[i]:
            for p in "qkv":
                w.rand(b(f"ssm_conv1d_{p}.weight"), [taps, 1, di], 0.5)
            w.rand(b("attn_q.weight"), [d, di], inv(d))
            w.rand(b("attn_k.weight"), [d, di], inv(d))
            w.rand(b("attn_v.weight"), [d, di], inv(d))
            w.rand(b("ssm_f_a.weight"), [d, di], inv(d))
            w.rand(b("ssm_beta.weight"), [d, nh], inv(d))
            # Scales the gate's pre-activation per head: lower_bound * sigmoid(a * (f_a x + dt)).
            w.rand(b("ssm_a"), [1, nh], 1.0)
            w.rand(b("ssm_dt.bias"), [di], 0.5)
            w.rand(b("ssm_g_a.weight"), [d, di], inv(d))
            w.const(b("ssm_norm.weight"), [hd])
            w.writes(b("attn_output.weight"), [di, d], inv(di), "context")
        else:
            if qa:
                w.rand(b("attn_q_a.weight"), [d, qa], inv(d))
                w.const(b("attn_q_a_norm.weight"), [qa])
                w.rand(b("attn_q_b.weight"), [qa, nh * k_mla], inv(qa))
            else:
                w.rand(b("attn_q.weight"), [d, nh * k_mla], inv(d))
            w.rand(b("attn_kv_a_mqa.weight"), [d, r + rope], inv(d))
            # The latent norm and the absorption matrix at sqrt(sharpness) each, as deepseek2's.
            w.const(b("attn_kv_a_norm.weight"), [r], np.sqrt(ATTN_SHARPNESS))
            w.rand(b("attn_k_b.weight"), [nope, r, nh], inv(nope) * np.sqrt(ATTN_SHARPNESS))
            w.rand(b("attn_v_b.weight"), [r, vh, nh], inv(r))
            w.rand(b("attn_gate.weight"), [d, nh], inv(d))
            w.writes(b("attn_output.weight"), [nh * vh, d], inv(nh * vh), "context")
        w.const(b("ffn_norm.weight"), [d])
        if i < s["dense_layers"]:
            w.rand(b("ffn_gate.weight"), [d, fd], inv(d))
            w.rand(b("ffn_up.weight"), [d, fd], inv(d))
            w.writes(b("ffn_down.weight"), [fd, d], inv(fd), "token")
            continue
        w.router(i, d, ne, s["router_gain"] * ROUTER_GAIN)
        w.rand(b("exp_probs_b.bias"), [ne], s["probs_bias"])
        w.rand(b("ffn_gate_exps.weight"), [d, ff, ne], inv(d))
        w.rand(b("ffn_up_exps.weight"), [d, ff, ne], inv(d))
        w.writes(b("ffn_down_exps.weight"), [ff, d, ne], inv(ff), "token")
        w.rand(b("ffn_gate_shexp.weight"), [d, fs], inv(d))
        w.rand(b("ffn_up_shexp.weight"), [d, fs], inv(d))
        w.writes(b("ffn_down_shexp.weight"), [fs, d], inv(fs), "token")
    w.const("output_norm.weight", [d])
    w.rand("output.weight", [d, n_vocab], inv(d))
    return meta


def deepseek4(s, w, n_vocab):
    """The metadata of a deepseek4 (DeepSeek-V4) file, its tensors into `w`: llama.cpp's
    deepseek4.cpp (`load_arch_hparams`, `load_arch_tensors`), tensors in the loader's order as
    gen/deepseek4.rs writes them; the map is docs/architectures.md, "deepseek4". One key-and-
    value head of `head_dim`, its last `rope` dims rotated; four hyper-connection streams; every
    layer routed experts plus the shared expert (no dense layers), the first `hash_layers`
    routed by token id. No MTP block."""
    d, ff, ne, k = s["d_model"], s["n_ff_exp"], s["n_expert"], s["n_expert_used"]
    nh, hd, qr = s["n_head"], s["head_dim"], s["q_lora_rank"]
    g, ro, hi, di = s["o_groups"], s["o_lora_rank"], s["indexer_heads"], s["indexer_dim"]
    hc, fs, ratios = s["hc"], s["n_ff_exp"] * s["n_shared"], s["ratios"]
    mix, group_in = (2 + hc) * hc, nh * hd // g
    # What llama.cpp's loader and graph assert or refuse.
    assert hc == 4 and nh % g == 0 and s["rope"] <= min(hd, di)
    assert di % 64 == 0 and di != hd, "deepseek4: the indexer's Hadamard rotation"
    assert len(ratios) == s["n_layer"] and set(ratios) <= {0, 4, 128}
    assert s["hash_layers"] <= s["n_layer"]
    a = "deepseek4."
    meta = [
        ("u32", a + "context_length", s["n_ctx_train"]),
        ("u32", a + "embedding_length", d),
        ("u32", a + "block_count", s["n_layer"]),
        ("u32", a + "attention.head_count", nh),
        ("u32", a + "attention.head_count_kv", 1),
        ("f32", a + "rope.freq_base", s["rope_base"]),
        ("f32", a + "attention.layer_norm_rms_epsilon", s["rms_eps"]),
        ("u32", a + "expert_count", ne),
        ("u32", a + "expert_used_count", k),
        ("u32", a + "expert_gating_func", 4),  # LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
        ("u32", a + "attention.key_length", hd),
        ("u32", a + "attention.value_length", hd),
        ("u32", a + "rope.dimension_count", s["rope"]),
        ("u32", a + "attention.q_lora_rank", qr),
        ("u32", a + "attention.sliding_window", s["n_swa"]),
        ("u32", a + "expert_feed_forward_length", ff),
        ("u32", a + "expert_shared_count", s["n_shared"]),
        ("f32", a + "expert_weights_scale", s["weights_scale"]),
        ("bool", a + "expert_weights_norm", s["weights_norm"]),
        ("arr", a + "swiglu_clamp_exp", s["swiglu_exp"]),
        ("arr", a + "swiglu_clamp_shexp", s["swiglu_shexp"]),
        ("u32", a + "attention.indexer.head_count", hi),
        ("u32", a + "attention.indexer.key_length", di),
        ("u32", a + "attention.indexer.top_k", s["indexer_top_k"]),
        ("u32", a + "attention.output_group_count", g),
        ("u32", a + "attention.output_lora_rank", ro),
        # The writer's default INT32 array, as the converter's add_array writes it (ours: UINT32).
        ("arr", a + "attention.compress_ratios", ratios),
        ("f32", a + "attention.compress_rope_freq_base", s["compress_rope_base"]),
        ("u32", a + "hyper_connection.count", hc),
        ("u32", a + "hyper_connection.sinkhorn_iterations", s["sinkhorn_iters"]),
        ("f32", a + "hyper_connection.epsilon", s["hc_eps"]),
        ("u32", a + "hash_layer_count", s["hash_layers"]),
        ("u32", a + "embedding_length_out", hc * d),
    ]
    if s["yarn_factor"]:
        meta += [
            ("str", a + "rope.scaling.type", "yarn"),
            ("f32", a + "rope.scaling.factor", s["yarn_factor"]),
            ("u32", a + "rope.scaling.original_context_length", s["yarn_orig_ctx"]),
        ]
    # The hyper-connection mixes as gen/deepseek4.rs: `fn` of std 0.5 / sqrt(fan-in) (mixes of
    # std ~0.5 from the normed streams), `base` of std 0.5, `scale` uniform on [0.5, 1.5].
    hc_std = 0.5 * inv(hc * d)

    def hc_mix(prefix, n_out, n_scale):
        w.rand(f"{prefix}_fn.weight", [hc * d, n_out], hc_std)
        w.rand(f"{prefix}_base.weight", [n_out], 0.5)
        w.uniform(f"{prefix}_scale.weight", [n_scale], 0.5, 1.5)

    w.embedding(d, n_vocab)
    w.const("output_norm.weight", [d])
    w.rand("output.weight", [d, n_vocab], inv(d))
    hc_mix("output_hc", hc, 1)
    for i in range(s["n_layer"]):
        def b(n, i=i):
            return f"blk.{i}.{n}"

        w.const(b("attn_norm.weight"), [d])
        w.rand(b("attn_sinks.weight"), [nh], 1.0)
        w.rand(b("attn_q_a.weight"), [d, qr], inv(d))
        w.const(b("attn_q_a_norm.weight"), [qr])
        w.rand(b("attn_q_b.weight"), [qr, nh * hd], inv(qr))
        w.rand(b("attn_kv.weight"), [d, hd], inv(d))
        # Queries are normed per head with no weight: the key's norm carries the sharpness.
        w.const(b("attn_kv_a_norm.weight"), [hd], np.sqrt(ATTN_SHARPNESS))
        w.rand(b("attn_output_a.weight"), [group_in, ro * g], inv(group_in))
        w.writes(b("attn_output_b.weight"), [g * ro, d], inv(g * ro), "context")
        hc_mix(b("hc_attn"), mix, 3)
        hc_mix(b("hc_ffn"), mix, 3)
        if ratios[i]:
            coff = 2 if ratios[i] == 4 else 1
            w.rand(b("attn_compressor_kv.weight"), [d, coff * hd], inv(d))
            w.rand(b("attn_compressor_gate.weight"), [d, coff * hd], inv(d))
            w.rand(b("attn_compressor_ape.weight"), [coff * hd, ratios[i]], 0.5)
            w.const(b("attn_compressor_norm.weight"), [hd], np.sqrt(ATTN_SHARPNESS))
            if ratios[i] == 4:
                w.rand(b("indexer.proj.weight"), [d, hi], inv(d))
                w.rand(b("indexer.attn_q_b.weight"), [qr, hi * di], inv(qr))
                w.rand(b("indexer_compressor_kv.weight"), [d, 2 * di], inv(d))
                w.rand(b("indexer_compressor_gate.weight"), [d, 2 * di], inv(d))
                w.rand(b("indexer_compressor_ape.weight"), [2 * di, 4], 0.5)
                w.const(b("indexer_compressor_norm.weight"), [di])
        w.router(i, d, ne, ROUTER_GAIN)
        if i < s["hash_layers"]:
            w.expert_ids(b("ffn_gate_tid2eid.weight"), k, n_vocab, ne)
        else:
            w.rand(b("exp_probs_b.bias"), [ne], 0.01)
        w.const(b("ffn_norm.weight"), [d])
        w.rand(b("ffn_gate_exps.weight"), [d, ff, ne], inv(d))
        w.writes(b("ffn_down_exps.weight"), [ff, d, ne], inv(ff), "token")
        w.rand(b("ffn_up_exps.weight"), [d, ff, ne], inv(d))
        w.rand(b("ffn_gate_shexp.weight"), [d, fs], inv(d))
        w.writes(b("ffn_down_shexp.weight"), [fs, d], inv(fs), "token")
        w.rand(b("ffn_up_shexp.weight"), [d, fs], inv(d))
    return meta


FAMILIES = {"qwen35moe": qwen35moe, "lfm2moe": lfm2moe, "deepseek2": deepseek2, "llama": llama,
            "bailingmoe3": bailingmoe3, "deepseek4": deepseek4}


def write(arch, shape_name, tokenizer_kv, out, seed):
    """Write the F32 model `arch` of shape `shape_name` to `out`, with the tokenizer entries
    `tokenizer_kv` ((name, value, type, sub_type), as `gguf.GGUFWriter.add_key_value` takes
    them) and the weights of `seed`."""
    import gguf

    key = (arch, shape_name)
    if key not in SHAPES:
        raise SystemExit(f"gguf_write_hybrid: no shape {shape_name!r} for {arch!r} "
                         f"(have: {sorted(SHAPES)})")
    s = SHAPES[key]
    tokens = [v for name, v, _, _ in tokenizer_kv if name == "tokenizer.ggml.tokens"]
    if not tokens:
        raise SystemExit("gguf_write_hybrid: the tokenizer source has no tokenizer.ggml.tokens")
    weights = Weights(seed, s["d_model"])
    meta = FAMILIES[arch](s, weights, len(tokens[0]))
    w = gguf.GGUFWriter(out, arch)
    w.add_name(f"bmoe gguf-py {arch} {shape_name} (seed {seed})")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for ty, name, value in meta:
        {"u32": w.add_uint32, "f32": w.add_float32, "arr": w.add_array, "bool": w.add_bool,
         "str": w.add_string}[ty](name, value)
    for name, value, vtype, sub_type in tokenizer_kv:
        w.add_key_value(name, value, vtype, sub_type=sub_type)
    for name, data in weights.tensors:
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
