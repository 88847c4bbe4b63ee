#!/usr/bin/env bash
# GPU checks on one CUDA device, about ten minutes: every attention backend against SDPA, greedy equality in fp32 and
# bf16 (the flash-attn cascade included), the sampling chi-square tests on CUDA, the decoder through the cascade on
# the default target, a bf16 benchmark with its near-tie report, the same with the passes captured as CUDA graphs
# (greedy identity of the graphed passes is in the gpu-marked tests; bench_verify_pass times one pass both ways), and
# a 20-step training run (bf16, nccl).
# Run from the repository root; outputs go to $OUT (default: a temporary directory).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
status=0
step() { echo; echo "== $*"; "$@" || { echo "FAILED: $*"; status=1; }; }

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
python -m pip install --quiet -e ".[train,dev]" >/dev/null 2>&1 || true
python -m pip install --quiet flash-attn --no-build-isolation >/dev/null 2>&1 \
  && echo "flash-attn installed" || echo "flash-attn not installable here: the cascade runs with its reference prefix kernel"

step python -m pytest -q -m gpu tests/ -p no:cacheprovider
step python scripts/generate.py --device cuda --dtype bfloat16 --attention cascade --proposer eagle3+ngram \
  --prompt "Write a haiku about rain." --max-new-tokens 64 --output "$OUT/cascade.jsonl"
step python scripts/benchmark.py --device cuda --dtype bfloat16 --limit 5 --max-new-tokens 128 \
  --methods hf-greedy,none,ngram,eagle3+ngram --output "$OUT/gpu_bench_bf16.json"
step python scripts/bench_verify_pass.py --device cuda --dtype bfloat16 --sizes 1 4 16 --fixed-shapes
step python scripts/benchmark.py --device cuda --dtype bfloat16 --limit 5 --max-new-tokens 128 --cuda-graphs \
  --methods hf-greedy,none,ngram,eagle3+ngram --output "$OUT/gpu_bench_bf16_cuda_graphs.json"
step python training/train.py head=eagle3 trainer.max_steps=20 data.max_samples=64 eval.every=10 eval.max_samples=8 \
  checkpoint.every=20 tracker=disabled output_dir="$OUT/train_eagle3"
echo; echo "outputs in $OUT"
exit $status
