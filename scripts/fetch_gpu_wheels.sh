#!/usr/bin/env bash
# Collect, into .whl/, the wheels the GPU machine lacks, so scripts/gpu_check.sh can install them there with no
# package index. Run here, from anywhere in the repo (needs PyPI); safe to rerun: only missing wheels are fetched.
#
# Target machine: x86-64, CPython 3.12, torch 2.11+cu130, transformers 5.17, accelerate 1.15, safetensors 0.8.0,
# tokenizers 0.23.2, numpy, pandas, pyarrow, fsspec, xxhash, huggingface-hub, psutil, ninja, einops, msgpack,
# py-cpuinfo and nvidia-ml-py already there (see the device notes). What it lacks or has at another version than
# requirements.txt pins is listed in WHEELS below, each with the reason.
#
#   scripts/fetch_gpu_wheels.sh            # fill .whl/ and print its size
#   PYTHON=.venv/bin/python scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PYTHON="${PYTHON:-python3}"
DEST=.whl

# name==version  reason
WHEELS=(
  "transformers==5.23.0"       # pinned stack (5.17 is there)
  "tokenizers==0.23.3"         # pinned stack (0.23.2 is there)
  "peft==0.21.2"               # pinned stack
  "datasets==5.2.0"            # not there
  "dill==0.4.1"                # datasets
  "multiprocess==0.70.19"      # datasets
  "fsspec==2026.9.0"           # datasets 5.2.0 requires <= 2026.9.0; the machine's version is not recorded
  "hjson==3.1.0"               # deepspeed
  "pydantic==2.14.3"           # deepspeed
  "pydantic-core==2.50.4"      # pydantic (the exact version pydantic 2.14.3 requires)
  "annotated-types==0.8.0"     # pydantic
  "typing-inspection==0.4.5"   # pydantic
  "typing-extensions==4.16.0"  # pydantic-core needs >= 4.16; the machine's version is not recorded
  "regex==2026.11.15"          # transformers checks regex >= 2025.10.22 at import; the machine's is not recorded
  "bitsandbytes==0.50.2"       # QLoRA; slimmed below to the CUDA 13 and CPU libraries
  "torchao==0.18.0"            # fp8 (float8 training); its C++ extensions are not used by float8
  "liger-kernel==0.8.5"        # enable_liger_kernel (Triton kernels; triton comes with torch's CUDA build)
  "nltk==3.10.4"               # do_predict's BLEU-4 (the metrics extra; click, joblib, tqdm are there)
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$DEST"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"

have_wheel() {  # have_wheel NAME VERSION: a wheel of that distribution and version is already in .whl/
  local stem="${1//-/_}-$2-"
  compgen -G "$DEST/${stem}*.whl" > /dev/null || compgen -G "$DEST/${stem,,}*.whl" > /dev/null
}

for spec in "${WHEELS[@]}"; do
  name="${spec%%==*}" version="${spec##*==}"
  have_wheel "$name" "$version" && continue
  "$PYTHON" -m pip download --quiet --no-deps --disable-pip-version-check --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "$spec"
done

# bitsandbytes ships one library per CUDA / ROCm / XPU version (43 MB); the machine's torch is built for CUDA 13.0,
# so keep the CUDA 13.x and CPU libraries only (bitsandbytes loads libbitsandbytes_cuda<torch's CUDA>.so). The
# slimmed wheel keeps its name and gets a RECORD that lists what is left.
"$PYTHON" - "$DEST"/bitsandbytes-0.50.2-*.whl <<'PY'
import base64, hashlib, re, sys, zipfile
from pathlib import Path

path = Path(sys.argv[1])
dropped = re.compile(r"bitsandbytes/libbitsandbytes_(?!cuda13\d*\.so$|cpu\.so$).*\.so$")
with zipfile.ZipFile(path) as src:
    names = [n for n in src.namelist() if not dropped.match(n)]
    if len(names) == len(src.namelist()):
        sys.exit(0)  # already slim
    files = {n: src.read(n) for n in names}
record = next(n for n in files if n.endswith(".dist-info/RECORD"))
lines = []
for name, data in files.items():
    if name == record:
        continue
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    lines.append(f"{name},sha256={digest},{len(data)}")
files[record] = ("\n".join([*lines, f"{record},,"]) + "\n").encode()
tmp = path.with_suffix(".tmp")
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
    for name, data in files.items():
        out.writestr(name, data)
tmp.replace(path)
print(f"slimmed {path.name}: kept {len(files)} files")
PY

# DeepSpeed publishes only a source archive: build a pure-Python wheel; its ops compile on the GPU machine (nvcc).
if ! have_wheel deepspeed 0.19.8; then
  DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --quiet --no-deps deepspeed==0.19.8 -w "$DEST"
fi

# rouge-score (do_predict's ROUGE) publishes only a source archive too; pure Python (absl-py, numpy, six are there).
if ! have_wheel rouge_score 0.1.2; then
  "$PYTHON" -m pip wheel --quiet --no-deps rouge-score==0.1.2 -w "$DEST"
fi

# shardtune itself, rebuilt every time so the wheel matches the working tree.
rm -f "$DEST"/shardtune-*.whl
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation . -w "$DEST" 2>/dev/null \
  || "$PYTHON" -m pip wheel --quiet --no-deps . -w "$DEST"
rm -rf build src/*.egg-info

ls -1 "$DEST"
du -sh "$DEST"
