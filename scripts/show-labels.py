#!/usr/bin/env python3
"""What a row trains on: its rendering with each labelled span between [[ and ]].

    scripts/show-labels.py --model tiny-qwen2 --data path/to/train.jsonl [--row 1]
                           [--chat-template template.jinja] [--no-mask-prompt]

--chat-template replaces the tokenizer's template (to check one before training with it). A row
that can't be labelled prints its one-line refusal, as `mlxwalk train` would.
"""

import argparse
import sys
from pathlib import Path

from mlxwalk import use_openblas
from mlxwalk.training import data, models

use_openblas()  # MLX's CPU matrix products on OpenBLAS (mlxwalk/_blas.py)


def marked(tokenizer, example: data.Example) -> str:
    out, run, inside = [], [], False
    for token, label in zip(example.ids, example.labels):
        if bool(label) != inside:
            out.append(tokenizer.decode(run))
            out.append("[[" if label else "]]")
            run, inside = [], bool(label)
        run.append(token)
    out.append(tokenizer.decode(run) + ("]]" if inside else ""))
    return "".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--data", required=True, help="a jsonl file")
    p.add_argument("--row", type=int, default=1, help="the row's line number")
    p.add_argument("--chat-template", help="a Jinja file to use as the chat template")
    p.add_argument("--no-mask-prompt", action="store_true")
    a = p.parse_args()
    _, tokenizer = models.load(a.model)
    if a.chat_template:
        tokenizer._tokenizer.chat_template = Path(a.chat_template).read_text()
    rows = dict(data.numbered_rows(Path(a.data)))
    if a.row not in rows:
        sys.exit(f"show-labels: {a.data} has no row at line {a.row}")
    try:
        ex = data.to_example(tokenizer, rows[a.row], f"{a.data}:{a.row}", not a.no_mask_prompt)
    except data.DataError as e:
        sys.exit(f"show-labels: {e}")
    print(marked(tokenizer, ex))
    print(f"-- {ex.trainable} of {len(ex)} positions labelled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
