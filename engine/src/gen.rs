//! The synthetic model generator behind `bmoe-cli gen`: complete, loadable GGUF files of every
//! architecture the engine runs (`--arch`: qwen3moe, qwen2moe, qwen35moe, gemma4, gpt-oss, lfm2moe,
//! deepseek2, llama, bailingmoe3, deepseek4) with deterministic random
//! weights, a real tokenizer and chat template, so tests and benchmarks make the models they
//! need and no model file is ever committed. Each file follows llama.cpp's tensor names and
//! metadata for its architecture, so llama.cpp loads it too (the parity gates).
//!
//! ## Routing realism
//! Random weights route uniformly at random: consecutive tokens would share ~k/n of their
//! experts, far below the ~35–40 % previous-token reuse real models show, and every cache
//! policy would look alike. The generator therefore gives the hidden state two halves:
//! *token* dimensions (written by the token embedding and by the experts) and *context*
//! dimensions (written only by attention, whose near-uniform weights make it a running mean
//! of the context, so it drifts slowly from token to token). The router reads both, mixed by
//! `routing_context` R ∈ [0, 1]: R = 0 routes on token identity alone, R = 1 on context alone.
//! Intermediate values give the reuse and LRU hit-rate curves of real models; see
//! `docs/models.md` for measured statistics.
//!
//! Every layer's attention adds to the context half, so it grows with depth while the token
//! half's signal does not: with one gain for every layer, the deep layers of a 48-layer model
//! routed on context alone (previous-token reuse rising from 20 % at layer 0 to 85 % past
//! layer 20). Layer `i`'s router therefore reads the context half at a gain divided by
//! `(i + 1)^routing_depth` — 0.75 by default, the exponent that keeps reuse flat over depth on
//! both the `small` and the 30B-A3B shape (measured: docs/models.md).

mod bailingmoe3;
mod deepseek2;
mod deepseek4;
mod gemma4;
mod gpt_oss;
mod lfm2moe;
mod llama;
mod llama_moe;
mod mix;
mod qwen2moe;
mod qwen35moe;
mod qwen3moe;

pub use bailingmoe3::BailingShape;
pub use deepseek2::Deepseek2Shape;
pub use deepseek4::Deepseek4Shape;
pub use gemma4::GemmaShape;
pub use lfm2moe::Lfm2Shape;
pub use qwen35moe::Qwen35Shape;

pub use mix::Ftype;

use crate::gguf::{GgmlType, GgufError, GgufWriter, TensorSpec, Value};
use crate::kernels;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The architectures `gen` writes (`general.architecture`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GenArch {
    /// Qwen3 MoE: q/k norms, routed experts only.
    Qwen3Moe,
    /// Qwen1.5/Qwen2 MoE: q/k/v biases, a sigmoid-gated shared expert, weights not
    /// renormalised.
    Qwen2Moe,
    /// Gemma 4 MoE: a dense GELU MLP beside fused gate_up experts, sliding-window and global
    /// layers, post-norms, logit soft-capping.
    Gemma4,
    /// gpt-oss: attention sinks, sliding-window layers, YaRN, biases everywhere, clamped
    /// SwiGLU experts, top-k then softmax.
    GptOss,
    /// LFM2 MoE: short-convolution and attention layers, leading dense FFN layers, sigmoid
    /// routing with a selection bias.
    Lfm2Moe,
    /// Qwen3.5/3.6 MoE: Gated DeltaNet layers with gated full attention every few, a
    /// sigmoid-gated shared expert, an MTP block.
    Qwen35Moe,
    /// DeepSeek-V2 family: multi-head latent attention (split k_b/v_b), leading dense layers,
    /// routed experts beside shared ones.
    Deepseek2,
    /// llama with routed experts (Mixtral): GQA with the original rotary embedding, softmax
    /// top-k renormalised, no shared expert.
    LlamaMoe,
    /// Ling/Ring 3.0: Kimi Delta Attention layers with gated latent attention every few,
    /// leading dense layers, sigmoid routing with a selection bias beside a shared expert.
    BailingMoe3,
    /// DeepSeek-V4: four hyper-connection streams, one key-and-value head with sinks in a
    /// window beside compressed rows (ratio 4 with an indexer, or 128), a grouped low-rank
    /// output, sqrt-softplus routing (by token id on the first layers) beside a shared expert.
    Deepseek4,
}

impl GenArch {
    pub const NAMES: &'static [&'static str] = &[
        "qwen3moe",
        "qwen2moe",
        "qwen35moe",
        "gemma4",
        "gpt-oss",
        "lfm2moe",
        "deepseek2",
        "llama",
        "bailingmoe3",
        "deepseek4",
    ];

    pub fn from_name(s: &str) -> Option<GenArch> {
        match s {
            "qwen3moe" => Some(GenArch::Qwen3Moe),
            "qwen2moe" => Some(GenArch::Qwen2Moe),
            "gemma4" => Some(GenArch::Gemma4),
            "gpt-oss" => Some(GenArch::GptOss),
            "lfm2moe" => Some(GenArch::Lfm2Moe),
            "qwen35moe" => Some(GenArch::Qwen35Moe),
            "deepseek2" => Some(GenArch::Deepseek2),
            "llama" => Some(GenArch::LlamaMoe),
            "bailingmoe3" => Some(GenArch::BailingMoe3),
            "deepseek4" => Some(GenArch::Deepseek4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GenArch::Qwen3Moe => "qwen3moe",
            GenArch::Qwen2Moe => "qwen2moe",
            GenArch::Gemma4 => "gemma4",
            GenArch::GptOss => "gpt-oss",
            GenArch::Lfm2Moe => "lfm2moe",
            GenArch::Qwen35Moe => "qwen35moe",
            GenArch::Deepseek2 => "deepseek2",
            GenArch::LlamaMoe => "llama",
            GenArch::BailingMoe3 => "bailingmoe3",
            GenArch::Deepseek4 => "deepseek4",
        }
    }

    /// The presets `gen` offers for this architecture (`--list-archs` prints them).
    pub fn presets(self) -> Vec<&'static str> {
        Preset::ALL
            .iter()
            .filter(|p| p.arch().is_none_or(|a| a == self))
            .map(|p| p.name())
            .collect()
    }
}

/// What one architecture writes (`gen/<arch>.rs`): its checks, its `<arch>.*` keys and its
/// tensors in llama.cpp's order, and what a generic size (tiny, tiny-odd, small) gains to be
/// one of its files. Everything else — the routing realism, the type scheme, the weights'
/// streams, the file — is shared.
trait Family: Sync {
    /// A generic preset's shape (`s`, the qwen3moe one) made this architecture's.
    fn generic(&self, _preset: Preset, _s: &mut ModelShape) {}
    /// Refuse what would not make a working file of this architecture.
    fn validate(&self, s: &ModelShape) -> Result<(), String>;
    /// The `<arch>.*` metadata keys.
    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError>;
    /// Every tensor of the file, in llama.cpp's order.
    fn plan(&self, o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError>;
}

/// Tensors whose wanted type could not hold their rows: (name, wanted, written).
type Fallbacks = Vec<(String, GgmlType, GgmlType)>;

impl GenArch {
    /// The architecture's part of the generator.
    fn family(self) -> &'static dyn Family {
        match self {
            GenArch::Qwen3Moe => &qwen3moe::Qwen3Moe,
            GenArch::Qwen2Moe => &qwen2moe::Qwen2Moe,
            GenArch::Gemma4 => &gemma4::Gemma4,
            GenArch::GptOss => &gpt_oss::GptOss,
            GenArch::Lfm2Moe => &lfm2moe::Lfm2Moe,
            GenArch::Qwen35Moe => &qwen35moe::Qwen35Moe,
            GenArch::Deepseek2 => &deepseek2::Deepseek2,
            GenArch::LlamaMoe => &llama_moe::LlamaMoe,
            GenArch::BailingMoe3 => &bailingmoe3::BailingMoe3,
            GenArch::Deepseek4 => &deepseek4::Deepseek4,
        }
    }
}

/// Model dimensions of a generated file.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    pub arch: GenArch,
    pub n_layer: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub d_model: u32,
    pub n_ff_exp: u32,
    /// The shared expert's FFN width (qwen2moe), or the dense MLP's beside the experts
    /// (gemma4, which llama.cpp calls its shared expert); 0 for an architecture without one.
    pub n_ff_shexp: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub n_ctx_train: u32,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Omit `output.weight`: the head reuses `token_embd`.
    pub tie_output: bool,
    /// gemma4's layer pattern and global-layer attention (`None` for other architectures).
    pub gemma: Option<GemmaShape>,
    /// lfm2moe's layer pattern, convolution and dense layers (`None` for other architectures).
    pub lfm2: Option<Lfm2Shape>,
    /// qwen35moe's layer pattern, DeltaNet and rope dimensions (`None` for other architectures).
    pub qwen35: Option<Qwen35Shape>,
    /// deepseek2's latent attention, dense layers and gating (`None` for other architectures).
    pub deepseek2: Option<Deepseek2Shape>,
    /// bailingmoe3's layer pattern, KDA and latent attention (`None` for other architectures).
    pub bailing: Option<BailingShape>,
    /// deepseek4's attention, compressors, hyper-connections and routing (`None` for other
    /// architectures).
    pub deepseek4: Option<Deepseek4Shape>,
    /// Sliding window of the sliding layers (gpt-oss, deepseek4; 0 = every layer attends
    /// fully).
    pub n_swa: u32,
    /// YaRN context extension factor (gpt-oss, deepseek2, deepseek4's compressed layers; 0 = no
    /// rope scaling) and its original context length.
    pub yarn_factor: f32,
    pub yarn_orig_ctx: u32,
}

/// Named starting points; every dimension can be overridden.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Preset {
    /// 4 layers, 16 experts, top-4, d_model 256, expert FFN 384, Q8_0 experts (~20 MiB of
    /// experts: a 2 MiB cache evicts every token, a 32 MiB one holds every expert).
    Tiny,
    /// 12 layers, 64 experts, top-8, d_model 1024, expert FFN 512, Q4_K_M: hundreds of MiB.
    Small,
    /// The full shape of Qwen3-30B-A3B: 48 layers, 128 experts, top-8, d_model 2048,
    /// expert FFN 768, GQA 32/4 heads of 128; ~17 GB at Q4_K_M.
    Qwen3_30bA3bShape,
    /// Tiny with no row length a multiple of 256 (d_model 288, expert FFN 160, 6 heads of 48):
    /// every K-quant and IQ4_XS weight falls back to its 32-value stand-in, as in models like
    /// gpt-oss (2880) or those with expert widths of 1408.
    TinyOdd,
    /// The full shape of Qwen1.5-MoE-A2.7B (qwen2moe): 24 layers, 60 experts, top-4,
    /// d_model 2048, expert FFN 1408, shared expert FFN 5632, 16 heads of 128; ~8 GB at
    /// Q4_K_M.
    Qwen15MoeA27bShape,
    /// The full shape of DeepSeek-V2-Lite (deepseek2; the routing shape of the DeepSeek trace
    /// in ../shared/traces, for `--routing-from`): 27 layers (the first dense), 64 experts,
    /// top-6, 2 shared, d_model 2048, expert FFN 1408, multi-head latent attention (16 heads,
    /// latent 512), YaRN ×40; ~10 GB at Q4_K_M.
    DeepseekV2LiteShape,
    /// The full shape of DeepSeek-V2 (deepseek2, 236B-A21B): 60 layers, 160 experts top-6 in 8
    /// groups (3 selectable), 2 shared, d_model 5120, 128 latent-attention heads; ~130 GB at
    /// Q4_K_M (estimated; never generated here).
    DeepseekV2Shape,
    /// The qwen2moe stand-in `deepseek-v2-lite-shape` was before deepseek2 ran (its shared
    /// expert standing in for the two, GQA 16 heads of 128 for the latent attention): 26 MoE
    /// layers, 64 experts, top-6; ~9 GB at Q4_K_M. Kept for the measurements recorded on it.
    DeepseekV2LiteQwen2moeStandIn,
    /// The full shape of Moonlight-16B-A3B (deepseek2): V2-Lite's with sigmoid routing and a
    /// selection bias, renormalised, × 2.446.
    Moonlight16bA3bShape,
    /// The full shape of Mixtral-8x7B (llama with experts; the routing shape of the Mixtral
    /// trace, for `--routing-from`): 32 layers, 8 experts, top-2, d_model 4096, expert FFN
    /// 14336, GQA 32/8 heads of 128, rope base 1e6; ~26 GB at Q4_K_M.
    Mixtral8x7bShape,
    /// The qwen3moe file that stood in for Mixtral's routing shape before llama ran (q/k norms,
    /// NeoX rope); kept for the measurements recorded on it.
    Mixtral8x7bQwen3moeStandIn,
    /// The full shape of Gemma-4-26B-A4B (gemma4): 30 layers (five sliding-window of 1024 to
    /// one global), 128 experts, top-8, d_model 2816, expert FFN 704, dense MLP 2112, 16
    /// heads of 256 (8 KV) on window layers and of 512 (2 KV) on global ones.
    Gemma4_26bA4bShape,
    /// The full shape of gpt-oss-20b: 24 layers, 32 experts, top-4, d_model 2880, expert FFN
    /// 2880, GQA 64/8 heads of 64, window 128, YaRN ×32; MXFP4 experts (~10.9 GB).
    GptOss20bShape,
    /// The full shape of gpt-oss-120b: as 20b with 36 layers and 128 experts (~62 GB).
    GptOss120bShape,
    /// The full shape of LFM2-8B-A1B (lfm2moe): 24 layers (attention at 2, 6, 10, 14, 18, 21,
    /// short convolutions of width 3 elsewhere), the first two dense (FFN 7168), 32 experts,
    /// top-4, d_model 2048, expert FFN 1792, 32 heads of 64 with 8 KV heads; ~5 GB at Q4_K_M.
    Lfm2_8bA1bShape,
    /// The full shape of Qwen3.6-35B-A3B (qwen35moe; Qwen3.5-35B-A3B is the same): 40 layers
    /// (three Gated DeltaNet to one gated attention) and an MTP block, 256 experts, top-8,
    /// d_model 2048, expert FFN 512, shared expert 512, 16 heads of 256 (2 KV).
    Qwen36_35bA3bShape,
    /// The full shape of DeepSeek-V4-Flash (deepseek4, 284B-A13B): 43 layers (two window-only,
    /// then compressed by 4 and 128 by turns), 256 experts top-6 (hash-routed on the first 3)
    /// beside one shared, d_model 4096, expert FFN 2048, 64 heads of 512, four
    /// hyper-connection streams; MXFP4 experts as published (~155 GB with its 129280-token
    /// vocabulary; never generated here).
    DeepseekV4FlashShape,
}

/// `--routing-depth`'s default: flat previous-token reuse over depth on the pre-norm
/// architectures (docs/models.md).
pub const ROUTING_DEPTH_DEFAULT: f32 = 0.75;

/// `--routing-context`'s default for gemma4 files, whatever the preset: with routing depth 0
/// (gemma4 normalises its sub-layers' outputs, so the context half does not grow with depth)
/// it gives the 26B-A4B shape 36.4 % previous-token reuse, 28–46 % in every layer.
pub const GEMMA4_ROUTING_CONTEXT: f32 = 0.2;

impl Preset {
    pub const NAMES: &'static [&'static str] = &[
        "tiny",
        "tiny-odd",
        "small",
        "qwen3-30b-a3b-shape",
        "qwen1.5-moe-a2.7b-shape",
        "deepseek-v2-lite-shape",
        "deepseek-v2-lite-qwen2moe-stand-in",
        "moonlight-16b-a3b-shape",
        "deepseek-v2-shape",
        "mixtral-8x7b-shape",
        "mixtral-8x7b-qwen3moe-stand-in",
        "gemma-4-26b-a4b-shape",
        "gpt-oss-20b-shape",
        "gpt-oss-120b-shape",
        "lfm2-8b-a1b-shape",
        "qwen3.6-35b-a3b-shape",
        "deepseek-v4-flash-shape",
    ];

    pub const ALL: &'static [Preset] = &[
        Preset::Tiny,
        Preset::TinyOdd,
        Preset::Small,
        Preset::Qwen3_30bA3bShape,
        Preset::Qwen15MoeA27bShape,
        Preset::DeepseekV2LiteShape,
        Preset::DeepseekV2LiteQwen2moeStandIn,
        Preset::Moonlight16bA3bShape,
        Preset::DeepseekV2Shape,
        Preset::Mixtral8x7bShape,
        Preset::Mixtral8x7bQwen3moeStandIn,
        Preset::Gemma4_26bA4bShape,
        Preset::GptOss20bShape,
        Preset::GptOss120bShape,
        Preset::Lfm2_8bA1bShape,
        Preset::Qwen36_35bA3bShape,
        Preset::DeepseekV4FlashShape,
    ];

    pub fn from_name(s: &str) -> Option<Preset> {
        match s {
            "tiny" => Some(Preset::Tiny),
            "tiny-odd" => Some(Preset::TinyOdd),
            "small" => Some(Preset::Small),
            "qwen3-30b-a3b-shape" | "qwen3-30b-a3b" => Some(Preset::Qwen3_30bA3bShape),
            "qwen1.5-moe-a2.7b-shape" | "qwen2moe-a2.7b-shape" => Some(Preset::Qwen15MoeA27bShape),
            "deepseek-v2-lite-shape" | "deepseek-v2-lite" => Some(Preset::DeepseekV2LiteShape),
            "deepseek-v2-lite-qwen2moe-stand-in" => Some(Preset::DeepseekV2LiteQwen2moeStandIn),
            "moonlight-16b-a3b-shape" | "moonlight-16b-a3b" => Some(Preset::Moonlight16bA3bShape),
            "deepseek-v2-shape" => Some(Preset::DeepseekV2Shape),
            "mixtral-8x7b-shape" | "mixtral-8x7b" => Some(Preset::Mixtral8x7bShape),
            "mixtral-8x7b-qwen3moe-stand-in" => Some(Preset::Mixtral8x7bQwen3moeStandIn),
            "gemma-4-26b-a4b-shape" => Some(Preset::Gemma4_26bA4bShape),
            "gpt-oss-20b-shape" => Some(Preset::GptOss20bShape),
            "gpt-oss-120b-shape" => Some(Preset::GptOss120bShape),
            "lfm2-8b-a1b-shape" => Some(Preset::Lfm2_8bA1bShape),
            "qwen3.6-35b-a3b-shape" | "qwen3.5-35b-a3b-shape" => Some(Preset::Qwen36_35bA3bShape),
            "deepseek-v4-flash-shape" | "deepseek-v4-flash" => Some(Preset::DeepseekV4FlashShape),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::TinyOdd => "tiny-odd",
            Preset::Small => "small",
            Preset::Qwen3_30bA3bShape => "qwen3-30b-a3b-shape",
            Preset::Qwen15MoeA27bShape => "qwen1.5-moe-a2.7b-shape",
            Preset::DeepseekV2LiteShape => "deepseek-v2-lite-shape",
            Preset::DeepseekV2LiteQwen2moeStandIn => "deepseek-v2-lite-qwen2moe-stand-in",
            Preset::Moonlight16bA3bShape => "moonlight-16b-a3b-shape",
            Preset::DeepseekV2Shape => "deepseek-v2-shape",
            Preset::Mixtral8x7bShape => "mixtral-8x7b-shape",
            Preset::Mixtral8x7bQwen3moeStandIn => "mixtral-8x7b-qwen3moe-stand-in",
            Preset::Gemma4_26bA4bShape => "gemma-4-26b-a4b-shape",
            Preset::GptOss20bShape => "gpt-oss-20b-shape",
            Preset::GptOss120bShape => "gpt-oss-120b-shape",
            Preset::Lfm2_8bA1bShape => "lfm2-8b-a1b-shape",
            Preset::Qwen36_35bA3bShape => "qwen3.6-35b-a3b-shape",
            Preset::DeepseekV4FlashShape => "deepseek-v4-flash-shape",
        }
    }

    /// The architecture a full-shape preset is the shape of; `None` for the generic sizes,
    /// which every architecture has.
    pub fn arch(self) -> Option<GenArch> {
        match self {
            Preset::Tiny | Preset::TinyOdd | Preset::Small => None,
            Preset::Qwen3_30bA3bShape | Preset::Mixtral8x7bQwen3moeStandIn => {
                Some(GenArch::Qwen3Moe)
            }
            Preset::Mixtral8x7bShape => Some(GenArch::LlamaMoe),
            Preset::Qwen15MoeA27bShape | Preset::DeepseekV2LiteQwen2moeStandIn => {
                Some(GenArch::Qwen2Moe)
            }
            Preset::DeepseekV2LiteShape
            | Preset::Moonlight16bA3bShape
            | Preset::DeepseekV2Shape => Some(GenArch::Deepseek2),
            Preset::Gemma4_26bA4bShape => Some(GenArch::Gemma4),
            Preset::GptOss20bShape | Preset::GptOss120bShape => Some(GenArch::GptOss),
            Preset::Lfm2_8bA1bShape => Some(GenArch::Lfm2Moe),
            Preset::Qwen36_35bA3bShape => Some(GenArch::Qwen35Moe),
            Preset::DeepseekV4FlashShape => Some(GenArch::Deepseek4),
        }
    }

    /// The preset's shape for architecture `arch`: a generic size gains what `arch` needs
    /// (qwen2moe's shared expert, as wide as llama.cpp's K-quants allow: 256-multiples except
    /// on tiny-odd); a full-shape preset of another architecture is refused.
    pub fn shape_for(self, arch: GenArch) -> Result<ModelShape, GenError> {
        if let Some(a) = self.arch().filter(|&a| a != arch) {
            return Err(GenError::Invalid(format!(
                "--preset {} is a {} shape, not {} (presets for {}: {})",
                self.name(),
                a.name(),
                arch.name(),
                arch.name(),
                arch.presets().join(", ")
            )));
        }
        let mut s = self.shape();
        if self.arch().is_none() {
            s.arch = arch;
            arch.family().generic(self, &mut s);
        }
        Ok(s)
    }

    /// The preset's shape for its own architecture (qwen3moe for the generic sizes).
    pub fn shape(self) -> ModelShape {
        let base = ModelShape {
            arch: GenArch::Qwen3Moe,
            n_layer: 4,
            n_expert: 16,
            n_expert_used: 4,
            d_model: 256,
            n_ff_exp: 384,
            n_ff_shexp: 0,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 64,
            n_ctx_train: 4096,
            rope_base: 1_000_000.0,
            rms_eps: 1e-6,
            tie_output: false,
            gemma: None,
            lfm2: None,
            qwen35: None,
            deepseek2: None,
            bailing: None,
            deepseek4: None,
            n_swa: 0,
            yarn_factor: 0.0,
            yarn_orig_ctx: 0,
        };
        match self {
            Preset::Tiny => base,
            Preset::TinyOdd => ModelShape {
                d_model: 288,
                n_ff_exp: 160,
                n_head: 6,
                n_head_kv: 2,
                head_dim: 48,
                ..base
            },
            Preset::Small => ModelShape {
                n_layer: 12,
                n_expert: 64,
                n_expert_used: 8,
                d_model: 1024,
                n_ff_exp: 512,
                n_head: 16,
                n_head_kv: 4,
                head_dim: 64,
                ..base
            },
            Preset::Qwen3_30bA3bShape => ModelShape {
                n_layer: 48,
                n_expert: 128,
                n_expert_used: 8,
                d_model: 2048,
                n_ff_exp: 768,
                n_head: 32,
                n_head_kv: 4,
                head_dim: 128,
                n_ctx_train: 40960,
                ..base
            },
            Preset::Qwen15MoeA27bShape => ModelShape {
                arch: GenArch::Qwen2Moe,
                n_layer: 24,
                n_expert: 60,
                n_expert_used: 4,
                d_model: 2048,
                n_ff_exp: 1408,
                n_ff_shexp: 5632,
                n_head: 16,
                n_head_kv: 16,
                head_dim: 128,
                n_ctx_train: 8192,
                ..base
            },
            Preset::DeepseekV2LiteShape => deepseek2::v2_lite_shape(),
            Preset::Moonlight16bA3bShape => deepseek2::moonlight_shape(),
            Preset::DeepseekV2Shape => deepseek2::v2_shape(),
            Preset::DeepseekV2LiteQwen2moeStandIn => ModelShape {
                arch: GenArch::Qwen2Moe,
                n_layer: 26,
                n_expert: 64,
                n_expert_used: 6,
                d_model: 2048,
                n_ff_exp: 1408,
                n_ff_shexp: 2816,
                n_head: 16,
                n_head_kv: 16,
                head_dim: 128,
                n_ctx_train: 32768,
                ..base
            },
            Preset::Mixtral8x7bShape => ModelShape {
                arch: GenArch::LlamaMoe,
                rope_base: 1_000_000.0,
                rms_eps: 1e-5,
                ..Preset::Mixtral8x7bQwen3moeStandIn.shape()
            },
            Preset::Mixtral8x7bQwen3moeStandIn => ModelShape {
                n_layer: 32,
                n_expert: 8,
                n_expert_used: 2,
                d_model: 4096,
                n_ff_exp: 14336,
                n_head: 32,
                n_head_kv: 8,
                head_dim: 128,
                n_ctx_train: 32768,
                ..base
            },
            Preset::Gemma4_26bA4bShape => ModelShape {
                arch: GenArch::Gemma4,
                n_layer: 30,
                n_expert: 128,
                n_expert_used: 8,
                d_model: 2816,
                n_ff_exp: 704,
                n_ff_shexp: 2112,
                n_head: 16,
                n_head_kv: 8,
                head_dim: 256,
                n_ctx_train: 262_144,
                rope_base: 1_000_000.0,
                gemma: Some(GemmaShape::gemma_4_26b_a4b()),
                ..base
            },
            Preset::GptOss20bShape => gpt_oss::full_shape(24, 32),
            Preset::GptOss120bShape => gpt_oss::full_shape(36, 128),
            Preset::Lfm2_8bA1bShape => lfm2moe::full_shape(),
            // Qwen/Qwen3.6-35B-A3B's config.json (`text_config`): hidden_size 2048,
            // num_hidden_layers 40, num_experts 256, num_experts_per_tok 8,
            // moe_intermediate_size 512, shared_expert_intermediate_size 512,
            // num_attention_heads 16, num_key_value_heads 2, head_dim 256, rope_theta 1e7,
            // max_position_embeddings 262144, rms_norm_eps 1e-6 (llama.cpp names a 40-layer
            // qwen35moe 35B-A3B).
            Preset::Qwen36_35bA3bShape => ModelShape {
                arch: GenArch::Qwen35Moe,
                n_layer: 40,
                n_expert: 256,
                n_expert_used: 8,
                d_model: 2048,
                n_ff_exp: 512,
                n_ff_shexp: 512,
                n_head: 16,
                n_head_kv: 2,
                head_dim: 256,
                n_ctx_train: 262_144,
                rope_base: 10_000_000.0,
                qwen35: Some(Qwen35Shape::qwen36_35b_a3b()),
                ..base
            },
            Preset::DeepseekV4FlashShape => deepseek4::v4_flash_shape(),
        }
    }

    /// The `routing_context` that gives this shape ~35–40 % previous-token reuse on English
    /// text in every layer, as real MoE models show, with the default `routing_depth`
    /// (measured: docs/models.md).
    pub fn default_routing_context(self) -> f32 {
        match self {
            Preset::Tiny | Preset::TinyOdd => 0.65,
            Preset::Small | Preset::Qwen3_30bA3bShape => 0.7,
            // Not calibrated for their own shapes: the value small and the 30B shape share.
            Preset::Qwen15MoeA27bShape
            | Preset::DeepseekV2LiteShape
            | Preset::DeepseekV2LiteQwen2moeStandIn
            | Preset::Moonlight16bA3bShape
            | Preset::DeepseekV2Shape
            | Preset::Mixtral8x7bShape
            | Preset::Mixtral8x7bQwen3moeStandIn
            | Preset::Gemma4_26bA4bShape
            | Preset::GptOss20bShape
            | Preset::GptOss120bShape
            | Preset::Lfm2_8bA1bShape
            | Preset::Qwen36_35bA3bShape
            | Preset::DeepseekV4FlashShape => 0.7,
        }
    }

    pub fn default_types(self) -> TypeScheme {
        match self {
            Preset::Tiny | Preset::TinyOdd => TypeScheme {
                experts: Some(GgmlType::Q8_0),
                ..TypeScheme::pure(GgmlType::F32)
            },
            Preset::Small
            | Preset::Qwen3_30bA3bShape
            | Preset::Qwen15MoeA27bShape
            | Preset::DeepseekV2LiteShape
            | Preset::DeepseekV2LiteQwen2moeStandIn
            | Preset::Moonlight16bA3bShape
            | Preset::DeepseekV2Shape
            | Preset::Mixtral8x7bShape
            | Preset::Mixtral8x7bQwen3moeStandIn
            | Preset::Gemma4_26bA4bShape
            | Preset::Lfm2_8bA1bShape
            | Preset::Qwen36_35bA3bShape => TypeScheme::q4_k_m(),
            // As the published files: MXFP4 experts, Q8_0 elsewhere (DeepSeek-V4-Flash's
            // converter writes its dense weights Q8_0 or BF16 beside the MXFP4 experts).
            Preset::GptOss20bShape | Preset::GptOss120bShape | Preset::DeepseekV4FlashShape => {
                TypeScheme::ftype(Ftype::MXFP4_MOE)
            }
        }
    }
}

/// How `gen` picks each weight's type.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeScheme {
    pub base: BaseTypes,
    /// `--experts-type`: the expert tensors' type whatever `base` says (fallbacks aside).
    pub experts: Option<GgmlType>,
}

/// The choice of types for the weights `llama-quantize` would quantize (norms and the router
/// stay F32).
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum BaseTypes {
    /// `llama-quantize`'s per-tensor choices for this file type, fallbacks included.
    Ftype(Ftype),
    /// One type for every weight (`llama-quantize --pure`), with its fallback for rows it
    /// cannot hold.
    Pure(GgmlType),
}

impl TypeScheme {
    /// The preset `llama-quantize` writes for `f`.
    pub fn ftype(f: Ftype) -> TypeScheme {
        TypeScheme {
            base: BaseTypes::Ftype(f),
            experts: None,
        }
    }

    /// Type `t` for every weight.
    pub fn pure(t: GgmlType) -> TypeScheme {
        TypeScheme {
            base: BaseTypes::Pure(t),
            experts: None,
        }
    }

    /// The mix `llama-quantize` writes for Q4_K_M.
    pub fn q4_k_m() -> TypeScheme {
        TypeScheme::ftype(Ftype::Q4_K_M)
    }

    /// Parse `--type`: a `llama-quantize` preset name (see [`TypeScheme::NAMES`]), or any other
    /// weight type the kernels take (`q4_k`, `q5_k`, `q3_k`, `mxfp4`) for that type everywhere.
    pub fn from_name(s: &str) -> Option<TypeScheme> {
        if let Some(f) = Ftype::from_name(s) {
            return Some(TypeScheme::ftype(f));
        }
        let t = GgmlType::from_name(s)?;
        kernels::supports_quantize(t).then(|| TypeScheme::pure(t))
    }

    /// What `--type` accepts, for help and errors.
    pub const NAMES: &'static str = "presets as llama-quantize writes them: f32, f16, bf16, q8_0, \
        q4_0, q4_1, q5_0, q5_1, q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m, \
        q6_k, iq4_nl, iq4_xs, mxfp4_moe; or one type everywhere: q4_k, q5_k, q3_k, mxfp4";

    /// The name recorded and printed (`Q4_K_M`, `Q4_K (pure)`, `F32 + Q8_0 experts`).
    pub fn label(&self) -> String {
        let base = match self.base {
            BaseTypes::Ftype(f) => f.name().to_string(),
            BaseTypes::Pure(t) if Ftype::from_name(t.name()).is_some() => t.name().to_string(),
            BaseTypes::Pure(t) => format!("{t} (pure)"),
        };
        match self.experts {
            Some(e) => format!("{base} + {e} experts"),
            None => base,
        }
    }

    /// `general.file_type` (`llama_ftype`): the preset's, or for one type everywhere (and for
    /// an expert override, which holds most of the bytes) the first preset built on it.
    fn file_type(&self) -> u32 {
        let main = match (self.experts, self.base) {
            (Some(e), _) | (None, BaseTypes::Pure(e)) => e,
            (None, BaseTypes::Ftype(f)) => return f.id(),
        };
        Ftype::all()
            .find(|f| f.default_type() == main)
            .map_or(0, Ftype::id)
    }

    /// The type for weight `w` before and after the fallback for its row length.
    fn choose(&self, w: &mix::Weight, m: &mix::Model) -> (GgmlType, GgmlType) {
        let is_expert = w.dims.len() > 2;
        if let (Some(e), true) = (self.experts, is_expert) {
            return (e, mix::fallback(e, w.dims[0]));
        }
        match self.base {
            BaseTypes::Ftype(f) => (mix::choose_before_fallback(f, w, m), mix::choose(f, w, m)),
            BaseTypes::Pure(t) => (t, mix::fallback(t, w.dims[0])),
        }
    }
}

/// Everything `gen` needs besides the output path.
#[derive(Clone, Debug)]
pub struct GenOptions {
    pub preset: Preset,
    pub shape: ModelShape,
    pub types: TypeScheme,
    pub seed: u64,
    /// Router mix of context vs token identity, in [0, 1].
    pub routing_context: f32,
    /// Gain of the router logits (sharpness of the routing softmax).
    pub router_gain: f32,
    /// Layer `i` reads the context half at `1 / (i + 1)^routing_depth` of its gain, to offset
    /// the context half's growth with depth (module doc); 0 = one gain for every layer.
    pub routing_depth: f32,
    /// q/k norm weight: small values make attention near-uniform (a running context mean).
    pub attn_sharpness: f32,
    /// Tokenizer metadata (`tokenizer.*` keys, chat template included).
    pub vocab: Vec<(String, Value)>,
    /// Worker threads for weight generation.
    pub threads: usize,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct GenReport {
    pub bytes: u64,
    pub n_tensors: usize,
    pub n_vocab: usize,
    /// Tensors whose requested type could not hold their row length, and the type used.
    pub fallbacks: Vec<(String, GgmlType, GgmlType)>,
}

#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("gen: {0}")]
    Invalid(String),
    #[error("gen: quantizing tensor '{tensor}': {source}")]
    Kernel {
        tensor: String,
        source: kernels::KernelError,
    },
}

/// The two halves of the residual stream (see the module doc).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Half {
    Token,
    Context,
}

/// How each tensor's rows are drawn.
#[derive(Copy, Clone, Debug)]
enum Fill {
    /// Uniform with standard deviation `std`, over the dims in `lo..hi` (zeros elsewhere).
    Rand {
        std: f32,
        lo: u32,
        hi: u32,
    },
    /// Rows (output dims) in one half of the residual stream are random with `std`, the
    /// rest zero: which half a matrix may write is what keeps context and token apart.
    RandRows {
        std: f32,
        half: Half,
        split: u32,
    },
    /// Router rows: token dims scaled by `tok`, context dims by `ctx`.
    Router {
        tok: f32,
        ctx: f32,
        split: u32,
    },
    Const(f32),
    /// Each row runs evenly from `lo` (first value) to `hi` (last): distinct, deterministic
    /// per-entry factors (gemma4's per-expert down scales).
    Ramp {
        lo: f32,
        hi: f32,
    },
    /// Uniform on [lo, hi) (deepseek4's hyper-connection scales, near 1).
    Uniform {
        lo: f32,
        hi: f32,
    },
    /// An I32 table: each row (one token) `dims[0]` distinct expert ids in `0..n`, at random
    /// (deepseek4's hash routing, `ffn_gate_tid2eid`).
    ExpertIds {
        n: u32,
    },
}

struct Planned {
    spec: TensorSpec,
    fill: Fill,
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A planned tensor's type: kept as given (norms, the router), or chosen by the scheme.
#[derive(Copy, Clone, Debug)]
enum Want {
    Keep(GgmlType),
    /// A weight `llama-quantize` would quantize, of this layer (`None` outside the layers).
    Weight(Option<u32>),
    /// An `attn_v` weight of layer `layer` in a file where not every layer has one
    /// (lfm2moe): llama-quantize ranks it among the file's `of` attn_v tensors.
    AttnV {
        layer: u32,
        rank: u32,
        of: u32,
    },
}

impl GenOptions {
    /// Refuse options that cannot make a working model (run again by `generate`).
    pub fn validate(&self) -> Result<(), GenError> {
        let s = &self.shape;
        let bad = |m: String| Err(GenError::Invalid(m));
        if s.n_layer == 0
            || s.n_expert == 0
            || s.d_model == 0
            || s.n_ff_exp == 0
            || s.n_head == 0
            || s.head_dim == 0
        {
            return bad(format!("every dimension must be positive: {s:?}"));
        }
        if s.n_expert_used == 0 || s.n_expert_used > s.n_expert {
            return bad(format!(
                "--top-k {} must be in 1..={} (the expert count)",
                s.n_expert_used, s.n_expert
            ));
        }
        if s.n_head_kv == 0 || !s.n_head.is_multiple_of(s.n_head_kv) {
            return bad(format!(
                "--heads {} must be a multiple of --kv-heads {}",
                s.n_head, s.n_head_kv
            ));
        }
        if !s.head_dim.is_multiple_of(2) {
            return bad(format!(
                "--head-dim {} must be even (rotary pairs)",
                s.head_dim
            ));
        }
        if !s.d_model.is_multiple_of(32)
            || !s.n_ff_exp.is_multiple_of(32)
            || !(s.n_head * s.head_dim).is_multiple_of(32)
        {
            return bad("d_model, expert FFN and heads x head_dim must be multiples of 32 (the smallest quant block)".into());
        }
        s.arch.family().validate(s).map_err(GenError::Invalid)?;
        if s.n_layer > 4096 || s.n_expert > 65535 {
            return bad("at most 4096 layers and 65535 experts".into());
        }
        // A NaN or infinite knob makes NaN weights, and a model that prints garbage.
        for (flag, v) in [
            ("--router-gain", self.router_gain),
            ("--attn-sharpness", self.attn_sharpness),
        ] {
            if !v.is_finite() {
                return bad(format!("{flag} {v} must be a finite number"));
            }
        }
        if !(0.0..=1.0).contains(&self.routing_context) {
            return bad(format!(
                "--routing-context {} must be in [0, 1]",
                self.routing_context
            ));
        }
        if !(0.0..=4.0).contains(&self.routing_depth) {
            return bad(format!(
                "--routing-depth {} must be in [0, 4]",
                self.routing_depth
            ));
        }
        Ok(())
    }

    /// Layer `layer`'s router: token dims at `(1 − R)·gain`, context dims at `R·gain·4`
    /// divided by `(layer + 1)^routing_depth` (module doc), each over √(its dims).
    fn router_fill(&self, layer: u32) -> Fill {
        let s = &self.shape;
        let split = s.d_model / 2;
        let r = self.routing_context;
        let inv = |n: u32| 1.0 / (n as f32).sqrt();
        let depth = ((layer + 1) as f32).powf(self.routing_depth);
        Fill::Router {
            tok: (1.0 - r) * self.router_gain * inv(split),
            ctx: r * self.router_gain * inv(s.d_model - split) * 4.0 / depth,
            split,
        }
    }

    fn n_vocab(&self) -> Result<u64, GenError> {
        self.vocab
            .iter()
            .find(|(k, _)| k == "tokenizer.ggml.tokens")
            .and_then(|(_, v)| v.as_array())
            .map(|a| a.len() as u64)
            .filter(|&n| n > 0)
            .ok_or_else(|| GenError::Invalid("the vocabulary has no tokenizer.ggml.tokens".into()))
    }

    fn metadata(&self) -> Result<Vec<(String, Value)>, GenError> {
        let s = &self.shape;
        let a = s.arch.name();
        let mut m: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(a.into())),
            (
                "general.name".into(),
                Value::String(format!(
                    "bmoe synthetic {} (seed {})",
                    self.preset.name(),
                    self.seed
                )),
            ),
            (
                "general.file_type".into(),
                Value::U32(self.types.file_type()),
            ),
            ("general.quantization_version".into(), Value::U32(2)),
            ("general.alignment".into(), Value::U32(32)),
        ];
        m.extend(s.arch.family().metadata(self)?);
        m.extend([
            (
                "bmoe.gen.preset".into(),
                Value::String(self.preset.name().into()),
            ),
            ("bmoe.gen.seed".into(), Value::U64(self.seed)),
            (
                "bmoe.gen.routing_context".into(),
                Value::F32(self.routing_context),
            ),
            ("bmoe.gen.router_gain".into(), Value::F32(self.router_gain)),
            (
                "bmoe.gen.routing_depth".into(),
                Value::F32(self.routing_depth),
            ),
            (
                "bmoe.gen.attn_sharpness".into(),
                Value::F32(self.attn_sharpness),
            ),
        ]);
        for (key, v) in &self.vocab {
            if !key.starts_with("tokenizer.") {
                continue;
            }
            if let Value::Array(t, items) = v {
                if items.iter().any(|x| x.value_type() != *t) {
                    return Err(GenError::Invalid(format!(
                        "vocabulary key {key}: mixed array element types"
                    )));
                }
            }
            m.push((key.clone(), v.clone()));
        }
        Ok(m)
    }

    /// The model facts llama-quantize's choices depend on.
    fn mix_model(&self) -> mix::Model {
        let s = &self.shape;
        mix::Model {
            n_layer: s.n_layer,
            n_expert: s.n_expert,
            // llama.cpp's `n_gqa()` is layer 0's: 0 where layer 0 has no KV heads (an lfm2moe
            // convolution).
            n_gqa: match (&s.lfm2, &s.bailing) {
                (Some(l), _) if !l.attends(0) => 0,
                (_, Some(b)) if !b.attends(0) => 0,
                _ => s.n_head / s.n_head_kv.max(1),
            },
            tied: s.tie_output,
        }
    }

    /// One planned tensor: its type kept, or chosen by the scheme (a fallback recorded).
    fn planned(
        &self,
        model: &mix::Model,
        name: String,
        dims: &[u64],
        want: Want,
        fill: Fill,
        fallbacks: &mut Vec<(String, GgmlType, GgmlType)>,
    ) -> Planned {
        let ty = match want {
            Want::Keep(t) => t,
            Want::Weight(_) | Want::AttnV { .. } => {
                let (layer, attn_v_rank) = match want {
                    Want::AttnV { layer, rank, of } => (Some(layer), Some((rank, of))),
                    Want::Weight(layer) => (layer, None),
                    Want::Keep(_) => (None, None),
                };
                let w = mix::Weight {
                    name: &name,
                    layer,
                    dims,
                    attn_v_rank,
                };
                let (wanted, ty) = self.types.choose(&w, model);
                if ty != wanted {
                    fallbacks.push((name.clone(), wanted, ty));
                }
                ty
            }
        };
        Planned {
            spec: TensorSpec::new(name, dims, ty),
            fill,
        }
    }

    /// Every tensor of the file, in llama.cpp's order (the family's plan).
    fn plan(
        &self,
        fallbacks: &mut Vec<(String, GgmlType, GgmlType)>,
    ) -> Result<Vec<Planned>, GenError> {
        self.shape.arch.family().plan(self, fallbacks)
    }
}

/// Rows generated per RNG stream: fixed, so the output never depends on the thread count.
const CHUNK_ROWS: u64 = 64;

fn fill_chunk(
    p: &Planned,
    seed: u64,
    chunk: u64,
    rows: std::ops::Range<u64>,
    out: &mut [u8],
) -> Result<(), GenError> {
    let ne0 = p.spec.dims[0] as usize;
    let row_bytes = p.spec.ty.row_bytes(ne0 as u64).unwrap_or(0) as usize;
    let mut rng = ChaCha8Rng::seed_from_u64(fnv1a(&[
        &seed.to_le_bytes(),
        p.spec.name.as_bytes(),
        &chunk.to_le_bytes(),
    ]));
    let mut row = vec![0f32; ne0];
    // Uniform on [-√3, √3] has unit variance and zero mean.
    let sqrt3 = 3f32.sqrt();
    // The expert ids a row draws from (a Fisher-Yates prefix of them is the row).
    let mut ids: Vec<i32> = match p.fill {
        Fill::ExpertIds { n } => (0..n as i32).collect(),
        _ => Vec::new(),
    };
    for (i, r) in rows.enumerate() {
        match p.fill {
            Fill::ExpertIds { .. } => {
                let dst = &mut out[i * row_bytes..(i + 1) * row_bytes];
                if p.spec.ty != GgmlType::I32 || ne0 > ids.len() {
                    return Err(GenError::Invalid(format!(
                        "{}: {ne0} distinct expert ids of {} in a {} tensor",
                        p.spec.name,
                        ids.len(),
                        p.spec.ty
                    )));
                }
                for j in 0..ne0 {
                    let pick = rng.gen_range(j..ids.len());
                    ids.swap(j, pick);
                    dst[j * 4..(j + 1) * 4].copy_from_slice(&ids[j].to_le_bytes());
                }
                continue;
            }
            Fill::Uniform { lo, hi } => {
                for x in row.iter_mut() {
                    *x = rng.gen_range(lo..hi);
                }
            }
            Fill::Const(c) => row.iter_mut().for_each(|x| *x = c),
            Fill::Ramp { lo, hi } => {
                let steps = (ne0.max(2) - 1) as f32;
                for (j, x) in row.iter_mut().enumerate() {
                    *x = lo + (hi - lo) * j as f32 / steps;
                }
            }
            Fill::Rand { std, lo, hi } => {
                for (j, x) in row.iter_mut().enumerate() {
                    *x = if (j as u32) >= lo && (j as u32) < hi {
                        std * sqrt3 * rng.gen_range(-1.0f32..1.0)
                    } else {
                        0.0
                    };
                }
            }
            Fill::RandRows { std, half, split } => {
                let out_dim = (r % (p.spec.dims[1])) as u32;
                let live = (out_dim < split) == (half == Half::Token);
                for x in row.iter_mut() {
                    *x = if live {
                        std * sqrt3 * rng.gen_range(-1.0f32..1.0)
                    } else {
                        0.0
                    };
                }
            }
            Fill::Router { tok, ctx, split } => {
                for (j, x) in row.iter_mut().enumerate() {
                    let g = if (j as u32) < split { tok } else { ctx };
                    *x = g * sqrt3 * rng.gen_range(-1.0f32..1.0);
                }
            }
        }
        kernels::quantize_row(
            p.spec.ty,
            &row,
            &mut out[i * row_bytes..(i + 1) * row_bytes],
        )
        .map_err(|e| GenError::Kernel {
            tensor: p.spec.name.clone(),
            source: e,
        })?;
    }
    Ok(())
}

fn tensor_bytes(p: &Planned, seed: u64, threads: usize) -> Result<Vec<u8>, GenError> {
    let n_rows: u64 = p.spec.dims[1..].iter().product();
    let row_bytes = p.spec.ty.row_bytes(p.spec.dims[0]).unwrap_or(0) as usize;
    let mut data = vec![0u8; row_bytes * n_rows as usize];
    let n_chunks = n_rows.div_ceil(CHUNK_ROWS);
    let next = AtomicUsize::new(0);
    let chunks: Vec<&mut [u8]> = data.chunks_mut(row_bytes * CHUNK_ROWS as usize).collect();
    let slots: Vec<std::sync::Mutex<Option<&mut [u8]>>> = chunks
        .into_iter()
        .map(|c| std::sync::Mutex::new(Some(c)))
        .collect();
    let result: Result<(), GenError> = std::thread::scope(|sc| {
        let workers: Vec<_> = (0..threads.max(1).min(n_chunks as usize))
            .map(|_| {
                sc.spawn(|| -> Result<(), GenError> {
                    loop {
                        let c = next.fetch_add(1, Ordering::Relaxed);
                        if c as u64 >= n_chunks {
                            return Ok(());
                        }
                        let buf = slots[c]
                            .lock()
                            .map_err(|_| GenError::Invalid("worker poisoned".into()))?
                            .take();
                        if let Some(buf) = buf {
                            let lo = c as u64 * CHUNK_ROWS;
                            let hi = (lo + CHUNK_ROWS).min(n_rows);
                            fill_chunk(p, seed, c as u64, lo..hi, buf)?;
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| GenError::Invalid("generator thread panicked".into()))??;
        }
        Ok(())
    });
    result?;
    Ok(data)
}

/// Write the model to `path`. `progress(done_bytes, total_bytes)` is called after each tensor.
pub fn generate(
    opts: &GenOptions,
    path: &Path,
    mut progress: impl FnMut(u64, u64),
) -> Result<GenReport, GenError> {
    opts.validate()?;
    let mut fallbacks = Vec::new();
    let plan = opts.plan(&mut fallbacks)?;
    let meta = opts.metadata()?;
    let total: u64 = plan.iter().map(|p| p.spec.n_bytes().unwrap_or(0)).sum();
    let mut w = GgufWriter::create(path, &meta, plan.iter().map(|p| p.spec.clone()).collect())?;
    let mut done = 0;
    for p in &plan {
        let data = tensor_bytes(p, opts.seed, opts.threads)?;
        w.write_tensor(&data)?;
        done += data.len() as u64;
        progress(done, total);
    }
    let bytes = w.finish()?;
    Ok(GenReport {
        bytes,
        n_tensors: plan.len(),
        n_vocab: opts.n_vocab()? as usize,
        fallbacks,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gguf::ValueType;

    /// Options of a test model: `preset` in `types`, seed 1, a 300-token vocabulary, one thread.
    pub(crate) fn options(preset: Preset, types: TypeScheme) -> GenOptions {
        let tokens = (0..300).map(|i| Value::String(format!("t{i}"))).collect();
        GenOptions {
            preset,
            shape: preset.shape(),
            types,
            seed: 1,
            routing_context: 0.5,
            router_gain: 6.0,
            routing_depth: ROUTING_DEPTH_DEFAULT,
            attn_sharpness: 0.5,
            vocab: vec![(
                "tokenizer.ggml.tokens".into(),
                Value::Array(ValueType::String, tokens),
            )],
            threads: 1,
        }
    }

    /// Layer i's router reads the context half at 1/(i+1)^routing_depth of layer 0's gain and
    /// the token half at the same gain as layer 0; depth 0 gives every layer layer 0's gains.
    #[test]
    fn router_context_gain_falls_with_depth() {
        let mut o = options(Preset::Small, TypeScheme::from_name("q8_0").unwrap());
        let gains = |o: &GenOptions, layer| match o.router_fill(layer) {
            Fill::Router { tok, ctx, split } => (tok, ctx, split),
            other => panic!("{other:?}"),
        };
        let (tok0, ctx0, split) = gains(&o, 0);
        assert_eq!(split, o.shape.d_model / 2);
        for layer in [1u32, 3, 11, 47] {
            let (tok, ctx, _) = gains(&o, layer);
            assert_eq!(tok, tok0, "layer {layer}");
            let want = ctx0 / ((layer + 1) as f32).powf(0.75);
            assert!(
                (ctx - want).abs() <= want * 1e-6,
                "layer {layer}: {ctx} vs {want}"
            );
        }
        o.routing_depth = 0.0;
        assert_eq!(gains(&o, 47), gains(&o, 0));
        // The plan uses it: the routers of two layers differ only by the context gain.
        let plan = o.plan(&mut Vec::new()).unwrap();
        let router = |i: u32| {
            let name = format!("blk.{i}.ffn_gate_inp.weight");
            plan.iter().find(|p| p.spec.name == name).unwrap().fill
        };
        assert!(matches!(router(5), Fill::Router { ctx, .. } if ctx == ctx0));
        o.routing_depth = 4.5;
        assert!(o.validate().is_err(), "routing_depth above 4 is refused");
    }

    /// Every preset and every `--type` plans a file whose every tensor has a type the kernels
    /// take (fallbacks included), and the plan follows the mix's rules.
    #[test]
    fn every_type_plans_loadable_tensors() {
        let names = TypeScheme::NAMES
            .split([':', ';', ','])
            .map(|n| n.trim().trim_start_matches("or one type everywhere").trim())
            .filter(|n| !n.is_empty() && !n.contains(' '));
        let names: Vec<&str> = names.collect();
        assert!(names.len() >= 24, "{names:?}");
        for preset in [Preset::Tiny, Preset::TinyOdd] {
            for name in &names {
                let types = TypeScheme::from_name(name).unwrap_or_else(|| panic!("{name}"));
                let opts = options(preset, types);
                let mut fallbacks = Vec::new();
                let plan = opts.plan(&mut fallbacks).unwrap();
                for p in &plan {
                    assert!(
                        kernels::supports_dot(p.spec.ty),
                        "{preset:?} {name}: {} is {}",
                        p.spec.name,
                        p.spec.ty
                    );
                    assert!(p.spec.ty.row_bytes(p.spec.dims[0]).is_some());
                }
                for (t, want, got) in &fallbacks {
                    assert_ne!(want, got, "{t}");
                }
            }
        }
    }

    /// Every preset, as it stands (for its own architecture; the generic sizes for each), makes
    /// options `validate` accepts and a plan: no preset is refused before its first tensor.
    #[test]
    fn every_preset_validates_and_plans() {
        for &preset in Preset::ALL {
            let archs: Vec<GenArch> = match preset.arch() {
                Some(a) => vec![a],
                None => GenArch::NAMES
                    .iter()
                    .map(|n| GenArch::from_name(n).unwrap())
                    .collect(),
            };
            for arch in archs {
                let mut opts = options(preset, TypeScheme::pure(GgmlType::F32));
                opts.shape = preset.shape_for(arch).unwrap();
                opts.validate()
                    .unwrap_or_else(|e| panic!("{} {}: {e}", preset.name(), arch.name()));
                opts.plan(&mut Vec::new())
                    .unwrap_or_else(|e| panic!("{} {}: {e}", preset.name(), arch.name()));
            }
        }
    }

    #[test]
    fn tiny_odd_has_no_row_a_multiple_of_256() {
        let opts = options(Preset::TinyOdd, TypeScheme::q4_k_m());
        let mut fallbacks = Vec::new();
        let plan = opts.plan(&mut fallbacks).unwrap();
        for p in plan.iter().filter(|p| p.spec.dims.len() > 1) {
            assert_ne!(p.spec.dims[0] % 256, 0, "{}", p.spec.name);
            assert!(
                !matches!(p.spec.ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K),
                "{} is {}",
                p.spec.name,
                p.spec.ty
            );
        }
        // The stand-ins llama-quantize uses: Q5_0 for Q4_K, Q8_0 for Q6_K.
        let ty = |n: &str| plan.iter().find(|p| p.spec.name == n).unwrap().spec.ty;
        assert_eq!(ty("blk.1.ffn_gate_exps.weight"), GgmlType::Q5_0);
        assert_eq!(ty("blk.0.ffn_down_exps.weight"), GgmlType::Q5_0);
        assert_eq!(ty("blk.2.ffn_down_exps.weight"), GgmlType::Q8_0);
        assert_eq!(ty("output.weight"), GgmlType::Q8_0);
        assert!(!fallbacks.is_empty());
    }

    #[test]
    fn qwen2moe_plans_its_shared_expert_and_biases_and_no_qk_norms() {
        let mut opts = options(Preset::Tiny, TypeScheme::pure(GgmlType::F32));
        opts.shape = Preset::Tiny.shape_for(GenArch::Qwen2Moe).unwrap();
        opts.validate().unwrap();
        let plan = opts.plan(&mut Vec::new()).unwrap();
        let dims = |n: &str| {
            plan.iter()
                .find(|p| p.spec.name == n)
                .map(|p| p.spec.dims.clone())
        };
        assert_eq!(dims("blk.0.ffn_gate_inp_shexp.weight"), Some(vec![256]));
        assert_eq!(dims("blk.3.ffn_down_shexp.weight"), Some(vec![512, 256]));
        assert_eq!(dims("blk.1.attn_k.bias"), Some(vec![128]));
        assert_eq!(dims("blk.0.attn_q_norm.weight"), None);
        let meta = opts.metadata().unwrap();
        let key = |k: &str| meta.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(
            key("general.architecture"),
            Some(Value::String("qwen2moe".into()))
        );
        assert_eq!(
            key("qwen2moe.expert_shared_feed_forward_length"),
            Some(Value::U32(512))
        );
        // A full shape of another family, a qwen3moe shared expert, a tied qwen2moe head: no.
        assert!(Preset::Qwen3_30bA3bShape
            .shape_for(GenArch::Qwen2Moe)
            .is_err());
        let mut bad = options(Preset::Tiny, TypeScheme::pure(GgmlType::F32));
        bad.shape.n_ff_shexp = 64;
        assert!(bad.validate().is_err());
        opts.shape.tie_output = true;
        assert!(opts.validate().is_err());
    }

    #[test]
    fn gemma4_plans_its_mlp_experts_and_layer_pattern() {
        let mut opts = options(Preset::Tiny, TypeScheme::pure(GgmlType::F32));
        opts.shape = Preset::Tiny.shape_for(GenArch::Gemma4).unwrap();
        opts.validate().unwrap();
        let plan = opts.plan(&mut Vec::new()).unwrap();
        let dims = |n: &str| {
            plan.iter()
                .find(|p| p.spec.name == n)
                .map(|p| p.spec.dims.clone())
        };
        // Layer 0 is dense-only; layer 1 is global (heads of 128, one KV head).
        assert_eq!(dims("blk.0.ffn_gate_inp.weight"), None);
        assert_eq!(dims("blk.0.ffn_down.weight"), Some(vec![512, 256]));
        assert_eq!(dims("blk.1.attn_k.weight"), Some(vec![256, 128]));
        assert_eq!(dims("blk.2.attn_k.weight"), Some(vec![256, 128]));
        assert_eq!(dims("blk.1.attn_q.weight"), Some(vec![256, 512]));
        assert_eq!(
            dims("blk.1.ffn_gate_up_exps.weight"),
            Some(vec![256, 768, 16])
        );
        assert_eq!(dims("blk.1.ffn_down_exps.scale"), Some(vec![16]));
        assert_eq!(dims("rope_freqs.weight"), Some(vec![64]));
        let mut bad = opts.clone();
        bad.shape.gemma.as_mut().unwrap().dense_layers = 4;
        assert!(bad.validate().is_err(), "no MoE layer left");
        assert!(Preset::Gemma4_26bA4bShape
            .shape_for(GenArch::Qwen3Moe)
            .is_err());
    }

    /// The full-shape preset states what the real Gemma-4-26B-A4B GGUF states: every
    /// `gemma4.*` key of llama.cpp's gemma-4 vocabulary file (converted from the real model)
    /// has the same value in ours.
    #[test]
    fn gemma_4_26b_a4b_shape_matches_the_real_file() {
        let Some(path) = crate::testdata::shared_path("data/vocab/ggml-vocab-gemma-4.gguf") else {
            return;
        };
        let real = crate::gguf::GgufFile::open(&path).unwrap();
        let mut opts = options(Preset::Gemma4_26bA4bShape, TypeScheme::q4_k_m());
        opts.shape = Preset::Gemma4_26bA4bShape.shape();
        opts.validate().unwrap();
        let ours = opts.metadata().unwrap();
        let mut n = 0;
        for (k, v) in real.metadata() {
            if !k.starts_with("gemma4.") {
                continue;
            }
            let mine = ours
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v)
                .unwrap_or_else(|| panic!("{k} missing from ours"));
            let same = match (mine.as_array(), v.as_array()) {
                (Some(a), Some(b)) => {
                    a.len() == b.len()
                        && a.iter()
                            .zip(b)
                            .all(|(x, y)| x.as_u64() == y.as_u64() && x.as_bool() == y.as_bool())
                }
                _ => match (mine.as_f64(), v.as_f64()) {
                    (Some(x), Some(y)) => (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                    _ => mine == v,
                },
            };
            assert!(same, "{k}: ours {mine:?}, the real file {v:?}");
            n += 1;
        }
        assert!(n >= 20, "only {n} gemma4 keys compared");
    }

    #[test]
    fn gen_writes_every_architecture_the_engine_runs() {
        for e in crate::arch::REGISTRY {
            let a = GenArch::from_name(e.name).unwrap_or_else(|| panic!("{}", e.name));
            assert_eq!(a.name(), e.name);
            assert!(a.presets().contains(&"tiny"), "{}", e.name);
        }
        assert_eq!(
            GenArch::Qwen2Moe.presets(),
            [
                "tiny",
                "tiny-odd",
                "small",
                "qwen1.5-moe-a2.7b-shape",
                "deepseek-v2-lite-qwen2moe-stand-in"
            ]
        );
        assert_eq!(
            GenArch::Gemma4.presets(),
            ["tiny", "tiny-odd", "small", "gemma-4-26b-a4b-shape"]
        );
    }

    #[test]
    fn labels_and_file_types() {
        let t = |s: &str| TypeScheme::from_name(s).unwrap();
        assert_eq!(t("q4_k_m").label(), "Q4_K_M");
        assert_eq!(t("Q4_K_M").file_type(), 15);
        assert_eq!(t("q4_k").label(), "Q4_K (pure)");
        assert_eq!(t("q4_k").file_type(), 14);
        assert_eq!(t("iq4_xs").file_type(), 30);
        assert_eq!(Preset::Tiny.default_types().label(), "F32 + Q8_0 experts");
        assert_eq!(Preset::Tiny.default_types().file_type(), 7);
        assert!(TypeScheme::from_name("q8_k").is_none());
        assert!(TypeScheme::from_name("q4_k_x").is_none());
    }
}
