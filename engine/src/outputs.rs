//! A run's output files (`--csv`, the traces, `--logits-out`), opened and checked before the
//! model loads, with the checks of [`crate::files`].

pub use crate::files::NamedFile;
use crate::files::{check_distinct, Named};
use anyhow::Result;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

/// The outputs of one generation run, created and probed.
#[derive(Debug, Default)]
pub struct RunOutputs {
    pub csv: Option<BufWriter<NamedFile>>,
    pub route_trace: Option<BufWriter<NamedFile>>,
    pub io_trace: Option<BufWriter<NamedFile>>,
    /// `--compute-trace` / `--compute-trace-layers`, with its granularity.
    pub compute_trace: Option<(crate::optrace::Granularity, BufWriter<NamedFile>)>,
    /// `--logits-out PATH` and its `PATH.json` sidecar.
    pub logits: Option<BufWriter<NamedFile>>,
    pub logits_json: Option<NamedFile>,
}

/// The files of a model: the path itself, and for a split model every shard the name implies.
fn model_inputs(model: &Path) -> Vec<PathBuf> {
    let mut v = crate::gguf::split_shard_paths(model);
    if !v.iter().any(|p| p == model) {
        v.push(model.to_path_buf());
    }
    v
}

/// The path of `--logits-out PATH`'s JSON sidecar.
pub fn logits_sidecar(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(".json");
    PathBuf::from(s)
}

impl RunOutputs {
    /// Check every output of a run against the model's files and each other, then create
    /// them. Call before loading the model: a bad output costs nothing.
    pub fn open(model: &Path, args: &crate::cli::RunArgs) -> Result<RunOutputs> {
        let shards = model_inputs(model);
        let inputs: Vec<Named<'_>> = shards.iter().map(|p| Named::new("-m", p)).collect();
        let t = &args.telemetry;
        let sidecar = args.logits_out.as_deref().map(logits_sidecar);
        let mut outputs = Vec::new();
        for (flag, p) in [
            ("--csv", t.csv.as_deref()),
            ("--route-trace", t.route_trace.as_deref()),
            ("--io-trace", t.io_trace.as_deref()),
            ("--compute-trace", args.compute_trace.as_deref()),
            (
                "--compute-trace-layers",
                args.compute_trace_layers.as_deref(),
            ),
            ("--logits-out", args.logits_out.as_deref()),
            ("--logits-out (its .json sidecar)", sidecar.as_deref()),
        ] {
            if let Some(p) = p {
                outputs.push(Named::new(flag, p));
            }
        }
        check_distinct(&inputs, &outputs)?;
        let open = |flag: &str, p: Option<&Path>| -> Result<Option<BufWriter<NamedFile>>> {
            p.map(|p| NamedFile::create(flag, p).map(BufWriter::new))
                .transpose()
        };
        Ok(RunOutputs {
            csv: open("--csv", t.csv.as_deref())?,
            route_trace: open("--route-trace", t.route_trace.as_deref())?,
            io_trace: open("--io-trace", t.io_trace.as_deref())?,
            compute_trace: match args.compute_trace() {
                Some((g, p)) => {
                    let flag = match g {
                        crate::optrace::Granularity::Op => "--compute-trace",
                        crate::optrace::Granularity::Layers => "--compute-trace-layers",
                    };
                    Some((g, BufWriter::new(NamedFile::create(flag, p)?)))
                }
                None => None,
            },
            logits: open("--logits-out", args.logits_out.as_deref())?,
            logits_json: sidecar
                .as_deref()
                .map(|p| NamedFile::create("--logits-out (its .json sidecar)", p))
                .transpose()?,
        })
    }
}

impl Drop for RunOutputs {
    /// The `--logits-out` sidecar is written last, once the run's rows are known; a run that
    /// stopped before that (a load error, a refused prompt) leaves no empty `PATH.json` behind
    /// to pass for a description of the logits.
    fn drop(&mut self) {
        if let Some(json) = self.logits_json.take() {
            let path = json.path().to_path_buf();
            drop(json);
            if std::fs::metadata(&path).is_ok_and(|m| m.len() == 0) {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Write;

    #[test]
    fn an_unwritten_logits_sidecar_is_removed_when_the_run_stops() {
        let dir = crate::testdata::scratch_dir("outputs-sidecar");
        let path = dir.join("logits.bin");
        let side = logits_sidecar(&path);
        let mut outputs = RunOutputs::default();
        outputs.logits_json = Some(NamedFile::create("--logits-out", &side).unwrap());
        assert!(side.exists());
        drop(outputs);
        assert!(!side.exists(), "an empty sidecar was left behind");
        // A written one stays.
        let mut json = NamedFile::create("--logits-out", &side).unwrap();
        json.write_all(b"{}").unwrap();
        let mut outputs = RunOutputs::default();
        outputs.logits_json = Some(json);
        drop(outputs);
        assert!(side.exists());
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("bmoe-outputs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn an_output_on_an_input_is_refused_through_links() {
        let d = scratch("links");
        let model = d.join("m.gguf");
        std::fs::write(&model, b"model bytes").unwrap();
        let hard = d.join("hard.csv");
        std::fs::hard_link(&model, &hard).unwrap();
        let soft = d.join("soft.csv");
        std::os::unix::fs::symlink(&model, &soft).unwrap();
        let rel = d.join("sub/../m.gguf");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        for out in [&model, &hard, &soft, &rel] {
            let e = check_distinct(&[Named::new("-m", &model)], &[Named::new("--csv", out)])
                .expect_err("an output on the model must be refused");
            assert!(e.to_string().contains("refusing to overwrite"), "{e}");
        }
        assert_eq!(std::fs::read(&model).unwrap(), b"model bytes");
    }

    #[test]
    fn two_outputs_on_one_new_path_are_refused_but_dev_null_is_shared() {
        let d = scratch("two");
        let a = d.join("a.csv");
        let also_a = d.join("./a.csv");
        let e = check_distinct(
            &[],
            &[
                Named::new("--csv", &a),
                Named::new("--route-trace", &also_a),
            ],
        )
        .expect_err("same new path twice");
        assert!(
            e.to_string().contains("each output needs its own path"),
            "{e}"
        );
        assert!(!a.exists(), "nothing is created by the check");
        let null = Path::new("/dev/null");
        check_distinct(
            &[],
            &[Named::new("--csv", null), Named::new("--io-trace", null)],
        )
        .unwrap();
    }

    #[test]
    fn an_output_in_a_missing_directory_is_named() {
        let e = check_distinct(
            &[],
            &[Named::new(
                "--csv",
                Path::new("/nonexistent-bmoe-dir/x.csv"),
            )],
        )
        .expect_err("missing directory");
        let t = e.to_string();
        assert!(t.contains("--csv /nonexistent-bmoe-dir/x.csv"), "{t}");
        assert!(t.contains("/nonexistent-bmoe-dir"), "{t}");
    }

    #[test]
    fn dev_full_is_caught_at_create() {
        if !Path::new("/dev/full").exists() {
            eprintln!("skipped: no /dev/full on this system");
            return;
        }
        let e = NamedFile::create("--csv", Path::new("/dev/full")).expect_err("/dev/full");
        let t = e.to_string();
        assert!(
            t.contains("--csv /dev/full") && t.contains("No space left"),
            "{t}"
        );
    }

    #[test]
    fn write_errors_name_the_file() {
        let mut f = NamedFile {
            path: PathBuf::from("/dev/full"),
            file: match File::options().write(true).open("/dev/full") {
                Ok(f) => f,
                Err(_) => return,
            },
        };
        let e = f.write_all(b"x").expect_err("ENOSPC");
        assert!(e.to_string().starts_with("/dev/full: "), "{e}");
    }
}
