#!/usr/bin/env python3
"""ferrotext's step losses beside the PyTorch peer's, from the same initial weights and tokens, in
f32 and in bf16 (ferrotext `dtype=bfloat16`; the peer's `--dtype bf16`, torch.autocast).

The initial weights are the peer's own `jax_peer_init` (HF Qwen3 names, written as safetensors
for both engines); the tokens are its `make_batch` for each step, written as one u32 file laid
out `[step][micro-batch][row][seq + 1]`, which ferrotext reads with `dataset_type=tokens
dataset_order=sequential` and the peer with `--tokens`. Both run SGD at a constant learning
rate, no clipping, one device, qwen3-peer's shape. Nothing is downloaded.

    cargo build --release -p ferrotext
    PY=~/venv-torch/bin/python   # torch and safetensors, as ../shared/peers/torch/README.md
    $PY crates/ferrotext/bench/precision_vs_torch.py --peers ../shared/peers \\
        --ferrotext target/release/ferrotext --steps 20 --out target/bench/precision_vs_torch.json

Prints, per dtype pair, the largest step-loss difference; writes every loss to the JSON.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="../shared/peers", help="the team checkout's peers directory")
    ap.add_argument("--ferrotext", default="target/release/ferrotext")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ga", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="where the weights, tokens and runs go (default: a temp dir)")
    ap.add_argument("--out", default="target/bench/precision_vs_torch.json")
    return ap.parse_args()


def shape(args):
    """qwen3-peer's shape, as the peer's defaults name it."""
    return argparse.Namespace(vocab=2048, d_model=256, layers=4, heads=8, kv_heads=4, head_dim=32,
                              mlp_dim=768, seq=64, rope_theta=1e6, eps=1e-6, attn="sdpa")


def write_inputs(peer, c, args, work):
    from safetensors.numpy import save_file

    sd = peer.jax_peer_init(c, args.seed)
    init = os.path.join(work, "init.safetensors")
    save_file({k: np.ascontiguousarray(v.numpy()) for k, v in sd.items()}, init)
    tokens = os.path.join(work, "tokens.u32")
    batches = [peer.make_batch(c, step, args.ga, args.rows, args.seed) for step in range(args.steps)]
    np.concatenate([b.reshape(-1) for b in batches]).astype("<u4").tofile(tokens)
    return init, tokens


def run_torch(python, peers, init, tokens, dtype, args, work):
    out = os.path.join(work, f"torch-{dtype}.jsonl")
    if os.path.exists(out):
        os.remove(out)
    cmd = [python, "train.py", "--nproc", "1", "--no-ddp", "--mode", "plain", "--ga", str(args.ga),
           "--micro-batch", str(args.rows), "--opt", "sgd", "--lr", str(args.lr), "--clip", "0",
           "--warmup", "0", "--steps", str(args.steps), "--init", init, "--tokens", tokens,
           "--dtype", dtype, "--json", out]
    subprocess.run(cmd, cwd=os.path.join(peers, "torch"), check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.loads(f.readline())["step_loss"]


def run_ferrotext(exe, init, tokens, dtype, args, work):
    name = f"ferrotext-{dtype}"
    cmd = [exe, "train", "model_name=qwen3-peer", "max_target_length=64", "opt_type=sgd",
           f"learning_rate={args.lr}", "warmup_steps_fraction=0", "learning_rate_final_fraction=1",
           "gradient_clipping_threshold=0", "ici_data_parallelism=1", "local_devices=1",
           f"per_device_batch_size={args.rows}", f"gradient_accumulation_steps={args.ga}",
           f"steps={args.steps}", f"load_parameters_path={init}", "dataset_type=tokens",
           f"dataset_path={tokens}", "token_dtype=u32", "dataset_order=sequential",
           f"dtype={'bfloat16' if dtype == 'bf16' else 'float32'}",
           f"base_output_directory={work}", f"run_name={name}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(work, name, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line]


def main():
    args = parse_args()
    peers = os.path.abspath(args.peers)
    sys.path.insert(0, os.path.join(peers, "torch"))
    import train as peer  # the peer's own init and data

    work = args.work or tempfile.mkdtemp(prefix="precision-vs-torch-")
    os.makedirs(work, exist_ok=True)
    c = shape(args)
    init, tokens = write_inputs(peer, c, args, work)
    losses = {}
    for dtype in ["f32", "bf16"]:
        losses[f"torch-{dtype}"] = run_torch(sys.executable, peers, init, tokens, dtype, args, work)
        losses[f"ferrotext-{dtype}"] = run_ferrotext(os.path.abspath(args.ferrotext), init, tokens, dtype, args, work)

    def gap(a, b):
        return max(abs(x - y) for x, y in zip(losses[a], losses[b]))

    pairs = {
        "ferrotext-f32 vs torch-f32": gap("ferrotext-f32", "torch-f32"),
        "ferrotext-bf16 vs torch-bf16": gap("ferrotext-bf16", "torch-bf16"),
        "ferrotext-bf16 vs ferrotext-f32": gap("ferrotext-bf16", "ferrotext-f32"),
        "torch-bf16 vs torch-f32": gap("torch-bf16", "torch-f32"),
    }
    for name, g in pairs.items():
        print(f"{name:34s} largest step-loss difference over {args.steps} steps: {g:.6f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "precision_vs_torch", "steps": args.steps, "ga": args.ga,
                   "rows": args.rows, "lr": args.lr, "largest_difference": pairs, "losses": losses}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
