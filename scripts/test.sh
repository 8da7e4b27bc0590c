#!/usr/bin/env bash
# Run every test of the workspace, installing the Python references the tests compare
# against (the PyPI gguf reader, jinja2 for chat-template goldens, llama-cpp-python for
# logit parity, openai and prometheus_client for the HTTP server) and what the Python module's
# tests need (maturin, pytest, pandas, dask's distributed). pip compiles llama-cpp-python once
# (~5 minutes on 2 cores) and caches the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's wall time on stderr, so CI's 30-minute budget can be spent knowingly.
t=$SECONDS
took() { echo "test.sh: $1 took $((SECONDS - t)) s" >&2; t=$SECONDS; }
if ! python3 -c "import gguf, jinja2, jsonschema, numpy, llama_cpp, openai, prometheus_client, maturin, pytest, pandas, distributed" 2>/dev/null; then
  echo "test.sh: installing Python test references (first run compiles llama-cpp-python, ~5 min)" >&2
  python3 -m pip install -q --disable-pip-version-check -r scripts/requirements-test.txt
  took "installing the Python references"
fi
status=0
# The web chat's browser test (engine/tests/webchat.rs) needs Chromium, its driver and
# selenium: CI installs them; elsewhere the test says how when they are missing.
if [ "${CI:-}" = true ]; then
  bash scripts/browser.sh || status=$?
  took "installing the browser test's tools"
fi
# Issue 33: the core's modules form a stack with no import cycle (stdlib-only, instant).
python3 scripts/check-layers.py || status=$?
# Issue 35: the engine's modules too (the front ends over converse over run, cli at the bottom).
python3 scripts/check-layers.py engine/src || status=$?
# The Python module's wheel (issue 36, sim/python): maturin builds it in the background while
# the phone binary builds (target/debug and the aarch64 target lock apart, and each build
# leaves a core idle while rustc works through one large crate), done before the suite builds
# into target/debug. The dev profile, with the derive macros (run only at compile time)
# unoptimised: maturin resolves the module's dependencies apart from the workspace, so its
# chain (core, simulator, serde, clap) compiles again; docs/simulator.md, "Python". Outside
# CI, skipped with a message without maturin or pytest.
py=0
if python3 -c "import maturin, pytest" 2>/dev/null; then
  py=1
elif [ "${CI:-}" = true ]; then
  echo "test.sh: CI=true but maturin or pytest is missing (scripts/requirements-test.txt)" >&2
  status=1
else
  echo "test.sh: skipping the Python module's tests: maturin and pytest are not installed (pip install -r scripts/requirements-test.txt)" >&2
fi
wheel=
if [ "$py" = 1 ]; then
  rm -rf target/wheels/test
  mkdir -p target/wheels/test
  macros_unoptimised=()
  for p in proc-macro2 quote unicode-ident syn heck serde_derive thiserror-impl clap_derive \
      pyo3-macros pyo3-macros-backend pyo3-build-config target-lexicon; do
    macros_unoptimised+=(--config "profile.dev.package.$p.opt-level=0")
  done
  ( if maturin build --quiet -m sim/python/Cargo.toml --profile dev "${macros_unoptimised[@]}" \
        -i python3 -o target/wheels/test > target/wheels/test/build.log 2>&1; then
      echo 0 > target/wheels/test/build.rc
    else
      echo 1 > target/wheels/test/build.rc
    fi ) &
  wheel=$!
fi
# ARM (issue 31): the phone binary the cross-architecture gate runs under qemu
# (gates/tests/arm_identity.rs), built before the suite, and the aarch64 kernel tests under qemu
# after it. CI installs the tools (scripts/arm.sh: rustup targets, cross gcc, qemu-user); on
# another machine this part runs when they are present and says how to get them when not.
arm=0
if [ "${CI:-}" = true ]; then
  bash scripts/arm.sh
  arm=1
elif command -v qemu-aarch64-static >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null \
    && rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-musl; then
  arm=1
else
  echo "test.sh: skipping the ARM build and tests (scripts/arm.sh installs qemu-user and the aarch64 toolchain)" >&2
fi
if [ "$arm" = 1 ]; then
  echo "test.sh: building the aarch64 phone binary (scripts/build-phone.sh)" >&2
  bash scripts/build-phone.sh >&2 || status=$?
  took "building the phone binary (and installing the ARM tools)"
fi
if [ -n "$wheel" ]; then
  wait "$wheel" || true
  took "the Python module's wheel (the rest of its build)"
fi
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@" || status=$?
else
  cargo test --workspace --no-fail-fast "$@" || status=$?
fi
took "building and running the workspace's tests"
if [ "$arm" = 1 ]; then
  # Every kernel at every ARM level (qemu's default CPU has dotprod and i8mm, so the per-level
  # checks cover scalar, neon, dotprod and i8mm), plus the other aarch64-only code.
  echo "test.sh: aarch64 engine unit tests under qemu-aarch64-static" >&2
  CARGO_PROFILE_RELEASE_DEBUG=0 cargo test -q --release --target aarch64-unknown-linux-musl -p bmoe-engine --lib -- \
    kernels:: cpus:: probe:: arch:: || status=$?
  took "the aarch64 unit tests under qemu"
fi
# Issue 36: the Python module bmoe_sim (sim/python): its wheel was built by maturin beside the
# phone binary (above); installed here, and its pytest suite run (byte-equality with the
# bmoe-sim binary the suite just built, Python policies against the core's, a sweep on a Dask
# cluster).
if [ "$py" = 1 ]; then
  echo "test.sh: the Python module: pip install, pytest (sim/python)" >&2
  if [ "$(cat target/wheels/test/build.rc 2>/dev/null)" = 0 ] \
      && python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
        --force-reinstall --no-deps target/wheels/test/bmoe_sim-*.whl; then
    BMOE_SIM_BIN="$PWD/target/debug/bmoe-sim" python3 -m pytest -q -p no:cacheprovider sim/python/tests \
      || status=$?
  else
    echo "test.sh: the Python module did not build or install; maturin said:" >&2
    tail -n 40 target/wheels/test/build.log >&2 || true
    status=1
  fi
  took "the Python module (install, pytest)"
fi
# The lane -> compute handoff, model-checked with loom (its own cfg, so its own target dir).
echo "test.sh: loom model check of the I/O lane handoff" >&2
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -q -p bmoe-core --release --test loom_handoff || status=$?
took "the loom model check"
exit $status
