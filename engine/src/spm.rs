//! SentencePiece-style vocabularies: spaces are written `▁` (U+2581) inside tokens, text is
//! merged on raw UTF-8 characters (no GPT-2 byte encoding), and a character no token covers
//! falls back to byte tokens `<0xXX>`.
//!
//! Two ways of merging, as llama.cpp (`src/llama-vocab.cpp`) runs them:
//! - **by score** (`tokenizer.ggml.model = llama`, Llama 1/2, Mistral): every adjacent pair whose
//!   concatenation is a token is a candidate; the candidate whose token has the highest score
//!   merges first (ties: the leftmost). A final piece that is not a token is split back along
//!   the merges that built it, and what still is no token becomes bytes.
//! - **by rank** (`tokenizer.ggml.model = gemma4`): BPE with the file's merge list over the
//!   whole text, split only at runs of newlines (a run of newlines that is itself a token stays
//!   whole); the lowest-ranked pair merges first (ties: the leftmost).
//!
//! [`crate::tokenizer::Tokenizer`] owns the special-token partition, BOS and the space prefix;
//! this module turns one fragment of ordinary text into ids and one id back into bytes.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// GGUF token type of a byte token (`<0x41>`).
pub const TOKEN_TYPE_BYTE: i32 = 6;
/// GGUF token type of an unused slot (decodes to nothing, as in llama.cpp).
pub const TOKEN_TYPE_UNUSED: i32 = 5;

/// How adjacent pieces merge.
pub enum Merging {
    /// Llama-style SentencePiece: one score per token, highest first.
    Scores(Vec<f32>),
    /// BPE merge list: `(left id, right id) → rank`, lowest first. Merges naming text that is
    /// no token (never in the real vocabularies, but a file may) sit in `by_text`.
    Ranks {
        by_id: HashMap<(u32, u32), u32>,
        by_text: HashMap<(String, String), u32>,
    },
}

/// A SentencePiece-style vocabulary: the token texts, their lookup, the byte fallback and the
/// merging rule.
pub struct SpmVocab {
    texts: Vec<String>,
    /// Token text → id; on a duplicated text the last id wins, as in llama.cpp.
    ids: HashMap<String, u32>,
    /// Per id: `Some(b)` for a byte token, decoded as the single byte `b`.
    byte_of: Vec<Option<u8>>,
    /// Per id: an unused slot, decoded as nothing.
    unused: Vec<bool>,
    /// The token of each byte value: `<0xXX>`, else the byte itself as text (llama.cpp's
    /// fallback), else none (the byte is dropped, where llama.cpp would abort).
    byte_token: [Option<u32>; 256],
    merging: Merging,
}

impl std::fmt::Debug for SpmVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpmVocab")
            .field("n_vocab", &self.texts.len())
            .field(
                "merging",
                &match self.merging {
                    Merging::Scores(_) => "scores",
                    Merging::Ranks { .. } => "ranks",
                },
            )
            .finish()
    }
}

/// `<0xXX>` → XX.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Length of the UTF-8 sequence a lead byte starts (1 for a stray continuation byte), as
/// llama.cpp's `unicode_len_utf8`.
fn utf8_len(lead: u8) -> usize {
    match lead >> 4 {
        0xf => 4,
        0xe => 3,
        0xc | 0xd => 2,
        _ => 1,
    }
}

/// One piece of a word being merged: `[start, start + len)` of the word, linked to its
/// neighbours (`usize::MAX` = none). A piece merged into its left neighbour has `len == 0`.
#[derive(Clone, Copy)]
struct Piece {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

fn pieces_of(word: &[u8]) -> Vec<Piece> {
    let mut pieces = Vec::with_capacity(word.len());
    let mut at = 0;
    while at < word.len() {
        let len = utf8_len(word[at]).min(word.len() - at);
        let index = pieces.len();
        pieces.push(Piece {
            start: at,
            len,
            prev: if index == 0 { NONE } else { index - 1 },
            next: if at + len == word.len() {
                NONE
            } else {
                index + 1
            },
        });
        at += len;
    }
    pieces
}

/// Merge `right` into `left` (its left neighbour).
fn merge(pieces: &mut [Piece], left: usize, right: usize) {
    pieces[left].len += pieces[right].len;
    pieces[right].len = 0;
    let next = pieces[right].next;
    pieces[left].next = next;
    if next != NONE {
        pieces[next].prev = left;
    }
}

/// A candidate merge in the score queue: highest score first, then the leftmost.
struct ScoreCandidate {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for ScoreCandidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for ScoreCandidate {}
impl PartialOrd for ScoreCandidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for ScoreCandidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}

/// A candidate merge in the rank queue: lowest rank first, then the leftmost. It is stale
/// once either side changed length (a piece only grows by absorbing its right neighbour).
#[derive(PartialEq, Eq)]
struct RankCandidate {
    rank: u32,
    left: usize,
    right: usize,
    left_len: usize,
    right_len: usize,
}

impl PartialOrd for RankCandidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for RankCandidate {
    fn cmp(&self, other: &Self) -> Ordering {
        other.rank.cmp(&self.rank).then(other.left.cmp(&self.left))
    }
}

impl SpmVocab {
    /// A vocabulary from its token texts, GGUF token types, and merging rule. `types` has
    /// one entry per token (callers check the length).
    pub fn new(texts: Vec<String>, types: &[i32], merging: Merging) -> SpmVocab {
        let mut ids = HashMap::with_capacity(texts.len());
        for (id, t) in texts.iter().enumerate() {
            ids.insert(t.clone(), id as u32);
        }
        let byte_of: Vec<Option<u8>> = texts
            .iter()
            .zip(types)
            .map(|(t, &ty)| {
                if ty == TOKEN_TYPE_BYTE {
                    parse_byte_token(t)
                } else {
                    None
                }
            })
            .collect();
        let unused = types.iter().map(|&t| t == TOKEN_TYPE_UNUSED).collect();
        let mut byte_token = [None; 256];
        for (b, slot) in byte_token.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = ids.get(&hex).copied().or_else(|| {
                std::str::from_utf8(&[b as u8])
                    .ok()
                    .and_then(|s| ids.get(s).copied())
            });
        }
        SpmVocab {
            texts,
            ids,
            byte_of,
            unused,
            byte_token,
            merging,
        }
    }

    /// A rank table from the `"left right"` merge strings (already split by the caller).
    pub fn ranks(texts: &[String], merges: &[(String, String)]) -> Merging {
        let mut ids: HashMap<&str, u32> = HashMap::with_capacity(texts.len());
        for (id, t) in texts.iter().enumerate() {
            ids.insert(t.as_str(), id as u32);
        }
        let mut by_id = HashMap::with_capacity(merges.len());
        let mut by_text = HashMap::new();
        // On a repeated pair the first rank stays, as llama.cpp's `emplace` keeps it.
        for (rank, (l, r)) in merges.iter().enumerate() {
            let rank = rank as u32;
            match (ids.get(l.as_str()), ids.get(r.as_str())) {
                (Some(&a), Some(&b)) => {
                    by_id.entry((a, b)).or_insert(rank);
                }
                _ => {
                    by_text.entry((l.clone(), r.clone())).or_insert(rank);
                }
            }
        }
        Merging::Ranks { by_id, by_text }
    }

    /// The tokenizer model this rule belongs to: `llama` (scores) or `gemma4` (ranks).
    pub fn model_name(&self) -> &'static str {
        match self.merging {
            Merging::Scores(_) => "llama",
            Merging::Ranks { .. } => "gemma4",
        }
    }

    /// The id of a token text.
    pub fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// The vocabulary text of `id`.
    pub fn text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The bytes an ordinary token stands for: `▁` as a space, a byte token as its byte, an
    /// unused slot as nothing.
    pub fn piece_bytes(&self, id: u32) -> Vec<u8> {
        let i = id as usize;
        if let Some(Some(b)) = self.byte_of.get(i) {
            return vec![*b];
        }
        if self.unused.get(i) == Some(&true) {
            return Vec::new();
        }
        self.texts
            .get(i)
            .map(|t| t.replace('\u{2581}', " ").into_bytes())
            .unwrap_or_default()
    }

    /// Encode one fragment of ordinary text (spaces already written as `▁` by the caller).
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        match &self.merging {
            Merging::Scores(scores) => self.encode_scores(text.as_bytes(), scores, out),
            Merging::Ranks { by_id, by_text } => {
                // Split into runs of newlines and runs of everything else.
                let bytes = text.as_bytes();
                let mut start = 0;
                while start < bytes.len() {
                    let newline = bytes[start] == b'\n';
                    let end = bytes[start..]
                        .iter()
                        .position(|&b| (b == b'\n') != newline)
                        .map_or(bytes.len(), |p| start + p);
                    let word = &text[start..end];
                    match self.ids.get(word) {
                        // A run of newlines that is a token stays whole (llama.cpp's gemma-4 rule).
                        Some(&id) if newline => out.push(id),
                        _ => self.encode_ranks(word.as_bytes(), by_id, by_text, out),
                    }
                    start = end;
                }
            }
        }
    }

    fn id_of_bytes(&self, bytes: &[u8]) -> Option<u32> {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| self.ids.get(s).copied())
    }

    fn push_bytes(&self, bytes: &[u8], out: &mut Vec<u32>) {
        out.extend(bytes.iter().filter_map(|&b| self.byte_token[b as usize]));
    }

    fn encode_scores(&self, word: &[u8], scores: &[f32], out: &mut Vec<u32>) {
        let mut pieces = pieces_of(word);
        if pieces.is_empty() {
            return;
        }
        let mut queue = BinaryHeap::new();
        // The pair each merged text was last built from, to split an unknown result back.
        let mut built_from: HashMap<&[u8], (usize, usize)> = HashMap::new();
        for i in 1..pieces.len() {
            self.score_pair(word, scores, &pieces, &mut queue, &mut built_from, i - 1, i);
        }
        while let Some(c) = queue.pop() {
            let (l, r) = (pieces[c.left], pieces[c.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != c.size {
                continue;
            }
            merge(&mut pieces, c.left, c.right);
            let prev = pieces[c.left].prev;
            let next = pieces[c.left].next;
            self.score_pair(
                word,
                scores,
                &pieces,
                &mut queue,
                &mut built_from,
                prev,
                c.left,
            );
            self.score_pair(
                word,
                scores,
                &pieces,
                &mut queue,
                &mut built_from,
                c.left,
                next,
            );
        }
        let mut i = 0;
        while i != NONE {
            self.resegment(word, &pieces, &built_from, i, out);
            i = pieces[i].next;
        }
    }

    /// Queue the merge of two neighbouring pieces if their concatenation is a token.
    #[allow(clippy::too_many_arguments)]
    fn score_pair<'w>(
        &self,
        word: &'w [u8],
        scores: &[f32],
        pieces: &[Piece],
        queue: &mut BinaryHeap<ScoreCandidate>,
        built_from: &mut HashMap<&'w [u8], (usize, usize)>,
        left: usize,
        right: usize,
    ) {
        if left == NONE || right == NONE {
            return;
        }
        let (s, n) = (pieces[left].start, pieces[left].len + pieces[right].len);
        let text = &word[s..s + n];
        let Some(id) = self.id_of_bytes(text) else {
            return;
        };
        let Some(&score) = scores.get(id as usize) else {
            return;
        };
        queue.push(ScoreCandidate {
            score,
            left,
            right,
            size: n,
        });
        built_from.insert(text, (left, right));
    }

    /// A final piece: its token, else the two pieces it was built from, else its bytes.
    fn resegment(
        &self,
        word: &[u8],
        pieces: &[Piece],
        built_from: &HashMap<&[u8], (usize, usize)>,
        i: usize,
        out: &mut Vec<u32>,
    ) {
        let p = pieces[i];
        let text = &word[p.start..p.start + p.len];
        if let Some(id) = self.id_of_bytes(text) {
            out.push(id);
            return;
        }
        match built_from.get(text) {
            Some(&(l, r)) => {
                self.resegment(word, pieces, built_from, l, out);
                self.resegment(word, pieces, built_from, r, out);
            }
            None => self.push_bytes(text, out),
        }
    }

    fn encode_ranks(
        &self,
        word: &[u8],
        by_id: &HashMap<(u32, u32), u32>,
        by_text: &HashMap<(String, String), u32>,
        out: &mut Vec<u32>,
    ) {
        let mut pieces = pieces_of(word);
        if pieces.is_empty() {
            return;
        }
        let rank_of = |pieces: &[Piece], left: usize, right: usize| -> Option<u32> {
            let (a, b) = (pieces[left], pieces[right]);
            let lt = &word[a.start..a.start + a.len];
            let rt = &word[b.start..b.start + b.len];
            if let (Some(x), Some(y)) = (self.id_of_bytes(lt), self.id_of_bytes(rt)) {
                if let Some(&r) = by_id.get(&(x, y)) {
                    return Some(r);
                }
            }
            if by_text.is_empty() {
                return None;
            }
            let key = (
                String::from_utf8_lossy(lt).into_owned(),
                String::from_utf8_lossy(rt).into_owned(),
            );
            by_text.get(&key).copied()
        };
        let mut queue = BinaryHeap::new();
        let push = |pieces: &[Piece], queue: &mut BinaryHeap<RankCandidate>, l: usize, r: usize| {
            if l == NONE || r == NONE {
                return;
            }
            if let Some(rank) = rank_of(pieces, l, r) {
                queue.push(RankCandidate {
                    rank,
                    left: l,
                    right: r,
                    left_len: pieces[l].len,
                    right_len: pieces[r].len,
                });
            }
        };
        for i in 1..pieces.len() {
            push(&pieces, &mut queue, i - 1, i);
        }
        while let Some(c) = queue.pop() {
            let (l, r) = (pieces[c.left], pieces[c.right]);
            if l.len == 0 || r.len == 0 || l.len != c.left_len || r.len != c.right_len {
                continue;
            }
            merge(&mut pieces, c.left, c.right);
            let prev = pieces[c.left].prev;
            let next = pieces[c.left].next;
            push(&pieces, &mut queue, prev, c.left);
            push(&pieces, &mut queue, c.left, next);
        }
        let mut i = 0;
        while i != NONE {
            let p = pieces[i];
            let text = &word[p.start..p.start + p.len];
            match self.id_of_bytes(text) {
                Some(id) => out.push(id),
                None => self.push_bytes(text, out),
            }
            i = p.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(tokens: &[&str], merging: impl FnOnce(&[String]) -> Merging) -> SpmVocab {
        let mut texts: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        texts.extend(tokens.iter().map(|t| t.to_string()));
        let mut types = vec![TOKEN_TYPE_BYTE; 256];
        types.extend(std::iter::repeat_n(1, tokens.len()));
        let merging = merging(&texts);
        SpmVocab::new(texts, &types, merging)
    }

    #[test]
    fn scores_merge_the_best_pair_first_and_fall_back_to_bytes() {
        // "▁ab" (best) beats "ab"; "é" is no token and becomes its two bytes.
        let tokens = ["▁", "a", "b", "ab", "▁a", "▁ab"];
        let mut scores = vec![0.0; 256];
        scores.extend([-1.0, -1.0, -1.0, -5.0, -3.0, -2.0]);
        let v = vocab(&tokens, |_| Merging::Scores(scores));
        let mut out = Vec::new();
        v.encode("▁abé", &mut out);
        assert_eq!(out, vec![256 + 5, 0xc3, 0xa9]);
        assert_eq!(v.piece_bytes(256 + 5), b" ab");
        assert_eq!(v.piece_bytes(0xc3), vec![0xc3]);
    }

    #[test]
    fn ranks_merge_lowest_first_and_keep_newline_runs() {
        let tokens = ["a", "b", "c", "ab", "bc", "abc", "\n\n", "\n"];
        let merges =
            [("b", "c"), ("a", "b"), ("a", "bc")].map(|(l, r)| (l.to_string(), r.to_string()));
        let v = vocab(&tokens, |t| SpmVocab::ranks(t, &merges));
        let mut out = Vec::new();
        v.encode("abc\n\nab\n\n\nx", &mut out);
        let id = |t: &str| v.id(t).unwrap();
        // "b c" ranks first, then "a bc"; "\n\n" is whole, "\n\n\n" is no token so it merges
        // (no merges for "\n") into three "\n"; "x" falls back to its byte.
        assert_eq!(
            out,
            vec![
                id("abc"),
                id("\n\n"),
                id("ab"),
                id("\n"),
                id("\n"),
                id("\n"),
                b'x' as u32
            ]
        );
    }
}
