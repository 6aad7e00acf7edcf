#!/bin/bash
# Run a command on the lent GPU machine, which has torch and transformers but not this package, nor
# DeepSpeed/Dask, nor a `rollplex` executable. From the repository root there:
#
#   scripts/on-device.sh [--wheels] rollplex bench --policies serial,rollplex --out $OUT/bench
#   scripts/on-device.sh --wheels python benchmarks/dp_scaling.py --gpus 1,2 --json $OUT/dp.json
#   scripts/on-device.sh --wheels python -m pytest -m gpu tests/test_distributed_gpu.py
#
# It makes `import rollplex` resolve to this tree (pipeline/ tasks/ engines/ dags/ under rollplex/,
# as the editable install maps them), puts a `rollplex` executable next to python (tests spawn it),
# and with --wheels installs the .whl/ taken along (../shared/gpu/fetch-wheels.sh; carry ".whl").
# Commands run from a scratch directory, so the repository's rollplex/ cannot shadow the package.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
if [[ "${1:-}" == "--wheels" ]]; then
  shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl
  DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site "$repo"/.whl/deepspeed-*.tar.gz
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} TORCH_EXTENSIONS_DIR=/tmp/torch_ext TORCH_CUDA_ARCH_LIST=9.0
fi
shim=/tmp/rollplex-shim
mkdir -p "$shim"
rm -rf "$shim/rollplex" && cp -r "$repo/rollplex" "$shim/"
for d in pipeline tasks engines dags; do ln -sfn "$repo/$d" "$shim/rollplex/$d"; done
export PYTHONPATH=$shim:${PYTHONPATH:-} ROLLPLEX_CACHE=${ROLLPLEX_CACHE:-/tmp/rollplex-cache}
bin=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
if [[ ! -x "$bin/rollplex" ]]; then
  printf '#!/bin/sh\nexec %s -m rollplex.cli "$@"\n' "$bin/python3" > "$bin/rollplex" && chmod +x "$bin/rollplex"
fi
mkdir -p /tmp/rollplex-work && cd /tmp/rollplex-work
# Paths in the command are relative to the repository root, as the caller wrote them. Only words
# that look like paths (a slash or a suffix) are mapped: `--profile rollplex` names a policy, not
# the rollplex/ folder.
args=("$1")
for a in "${@:2}"; do
  if [[ "$a" != /* && "$a" != -* && ( "$a" == */* || "$a" == *.* ) && -e "$repo/$a" ]]; then
    args+=("$repo/$a")
  else
    args+=("$a")
  fi
done
exec "${args[@]}"
