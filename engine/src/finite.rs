//! Non-finite numbers stop a run instead of becoming text.
//!
//! NaN logits sample as token 0 every time, so a model with broken weights (a misread file,
//! `gen --router-gain nan`) used to print `!!!!!!!!` and exit 0. Every step's logits are
//! checked (one pass over `n_vocab` floats, nothing beside a forward pass); `--check-finite`
//! adds a check after each layer's named intermediates to find where the first NaN appears.

use bmoe_core::records::Phase;
use bmoe_core::StepInput;

/// Non-finite values in `v`: (count, index of the first), or `None` when all are finite.
pub fn non_finite(v: &[f32]) -> Option<(usize, usize)> {
    let first = v.iter().position(|x| !x.is_finite())?;
    let count = v[first..].iter().filter(|x| !x.is_finite()).count();
    Some((count, first))
}

/// Why a step's output cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("the logits of the {step} are not finite ({count} of {total} values are NaN or infinite): the model's weights or options produce NaN; rerun with --check-finite to find the first layer that does")]
pub struct NonFiniteLogits {
    /// `prefill step (positions 0..7)` or `decode step at position 12`.
    pub step: String,
    pub count: usize,
    pub total: usize,
}

/// `prefill step (positions 0..=7)`, `decode step of turn 2 at position 12`.
pub fn describe(input: &StepInput<'_>) -> String {
    let first = input.positions.first().copied().unwrap_or(0);
    let last = input.positions.last().copied().unwrap_or(0);
    let turn = if input.turn > 0 {
        format!(" of turn {}", input.turn)
    } else {
        String::new()
    };
    match input.phase {
        Phase::Prefill => format!("prefill step{turn} (positions {first}..={last})"),
        Phase::Decode => format!("decode step{turn} at position {last}"),
    }
}

/// `Ok` when every logit of the step is finite.
pub fn check_logits(logits: &[f32], input: &StepInput<'_>) -> Result<(), NonFiniteLogits> {
    check_logits_of(logits, || describe(input))
}

/// `check_logits` with the step named by `step` (called only when a logit is not finite).
pub fn check_logits_of(
    logits: &[f32],
    step: impl FnOnce() -> String,
) -> Result<(), NonFiniteLogits> {
    match non_finite(logits) {
        None => Ok(()),
        Some((count, _)) => Err(NonFiniteLogits {
            step: step(),
            count,
            total: logits.len(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_first_and_counts() {
        assert_eq!(non_finite(&[1.0, 2.0]), None);
        assert_eq!(
            non_finite(&[1.0, f32::NAN, 3.0, f32::INFINITY]),
            Some((2, 1))
        );
    }

    #[test]
    fn the_error_names_the_step() {
        let input = StepInput {
            turn: 0,
            phase: Phase::Decode,
            tokens: &[5],
            positions: &[12],
        };
        let e = check_logits(&[0.0, f32::NAN], &input).unwrap_err();
        let t = e.to_string();
        assert!(t.contains("decode step at position 12"), "{t}");
        assert!(t.contains("1 of 2"), "{t}");
        let input = StepInput {
            turn: 0,
            phase: Phase::Prefill,
            tokens: &[1, 2, 3],
            positions: &[0, 1, 2],
        };
        let t = check_logits(&[f32::NAN], &input).unwrap_err().to_string();
        assert!(t.contains("prefill step (positions 0..=2)"), "{t}");
        assert!(check_logits(&[0.5], &input).is_ok());
    }
}
