//! Reading an architecture's hyper-parameters from GGUF metadata: `<arch>.<key>` values, scalar
//! or per layer, each checked once with the key and what was expected named in the error.

use super::ArchError;
use crate::gguf::{GgufFile, Value};

/// The metadata of one file, read under one architecture's key prefix.
pub struct Meta<'a> {
    pub f: &'a GgufFile,
    pub arch: &'static str,
}

impl<'a> Meta<'a> {
    pub fn new(f: &'a GgufFile, arch: &'static str) -> Meta<'a> {
        Meta { f, arch }
    }

    /// `<arch>.<name>`.
    pub fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.arch)
    }

    /// An error about metadata key `<arch>.<name>`.
    pub fn err(&self, name: &str, what: impl Into<String>) -> ArchError {
        ArchError::Key {
            file: self.f.path().display().to_string(),
            key: self.key(name),
            what: what.into(),
        }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.f.get(&self.key(name))
    }

    fn as_usize(&self, name: &str, v: &Value) -> Result<usize, ArchError> {
        let n = v
            .as_u64()
            .ok_or_else(|| self.err(name, format!("is {v}, expected a non-negative integer")))?;
        usize::try_from(n).map_err(|_| self.err(name, "does not fit this machine's usize"))
    }

    /// A required count. A per-layer array is accepted when every entry agrees.
    pub fn req_u(&self, name: &str) -> Result<usize, ArchError> {
        let v = self
            .get(name)
            .ok_or_else(|| self.err(name, format!("is missing (required for {})", self.arch)))?;
        if let Some(arr) = v.as_array() {
            let first = arr
                .first()
                .ok_or_else(|| self.err(name, "is an empty array"))?;
            let n = self.as_usize(name, first)?;
            if arr.iter().any(|x| x.as_u64() != first.as_u64()) {
                return Err(self.err(name, "varies per layer, which this build does not support"));
            }
            return Ok(n);
        }
        self.as_usize(name, v)
    }

    /// An optional count (`None` when absent).
    pub fn opt_u(&self, name: &str) -> Result<Option<usize>, ArchError> {
        match self.get(name) {
            None => Ok(None),
            Some(_) => self.req_u(name).map(Some),
        }
    }

    /// A count per layer: a scalar (the same for every layer) or an array of `n_layer`
    /// entries. `None` when absent.
    pub fn per_layer_u(&self, name: &str, n_layer: usize) -> Result<Option<Vec<usize>>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        match v.as_array() {
            None => Ok(Some(vec![self.as_usize(name, v)?; n_layer])),
            Some(arr) => {
                if arr.len() != n_layer {
                    return Err(self.err(
                        name,
                        format!(
                            "has {} entries, expected one per layer ({n_layer})",
                            arr.len()
                        ),
                    ));
                }
                arr.iter()
                    .map(|x| self.as_usize(name, x))
                    .collect::<Result<_, _>>()
                    .map(Some)
            }
        }
    }

    /// A flag per layer (an array of `n_layer` booleans). `None` when absent.
    pub fn per_layer_bool(
        &self,
        name: &str,
        n_layer: usize,
    ) -> Result<Option<Vec<bool>>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(name, format!("is {v}, expected an array of booleans")))?;
        if arr.len() != n_layer {
            return Err(self.err(
                name,
                format!(
                    "has {} entries, expected one per layer ({n_layer})",
                    arr.len()
                ),
            ));
        }
        arr.iter()
            .map(|x| {
                x.as_bool()
                    .ok_or_else(|| self.err(name, format!("holds {x}, expected booleans")))
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// A required number.
    pub fn req_f(&self, name: &str) -> Result<f32, ArchError> {
        let v = self
            .get(name)
            .ok_or_else(|| self.err(name, format!("is missing (required for {})", self.arch)))?;
        self.num(name, v)
    }

    /// An optional number, `default` when absent.
    pub fn opt_f(&self, name: &str, default: f32) -> Result<f32, ArchError> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => self.num(name, v),
        }
    }

    fn num(&self, name: &str, v: &Value) -> Result<f32, ArchError> {
        let x = v
            .as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| self.err(name, format!("is {v}, expected a number")))?;
        if !x.is_finite() {
            return Err(self.err(name, format!("is {x}, expected a finite number")));
        }
        Ok(x)
    }

    /// An optional string.
    pub fn opt_str(&self, name: &str) -> Result<Option<&'a str>, ArchError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(name, format!("is {v}, expected a string"))),
        }
    }

    /// Refuse a value outside `lo..=hi`, naming the key.
    pub fn check_range(&self, name: &str, v: usize, lo: usize, hi: usize) -> Result<(), ArchError> {
        if v < lo || v > hi {
            return Err(self.err(name, format!("is {v}, expected {lo}..={hi}")));
        }
        Ok(())
    }
}
