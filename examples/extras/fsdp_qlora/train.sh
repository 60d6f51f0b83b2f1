#!/usr/bin/env bash
# FSDP + QLoRA on every GPU of this machine. Usage: bash examples/extras/fsdp_qlora/train.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
NPROC_PER_NODE="${NPROC_PER_NODE:-$(nvidia-smi -L | wc -l)}" \
  .venv/bin/shardtune train examples/extras/fsdp_qlora/llama3_lora_sft.yaml "$@"
