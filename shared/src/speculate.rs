//! Self-speculation's draft sources and the one rule that verifies them.
//!
//! A speculative decode step feeds `[t, d1 … dk]` — the token just chosen and `k` drafted
//! continuations — at consecutive positions in one step with logits at every row, then walks
//! the rows: row `j`'s logits choose the token after `d_j`'s predecessor exactly as a plain
//! decode would; while that choice equals the draft `d_{j+1}` the draft is confirmed (its KV is
//! already written), and the first choice that differs is the next token to feed. The rows
//! after it are forgotten: their positions are overwritten by the next step.
//!
//! **Why the output is unchanged.** Every row is computed with the same bits as a one-token
//! decode at its position (the kernels are row-invariant: `matmul` gives each (token, row)
//! exactly `matvec`'s bits), so under greedy decoding each choice is the plain run's choice.
//! Under sampling the drafts here are one token each (a point mass `q = δ_d`), and the standard
//! speculative-sampling rule — accept `d` with probability `min(1, p(d)/q(d)) = p(d)`, else
//! draw from `norm(max(0, p − q))`, which is `p` with `d` removed — is exactly "draw `s ~ p`
//! and accept iff `s = d`": `P(s = d) = p(d)`, and given `s ≠ d`, `s` is distributed as `p`
//! without `d`. So the sampler draws from each row as it would in a plain run, one draw per
//! output token in the same order, and the output distribution is the plain one (with a seeded
//! sampler and row-invariant logits, the very same tokens).
//!
//! The n-gram source (prompt lookup) is here; it costs a scan of the token history and
//! allocates nothing. So is what the model's own draft head (`--mtp`) drafts from its logits
//! ([`head_draft`]).

use crate::backend::Backend;

/// `--mtp`'s drafting: up to `max` tokens after `token` (about to be fed at `position`), each
/// the head's most likely next token (the lowest id among equals) fed back to it, stopping
/// before one whose probability under the head is below `p_min`. Into `out` (cleared first).
pub fn head_draft<B: Backend + ?Sized>(
    backend: &mut B,
    token: u32,
    position: u32,
    max: usize,
    p_min: f32,
    out: &mut Vec<u32>,
) -> Result<(), B::Error> {
    out.clear();
    let mut tok = token;
    for i in 0..max as u32 {
        let Some(logits) = backend.head_logits(tok, position + i, i > 0)? else {
            break;
        };
        let (best, top) =
            logits
                .iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |(b, v), (j, &x)| {
                    if x > v {
                        (j, x)
                    } else {
                        (b, v)
                    }
                });
        if p_min > 0.0 {
            let sum: f64 = logits.iter().map(|&x| f64::from(x - top).exp()).sum();
            if ((1.0 / sum) as f32) < p_min {
                break;
            }
        }
        tok = best as u32;
        out.push(tok);
    }
    Ok(())
}

/// `--ngram` settings: draft up to `draft_max` tokens from the longest earlier match of at
/// least `min_match` (at most `max_match`) trailing tokens.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct NgramParams {
    pub draft_max: u32,
    pub min_match: u32,
    pub max_match: u32,
}

/// Draft by prompt lookup over the corpus `history ++ [last]` (the context fed so far and the
/// token chosen to be fed next): the pattern is the corpus's suffix; every earlier position
/// is a candidate end (the pattern itself excluded, overlap allowed); the longest common
/// suffix, at most `max_match`, wins, ties to the most recent; the draft is what followed the
/// winner, at most `n` tokens, clipped at the corpus end. A match shorter than `min_match`
/// drafts nothing. Writes the draft into `out` (cleared first) and returns the match length.
pub fn ngram_draft(
    history: &[u32],
    last: u32,
    min_match: u32,
    max_match: u32,
    n: usize,
    out: &mut Vec<u32>,
) -> usize {
    out.clear();
    let len = history.len() + 1;
    let at = |i: usize| if i < history.len() { history[i] } else { last };
    let max_match = max_match as usize;
    let (mut best_len, mut best_end) = (0usize, 0usize);
    // Candidate ends e < len − 1 (the suffix itself ends at len − 1), most recent first so a
    // tie keeps the later one.
    for e in (0..len - 1).rev() {
        let mut l = 0;
        while l < max_match && l <= e && at(e - l) == at(len - 1 - l) {
            l += 1;
        }
        if l > best_len {
            best_len = l;
            best_end = e;
            if l == max_match {
                break;
            }
        }
    }
    if best_len == 0 || best_len < min_match as usize {
        return best_len;
    }
    let start = best_end + 1;
    let end = (start + n).min(len);
    out.extend((start..end).map(at));
    best_len
}

/// What speculation did over a turn: the counters behind the `mtp:`/`ngram:` lines and the
/// `mtp_*` keys.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecCounters {
    /// Tokens drafted.
    pub drafted: u64,
    /// Drafts confirmed by a verify decode.
    pub accepted: u64,
    /// Decode steps run while speculation was on (each verifies a group or decodes plainly).
    pub decodes: u64,
    /// Decode steps that verified a draft (the rest decoded plainly: no match).
    pub drafted_steps: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(history: &[u32], last: u32, min: u32, max: u32, n: usize) -> (usize, Vec<u32>) {
        let mut out = vec![99];
        let l = ngram_draft(history, last, min, max, n, &mut out);
        (l, out)
    }

    #[test]
    fn drafts_what_followed_the_longest_earlier_match() {
        // corpus 1 2 3 4 9 2 3 | 4? — suffix "2 3"… the corpus ends with last = 3:
        // 5 1 2 3 4 5 1 2 [3]: suffix "1 2 3" matched at 1..=3, followed by 4 5 1 2 3.
        let h = [5, 1, 2, 3, 4, 5, 1, 2];
        assert_eq!(draft(&h, 3, 1, 12, 3), (4, vec![4, 5, 1]));
        // Clipped at the corpus end: what followed runs into the pattern itself.
        assert_eq!(draft(&h, 3, 1, 12, 8), (4, vec![4, 5, 1, 2, 3]));
    }

    #[test]
    fn ties_go_to_the_most_recent_and_short_matches_draft_nothing() {
        // "7" occurs at 0 (followed by 1) and at 2 (followed by 2): the later wins.
        let h = [7, 1, 7, 2];
        assert_eq!(draft(&h, 7, 1, 12, 1), (1, vec![2]));
        // The same match under --ngram-min-match 2 drafts nothing.
        assert_eq!(draft(&h, 7, 2, 12, 1), (1, vec![]));
        // No earlier occurrence at all.
        assert_eq!(draft(&[1, 2, 3], 4, 1, 12, 3), (0, vec![]));
        // An empty history: the corpus is the one token.
        assert_eq!(draft(&[], 4, 1, 12, 3), (0, vec![]));
    }

    #[test]
    fn the_match_is_capped_and_overlap_is_allowed() {
        // A run of one token: the longest match overlaps the pattern and drafts more of it.
        let h = [3, 3, 3, 3, 3];
        assert_eq!(draft(&h, 3, 1, 12, 2), (5, vec![3]));
        assert_eq!(draft(&h, 3, 1, 2, 2), (2, vec![3]));
        // The cap stops the scan at the most recent full-length match.
        let h = [1, 2, 9, 1, 2];
        assert_eq!(draft(&h, 9, 1, 1, 2), (1, vec![1, 2]));
    }
}
