#!/usr/bin/env python3
"""Does exactness matter? Train the same model on the same data with the exact walk and with the
plain walk (same seed, learning rate, chunk, epochs) and print the eval loss per epoch side by side.

The default data is the bundled recall task (mlxwalk/data/recall): a code is stated at the start
of a ~2,000-token conversation and asked for at its end; only the answer is labelled, so at chunk
256 the fact sits 7 or more chunks before the only loss.

    scripts/exact-vs-plain.py [-m tiny-qwen2] [--data mlxwalk/data/recall] [--epochs 3] [--lr 1e-3]
"""

import argparse
import json
import sys
from pathlib import Path

from mlxwalk import use_openblas
from mlxwalk.training import samples
from mlxwalk.training.run import TrainConfig, train_run

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-m", "--model", default="tiny-qwen2")
    p.add_argument("--data", default=str(samples.folder("recall")))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--out", default="runs/exact-vs-plain")
    p.add_argument("--json", help="also write both runs' epochs to this file")
    a = p.parse_args()
    results = {}
    for walk in ("plain", "exact"):
        cfg = TrainConfig(
            model=a.model,
            data=a.data,
            walk=walk,
            chunk=a.chunk,
            epochs=a.epochs,
            lr=a.lr,
            rank=a.rank,
            num_layers=-1,
            seed=0,
            progress=False,
            adapter_path=f"{a.out}/{walk}",
        )
        print(f"--- {walk} walk", flush=True)
        results[walk] = train_run(cfg)
    plain, exact = results["plain"]["epochs"], results["exact"]["epochs"]
    print(
        f"\n{a.model}, {Path(a.data).name}, chunk {a.chunk}, lr {a.lr}, LoRA r{a.rank} on every "
        "layer, seed 0"
    )
    print("| epoch | plain eval loss | exact eval loss | exact vs plain | plain s | exact s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for p_, e in zip(plain, exact):
        gain = 100 * (e["eval_loss"] - p_["eval_loss"]) / p_["eval_loss"]
        print(
            f"| {e['epoch']} | {p_['eval_loss']:.4f} | {e['eval_loss']:.4f} | {gain:+.1f}% |"
            f" {p_['seconds']:.0f} | {e['seconds']:.0f} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({w: r["epochs"] for w, r in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
