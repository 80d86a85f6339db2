#!/usr/bin/env bash
# cargo-deny over the workspace's lock file (deny.toml says what is allowed): licences,
# duplicate versions and sources always; advisories when the advisory database can be had.
#
#   bash .ci/deny.sh
#
# The advisory database is a git repository that cargo-deny clones; a machine that cannot
# reach it (a sandbox that reaches package registries only) checks advisories against a
# copy fetched earlier if there is one, and otherwise says plainly that advisories were not
# checked. Any other failure of any check fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo deny --version >/dev/null 2>&1; then
  echo "--- installing cargo-deny"
  cargo install --locked cargo-deny
fi
cargo deny --version

cargo deny check --hide-inclusion-graph licenses bans sources

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if cargo deny check --hide-inclusion-graph advisories 2>"$log"; then
  echo "advisories: checked against a freshly fetched database"
elif grep -q "failed to fetch advisory database" "$log"; then
  dbs="${CARGO_HOME:-$HOME/.cargo}/advisory-dbs"
  if compgen -G "$dbs/*/crates" >/dev/null; then
    echo "advisories: the database cannot be fetched; checking against the copy fetched before"
    cargo deny --offline check advisories
  else
    echo "advisories: NOT CHECKED: the advisory database cannot be fetched from this machine and no earlier copy exists"
  fi
else
  cat "$log" >&2
  exit 1
fi
