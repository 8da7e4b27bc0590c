#!/usr/bin/env bash
# Install what the web chat's browser test needs on a Debian machine, and nothing that is
# already there: Chromium and its chromedriver (Debian's packages; Selenium drives them), and
# the selenium Python package (scripts/requirements-test.txt). Idempotent and silent when
# everything is present; apt-get needs root (or sudo).
set -euo pipefail
need=()
command -v chromium >/dev/null || need+=(chromium)
{ command -v chromedriver >/dev/null || [ -x /usr/lib/chromium/chromedriver ]; } || need+=(chromium-driver)
if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "browser.sh: apt-get install ${need[*]}" >&2
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >&2
fi
python3 -c "import selenium" 2>/dev/null || python3 -m pip install -q --disable-pip-version-check selenium >&2
