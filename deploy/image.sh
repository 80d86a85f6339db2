#!/usr/bin/env bash
# Builds Bulwark's image without a Docker daemon and without pulling anything: buildah
# builds deploy/Dockerfile's final stage (FROM scratch) from a context holding BINARY and
# the libraries it links (deploy/rootfs.sh), then runs `bulwark --version` in the image as
# user 65532 and checks the image's user, entrypoint and command. The build stage of the
# Dockerfile (cargo in the Rust image) is left out: CI reaches no container registry.
#
# Usage: deploy/image.sh [BINARY]   BINARY defaults to target/debug/bulwark, the binary
#                                   `cargo test` builds; pass target/release/bulwark for
#                                   the release build.
# Needs buildah (Debian: apt-get install -y buildah) and root. Its storage lives in a
# temporary folder that is removed on exit.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${1:-$repo/target/debug/bulwark}"
[[ -x "$bin" ]] || { echo "image.sh: no binary at $bin (cargo build -p bulwark first)" >&2; exit 1; }
command -v buildah >/dev/null || { echo "image.sh: buildah is not installed (apt-get install -y buildah)" >&2; exit 1; }

work="$(mktemp -d)"
ctr=""
cleanup() {
  [[ -z "$ctr" ]] || buildah "${store[@]}" rm "$ctr" >/dev/null 2>&1 || true
  buildah "${store[@]}" rmi --all --force >/dev/null 2>&1 || true
  rm -rf "$work"
}
# vfs needs no kernel overlay support and chroot isolation no user namespaces: both work
# as root inside a container, as CI runs.
store=(--root "$work/storage" --runroot "$work/run" --storage-driver vfs)
trap cleanup EXIT

ctx="$work/context"
sh "$repo/deploy/rootfs.sh" "$bin" "$ctx/rootfs"
install -m 0755 "$bin" "$ctx/bulwark"
# The SBOM the build stage makes (BULWARK_SBOM: made beforehand, as .ci/run does).
sbom="${BULWARK_SBOM:-}"
if [[ -z "$sbom" ]]; then
  command -v cargo-sbom >/dev/null || { echo "image.sh: set BULWARK_SBOM, or install cargo-sbom (cargo install cargo-sbom --version 0.10.0 --locked)" >&2; exit 1; }
  sbom="$work/sbom.cdx.json"
  (cd "$repo" && cargo sbom --cargo-package bulwark --output-format cyclone_dx_json_1_6) >"$sbom"
fi
install -m 0644 "$sbom" "$ctx/sbom.cdx.json"
# The labels: the binary's version, the checkout's commit, and its origin when that is a URL.
version_arg="$("$bin" --version | awk '{print $2}')"
revision_arg="$(git -C "$repo" rev-parse HEAD)"
source_arg="$(git -C "$repo" config --get remote.origin.url || true)"
[[ "$source_arg" == https://* ]] || source_arg=""
# The Dockerfile's final stage, reading from this context instead of the build stage.
sed -n '/^FROM scratch/,$p' "$repo/deploy/Dockerfile" |
  sed 's#^COPY --from=build /out/#COPY #' >"$ctx/Containerfile"
grep -q '^FROM scratch' "$ctx/Containerfile" || { echo "image.sh: deploy/Dockerfile has no FROM scratch stage" >&2; exit 1; }
if grep -q -- '--from=' "$ctx/Containerfile"; then
  echo "image.sh: the final stage copies from elsewhere than /out/ of the build stage" >&2
  exit 1
fi

image=localhost/bulwark:ci
buildah "${store[@]}" bud --isolation chroot --layers=false -f "$ctx/Containerfile" -t "$image" \
  --build-arg VERSION="$version_arg" --build-arg REVISION="$revision_arg" --build-arg SOURCE="$source_arg" "$ctx"
buildah "${store[@]}" images "$image"

user="$(buildah "${store[@]}" inspect --type image --format '{{.OCIv1.Config.User}}' "$image")"
entrypoint="$(buildah "${store[@]}" inspect --type image --format '{{.OCIv1.Config.Entrypoint}}' "$image")"
echo "image user: $user; entrypoint: $entrypoint"
[[ "$user" == 65532:65532 ]] || { echo "image.sh: the image runs as '$user', not 65532:65532" >&2; exit 1; }
label() { buildah "${store[@]}" inspect --type image --format "{{index .OCIv1.Config.Labels \"org.opencontainers.image.$1\"}}" "$image"; }
echo "labels: version $(label version), revision $(label revision), source '$(label source)'"
[[ "$(label version)" == "$version_arg" && -n "$version_arg" ]] || { echo "image.sh: the version label is not the binary's" >&2; exit 1; }
[[ "$(label revision)" == "$revision_arg" ]] || { echo "image.sh: the revision label is not the checkout's commit" >&2; exit 1; }

ctr="$(buildah "${store[@]}" from --pull-never "$image")"
echo "files in the image:"
(cd "$ctx/rootfs" && find . -type f | sed 's#^\.##'; echo /usr/local/bin/bulwark) | sort
version="$(buildah "${store[@]}" run --isolation chroot --user 65532:65532 "$ctr" -- /usr/local/bin/bulwark --version)"
echo "bulwark --version in the image, as 65532: $version"
[[ "$version" == "bulwark "* ]] || { echo "image.sh: unexpected version output" >&2; exit 1; }
mnt="$(buildah "${store[@]}" mount "$ctr")"
in_image="$mnt/usr/local/share/doc/bulwark/sbom.cdx.json"
grep -q '"name": *"rustls"' "$in_image" || { echo "image.sh: the image's SBOM does not list rustls" >&2; exit 1; }
echo "the image's SBOM lists $(grep -c '"purl"' "$in_image") components"
buildah "${store[@]}" umount "$ctr" >/dev/null
