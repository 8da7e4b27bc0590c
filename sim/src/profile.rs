//! Device profiles: the numbers that turn a replay's reads and computes into time.
//!
//! A profile is a small JSON file (`sim/profiles/*.json`): a flash model (latency, lane and
//! device rates, alignment, jitter), a compute model (dense and expert processing rates,
//! fixed costs, eviction cost, loop overhead, jitter), the memory `--cache-mb auto` would see,
//! and where every number came from. Rates are in bytes per second rather than per-model
//! times, so one device profile prices any model's trace (its layout says how many bytes each
//! layer and expert is); `head_ms` is the exception and is stated per profile.
//!
//! The files under `sim/profiles/` are compiled in and addressed by name; any other path is
//! read from disk. `DEFAULT_PROFILE` is used when `--profile` is not given.

use crate::compute::ComputeParams;
use crate::error::SimError;
use crate::flash::FlashParams;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The profile a replay uses without `--profile`: the origin's 12 GB phone, fitted to its
/// measured anchors (docs/simulator.md).
pub const DEFAULT_PROFILE: &str = "origin-12gb-phone";

/// Built-in profiles: (name, JSON text).
pub const BUILTIN: [(&str, &str); 5] = [
    (
        "origin-12gb-phone",
        include_str!("../profiles/origin-12gb-phone.json"),
    ),
    ("ufs40-phone", include_str!("../profiles/ufs40-phone.json")),
    (
        "ufs40-phone-cycles",
        include_str!("../profiles/ufs40-phone-cycles.json"),
    ),
    ("laptop-nvme", include_str!("../profiles/laptop-nvme.json")),
    (
        "this-machine",
        include_str!("../profiles/this-machine.json"),
    ),
];

/// A device: flash, compute, memory, and the provenance of each number.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    /// Short name (`origin-12gb-phone`).
    pub name: String,
    /// What the device is and how the numbers were obtained.
    pub description: String,
    /// Where each number comes from (datasheets, measurements, fits).
    pub sources: Vec<String>,
    pub flash: FlashParams,
    pub compute: ComputeParams,
    /// What `MemAvailable` reads on the device with the model loaded, MiB: the input of
    /// `--cache-mb auto`.
    pub mem_available_mib: u64,
    /// Compute threads the device runs (printed as the CSV preamble's `threads=`).
    pub threads: u32,
}

impl DeviceProfile {
    /// Parse and check a profile's JSON; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<DeviceProfile, SimError> {
        let p: DeviceProfile = serde_json::from_str(text).map_err(|e| SimError::Profile {
            name: origin.to_string(),
            reason: e.to_string(),
        })?;
        p.validate()?;
        Ok(p)
    }

    /// Check every number is usable.
    pub fn validate(&self) -> Result<(), SimError> {
        self.flash.validate(&self.name)?;
        self.compute.validate(&self.name)?;
        if self.threads == 0 {
            return Err(SimError::Profile {
                name: self.name.clone(),
                reason: "threads must be > 0".to_string(),
            });
        }
        Ok(())
    }

    /// A built-in profile by name, or the JSON file at `spec`. A name that is neither lists
    /// the built-in names in the error.
    pub fn load(spec: &str) -> Result<DeviceProfile, SimError> {
        if let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == spec) {
            return DeviceProfile::from_json(text, spec);
        }
        let path = Path::new(spec);
        if path.exists() {
            let text = std::fs::read_to_string(path).map_err(|e| SimError::io(path, e))?;
            return DeviceProfile::from_json(&text, spec);
        }
        let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
        Err(SimError::Profile {
            name: spec.to_string(),
            reason: format!(
                "no such file and not a built-in profile (built-in: {})",
                names.join(", ")
            ),
        })
    }

    /// The profile as pretty JSON (what `calibrate` writes).
    pub fn to_json(&self) -> String {
        // Serialising plain numbers and strings cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_loads_and_round_trips() {
        for (name, text) in BUILTIN {
            let p = DeviceProfile::from_json(text, name).expect(name);
            assert_eq!(p.name, name, "a file's name field matches its file name");
            assert!(!p.sources.is_empty(), "{name} states its sources");
            let again = DeviceProfile::from_json(&p.to_json(), name).expect("round trip");
            assert_eq!(again, p);
        }
        assert!(DeviceProfile::load(DEFAULT_PROFILE).is_ok());
    }

    #[test]
    fn bad_profiles_are_refused_with_their_name() {
        let e = DeviceProfile::load("no-such-profile").expect_err("unknown");
        assert!(e.to_string().contains("built-in: origin-12gb-phone"), "{e}");
        let (_, text) = BUILTIN[0];
        let bad = text.replace("\"threads\": 4", "\"threads\": 0");
        assert!(DeviceProfile::from_json(&bad, "x").is_err());
        let extra = text.replacen('{', "{\"surprise\": 1,", 1);
        assert!(DeviceProfile::from_json(&extra, "x")
            .expect_err("unknown field")
            .to_string()
            .contains("surprise"));
    }
}
