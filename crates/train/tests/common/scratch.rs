//! Scratch space for the integration tests: under cargo's per-target temporary directory (never
//! the system's), one directory per use, named after it and this process, removed when the test
//! ends — also when it fails.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A test's scratch path: a fresh directory of its own, or a path inside one; the directory is
/// removed on drop.
pub struct Scratch {
    root: PathBuf,
    path: PathBuf,
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl Scratch {
    /// The path `rel` inside this scratch directory, which the returned guard now removes.
    pub fn at(mut self, rel: &str) -> Scratch {
        let root = std::mem::take(&mut self.root);
        Scratch {
            path: root.join(rel),
            root,
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Empty once [`Scratch::at`] has handed the directory on.
        if !self.root.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// An empty directory `ferrotext-{name}-{pid}-{n}`.
pub fn scratch(name: &str) -> Scratch {
    let root = fresh_dir(name);
    Scratch {
        path: root.clone(),
        root,
    }
}

/// The path `name` (nothing there yet) inside an empty directory of its own.
pub fn scratch_path(name: &str) -> Scratch {
    scratch(&format!("path-{name}")).at(name)
}

/// A fresh empty directory; a counter keeps two tests of one process that ask for the same name
/// (they run on threads at once) apart.
fn fresh_dir(name: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ferrotext-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("scratch dir");
    root
}
