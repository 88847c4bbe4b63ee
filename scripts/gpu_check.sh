#!/usr/bin/env bash
# GPU checks, under 10 minutes on one CUDA device: every attention backend against SDPA, greedy equality in fp32
# and bf16 on the GPU, and a short benchmark. Run from the repository root on a machine with CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
python -m pip install --quiet -e ".[dev]" >/dev/null 2>&1 || true
python -m pip install --quiet flash-attn --no-build-isolation >/dev/null 2>&1 \
  && echo "flash-attn installed" || echo "flash-attn not installable here: the cascade runs with its reference prefix kernel"
python -m pytest -q -m gpu tests/ -p no:cacheprovider
python scripts/benchmark.py --limit 5 --max-new-tokens 128 --output /tmp/gpu_bench.json --methods hf-greedy,none,ngram
