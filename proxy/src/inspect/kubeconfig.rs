//! The kubeconfig, read as kubectl reads it: `--kubeconfig`, else every file `KUBECONFIG`
//! lists (the first to name a cluster, user or context wins), else `~/.kube/config`; the
//! current context (or `--context`), its cluster's server and CA, and its user's client
//! certificate or token. Files named in a kubeconfig are relative to it.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Deserialize;

use super::fetch::{Dial, client_config};

/// Why the kubeconfig gives no way to the apiserver.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    /// No file to read.
    #[error("no kubeconfig: pass --kubeconfig or set KUBECONFIG (~/.kube/config does not exist)")]
    Missing,
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file is not a kubeconfig.
    #[error("{}: not a kubeconfig: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// A problem with what the kubeconfig says.
    #[error("kubeconfig: {0}")]
    Invalid(String),
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
struct File {
    #[serde(default)]
    clusters: Vec<NamedCluster>,
    #[serde(default)]
    users: Vec<NamedUser>,
    #[serde(default)]
    contexts: Vec<NamedContext>,
    #[serde(default)]
    current_context: Option<String>,
}

#[derive(Deserialize)]
struct NamedCluster {
    name: String,
    cluster: Cluster,
}

#[derive(Deserialize)]
struct NamedUser {
    name: String,
    #[serde(default)]
    user: User,
}

#[derive(Deserialize)]
struct NamedContext {
    name: String,
    context: Context,
}

#[derive(Deserialize, Clone)]
#[serde(rename_all = "kebab-case")]
struct Cluster {
    server: String,
    #[serde(default)]
    certificate_authority: Option<PathBuf>,
    #[serde(default)]
    certificate_authority_data: Option<String>,
    #[serde(default)]
    insecure_skip_tls_verify: bool,
    #[serde(default)]
    tls_server_name: Option<String>,
    #[serde(default)]
    proxy_url: Option<String>,
}

#[derive(Deserialize, Clone, Default)]
#[serde(rename_all = "kebab-case")]
struct User {
    #[serde(default)]
    client_certificate: Option<PathBuf>,
    #[serde(default)]
    client_certificate_data: Option<String>,
    #[serde(default)]
    client_key: Option<PathBuf>,
    #[serde(default)]
    client_key_data: Option<String>,
    #[serde(default)]
    token: Option<String>,
    #[serde(default, rename = "tokenFile")]
    token_file: Option<PathBuf>,
    #[serde(default)]
    exec: Option<serde_json::Value>,
    #[serde(default)]
    auth_provider: Option<serde_json::Value>,
    #[serde(default)]
    username: Option<String>,
}

#[derive(Deserialize, Clone)]
struct Context {
    cluster: String,
    #[serde(default)]
    user: Option<String>,
}

/// The apiserver of the chosen context, and how to reach it.
pub struct Apiserver {
    /// The server URL.
    pub server: String,
    /// TLS, name and credential for [`super::fetch::get`].
    pub dial: Dial,
    /// The cluster's CA, PEM: the admin listeners' CA when `--admin-ca` is not given.
    pub ca: Vec<u8>,
    /// The context's user, for messages.
    pub user: String,
}

/// The kubeconfig files: `explicit` (`--kubeconfig`), else `KUBECONFIG`'s list (`env`),
/// else `home`/.kube/config.
pub fn files(
    explicit: Option<&Path>,
    env: Option<&str>,
    home: Option<&Path>,
) -> Result<Vec<PathBuf>, KubeconfigError> {
    if let Some(path) = explicit {
        return Ok(vec![path.to_path_buf()]);
    }
    if let Some(list) = env.filter(|l| !l.trim().is_empty()) {
        let files: Vec<PathBuf> = std::env::split_paths(list)
            .filter(|p| !p.as_os_str().is_empty())
            .collect();
        if !files.is_empty() {
            return Ok(files);
        }
    }
    let default = home.ok_or(KubeconfigError::Missing)?.join(".kube/config");
    if default.exists() {
        Ok(vec![default])
    } else {
        Err(KubeconfigError::Missing)
    }
}

/// Reads `files` (missing ones skipped when there are several, as kubectl does) and
/// resolves `context` (default: the current context).
pub fn load(files: &[PathBuf], context: Option<&str>) -> Result<Apiserver, KubeconfigError> {
    let mut read = Vec::new();
    for path in files {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if files.len() > 1 && e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(KubeconfigError::Read {
                    path: path.clone(),
                    source,
                });
            }
        };
        let file: File = if text.trim().is_empty() {
            File::default()
        } else {
            serde_norway::from_str(&text).map_err(|e| KubeconfigError::Parse {
                path: path.clone(),
                message: e.to_string(),
            })?
        };
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        read.push((dir, file));
    }
    resolve(&read, context)
}

// Over 120 lines: kubectl's merge rules for one context in the order kubectl applies them
// (context, cluster, user, then each credential source), each with its own error.
fn resolve(read: &[(PathBuf, File)], context: Option<&str>) -> Result<Apiserver, KubeconfigError> {
    let invalid = |m: String| KubeconfigError::Invalid(m);
    let name = match context {
        Some(name) => name.to_owned(),
        None => read
            .iter()
            .find_map(|(_, f)| f.current_context.clone().filter(|c| !c.is_empty()))
            .ok_or_else(|| invalid("no current-context: pass --context".into()))?,
    };
    let context = read
        .iter()
        .find_map(|(_, f)| f.contexts.iter().find(|c| c.name == name))
        .ok_or_else(|| invalid(format!("no context {name:?}")))?
        .context
        .clone();
    let (cluster_dir, cluster) = read
        .iter()
        .find_map(|(dir, f)| {
            f.clusters
                .iter()
                .find(|c| c.name == context.cluster)
                .map(|c| (dir, c.cluster.clone()))
        })
        .ok_or_else(|| {
            invalid(format!(
                "context {name:?} names cluster {:?}, which is not there",
                context.cluster
            ))
        })?;
    let user_name = context.user.clone().unwrap_or_default();
    let (user_dir, user) = match &context.user {
        None => (cluster_dir, User::default()),
        Some(user) => read
            .iter()
            .find_map(|(dir, f)| {
                f.users
                    .iter()
                    .find(|u| &u.name == user)
                    .map(|u| (dir, u.user.clone()))
            })
            .ok_or_else(|| {
                invalid(format!(
                    "context {name:?} names user {user:?}, which is not there"
                ))
            })?,
    };
    if cluster.insecure_skip_tls_verify {
        return Err(invalid(format!(
            "cluster {:?} sets insecure-skip-tls-verify; give its certificate-authority instead",
            context.cluster
        )));
    }
    if cluster.proxy_url.is_some() {
        return Err(invalid(format!(
            "cluster {:?} sets proxy-url, which this command does not support",
            context.cluster
        )));
    }
    let ca = data_or_file(
        cluster.certificate_authority_data.as_deref(),
        cluster.certificate_authority.as_deref(),
        cluster_dir,
        "certificate-authority",
    )?
    .ok_or_else(|| {
        invalid(format!(
            "cluster {:?} has no certificate-authority(-data)",
            context.cluster
        ))
    })?;
    if user.exec.is_some() || user.auth_provider.is_some() {
        return Err(invalid(format!(
            "user {user_name:?} gets its credential from an exec or auth-provider plugin, \
             which this command does not run: use a context with a client certificate or a token"
        )));
    }
    if user.username.is_some() {
        return Err(invalid(format!(
            "user {user_name:?} has a username and password, which this command does not send"
        )));
    }
    let cert = data_or_file(
        user.client_certificate_data.as_deref(),
        user.client_certificate.as_deref(),
        user_dir,
        "client-certificate",
    )?;
    let key = data_or_file(
        user.client_key_data.as_deref(),
        user.client_key.as_deref(),
        user_dir,
        "client-key",
    )?;
    let client = match (&cert, &key) {
        (Some(cert), Some(key)) => Some((cert.as_slice(), key.as_slice())),
        (None, None) => None,
        _ => {
            return Err(invalid(format!(
                "user {user_name:?} has a client certificate or a key, not both"
            )));
        }
    };
    let bearer = match (&user.token, &user.token_file) {
        (Some(token), _) => Some(token.trim().to_owned()),
        (None, Some(file)) => {
            let path = user_dir.join(file);
            let token = std::fs::read_to_string(&path).map_err(|source| KubeconfigError::Read {
                path: path.clone(),
                source,
            })?;
            Some(token.trim().to_owned())
        }
        (None, None) => None,
    };
    let tls = client_config(&ca, client).map_err(|e| {
        invalid(format!(
            "cluster {:?} or user {user_name:?}: {e}",
            context.cluster
        ))
    })?;
    Ok(Apiserver {
        server: cluster.server,
        dial: Dial {
            tls: Some(tls),
            server_name: cluster.tls_server_name,
            bearer,
            timeout: std::time::Duration::ZERO,
        },
        ca,
        user: user_name,
    })
}

/// The bytes of a `FOO-data` field (base64) or of the `FOO` file, relative to `dir`.
fn data_or_file(
    data: Option<&str>,
    file: Option<&Path>,
    dir: &Path,
    field: &str,
) -> Result<Option<Vec<u8>>, KubeconfigError> {
    if let Some(data) = data {
        return base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map(Some)
            .map_err(|e| KubeconfigError::Invalid(format!("{field}-data is not base64: {e}")));
    }
    match file {
        Some(file) => {
            let path = dir.join(file);
            std::fs::read(&path)
                .map(Some)
                .map_err(|source| KubeconfigError::Read { path, source })
        }
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Vec<(PathBuf, File)> {
        vec![(PathBuf::from("."), serde_norway::from_str(text).unwrap())]
    }

    #[test]
    fn what_the_kubeconfig_lacks_is_said_by_name() {
        let text = "clusters:\n- name: c\n  cluster: {server: 'https://a:6443'}\n\
                    users:\n- name: u\n  user: {exec: {command: aws}}\n\
                    contexts:\n- name: x\n  context: {cluster: c, user: u}\n";
        let error = |context| resolve(&parsed(text), context).err().unwrap().to_string();
        assert_eq!(
            error(None),
            "kubeconfig: no current-context: pass --context"
        );
        assert_eq!(error(Some("y")), "kubeconfig: no context \"y\"");
        assert_eq!(
            error(Some("x")),
            "kubeconfig: cluster \"c\" has no certificate-authority(-data)"
        );
    }

    #[test]
    fn the_files_are_the_flag_else_kubeconfig_s_list_else_the_home_one() {
        let flag = Path::new("/k/flag");
        assert_eq!(
            files(Some(flag), Some("/a:/b"), None).unwrap(),
            vec![flag.to_path_buf()]
        );
        assert_eq!(
            files(None, Some("/a::/b"), None).unwrap(),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert!(matches!(
            files(None, None, Some(Path::new("/nowhere"))),
            Err(KubeconfigError::Missing)
        ));
    }
}
