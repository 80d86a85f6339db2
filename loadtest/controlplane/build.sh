#!/usr/bin/env bash
# Builds the real control plane used by Bulwark's Rust tests, from Go modules:
#   OUT/bin/kube-apiserver  (k8s.io/kubernetes, see go.mod)
#   OUT/bin/etcd            (go.etcd.io/etcd/server/v3, the version k/k requires)
#   OUT/bin/kubectl         (k8s.io/kubectl)
#   OUT/bin/cpdriver        (this module's client-go driver)
#   OUT/bin/kube-controller-manager, OUT/bin/kube-scheduler (k8s.io/kubernetes)
#   OUT/bin/helm            (helm.sh/helm/v3/cmd/helm, in its own module: helm/go.mod)
#   OUT/bin/kwok            (sigs.k8s.io/kwok/cmd/kwok, in its own module: kwok/go.mod)
#
# Usage: build.sh [OUT [NAME...]]   OUT defaults to target/controlplane in the repo;
#                                   NAMEs pick some of the binaries (default: all).
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
shift $(( $# > 0 ? 1 : 0 ))
all=(kube-apiserver kubectl etcd cpdriver kube-controller-manager kube-scheduler helm kwok)
wanted=("${@:-${all[@]}}")
for name in "${wanted[@]}"; do
  [[ " ${all[*]} " == *" $name "* ]] || { echo "build.sh: no binary '$name' (${all[*]})" >&2; exit 2; }
done
want() { [[ " ${wanted[*]} " == *" $1 "* ]]; }

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

up_to_date() { # $1 = binary path, $2 = its stamp, $3 = its module folder
  local bin="$1" stamp="$2" module="$3"
  [[ "${FORCE:-0}" != 1 && -x "$bin" && -f "$bin.stamp" ]] || return 1
  [[ "$(cat "$bin.stamp")" == "$stamp" ]] || return 1
  # helm/ and kwok/ are modules of their own: their files never make the control plane stale.
  [[ -z "$(find "$module" "$here/build.sh" \( \( -path "$here/helm" -o -path "$here/kwok" \) -a ! -path "$module" \) -prune \
    -o \( -name '*.go' -o -name go.mod -o -name go.sum -o -name build.sh \) -newer "$bin" -print -quit)" ]]
}

total_start=$SECONDS
# kube-apiserver first: it compiles most of what the others share.
for name in kube-apiserver kubectl etcd cpdriver kube-controller-manager kube-scheduler; do
  want "$name" || continue
  bin="$out/bin/$name"
  if up_to_date "$bin" "$stamp" "$here"; then
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
# helm, for the chart in deploy/helm: its own module graph (helm/go.mod), because helm
# v3.22 needs the k8s.io v0.37 modules where the control plane above pins v0.36.5. The
# -X flags are the ones helm's Makefile sets: its version, and the Kubernetes version that
# `helm template` and `helm lint` assume (from the k8s.io/client-go it is built with).
if want helm; then
  bin="$out/bin/helm"
  cd "$here/helm"
  hver="$(go list -m -f '{{.Version}}' helm.sh/helm/v3)"
  cver="$(go list -m -f '{{.Version}}' k8s.io/client-go)"   # v0.37.0 = Kubernetes 1.37
  cminor="$(echo "$cver" | sed -E 's/^v0\.([0-9]+)\..*/\1/')"
  hldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$hver"
  hldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=archive"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    hldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$cminor"
  done
  hstamp="$have CGO_ENABLED=$CGO_ENABLED $hldflags"
  if up_to_date "$bin" "$hstamp" "$here/helm"; then
    echo "helm: up to date ($bin)"
  else
    start=$(date +%s.%N)
    go build -trimpath -ldflags "$hldflags" -o "$bin.tmp" helm.sh/helm/v3/cmd/helm
    mv -f "$bin.tmp" "$bin"
    echo "$hstamp" > "$bin.stamp"
    end=$(date +%s.%N)
    awk -v s="$start" -v e="$end" -v b="$bin" 'BEGIN { printf "helm: built in %.1fs (%s)\n", e - s, b }'
  fi
  cd "$here"
fi
# KWOK's controller, which speaks for simulated nodes and their pods: its own module graph
# (kwok/go.mod) like helm's, at the version it was released with.
if want kwok; then
  bin="$out/bin/kwok"
  cd "$here/kwok"
  kwstamp="$have CGO_ENABLED=$CGO_ENABLED $(go list -m -f '{{.Version}}' sigs.k8s.io/kwok) -s -w"
  if up_to_date "$bin" "$kwstamp" "$here/kwok"; then
    echo "kwok: up to date ($bin)"
  else
    start=$(date +%s.%N)
    go build -trimpath -ldflags "-s -w" -o "$bin.tmp" sigs.k8s.io/kwok/cmd/kwok
    mv -f "$bin.tmp" "$bin"
    echo "$kwstamp" > "$bin.stamp"
    end=$(date +%s.%N)
    awk -v s="$start" -v e="$end" -v b="$bin" 'BEGIN { printf "kwok: built in %.1fs (%s)\n", e - s, b }'
  fi
  cd "$here"
fi
echo "controlplane: done in $((SECONDS - total_start))s; binaries in $out/bin"
