"""The mlx-lm drop-in's `-m` entry: `python -m mlxwalk.lora` as `python -m mlx_lm.lora`, and the
`mlxwalk-lora` script (pyproject.toml). The drop-in itself is mlxwalk/dropin/: lora.py (these
arguments and the run), trainer.py (`mlxwalk.train`)."""

from .dropin.lora import main

if __name__ == "__main__":
    raise SystemExit(main())
