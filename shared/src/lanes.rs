//! Several sequences decoded together (`serve --parallel N`): continuous batching over one
//! [`Engine`] whose backend holds each sequence's memory ([`Sequences`]).
//!
//! A lane is one generation on one sequence. [`Lanes::start`] places it on the free sequence
//! whose memory holds the longest prefix of its prompt; [`Lanes::step`] then runs **one**
//! step for every lane: a decoding lane feeds the token it chose (one row), a new lane the
//! part of its prompt its sequence lacks (at most `chunk` rows a step), and each lane whose
//! rows end there chooses its next token from its own logits row. In that step the dense
//! weights are read once for all rows and each MoE layer reads the union of the rows'
//! experts once (the streamer's per-step union): the batch's gain. A new request's prompt
//! rides in the running ones' step, so its first token waits for one step, not for theirs.
//!
//! **Token count** as in [`crate::generate`]: a lane of `n_predict` N yields up to N tokens;
//! an end-of-generation token ends it without being fed. One difference: the N-th token is
//! not fed (nothing would read its logits); the sequence's context ends before it, so a
//! later request that continues the text feeds it then.
//!
//! **Bits**: a row's logits do not depend on the rows beside it (the backend's contract for
//! [`crate::Backend::verifies_rows`]), so each lane chooses exactly what it would alone; the
//! gate `gates/tests/batched.rs` holds the engine to it.
//!
//! **Trace**: the rows of a step are in sequence order, and the sink hears each row's
//! sequence ([`RecordSink::step_rows`]) before the step: a route trace with the `seq` column
//! records a batched run the simulator replays step by step (`bmoe-sim replay`).
//!
//! **Failures**: a failed step poisons the engine (STYLE 12) and ends every lane `Failed`; a
//! source's error ends its own lane `Failed`; a set cancel flag ends its lane at the next
//! token boundary.

use crate::backend::{SeqRun, Sequences};
use crate::clock::Clock;
use crate::flash::Flash;
use crate::generate::{CancelFlag, StopReason, TokenSource};
use crate::records::{Phase, RecordSink};
use crate::step::{Engine, StepInput};

/// What a new lane is given.
pub struct Start<'a> {
    /// The whole context the lane continues (its prompt): the sequence's memory keeps what
    /// it already holds of it.
    pub prompt: &'a [u32],
    pub n_predict: u32,
    pub cancel: CancelFlag,
}

/// A lane that ended, with its source given back.
pub struct Ended<S> {
    /// The caller's key for the lane (given to [`Lanes::start`]).
    pub key: u64,
    pub seq: u32,
    pub source: S,
    pub stop: StopReason,
    /// The tokens chosen (not counting an end-of-generation token).
    pub tokens: Vec<u32>,
    pub prompt_tokens: u32,
    /// Prompt tokens the sequence's memory already held.
    pub reused: u32,
    /// Why it failed (`StopReason::Failed`).
    pub error: Option<String>,
}

struct Lane<S> {
    key: u64,
    seq: u32,
    source: S,
    cancel: CancelFlag,
    /// The prompt, while part of it is still to be fed (empty once it all is).
    prompt: Vec<u32>,
    /// Decoding: the token chosen and not fed yet.
    next: u32,
    n_predict: u32,
    tokens: Vec<u32>,
    prompt_tokens: u32,
    reused: u32,
}

/// The lanes running on one engine, and what each sequence's memory holds.
pub struct Lanes<S> {
    /// Per sequence, the tokens its memory holds (positions `0..len`).
    contexts: Vec<Vec<u32>>,
    busy: Vec<bool>,
    /// Per sequence, when a lane last started on it (`starts` then).
    used: Vec<u64>,
    starts: u64,
    running: Vec<Lane<S>>,
    /// Prefill step size (`--ubatch`; 0 = the whole prompt in one step).
    chunk: usize,
    turn: u32,
    /// Decode steps run (steps that carried no prompt), and the lanes they held in all (the
    /// mean batch is their ratio).
    pub steps: u64,
    pub rows: u64,
    /// Over those steps: bytes read from flash, the routed experts' bytes counting each
    /// distinct expert of a layer once (`StepStats::routed_bytes`: the union the batch
    /// shares), and the routings (row × rank) behind them.
    pub read_bytes: u64,
    pub routed_bytes: u64,
    pub routings: u64,
}

/// The longest common prefix of two token lists.
fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<S> Lanes<S> {
    /// `n` sequences, all empty; prompts fed in steps of at most `chunk` tokens (0: one).
    pub fn new(n: u32, chunk: usize) -> Self {
        Lanes {
            contexts: vec![Vec::new(); n as usize],
            busy: vec![false; n as usize],
            used: vec![0; n as usize],
            starts: 0,
            running: Vec::new(),
            chunk,
            turn: 0,
            steps: 0,
            rows: 0,
            read_bytes: 0,
            routed_bytes: 0,
            routings: 0,
        }
    }

    /// Lanes running now.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Whether a lane can start now.
    pub fn has_free(&self) -> bool {
        self.busy.iter().any(|b| !b)
    }

    /// The cancel flags of the running lanes, by key.
    pub fn cancel_flags(&self) -> impl Iterator<Item = (u64, &CancelFlag)> {
        self.running.iter().map(|l| (l.key, &l.cancel))
    }

    /// The free sequence for `prompt`, and the prefix of it its memory holds (short of the
    /// whole prompt: its last token is fed for the logits the first choice reads). The one
    /// holding the longest prefix when that is at least half the prompt (a conversation
    /// continued, a shared system prompt); otherwise the one used longest ago, so that the
    /// others keep what they hold for the requests that continue them (llama-server's
    /// slot similarity, 0.5).
    pub fn place<B: Sequences>(&self, backend: &B, prompt: &[u32]) -> Option<(u32, u32)> {
        let reuse = |s: usize| {
            let c = common(&self.contexts[s], prompt).min(prompt.len().saturating_sub(1)) as u32;
            backend.seq_reusable_prefix(s as u32, c)
        };
        let free = (0..self.contexts.len()).filter(|&s| !self.busy[s]);
        let best = free
            .clone()
            .map(|s| (reuse(s), s))
            .max_by_key(|&(c, s)| (c, std::cmp::Reverse(s)))?;
        if 2 * best.0 as usize >= prompt.len() {
            return Some((best.1 as u32, best.0));
        }
        let lru = free.min_by_key(|&s| (self.used[s], s))?;
        Some((lru as u32, reuse(lru)))
    }

    /// Start a lane keyed `key` on the free sequence [`Lanes::place`] picks; its prompt is fed
    /// by the next steps. `Some` when it ended already (its cancel flag was set). An empty
    /// prompt, or no free sequence, is refused.
    pub fn start<C, F, B>(
        &mut self,
        engine: &mut Engine<C, F, B>,
        key: u64,
        start: Start<'_>,
        source: S,
    ) -> Result<Option<Ended<S>>, LaneError>
    where
        C: Clock,
        F: Flash,
        B: Sequences,
    {
        if start.prompt.is_empty() {
            return Err(LaneError::EmptyPrompt);
        }
        let n_seq = engine.backend().n_sequences();
        if n_seq < self.contexts.len() as u32 {
            return Err(LaneError::Sequences {
                held: n_seq,
                wanted: self.contexts.len() as u32,
            });
        }
        let Some((seq, reuse)) = self.place(engine.backend(), start.prompt) else {
            return Err(LaneError::Full);
        };
        let s = seq as usize;
        self.contexts[s].truncate(reuse as usize);
        self.busy[s] = true;
        self.starts += 1;
        self.used[s] = self.starts;
        let lane = Lane {
            key,
            seq,
            source,
            cancel: start.cancel,
            prompt: start.prompt.to_vec(),
            next: 0,
            n_predict: start.n_predict,
            tokens: Vec::new(),
            prompt_tokens: start.prompt.len() as u32,
            reused: reuse,
        };
        if lane.cancel.is_set() {
            return Ok(Some(self.end(lane, StopReason::Cancelled, None)));
        }
        self.running.push(lane);
        Ok(None)
    }

    /// One step of every lane (cancelled ones end first, unfed): the lanes that ended with
    /// it. Nothing runs when no lane does.
    pub fn step<C, F, B>(
        &mut self,
        engine: &mut Engine<C, F, B>,
        sink: &mut dyn RecordSink,
    ) -> Vec<Ended<S>>
    where
        C: Clock,
        F: Flash,
        B: Sequences,
        S: TokenSource<B>,
    {
        let mut ended = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancel.is_set() {
                let lane = self.running.remove(i);
                ended.push(self.end(lane, StopReason::Cancelled, None));
            } else {
                i += 1;
            }
        }
        if self.running.is_empty() {
            return ended;
        }
        // Rows in sequence order: a route trace keys a batched step's tokens by sequence and
        // position, and its replay feeds them in that order, so the cache sees the experts
        // in the order the engine looked them up.
        self.running.sort_by_key(|l| l.seq);
        // Each lane's rows: its chosen token, or the next piece of its prompt. `fed[i]`: the
        // lane's row count; `out[i]`: its logits row, when its rows end its prompt or it
        // decodes.
        let (mut tokens, mut positions, mut runs) = (Vec::new(), Vec::new(), Vec::new());
        let (mut fed, mut out, mut out_rows) = (Vec::new(), Vec::new(), Vec::new());
        let mut prefill = false;
        for lane in &self.running {
            let ctx = &self.contexts[lane.seq as usize];
            let first = tokens.len() as u32;
            let piece: &[u32] = if lane.prompt.is_empty() {
                std::slice::from_ref(&lane.next)
            } else {
                prefill = true;
                let rest = &lane.prompt[ctx.len()..];
                let n = if self.chunk == 0 {
                    rest.len()
                } else {
                    rest.len().min(self.chunk)
                };
                &rest[..n]
            };
            tokens.extend_from_slice(piece);
            positions.extend((0..piece.len() as u32).map(|j| ctx.len() as u32 + j));
            runs.push(SeqRun {
                seq: lane.seq,
                first,
                rows: piece.len() as u32,
            });
            fed.push(piece.len());
            let done = lane.prompt.is_empty() || ctx.len() + piece.len() == lane.prompt.len();
            out.push(done.then_some(out_rows.len() as u32));
            if done {
                out_rows.push(first + piece.len() as u32 - 1);
            }
        }
        let turn = self.turn;
        self.turn = self.turn.wrapping_add(1);
        let input = StepInput {
            turn,
            phase: if prefill {
                Phase::Prefill
            } else {
                Phase::Decode
            },
            tokens: &tokens,
            positions: &positions,
        };
        let mut failed = engine
            .backend_mut()
            .assign_rows(&runs)
            .map_err(|e| e.to_string())
            .err();
        for lane in self.running.iter_mut() {
            if failed.is_some() {
                break;
            }
            if let Err(e) = lane.source.before_step(engine.backend_mut(), &input) {
                failed = Some(e.to_string());
            }
        }
        let stepped = match failed {
            Some(e) => Err(e),
            None => {
                // Only the rows that choose a token need logits (a prompt's last row).
                let b = engine.backend_mut();
                b.logits_at_rows(&out_rows);
                let seqs: Vec<u32> = runs
                    .iter()
                    .flat_map(|r| std::iter::repeat_n(r.seq, r.rows as usize))
                    .collect();
                sink.step_rows(&seqs);
                let r = engine.step(&input, sink).map_err(|e| e.to_string());
                engine.backend_mut().logits_at_rows(&[]);
                r
            }
        };
        let stats = match stepped {
            Ok(st) => st,
            Err(e) => {
                for lane in std::mem::take(&mut self.running) {
                    self.contexts[lane.seq as usize].clear();
                    ended.push(self.end(lane, StopReason::Failed, Some(e.clone())));
                }
                return ended;
            }
        };
        if !prefill {
            self.steps += 1;
            self.rows += tokens.len() as u64;
            self.read_bytes += stats.read_bytes;
            self.routed_bytes += stats.routed_bytes;
            self.routings += stats.experts_routed;
        }
        let running = std::mem::take(&mut self.running);
        for ((mut lane, n), out) in running.into_iter().zip(fed).zip(out) {
            let ctx = &mut self.contexts[lane.seq as usize];
            if lane.prompt.is_empty() {
                ctx.push(lane.next);
            } else {
                let at = ctx.len();
                ctx.extend_from_slice(&lane.prompt[at..at + n]);
            }
            let mut st = stats.clone();
            if let Err(e) = lane.source.after_step(engine.backend(), &input, &mut st) {
                ended.push(self.end(lane, StopReason::Failed, Some(e.to_string())));
                continue;
            }
            if lane.cancel.is_set() {
                ended.push(self.end(lane, StopReason::Cancelled, None));
                continue;
            }
            let Some(row) = out else {
                // More of its prompt next step.
                self.running.push(lane);
                continue;
            };
            lane.prompt = Vec::new();
            if lane.n_predict == 0 {
                ended.push(self.end(lane, StopReason::Count, None));
                continue;
            }
            let last = lane.tokens.len() as u32 + 1 == lane.n_predict;
            match lane.source.next_token_at(engine.backend_mut(), row, last) {
                Err(e) => ended.push(self.end(lane, StopReason::Failed, Some(e.to_string()))),
                Ok(None) => ended.push(self.end(lane, StopReason::EndOfGeneration, None)),
                Ok(Some(t)) => {
                    lane.tokens.push(t);
                    lane.next = t;
                    if last {
                        ended.push(self.end(lane, StopReason::Count, None));
                    } else {
                        self.running.push(lane);
                    }
                }
            }
        }
        ended
    }

    fn end(&mut self, lane: Lane<S>, stop: StopReason, error: Option<String>) -> Ended<S> {
        self.busy[lane.seq as usize] = false;
        Ended {
            key: lane.key,
            seq: lane.seq,
            source: lane.source,
            stop,
            tokens: lane.tokens,
            prompt_tokens: lane.prompt_tokens,
            reused: lane.reused,
            error,
        }
    }
}

/// A lane that could not start.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LaneError {
    #[error("a lane needs at least one prompt token")]
    EmptyPrompt,
    #[error("every sequence runs a lane")]
    Full,
    #[error("the backend holds {held} sequences; these lanes need {wanted}")]
    Sequences { held: u32, wanted: u32 },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_common_prefix_stops_at_the_first_difference() {
        assert_eq!(common(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common(&[], &[1]), 0);
        assert_eq!(common(&[7, 8], &[7, 8]), 2);
    }
}
