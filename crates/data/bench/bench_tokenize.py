#!/usr/bin/env python3
"""Tokenize throughput: ferrotext's tokenizer pipeline against the `tokenizers` Python package.

Both read the same jsonl files, parse every line, and encode the `text` field in batches of about
4 MiB with the same tokenizer.json on every core of the machine (the Rust side through
`encode_batch_fast`, as `ferrotext tokenize` does, then writes the shards; the Python side
`encode_batch` and `encode_batch_fast`, keeping the ids in memory, writing nothing).

Nothing is downloaded: the corpus is generated here (pseudo-words from syllables, sentences of
varied length, a fixed seed), and the tokenizer is a byte-level BPE trained here by the
`tokenizers` trainer on the first part of it.

    python3 -m venv ~/venv-tok && ~/venv-tok/bin/pip install tokenizers
    cargo build --release -p ferrotext-data --example tokenize
    ~/venv-tok/bin/python crates/data/bench/bench_tokenize.py --mb 100 \
        --work /tmp/tokbench --rust target/release/examples/tokenize \
        --out target/bench/tokenize.json
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import time
from statistics import median

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BATCH_BYTES = 4 << 20


def make_corpus(path, megabytes, seed):
    """Jsonl of documents of 20-400 words drawn from 3000 pseudo-words (Zipf-like)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "sh", "qu"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)})
    weights = [1.0 / (i + 1) for i in range(len(words))]
    punct = [".", ",", "!", "?", ";"]
    target = megabytes * 1_000_000
    written = 0
    with open(path, "w") as f:
        doc = 0
        while written < target:
            n = rng.randint(20, 400)
            ws = rng.choices(words, weights, k=n)
            parts = []
            for i, w in enumerate(ws):
                parts.append(w.capitalize() if i == 0 or rng.random() < 0.05 else w)
                if rng.random() < 0.08:
                    parts[-1] += rng.choice(punct)
            if rng.random() < 0.2:
                parts.append(str(rng.randint(0, 99999)))
            line = json.dumps({"id": doc, "text": " ".join(parts)}) + "\n"
            f.write(line)
            written += len(line)
            doc += 1
    return doc


def train_tokenizer(corpus, out, vocab):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def sample():
        with open(corpus) as f:
            for i, line in enumerate(f):
                if i >= 20000:
                    break
                yield json.loads(line)["text"]

    tok.train_from_iterator(sample(), trainer)
    tok.save(out)


def python_encode(tokenizer_path, corpus, fast):
    tok = Tokenizer.from_file(tokenizer_path)
    start = time.perf_counter()
    tokens = docs = text_bytes = 0
    batch, size = [], 0
    encode = tok.encode_batch_fast if fast else tok.encode_batch

    def flush():
        nonlocal tokens
        for e in encode(batch, add_special_tokens=False):
            tokens += len(e.ids) + 1
    with open(corpus) as f:
        for line in f:
            text = json.loads(line)["text"]
            batch.append(text)
            size += len(text.encode())
            text_bytes += len(text.encode())
            docs += 1
            if size >= BATCH_BYTES:
                flush()
                batch, size = [], 0
    if batch:
        flush()
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "documents": docs,
            "text_bytes": text_bytes}


def rust_encode(binary, tokenizer_path, corpus, out_dir):
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    res = subprocess.run([binary, tokenizer_path, out_dir, corpus], capture_output=True, text=True,
                         check=True)
    report = json.loads(res.stdout.strip().splitlines()[-1])
    shutil.rmtree(out_dir)
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--work", required=True)
    ap.add_argument("--rust", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    corpus = os.path.join(args.work, "corpus.jsonl")
    tokenizer = os.path.join(args.work, "tokenizer.json")
    if not os.path.exists(corpus):
        make_corpus(corpus, args.mb, seed=29)
    if not os.path.exists(tokenizer):
        train_tokenizer(corpus, tokenizer, args.vocab)
    runs = {"python_encode_batch": [], "python_encode_batch_fast": [], "ferrotext": []}
    for _ in range(args.repeats):
        runs["ferrotext"].append(rust_encode(args.rust, tokenizer, corpus,
                                             os.path.join(args.work, "shards")))
        runs["python_encode_batch"].append(python_encode(tokenizer, corpus, fast=False))
        runs["python_encode_batch_fast"].append(python_encode(tokenizer, corpus, fast=True))
    best = {k: min(r["seconds"] for r in v) for k, v in runs.items()}
    tokens = {k: v[0]["tokens"] for k, v in runs.items()}
    mb = runs["ferrotext"][0]["text_bytes"] / 1e6
    result = {
        "corpus_mb_text": mb,
        "corpus_file_mb": os.path.getsize(corpus) / 1e6,
        "documents": runs["ferrotext"][0]["documents"],
        "vocab": args.vocab,
        "cores": os.cpu_count(),
        "best_seconds": best,
        "mb_per_second": {k: mb / s for k, s in best.items()},
        "tokens": tokens,
        "ferrotext_over_python_encode_batch": best["ferrotext"] / best["python_encode_batch"],
        "ferrotext_over_python_encode_batch_fast":
            best["ferrotext"] / best["python_encode_batch_fast"],
        # The machine is shared: each repeat runs the three back to back, so the median of the
        # per-repeat ratios is the figure least moved by other load.
        "median_ratio_over_python_encode_batch": median(
            [f["seconds"] / p["seconds"] for f, p in zip(runs["ferrotext"], runs["python_encode_batch"])]),
        "median_ratio_over_python_encode_batch_fast": median(
            [f["seconds"] / p["seconds"]
             for f, p in zip(runs["ferrotext"], runs["python_encode_batch_fast"])]),
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in result if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
