//! `decide`: score a fixed set of answers with one prefill and no decode — the policy half.
//!
//! A decide request renders `prefix + suffix` as one user message (reasoning off) and asks how
//! likely each choice's first token is as the answer's first token: `choice_logp[i]` is the
//! log-softmax over the **whole vocabulary** of the last prompt position's logits, at the first
//! token of `choices[i]` (`None` where that is −∞), and `best` the most likely choice.
//!
//! Callers repeat one long prefix (a document, a rubric) with many short suffixes, so the
//! session keeps the sequence state after the prefix and restores it when the next prefix
//! renders equal to it or extends it: only the tokens past it are prefilled. This module holds
//! the decisions — where the prefix ends in tokens, what may be restored, how the choices are
//! scored and which requests are refused; `Session::decide` runs them through the decode step,
//! and the backend keeps and restores the state itself (`Backend::keep_prefix`,
//! `restore_prefix`, `drop_prefix`), because only it knows what its state is.

pub use crate::telemetry::progress::DecideOutcome;
use thiserror::Error;

/// Why a decide request is refused before anything runs. Each leaves the session as it was.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DecideRejected {
    #[error("no choices: a decide needs at least one")]
    NoChoices,
    #[error("choice {index} has no tokens")]
    EmptyChoice { index: usize },
    #[error("choices {first} and {second} share their first token {token}, so no prefill can tell them apart")]
    SharedFirstToken {
        first: usize,
        second: usize,
        token: u32,
    },
    #[error("the rendered prompt is empty")]
    EmptyPrompt,
    #[error("the rendered prompt has {tokens} tokens, past the context of {n_ctx}")]
    PastContext { tokens: usize, n_ctx: u32 },
    #[error("the prefix ends at token {prefix_len} of a prompt of {tokens}")]
    PrefixPastPrompt { prefix_len: u32, tokens: usize },
}

/// Check a request's choices (their first tokens, request order): at least one, and no two
/// sharing a first token.
pub fn check_choices(first_tokens: &[Option<u32>]) -> Result<Vec<u32>, DecideRejected> {
    if first_tokens.is_empty() {
        return Err(DecideRejected::NoChoices);
    }
    let mut out = Vec::with_capacity(first_tokens.len());
    for (i, t) in first_tokens.iter().enumerate() {
        let t = t.ok_or(DecideRejected::EmptyChoice { index: i })?;
        if let Some(j) = out.iter().position(|&u| u == t) {
            return Err(DecideRejected::SharedFirstToken {
                first: j,
                second: i,
                token: t,
            });
        }
        out.push(t);
    }
    Ok(out)
}

/// How many tokens of `tokens` (the whole render) belong to the prefix, given `prefix_tokens`,
/// the tokens of the render cut where the prefix text ends. A tokenizer may merge across that
/// cut (the prefix's last word with the suffix's first), so the prefix is the common run of the
/// two, minus its last token — which another suffix could merge differently — and never the
/// whole render (the last token is always prefilled, for its logits).
pub fn prefix_split(prefix_tokens: &[u32], tokens: &[u32]) -> u32 {
    let common = prefix_tokens
        .iter()
        .zip(tokens)
        .take_while(|(a, b)| a == b)
        .count();
    let split = common
        .min(prefix_tokens.len().saturating_sub(1))
        .min(tokens.len().saturating_sub(1));
    split as u32
}

/// How many leading tokens can be restored from the kept prefix state `kept` (the tokens it
/// holds) for a request whose render is `tokens` with its prefix ending at `prefix_len`: all of
/// `kept` when the new prefix renders equal to it or extends it, else none.
pub fn reusable(kept: Option<&[u32]>, tokens: &[u32], prefix_len: u32) -> u32 {
    match kept {
        Some(k) if !k.is_empty() && k.len() <= prefix_len as usize && tokens.starts_with(k) => {
            k.len() as u32
        }
        _ => 0,
    }
}

/// Log-softmax over all of `logits` (one vocabulary row), in f64, at each of `tokens`:
/// `None` where it is −∞ (or the logits hold no finite value at all), and for a token past the
/// vocabulary.
pub fn choice_logp(logits: &[f32], tokens: &[u32]) -> Vec<Option<f64>> {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f64::NEG_INFINITY, |m, l| m.max(f64::from(l)));
    let lse = if max.is_finite() {
        let sum: f64 = logits
            .iter()
            .filter(|l| l.is_finite())
            .map(|&l| libm::exp(f64::from(l) - max))
            .sum();
        // libm: f64 `exp`/`ln` differ between glibc and musl; a choice's log-probability is
        // part of what an aarch64 build must reproduce.
        max + libm::log(sum)
    } else {
        f64::NAN
    };
    tokens
        .iter()
        .map(|&t| {
            let l = f64::from(*logits.get(t as usize)?);
            let lp = l - lse;
            lp.is_finite().then_some(lp)
        })
        .collect()
}

/// The index of the highest log-probability (the first on a tie), `None` when none is finite.
pub fn best(logp: &[Option<f64>]) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, lp) in logp.iter().enumerate() {
        if let Some(v) = *lp {
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
    }
    best.map(|(i, _)| i)
}

/// One decide request, as tokens.
#[derive(Copy, Clone, Debug)]
pub struct DecideRequest<'a> {
    /// The whole render: prefix and suffix as one user message, then the generation prompt.
    pub tokens: &'a [u32],
    /// How many leading tokens belong to the prefix (`prefix_split`): the state kept after
    /// the call covers exactly them.
    pub prefix_len: u32,
    /// Each choice's first token, request order (`check_choices`).
    pub choices: &'a [u32],
    /// Restore the kept prefix state when this prefix renders equal to it or extends it.
    pub reuse_prefix: bool,
    /// The context size: a render past it is refused.
    pub n_ctx: u32,
}

/// Whether `req` can be served: a render within the context, a prefix inside it, and choices
/// with distinct first tokens. `Session::decide` refuses what this refuses, before anything
/// runs; a front end can ask first, to answer before announcing the request.
pub fn check(req: &DecideRequest<'_>) -> Result<(), DecideRejected> {
    let n = req.tokens.len();
    if n == 0 {
        return Err(DecideRejected::EmptyPrompt);
    }
    if n > req.n_ctx as usize {
        return Err(DecideRejected::PastContext {
            tokens: n,
            n_ctx: req.n_ctx,
        });
    }
    if req.prefix_len as usize >= n {
        return Err(DecideRejected::PrefixPastPrompt {
            prefix_len: req.prefix_len,
            tokens: n,
        });
    }
    let first: Vec<Option<u32>> = req.choices.iter().map(|&t| Some(t)).collect();
    check_choices(&first).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_need_distinct_first_tokens() {
        assert_eq!(check_choices(&[]), Err(DecideRejected::NoChoices));
        assert_eq!(
            check_choices(&[Some(4), None]),
            Err(DecideRejected::EmptyChoice { index: 1 })
        );
        assert_eq!(
            check_choices(&[Some(4), Some(9), Some(4)]),
            Err(DecideRejected::SharedFirstToken {
                first: 0,
                second: 2,
                token: 4
            })
        );
        assert_eq!(check_choices(&[Some(4), Some(9)]), Ok(vec![4, 9]));
    }

    #[test]
    fn the_prefix_ends_one_token_before_the_cut_or_where_the_cut_merged() {
        // No merge at the cut: its last token is dropped all the same.
        assert_eq!(prefix_split(&[1, 2, 3, 4], &[1, 2, 3, 4, 5, 6]), 3);
        // The suffix merged into the prefix's last token: the common run already ends before.
        assert_eq!(prefix_split(&[1, 2, 3, 4], &[1, 2, 3, 9, 6]), 3);
        assert_eq!(prefix_split(&[1, 2, 3, 4], &[1, 2, 7, 9]), 2);
        // Never the whole render.
        assert_eq!(prefix_split(&[1, 2, 3], &[1, 2]), 1);
        assert_eq!(prefix_split(&[], &[1, 2]), 0);
    }

    #[test]
    fn a_kept_prefix_is_reused_when_the_new_one_equals_or_extends_it() {
        let kept = [1u32, 2, 3];
        // Equal prefix, another suffix.
        assert_eq!(reusable(Some(&kept), &[1, 2, 3, 8, 9], 3), 3);
        // An extended prefix.
        assert_eq!(reusable(Some(&kept), &[1, 2, 3, 4, 5, 9], 5), 3);
        // A shorter prefix: the kept state covers tokens this prefix does not have.
        assert_eq!(reusable(Some(&kept), &[1, 2, 3, 4], 2), 0);
        // A different prefix, or nothing kept.
        assert_eq!(reusable(Some(&kept), &[1, 2, 4, 3, 9], 4), 0);
        assert_eq!(reusable(None, &[1, 2, 3, 9], 3), 0);
        assert_eq!(reusable(Some(&[]), &[1, 2, 3, 9], 3), 0);
    }

    #[test]
    fn log_softmax_over_the_whole_vocabulary() {
        let logits = [1.0f32, 2.0, 3.0, f32::NEG_INFINITY];
        let lp = choice_logp(&logits, &[2, 0, 3, 9]);
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((lp[0].unwrap() - (3.0 - lse)).abs() < 1e-12);
        assert!((lp[1].unwrap() - (1.0 - lse)).abs() < 1e-12);
        assert_eq!(lp[2], None, "-inf is null");
        assert_eq!(lp[3], None, "past the vocabulary");
        let total: f64 = [0u32, 1, 2]
            .iter()
            .map(|&t| choice_logp(&logits, &[t])[0].unwrap().exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert_eq!(best(&lp), Some(0));
        assert_eq!(best(&[None, Some(-2.0), Some(-1.0), Some(-1.0)]), Some(2));
        assert_eq!(best(&[None, None]), None);
        // Huge logits do not overflow.
        let lp = choice_logp(&[1000.0, 999.0], &[0, 1]);
        assert!(lp.iter().all(|v| v.is_some_and(f64::is_finite)));
        assert!(choice_logp(&[f32::NEG_INFINITY; 3], &[0])[0].is_none());
    }
}
