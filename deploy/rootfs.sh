#!/bin/sh
# Lays out the root file system of Bulwark's FROM-scratch image: exactly the shared
# libraries the binary links (as ldd lists them, the dynamic loader included, each at the
# path ldd names) and /etc/passwd and /etc/group naming root and "nonroot" (65532, the
# user the image and the DaemonSet run as). The binary itself is copied by the Dockerfile.
# Used by deploy/Dockerfile's build stage and by deploy/image.sh; POSIX sh, so it runs in
# any build image.
#   rootfs.sh BINARY DIR
set -eu
bin="$1"
dir="$2"
mkdir -p "$dir/etc"
# "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2
# (0x...)"; linux-vdso has no file. A "not found" stops the build.
if ldd "$bin" | grep -q 'not found'; then
  ldd "$bin" >&2
  echo "rootfs.sh: $bin links a library this system lacks" >&2
  exit 1
fi
ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u |
  while read -r lib; do
    mkdir -p "$dir$(dirname "$lib")"
    # -L: the file, not the distribution's symlink to it.
    cp -L "$lib" "$dir$lib"
    echo "rootfs.sh: $lib"
  done
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$dir/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$dir/etc/group"
