//! The simulator's errors as Python exceptions. The message is the one the binary prints
//! after `bmoe-sim: error:` (it names the file, the flag or the field at fault); the type says
//! what kind of wrong it was, so a caller can catch it: `FileNotFoundError` and the other
//! `OSError`s for a path, `ValueError` for an input or a flag the simulator refuses (a bad
//! flag value, a malformed trace, an unknown policy), `RuntimeError` for a run that went wrong
//! inside the core (a cache that lost its accounting, a policy naming an impossible victim).

use bmoe_sim::SimError;
use pyo3::exceptions::{
    PyFileNotFoundError, PyIsADirectoryError, PyOSError, PyPermissionError, PyRuntimeError,
    PyValueError,
};
use pyo3::PyErr;

pyo3::create_exception!(
    _native,
    PolicyError,
    PyRuntimeError,
    "A Python eviction policy raised, or answered what the cache cannot use; the message names \
     the policy and the call, the cause is the policy's own exception."
);

/// `e` as the Python exception of its kind.
pub fn sim_error(e: SimError) -> PyErr {
    let message = e.to_string();
    match &e {
        SimError::Io { source, .. } => match source.kind() {
            std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(message),
            std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(message),
            std::io::ErrorKind::IsADirectory => PyIsADirectoryError::new_err(message),
            _ => PyOSError::new_err(message),
        },
        SimError::Cache(_) | SimError::Step(_) | SimError::Clairvoyant { .. } => {
            PyRuntimeError::new_err(message)
        }
        _ => PyValueError::new_err(message),
    }
}

/// A usage error of `bmoe-sim SUB` (clap's message: the flag, the value, what it accepts).
pub fn usage(sub: &str, rendered: &str) -> PyErr {
    let text = rendered.trim_end();
    let text = text.strip_prefix("error: ").unwrap_or(text);
    PyValueError::new_err(format!("bmoe-sim {sub}: {text}"))
}
