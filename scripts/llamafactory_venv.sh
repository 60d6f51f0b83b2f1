#!/usr/bin/env bash
# LLaMA-Factory 0.9.5 in a venv of its own, for benchmarks/llamafactory_cpu.py (the side-by-side on CPU).
#
#   scripts/llamafactory_venv.sh [DEST]        # default /work/lf-venv; needs PyPI and LLaMA-Factory's source
#
# torch==2.13.0 first (this machine's local CPU wheel), then LLaMA-Factory's dependencies from PyPI within its own pins
# (pyproject.toml of v0.9.5), then LLaMA-Factory itself from its v0.9.5 source without dependencies. PyPI has no CPU
# build of torchaudio/torchvision for torch 2.13: LLaMA-Factory imports torchaudio at start-up for audio data only,
# so a stub package stands in (text SFT never calls it), and torchvision is left out.
# Source: LF_SOURCE (a checkout) or LF_MIRROR (a bare git repository with the v0.9.5 tag).
set -euo pipefail
DEST=${1:-/work/lf-venv}
MIRROR=${LF_MIRROR:-/work/.mirror/hiyouga+LLaMA-Factory/repo}
SOURCE=${LF_SOURCE:-}

if [ -z "$SOURCE" ]; then
  SOURCE=$(mktemp -d)
  git --git-dir "$MIRROR" archive v0.9.5 | tar -x -C "$SOURCE"
fi
python3 -m venv "$DEST"
PIP=("$DEST/bin/python" -m pip install --quiet)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" "transformers==5.6.0" "datasets==4.0.0" "accelerate==1.11.0" "peft==0.18.1" "trl==0.24.0" \
  "torchdata>=0.10.0,<=0.11.0" "gradio>=4.38.0,<=5.50.0" matplotlib "tyro<0.9.0" einops numpy pandas scipy \
  sentencepiece tiktoken modelscope hf-transfer safetensors "av>=10.0.0,<=16.0.0" fire omegaconf packaging protobuf \
  pyyaml pydantic uvicorn fastapi sse-starlette
"${PIP[@]}" --no-deps "$SOURCE"
SITE=$("$DEST/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$SITE/torchaudio"
cat > "$SITE/torchaudio/__init__.py" <<'EOF'
"""Stand-in: PyPI has no CPU torchaudio for torch 2.13; LLaMA-Factory imports it only for audio data."""
__version__ = "2.13.0"
EOF
"$DEST/bin/llamafactory-cli" version >/dev/null
echo "LLaMA-Factory 0.9.5 ready in $DEST"
