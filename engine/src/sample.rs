//! Token sampling: greedy by default (ties go to the lower id, so it is deterministic), or
//! top-k → min-p → temperature → top-p from a seeded `rand_chacha` stream, reproducible per
//! seed. Before either, the logits may be shifted: `logit_bias`, then llama.cpp's penalties
//! over the last `penalty_last_n` tokens (the prompt's tail and what was generated):
//! `repeat_penalty` divides a positive logit of a token seen there (multiplies a negative one),
//! `frequency_penalty` subtracts per occurrence and `presence_penalty` once. With every one of
//! them at its neutral value the logits are used as they are, bit for bit.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use std::collections::VecDeque;

/// Sampling settings (`--temp`, `--top-k`, `--top-p`, `--min-p`, `--seed`, the penalties,
/// a request's `logit_bias`).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temp: f32,
    pub top_k: usize,
    pub top_p: f32,
    /// Keep tokens whose probability (at temperature 1) is at least `min_p` times the most
    /// likely one's; 0 = off.
    pub min_p: f32,
    pub seed: u64,
    pub penalties: Penalties,
    /// Added to a token's logit before anything else (`-inf` bans it).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temp: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.0,
            seed: 0,
            penalties: Penalties::default(),
            logit_bias: Vec::new(),
        }
    }
}

/// llama.cpp's repetition penalties, over the last `last_n` tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalties {
    /// 1 = off.
    pub repeat: f32,
    /// 0 = off.
    pub frequency: f32,
    /// 0 = off.
    pub presence: f32,
    /// How many recent tokens count (0 = none: the penalties are off).
    pub last_n: usize,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            repeat: 1.0,
            frequency: 0.0,
            presence: 0.0,
            last_n: 64,
        }
    }
}

impl Penalties {
    /// Whether any penalty changes a logit.
    pub fn active(&self) -> bool {
        self.last_n > 0 && (self.repeat != 1.0 || self.frequency != 0.0 || self.presence != 0.0)
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha20Rng,
    cand: Vec<(f32, u32)>,
    /// The last `penalties.last_n` tokens (kept only while a penalty is active).
    recent: VecDeque<u32>,
    /// The shifted logits (only while a bias or a penalty is active).
    work: Vec<f32>,
    /// Per-token counts over `recent`, for the penalties.
    counts: std::collections::HashMap<u32, u32>,
}

/// Index of the largest logit; ties to the lowest index. NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

/// A chosen token's log-probability under the model (the raw logits at temperature 1, before
/// any bias, penalty or cutoff) and the `top` most likely tokens' (ties to the lower id).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The log-softmax of `logits` at `id`, and the `top` largest entries.
pub fn logprobs(logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let mx = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| libm::exp(f64::from(v - mx)))
        .sum();
    let log_z = f64::from(mx) + libm::log(sum);
    let lp = |v: f32| {
        if v.is_nan() {
            f32::NEG_INFINITY
        } else {
            (f64::from(v) - log_z) as f32
        }
    };
    // The `top` largest, kept sorted (largest first, lower id first among equals).
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &v) in logits.iter().enumerate() {
            if v.is_nan() || (best.len() == top && v <= best[top - 1].0) {
                continue;
            }
            let at = best.partition_point(|&(b, _)| b >= v);
            best.insert(at, (v, i as u32));
            best.truncate(top);
        }
    }
    TokenLogprob {
        id,
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&v| lp(v)),
        top: best.into_iter().map(|(v, i)| (i, lp(v))).collect(),
    }
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = ChaCha20Rng::seed_from_u64(cfg.seed);
        Sampler {
            cfg,
            rng,
            cand: Vec::new(),
            recent: VecDeque::new(),
            work: Vec::new(),
            counts: std::collections::HashMap::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Start the penalties' window over `context` (the turn's whole prompt): its last
    /// `last_n` tokens count, and each sampled token joins them.
    pub fn prime(&mut self, context: &[u32]) {
        self.recent.clear();
        if self.cfg.penalties.active() {
            let n = self.cfg.penalties.last_n;
            self.recent
                .extend(&context[context.len().saturating_sub(n)..]);
        }
    }

    /// Note a chosen token in the penalties' window.
    fn accept(&mut self, id: u32) {
        let p = self.cfg.penalties;
        if p.active() {
            self.recent.push_back(id);
            while self.recent.len() > p.last_n {
                self.recent.pop_front();
            }
        }
    }

    /// The next token from one row of logits, noted in the penalties' window.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let shifted = !self.cfg.logit_bias.is_empty() || self.cfg.penalties.active();
        let id = if shifted {
            let mut work = std::mem::take(&mut self.work);
            work.clear();
            work.extend_from_slice(logits);
            self.shift(&mut work);
            let id = self.draw(&work);
            self.work = work;
            id
        } else {
            self.draw(logits)
        };
        self.accept(id);
        id
    }

    /// Apply the logit bias, then the penalties, in place.
    fn shift(&mut self, logits: &mut [f32]) {
        for &(id, b) in &self.cfg.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        let p = self.cfg.penalties;
        if !p.active() {
            return;
        }
        self.counts.clear();
        for &t in &self.recent {
            *self.counts.entry(t).or_insert(0) += 1;
        }
        for (&t, &c) in &self.counts {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            if *l <= 0.0 {
                *l *= p.repeat;
            } else {
                *l /= p.repeat;
            }
            *l -= c as f32 * p.frequency + p.presence;
        }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temp <= 0.0 {
            return argmax(logits);
        }
        let c = &mut self.cand;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, &v)| (v, i as u32)),
        );
        if c.is_empty() {
            return argmax(logits);
        }
        c.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        if self.cfg.top_k > 0 {
            c.truncate(self.cfg.top_k.max(1));
        }
        let mx = c[0].0;
        if self.cfg.min_p > 0.0 {
            // p_i >= min_p · p_max at temperature 1  ⇔  l_i >= l_max + ln(min_p).
            let floor = mx + self.cfg.min_p.ln();
            let keep = c.iter().take_while(|&&(v, _)| v >= floor).count().max(1);
            c.truncate(keep);
        }
        let mut probs: Vec<f64> = c
            .iter()
            // libm: f64 `exp` differs between glibc and musl; the draw must not.
            .map(|&(v, _)| libm::exp(((v - mx) / self.cfg.temp) as f64))
            .collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            c.truncate(keep);
            let s: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= s);
        }
        let u: f64 = self.rng.gen();
        let mut acc = 0.0;
        for (p, &(_, id)) in probs.iter().zip(c.iter()) {
            acc += p;
            if u < acc {
                return id;
            }
        }
        c[c.len() - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_lowest_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_varies_with_seed() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplerConfig {
                temp: 1.0,
                top_k: 40,
                top_p: 0.95,
                seed,
                ..Default::default()
            });
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_entries_in_order() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, f32::NAN, 0.5];
        let lp = logprobs(&logits, 0, 3);
        let z: f64 = [1.0f64, 3.0, 3.0, -2.0, 0.5].iter().map(|v| v.exp()).sum();
        assert!((f64::from(lp.logprob) - (1.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 2, 0], "largest first, ties to the lower id");
        let total: f64 = [1.0f32, 3.0, 3.0, -2.0, 0.5]
            .iter()
            .map(|&v| f64::from(logprobs(&logits, 0, 0).logprob - 1.0 + v).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        assert!(logprobs(&logits, 9, 0).logprob.is_infinite());
    }

    #[test]
    fn neutral_settings_leave_sampling_unchanged() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        let cfg = SamplerConfig {
            temp: 0.8,
            seed: 5,
            ..Default::default()
        };
        let mut plain = Sampler::new(cfg.clone());
        let mut primed = Sampler::new(SamplerConfig {
            penalties: Penalties {
                last_n: 0,
                repeat: 1.3,
                ..Default::default()
            },
            ..cfg
        });
        primed.prime(&[1, 2, 3]);
        for _ in 0..50 {
            assert_eq!(plain.sample(&logits), primed.sample(&logits));
        }
    }

    #[test]
    fn penalties_follow_llama_cpps_formula() {
        let mut s = Sampler::new(SamplerConfig {
            penalties: Penalties {
                repeat: 2.0,
                frequency: 0.5,
                presence: 0.25,
                last_n: 3,
            },
            logit_bias: vec![(3, 10.0)],
            ..Default::default()
        });
        // Only the last 3 of the context count: token 0 falls out.
        s.prime(&[0, 1, 1, 2]);
        let mut l = vec![4.0f32, 4.0, -1.0, 0.0];
        s.shift(&mut l);
        assert_eq!(l[0], 4.0, "outside the window");
        assert_eq!(l[1], 4.0 / 2.0 - 2.0 * 0.5 - 0.25);
        assert_eq!(l[2], -2.0 - 0.5 - 0.25, "a negative logit is multiplied");
        assert_eq!(l[3], 10.0, "bias only");
        // Greedy with a penalty: the repeated token loses to the fresh one.
        let mut g = Sampler::new(SamplerConfig {
            penalties: Penalties {
                repeat: 1.5,
                ..Default::default()
            },
            ..Default::default()
        });
        g.prime(&[0]);
        assert_eq!(g.sample(&[3.0, 2.5]), 1);
        assert_eq!(
            g.sample(&[3.0, 2.5]),
            0,
            "1 now counts as well: 3/1.5 vs 2.5/1.5"
        );
    }

    #[test]
    fn a_banned_token_is_never_drawn_and_min_p_cuts_the_tail() {
        let logits = [2.0f32, 1.9, 0.0, -5.0];
        let mut s = Sampler::new(SamplerConfig {
            temp: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            seed: 9,
            logit_bias: vec![(0, f32::NEG_INFINITY)],
            ..Default::default()
        });
        // Without 0, the most likely is 1; 0.0 is e^-1.9 < 0.5 of it: only 1 stays.
        for _ in 0..30 {
            assert_eq!(s.sample(&logits), 1);
        }
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.1, 2.0, 1.0];
        let mut s = Sampler::new(SamplerConfig {
            temp: 5.0,
            top_k: 1,
            top_p: 1.0,
            seed: 3,
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
    }
}
