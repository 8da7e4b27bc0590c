//! Output files checked against the inputs and each other before anything is created, and
//! files that name themselves in their write errors.
//!
//! Why: an output flag pointed at an input (`--csv model.gguf`) used to truncate the model
//! and then die of SIGBUS on the mapping; two outputs on one path silently lost one of them;
//! and an output that could not be written (`--csv /dev/full`) failed only after the whole
//! generation ran, without naming the file. Here every output is compared with every input
//! and with every other output (by canonical path and by device + inode, so symlinks and hard
//! links are seen through) *before anything is created*, then created and probed, so a bad
//! output costs nothing. Every later write error names its file.

use anyhow::{bail, Result};
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// What a path is, for comparing it with others: its canonical form (the parent's, joined
/// with the name, for a file that does not exist yet) and, when it exists, its device and
/// inode.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Identity {
    canonical: PathBuf,
    inode: Option<(u64, u64)>,
}

impl Identity {
    fn of(path: &Path) -> io::Result<Identity> {
        match std::fs::metadata(path) {
            Ok(m) => Ok(Identity {
                canonical: std::fs::canonicalize(path)?,
                inode: Some((m.dev(), m.ino())),
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let name = path.file_name().ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, "the path names no file")
                })?;
                let parent = match path.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
                let dir = std::fs::canonicalize(parent).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("its directory {} cannot be used: {e}", parent.display()),
                    )
                })?;
                Ok(Identity {
                    canonical: dir.join(name),
                    inode: None,
                })
            }
            Err(e) => Err(e),
        }
    }

    fn same_as(&self, other: &Identity) -> bool {
        self.canonical == other.canonical
            || matches!((self.inode, other.inode), (Some(a), Some(b)) if a == b)
    }

    /// `/dev/null` may take any number of outputs: nothing written there is lost.
    fn discards(&self) -> bool {
        self.canonical == Path::new("/dev/null")
    }
}

/// An input or output of a run: the flag that named it (for messages) and the path.
#[derive(Clone, Debug)]
pub struct Named<'a> {
    pub flag: &'a str,
    pub path: &'a Path,
}

impl<'a> Named<'a> {
    pub fn new(flag: &'a str, path: &'a Path) -> Self {
        Named { flag, path }
    }
}

/// Refuse outputs that are an input or another output. Nothing is created or truncated.
/// Inputs that do not exist are compared by path only (opening them fails later anyway).
pub fn check_distinct(inputs: &[Named<'_>], outputs: &[Named<'_>]) -> Result<()> {
    let input_ids: Vec<Option<Identity>> =
        inputs.iter().map(|n| Identity::of(n.path).ok()).collect();
    let mut output_ids: Vec<Identity> = Vec::with_capacity(outputs.len());
    for o in outputs {
        let id = Identity::of(o.path).map_err(|e| {
            anyhow::anyhow!("{} {}: cannot be written: {e}", o.flag, o.path.display())
        })?;
        for (i, iid) in inputs.iter().zip(&input_ids) {
            if iid.as_ref().is_some_and(|iid| id.same_as(iid)) && !id.discards() {
                bail!(
                    "{} {} is the same file as the input {} {}: refusing to overwrite an input; choose another path",
                    o.flag,
                    o.path.display(),
                    i.flag,
                    i.path.display()
                );
            }
        }
        for (prev, pid) in outputs.iter().zip(&output_ids) {
            if id.same_as(pid) && !id.discards() {
                bail!(
                    "{} {} and {} {} are the same file: each output needs its own path",
                    prev.flag,
                    prev.path.display(),
                    o.flag,
                    o.path.display()
                );
            }
        }
        output_ids.push(id);
    }
    Ok(())
}

/// A file being written whose errors name it: `PATH: No space left on device (os error 28)`.
#[derive(Debug)]
pub struct NamedFile {
    pub(crate) path: PathBuf,
    pub(crate) file: File,
}

impl NamedFile {
    /// Create (or truncate) `path` for the output named by `flag`, and check that it takes
    /// writes: a zero-length write fails on a device that refuses every write (`/dev/full`),
    /// and a regular file's filesystem must have free blocks.
    pub fn create(flag: &str, path: &Path) -> Result<NamedFile> {
        let file = File::create(path)
            .map_err(|e| anyhow::anyhow!("{flag} {}: cannot create: {e}", path.display()))?;
        probe_writable(&file)
            .map_err(|e| anyhow::anyhow!("{flag} {}: cannot write: {e}", path.display()))?;
        Ok(NamedFile {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn named(&self, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("{}: {e}", self.path.display()))
    }
}

impl Write for NamedFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf).map_err(|e| self.named(e))
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush().map_err(|e| self.named(e))
    }
}

pub(crate) fn probe_writable(f: &File) -> io::Result<()> {
    // SAFETY: a zero-length write from a valid (dangling but unused) pointer on an open fd.
    let r = unsafe { libc::write(f.as_raw_fd(), [0u8; 0].as_ptr().cast(), 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    if f.metadata()?.is_file() {
        // SAFETY: statvfs is plain data, filled by the call on success.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatvfs(f.as_raw_fd(), &mut st) } == 0 {
            // Root may write into the reserved blocks; others only into the available ones.
            let free = if unsafe { libc::geteuid() } == 0 {
                st.f_bfree
            } else {
                st.f_bavail
            };
            if free == 0 {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
        }
    }
    Ok(())
}
