//! Where the control plane's Go binaries are, and building them with
//! `loadtest/controlplane/build.sh` when the default folder lacks them.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use super::Error;

/// Names a folder holding `etcd`, `kube-apiserver` and `kubectl`; without it the default is
/// `target/controlplane/bin` in the repository.
pub const BIN_ENV: &str = "BULWARK_CONTROLPLANE_BIN";

/// The binaries a control plane and its test need.
const NEEDED: [&str; 3] = ["etcd", "kube-apiserver", "kubectl"];

/// The repository this crate was built from (two folders above the crate).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(Path::parent)
        .unwrap_or(manifest)
        .to_path_buf()
}

/// The folder `build.sh` writes into by default.
pub fn default_dir() -> PathBuf {
    repo_root().join("target/controlplane/bin")
}

/// The folder of the Go binaries.
#[derive(Clone, Debug)]
pub struct Binaries {
    dir: PathBuf,
}

impl Binaries {
    /// A folder that holds every needed binary.
    pub fn at(dir: PathBuf) -> Result<Binaries, Error> {
        let missing = missing(&dir);
        if missing.is_empty() {
            Ok(Binaries { dir })
        } else {
            Err(Error::MissingBinaries { dir, missing })
        }
    }

    /// The folder named by [`BIN_ENV`], which must hold the binaries; else the default
    /// folder, after running `build.sh`: when something is missing there it builds it (the
    /// first build takes minutes and needs Go and the Go module proxy), and otherwise, when
    /// Go is installed, it is a 0.1 s check that rebuilds what `go.mod` or the sources have
    /// changed since.
    pub async fn locate() -> Result<Binaries, Error> {
        if let Some(dir) = std::env::var_os(BIN_ENV) {
            return Binaries::at(PathBuf::from(dir));
        }
        let dir = default_dir();
        let missing = missing(&dir);
        let script = repo_root().join("loadtest/controlplane/build.sh");
        if !script.exists() {
            return Binaries::at(dir);
        }
        if missing.is_empty() {
            if crate::child::on_path("go").is_some()
                && let Err(e) = build(&script).await
            {
                eprintln!("controlplane: {e}; using the binaries built before");
            }
            return Ok(Binaries { dir });
        }
        eprintln!(
            "controlplane: {} missing from {}; building them with {} (the first build takes \
             minutes; set {BIN_ENV} to use binaries from elsewhere)",
            missing.join(", "),
            dir.display(),
            script.display(),
        );
        build(&script).await?;
        Binaries::at(dir)
    }

    /// The folder itself.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `etcd`.
    pub fn etcd(&self) -> PathBuf {
        self.dir.join("etcd")
    }

    /// `kube-apiserver`.
    pub fn kube_apiserver(&self) -> PathBuf {
        self.dir.join("kube-apiserver")
    }

    /// `kubectl`, built from the same Kubernetes version.
    pub fn kubectl(&self) -> PathBuf {
        self.dir.join("kubectl")
    }

    /// kube-controller-manager, kube-scheduler and KWOK, which only a whole cluster needs
    /// (`build.sh` builds them too); an error names the ones missing.
    pub fn components(&self) -> Result<ComponentBinaries, Error> {
        let missing: Vec<&'static str> = COMPONENTS
            .into_iter()
            .filter(|name| !self.dir.join(name).is_file())
            .collect();
        if !missing.is_empty() {
            return Err(Error::MissingBinaries {
                dir: self.dir.clone(),
                missing,
            });
        }
        Ok(ComponentBinaries {
            kube_controller_manager: self.dir.join("kube-controller-manager"),
            kube_scheduler: self.dir.join("kube-scheduler"),
            kwok: self.dir.join("kwok"),
        })
    }
}

/// The binaries of a cluster's components beside its control plane.
#[derive(Clone, Debug)]
pub struct ComponentBinaries {
    /// `kube-controller-manager`.
    pub kube_controller_manager: PathBuf,
    /// `kube-scheduler`.
    pub kube_scheduler: PathBuf,
    /// KWOK's controller, `kwok`.
    pub kwok: PathBuf,
}

/// The binaries [`Binaries::components`] needs.
const COMPONENTS: [&str; 3] = ["kube-controller-manager", "kube-scheduler", "kwok"];

/// Runs `build.sh`, passing on to stderr what it says except its "up to date" lines (the
/// caller's stdout stays its own). A plain child: in the runner's process group, so that a
/// Ctrl-C also stops the Go compiler under it.
async fn build(script: &Path) -> Result<(), Error> {
    use tokio::io::AsyncBufReadExt as _;
    let io = |source| Error::Io {
        path: script.to_path_buf(),
        source,
    };
    let mut child = tokio::process::Command::new("bash")
        .arg(script)
        .current_dir(repo_root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(io)?;
    if let Some(stdout) = child.stdout.take() {
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let mut built = false;
        while let Some(line) = lines.next_line().await.map_err(io)? {
            let quiet = line.contains(": up to date (")
                || (!built && line.starts_with("controlplane: done"));
            built |= line.contains(": built in ");
            if !quiet {
                eprintln!("{line}");
            }
        }
    }
    let status = child.wait().await.map_err(io)?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Build {
            script: script.to_path_buf(),
            status,
        })
    }
}

fn missing(dir: &Path) -> Vec<&'static str> {
    NEEDED
        .into_iter()
        .filter(|name| !dir.join(name).is_file())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repository_root_is_the_workspace() {
        let manifest = std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"));
        assert!(default_dir().ends_with("target/controlplane/bin"));
    }

    #[test]
    fn a_folder_without_the_binaries_names_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("etcd"), "").unwrap();
        match Binaries::at(dir.path().to_path_buf()) {
            Err(Error::MissingBinaries { missing, .. }) => {
                assert_eq!(missing, ["kube-apiserver", "kubectl"]);
            }
            other => panic!("expected missing binaries, got {other:?}"),
        }
    }
}
