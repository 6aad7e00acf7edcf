#!/usr/bin/env bash
# Render each algorithm's compiled iteration (schedule rollplex) into docs/gallery/ as SVG.
# A small shape keeps the pictures readable: 4 prompts × 4 samples, 2 micro-batches, one prompt per
# node, 8 tokens in 2 decode chunks. tests/test_gallery.py checks that the files are current.
set -euo pipefail
cd "$(dirname "$0")/.."
ROLLPLEX=${ROLLPLEX:-.venv/bin/rollplex}
mkdir -p docs/gallery
for alg in grpo ppo rloo dapo reinforce_pp; do
  "$ROLLPLEX" graph $(cat docs/gallery/ARGS) --set algorithm="$alg" --format svg --out "docs/gallery/$alg.svg"
done
