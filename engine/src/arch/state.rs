//! Per-session mutable state of a forward pass: each layer's memory (a full KV cache, a
//! ring that keeps only a sliding window's positions, or a recurrent layer's state), the
//! batch in flight, and scratch buffers sized once and reused. Shared by every architecture;
//! what a layer keeps is the architecture's answer to [`super::Arch::memory`].

use super::ArchError;
use crate::kernels::{ActBuf, ActFormat};

/// What an attention layer's keys and values cover.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Every position's keys and values (`n_ctx` of them).
    Full,
    /// Only the last `window` positions' (a sliding-window layer), in a ring of
    /// `window + RING_SLACK` slots (slot `pos % capacity`), so that a turn may roll back up to
    /// [`RING_SLACK`] positions and still find the window before it.
    Ring { window: usize },
}

/// Positions a ring keeps beyond its window: how far a continued chat may roll the KV back (a
/// re-rendered answer, the sampled token never fed) and still reuse it, as llama.cpp keeps
/// `n_swa + n_ubatch` cells for its sliding layers. Past it the session re-feeds the prompt
/// ([`State::reusable_prefix`]).
pub const RING_SLACK: usize = 256;

/// One layer's memory as the architecture declares it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LayerMemory {
    /// An attention layer's keys and values.
    Kv {
        kind: MemoryKind,
        n_head_kv: usize,
        head_dim: usize,
    },
    /// Multi-head latent attention's memory (deepseek2): one row of `width` floats per position
    /// — the compressed latent and the roped shared key part — which is every head's key,
    /// and whose leading part is every head's value. Held once, not as keys and values.
    Latent { width: usize },
    /// deepseek4's compressed attention: a ring of `width`-float rows (each position's raw key
    /// — its value too — and its compressor inputs) holding `window` positions plus the slack a
    /// turn may roll back, beside one `block_width`-float row per finished block of `ratio`
    /// positions (the block's compressed rows), addressed by block. `ratio` 0: no blocks.
    Compressed {
        width: usize,
        window: usize,
        ratio: usize,
        block_width: usize,
    },
    /// A recurrent layer's state, which folds every position fed into a fixed size and so
    /// cannot be rolled back: a short causal convolution's last inputs and, for a gated
    /// delta-rule layer, one state matrix per head (see [`RecurrentShape`]).
    Recurrent(RecurrentShape),
    /// Nothing kept between steps (a layer whose mixing sees only its own position).
    None,
}

/// The size of a recurrent layer's state.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RecurrentShape {
    /// Channels of the causal convolution (0: none) and its kernel width: the state keeps the
    /// last `conv_kernel − 1` inputs of every channel.
    pub conv_channels: usize,
    pub conv_kernel: usize,
    /// Heads of the delta rule (0: none), each a `key_dim × value_dim` state matrix.
    pub heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

impl RecurrentShape {
    /// f32 values of the convolution's window and of the state matrices.
    fn lens(&self) -> (usize, usize) {
        (
            self.conv_channels * self.conv_kernel.saturating_sub(1),
            self.heads * self.key_dim * self.value_dim,
        )
    }
}

/// One layer's keys and values.
pub struct KvLayer {
    pub kind: MemoryKind,
    /// `n_head_kv · head_dim`: the width of one position's key (and value).
    pub kv_dim: usize,
    /// Positions held: `n_ctx` (full), or the ring's slots.
    cap: usize,
    k: Vec<f32>,
    /// Empty for a latent memory, whose value of a position is its key row.
    v: Vec<f32>,
    /// Ring only: the position each slot holds (`u32::MAX` = none yet).
    slot_pos: Vec<u32>,
    /// A latent memory ([`LayerMemory::Latent`]): keys only, read back as values too.
    latent: bool,
    /// A compressed memory's blocks ([`LayerMemory::Compressed`]): `block_width` floats per
    /// block of `ratio` positions (empty otherwise).
    blocks: Vec<f32>,
    block_width: usize,
    ratio: usize,
}

/// Where attention reads a position's key and value: the layer's memory, or — for the
/// positions of the batch in flight in a ring layer — the batch's own rows.
pub enum KvSource<'a> {
    Full {
        k: &'a [f32],
        v: &'a [f32],
        kv_dim: usize,
    },
    Ring {
        k: &'a [f32],
        v: &'a [f32],
        kv_dim: usize,
        cap: usize,
        batch_k: &'a [f32],
        batch_v: &'a [f32],
        /// Position of the batch's first row (rows are consecutive).
        first: usize,
    },
}

impl KvSource<'_> {
    // Always: the attention kernels call these per key inside loops that keep their
    // accumulators in registers, which a call would spill.
    #[inline(always)]
    pub fn key(&self, pos: usize) -> &[f32] {
        match self {
            KvSource::Full { k, kv_dim, .. } => &k[pos * kv_dim..(pos + 1) * kv_dim],
            KvSource::Ring {
                k,
                kv_dim,
                cap,
                batch_k,
                first,
                ..
            } => {
                if pos >= *first {
                    let r = pos - first;
                    &batch_k[r * kv_dim..(r + 1) * kv_dim]
                } else {
                    let s = pos % cap;
                    &k[s * kv_dim..(s + 1) * kv_dim]
                }
            }
        }
    }

    #[inline(always)]
    pub fn value(&self, pos: usize) -> &[f32] {
        match self {
            KvSource::Full { v, kv_dim, .. } => &v[pos * kv_dim..(pos + 1) * kv_dim],
            KvSource::Ring {
                v,
                kv_dim,
                cap,
                batch_v,
                first,
                ..
            } => {
                if pos >= *first {
                    let r = pos - first;
                    &batch_v[r * kv_dim..(r + 1) * kv_dim]
                } else {
                    let s = pos % cap;
                    &v[s * kv_dim..(s + 1) * kv_dim]
                }
            }
        }
    }
}

impl LayerMemory {
    /// A full or ring attention memory of `n_head_kv` heads of `head_dim`.
    pub fn kv(kind: MemoryKind, n_head_kv: usize, head_dim: usize) -> LayerMemory {
        LayerMemory::Kv {
            kind,
            n_head_kv,
            head_dim,
        }
    }

    /// Bytes (f32) this memory holds at a context of `n_ctx`: keys and values of the
    /// positions a full or ring layer keeps; a recurrent layer's state and its turn-boundary
    /// copy, whatever the context.
    pub fn bytes(&self, n_ctx: usize) -> u64 {
        match *self {
            LayerMemory::Kv {
                kind,
                n_head_kv,
                head_dim,
            } => {
                let (cap, _) = capacity(kind, n_ctx, RING_SLACK);
                8 * (cap * n_head_kv * head_dim) as u64
            }
            LayerMemory::Latent { width } => 4 * (n_ctx * width) as u64,
            LayerMemory::Compressed {
                width,
                window,
                ratio,
                block_width,
            } => {
                let (cap, _) = capacity(MemoryKind::Ring { window }, n_ctx, RING_SLACK);
                let blocks = n_ctx.checked_div(ratio).unwrap_or(0);
                4 * (cap * width + blocks * block_width) as u64
            }
            LayerMemory::Recurrent(r) => {
                let (conv, state) = r.lens();
                2 * 4 * (conv + state) as u64
            }
            LayerMemory::None => 0,
        }
    }
}

/// The positions a KV memory of `kind` holds at a context of `n_ctx` — a ring its window plus
/// `slack` positions a turn may roll back — and its kind as built.
fn capacity(kind: MemoryKind, n_ctx: usize, slack: usize) -> (usize, MemoryKind) {
    match kind {
        MemoryKind::Full => (n_ctx, MemoryKind::Full),
        MemoryKind::Ring { window } => {
            let w = window.min(n_ctx).max(1);
            (
                (w + slack).min(n_ctx.max(w)),
                MemoryKind::Ring { window: w },
            )
        }
    }
}

impl KvLayer {
    fn new(kind: MemoryKind, kv_dim: usize, n_ctx: usize) -> KvLayer {
        KvLayer::with_slack(kind, kv_dim, n_ctx, RING_SLACK)
    }

    fn with_slack(kind: MemoryKind, kv_dim: usize, n_ctx: usize, slack: usize) -> KvLayer {
        let (cap, kind) = capacity(kind, n_ctx, slack);
        KvLayer {
            kind,
            kv_dim,
            cap,
            k: vec![0.0; cap * kv_dim],
            v: vec![0.0; cap * kv_dim],
            slot_pos: match kind {
                MemoryKind::Ring { .. } => vec![u32::MAX; cap],
                MemoryKind::Full => Vec::new(),
            },
            latent: false,
            blocks: Vec::new(),
            block_width: 0,
            ratio: 0,
        }
    }

    /// A latent memory of `width`-float rows at every position (full, never a ring).
    fn latent(width: usize, n_ctx: usize) -> KvLayer {
        KvLayer {
            kind: MemoryKind::Full,
            kv_dim: width,
            cap: n_ctx,
            k: vec![0.0; n_ctx * width],
            v: Vec::new(),
            slot_pos: Vec::new(),
            latent: true,
            blocks: Vec::new(),
            block_width: 0,
            ratio: 0,
        }
    }

    /// A compressed memory ([`LayerMemory::Compressed`]): a latent ring and its blocks.
    fn compressed(
        width: usize,
        window: usize,
        ratio: usize,
        block_width: usize,
        n_ctx: usize,
    ) -> KvLayer {
        let (cap, kind) = capacity(MemoryKind::Ring { window }, n_ctx, RING_SLACK);
        let n_blocks = n_ctx.checked_div(ratio).unwrap_or(0);
        KvLayer {
            kind,
            kv_dim: width,
            cap,
            k: vec![0.0; cap * width],
            v: Vec::new(),
            slot_pos: vec![u32::MAX; cap],
            latent: true,
            blocks: vec![0.0; n_blocks * block_width],
            block_width,
            ratio,
        }
    }

    /// Bytes this layer holds.
    pub fn bytes(&self) -> usize {
        4 * (self.k.len() + self.v.len() + self.blocks.len())
    }

    /// A compressed memory's source for the batch, as [`KvLayer::source`] gives a ring's (the
    /// batch's rows read from `batch` until [`KvLayer::commit`] stores them), and beside it
    /// the block rows, to write the blocks the batch finishes (`block_width` floats each).
    pub fn source_and_blocks<'a>(
        &'a mut self,
        layer: usize,
        positions: &[u32],
        batch: &'a [f32],
    ) -> Result<(KvSource<'a>, &'a mut [f32]), ArchError> {
        let first = self.ring_first(layer, positions)?;
        let KvLayer {
            k,
            kv_dim,
            cap,
            blocks,
            ..
        } = self;
        Ok((
            KvSource::Ring {
                k,
                v: k,
                kv_dim: *kv_dim,
                cap: *cap,
                batch_k: batch,
                batch_v: batch,
                first,
            },
            blocks,
        ))
    }

    /// A ring layer's checks before a batch: consecutive positions, and the window before the
    /// first still held. The first position.
    fn ring_first(&self, layer: usize, positions: &[u32]) -> Result<usize, ArchError> {
        let MemoryKind::Ring { window } = self.kind else {
            return Err(ring_err(layer, "is not a ring".into()));
        };
        let first = positions.first().copied().unwrap_or(0) as usize;
        if positions
            .iter()
            .enumerate()
            .any(|(r, &p)| p as usize != first + r)
        {
            return Err(ring_err(
                layer,
                "a sliding-window layer needs the batch's positions consecutive".into(),
            ));
        }
        if !self.holds_window_before(first) {
            let q = (first.saturating_sub(window - 1)..first)
                .find(|&q| self.slot_pos[q % self.cap] != q as u32)
                .unwrap_or(first);
            return Err(ring_err(
                layer,
                format!(
                    "its ring no longer holds position {q} (the window before position {first}); re-run the prompt"
                ),
            ));
        }
        Ok(first)
    }

    /// Take the batch's keys and values (`positions.len()` rows of `kv_dim`) and give the
    /// source attention reads them through. A full layer stores them first; a ring layer
    /// checks it still holds the window before the batch (the batch's positions must be
    /// consecutive) and stores the batch's last `window` rows after attention
    /// ([`KvLayer::commit`]).
    pub fn source<'a>(
        &'a mut self,
        layer: usize,
        positions: &[u32],
        batch_k: &'a [f32],
        batch_v: &'a [f32],
    ) -> Result<KvSource<'a>, ArchError> {
        let d = self.kv_dim;
        match self.kind {
            MemoryKind::Full => {
                if positions.iter().any(|&p| p as usize >= self.cap) {
                    return Err(ArchError::Key {
                        file: String::new(),
                        key: format!("blk.{layer} KV"),
                        what: format!("holds {} positions: the context is full", self.cap),
                    });
                }
                for (r, &p) in positions.iter().enumerate() {
                    let base = p as usize * d;
                    self.k[base..base + d].copy_from_slice(&batch_k[r * d..(r + 1) * d]);
                    if !self.latent {
                        self.v[base..base + d].copy_from_slice(&batch_v[r * d..(r + 1) * d]);
                    }
                }
                Ok(KvSource::Full {
                    k: &self.k,
                    v: if self.latent { &self.k } else { &self.v },
                    kv_dim: d,
                })
            }
            MemoryKind::Ring { .. } => {
                // The first row looks back furthest: window − 1 positions before it.
                let first = self.ring_first(layer, positions)?;
                Ok(KvSource::Ring {
                    k: &self.k,
                    v: if self.latent { &self.k } else { &self.v },
                    kv_dim: d,
                    cap: self.cap,
                    batch_k,
                    batch_v,
                    first,
                })
            }
        }
    }

    /// Whether a batch may start at position `first`: a full layer always; a ring while it
    /// still holds the `window − 1` positions before it.
    pub fn holds_window_before(&self, first: usize) -> bool {
        let MemoryKind::Ring { window } = self.kind else {
            return true;
        };
        (first.saturating_sub(window - 1)..first).all(|q| self.slot_pos[q % self.cap] == q as u32)
    }

    /// After attention: a ring layer stores the batch's last rows (as many as it has slots).
    pub fn commit(&mut self, positions: &[u32], batch_k: &[f32], batch_v: &[f32]) {
        if self.kind == MemoryKind::Full {
            return;
        }
        let d = self.kv_dim;
        let skip = positions.len().saturating_sub(self.cap);
        for (r, &p) in positions.iter().enumerate().skip(skip) {
            let s = p as usize % self.cap;
            self.k[s * d..(s + 1) * d].copy_from_slice(&batch_k[r * d..(r + 1) * d]);
            if !self.latent {
                self.v[s * d..(s + 1) * d].copy_from_slice(&batch_v[r * d..(r + 1) * d]);
            }
            self.slot_pos[s] = p;
        }
    }
}

fn ring_err(layer: usize, what: String) -> ArchError {
    ArchError::Key {
        file: String::new(),
        key: format!("blk.{layer} KV"),
        what,
    }
}

/// One layer's memory as a session holds it (built from its [`LayerMemory`]).
pub enum Memory {
    Kv(KvLayer),
    Recurrent(RecurrentLayer),
    None,
}

/// A recurrent layer's state: the convolution's last inputs and the delta rule's matrices,
/// as they stand after the positions folded in so far.
pub struct RecurrentLayer {
    pub shape: RecurrentShape,
    /// The last `conv_kernel − 1` inputs of every channel, oldest first
    /// (`(conv_kernel − 1) × conv_channels`).
    pub conv: Vec<f32>,
    /// Per head, its `key_dim × value_dim` state matrix.
    pub state: Vec<f32>,
    /// Positions folded in: the state is the one after position `seen − 1`.
    seen: usize,
    /// The state at a turn boundary ([`State::mark_boundary`]), kept so that a later turn
    /// whose prompt shares that much but not what followed it (a template that re-renders
    /// the answer, a regenerated reply) continues from there instead of from 0.
    mark: Option<Mark>,
    /// Keep [`RowMarks`] for the batches that follow (a speculative verify decode:
    /// [`State::keep_rows`]).
    keep_rows: bool,
    /// The state after each row but the last of the last batch, while `keep_rows` asked for
    /// them: the next batch may start after any of its rows (a verify decode whose later
    /// drafts were rejected), as an attention layer simply writes over the rows past it.
    rows: RowMarks,
}

/// The states a batch of `n` rows from position `first` left after each of its rows but the
/// last (`n − 1` copies, row `t` after position `first + t`); none when `n` is 0.
#[derive(Default)]
struct RowMarks {
    first: usize,
    n: usize,
    conv: Vec<f32>,
    state: Vec<f32>,
}

impl RowMarks {
    /// The row whose state stands before position `at`, if one is kept.
    fn row_before(&self, at: usize) -> Option<usize> {
        (at > self.first && at < self.first + self.n).then(|| at - self.first - 1)
    }
}

/// A recurrent state as it stood after position `at − 1`.
struct Mark {
    at: usize,
    conv: Vec<f32>,
    state: Vec<f32>,
}

impl RecurrentLayer {
    fn new(shape: RecurrentShape) -> RecurrentLayer {
        let (conv, state) = shape.lens();
        RecurrentLayer {
            shape,
            conv: vec![0.0; conv],
            state: vec![0.0; state],
            seen: 0,
            mark: None,
            keep_rows: false,
            rows: RowMarks::default(),
        }
    }

    /// Positions a batch may start at beside 0 and `seen`: after a kept row of the last
    /// batch.
    fn row_mark_at(&self, at: usize) -> bool {
        self.rows.row_before(at).is_some()
    }

    /// Where the turn-boundary copy stands, if one is kept.
    pub fn mark(&self) -> Option<usize> {
        self.mark.as_ref().map(|m| m.at)
    }

    /// Positions folded in so far.
    pub fn seen(&self) -> usize {
        self.seen
    }

    /// Start a batch of consecutive `positions`: from a zero state when it starts at 0,
    /// from the state as it stands when it starts at the next position, from the kept
    /// turn-boundary copy when it starts where that stands; anything else is refused by name
    /// — a recurrent state cannot be rolled back (a session restores a snapshot or feeds the
    /// prompt again). The caller folds the batch in, then [`RecurrentLayer::finish`]es it.
    pub fn begin(&mut self, layer: usize, positions: &[u32]) -> Result<(), ArchError> {
        let first = positions.first().copied().unwrap_or(0) as usize;
        if positions
            .iter()
            .enumerate()
            .any(|(r, &p)| p as usize != first + r)
        {
            return Err(recurrent_err(
                layer,
                "a recurrent layer needs the batch's positions consecutive".into(),
            ));
        }
        if first == 0 {
            self.conv.fill(0.0);
            self.state.fill(0.0);
            self.seen = 0;
            // The attention layers' rows before the copy are about to be rewritten: it would
            // describe a past that is gone. (No other accepted start lies below it: the copy
            // never stands past `seen`.)
            self.mark = None;
        } else if first == self.seen {
            // Continues where it stands.
        } else if let Some(m) = self.mark.as_ref().filter(|m| m.at == first) {
            self.conv.copy_from_slice(&m.conv);
            self.state.copy_from_slice(&m.state);
            self.seen = first;
        } else if let Some(t) = self.rows.row_before(first) {
            // A verify decode's rows past `first − 1` were rejected: the state after its
            // row `t`, as a decode of just those rows would have left it.
            let (c, s) = (self.conv.len(), self.state.len());
            self.conv
                .copy_from_slice(&self.rows.conv[t * c..(t + 1) * c]);
            self.state
                .copy_from_slice(&self.rows.state[t * s..(t + 1) * s]);
            self.seen = first;
        } else {
            return Err(recurrent_err(
                layer,
                format!(
                    "its state is the one after position {} and cannot start a batch at \
                     position {first} (a recurrent state cannot roll back); re-run the prompt",
                    self.seen as i64 - 1
                ),
            ));
        }
        // The rows kept describe the batch before this one: gone now, or kept anew.
        let n = if self.keep_rows { positions.len() } else { 0 };
        let (c, s) = (self.conv.len(), self.state.len());
        let kept = n.saturating_sub(1);
        self.rows.first = first;
        self.rows.n = n;
        self.rows.conv.resize(kept * c, 0.0);
        self.rows.state.resize(kept * s, 0.0);
        Ok(())
    }

    /// While a batch folds in: its row `t` has updated the convolution's window (`conv`).
    /// Kept when the batch keeps its rows ([`State::keep_rows`]) and `t` is not its last.
    pub fn row_conv_done(&mut self, t: usize) {
        if t + 1 < self.rows.n {
            let c = self.conv.len();
            self.rows.conv[t * c..(t + 1) * c].copy_from_slice(&self.conv);
        }
    }

    /// As [`RecurrentLayer::row_conv_done`], for a layer that keeps its window elsewhere
    /// while the batch folds in: `window` is the window after row `t`.
    pub fn row_conv_is(&mut self, t: usize, window: &[f32]) {
        if t + 1 < self.rows.n {
            let c = self.conv.len();
            self.rows.conv[t * c..(t + 1) * c].copy_from_slice(window);
        }
    }

    /// While a batch folds in: its row `t` has updated every state matrix (`state`).
    pub fn row_state_done(&mut self, t: usize) {
        if t + 1 < self.rows.n {
            let s = self.state.len();
            self.rows.state[t * s..(t + 1) * s].copy_from_slice(&self.state);
        }
    }

    /// After folding in the batch `begin` accepted.
    pub fn finish(&mut self, positions: &[u32]) {
        if let Some(&last) = positions.last() {
            self.seen = last as usize + 1;
        }
    }

    /// Copy the state as it stands into the turn-boundary copy (replacing the last).
    fn mark_here(&mut self) {
        let m = self.mark.get_or_insert_with(|| Mark {
            at: 0,
            conv: Vec::new(),
            state: Vec::new(),
        });
        m.at = self.seen;
        m.conv.clone_from(&self.conv);
        m.state.clone_from(&self.state);
    }
}

fn recurrent_err(layer: usize, what: String) -> ArchError {
    ArchError::Key {
        file: String::new(),
        key: format!("blk.{layer} recurrent state"),
        what,
    }
}

impl Memory {
    fn new(m: LayerMemory, n_ctx: usize) -> Memory {
        match m {
            LayerMemory::Kv {
                kind,
                n_head_kv,
                head_dim,
            } => Memory::Kv(KvLayer::new(kind, n_head_kv * head_dim, n_ctx)),
            LayerMemory::Latent { width } => Memory::Kv(KvLayer::latent(width, n_ctx)),
            LayerMemory::Compressed {
                width,
                window,
                ratio,
                block_width,
            } => Memory::Kv(KvLayer::compressed(
                width,
                window,
                ratio,
                block_width,
                n_ctx,
            )),
            LayerMemory::Recurrent(r) => Memory::Recurrent(RecurrentLayer::new(r)),
            LayerMemory::None => Memory::None,
        }
    }

    /// The layer's keys and values, or an error naming a layer that keeps none.
    pub fn kv(&mut self, layer: usize) -> Result<&mut KvLayer, ArchError> {
        match self {
            Memory::Kv(kv) => Ok(kv),
            _ => Err(ArchError::Key {
                file: String::new(),
                key: format!("blk.{layer} KV"),
                what: "is not kept: the architecture declared no attention memory for this layer"
                    .into(),
            }),
        }
    }

    /// The layer's recurrent state, or an error naming a layer that keeps none.
    pub fn recurrent(&mut self, layer: usize) -> Result<&mut RecurrentLayer, ArchError> {
        match self {
            Memory::Recurrent(r) => Ok(r),
            _ => Err(recurrent_err(
                layer,
                "is not kept: the architecture declared no recurrent memory for this layer".into(),
            )),
        }
    }

    /// Bytes this layer holds.
    pub fn bytes(&self) -> usize {
        match self {
            Memory::Kv(kv) => kv.bytes(),
            Memory::Recurrent(r) => {
                // The row copies as allocated: a verify decode's stay for the next one.
                4 * (r.conv.len() + r.state.len())
                    + 4 * (r.rows.conv.capacity() + r.rows.state.capacity())
                    + r.mark
                        .as_ref()
                        .map_or(0, |m| 4 * (m.conv.len() + m.state.len()))
            }
            Memory::None => 0,
        }
    }

    /// Whether a batch may start at position `n`: a full layer always, a ring while it holds
    /// the window before `n`, a recurrent state at 0 or where it stands.
    fn holds_before(&self, n: usize) -> bool {
        match self {
            Memory::Kv(kv) => kv.holds_window_before(n),
            Memory::Recurrent(r) => {
                n == 0 || n == r.seen || r.mark() == Some(n) || r.row_mark_at(n)
            }
            Memory::None => true,
        }
    }
}

/// A copy of every layer's memory of positions `0..n`: the whole sequence state, as a decide
/// keeps it after its prefix (`Backend::keep_prefix`). A full layer keeps the rows of those
/// positions; a ring layer the slots holding positions below `n` (a ring that has since moved
/// past them cannot give them back: restoring it leaves those slots empty and the next batch
/// that needs them is refused by name); a recurrent layer its state, which must stand at `n`.
#[derive(Debug, Default)]
pub struct KvSnapshot {
    n: usize,
    layers: Vec<LayerSnap>,
}

#[derive(Debug, Default)]
struct LayerSnap {
    k: Vec<f32>,
    v: Vec<f32>,
    /// Ring layers: the position of each kept slot (`u32::MAX` = not kept).
    slot_pos: Vec<u32>,
    /// Compressed layers: the rows of the blocks finished below the snapshot's length.
    blocks: Vec<f32>,
    /// Recurrent layers: the state after the snapshot's last position.
    conv: Vec<f32>,
    state: Vec<f32>,
}

impl KvSnapshot {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.n
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// Bytes of memory held.
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| {
                (l.k.capacity()
                    + l.v.capacity()
                    + l.blocks.capacity()
                    + l.conv.capacity()
                    + l.state.capacity())
                    * std::mem::size_of::<f32>()
                    + l.slot_pos.capacity() * std::mem::size_of::<u32>()
            })
            .sum::<usize>() as u64
    }
}

impl KvLayer {
    fn snapshot(&self, n: usize, into: &mut LayerSnap) {
        let d = self.kv_dim;
        into.k.clear();
        into.v.clear();
        into.slot_pos.clear();
        match self.kind {
            MemoryKind::Full => {
                into.k.extend_from_slice(&self.k[..n * d]);
                if !self.latent {
                    into.v.extend_from_slice(&self.v[..n * d]);
                }
            }
            MemoryKind::Ring { .. } => {
                into.k.extend_from_slice(&self.k);
                into.v.extend_from_slice(&self.v);
                into.slot_pos.extend(self.slot_pos.iter().map(|&p| {
                    if (p as usize) < n {
                        p
                    } else {
                        u32::MAX
                    }
                }));
            }
        }
        into.blocks.clear();
        if let Some(done) = n.checked_div(self.ratio) {
            into.blocks
                .extend_from_slice(&self.blocks[..done * self.block_width]);
        }
        // Hold what this snapshot needs, not what a longer earlier one did.
        into.k.shrink_to_fit();
        into.v.shrink_to_fit();
        into.blocks.shrink_to_fit();
    }

    fn restore(&mut self, n: usize, snap: &LayerSnap) -> bool {
        let d = self.kv_dim;
        match self.kind {
            MemoryKind::Full => {
                let nv = if self.latent { 0 } else { n * d };
                if snap.k.len() != n * d || snap.v.len() != nv {
                    return false;
                }
                self.k[..n * d].copy_from_slice(&snap.k);
                self.v[..nv].copy_from_slice(&snap.v);
            }
            MemoryKind::Ring { .. } => {
                if snap.k.len() != self.k.len() || snap.slot_pos.len() != self.slot_pos.len() {
                    return false;
                }
                self.k.copy_from_slice(&snap.k);
                self.v.copy_from_slice(&snap.v);
                self.slot_pos.copy_from_slice(&snap.slot_pos);
            }
        }
        let done = n.checked_div(self.ratio).unwrap_or(0);
        if snap.blocks.len() != done * self.block_width {
            return false;
        }
        self.blocks[..snap.blocks.len()].copy_from_slice(&snap.blocks);
        true
    }
}

impl Memory {
    /// Copy this layer's memory of positions `0..n` into `into`; a recurrent state must stand
    /// at `n` (a state that moved on is gone).
    fn snapshot(&self, layer: usize, n: usize, into: &mut LayerSnap) -> Result<(), ArchError> {
        into.conv.clear();
        into.state.clear();
        into.blocks.clear();
        match self {
            Memory::Kv(kv) => kv.snapshot(n, into),
            Memory::Recurrent(r) => {
                if r.seen != n {
                    return Err(recurrent_err(
                        layer,
                        format!(
                            "cannot be copied at position {n}: it stands after position {}",
                            r.seen as i64 - 1
                        ),
                    ));
                }
                into.k.clear();
                into.v.clear();
                into.slot_pos.clear();
                into.conv.extend_from_slice(&r.conv);
                into.state.extend_from_slice(&r.state);
            }
            Memory::None => {
                into.k.clear();
                into.v.clear();
                into.slot_pos.clear();
            }
        }
        into.conv.shrink_to_fit();
        into.state.shrink_to_fit();
        Ok(())
    }

    /// Put `snap` (of `n` positions) back; false when it is not this layer's shape.
    fn restore(&mut self, n: usize, snap: &LayerSnap) -> bool {
        match self {
            Memory::Kv(kv) => kv.restore(n, snap),
            Memory::Recurrent(r) => {
                if snap.conv.len() != r.conv.len() || snap.state.len() != r.state.len() {
                    return false;
                }
                r.conv.copy_from_slice(&snap.conv);
                r.state.copy_from_slice(&snap.state);
                r.seen = n;
                // The snapshot may come from another history than the copy (a decide kept
                // before a new prompt): the attention rows under it are the snapshot's now.
                r.mark = None;
                r.rows.n = 0;
                true
            }
            Memory::None => true,
        }
    }
}

/// Scratch for a layer's matrix products and FFN.
#[derive(Default)]
pub struct Scratch {
    pub acts: Vec<ActBuf>,
    pub act2: Vec<ActBuf>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
    pub tmp: Vec<f32>,
    pub rope: Vec<f32>,
}

/// Attention's buffers for the batch in flight.
#[derive(Default)]
pub struct AttnBufs {
    /// Projected queries, keys and values, one row per batch row.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// The heads' output, before the output projection.
    pub att: Vec<f32>,
    /// Score scratch.
    pub scores: Vec<f32>,
}

/// The routed experts' buffers of the MoE layer in flight, written by [`super::Model`] (an
/// architecture reads only their sum, [`State::moe_out`]).
#[derive(Default)]
pub struct ExpertBufs {
    /// Width of the layer's routing (experts per FFN row).
    pub k: usize,
    /// `ffn_rows × k × d` per-rank expert outputs, already weighted, and which were computed
    /// (a dropped rank never is).
    pub per_rank: Vec<f32>,
    pub filled: Vec<bool>,
    /// An expert's input and output rows for the routings it serves.
    pub expert_in: Vec<f32>,
    pub expert_out: Vec<f32>,
    /// `h`'s rows quantised once per layer for the experts' first projection, and the layer
    /// and activation format they hold (`None`: stale; `dense` makes them so).
    pub h_acts: Vec<ActBuf>,
    pub h_acts_for: Option<(usize, ActFormat)>,
}

/// Expert prediction's buffers: the router input of the batch's last routed row at the MoE
/// layer routed last (`layer`), kept until the next `route`, and the scratch of a later
/// layer's router applied to it.
#[derive(Default)]
pub struct Prediction {
    pub input: Vec<f32>,
    pub layer: Option<usize>,
    pub acts: Vec<ActBuf>,
    pub scores: Vec<f32>,
    /// Every expert by ranking score (the gating's selection order; `route` uses it too).
    pub order: Vec<u32>,
}

/// Per-session mutable state: each layer's memory and the buffers of the batch in flight.
pub struct State {
    pub n_ctx: usize,
    pub mem: Vec<Memory>,
    /// Batch rows in flight, their tokens and positions.
    pub n_rows: usize,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// The residual stream, `n_rows × d_model`.
    pub x: Vec<f32>,
    /// A family's residual when it is wider than one stream (deepseek4's hyper-connections:
    /// `n_rows × hc·d_model`), and what its layer carries from `dense` to `finish_layer`
    /// per FFN row (the streams' mix); empty for every other family.
    pub streams: Vec<f32>,
    pub stream_mix: Vec<f32>,
    /// A layer's normed input (attention's, a dense FFN's).
    pub cur: Vec<f32>,
    pub attn: AttnBufs,
    /// An `n_rows × d_model` output (attention's after `attn_output`, an FFN's).
    pub out: Vec<f32>,
    /// Rows the FFN runs for at the current layer (all, or the output rows at the last).
    pub ffn_rows: Vec<u32>,
    /// The experts' input, one row per FFN row.
    pub h: Vec<f32>,
    /// The router's input when it is not `h` (`router_separate`), one row per FFN row.
    pub router_in: Vec<f32>,
    pub router_separate: bool,
    /// A resident FFN's output for the FFN rows (a shared expert, a parallel dense MLP),
    /// combined with the experts' by the architecture's `finish_layer`.
    pub side: Vec<f32>,
    pub experts: ExpertBufs,
    /// The experts' sum per FFN row (rank order), for `finish_layer`.
    pub moe_out: Vec<f32>,
    pub scratch: Scratch,
    pub pred: Prediction,
    /// Per batch row, the smallest router margin over the MoE layers that routed it: the
    /// k-th chosen expert's ranking score less the best unchosen one's, in logit units
    /// (`Gating::rank_score`); infinite for a row no layer routed. A row routed at a near-tie
    /// flips its choice on last-bit differences — what `--logits-out` reports it for.
    pub router_margin: Vec<f32>,
    /// Rows whose logits are wanted at the end of the batch.
    pub out_rows: Vec<u32>,
    /// Run the last layer's FFN for every row, not just `out_rows`: every row's final hidden
    /// state is wanted (the MTP head's input).
    pub every_row_out: bool,
    /// `out_rows.len() × n_vocab` logits after `head`.
    pub logits: Vec<f32>,
    /// `--compute-trace` / `--compute-trace-layers`: the op clock, when tracing.
    pub trace: Option<Box<crate::optrace::OpTrace>>,
    /// Sequences beside `mem` (`serve --parallel`): sequence `s ≥ 1`'s memory is
    /// `seqs[s - 1]`, sequence 0's is `mem`.
    pub seqs: Vec<Vec<Memory>>,
    /// The batch in flight as runs of rows of one sequence each: (sequence, first row, rows),
    /// in row order. Empty: every row is sequence 0's (a one-sequence run).
    pub groups: Vec<(usize, usize, usize)>,
}

impl State {
    /// State for a model whose layers remember `memory` (one entry per layer), for contexts
    /// of up to `n_ctx` positions.
    pub fn new(memory: &[LayerMemory], n_ctx: usize) -> State {
        State {
            n_ctx,
            mem: memory.iter().map(|&m| Memory::new(m, n_ctx)).collect(),
            n_rows: 0,
            tokens: Vec::new(),
            positions: Vec::new(),
            x: Vec::new(),
            streams: Vec::new(),
            stream_mix: Vec::new(),
            cur: Vec::new(),
            attn: AttnBufs::default(),
            out: Vec::new(),
            ffn_rows: Vec::new(),
            h: Vec::new(),
            router_in: Vec::new(),
            router_separate: false,
            side: Vec::new(),
            experts: ExpertBufs::default(),
            moe_out: Vec::new(),
            scratch: Scratch::default(),
            pred: Prediction::default(),
            router_margin: Vec::new(),
            out_rows: Vec::new(),
            every_row_out: false,
            logits: Vec::new(),
            trace: None,
            seqs: Vec::new(),
            groups: Vec::new(),
        }
    }

    /// Hold `n` sequences in all (`mem` and `n − 1` more of its shape and context size).
    pub fn set_sequences(&mut self, memory: &[LayerMemory], n: usize) {
        let n_ctx = self.n_ctx;
        self.seqs.truncate(n.saturating_sub(1));
        while self.seqs.len() + 1 < n {
            self.seqs
                .push(memory.iter().map(|&m| Memory::new(m, n_ctx)).collect());
        }
    }

    /// [`State::reusable_prefix`] of sequence `seq` (a KV-only model's: where every layer
    /// still holds what a batch starting there looks back at).
    pub fn seq_reusable_prefix(&self, seq: usize, n: usize) -> usize {
        if seq == 0 {
            return self.reusable_prefix(n);
        }
        match self.seqs.get(seq - 1) {
            Some(mem) if mem.iter().all(|l| l.holds_before(n)) => n,
            _ => 0,
        }
    }

    /// `--compute-trace`: the op of `layer` named `name` ends here (nothing when not tracing).
    #[inline]
    pub fn mark(&mut self, layer: usize, op: &'static str, name: &'static str) {
        if let Some(t) = self.trace.as_mut() {
            t.mark(layer as i32, op, name);
        }
    }

    /// Keep, or stop keeping, each recurrent layer's state after every row of the batches
    /// that follow (a speculative verify decode), so that the next batch may start after any
    /// of them: what lets a hybrid verify a drafted group and take back the rejected rows.
    pub fn keep_rows(&mut self, on: bool) {
        for l in &mut self.mem {
            if let Memory::Recurrent(r) = l {
                r.keep_rows = on;
            }
        }
    }

    /// Copy every layer's memory of positions `0..n` into `into`, reusing its buffers.
    pub fn snapshot_kv(&self, n: usize, into: &mut KvSnapshot) -> Result<(), ArchError> {
        if n > self.n_ctx {
            return Err(ArchError::Key {
                file: String::new(),
                key: "n_ctx".into(),
                what: format!(
                    "a snapshot of {n} positions is past the context size {}",
                    self.n_ctx
                ),
            });
        }
        into.n = n;
        into.layers.resize_with(self.mem.len(), LayerSnap::default);
        for (layer, (l, s)) in self.mem.iter().zip(&mut into.layers).enumerate() {
            l.snapshot(layer, n, s)?;
        }
        Ok(())
    }

    /// Put `snap`'s memory back: positions `0..snap.len()` of every layer read exactly as they
    /// did when it was taken, whatever was fed since.
    pub fn restore_kv(&mut self, snap: &KvSnapshot) -> Result<(), ArchError> {
        let n = snap.n;
        let fits = n <= self.n_ctx
            && snap.layers.len() == self.mem.len()
            && self
                .mem
                .iter_mut()
                .zip(&snap.layers)
                .all(|(l, s)| l.restore(n, s));
        if !fits {
            return Err(ArchError::Key {
                file: String::new(),
                key: "kv snapshot".into(),
                what: format!(
                    "{n} positions of {} layers do not fit this model's {} layers",
                    snap.layers.len(),
                    self.mem.len()
                ),
            });
        }
        Ok(())
    }

    /// The longest prefix of at most `n` positions the next batch can continue from: `n`
    /// when every layer holds what a batch starting there reads; else where the recurrent
    /// layers stand (a chat whose last sampled token was never fed: its state stands one
    /// short of the context), or their turn-boundary copy ([`State::mark_boundary`]: a
    /// template that re-renders the previous answer shares the messages, not what followed),
    /// the longer of the two that is at most `n` and that every layer holds what a batch
    /// starting there reads; else 0 (a ring that moved on past its slack, a recurrent state
    /// past `n` with no copy below: the prompt is fed again, as llama.cpp does for its
    /// sliding and recurrent layers).
    pub fn reusable_prefix(&self, n: usize) -> usize {
        if self.mem.iter().all(|l| l.holds_before(n)) {
            return n;
        }
        let Some(r) = self.mem.iter().find_map(|l| match l {
            Memory::Recurrent(r) => Some(r),
            _ => None,
        }) else {
            return 0;
        };
        // The latest start a kept row allows below `n`.
        let row = (r.rows.n > 1).then(|| (r.rows.first + r.rows.n - 1).min(n.saturating_sub(1)));
        [Some(r.seen), r.mark(), row.filter(|&m| r.row_mark_at(m))]
            .into_iter()
            .flatten()
            .filter(|&m| m < n && self.mem.iter().all(|l| l.holds_before(m)))
            .max()
            .unwrap_or(0)
    }

    /// Keep a copy of every recurrent layer's state standing at `n` (a turn boundary),
    /// replacing the copies kept before; a batch may then start at `n` again
    /// ([`State::reusable_prefix`]) until one starts at 0 or a snapshot is restored. False
    /// (and nothing changed) when the model has no recurrent layer or its states do not stand
    /// at `n`. The copy's bytes are the state's own: qwen35moe's full shape keeps 60 MiB
    /// beside 60.
    pub fn mark_boundary(&mut self, n: usize) -> bool {
        let seen: Vec<usize> = self
            .mem
            .iter()
            .filter_map(|l| match l {
                Memory::Recurrent(r) => Some(r.seen),
                _ => None,
            })
            .collect();
        if n == 0 || seen.is_empty() || seen.iter().any(|&s| s != n) {
            return false;
        }
        for l in &mut self.mem {
            if let Memory::Recurrent(r) = l {
                r.mark_here();
            }
        }
        true
    }

    /// Bytes the layers' memories hold.
    pub fn memory_bytes(&self) -> usize {
        self.mem
            .iter()
            .chain(self.seqs.iter().flatten())
            .map(Memory::bytes)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(window: usize) -> KvLayer {
        KvLayer::with_slack(MemoryKind::Ring { window }, 1, 64, 0)
    }

    /// The KV of layer `l` of `st`.
    fn kv(st: &mut State, l: usize) -> &mut KvLayer {
        st.mem[l].kv(l).unwrap()
    }

    #[test]
    fn a_ring_with_slack_rolls_back_that_far_and_no_further() {
        let mut l = KvLayer::with_slack(MemoryKind::Ring { window: 3 }, 1, 64, 2);
        let pos: Vec<u32> = (0..10).collect();
        let bk: Vec<f32> = pos.iter().map(|&p| p as f32).collect();
        l.source(0, &pos, &bk, &bk).unwrap();
        l.commit(&pos, &bk, &bk);
        // Five slots hold 5..=9: a batch may start at 7 to 10 (it reads the 2 before it),
        // not at 6.
        assert!(l.holds_window_before(10) && l.holds_window_before(7));
        assert!(!l.holds_window_before(6));
        let one = [70.0f32];
        let s = l.source(0, &[7], &one, &one).unwrap();
        assert_eq!(
            (s.key(5), s.key(6), s.key(7)),
            (&[5.0][..], &[6.0][..], &[70.0][..])
        );
        assert!(l.source(0, &[6], &one, &one).is_err());
        // A state built from such layers reuses all of a prefix or, past the slack, none.
        let mut st = State::new(
            &[LayerMemory::kv(MemoryKind::Ring { window: 3 }, 1, 1)],
            4096,
        );
        let pos: Vec<u32> = (0..600).collect();
        let bk = vec![0f32; 600];
        kv(&mut st, 0).source(0, &pos, &bk, &bk).unwrap();
        kv(&mut st, 0).commit(&pos, &bk, &bk);
        // The ring's 3 + RING_SLACK slots hold positions from `oldest` on; a batch at `n`
        // reads back to n − 2.
        let oldest = 600 - (3 + RING_SLACK);
        assert_eq!(st.reusable_prefix(600), 600);
        assert_eq!(st.reusable_prefix(oldest + 2), oldest + 2);
        assert_eq!(st.reusable_prefix(oldest + 1), 0);
    }

    #[test]
    fn a_ring_serves_the_window_from_memory_and_the_batch() {
        let mut l = ring(3);
        // Prefill 0..5: everything comes from the batch.
        let pos: Vec<u32> = (0..5).collect();
        let bk: Vec<f32> = pos.iter().map(|&p| p as f32).collect();
        {
            let s = l.source(0, &pos, &bk, &bk).unwrap();
            assert_eq!(s.key(4), &[4.0]);
        }
        l.commit(&pos, &bk, &bk);
        // Decode 5: positions 3 and 4 come from the ring, 5 from the batch.
        let one = [50.0f32];
        let s = l.source(0, &[5], &one, &one).unwrap();
        assert_eq!(
            (s.key(3), s.key(4), s.key(5)),
            (&[3.0][..], &[4.0][..], &[50.0][..])
        );
    }

    #[test]
    fn a_snapshot_gives_back_the_prefix_of_full_and_ring_layers() {
        let mem = |kind| LayerMemory::kv(kind, 1, 1);
        let mut st = State::new(
            &[mem(MemoryKind::Full), mem(MemoryKind::Ring { window: 4 })],
            16,
        );
        let feed = |st: &mut State, pos: &[u32], base: f32| {
            let b: Vec<f32> = pos.iter().map(|&p| base + p as f32).collect();
            for l in 0..st.mem.len() {
                kv(st, l).source(0, pos, &b, &b).unwrap();
                kv(st, l).commit(pos, &b, &b);
            }
        };
        feed(&mut st, &[0, 1, 2, 3, 4, 5], 0.0);
        let mut snap = KvSnapshot::default();
        st.snapshot_kv(6, &mut snap).unwrap();
        assert_eq!(snap.len(), 6);
        // Feed past the prefix (the ring overwrites positions 2..=5), then restore.
        feed(&mut st, &[6, 7, 8, 9], 100.0);
        st.restore_kv(&snap).unwrap();
        let one = [7.0f32];
        for l in 0..st.mem.len() {
            let s = kv(&mut st, l).source(0, &[6], &one, &one).unwrap();
            assert_eq!(
                (s.key(3), s.key(5), s.value(6)),
                (&[3.0][..], &[5.0][..], &[7.0][..])
            );
        }
        // A snapshot for another model shape is refused.
        let mut other = State::new(&[mem(MemoryKind::Full)], 16);
        assert!(other.restore_kv(&snap).is_err());
        assert!(st.snapshot_kv(17, &mut snap).is_err());
    }

    #[test]
    fn a_ring_refuses_what_it_no_longer_holds() {
        let mut l = ring(2);
        let pos: Vec<u32> = (0..4).collect();
        let bk = vec![0f32; 4];
        l.source(0, &pos, &bk, &bk).unwrap();
        l.commit(&pos, &bk, &bk);
        // Rewinding to position 1 needs position 0, long overwritten.
        assert!(l.source(0, &[1], &bk[..1], &bk[..1]).is_err());
        // Positions must be consecutive.
        assert!(l.source(0, &[4, 6], &bk[..2], &bk[..2]).is_err());
        // Re-deciding the last position is fine.
        assert!(l.source(0, &[3], &bk[..1], &bk[..1]).is_ok());
    }

    /// A layer's recurrent state with its two parts numbered by what was folded in.
    fn fold(r: &mut RecurrentLayer, positions: &[u32]) {
        for &p in positions {
            r.conv.iter_mut().for_each(|v| *v = *v * 0.5 + p as f32);
            r.state.iter_mut().for_each(|v| *v += p as f32);
        }
    }

    /// Fold `positions` in one at a time as a layer does, telling `r` after each row.
    fn fold_rows(r: &mut RecurrentLayer, positions: &[u32]) {
        for (t, &p) in positions.iter().enumerate() {
            fold(r, &[p]);
            r.row_conv_done(t);
            r.row_state_done(t);
        }
    }

    #[test]
    fn a_verify_decode_keeps_the_state_after_each_row_for_the_next_step() {
        let shape = RecurrentShape {
            conv_channels: 2,
            conv_kernel: 3,
            heads: 1,
            key_dim: 2,
            value_dim: 2,
        };
        let mut st = State::new(&[LayerMemory::Recurrent(shape)], 32);
        let r = st.mem[0].recurrent(0).unwrap();
        r.begin(0, &[0, 1, 2]).unwrap();
        fold_rows(r, &[0, 1, 2]);
        r.finish(&[0, 1, 2]);
        let mut after = vec![(r.conv.clone(), r.state.clone())];
        // What a plain decode of positions 3 and 4 leaves.
        for p in [3, 4] {
            r.begin(0, &[p]).unwrap();
            fold_rows(r, &[p]);
            r.finish(&[p]);
            after.push((r.conv.clone(), r.state.clone()));
        }
        // Back to 3 (a snapshot would do; here: a fresh fold), then a verify decode of 3..=6.
        let mut st = State::new(&[LayerMemory::Recurrent(shape)], 32);
        let r = st.mem[0].recurrent(0).unwrap();
        r.begin(0, &[0, 1, 2]).unwrap();
        fold_rows(r, &[0, 1, 2]);
        r.finish(&[0, 1, 2]);
        st.keep_rows(true);
        let r = st.mem[0].recurrent(0).unwrap();
        r.begin(0, &[3, 4, 5, 6]).unwrap();
        fold_rows(r, &[3, 4, 5, 6]);
        r.finish(&[3, 4, 5, 6]);
        st.keep_rows(false);
        assert!(
            st.memory_bytes() > 4 * (2 * 2 + 4),
            "the row copies are counted"
        );
        // Rows 4.. rejected: the next step starts at 5 from the state after 4, and only
        // starts inside the verified rows are allowed.
        assert_eq!(st.reusable_prefix(5), 5);
        assert_eq!(st.reusable_prefix(8), 7, "where the state stands");
        let r = st.mem[0].recurrent(0).unwrap();
        assert!(
            r.begin(0, &[3]).is_err(),
            "the group's first row is never rejected"
        );
        r.begin(0, &[5]).unwrap();
        assert_eq!((r.conv.clone(), r.state.clone()), after[2]);
        // The copies were of the verify decode: a plain step drops them.
        fold_rows(r, &[5]);
        r.finish(&[5]);
        assert!(r.begin(0, &[5]).is_err());
        assert_eq!(st.reusable_prefix(5), 0);
    }

    #[test]
    fn a_recurrent_state_continues_or_restarts_and_never_rolls_back() {
        let shape = RecurrentShape {
            conv_channels: 3,
            conv_kernel: 4,
            heads: 2,
            key_dim: 2,
            value_dim: 3,
        };
        let mut st = State::new(
            &[
                LayerMemory::Recurrent(shape),
                LayerMemory::kv(MemoryKind::Full, 1, 1),
                LayerMemory::None,
            ],
            32,
        );
        assert_eq!(st.memory_bytes(), 4 * (3 * 3 + 2 * 2 * 3) + 2 * 4 * 32);
        assert_eq!(
            LayerMemory::Recurrent(shape).bytes(32),
            2 * 4 * (3 * 3 + 2 * 2 * 3),
            "the state and its turn-boundary copy"
        );
        let r = st.mem[0].recurrent(0).unwrap();
        r.begin(0, &[0, 1, 2]).unwrap();
        fold(r, &[0, 1, 2]);
        r.finish(&[0, 1, 2]);
        assert_eq!(r.seen(), 3);
        assert_eq!(r.mark(), None);
        assert!(!st.mark_boundary(2), "the state does not stand at 2");
        assert!(st.mark_boundary(3));
        let r = st.mem[0].recurrent(0).unwrap();
        assert_eq!(r.mark(), Some(3));
        let after3 = (r.conv.clone(), r.state.clone());
        // Where it stands, and from the start, a batch may begin; nowhere else.
        assert_eq!(st.reusable_prefix(3), 3);
        assert_eq!(st.reusable_prefix(2), 0);
        // A longer prefix continues where the state stands.
        assert_eq!(st.reusable_prefix(5), 3);
        let r = st.mem[0].recurrent(0).unwrap();
        let e = r.begin(0, &[2]).unwrap_err().to_string();
        assert!(e.contains("cannot roll back"), "{e}");
        assert!(
            r.begin(0, &[3, 5]).is_err(),
            "positions must be consecutive"
        );
        // A snapshot at 3 brings the state after position 2 back.
        let mut snap = KvSnapshot::default();
        st.snapshot_kv(3, &mut snap).unwrap();
        assert!(
            st.snapshot_kv(2, &mut snap).is_err(),
            "the state after 1 is gone"
        );
        st.snapshot_kv(3, &mut snap).unwrap();
        let r = st.mem[0].recurrent(0).unwrap();
        r.begin(0, &[3, 4]).unwrap();
        fold(r, &[3, 4]);
        r.finish(&[3, 4]);
        assert_ne!((r.conv.clone(), r.state.clone()), after3);
        st.restore_kv(&snap).unwrap();
        let r = st.mem[0].recurrent(0).unwrap();
        assert_eq!(
            (r.seen(), (r.conv.clone(), r.state.clone())),
            (3, after3.clone())
        );
        assert_eq!(r.mark(), None, "a restore forgets the copy (at 5)");
        r.begin(0, &[0, 1, 2]).unwrap();
        fold(r, &[0, 1, 2]);
        r.finish(&[0, 1, 2]);
        assert!(st.mark_boundary(3));
        let r = st.mem[0].recurrent(0).unwrap();
        // Decoding on (one position a batch) keeps the copy at the prefill's end, and a batch
        // may start there again: a turn whose prompt shares only the prompt.
        for p in 3..6u32 {
            r.begin(0, &[p]).unwrap();
            fold(r, &[p]);
            r.finish(&[p]);
        }
        assert_eq!((r.seen(), r.mark()), (6, Some(3)));
        assert_eq!(st.reusable_prefix(5), 3);
        assert_eq!(st.reusable_prefix(6), 6);
        let r = st.mem[0].recurrent(0).unwrap();
        assert!(r.begin(0, &[4]).is_err(), "no copy at 4");
        r.begin(0, &[3, 4]).unwrap();
        assert_eq!(
            ((r.conv.clone(), r.state.clone()), r.seen()),
            (after3.clone(), 3)
        );
        fold(r, &[3, 4]);
        r.finish(&[3, 4]);
        assert!(st.mark_boundary(5));
        let r = st.mem[0].recurrent(0).unwrap();
        assert_eq!(r.mark(), Some(5));
        // A refused batch changes nothing; one that rewrites positions before the copy drops it.
        r.begin(0, &[3]).unwrap_err();
        assert_eq!(r.mark(), Some(5));
        r.begin(0, &[0]).unwrap();
        assert_eq!(r.mark(), None);
        // Starting at 0 starts from a zero state.
        r.begin(0, &[0]).unwrap();
        assert!(r.conv.iter().chain(&r.state).all(|&v| v == 0.0));
        // Asking a layer for the memory it does not keep names it.
        assert!(st.mem[2].kv(2).is_err() && st.mem[1].recurrent(1).is_err());
    }
}
