"""The torch backend: the walk for Hugging Face models on PyTorch (CUDA), imported only when asked
for (`pip install -e ".[torch]"`); nothing else in mlxwalk imports it. It shares mlxwalk/plan.py.

  delta.py   the gated delta rule, chunked (the WY form of mlxwalk/ops/delta.py) with a
             recomputing backward, where flash-linear-attention is absent or fails its check
"""
