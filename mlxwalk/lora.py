"""`python -m mlxwalk.lora`: mlx_lm.lora with the walk as its trainer (see plugin/lora.py)."""

import sys

from .plugin.lora import main

if __name__ == "__main__":
    sys.exit(main())
