//! llama-quantize's per-tensor type choices, so that `gen --type Q4_K_M` (or any of its K-quant,
//! legacy and IQ4 presets) writes the mix a file made by `llama-quantize` has: which tensors get
//! more bits, on which layers, and which 32-value type stands in where a row length is not a
//! multiple of 256.
//!
//! The facts follow llama.cpp's `src/llama-quant.cpp` (`llama_tensor_get_type_impl`,
//! `tensor_type_fallback`, `llama_ftype_get_default_type`) as vendored by llama-cpp-python
//! 0.3.36, for the tensors a `qwen3moe` file has, without an importance matrix (what
//! `llama_model_quantize` does by default). The parity gate checks it: a file `llama-quantize`
//! writes from our F32 model has, tensor by tensor, the types `gen` writes for the same preset.

use crate::gguf::GgmlType;

/// A llama-quantize file type (`llama_ftype`): a preset `gen --type` writes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum Ftype {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K_S,
    Q3_K_M,
    Q3_K_L,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    MXFP4_MOE,
}

/// (file type, name, `llama_ftype` id, its default tensor type).
const FTYPES: &[(Ftype, &str, u32, GgmlType)] = &[
    (Ftype::F32, "F32", 0, GgmlType::F32),
    (Ftype::F16, "F16", 1, GgmlType::F16),
    (Ftype::BF16, "BF16", 32, GgmlType::BF16),
    (Ftype::Q4_0, "Q4_0", 2, GgmlType::Q4_0),
    (Ftype::Q4_1, "Q4_1", 3, GgmlType::Q4_1),
    (Ftype::Q5_0, "Q5_0", 8, GgmlType::Q5_0),
    (Ftype::Q5_1, "Q5_1", 9, GgmlType::Q5_1),
    (Ftype::Q8_0, "Q8_0", 7, GgmlType::Q8_0),
    (Ftype::Q2_K, "Q2_K", 10, GgmlType::Q2_K),
    (Ftype::Q3_K_S, "Q3_K_S", 11, GgmlType::Q3_K),
    (Ftype::Q3_K_M, "Q3_K_M", 12, GgmlType::Q3_K),
    (Ftype::Q3_K_L, "Q3_K_L", 13, GgmlType::Q3_K),
    (Ftype::Q4_K_S, "Q4_K_S", 14, GgmlType::Q4_K),
    (Ftype::Q4_K_M, "Q4_K_M", 15, GgmlType::Q4_K),
    (Ftype::Q5_K_S, "Q5_K_S", 16, GgmlType::Q5_K),
    (Ftype::Q5_K_M, "Q5_K_M", 17, GgmlType::Q5_K),
    (Ftype::Q6_K, "Q6_K", 18, GgmlType::Q6_K),
    (Ftype::IQ4_NL, "IQ4_NL", 25, GgmlType::IQ4_NL),
    (Ftype::IQ4_XS, "IQ4_XS", 30, GgmlType::IQ4_XS),
    (Ftype::MXFP4_MOE, "MXFP4_MOE", 38, GgmlType::MXFP4),
];

impl Ftype {
    fn row(self) -> &'static (Ftype, &'static str, u32, GgmlType) {
        // Every variant has a row (a test checks it).
        FTYPES.iter().find(|r| r.0 == self).unwrap_or(&FTYPES[0])
    }

    /// Every file type, in a fixed order.
    pub fn all() -> impl Iterator<Item = Ftype> {
        FTYPES.iter().map(|r| r.0)
    }

    /// Its name as llama-quantize spells it (`Q4_K_M`), case-insensitive.
    pub fn from_name(s: &str) -> Option<Ftype> {
        FTYPES
            .iter()
            .find(|r| r.1.eq_ignore_ascii_case(s))
            .map(|r| r.0)
    }

    pub fn name(self) -> &'static str {
        self.row().1
    }

    /// The `llama_ftype` number (`general.file_type`).
    pub fn id(self) -> u32 {
        self.row().2
    }

    /// The type of every weight the preset does not single out.
    pub fn default_type(self) -> GgmlType {
        self.row().3
    }
}

/// What llama-quantize calls a tensor, from its name.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    Output,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        Category::Output
    } else if name == "token_embd.weight" {
        Category::TokenEmbd
    } else if name.contains("attn_v.weight") || name.contains("attn_qkv.weight") {
        // llama-quantize treats a fused qkv as attention-v-like (qwen35moe's DeltaNet layers).
        Category::AttnV
    } else if name.contains("attn_k.weight") {
        Category::AttnK
    } else if name.contains("attn_q.weight") {
        Category::AttnQ
    } else if name.contains("attn_output.weight") {
        Category::AttnOutput
    } else if name.contains("ffn_up") {
        Category::FfnUp
    } else if name.contains("ffn_gate") {
        Category::FfnGate
    } else if name.contains("ffn_down") {
        Category::FfnDown
    } else {
        Category::Other
    }
}

/// The model facts the choices depend on.
#[derive(Copy, Clone, Debug)]
pub struct Model {
    pub n_layer: u32,
    pub n_expert: u32,
    /// Query heads per key/value head.
    pub n_gqa: u32,
    /// No `output.weight`: the token embedding is the head (and quantized like it).
    pub tied: bool,
}

/// One weight llama-quantize would quantize: 2-D or 3-D, named `*.weight`, not a norm, not
/// the router (`ffn_gate_inp`): those keep their type.
#[derive(Copy, Clone, Debug)]
pub struct Weight<'a> {
    pub name: &'a str,
    /// `blk.{layer}.` of the name.
    pub layer: Option<u32>,
    /// GGUF dims, `dims[0]` the row length.
    pub dims: &'a [u64],
    /// An `attn_v` weight in a file where only some layers attend (lfm2moe): its rank among
    /// the file's attn_v tensors and their count, which llama-quantize's choice reads in
    /// place of the layer and the layer count.
    pub attn_v_rank: Option<(u32, u32)>,
}

/// llama-quantize's `use_more_bits`: the layers its mixes give more bits (the first and last
/// eighth, and every third in between).
pub fn use_more_bits(i: u32, n: u32) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i.wrapping_sub(n / 8)) % 3 == 2
}

/// The type `llama-quantize` writes for `w` in a file of type `ftype` (no importance matrix),
/// fallback included.
pub fn choose(ftype: Ftype, w: &Weight, m: &Model) -> GgmlType {
    fallback(choose_before_fallback(ftype, w, m), w.dims[0])
}

/// [`choose`] before [`fallback`]: the type the preset asks for.
pub fn choose_before_fallback(ftype: Ftype, w: &Weight, m: &Model) -> GgmlType {
    let base = ftype.default_type();
    // Float presets quantize nothing: every weight takes the preset's type.
    if matches!(ftype, Ftype::F32 | Ftype::F16 | Ftype::BF16) {
        return base;
    }
    preset_choice(ftype, base, w, m)
}

/// `llama_tensor_get_type_impl` for the tensors of a MoE file, before the fallback.
fn preset_choice(ftype: Ftype, base: GgmlType, w: &Weight, m: &Model) -> GgmlType {
    use Ftype as F;
    use GgmlType as T;
    let cat = category(w.name);
    let layer = w.layer.unwrap_or(0);
    let n_layer = m.n_layer.max(1);
    if cat == Category::Output || (m.tied && cat == Category::TokenEmbd) {
        return if ftype == F::MXFP4_MOE || !w.dims[0].is_multiple_of(base.block_size()) {
            T::Q8_0
        } else if base != T::Q8_0 {
            T::Q6_K
        } else {
            base
        };
    }
    if ftype == F::MXFP4_MOE {
        // Expert tensors MXFP4, everything else Q8_0.
        return if w.dims.get(2).copied().unwrap_or(1) > 1 {
            T::MXFP4
        } else {
            T::Q8_0
        };
    }
    match cat {
        Category::AttnV => {
            // llama-quantize counts attn_v tensors in file order: one per layer, or as the
            // file ranks them where only some layers attend.
            let (i, n_layer) = w.attn_v_rank.unwrap_or((layer, n_layer));
            let mut t = match ftype {
                F::Q2_K if m.n_gqa >= 4 => T::Q4_K,
                F::Q2_K => T::Q3_K,
                F::Q3_K_M if i < 2 => T::Q5_K,
                F::Q3_K_M => T::Q4_K,
                F::Q3_K_L => T::Q5_K,
                F::IQ4_NL | F::IQ4_XS if m.n_gqa >= 4 => T::Q5_K,
                F::Q4_K_M | F::Q5_K_M if use_more_bits(i, n_layer) => T::Q6_K,
                F::Q4_K_S if i < 4 => T::Q5_K,
                _ => base,
            };
            if m.n_expert == 8 {
                t = T::Q8_0;
            }
            t
        }
        Category::AttnK if m.n_expert == 8 => T::Q8_0,
        Category::FfnDown => match ftype {
            F::Q2_K => T::Q3_K,
            F::Q3_K_M if layer < n_layer / 16 => T::Q5_K,
            F::Q3_K_M => T::Q4_K,
            F::Q3_K_L => T::Q5_K,
            F::Q4_K_M if use_more_bits(layer, n_layer) => T::Q6_K,
            F::IQ4_NL | F::IQ4_XS if layer < n_layer / 8 => T::Q5_K,
            F::Q5_K_M if use_more_bits(layer, n_layer) => T::Q6_K,
            F::Q4_K_S if layer < n_layer / 8 => T::Q5_K,
            _ => base,
        },
        Category::AttnOutput => {
            if m.n_expert == 8 {
                match ftype {
                    F::Q2_K
                    | F::Q3_K_S
                    | F::Q3_K_M
                    | F::IQ4_NL
                    | F::Q4_K_S
                    | F::Q4_K_M
                    | F::IQ4_XS => T::Q5_K,
                    _ => base,
                }
            } else {
                match ftype {
                    F::Q2_K => T::Q3_K,
                    F::Q3_K_M => T::Q4_K,
                    F::Q3_K_L => T::Q5_K,
                    _ => base,
                }
            }
        }
        _ => base,
    }
}

/// `tensor_type_fallback`: the type that stands in when rows of `n_cols` values are not whole
/// blocks of `ty` — the 32-value type of about the same size — and F16 when even that does not
/// fit.
pub fn fallback(ty: GgmlType, n_cols: u64) -> GgmlType {
    use GgmlType as T;
    if n_cols.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let stand_in = match ty {
        T::IQ1_S
        | T::IQ1_M
        | T::IQ2_XXS
        | T::IQ2_XS
        | T::IQ2_S
        | T::IQ3_XXS
        | T::IQ3_S
        | T::IQ4_XS => T::IQ4_NL,
        T::Q2_K | T::Q3_K | T::TQ1_0 | T::TQ2_0 => T::Q4_0,
        T::Q4_K => T::Q5_0,
        T::Q5_K => T::Q5_1,
        T::Q6_K => T::Q8_0,
        other => other,
    };
    if n_cols.is_multiple_of(stand_in.block_size()) {
        stand_in
    } else {
        T::F16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_ftype_has_a_row_and_a_name() {
        for f in Ftype::all() {
            assert_eq!(f.row().0, f);
            assert_eq!(Ftype::from_name(f.name()), Some(f));
            assert_eq!(Ftype::from_name(&f.name().to_lowercase()), Some(f));
        }
        assert_eq!(Ftype::all().count(), 20);
        assert_eq!(Ftype::Q4_K_M.id(), 15);
        assert_eq!(Ftype::from_name("q4_k"), None);
    }

    #[test]
    fn more_bits_covers_about_half_of_48_layers() {
        let n = (0..48).filter(|&i| use_more_bits(i, 48)).count();
        assert!((20..=28).contains(&n), "{n}");
        // 4 layers: the first eighth is empty, the last eighth is layer 3, and layer 2 is
        // "every third" (2 − 0 ≡ 2 mod 3).
        assert_eq!(
            (0..4).map(|i| use_more_bits(i, 4)).collect::<Vec<_>>(),
            [false, false, true, true]
        );
    }

    #[test]
    fn fallbacks_are_llama_quantize_s() {
        use GgmlType as T;
        assert_eq!(fallback(T::Q4_K, 384), T::Q5_0);
        assert_eq!(fallback(T::Q4_K, 512), T::Q4_K);
        assert_eq!(fallback(T::Q5_K, 2880), T::Q5_1);
        assert_eq!(fallback(T::Q6_K, 2880), T::Q8_0);
        assert_eq!(fallback(T::Q2_K, 160), T::Q4_0);
        assert_eq!(fallback(T::Q3_K, 160), T::Q4_0);
        assert_eq!(fallback(T::IQ4_XS, 160), T::IQ4_NL);
        assert_eq!(fallback(T::Q8_0, 48), T::F16);
        assert_eq!(fallback(T::Q4_K, 48), T::F16);
        assert_eq!(fallback(T::F32, 7), T::F32);
    }

    fn w<'a>(name: &'a str, layer: u32, dims: &'a [u64]) -> Weight<'a> {
        Weight {
            name,
            layer: Some(layer),
            dims,
            attn_v_rank: None,
        }
    }

    /// A few choices read off llama-quant.cpp for a 48-layer, 128-expert, GQA-8 model (the
    /// 30B-A3B shape) in Q4_K_M; the parity gate checks whole files against llama-quantize.
    #[test]
    fn q4_k_m_of_a_moe_model() {
        use GgmlType as T;
        let m = Model {
            n_layer: 48,
            n_expert: 128,
            n_gqa: 8,
            tied: false,
        };
        let f = Ftype::Q4_K_M;
        let dense = [2048u64, 4096];
        let exps = [768u64, 2048, 128];
        assert_eq!(choose(f, &w("output.weight", 0, &dense), &m), T::Q6_K);
        assert_eq!(choose(f, &w("token_embd.weight", 0, &dense), &m), T::Q4_K);
        assert_eq!(choose(f, &w("blk.0.attn_v.weight", 0, &dense), &m), T::Q6_K);
        assert_eq!(choose(f, &w("blk.7.attn_v.weight", 7, &dense), &m), T::Q4_K);
        assert_eq!(choose(f, &w("blk.0.attn_k.weight", 0, &dense), &m), T::Q4_K);
        assert_eq!(
            choose(f, &w("blk.3.attn_output.weight", 3, &dense), &m),
            T::Q4_K
        );
        assert_eq!(
            choose(f, &w("blk.0.ffn_down_exps.weight", 0, &exps), &m),
            T::Q6_K
        );
        assert_eq!(
            choose(f, &w("blk.7.ffn_down_exps.weight", 7, &exps), &m),
            T::Q4_K
        );
        assert_eq!(
            choose(
                f,
                &w("blk.7.ffn_gate_exps.weight", 7, &[2048, 768, 128]),
                &m
            ),
            T::Q4_K
        );
        // A row length off 256: Q4_K's stand-in is Q5_0, Q6_K's is Q8_0.
        let odd = [1408u64, 2048, 64];
        assert_eq!(
            choose(f, &w("blk.0.ffn_down_exps.weight", 0, &odd), &m),
            T::Q8_0
        );
        assert_eq!(
            choose(f, &w("blk.7.ffn_down_exps.weight", 7, &odd), &m),
            T::Q5_0
        );
        // Tied: the embedding is the head.
        let tied = Model { tied: true, ..m };
        assert_eq!(
            choose(f, &w("token_embd.weight", 0, &dense), &tied),
            T::Q6_K
        );
        // Mixtral-like (8 experts): attention K/V to Q8_0, output projection Q5_K.
        let eight = Model { n_expert: 8, ..m };
        assert_eq!(
            choose(f, &w("blk.9.attn_v.weight", 9, &dense), &eight),
            T::Q8_0
        );
        assert_eq!(
            choose(f, &w("blk.9.attn_k.weight", 9, &dense), &eight),
            T::Q8_0
        );
        assert_eq!(
            choose(f, &w("blk.9.attn_output.weight", 9, &dense), &eight),
            T::Q5_K
        );
    }

    #[test]
    fn small_presets_single_out_their_tensors() {
        use GgmlType as T;
        let m = Model {
            n_layer: 16,
            n_expert: 16,
            n_gqa: 2,
            tied: false,
        };
        let dense = [256u64, 256];
        let down = [256u64, 256, 16];
        let v = |f, i| choose(f, &w("blk.0.attn_v.weight", i, &dense), &m);
        let d = |f, i| choose(f, &w("blk.0.ffn_down_exps.weight", i, &down), &m);
        assert_eq!((v(Ftype::Q2_K, 0), d(Ftype::Q2_K, 5)), (T::Q3_K, T::Q3_K));
        assert_eq!(
            (v(Ftype::Q3_K_M, 1), v(Ftype::Q3_K_M, 2)),
            (T::Q5_K, T::Q4_K)
        );
        assert_eq!(
            (d(Ftype::Q3_K_M, 0), d(Ftype::Q3_K_M, 1)),
            (T::Q5_K, T::Q4_K)
        );
        assert_eq!(
            (v(Ftype::Q3_K_L, 9), d(Ftype::Q3_K_L, 9)),
            (T::Q5_K, T::Q5_K)
        );
        assert_eq!(
            (v(Ftype::Q4_K_S, 3), v(Ftype::Q4_K_S, 4)),
            (T::Q5_K, T::Q4_K)
        );
        assert_eq!(
            (d(Ftype::IQ4_XS, 1), d(Ftype::IQ4_XS, 2)),
            (T::Q5_K, T::IQ4_XS)
        );
        assert_eq!(v(Ftype::IQ4_NL, 0), T::IQ4_NL);
        assert_eq!(
            choose(Ftype::Q8_0, &w("output.weight", 0, &dense), &m),
            T::Q8_0
        );
        assert_eq!(
            choose(Ftype::Q4_0, &w("output.weight", 0, &dense), &m),
            T::Q6_K
        );
        assert_eq!(
            choose(
                Ftype::MXFP4_MOE,
                &w("blk.1.ffn_up_exps.weight", 1, &down),
                &m
            ),
            T::MXFP4
        );
        assert_eq!(
            choose(Ftype::MXFP4_MOE, &w("blk.1.attn_q.weight", 1, &dense), &m),
            T::Q8_0
        );
        assert_eq!(
            choose(Ftype::F16, &w("output.weight", 0, &dense), &m),
            T::F16
        );
    }
}
