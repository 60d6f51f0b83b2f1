#!/usr/bin/env bash
# FSDP + QLoRA on every GPU of this machine (untested on GPU in this release; see the YAML's comment).
# Usage: bash examples/extras/fsdp_qlora/train.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/../../.."
NPROC_PER_NODE="${NPROC_PER_NODE:-$(nvidia-smi -L | wc -l)}" \
  .venv/bin/shardtune train examples/extras/fsdp_qlora/llama3_lora_sft.yaml "$@"
