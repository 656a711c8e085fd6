#!/usr/bin/env bash
# ferrotext's bf16 and f32 products (crates/tensor/examples/bf16.rs) and PyTorch's
# (matmul_torch.py) on the same shapes, alternated ferrotext, torch, torch, ferrotext in one
# sitting, so their ratios hold on a shared machine. Run by hand from the repository root
# (CI has no torch):
#   crates/ferrotext/bench/matmul_sitting.sh [PYTHON] [threads=1] [tokens=512] [models=peer,0.6b]
# Writes target/bench/matmul_sitting/{ferrotext,torch}-{1,2}.json.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python=${1:-/work/venv-hf/bin/python}
shift || true
out=target/bench/matmul_sitting
mkdir -p "$out"
cargo build -q --release -p ferrotext-tensor --example bf16
for round in 1 2; do
    order=(ferrotext torch)
    [ "$round" = 2 ] && order=(torch ferrotext)
    for side in "${order[@]}"; do
        if [ "$side" = ferrotext ]; then
            target/release/examples/bf16 libs=auto pairs=5 "$@"
            cp target/bench/bf16.json "$out/ferrotext-$round.json"
        else
            "$python" crates/ferrotext/bench/matmul_torch.py pairs=5 "$@"
            cp target/bench/matmul_torch.json "$out/torch-$round.json"
        fi
    done
done
echo "wrote $out"
