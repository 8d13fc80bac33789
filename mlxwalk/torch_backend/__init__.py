"""The torch backend: the walk for Hugging Face models on PyTorch (CUDA), imported only when asked
for (`pip install -e ".[torch]"`, `--backend torch`). It shares mlxwalk/plan.py, and the training
run's data, windows and report.

  walk.py        the exact and plain walks over one window, their loss, train_window
  cache.py       the transformers Cache the model reads the store and the states through
  attention.py   a chunk's attention over the prefix (FlashAttention / SDPA, lower-right causal)
  recurrent.py   which gated delta rule a hybrid's layers run (mlxwalk's, flash-linear-attention's)
  delta.py       the gated delta rule, chunked (the WY form of mlxwalk/ops/delta/chunk.py) with a
                 recomputing backward
  delta_kernels.py  the same rule on the chunked CUDA kernels (metal_kernels/delta), compiled with
                 NVRTC through torch, self-checked against delta.py, routed on CUDA
  model.py       loading, the PEFT adapter, the footprint, the bundled tiny models for transformers
  exactness.py   `mlxwalk test-walk-exact --backend torch`
  train.py       `mlxwalk train --backend torch`
  plan_command.py  `mlxwalk plan --backend torch`
"""
