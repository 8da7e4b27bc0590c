//! Several sequences decoded together (`serve --parallel N`): continuous batching over one
//! [`Engine`] whose backend holds each sequence's memory ([`Sequences`]).
//!
//! A lane is one generation on one sequence. [`Lanes::start`] feeds its prompt (the part its
//! sequence's memory does not already hold) in steps of that sequence alone and chooses its
//! first token; [`Lanes::step`] then feeds every running lane's chosen token in **one** decode
//! step — one row per lane — and chooses each lane's next token from its own row. In that step
//! the dense weights are read once for all lanes and each MoE layer reads the union of the
//! lanes' experts once (the streamer's per-step union), which is the batch's gain.
//!
//! **Token count** as in [`crate::generate`]: a lane of `n_predict` N yields up to N tokens;
//! an end-of-generation token ends it without being fed. One difference: the N-th token is
//! not fed (nothing would read its logits); the sequence's context ends before it, so a
//! later request that continues the text feeds it then.
//!
//! **Bits**: a row's logits do not depend on the rows beside it (the backend's contract for
//! [`Backend::verifies_rows`]), so each lane chooses exactly what it would alone; the engine's
//! gate `serve_parallel` holds the engine to it.
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
    /// The token chosen and not fed yet.
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
    running: Vec<Lane<S>>,
    /// Prefill step size (`--ubatch`; 0 = the whole prompt in one step).
    chunk: usize,
    turn: u32,
    /// Decode steps run, and the lanes they held in all (the mean batch is their ratio).
    pub steps: u64,
    pub rows: u64,
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
            running: Vec::new(),
            chunk,
            turn: 0,
            steps: 0,
            rows: 0,
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

    /// The free sequence for `prompt`: the one whose memory holds the longest prefix of it
    /// (lowest id on a tie), and that prefix's length (short of the whole prompt: its last
    /// token is fed for the logits the first choice reads).
    pub fn place<B: Sequences>(&self, backend: &B, prompt: &[u32]) -> Option<(u32, u32)> {
        let mut best: Option<(u32, u32)> = None;
        for (s, ctx) in self.contexts.iter().enumerate() {
            if self.busy[s] {
                continue;
            }
            let c = common(ctx, prompt).min(prompt.len().saturating_sub(1)) as u32;
            let c = backend.seq_reusable_prefix(s as u32, c);
            if best.is_none_or(|(_, b)| c > b) {
                best = Some((s as u32, c));
            }
        }
        best
    }

    /// Start a lane keyed `key` on the free sequence [`Lanes::place`] picks: feed what its
    /// memory lacks of the prompt and choose the first token. `Some` when the lane ended
    /// already (cancelled, an end-of-generation first token, `n_predict` 0, a failure);
    /// `None` when it runs. An empty prompt, or no free sequence, is refused.
    pub fn start<C, F, B>(
        &mut self,
        engine: &mut Engine<C, F, B>,
        key: u64,
        start: Start<'_>,
        mut source: S,
        sink: &mut dyn RecordSink,
    ) -> Result<Option<Ended<S>>, LaneError>
    where
        C: Clock,
        F: Flash,
        B: Sequences,
        S: TokenSource<B>,
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
        let turn = self.turn;
        self.turn = self.turn.wrapping_add(1);
        let end = |source, stop, error: Option<String>| Ended {
            key,
            seq,
            source,
            stop,
            tokens: Vec::new(),
            prompt_tokens: start.prompt.len() as u32,
            reused: reuse,
            error,
        };
        if start.cancel.is_set() {
            return Ok(Some(end(source, StopReason::Cancelled, None)));
        }
        let rest = &start.prompt[reuse as usize..];
        let chunk = if self.chunk == 0 {
            rest.len()
        } else {
            self.chunk
        };
        let mut pos = reuse;
        for (i, tokens) in rest.chunks(chunk).enumerate() {
            if i > 0 && start.cancel.is_set() {
                return Ok(Some(end(source, StopReason::Cancelled, None)));
            }
            let positions: Vec<u32> = (pos..pos + tokens.len() as u32).collect();
            let input = StepInput {
                turn,
                phase: Phase::Prefill,
                tokens,
                positions: &positions,
            };
            let run = [SeqRun {
                seq,
                first: 0,
                rows: tokens.len() as u32,
            }];
            let stepped = engine
                .backend_mut()
                .assign_rows(&run)
                .map_err(|e| e.to_string())
                .and_then(|()| {
                    source
                        .before_step(engine.backend_mut(), &input)
                        .map_err(|e| e.to_string())
                })
                .and_then(|()| engine.step(&input, sink).map_err(|e| e.to_string()));
            let mut stats = match stepped {
                Ok(st) => st,
                Err(e) => {
                    self.contexts[s].clear();
                    return Ok(Some(end(source, StopReason::Failed, Some(e))));
                }
            };
            self.contexts[s].extend_from_slice(tokens);
            pos += tokens.len() as u32;
            if let Err(e) = source.after_step(engine.backend(), &input, &mut stats) {
                return Ok(Some(end(source, StopReason::Failed, Some(e.to_string()))));
            }
        }
        if start.n_predict == 0 {
            return Ok(Some(end(source, StopReason::Count, None)));
        }
        if start.cancel.is_set() {
            return Ok(Some(end(source, StopReason::Cancelled, None)));
        }
        match source.next_token(engine.backend_mut(), start.n_predict == 1) {
            Err(e) => Ok(Some(end(source, StopReason::Failed, Some(e.to_string())))),
            Ok(None) => Ok(Some(end(source, StopReason::EndOfGeneration, None))),
            Ok(Some(t)) if start.n_predict == 1 => {
                let mut e = end(source, StopReason::Count, None);
                e.tokens.push(t);
                Ok(Some(e))
            }
            Ok(Some(t)) => {
                self.busy[s] = true;
                self.running.push(Lane {
                    key,
                    seq,
                    source,
                    cancel: start.cancel,
                    next: t,
                    n_predict: start.n_predict,
                    tokens: vec![t],
                    prompt_tokens: start.prompt.len() as u32,
                    reused: reuse,
                });
                Ok(None)
            }
        }
    }

    /// One decode step of every running lane (cancelled ones end first, unfed): the lanes
    /// that ended with it. Nothing runs when no lane does.
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
        let tokens: Vec<u32> = self.running.iter().map(|l| l.next).collect();
        let positions: Vec<u32> = self
            .running
            .iter()
            .map(|l| self.contexts[l.seq as usize].len() as u32)
            .collect();
        let runs: Vec<SeqRun> = self
            .running
            .iter()
            .enumerate()
            .map(|(r, l)| SeqRun {
                seq: l.seq,
                first: r as u32,
                rows: 1,
            })
            .collect();
        let turn = self.turn;
        self.turn = self.turn.wrapping_add(1);
        let input = StepInput {
            turn,
            phase: Phase::Decode,
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
                engine.backend_mut().logits_at_every_row(true);
                let r = engine.step(&input, sink).map_err(|e| e.to_string());
                engine.backend_mut().logits_at_every_row(false);
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
        self.steps += 1;
        self.rows += tokens.len() as u64;
        let running = std::mem::take(&mut self.running);
        for (row, mut lane) in running.into_iter().enumerate() {
            self.contexts[lane.seq as usize].push(lane.next);
            let mut st = stats.clone();
            if let Err(e) = lane.source.after_step(engine.backend(), &input, &mut st) {
                ended.push(self.end(lane, StopReason::Failed, Some(e.to_string())));
                continue;
            }
            let produced = lane.tokens.len() as u32;
            if lane.cancel.is_set() {
                ended.push(self.end(lane, StopReason::Cancelled, None));
                continue;
            }
            let last = produced + 1 == lane.n_predict;
            match lane
                .source
                .next_token_at(engine.backend_mut(), row as u32, last)
            {
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
