//! `serve --parallel N`: the engine thread decodes up to N choices together
//! ([`bmoe_core::lanes::Lanes`]). Jobs are taken as they come; each choice of a job waits for
//! a free slot (a sequence of the model's memory: the one holding at least half its prompt,
//! else the one used longest ago), and from then on every step carries it — its prompt first
//! (beside the other choices' tokens), then one token a step. A job's events are the
//! one-at-a-time server's: `Started` once, deltas per choice, `Choice` as each finishes (in any
//! order), `End` after the last.

use super::*;
use crate::converse::{relay, Relay};
use bmoe_core::lanes::{Ended, Lanes, Start};
use std::collections::VecDeque;

/// A job being served: how many of its choices started and are still to finish.
struct Running {
    job: Arc<Job>,
    plan: Plan,
    started: u32,
    unfinished: u32,
    /// Its `Started` went out (sent with the first choice).
    announced: bool,
}

/// Lane keys name (job number, choice index): the index fits in the low 8 bits
/// (`n` ≤ 16).
fn key(job: u64, index: u32) -> u64 {
    (job << 8) | u64::from(index)
}

impl Engine {
    /// Serve jobs on `conv`'s `n` lanes until the job channel closes and every lane ends.
    pub(super) fn run_lanes(
        &self,
        conv: &mut Conversation,
        n: u32,
        seeds: &mut impl RngCore,
    ) -> Result<()> {
        let tok = conv.shared_tokenizer();
        let n_vocab = conv.n_vocab();
        let mut lanes: Lanes<Relay<'_, '_>> = Lanes::new(n, conv.ubatch());
        let mut jobs: std::collections::BTreeMap<u64, Running> = Default::default();
        let mut waiting: VecDeque<u64> = VecDeque::new();
        let mut next_job = 0u64;
        let mut open = true;
        let mut reported = [0u64; 5];
        loop {
            // Take what has arrived; wait only when nothing runs or waits.
            loop {
                let idle = lanes.running() == 0 && waiting.is_empty();
                let got = if idle && open {
                    self.jobs.recv().ok()
                } else if open {
                    match self.jobs.try_recv() {
                        Ok(j) => Some(j),
                        Err(std_mpsc::TryRecvError::Empty) => None,
                        Err(std_mpsc::TryRecvError::Disconnected) => {
                            open = false;
                            None
                        }
                    }
                } else {
                    None
                };
                let Some(job) = got else {
                    if idle {
                        open = false;
                    }
                    break;
                };
                let job = Arc::new(job);
                match self.lane_plan(conv, &job, seeds) {
                    Ok(plan) => {
                        let id = next_job;
                        next_job += 1;
                        jobs.insert(
                            id,
                            Running {
                                job,
                                plan,
                                started: 0,
                                unfinished: 0,
                                announced: false,
                            },
                        );
                        waiting.push_back(id);
                    }
                    Err(ev) => self.job_over(&job, ev),
                }
            }
            if self.signal.is_set() {
                // Stopping: a job with choices still to start is answered now (its running
                // ones are cancelled); the running lanes end at their next step, their
                // listeners gone.
                for id in std::mem::take(&mut waiting) {
                    let ev = Event::Error(ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "the server is stopping: the request did not finish",
                    ));
                    self.abandon(&mut jobs, &mut waiting, &lanes, id, Some(ev));
                }
            }
            if !open && lanes.running() == 0 && waiting.is_empty() {
                break;
            }
            // Start waiting choices while slots are free, oldest job first.
            while lanes.has_free() {
                let Some(&id) = waiting.front() else {
                    break;
                };
                let Some(r) = jobs.get_mut(&id) else {
                    waiting.pop_front();
                    continue;
                };
                let index = r.started;
                let choices = r.job.common.n.max(1);
                r.started += 1;
                if r.started >= choices {
                    waiting.pop_front();
                }
                let prepared = match conv.prepare(&r.plan.prompt, r.job.common.max_tokens) {
                    Ok(p) => p,
                    Err(why) => {
                        let ev = Event::Error(refused_for(&r.job, &why));
                        self.abandon(&mut jobs, &mut waiting, &lanes, id, Some(ev));
                        continue;
                    }
                };
                if !r.announced {
                    r.announced = true;
                    if send_within(&r.job.events, Event::Started, self.client_timeout, || false)
                        != Sent::Yes
                    {
                        self.metrics.skipped();
                        self.abandon(&mut jobs, &mut waiting, &lanes, id, None);
                        continue;
                    }
                }
                let r = jobs.get_mut(&id).expect("the job was just used");
                r.unfinished += 1;
                let mut opts = r.plan.opts.clone();
                opts.sampler.seed = r.plan.base.wrapping_add(u64::from(index));
                let constraint = match &opts.constraint {
                    // Compiled once already by the plan: this cannot fail but is not assumed not to.
                    Some(spec) => match conv.grammar(spec) {
                        Ok(c) => Some(c),
                        Err(e) => {
                            let ev = Event::Error(ApiError::invalid(
                                "grammar",
                                format!("the grammar does not compile: {e:#}"),
                            ));
                            self.abandon(&mut jobs, &mut waiting, &lanes, id, Some(ev));
                            continue;
                        }
                    },
                    None => None,
                };
                let cancel = CancelFlag::new();
                let listener = JobListener {
                    job: r.job.clone(),
                    index,
                    stream: r.job.common.stream,
                    client_timeout: self.client_timeout,
                    signal: &self.signal,
                    logprobs: Vec::new(),
                };
                let source = relay(
                    &tok,
                    n_vocab,
                    &prepared,
                    &opts,
                    constraint,
                    Box::new(listener),
                    cancel.clone(),
                );
                let start = Start {
                    prompt: prepared.tokens(),
                    n_predict: prepared.n_predict,
                    cancel,
                };
                match lanes.start(conv.engine_mut(), key(id, index), start, source) {
                    Ok(None) => {}
                    Ok(Some(ended)) => self.lane_ended(&mut jobs, &mut waiting, &lanes, ended),
                    Err(e) => {
                        let ev = Event::Error(ApiError::new(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "server_error",
                            format!("the request could not start: {e}"),
                        ));
                        self.abandon(&mut jobs, &mut waiting, &lanes, id, Some(ev));
                    }
                }
            }
            for ended in conv.lanes_step(&mut lanes) {
                self.lane_ended(&mut jobs, &mut waiting, &lanes, ended);
            }
            let now = [
                lanes.steps,
                lanes.rows,
                lanes.read_bytes,
                lanes.routed_bytes,
                lanes.routings,
            ];
            if now[0] > reported[0] {
                // How full the shared steps ran, and what they read.
                let d: Vec<u64> = now.iter().zip(&reported).map(|(a, b)| a - b).collect();
                self.metrics.batch(d[0], d[1], d[2], d[3], d[4]);
                reported = now;
            }
        }
        Ok(())
    }

    /// [`Engine::plan`], plus what lanes cannot do.
    fn lane_plan(
        &self,
        conv: &mut Conversation,
        job: &Job,
        seeds: &mut impl RngCore,
    ) -> Result<Plan, Option<Event>> {
        if job.common.ngram == Some(true) {
            return Err(Some(Event::Error(ApiError::invalid(
                "ngram",
                "ngram: drafting verifies a group of tokens for one request at a time; this server decodes --parallel requests together (start it with --parallel 1 to draft)",
            ))));
        }
        self.plan(conv, job, seeds)
    }

    /// A lane ended: its choice's event, and the job's end after its last.
    fn lane_ended(
        &self,
        jobs: &mut std::collections::BTreeMap<u64, Running>,
        waiting: &mut VecDeque<u64>,
        lanes: &Lanes<Relay<'_, '_>>,
        ended: Ended<Relay<'_, '_>>,
    ) {
        let (id, index) = (ended.key >> 8, (ended.key & 0xff) as u32);
        let fin = ended.source.finished(crate::converse::Ended {
            stop: ended.stop,
            prompt_tokens: ended.prompt_tokens as usize,
            cached_tokens: ended.reused as usize,
            completion_tokens: ended.tokens.len() as u32,
            summary: Default::default(),
            error: ended.error,
        });
        let Some(r) = jobs.get_mut(&id) else {
            // Its job was given up (another choice failed): the answer went out already.
            return;
        };
        r.unfinished = r.unfinished.saturating_sub(1);
        let fin = match self.turn_result(&r.job, fin, None) {
            Ok(f) => f,
            Err(ev) => return self.abandon(jobs, waiting, lanes, id, Some(ev)),
        };
        let ev = self.choice_done(&r.job, index, fin, r.plan.tool_format);
        if send_within(&r.job.events, ev, self.client_timeout, || false) != Sent::Yes {
            return self.abandon(jobs, waiting, lanes, id, None);
        }
        if r.unfinished == 0 && r.started >= r.job.common.n.max(1) {
            let r = jobs.remove(&id).expect("the job is there");
            self.job_over(&r.job, Some(Event::End));
        }
    }

    /// Give up job `id`: its running choices are cancelled (their ends find it gone), it
    /// starts no more, and `last` is its answer.
    fn abandon(
        &self,
        jobs: &mut std::collections::BTreeMap<u64, Running>,
        waiting: &mut VecDeque<u64>,
        lanes: &Lanes<Relay<'_, '_>>,
        id: u64,
        last: Option<Event>,
    ) {
        waiting.retain(|&w| w != id);
        for (k, flag) in lanes.cancel_flags() {
            if k >> 8 == id {
                flag.set();
            }
        }
        if let Some(r) = jobs.remove(&id) {
            self.job_over(&r.job, last);
        }
    }

    /// A job is over: it no longer counts as in flight, then its last event goes out.
    fn job_over(&self, job: &Job, last: Option<Event>) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        if let Some(ev) = last {
            send_within(&job.events, ev, self.client_timeout, || false);
        }
    }
}
