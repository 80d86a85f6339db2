//! Setup of the Bulwark process itself.

/// Keeps private keys and tokens held in memory out of core dumps: sets `RLIMIT_CORE` to 0
/// and, on Linux, marks the process non-dumpable (which also stops other processes of the
/// same user from reading its memory through `/proc` or ptrace). Call once at start, before
/// any key is loaded.
#[cfg(unix)]
pub fn make_undumpable() -> std::io::Result<()> {
    use rustix::process::{Resource, Rlimit, setrlimit};
    setrlimit(
        Resource::Core,
        Rlimit {
            current: Some(0),
            maximum: Some(0),
        },
    )?;
    #[cfg(target_os = "linux")]
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[cfg(target_os = "linux")]
    #[test]
    fn the_process_is_made_undumpable() {
        use rustix::process::{DumpableBehavior, Resource, dumpable_behavior, getrlimit};
        super::make_undumpable().expect("allowed for an unprivileged process");
        assert_eq!(getrlimit(Resource::Core).current, Some(0));
        assert_eq!(dumpable_behavior().unwrap(), DumpableBehavior::NotDumpable);
    }
}
