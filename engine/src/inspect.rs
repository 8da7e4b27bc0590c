//! `bmoe-cli inspect`: what a GGUF model holds and what streaming its experts will cost.
//!
//! Besides the header, hyper-parameters, tokenizer and tensor table, this works out the
//! numbers the expert cache is sized by: bytes per expert per projection (from the stacked
//! `blk.N.ffn_{gate,up,down}_exps.weight` tensors), the dense bytes that stay resident, and
//! the routed bytes of one token in the worst case (`cache_cycle`: every layer's k experts
//! missed) and of the widest layer (`layer_demand`). The facts are computed once
//! ([`analyze`]) and rendered as text ([`inspect`]) or JSON ([`inspect_json`]).

use crate::gguf::{GgmlType, GgufFile, TensorInfo, Value};
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::PathBuf;

/// One projection of one MoE layer: a stacked expert tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertProjection {
    /// Short name: `gate`, `up`, `down`, or e.g. `gate_up` / `gate.bias` for other
    /// `*_exps` tensors.
    pub name: String,
    pub tensor: String,
    pub ty: GgmlType,
    /// Bytes of one expert's slice: tensor bytes / n_expert.
    pub per_expert_bytes: u64,
    /// Bytes of one row (`dims[0]` elements).
    pub row_bytes: u64,
    /// Rows in one expert's slice.
    pub rows_per_expert: u64,
    /// Where expert 0's slice starts; expert `e` is at `offset + e * per_expert_bytes`.
    pub shard: u16,
    pub offset: u64,
}

/// The experts of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeLayer {
    /// Model layer index (`N` in `blk.N.`).
    pub layer: u32,
    pub n_expert: u64,
    /// Experts used per token in this layer, when the metadata says.
    pub n_expert_used: Option<u64>,
    /// gate, up, down first, then any other `*_exps` tensor by name.
    pub projections: Vec<ExpertProjection>,
    /// Σ per-expert bytes over the projections: what one expert miss reads.
    pub expert_bytes: u64,
}

impl MoeLayer {
    /// Bytes one token routes through this layer in the worst case: k experts, all missed.
    pub fn routed_bytes(&self) -> Option<u64> {
        self.n_expert_used.map(|k| k * self.expert_bytes)
    }
}

/// Everything `inspect` reports, computed once.
#[derive(Clone, Debug, PartialEq)]
pub struct Inspection {
    pub shards: Vec<(PathBuf, u64)>,
    pub architecture: Option<String>,
    pub version: u32,
    pub alignment: u64,
    pub file_bytes: u64,
    /// Every `<arch>.*` key, in file order.
    pub hyperparameters: Vec<(String, Value)>,
    pub tokenizer: Tokenizer,
    pub tensors: Vec<TensorInfo>,
    /// `<arch>.expert_count`.
    pub expert_count: Option<u64>,
    pub layers: Vec<MoeLayer>,
    /// Bytes of every tensor that is not an `_exps` tensor (what stays resident).
    pub dense_bytes: u64,
    /// Bytes of every `_exps` tensor.
    pub expert_bytes_total: u64,
    /// Σ over MoE layers of per-expert bytes × experts used: one token's worst-case routed
    /// bytes. `None` for a model without experts, or when the experts-used count is
    /// unknown for some layer.
    pub cache_cycle_bytes: Option<u64>,
    /// The widest layer's routed bytes, and that layer.
    pub layer_demand: Option<(u32, u64)>,
    /// Inconsistencies found (expert tensors that do not split evenly, counts that
    /// disagree with the metadata). Empty for a sound file.
    pub problems: Vec<String>,
    /// The tensor types the file holds, most bytes first.
    pub types: Vec<TypeUse>,
}

/// How much of a file one tensor type holds, and whether this build can run it.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeUse {
    pub ty: GgmlType,
    pub tensors: u64,
    pub bytes: u64,
    /// The kernels take it (dot products, dequantization).
    pub kernel: bool,
}

/// The file's types, most bytes first (then by name).
fn type_uses(tensors: &[TensorInfo]) -> Vec<TypeUse> {
    let mut by: BTreeMap<&'static str, TypeUse> = BTreeMap::new();
    for t in tensors {
        let u = by.entry(t.ty.name()).or_insert(TypeUse {
            ty: t.ty,
            tensors: 0,
            bytes: 0,
            kernel: crate::kernels::supports_dot(t.ty),
        });
        u.tensors += 1;
        u.bytes += t.n_bytes;
    }
    let mut v: Vec<TypeUse> = by.into_values().collect();
    v.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.ty.name().cmp(b.ty.name())));
    v
}

/// The tokenizer as the GGUF metadata describes it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tokenizer {
    pub model: Option<String>,
    pub pre: Option<String>,
    pub vocab_size: Option<u64>,
    pub merges: Option<u64>,
    /// `tokenizer.ggml.<name>_token_id` → (id, token text when in range).
    pub special: Vec<(String, u64, Option<String>)>,
    /// Bytes of `tokenizer.chat_template`, when present.
    pub chat_template_bytes: Option<u64>,
}

/// `blk.N.<middle>_exps.<suffix>` → (N, projection name).
fn expert_tensor(name: &str) -> Option<(u32, String)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: u32 = layer.parse().ok()?;
    let (middle, suffix) = rest.split_once("_exps.")?;
    let proj = middle.strip_prefix("ffn_").unwrap_or(middle);
    let proj = if suffix == "weight" {
        proj.to_string()
    } else {
        format!("{proj}.{suffix}")
    };
    Some((layer, proj))
}

fn projection_rank(name: &str) -> (u8, String) {
    let r = match name {
        "gate" => 0,
        "up" => 1,
        "down" => 2,
        _ => 3,
    };
    (r, name.to_string())
}

/// A metadata value that may be a scalar or a per-layer array.
fn per_layer(v: Option<&Value>, layer: u32) -> Option<u64> {
    match v? {
        Value::Array(_, items) => items.get(layer as usize)?.as_u64(),
        v => v.as_u64(),
    }
}

/// Work out every fact `inspect` reports.
pub fn analyze(f: &GgufFile) -> Inspection {
    let arch = f.architecture().map(str::to_string);
    let prefix = arch.as_deref().map(|a| format!("{a}."));
    let hyperparameters: Vec<(String, Value)> = match &prefix {
        Some(p) => f
            .metadata()
            .iter()
            .filter(|(k, _)| k.starts_with(p.as_str()))
            .cloned()
            .collect(),
        None => Vec::new(),
    };
    let key = |k: &str| prefix.as_ref().and_then(|p| f.get(&format!("{p}{k}")));
    let expert_count = key("expert_count").and_then(Value::as_u64);
    let used = key("expert_used_count");

    let mut problems = Vec::new();
    let mut by_layer: BTreeMap<u32, Vec<ExpertProjection>> = BTreeMap::new();
    let mut n_by_layer: BTreeMap<u32, u64> = BTreeMap::new();
    let mut dense_bytes = 0u64;
    let mut expert_bytes_total = 0u64;
    for t in f.tensors() {
        let Some((layer, proj)) = expert_tensor(&t.name) else {
            dense_bytes += t.n_bytes;
            continue;
        };
        expert_bytes_total += t.n_bytes;
        let last = t.n_slices().unwrap_or(1);
        let n_expert = expert_count.unwrap_or(last);
        if last != n_expert {
            problems.push(format!(
                "{}: outermost dimension {last} differs from expert_count {n_expert}",
                t.name
            ));
        }
        if n_expert == 0 || t.n_rows() % n_expert != 0 || t.n_bytes % n_expert != 0 {
            problems.push(format!(
                "{}: {} rows ({} bytes) do not split into {n_expert} experts",
                t.name,
                t.n_rows(),
                t.n_bytes
            ));
            continue;
        }
        let per_expert_bytes = t.n_bytes / n_expert;
        let rows_per_expert = t.n_rows() / n_expert;
        if per_expert_bytes != t.row_bytes() * rows_per_expert {
            problems.push(format!(
                "{}: tensor bytes / n_expert = {per_expert_bytes}, but row bytes {} × {rows_per_expert} rows = {}",
                t.name,
                t.row_bytes(),
                t.row_bytes() * rows_per_expert
            ));
        }
        if let Some(prev) = n_by_layer.insert(layer, n_expert) {
            if prev != n_expert {
                problems.push(format!(
                    "layer {layer}: expert tensors disagree on the expert count"
                ));
            }
        }
        by_layer.entry(layer).or_default().push(ExpertProjection {
            name: proj,
            tensor: t.name.clone(),
            ty: t.ty,
            per_expert_bytes,
            row_bytes: t.row_bytes(),
            rows_per_expert,
            shard: t.shard,
            offset: t.offset,
        });
    }
    let layers: Vec<MoeLayer> = by_layer
        .into_iter()
        .map(|(layer, mut projections)| {
            projections.sort_by_key(|p| projection_rank(&p.name));
            let n_expert_used = per_layer(used, layer);
            let n_expert = n_by_layer.get(&layer).copied().unwrap_or(0);
            if let Some(k) = n_expert_used {
                if k > n_expert {
                    problems.push(format!(
                        "layer {layer}: expert_used_count {k} exceeds the {n_expert} experts"
                    ));
                }
            }
            MoeLayer {
                layer,
                n_expert,
                n_expert_used,
                expert_bytes: projections.iter().map(|p| p.per_expert_bytes).sum(),
                projections,
            }
        })
        .collect();
    if !layers.is_empty() && used.is_none() {
        problems.push(format!(
            "no {}expert_used_count: routed bytes unknown",
            prefix.as_deref().unwrap_or("<arch>.")
        ));
    }
    let routed: Option<Vec<(u32, u64)>> = layers
        .iter()
        .map(|l| l.routed_bytes().map(|b| (l.layer, b)))
        .collect::<Option<Vec<_>>>()
        .filter(|r| !r.is_empty());
    let cache_cycle_bytes = routed.as_ref().map(|r| r.iter().map(|x| x.1).sum());
    let layer_demand = routed.and_then(|r| {
        r.into_iter()
            .fold(None, |best: Option<(u32, u64)>, x| match best {
                Some(b) if b.1 >= x.1 => Some(b),
                _ => Some(x),
            })
    });

    let tokens = f.get("tokenizer.ggml.tokens").and_then(Value::as_array);
    let mut special: Vec<(String, u64, Option<String>)> = f
        .metadata()
        .iter()
        .filter_map(|(k, v)| {
            let name = k
                .strip_prefix("tokenizer.ggml.")?
                .strip_suffix("_token_id")?;
            let id = v.as_u64()?;
            let text = tokens
                .and_then(|t| t.get(id as usize))
                .and_then(|t| t.as_str())
                .map(str::to_string);
            Some((name.to_string(), id, text))
        })
        .collect();
    special.sort();
    let tokenizer = Tokenizer {
        model: f.get_str("tokenizer.ggml.model").map(str::to_string),
        pre: f.get_str("tokenizer.ggml.pre").map(str::to_string),
        vocab_size: tokens.map(|t| t.len() as u64),
        merges: f
            .get("tokenizer.ggml.merges")
            .and_then(Value::as_array)
            .map(|m| m.len() as u64),
        special,
        chat_template_bytes: f.get_str("tokenizer.chat_template").map(|s| s.len() as u64),
    };
    Inspection {
        shards: (0..f.shard_count())
            .map(|i| {
                (
                    f.shard_paths()[i].to_path_buf(),
                    f.shard_map(i).len() as u64,
                )
            })
            .collect(),
        architecture: arch,
        version: f.version(),
        alignment: f.alignment(),
        file_bytes: f.file_bytes(),
        hyperparameters,
        tokenizer,
        tensors: f.tensors().to_vec(),
        expert_count,
        layers,
        dense_bytes,
        expert_bytes_total,
        cache_cycle_bytes,
        layer_demand,
        problems,
        types: type_uses(f.tensors()),
    }
}

/// `n` bytes, with a binary-unit gloss for people.
fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{n} B ({v:.1} {})", UNITS[u])
}

fn shape(dims: &[u64]) -> String {
    let d: Vec<String> = dims.iter().map(u64::to_string).collect();
    format!("[{}]", d.join(", "))
}

/// The human report `bmoe-cli inspect` prints.
pub fn inspect(f: &GgufFile) -> String {
    render(&analyze(f))
}

/// Render facts as the human report.
pub fn render(r: &Inspection) -> String {
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = render_into(r, &mut s);
    s
}

fn render_into(r: &Inspection, s: &mut String) -> std::fmt::Result {
    writeln!(s, "file:         {}", r.shards[0].0.display())?;
    writeln!(
        s,
        "architecture: {}",
        r.architecture.as_deref().unwrap_or("(none)")
    )?;
    writeln!(s, "version:      {}", r.version)?;
    writeln!(s, "alignment:    {}", r.alignment)?;
    writeln!(s, "shards:       {}", r.shards.len())?;
    if r.shards.len() > 1 {
        for (i, (p, n)) in r.shards.iter().enumerate() {
            writeln!(s, "  [{i}] {} {}", p.display(), human(*n))?;
        }
    }
    writeln!(s, "file size:    {}", human(r.file_bytes))?;
    writeln!(s, "tensors:      {}", r.tensors.len())?;

    writeln!(s, "\nhyper-parameters:")?;
    if r.hyperparameters.is_empty() {
        writeln!(s, "  (none)")?;
    }
    for (k, v) in &r.hyperparameters {
        writeln!(s, "  {k} = {v}")?;
    }

    let t = &r.tokenizer;
    let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "(none)".into());
    let num = |v: Option<u64>| v.map(|n| n.to_string()).unwrap_or_else(|| "(none)".into());
    writeln!(s, "\ntokenizer:")?;
    writeln!(s, "  model:         {}", opt(&t.model))?;
    writeln!(s, "  pre:           {}", opt(&t.pre))?;
    writeln!(s, "  vocab size:    {}", num(t.vocab_size))?;
    writeln!(s, "  merges:        {}", num(t.merges))?;
    for (name, id, text) in &t.special {
        let label = format!("{name} token:");
        match text {
            Some(x) => writeln!(s, "  {label:<14} {id} {x:?}")?,
            None => writeln!(s, "  {label:<14} {id} (outside the vocabulary)")?,
        }
    }
    match t.chat_template_bytes {
        Some(n) => writeln!(s, "  chat template: present ({n} bytes)")?,
        None => writeln!(s, "  chat template: absent")?,
    }

    writeln!(s, "\ntensors:")?;
    let w = r
        .tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    writeln!(
        s,
        "  {:<w$}  {:<7}  {:<24}  {:>5}  {:>12}  {:>12}",
        "name", "type", "shape", "shard", "offset", "bytes"
    )?;
    for t in &r.tensors {
        writeln!(
            s,
            "  {:<w$}  {:<7}  {:<24}  {:>5}  {:>12}  {:>12}",
            t.name,
            t.ty.name(),
            shape(&t.dims),
            t.shard,
            t.offset,
            t.n_bytes
        )?;
    }

    writeln!(s, "\ntypes:")?;
    for u in &r.types {
        writeln!(
            s,
            "  {:<7}  {:>5} tensor(s)  {}{}",
            u.ty.name(),
            u.tensors,
            human(u.bytes),
            if u.kernel {
                ""
            } else {
                "  -- no kernel in this build: bmoe cannot run this file"
            }
        )?;
    }

    if !r.layers.is_empty() {
        writeln!(s, "\nexperts:")?;
        writeln!(s, "  expert_count: {}", num(r.expert_count))?;
        for l in &r.layers {
            let projs: Vec<String> = l
                .projections
                .iter()
                .map(|p| format!("{} {} {}", p.name, p.ty, p.per_expert_bytes))
                .collect();
            writeln!(
                s,
                "  layer {:>3}: {} experts, k={}; per expert: {} = {} B; routed {}",
                l.layer,
                l.n_expert,
                num(l.n_expert_used),
                projs.join(" + "),
                l.expert_bytes,
                l.routed_bytes()
                    .map(human)
                    .unwrap_or_else(|| "unknown".into())
            )?;
        }
    }
    writeln!(s, "\nbytes:")?;
    writeln!(s, "  dense (resident):     {}", human(r.dense_bytes))?;
    writeln!(s, "  experts (total):      {}", human(r.expert_bytes_total))?;
    if !r.layers.is_empty() {
        match r.cache_cycle_bytes {
            Some(n) => writeln!(s, "  cache_cycle (1 token worst case): {}", human(n))?,
            None => writeln!(s, "  cache_cycle: unknown")?,
        }
        match r.layer_demand {
            Some((l, n)) => writeln!(s, "  layer_demand (widest layer {l}):  {}", human(n))?,
            None => writeln!(s, "  layer_demand: unknown")?,
        }
    }
    if !r.problems.is_empty() {
        writeln!(s, "\nproblems:")?;
        for p in &r.problems {
            writeln!(s, "  {p}")?;
        }
    }
    Ok(())
}

/// A metadata value as JSON: non-finite floats as strings, long arrays as
/// `{len, first}`.
fn value_json(v: &Value) -> Json {
    let float = |x: f64| {
        if x.is_finite() {
            json!(x)
        } else if x.is_nan() {
            json!("nan")
        } else if x > 0.0 {
            json!("inf")
        } else {
            json!("-inf")
        }
    };
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F32(x) => float(f64::from(*x)),
        Value::F64(x) => float(*x),
        Value::Bool(x) => json!(x),
        Value::String(x) => json!(x),
        Value::Array(_, items) if items.len() <= 64 => {
            Json::Array(items.iter().map(value_json).collect())
        }
        Value::Array(t, items) => json!({
            "element_type": format!("{t:?}"),
            "len": items.len(),
            "first": items.iter().take(8).map(value_json).collect::<Vec<_>>(),
        }),
    }
}

/// The same facts as [`inspect`], for scripts.
pub fn inspect_json(f: &GgufFile) -> Json {
    to_json(&analyze(f))
}

/// Render facts as JSON.
pub fn to_json(r: &Inspection) -> Json {
    let t = &r.tokenizer;
    json!({
        "file": r.shards[0].0,
        "architecture": r.architecture,
        "version": r.version,
        "alignment": r.alignment,
        "shards": r.shards.iter().map(|(p, n)| json!({"path": p, "bytes": n})).collect::<Vec<_>>(),
        "file_bytes": r.file_bytes,
        "hyperparameters": r.hyperparameters.iter()
            .map(|(k, v)| (k.clone(), value_json(v)))
            .collect::<serde_json::Map<_, _>>(),
        "tokenizer": {
            "model": t.model,
            "pre": t.pre,
            "vocab_size": t.vocab_size,
            "merges": t.merges,
            "special": t.special.iter()
                .map(|(n, id, text)| (n.clone(), json!({"id": id, "token": text})))
                .collect::<serde_json::Map<_, _>>(),
            "chat_template": t.chat_template_bytes.is_some(),
            "chat_template_bytes": t.chat_template_bytes,
        },
        "tensors": r.tensors.iter().map(|t| json!({
            "name": t.name,
            "type": t.ty.name(),
            "shape": t.dims,
            "shard": t.shard,
            "offset": t.offset,
            "bytes": t.n_bytes,
        })).collect::<Vec<_>>(),
        "expert_count": r.expert_count,
        "moe_layers": r.layers.iter().map(|l| json!({
            "layer": l.layer,
            "n_expert": l.n_expert,
            "n_expert_used": l.n_expert_used,
            "projections": l.projections.iter().map(|p| json!({
                "name": p.name,
                "tensor": p.tensor,
                "type": p.ty.name(),
                "per_expert_bytes": p.per_expert_bytes,
                "row_bytes": p.row_bytes,
                "rows_per_expert": p.rows_per_expert,
                "shard": p.shard,
                "offset": p.offset,
            })).collect::<Vec<_>>(),
            "expert_bytes": l.expert_bytes,
            "routed_bytes": l.routed_bytes(),
        })).collect::<Vec<_>>(),
        "dense_bytes": r.dense_bytes,
        "expert_bytes_total": r.expert_bytes_total,
        "cache_cycle_bytes": r.cache_cycle_bytes,
        "layer_demand_bytes": r.layer_demand.map(|x| x.1),
        "layer_demand_layer": r.layer_demand.map(|x| x.0),
        "problems": r.problems,
        "types": r.types.iter().map(|u| json!({
            "type": u.ty.name(),
            "tensors": u.tensors,
            "bytes": u.bytes,
            "kernel": u.kernel,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_are_summed_most_bytes_first_and_unsupported_ones_flagged() {
        let t = |name: &str, ty: GgmlType, n_bytes: u64| TensorInfo {
            name: name.into(),
            dims: vec![256],
            ty,
            shard: 0,
            offset: 0,
            n_bytes,
        };
        let uses = type_uses(&[
            t("a", GgmlType::F32, 10),
            t("b", GgmlType::Q4_K, 100),
            t("c", GgmlType::IQ2_XS, 50),
            t("d", GgmlType::F32, 5),
        ]);
        let got: Vec<(&str, u64, u64, bool)> = uses
            .iter()
            .map(|u| (u.ty.name(), u.tensors, u.bytes, u.kernel))
            .collect();
        assert_eq!(
            got,
            [
                ("Q4_K", 1, 100, true),
                ("IQ2_XS", 1, 50, false),
                ("F32", 2, 15, true)
            ]
        );
    }

    #[test]
    fn expert_tensor_names() {
        assert_eq!(
            expert_tensor("blk.12.ffn_gate_exps.weight"),
            Some((12, "gate".into()))
        );
        assert_eq!(
            expert_tensor("blk.0.ffn_gate_up_exps.weight"),
            Some((0, "gate_up".into()))
        );
        assert_eq!(
            expert_tensor("blk.3.ffn_down_exps.bias"),
            Some((3, "down.bias".into()))
        );
        assert_eq!(expert_tensor("blk.3.ffn_down_shexp.weight"), None);
        assert_eq!(expert_tensor("token_embd.weight"), None);
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 20), "3145728 B (3.0 MiB)");
    }

    #[test]
    fn per_layer_values() {
        let arr = Value::Array(
            crate::gguf::ValueType::U32,
            vec![Value::U32(2), Value::U32(4)],
        );
        assert_eq!(per_layer(Some(&arr), 1), Some(4));
        assert_eq!(per_layer(Some(&arr), 2), None);
        assert_eq!(per_layer(Some(&Value::U32(8)), 7), Some(8));
    }
}
