#!/usr/bin/env bash
# The GPU tier on a bare GPU machine with no package index, one step per call (each well under 10 minutes).
#
#   scripts/fetch_gpu_wheels.sh          # first, on a machine with PyPI: fills .whl/ (carry it to the GPU machine)
#   scripts/gpu_check.sh STEP            # then, on the GPU machine, from the repository root
#
# Steps:
#   env            nvidia-smi, versions, imports, a 4-bit bitsandbytes product on the GPU      (~1 min)
#   tests-engines  tests/gpu/test_engines.py: local, DDP, FSDP2, FSDP1, ZeRO-2, ZeRO-3 in bf16, and the
#                  split attention on the flash kernel (test_sequence_parallel_gpu.py), an image-text LoRA
#                  SFT in bf16 (test_image_text_gpu.py), async_save staged in pinned memory on the
#                  local engine, FSDP2 and ZeRO-3 (test_async_save_gpu.py)                       (~8 min)
#   tests-qlora    tests/gpu/test_qlora.py + tests/unit/test_fsdp_qlora.py (bitsandbytes)       (~4 min)
#   tests-families tests/gpu/test_todays_families_gpu.py: Qwen3-Next, Qwen3.5-MoE, DeepSeek-V4, Nemotron-H and
#                  Qwen3-MoE under FSDP2 and ZeRO-3 in bf16 against one process; the experts' grouped
#                  matmul against their loop, and each one's tokens/s (test_expert_kernels_gpu.py) (~6 min)
#   tests-kernels  tests/gpu/test_kernels_gpu.py: fp8 (torchao float8; one process and FSDP2 with the float8
#                  all-gather, on a GPU of compute capability 8.9+) and enable_liger_kernel against bf16, 3 steps
#                  each, plus the CPU tests of both (tests/unit/test_fp8.py, test_liger.py)     (~3 min)
#   bench-local    benchmarks/gpu.py --engines local,ddp                                       (~4 min)
#   bench-fsdp     benchmarks/gpu.py --engines fsdp2                                           (~3 min)
#   bench-zero     benchmarks/gpu.py --engines zero2,zero3                                     (~5 min)
#   speed          benchmarks/gpu.py, one process, full and LoRA, on packed plain-text rows (pt) and packed
#                  multi-turn chat (sft, block-diagonal masks), 10 measured steps each (docs/speed.md)  (~6 min)
#   lf-qlora       benchmarks/gpu_llamafactory.py: a LLaMA-Factory LoRA file, bf16, 4-bit, sdpa/fa2,
#                  activation checkpointing on and off                                         (~4 min)
#   lease          for a 15-minute device lease, in one call of at most 10 minutes: env, then every GPU test at once
#                  (pytest-xdist, 8 workers, each test bounded), then benchmark rows in order of importance until
#                  the call's deadline (LEASE_SECONDS, default 560): pt rows of local, local + torch_compile, FSDP2,
#                  ZeRO-3, full and LoRA, then the sft rows; rows are written as they finish     (<= 9.5 min)
#   tests | bench | all                                                   several of the above, one after another
#                  (for a machine without a per-command limit; a device call brings back at most 8 files from $OUT,
#                  and each step leaves two or four there)
#
# Each step writes benchmarks/results/gpu-<date>-<step>.{md,log} (the benchmark also gpu-<date>.{md,json}) and
# copies them to $OUT when it is set. The wheels go to /tmp/site (installed once per machine); the checked-out
# src/ comes first on PYTHONPATH, so the code under test is this working tree, not the shardtune wheel.
set -uo pipefail
cd "$(dirname "$0")/.."
STEP="${1:-all}"
SITE=/tmp/site
DATE="$(date +%F)"
RESULTS=benchmarks/results
PY=python3

export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# Nothing can be reached from the machine: never wait on the Hugging Face Hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

install_wheels() {
  if ! compgen -G ".whl/*.whl" > /dev/null; then
    echo "gpu_check: no wheels in .whl/: run scripts/fetch_gpu_wheels.sh on a machine with PyPI and carry .whl" >&2
    exit 2
  fi
  local stamp="$SITE/.shardtune-wheels"
  if [ "$(ls .whl)" != "$(cat "$stamp" 2>/dev/null)" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || exit 2
    ls .whl > "$stamp"
  fi
}

env_report() {
  nvidia-smi
  $PY - <<'PY'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "transformers", "peft", "datasets", "accelerate", "deepspeed", "bitsandbytes", "safetensors",
             "tokenizers", "shardtune"):
    module = importlib.import_module(name)
    print(f"{name:14} {getattr(module, '__version__', '?'):24} {module.__file__}")
import torch
print("cuda", torch.version.cuda, "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0),
      "nccl", torch.cuda.nccl.version())
import bitsandbytes as bnb
layer = bnb.nn.Linear4bit(256, 128, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                          quant_storage=torch.bfloat16)
dense = layer.weight.data.clone()
layer = layer.cuda()
x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
error = (layer(x).float() - x.float() @ dense.cuda().float().t()).abs().max().item()
print(f"bitsandbytes 4-bit product on the GPU: max error {error:.3g} against the dense weight")
from deepspeed.accelerator import get_accelerator
print("deepspeed accelerator", get_accelerator()._name)
PY
}

run_pytest() {  # run_pytest ARGS...: the GPU tests, verbose, with a summary line per test
  $PY -m pytest -p no:cacheprovider -v -rA "$@"
}

run_step() {  # run_step NAME COMMAND...: log to benchmarks/results/gpu-<date>-NAME.log and summarise in .md
  local name="$1"; shift
  local log="$RESULTS/gpu-$DATE-$name.log" md="$RESULTS/gpu-$DATE-$name.md"
  mkdir -p "$RESULTS"
  echo "== gpu_check $name: $*"
  local started=$SECONDS
  "$@" 2>&1 | tee "$log"
  local code=${PIPESTATUS[0]}
  {
    echo "# GPU check: $name, $DATE"
    echo
    echo "Command: \`scripts/gpu_check.sh $name\` (runs: \`$*\`); exit code $code after $((SECONDS - started)) s."
    echo "GPU: $(nvidia-smi -L 2>/dev/null | head -1). Full output: \`$(basename "$log")\`."
    echo
    echo '```'
    grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) |^=+ .*(passed|failed|error|skipped).* =+$' "$log" \
      || tail -n 40 "$log"
    echo '```'
  } > "$md"
  copy_out "$md" "$log"
  return "$code"
}

copy_out() {
  if [ -n "${OUT:-}" ]; then cp "$@" "$OUT"/ 2>/dev/null || true; fi
}

bench() {  # bench ENGINES: benchmarks/gpu.py for those engines, full and LoRA; results merge into gpu-<date>.*
  $PY benchmarks/gpu.py --engines "$1" --date "$DATE"
  local code=$?
  copy_out "$RESULTS/gpu-$DATE.md" "$RESULTS/gpu-$DATE.json"
  return "$code"
}

speed() {  # the rows docs/speed.md reports: pt and sft rows, full and LoRA, one process
  local code=0
  for data in pt sft; do
    $PY benchmarks/gpu.py --engines local --finetuning full,lora --data "$data" --steps 10 --warmup 3 --date "$DATE" \
      || code=$?
  done
  copy_out "$RESULTS/gpu-$DATE.md" "$RESULTS/gpu-$DATE.json"
  return "$code"
}

lf_qlora() {
  $PY benchmarks/gpu_llamafactory.py --date "$DATE"
  local code=$?
  copy_out "$RESULTS/gpu-$DATE-llamafactory.md" "$RESULTS/gpu-$DATE-llamafactory.json"
  return "$code"
}

lease_bench() {  # lease_bench DEADLINE: benchmark rows by priority, each invocation stopped at the deadline
  local deadline="$1" code=0 left
  for spec in "pt local,local-compile,fsdp2,zero3" "sft local" "pt fsdp2-compile,ddp,zero2"; do
    left=$((deadline - SECONDS))
    [ "$left" -gt 60 ] || break
    timeout --kill-after=10 "$left" $PY benchmarks/gpu.py --data "${spec%% *}" --engines "${spec#* }" \
      --steps 8 --warmup 3 --date "$DATE" || code=$?
  done
  copy_out "$RESULTS/gpu-$DATE.md" "$RESULTS/gpu-$DATE.json"
  return "$code"
}

install_wheels
status=0
case "$STEP" in
  env)           run_step env env_report || status=$? ;;
  tests-engines) run_step tests-engines run_pytest -m gpu tests/gpu/test_engines.py tests/gpu/test_sequence_parallel_gpu.py tests/gpu/test_image_text_gpu.py tests/gpu/test_async_save_gpu.py || status=$? ;;
  tests-qlora)   run_step tests-qlora run_pytest tests/gpu/test_qlora.py tests/unit/test_fsdp_qlora.py || status=$? ;;
  tests-families) run_step tests-families run_pytest tests/gpu/test_todays_families_gpu.py tests/gpu/test_expert_kernels_gpu.py || status=$? ;;
  tests-kernels) run_step tests-kernels run_pytest tests/gpu/test_kernels_gpu.py tests/unit/test_fp8.py tests/unit/test_liger.py || status=$? ;;
  bench-local)   run_step bench-local bench local,ddp || status=$? ;;
  bench-fsdp)    run_step bench-fsdp bench fsdp2 || status=$? ;;
  bench-zero)    run_step bench-zero bench zero2,zero3 || status=$? ;;
  lf-qlora)      run_step lf-qlora lf_qlora || status=$? ;;
  speed)         run_step speed speed || status=$? ;;
  lease)         deadline=$((SECONDS + ${LEASE_SECONDS:-560}))
                 run_step env env_report || status=$?
                 run_step tests timeout --kill-after=10 250 $PY -m pytest -p no:cacheprovider -v -rA -n 8 --timeout 200 tests/gpu tests/unit/test_fsdp_qlora.py \
                   tests/unit/test_fp8.py tests/unit/test_liger.py || status=$?
                 run_step bench lease_bench "$deadline" || status=$? ;;
  tests|bench|all)
    steps=()
    [ "$STEP" = all ] && steps+=(env)
    [ "$STEP" != bench ] && steps+=(tests-engines tests-qlora tests-kernels tests-families)
    [ "$STEP" != bench ] && steps+=(lf-qlora)
    [ "$STEP" != tests ] && steps+=(speed bench-local bench-fsdp bench-zero)
    for s in "${steps[@]}"; do "$0" "$s" || status=$?; done ;;
  *) echo "usage: scripts/gpu_check.sh lease|env|tests-engines|tests-qlora|tests-kernels|tests-families|speed|bench-local|bench-fsdp|bench-zero|lf-qlora|tests|bench|all" >&2
     exit 2 ;;
esac
exit "$status"
