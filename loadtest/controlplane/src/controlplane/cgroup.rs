//! A cgroup v1 memory cgroup per kube-apiserver: the kernel enforces
//! `--apiserver-memory-limit` and its OOM killer is the one that kills, as on a real node;
//! the cgroup's counters say whether it did and how much memory the replica peaked at.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where cgroup v1's memory controller is mounted.
pub const DEFAULT_ROOT: &str = "/sys/fs/cgroup/memory";

/// Folder names start with this, then the owner's pid and the replica's index.
const PREFIX: &str = "bulwark-cp-";

/// Why a memory cgroup could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The controller is not mounted there (a cgroup v2-only machine, or no such folder).
    #[error(
        "{root} is not a cgroup v1 memory controller (no memory.limit_in_bytes); \
         --apiserver-memory-limit needs cgroup v1's memory controller mounted there"
    )]
    NoController {
        /// The folder looked at.
        root: PathBuf,
    },
    /// Creating the folder or writing one of its files failed.
    #[error(
        "{path} is not writable ({source}); --apiserver-memory-limit needs root, or a memory \
         cgroup folder delegated to this user"
    )]
    NotWritable {
        /// The folder or file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
}

/// One memory cgroup, removed by [`MemoryCgroup::remove`] once its processes are gone.
#[derive(Debug)]
pub struct MemoryCgroup {
    path: PathBuf,
    limit: u64,
}

impl MemoryCgroup {
    /// Creates (or reuses) `ROOT/bulwark-cp-<our pid>-<index>` with this limit, after removing
    /// the empty ones that runs no longer alive left behind.
    pub fn create(root: &Path, index: usize, limit: u64) -> Result<MemoryCgroup, CgroupError> {
        if !root.join("memory.limit_in_bytes").exists() {
            return Err(CgroupError::NoController {
                root: root.to_path_buf(),
            });
        }
        remove_stale(root);
        let path = root.join(format!("{PREFIX}{}-{index}", std::process::id()));
        let not_writable = |path: &Path, source| CgroupError::NotWritable {
            path: path.to_path_buf(),
            source,
        };
        match std::fs::create_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(not_writable(&path, e)),
        }
        let file = path.join("memory.limit_in_bytes");
        std::fs::write(&file, limit.to_string()).map_err(|e| not_writable(&file, e))?;
        Ok(MemoryCgroup { path, limit })
    }

    /// The cgroup's folder.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file a process writes its pid into to join.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// The limit in bytes: the cgroup's own, which someone may have changed since, or the
    /// one it was created with.
    pub fn limit(&self) -> u64 {
        std::fs::read_to_string(self.path.join("memory.limit_in_bytes"))
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(self.limit)
    }

    /// How many processes the kernel's OOM killer has killed in this cgroup.
    pub fn oom_kills(&self) -> u64 {
        std::fs::read_to_string(self.path.join("memory.oom_control"))
            .ok()
            .and_then(|text| oom_kill_count(&text))
            .unwrap_or(0)
    }

    /// The most memory the cgroup's processes have used at once, in bytes.
    pub fn peak_bytes(&self) -> Option<u64> {
        std::fs::read_to_string(self.path.join("memory.max_usage_in_bytes"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// The memory the cgroup's processes use now, in bytes.
    pub fn usage_bytes(&self) -> Option<u64> {
        std::fs::read_to_string(self.path.join("memory.usage_in_bytes"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Removes the folder, waiting up to `patience` for killed processes to leave it.
    pub fn remove(&self, patience: Duration) -> std::io::Result<()> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) if std::time::Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// The `oom_kill N` line of `memory.oom_control` (kernels since 4.13).
fn oom_kill_count(oom_control: &str) -> Option<u64> {
    oom_control.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == "oom_kill").then(|| value.trim().parse().ok())?
    })
}

/// The pid in a folder name of ours, `bulwark-cp-<pid>-<index>`.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?;
    let (pid, index) = rest.split_once('-')?;
    index.parse::<usize>().ok()?;
    pid.parse().ok()
}

/// Removes our folders whose owner has exited; a folder with processes still in it stays
/// (the kernel refuses), and so does anything that is not ours.
fn remove_stale(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = owner_pid(&name.to_string_lossy()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_oom_kill_counter() {
        let text = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(oom_kill_count(text), Some(3));
        assert_eq!(oom_kill_count("oom_kill_disable 0\nunder_oom 1\n"), None);
    }

    #[test]
    fn only_our_folder_names_have_an_owner() {
        assert_eq!(owner_pid("bulwark-cp-4242-0"), Some(4242));
        assert_eq!(owner_pid("bulwark-cp-4242"), None);
        assert_eq!(owner_pid("bulwark-cp-x-1"), None);
        assert_eq!(owner_pid("system.slice"), None);
    }

    #[test]
    fn a_folder_that_is_no_memory_controller_is_refused_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let err = MemoryCgroup::create(dir.path(), 0, 1 << 30).unwrap_err();
        assert!(matches!(err, CgroupError::NoController { .. }), "{err}");
        assert!(err.to_string().contains("cgroup v1"), "{err}");
    }
}
