#!/usr/bin/env bash
# Builds the real control plane used by Bulwark's Rust tests, from Go modules:
#   OUT/bin/kube-apiserver  (k8s.io/kubernetes, see go.mod)
#   OUT/bin/etcd            (go.etcd.io/etcd/server/v3, the version k/k requires)
#   OUT/bin/kubectl         (k8s.io/kubectl)
#   OUT/bin/cpdriver        (this module's client-go driver)
#
# Usage: build.sh [OUT]      OUT defaults to target/controlplane in the repo.
#
# The Go build cache lives in OUT/gocache so a warm rebuild is fast; the module
# cache is Go's default. A binary is skipped when it is newer than go.mod,
# go.sum, this script and every .go file in the module, and was built by the
# same Go toolchain with the same flags (FORCE=1 builds anyway; go's own cache
# then makes that a relink at most). See README.md for measured times.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$repo/target/controlplane}"

if ! command -v go >/dev/null 2>&1; then
  cat >&2 <<'EOF'
build.sh: the Go toolchain ('go') is not on PATH.
Install Go 1.26 or newer: the official tarball from the Go website unpacked
into /usr/local/go (then add /usr/local/go/bin to PATH), or your system's
package (e.g. 'apt-get install golang-1.26' where available). Then re-run.
EOF
  exit 1
fi
# Never let go fetch a different toolchain: fail clearly instead.
export GOTOOLCHAIN=local
need_minor=26
have="$(go env GOVERSION)"            # e.g. go1.26.8
have_minor="$(echo "$have" | sed -E 's/^go1\.([0-9]+).*/\1/')"
if ! [[ "$have_minor" =~ ^[0-9]+$ ]] || (( have_minor < need_minor )); then
  echo "build.sh: $have is too old; kube-apiserver 1.36 needs Go 1.$need_minor or newer." >&2
  exit 1
fi

mkdir -p "$out/bin" "$out/gocache"
out="$(cd "$out" && pwd)"
export GOCACHE="$out/gocache"
export CGO_ENABLED=0
# No VCS stamping: the binaries must not change (and relink) with every
# commit of the surrounding repository.
export GOFLAGS="-mod=readonly -buildvcs=false"

cd "$here"

# Version stamps, as k/k's hack/lib/version.sh sets them, taken from the
# k8s.io/kubernetes version in go.mod (so `kube-apiserver --version` and
# `/version` report it rather than v0.0.0-master).
read -r kver ktime < <(go list -m -f '{{.Version}} {{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)
kmajor="$(echo "$kver" | sed -E 's/^v([0-9]+)\..*/\1/')"
kminor="$(echo "$kver" | sed -E 's/^v[0-9]+\.([0-9]+)\..*/\1/')"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$kver -X $pkg.gitMajor=$kmajor -X $pkg.gitMinor=$kminor"
  ldflags+=" -X $pkg.gitTreeState=archive -X $pkg.buildDate=$ktime"
done

# What a binary depends on besides the module cache (which is immutable per
# version, and versions are fixed by go.mod/go.sum).
stamp="$have CGO_ENABLED=$CGO_ENABLED $ldflags"

up_to_date() { # $1 = binary path
  local bin="$1"
  [[ "${FORCE:-0}" != 1 && -x "$bin" && -f "$bin.stamp" ]] || return 1
  [[ "$(cat "$bin.stamp")" == "$stamp" ]] || return 1
  [[ -z "$(find "$here" \( -name '*.go' -o -name go.mod -o -name go.sum -o -name build.sh \) -newer "$bin" -print -quit)" ]]
}

total_start=$SECONDS
# kube-apiserver first: it compiles most of what the others share.
for name in kube-apiserver kubectl etcd cpdriver; do
  bin="$out/bin/$name"
  if up_to_date "$bin"; then
    echo "$name: up to date ($bin)"
    continue
  fi
  start=$(date +%s.%N)
  go build -trimpath -ldflags "$ldflags" -o "$bin.tmp" "./cmd/$name"
  mv -f "$bin.tmp" "$bin"
  echo "$stamp" > "$bin.stamp"
  end=$(date +%s.%N)
  awk -v n="$name" -v s="$start" -v e="$end" -v b="$bin" 'BEGIN { printf "%s: built in %.1fs (%s)\n", n, e - s, b }'
done
echo "controlplane: done in $((SECONDS - total_start))s; binaries in $out/bin"
