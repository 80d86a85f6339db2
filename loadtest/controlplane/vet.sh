#!/usr/bin/env bash
# Checks this module: gofmt, then `go vet ./...` (using build.sh's Go build
# cache in OUT/gocache, so it is quick after a build).
#
# Usage: vet.sh [OUT]      OUT defaults to target/controlplane in the repo.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$repo/target/controlplane}"

if ! command -v go >/dev/null 2>&1; then
  echo "vet.sh: the Go toolchain ('go', 1.26 or newer) is not on PATH; see build.sh." >&2
  exit 1
fi
export GOTOOLCHAIN=local
mkdir -p "$out/gocache"
export GOCACHE="$(cd "$out" && pwd)/gocache"
export CGO_ENABLED=0
# The same build flags as build.sh (-trimpath, no VCS stamping), so vet reuses
# its compiled packages instead of compiling every dependency again.
export GOFLAGS="-mod=readonly -buildvcs=false -trimpath"

cd "$here"
unformatted="$(gofmt -l .)"
if [[ -n "$unformatted" ]]; then
  echo "vet.sh: not gofmt-clean:" >&2
  echo "$unformatted" >&2
  exit 1
fi
go vet ./...
echo "vet.sh: gofmt and go vet clean"
