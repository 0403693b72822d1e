#!/usr/bin/env bash
# Installs the system packages a fresh Debian machine with only the Rust toolchain lacks.
# Idempotent: installs nothing that is already there. Builds nothing (the callers do).
set -euo pipefail
need=()
# libclang: userfaultfd-sys runs bindgen at build time (the shared-memory layer needs it).
# (libclang-cpp does not count: bindgen loads libclang.so / libclang-N.so.)
if ! { ldconfig -p 2>/dev/null | grep -qE 'libclang(-[0-9.]+)?\.so'; } && ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1; then
  need+=(libclang-dev)
fi
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
# ip and tc: the partition tests run the daemons in network namespaces and cut their links.
{ command -v ip && command -v tc; } >/dev/null 2>&1 || need+=(iproute2)
# DejaVu Sans: the text of the paper's figures (bench/src/bin/figures.rs).
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
# rustfmt and clippy: the test command checks the formatting and the lints first.
if command -v rustup >/dev/null 2>&1; then
  missing=()
  cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
  cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: adding the toolchain's ${missing[*]}"
    rustup component add "${missing[@]}"
  fi
fi
# Outside systems some tests run for real (each skips with one line where it is missing):
# Slurm and munge (tests/tests/slurm.rs), promtool (tests/tests/metrics.rs).
optional=()
[ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] || optional+=(slurm-wlm munge)
command -v promtool >/dev/null 2>&1 || optional+=(prometheus)
if [ ${#optional[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${optional[*]}"
  if ! { DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${optional[@]}" >/dev/null 2>&1 \
      || { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${optional[@]}" >/dev/null; }; }; then
    echo "setup: could not install ${optional[*]}: the tests that need them skip"
  fi
fi
