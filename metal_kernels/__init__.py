"""Custom kernels behind mlxwalk's ops.

Each kernel is a Metal body for `mx.fast.metal_kernel` with its CUDA twin for
`mx.fast.cuda_kernel` beside it (`attention/forward.metal` and `attention/forward.cu`, ...).
`build.py` reads, builds, caches and launches them; `attention/` says how each kernel is called;
`harness/` runs the Metal bodies on the CPU (compiled as C++ with a Metal stand-in header), which
is how they are tested where no Apple GPU exists. Nothing here imports mlxwalk: the routing, the
self-check and the pure-MLX reference twins live in `mlxwalk/ops/`. The names below come from
build.py on first use, so the MLX-free parts (sources.py, cuda_source.py, delta/blocks.py,
delta/pipeline.py) import without MLX (the torch backend compiles the CUDA kernels from them).
"""

__all__ = ["Launch", "Spec", "current_backend", "launch"]


def __getattr__(name: str):
    if name in __all__:
        from . import build

        return getattr(build, name)
    raise AttributeError(f"module 'metal_kernels' has no attribute {name!r}")
