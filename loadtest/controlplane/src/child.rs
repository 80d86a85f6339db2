//! Child processes that never outlive the runner: each gets its own process group (so a
//! stop reaches whatever it started, and a terminal's Ctrl-C reaches only the runner, which
//! stops them in order), is killed when its handle is dropped, and is started through
//! util-linux's `setpriv --pdeathsig KILL` where that exists, so that the kernel kills it
//! even when the runner dies without unwinding (SIGKILL, a test harness's timeout).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tokio::process::Command;

/// A command for `program` with the guarantees above. The death signal belongs to the
/// thread that spawns: spawn from a thread that lives as long as the children should
/// (a runtime's worker or the test's own thread, not a blocking-pool thread).
pub fn command(program: impl AsRef<OsStr>) -> Command {
    let mut command = match setpriv() {
        Some(setpriv) => {
            let mut c = Command::new(setpriv);
            c.args(["--pdeathsig", "KILL", "--"]).arg(program);
            c
        }
        None => Command::new(program),
    };
    command.process_group(0).kill_on_drop(true);
    command
}

/// Sends `signal` to the process group led by `pid` (as [`command`] starts them); a group
/// that is gone already is not an error.
pub fn signal_group(pid: u32, signal: rustix::process::Signal) {
    let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return;
    };
    let _ = rustix::process::kill_process_group(pid, signal);
}

fn setpriv() -> Option<&'static Path> {
    static SETPRIV: OnceLock<Option<PathBuf>> = OnceLock::new();
    SETPRIV.get_or_init(|| on_path("setpriv")).as_deref()
}

/// Where `name` is on `PATH`, if anywhere.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_child_leads_its_own_process_group() {
        let out = command("sh")
            .args(["-c", "cut -d' ' -f5 /proc/$$/stat; echo $$"])
            .output()
            .await
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines = text.lines();
        let group = lines.next().unwrap();
        let pid = lines.next().unwrap();
        assert_eq!(group, pid, "process group == pid");
    }
}
