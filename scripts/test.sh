#!/usr/bin/env bash
# Run every test of the workspace, installing the Python references the tests compare
# against (the PyPI gguf reader, jinja2 for chat-template goldens, llama-cpp-python for
# logit parity, openai and prometheus_client for the HTTP server). pip compiles llama-cpp-python once (~5 minutes on 2 cores) and caches
# the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import gguf, jinja2, numpy, llama_cpp, openai, prometheus_client" 2>/dev/null; then
  echo "test.sh: installing Python test references (first run compiles llama-cpp-python, ~5 min)" >&2
  python3 -m pip install -q --disable-pip-version-check -r scripts/requirements-test.txt
fi
status=0
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@" || status=$?
else
  cargo test --workspace --no-fail-fast "$@" || status=$?
fi
# The lane -> compute handoff, model-checked with loom (its own cfg, so its own target dir).
echo "test.sh: loom model check of the I/O lane handoff" >&2
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -q -p bmoe-core --release --test loom_handoff || status=$?
exit $status
