//! Reading an architecture's hyper-parameters from GGUF metadata: `<arch>.<key>` values, scalar
//! or per layer, each checked once with the key and what was expected named in the error.

use super::blocks::Yarn;
use super::ArchError;
use crate::gguf::{GgufFile, Value};

/// The metadata of one file, read under one architecture's key prefix.
pub struct Meta<'a> {
    pub f: &'a GgufFile,
    pub arch: &'static str,
}

impl<'a> Meta<'a> {
    pub fn new(f: &'a GgufFile, arch: &'static str) -> Meta<'a> {
        Meta { f, arch }
    }

    /// `<arch>.<name>`.
    pub fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.arch)
    }

    /// An error about metadata key `<arch>.<name>`.
    pub fn err(&self, name: &str, what: impl Into<String>) -> ArchError {
        ArchError::Key {
            file: self.f.path().display().to_string(),
            key: self.key(name),
            what: what.into(),
        }
    }

    /// The value of `<arch>.<name>`, if the file has it.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.f.get(&self.key(name))
    }

    fn as_usize(&self, name: &str, v: &Value) -> Result<usize, ArchError> {
        let n = v
            .as_u64()
            .ok_or_else(|| self.err(name, format!("is {v}, expected a non-negative integer")))?;
        usize::try_from(n).map_err(|_| self.err(name, "does not fit this machine's usize"))
    }

    /// A required count. A per-layer array is accepted when every entry agrees.
    pub fn req_u(&self, name: &str) -> Result<usize, ArchError> {
        let v = self
            .get(name)
            .ok_or_else(|| self.err(name, format!("is missing (required for {})", self.arch)))?;
        if let Some(arr) = v.as_array() {
            let first = arr
                .first()
                .ok_or_else(|| self.err(name, "is an empty array"))?;
            let n = self.as_usize(name, first)?;
            if arr.iter().any(|x| x.as_u64() != first.as_u64()) {
                return Err(self.err(name, "varies per layer, which this build does not support"));
            }
            return Ok(n);
        }
        self.as_usize(name, v)
    }

    /// An optional count (`None` when absent).
    pub fn opt_u(&self, name: &str) -> Result<Option<usize>, ArchError> {
        match self.get(name) {
            None => Ok(None),
            Some(_) => self.req_u(name).map(Some),
        }
    }

    /// A count per layer: a scalar (the same for every layer) or an array of `n_layer`
    /// entries. `None` when absent.
    pub fn per_layer_u(&self, name: &str, n_layer: usize) -> Result<Option<Vec<usize>>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        match v.as_array() {
            None => Ok(Some(vec![self.as_usize(name, v)?; n_layer])),
            Some(arr) => {
                if arr.len() != n_layer {
                    return Err(self.err(
                        name,
                        format!(
                            "has {} entries, expected one per layer ({n_layer})",
                            arr.len()
                        ),
                    ));
                }
                arr.iter()
                    .map(|x| self.as_usize(name, x))
                    .collect::<Result<_, _>>()
                    .map(Some)
            }
        }
    }

    /// A flag per layer (an array of `n_layer` booleans). `None` when absent.
    pub fn per_layer_bool(
        &self,
        name: &str,
        n_layer: usize,
    ) -> Result<Option<Vec<bool>>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(name, format!("is {v}, expected an array of booleans")))?;
        if arr.len() != n_layer {
            return Err(self.err(
                name,
                format!(
                    "has {} entries, expected one per layer ({n_layer})",
                    arr.len()
                ),
            ));
        }
        arr.iter()
            .map(|x| {
                x.as_bool()
                    .ok_or_else(|| self.err(name, format!("holds {x}, expected booleans")))
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// A required number.
    pub fn req_f(&self, name: &str) -> Result<f32, ArchError> {
        let v = self
            .get(name)
            .ok_or_else(|| self.err(name, format!("is missing (required for {})", self.arch)))?;
        self.num(name, v)
    }

    /// An optional number, `default` when absent.
    pub fn opt_f(&self, name: &str, default: f32) -> Result<f32, ArchError> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => self.num(name, v),
        }
    }

    fn num(&self, name: &str, v: &Value) -> Result<f32, ArchError> {
        let x = v
            .as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| self.err(name, format!("is {v}, expected a number")))?;
        if !x.is_finite() {
            return Err(self.err(name, format!("is {x}, expected a finite number")));
        }
        Ok(x)
    }

    /// An optional flag (`None` when absent).
    pub fn opt_bool(&self, name: &str) -> Result<Option<bool>, ArchError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(name, format!("is {v}, expected a bool"))),
        }
    }

    /// An optional string.
    pub fn opt_str(&self, name: &str) -> Result<Option<&'a str>, ArchError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(name, format!("is {v}, expected a string"))),
        }
    }

    /// Refuse a value outside `lo..=hi`, naming the key.
    pub fn check_range(&self, name: &str, v: usize, lo: usize, hi: usize) -> Result<(), ArchError> {
        if v < lo || v > hi {
            return Err(self.err(name, format!("is {v}, expected {lo}..={hi}")));
        }
        Ok(())
    }
}

/// The attention hyper-parameters the llama-style families (qwen3moe, qwen2moe, gpt-oss) state
/// the same way: head counts,
/// head dim (`key_length`, defaulting to d/heads; `value_length` must agree), rotary base and
/// dimension (the whole head: partial rotary is refused), RMS epsilon.
pub(crate) struct AttnParams {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
}

pub(crate) fn attn_params(m: &Meta, d_model: usize) -> Result<AttnParams, ArchError> {
    let n_head = m.req_u("attention.head_count")?;
    if n_head == 0 || d_model == 0 {
        return Err(m.err(
            "attention.head_count",
            "embedding_length and head_count must be positive",
        ));
    }
    let n_head_kv = m.opt_u("attention.head_count_kv")?.unwrap_or(n_head);
    if n_head_kv == 0 || n_head % n_head_kv != 0 {
        return Err(m.err(
            "attention.head_count_kv",
            format!("{n_head_kv} must divide head_count {n_head}"),
        ));
    }
    let head_dim = m.opt_u("attention.key_length")?.unwrap_or(d_model / n_head);
    let v_dim = m.opt_u("attention.value_length")?.unwrap_or(head_dim);
    if v_dim != head_dim {
        return Err(m.err(
            "attention.value_length",
            format!("{v_dim} differs from key_length {head_dim}; unsupported"),
        ));
    }
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(m.err(
            "attention.key_length",
            format!("{head_dim} must be even and positive for rotary embedding"),
        ));
    }
    if let Some(rd) = m.opt_u("rope.dimension_count")? {
        if rd != head_dim {
            return Err(m.err(
                "rope.dimension_count",
                format!(
                    "{rd} differs from the head dim {head_dim}; partial rotary is not supported"
                ),
            ));
        }
    }
    Ok(AttnParams {
        n_head,
        n_head_kv,
        head_dim,
        rope_base: m.opt_f("rope.freq_base", 10_000.0)?,
        rms_eps: m.req_f("attention.layer_norm_rms_epsilon")?,
    })
}

/// YaRN as a file states it (`rope.scaling.type` `yarn`: factor, original context — the
/// trained one when absent — betas and magnitude), `None` for no scaling; any other scaling
/// type is refused by key, naming `arch`'s supported ones.
pub(crate) fn yarn_params(m: &Meta, n_ctx_train: usize) -> Result<Option<Yarn>, ArchError> {
    match m.opt_str("rope.scaling.type")? {
        None | Some("none") => Ok(None),
        Some("yarn") => {
            let factor = m.opt_f("rope.scaling.factor", 1.0)?;
            if factor <= 0.0 {
                return Err(m.err(
                    "rope.scaling.factor",
                    format!("is {factor}, expected a positive factor"),
                ));
            }
            Ok(Some(Yarn {
                factor,
                n_ctx_orig: m
                    .opt_u("rope.scaling.original_context_length")?
                    .unwrap_or(n_ctx_train),
                beta_fast: m.opt_f("rope.scaling.yarn_beta_fast", 32.0)?,
                beta_slow: m.opt_f("rope.scaling.yarn_beta_slow", 1.0)?,
                attn_factor: m.opt_f("rope.scaling.attn_factor", 1.0)?,
            }))
        }
        Some(other) => Err(m.err(
            "rope.scaling.type",
            format!(
                "is '{other}'; this build runs {} with 'yarn' or 'none'",
                m.arch
            ),
        )),
    }
}

/// The MoE counts: `expert_count` (a MoE model has at least one), `expert_used_count` in
/// `1..=expert_count`, the expert FFN width (`expert_feed_forward_length`, or
/// `feed_forward_length / expert_used_count` as older files state it).
pub(crate) fn moe_params(m: &Meta) -> Result<(usize, usize, usize), ArchError> {
    let n_expert = m.req_u("expert_count")?;
    let n_expert_used = m.req_u("expert_used_count")?;
    if n_expert == 0 {
        return Err(ArchError::NotMoe {
            file: m.f.path().display().to_string(),
            arch: m.arch.into(),
        });
    }
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(m.err(
            "expert_used_count",
            format!("{n_expert_used}, expected 1..={n_expert}"),
        ));
    }
    let n_ff_exp = match m.opt_u("expert_feed_forward_length")? {
        Some(n) => n,
        None => m.req_u("feed_forward_length")? / n_expert_used,
    };
    if n_ff_exp == 0 {
        return Err(m.err("expert_feed_forward_length", "is 0"));
    }
    Ok((n_expert, n_expert_used, n_ff_exp))
}

/// `leading_dense_block_count` (required, or 0 when absent) and the dense layers' FFN width
/// (`feed_forward_length`, required when there are any), with at least one MoE layer of
/// `n_layer` left (deepseek2, bailingmoe3).
pub(crate) fn leading_dense(
    m: &Meta,
    n_layer: usize,
    required: bool,
) -> Result<(usize, usize), ArchError> {
    let n_dense_lead = if required {
        m.req_u("leading_dense_block_count")?
    } else {
        m.opt_u("leading_dense_block_count")?.unwrap_or(0)
    };
    if n_dense_lead >= n_layer {
        return Err(m.err(
            "leading_dense_block_count",
            format!("is {n_dense_lead}: no MoE layer left of {n_layer}"),
        ));
    }
    let n_ff = if n_dense_lead > 0 {
        let n = m.req_u("feed_forward_length")?;
        if n == 0 {
            return Err(m.err("feed_forward_length", "is 0"));
        }
        n
    } else {
        m.opt_u("feed_forward_length")?.unwrap_or(0)
    };
    Ok((n_dense_lead, n_ff))
}

/// A per-layer SwiGLU limit list of bailingmoe3 or deepseek4: a number for every layer, or an
/// array of at least `n_layer` (the converter writes one per block, the MTP block's included);
/// absent, 0 for every layer.
pub(crate) fn swiglu_limits(m: &Meta, key: &str, n_layer: usize) -> Result<Vec<f32>, ArchError> {
    let Some(v) = m.get(key) else {
        return Ok(vec![0.0; n_layer]);
    };
    let all: Vec<f32> = match v.as_array() {
        Some(a) => a
            .iter()
            .map(|x| x.as_f64().map(|x| x as f32))
            .collect::<Option<_>>()
            .ok_or_else(|| m.err(key, "holds a value that is not a number"))?,
        None => vec![
            v.as_f64()
                .ok_or_else(|| m.err(key, format!("is {v}, expected numbers")))?
                as f32;
            n_layer
        ],
    };
    if all.len() < n_layer || all.iter().any(|x| !x.is_finite()) {
        return Err(m.err(
            key,
            format!(
                "has {} entries (finite numbers, at least one per layer: {n_layer})",
                all.len()
            ),
        ));
    }
    Ok(all[..n_layer].to_vec())
}

/// The vocabulary size, from `token_embd.weight`'s second dimension.
pub(crate) fn n_vocab(f: &GgufFile) -> Result<usize, ArchError> {
    let embd = f
        .tensor("token_embd.weight")
        .ok_or_else(|| ArchError::Tensor {
            file: f.path().display().to_string(),
            tensor: "token_embd.weight".into(),
            what: "is missing".into(),
        })?;
    Ok(embd.dims.get(1).copied().unwrap_or(0) as usize)
}

/// A tensorless GGUF of architecture `arch` whose `<arch>.*` keys are `keys` with `change`
/// applied (`(key, Some(value))` sets it, `(key, None)` removes it): what a family's tests read
/// hyper-parameters and refusals from.
#[cfg(test)]
pub(crate) fn test_file(
    arch: &str,
    keys: &[(&str, Value)],
    change: &[(&str, Option<Value>)],
) -> GgufFile {
    use crate::gguf::GgufWriter;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut meta: Vec<(String, Value)> = keys
        .iter()
        .map(|(k, v)| (format!("{arch}.{k}"), v.clone()))
        .collect();
    for (k, v) in change {
        let key = format!("{arch}.{k}");
        meta.retain(|(m, _)| *m != key);
        if let Some(v) = v {
            meta.push((key, v.clone()));
        }
    }
    meta.insert(
        0,
        ("general.architecture".into(), Value::String(arch.into())),
    );
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "bmoe-{arch}-meta-{}-{call}.gguf",
        std::process::id()
    ));
    GgufWriter::write_file(&path, &meta, &[]).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    f
}
