//! An architecture's tensors: dense matrices mapped (or copied under `--dense-weights`), small
//! vectors read to f32, and the stacked expert tensors located but never touched (the core
//! streams them). One [`Loader`] checks every tensor's presence, shape and type as the
//! architecture asks for it, and keeps the books the engine needs afterwards: the address
//! ranges of the dense bytes (the residency probe) and every layer's dense bytes (the expert
//! layout and the trace preambles).

use super::ArchError;
use crate::dense::{AnonBuf, DenseMode};
use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use crate::kernels;
use std::sync::Arc;

/// Types a small vector (a norm's weights, a bias, a scale) may be stored in.
const VECTOR_TYPES: &[GgmlType] = &[GgmlType::F32, GgmlType::F16, GgmlType::BF16];

/// A 2-D weight matrix view: `rows` rows of `cols` elements, GGUF row-major.
#[derive(Copy, Clone, Debug)]
pub struct Mat {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    ptr: *const u8,
    len: usize,
    /// Where the bytes are in the file.
    pub shard: u16,
    pub file_offset: u64,
}

// SAFETY: a `Mat` points into memory owned by the `Weights` its loader made (the model's
// memory map or its anonymous dense buffers), which is immutable for the model's life.
unsafe impl Send for Mat {}
unsafe impl Sync for Mat {}

impl Mat {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: see the Send/Sync note; ptr/len come from a live slice of the owner.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// The address range of the bytes (for residency probes).
    pub fn range(&self) -> (*const u8, usize) {
        (self.ptr, self.len)
    }
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols as u64).unwrap_or(0) as usize
    }
    /// Row `r` dequantized into `out` (`cols` values): an embedding lookup.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) -> Result<(), ArchError> {
        let rb = self.row_bytes();
        kernels::dequantize_row(self.ty, &self.bytes()[r * rb..(r + 1) * rb], out)
            .map_err(super::blocks::kerr)
    }
}

/// One projection of a layer's experts, stacked in one tensor `{cols, rows, n_expert}`:
/// expert `e`'s bytes are `stride` bytes at `info.offset + e·stride`.
#[derive(Clone, Debug)]
pub struct ExpertTensor {
    pub info: TensorInfo,
    /// Bytes per expert.
    pub stride: u64,
    /// Output rows per expert and their input length.
    pub rows: usize,
    pub cols: usize,
}

/// The dense side of a loaded model: the file (which keeps the map alive behind every
/// [`Mat`]), the anonymous copies `--dense-weights anon` made, and the books.
pub struct Weights {
    file: Arc<GgufFile>,
    _anon: Vec<AnonBuf>,
    ranges: Vec<(*const u8, usize)>,
    /// Resident bytes per model layer (matrices, vectors, per-expert biases and scales).
    layer_bytes: Vec<u64>,
    /// Bytes `--dense-weights` copied or warmed.
    pub dense_mode_bytes: u64,
}

// SAFETY: the ranges are addresses for `mincore`, never dereferenced through this struct.
unsafe impl Send for Weights {}
unsafe impl Sync for Weights {}

impl Weights {
    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }
    /// Address ranges of the dense matrices as they are now (map or anonymous copies).
    pub fn dense_ranges(&self) -> &[(*const u8, usize)] {
        &self.ranges
    }
    /// Resident (never streamed) bytes of model layer `layer`.
    pub fn layer_dense_bytes(&self, layer: usize) -> u64 {
        self.layer_bytes.get(layer).copied().unwrap_or(0)
    }
    /// The file's bytes of expert `e` of `x` (the resident baseline computes from the map).
    pub fn expert_bytes<'a>(&'a self, x: &ExpertTensor, e: usize) -> &'a [u8] {
        let data = self.file.tensor_data(&x.info);
        let s = x.stride as usize;
        &data[e * s..(e + 1) * s]
    }
}

/// Checks and maps tensors for an architecture. See the module doc.
pub struct Loader {
    file: Arc<GgufFile>,
    mode: DenseMode,
    anon: Vec<AnonBuf>,
    ranges: Vec<(*const u8, usize)>,
    layer_bytes: Vec<u64>,
    mode_bytes: u64,
}

/// The model layer a tensor name belongs to (`blk.N.…`).
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

impl Loader {
    /// A loader over `file` applying `mode` to the dense matrices: `mmap` keeps the map;
    /// `warm` reads the dense bytes once, sequentially, so the first tokens do not fault them
    /// in one page at a time; `anon` copies them (O_DIRECT where the filesystem allows) into
    /// anonymous memory and drops the map's pages, so under pressure the kernel swaps them
    /// (zram) instead of re-reading flash.
    pub fn new(file: Arc<GgufFile>, mode: DenseMode, n_layer: usize) -> Loader {
        Loader {
            file,
            mode,
            anon: Vec::new(),
            ranges: Vec::new(),
            layer_bytes: vec![0; n_layer],
            mode_bytes: 0,
        }
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub(crate) fn path(&self) -> String {
        self.file.path().display().to_string()
    }

    fn count(&mut self, name: &str, bytes: u64) {
        if let Some(b) = layer_of(name).and_then(|l| self.layer_bytes.get_mut(l)) {
            *b += bytes;
        }
    }

    /// A tensor's description, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<TensorInfo, ArchError> {
        self.file
            .tensor(name)
            .cloned()
            .ok_or_else(|| ArchError::Tensor {
                file: self.path(),
                tensor: name.into(),
                what: "is missing".into(),
            })
    }

    /// Whether the file has tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    fn check_dims(&self, t: &TensorInfo, want: &[usize]) -> Result<(), ArchError> {
        let got: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        if got != want {
            return Err(ArchError::Tensor {
                file: self.path(),
                tensor: t.name.clone(),
                what: format!("has shape {got:?}, expected {want:?}"),
            });
        }
        Ok(())
    }

    fn check_type(&self, t: &TensorInfo, allowed: &[GgmlType]) -> Result<(), ArchError> {
        if !allowed.contains(&t.ty) {
            return Err(ArchError::Tensor {
                file: self.path(),
                tensor: t.name.clone(),
                what: format!(
                    "has type {}, which this build has no kernel for (supported: {})",
                    t.ty,
                    allowed
                        .iter()
                        .map(|t| t.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        Ok(())
    }

    /// A dense matrix `name` of shape `{cols, rows}` (GGUF order), mapped or copied per the
    /// dense mode.
    pub fn mat(&mut self, name: &str, cols: usize, rows: usize) -> Result<Mat, ArchError> {
        self.mat_dims(name, &[cols, rows], cols, rows)
    }

    /// A 3-D dense tensor of `n` stacked `rows × cols` matrices (GGUF dims `[cols, rows, n]`:
    /// deepseek2's per-head `attn_k_b` / `attn_v_b`), as one matrix of `n · rows` rows — matrix
    /// `i` is rows `i · rows ..`.
    pub fn mat_stacked(
        &mut self,
        name: &str,
        cols: usize,
        rows: usize,
        n: usize,
    ) -> Result<Mat, ArchError> {
        self.mat_dims(name, &[cols, rows, n], cols, rows * n)
    }

    fn mat_dims(
        &mut self,
        name: &str,
        dims: &[usize],
        cols: usize,
        rows: usize,
    ) -> Result<Mat, ArchError> {
        let t = self.tensor(name)?;
        self.check_dims(&t, dims)?;
        self.check_type(&t, kernels::weight_types())?;
        let data = self.file.tensor_data(&t);
        let mut m = Mat {
            ty: t.ty,
            rows,
            cols,
            ptr: data.as_ptr(),
            len: data.len(),
            shard: t.shard,
            file_offset: t.offset,
        };
        match self.mode {
            DenseMode::Mmap => {}
            DenseMode::Warm => {
                self.mode_bytes += crate::dense::warm(data) as u64;
            }
            DenseMode::Anon => {
                let path = self.file.shard_paths()[t.shard as usize].to_path_buf();
                let buf =
                    AnonBuf::read(&path, t.offset, data.len()).map_err(|e| ArchError::Tensor {
                        file: path.display().to_string(),
                        tensor: name.into(),
                        what: format!("--dense-weights anon: {e}"),
                    })?;
                crate::dense::drop_map_pages(data);
                m.ptr = buf.data().as_ptr();
                self.mode_bytes += data.len() as u64;
                self.anon.push(buf);
            }
        }
        self.ranges.push((m.ptr, m.len));
        self.count(name, data.len() as u64);
        Ok(m)
    }

    /// `mat` when the file has the tensor, `None` when it does not.
    pub fn mat_opt(
        &mut self,
        name: &str,
        cols: usize,
        rows: usize,
    ) -> Result<Option<Mat>, ArchError> {
        if !self.has(name) {
            return Ok(None);
        }
        self.mat(name, cols, rows).map(Some)
    }

    /// A small tensor of `dims` (GGUF order) read to f32: a norm's weights, a bias, a scale,
    /// or the per-expert biases of a stacked layer (kept resident: a few KiB per expert, not
    /// worth a read of their own).
    pub fn floats(&mut self, name: &str, dims: &[usize]) -> Result<Vec<f32>, ArchError> {
        let t = self.tensor(name)?;
        self.check_dims(&t, dims)?;
        self.check_type(&t, VECTOR_TYPES)?;
        let n: usize = dims.iter().product();
        let mut out = vec![0f32; n];
        let data = self.file.tensor_data(&t);
        let row = dims[0].max(1);
        let rb = t.ty.row_bytes(row as u64).unwrap_or(0) as usize;
        for (i, chunk) in out.chunks_mut(row).enumerate() {
            kernels::dequantize_row(t.ty, &data[i * rb..(i + 1) * rb], chunk).map_err(|e| {
                ArchError::Tensor {
                    file: self.path(),
                    tensor: name.into(),
                    what: e.to_string(),
                }
            })?;
        }
        self.count(name, 4 * n as u64);
        Ok(out)
    }

    /// A small I32 tensor of `dims` (GGUF order), read whole: a table of ids (deepseek4's
    /// `ffn_gate_tid2eid`).
    pub fn ids(&mut self, name: &str, dims: &[usize]) -> Result<Vec<i32>, ArchError> {
        let t = self.tensor(name)?;
        self.check_dims(&t, dims)?;
        self.check_type(&t, &[GgmlType::I32])?;
        let data = self.file.tensor_data(&t);
        let out: Vec<i32> = data
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        self.count(name, data.len() as u64);
        Ok(out)
    }

    /// A vector of `n` values.
    pub fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>, ArchError> {
        self.floats(name, &[n])
    }

    /// `floats` when the file has the tensor.
    pub fn floats_opt(
        &mut self,
        name: &str,
        dims: &[usize],
    ) -> Result<Option<Vec<f32>>, ArchError> {
        if !self.has(name) {
            return Ok(None);
        }
        self.floats(name, dims).map(Some)
    }

    /// A stacked expert projection `{cols, rows, n_expert}`: located, checked, not read.
    pub fn experts(
        &self,
        name: &str,
        cols: usize,
        rows: usize,
        n_expert: usize,
    ) -> Result<ExpertTensor, ArchError> {
        let t = self.tensor(name)?;
        self.check_dims(&t, &[cols, rows, n_expert])?;
        self.check_type(&t, kernels::weight_types())?;
        let stride = t.n_bytes / n_expert as u64;
        Ok(ExpertTensor {
            info: t,
            stride,
            rows,
            cols,
        })
    }

    /// Layer `layer`'s routed gated experts of width `ff` over `d`: a fused
    /// `ffn_gate_up_exps` (the gate's rows first) and `ffn_down_exps`, or split
    /// `ffn_gate_exps`, `ffn_up_exps` and `ffn_down_exps`, as llama.cpp takes either.
    pub fn glu_experts(
        &self,
        layer: usize,
        d: usize,
        ff: usize,
        n_expert: usize,
    ) -> Result<Vec<ExpertTensor>, ArchError> {
        let n = |s: &str| format!("blk.{layer}.{s}.weight");
        let down = self.experts(&n("ffn_down_exps"), ff, d, n_expert)?;
        Ok(if self.has(&n("ffn_gate_up_exps")) {
            vec![
                self.experts(&n("ffn_gate_up_exps"), d, 2 * ff, n_expert)?,
                down,
            ]
        } else {
            vec![
                self.experts(&n("ffn_gate_exps"), d, ff, n_expert)?,
                self.experts(&n("ffn_up_exps"), d, ff, n_expert)?,
                down,
            ]
        })
    }

    /// The embedding (`token_embd`, `d` × `n_vocab`), the head (`output`, or the embedding
    /// where the file ties them) and the final norm `norm`.
    pub fn embedding_and_head(
        &mut self,
        d: usize,
        n_vocab: usize,
        norm: &str,
    ) -> Result<(Mat, Mat, Vec<f32>), ArchError> {
        let embd = self.mat("token_embd.weight", d, n_vocab)?;
        let output = self.mat_opt("output.weight", d, n_vocab)?.unwrap_or(embd);
        let output_norm = self.vector(norm, d)?;
        Ok((embd, output, output_norm))
    }

    /// The dense side, with its books.
    pub fn finish(self) -> Weights {
        Weights {
            file: self.file,
            _anon: self.anon,
            ranges: self.ranges,
            layer_bytes: self.layer_bytes,
            dense_mode_bytes: self.mode_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_numbers_come_from_tensor_names() {
        assert_eq!(layer_of("blk.12.attn_q.weight"), Some(12));
        assert_eq!(layer_of("token_embd.weight"), None);
        assert_eq!(layer_of("blk.x.attn_q.weight"), None);
    }
}
