//! Per-expert checksums: a sidecar file written once by `bmoe-cli checksum MODEL`, and the
//! check `--verify-reads` makes of every expert read against it.
//!
//! Why: a read that reports success but lands torn or stale bytes (a device or filesystem
//! bug, an injected `torn` fault) would silently change the text. EIO and short reads are
//! reported by the device; only a checksum catches this. The sidecar holds the xxh3-64 of
//! every expert's projection bytes, so a streamed expert is checked before it is computed on,
//! once per read (cache hits are not re-hashed).
//!
//! Format (`MODEL.bmoe-sums`, text): a magic line, an identity line (every shard's size and
//! the xxh3-64 of the first shard's bytes before its data section, so a sidecar of another
//! model or an older file is refused), then one `moe_layer expert proj hash` line per
//! projection extent, in layout order.

use crate::gguf::GgufFile;
use bmoe_core::{ExpertKey, ExpertLayout};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The first line of a checksum sidecar.
pub const SUMS_MAGIC: &str = "# bmoe_checksums v1 xxh3-64";

/// The hash the sidecar uses.
pub fn hash(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Where `bmoe-cli checksum MODEL` writes, and `--verify-reads` looks: `MODEL.bmoe-sums`.
pub fn sidecar_path(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_os_string();
    s.push(".bmoe-sums");
    PathBuf::from(s)
}

/// Why the sidecar cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SumsError {
    #[error("{path}: cannot read the checksum sidecar ({source}); write it once with `bmoe-cli checksum MODEL`")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Bad { path: PathBuf, what: String },
    #[error("{path}: the checksums are of another model or an older file ({what}); write them again with `bmoe-cli checksum MODEL`")]
    Stale { path: PathBuf, what: String },
}

/// Every expert projection's hash, indexed like the layout.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertSums {
    /// Per MoE layer: `n_expert × n_proj` hashes, expert-major.
    layers: Vec<Vec<u64>>,
    n_proj: Vec<usize>,
}

impl ExpertSums {
    /// The expected hash of `key`'s projection `proj`.
    pub fn get(&self, key: ExpertKey, proj: usize) -> Option<u64> {
        let n = *self.n_proj.get(key.layer as usize)?;
        if proj >= n {
            return None;
        }
        self.layers
            .get(key.layer as usize)?
            .get(key.expert as usize * n + proj)
            .copied()
    }
}

/// The identity line of `file`: shard sizes and the hash of the first shard's header.
fn identity(file: &GgufFile) -> String {
    let sizes: Vec<String> = (0..file.shard_count())
        .map(|i| file.shard_map(i).len().to_string())
        .collect();
    let head_end = file.shard_data_start(0).unwrap_or(0) as usize;
    let head = file.shard_map(0);
    let head = &head[..head_end.min(head.len())];
    format!(
        "# shard_bytes={} header_xxh3={:016x}",
        sizes.join(","),
        hash(head)
    )
}

/// Hash every expert projection of `file` (`progress(done_bytes, total_bytes)` after each
/// layer).
pub fn compute(
    file: &GgufFile,
    layout: &ExpertLayout,
    mut progress: impl FnMut(u64, u64),
) -> ExpertSums {
    let total = layout.total_expert_bytes();
    let mut done = 0u64;
    let mut layers = Vec::with_capacity(layout.layers().len());
    let mut n_proj = Vec::with_capacity(layout.layers().len());
    for (moe, l) in layout.layers().iter().enumerate() {
        let np = l.projections.len();
        let mut sums = Vec::with_capacity(l.n_expert as usize * np);
        for e in 0..l.n_expert {
            for p in &l.projections {
                let ext = crate::gguf::Extent {
                    shard: p.shard,
                    offset: p.base_offset + u64::from(e) * p.stride_bytes,
                    len: p.stride_bytes,
                };
                sums.push(hash(file.extent_data(ext)));
                done += p.stride_bytes;
            }
        }
        layers.push(sums);
        n_proj.push(np);
        progress(done, total);
        let _ = moe;
    }
    ExpertSums { layers, n_proj }
}

/// Write `sums` of `file` to `out` (created whole: a temporary file renamed into place, so a
/// crash never leaves a half-written sidecar behind).
pub fn write(out: &Path, file: &GgufFile, sums: &ExpertSums) -> std::io::Result<()> {
    let mut text = String::with_capacity(64 + sums.layers.iter().map(Vec::len).sum::<usize>() * 24);
    text.push_str(SUMS_MAGIC);
    text.push('\n');
    text.push_str(&identity(file));
    text.push('\n');
    for (layer, hashes) in sums.layers.iter().enumerate() {
        let np = sums.n_proj[layer].max(1);
        for (i, h) in hashes.iter().enumerate() {
            text.push_str(&format!("{layer} {} {} {h:016x}\n", i / np, i % np));
        }
    }
    let mut tmp = out.as_os_str().to_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, out)
}

/// Read the sidecar at `path` for `file` / `layout`: it must be whole, of this model's
/// current bytes, and cover every expert projection of the layout exactly.
pub fn load(path: &Path, file: &GgufFile, layout: &ExpertLayout) -> Result<ExpertSums, SumsError> {
    let text = std::fs::read_to_string(path).map_err(|source| SumsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |what: String| SumsError::Bad {
        path: path.to_path_buf(),
        what,
    };
    let mut lines = text.lines();
    if lines.next() != Some(SUMS_MAGIC) {
        return Err(bad(format!("the first line is not '{SUMS_MAGIC}'")));
    }
    let want = identity(file);
    match lines.next() {
        Some(l) if l == want => {}
        Some(l) => {
            return Err(SumsError::Stale {
                path: path.to_path_buf(),
                what: format!("it says '{l}', the model '{want}'"),
            })
        }
        None => return Err(bad("no identity line".into())),
    }
    let mut layers: Vec<Vec<u64>> = layout
        .layers()
        .iter()
        .map(|l| Vec::with_capacity(l.n_expert as usize * l.projections.len()))
        .collect();
    let n_proj: Vec<usize> = layout
        .layers()
        .iter()
        .map(|l| l.projections.len())
        .collect();
    for (i, line) in lines.enumerate() {
        let no = i + 3;
        let f: Vec<&str> = line.split(' ').collect();
        let parsed = (f.len() == 4)
            .then(|| {
                Some((
                    f[0].parse::<usize>().ok()?,
                    f[1].parse::<usize>().ok()?,
                    f[2].parse::<usize>().ok()?,
                    u64::from_str_radix(f[3], 16).ok()?,
                ))
            })
            .flatten();
        let Some((layer, expert, proj, h)) = parsed else {
            return Err(bad(format!(
                "line {no}: expected 'moe_layer expert proj hash'"
            )));
        };
        let Some(v) = layers.get_mut(layer) else {
            return Err(bad(format!("line {no}: no MoE layer {layer} in the model")));
        };
        if v.len() != expert * n_proj[layer] + proj || proj >= n_proj[layer] {
            return Err(bad(format!(
                "line {no}: layer {layer} expert {expert} proj {proj} is out of order or out of range"
            )));
        }
        v.push(h);
    }
    for (layer, (v, l)) in layers.iter().zip(layout.layers()).enumerate() {
        if v.len() != l.n_expert as usize * l.projections.len() {
            return Err(bad(format!(
                "MoE layer {layer} has {} of its {} checksums (the file is cut short?)",
                v.len(),
                l.n_expert as usize * l.projections.len()
            )));
        }
    }
    Ok(ExpertSums { layers, n_proj })
}
