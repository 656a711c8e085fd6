"""GFLOP/s of PyTorch's bf16 × bf16 → f32 matmul and its f32 matmul at ferrotext's training
shapes, beside `cargo run --release -p ferrotext-tensor --example bf16` (same shapes, same
three forms, same pairing), so the two can be compared as ratios measured in one sitting.

Run by hand (never from a test; CI has no torch):

    /work/venv-hf/bin/python crates/ferrotext/bench/matmul_torch.py [threads=1] [pairs=5] [tokens=512] [models=peer,0.6b]

Writes target/bench/matmul_torch.json. The bf16 product is autocast's: bf16 operands, f32
accumulation inside oneDNN, the result stored as bf16 (`x @ w` on bf16 tensors), and, for the
weight gradient, `torch.matmul(..., out=f32)` is not offered for bf16, so it is timed as bf16
output too (what autocast's backward does).
"""

import json
import os
import sys
import time

import torch

WEIGHTS = {
    "peer": [("qkv", 256, 512), ("attn_out", 256, 256), ("mlp_up", 256, 768),
             ("mlp_down", 768, 256), ("lm_head", 256, 2048)],
    "0.6b": [("qkv", 1024, 4096), ("attn_out", 2048, 1024), ("mlp_up", 1024, 3072),
             ("mlp_down", 3072, 1024), ("lm_head/8", 1024, 18992)],
}


def operands(m, n, k, lt, rt, dtype):
    a = torch.randn((k, m) if lt else (m, k)).to(dtype)
    b = torch.randn((n, k) if rt else (k, n)).to(dtype)
    return (a.t() if lt else a), (b.t() if rt else b)


def timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def main():
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    threads = int(args.get("threads", 1))
    pairs = int(args.get("pairs", 5))
    tokens = int(args.get("tokens", 512))
    models = args.get("models", "peer,0.6b").split(",")
    torch.set_num_threads(threads)
    rows = []
    for model in models:
        for name, din, dout in WEIGHTS[model]:
            for product, m, n, k, lt, rt in [
                ("x·W", tokens, dout, din, False, False),
                ("dy·Wᵀ", tokens, din, dout, False, True),
                ("xᵀ·dy", din, dout, tokens, True, False),
            ]:
                a32, b32 = operands(m, n, k, lt, rt, torch.float32)
                a16, b16 = a32.to(torch.bfloat16), b32.to(torch.bfloat16)
                f32 = lambda: torch.matmul(a32, b32)
                bf16 = lambda: torch.matmul(a16, b16)
                f32(), bf16()
                ta, tb = [], []
                for p in range(pairs):
                    if p % 2 == 0:
                        ta.append(timed(f32)); tb.append(timed(bf16))
                    else:
                        tb.append(timed(bf16)); ta.append(timed(f32))
                flops = 2.0 * m * n * k
                f, b = flops / median(ta) / 1e9, flops / median(tb) / 1e9
                print(f"{model:>5} {name:<10} {product:<6} {m:>5}×{n:>5}×{k:>5}  f32 {f:6.1f}  "
                      f"bf16 {b:6.1f} GFLOP/s  ×{b / f:.2f}", file=sys.stderr)
                rows.append(dict(model=model, weight=name, product=product, m=m, n=n, k=k,
                                 f32_gflops=round(f, 2), bf16_gflops=round(b, 2)))
    os.makedirs("target/bench", exist_ok=True)
    path = "target/bench/matmul_torch.json"
    with open(path, "w") as out:
        json.dump(dict(benchmark="matmul_torch", torch=torch.__version__, threads=threads,
                       tokens=tokens, rows=rows), out)
        out.write("\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
