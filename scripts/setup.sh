#!/usr/bin/env bash
# Installs what a fresh Debian machine with only the Rust toolchain lacks, then builds.
# Idempotent: installs nothing that is already there.
set -euo pipefail
need=()
# libclang: userfaultfd-sys runs bindgen at build time (the shared-memory layer needs it).
if ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 && ! ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1; then
  need+=(libclang-dev)
fi
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
cargo build --workspace --bins --release --quiet
