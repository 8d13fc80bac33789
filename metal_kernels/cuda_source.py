"""The CUDA source MLX builds for a `cuda_kernel` call, written out for nvcc: a build check of the
CUDA kernels on a machine without a GPU (MLX compiles them with NVRTC only where CUDA runs).

MLX's generated source is: its default header, the kernel's header, then in `mlx::core::cu` a
`__global__` function whose parameters are the inputs (`const <type>*`) and outputs (`<type>*`),
the template arguments as `constexpr int`/`using` lines, and the body. The stand-in below
replaces MLX's device header include with the CUDA headers the bodies use.
"""

from __future__ import annotations

import mlx.core as mx

from .build import Launch, source

_TYPES = {
    mx.float32: "float",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
}
PRELUDE = """#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda/std/limits>
#define inf cuda::std::numeric_limits<float>::infinity()
"""


def render(call: Launch, name: str, header: bool = True) -> str:
    """The translation unit for one call, its kernel named `name` (without the kernel's header:
    the kernel function alone, to follow the headers in a unit of several)."""
    head, body = source(call.spec, "cuda")
    params = [f"    const {_TYPES[a.dtype]}* {n}" for n, a in zip(call.spec.inputs, call.inputs)]
    params += [f"    {_TYPES[d]}* {n}" for n, d in zip(call.spec.outputs, call.output_dtypes)]
    consts = []
    for key, value in call.template:
        if isinstance(value, mx.Dtype):
            consts.append(f"  using {key} = {_TYPES[value]};")
        elif isinstance(value, bool):
            consts.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        else:
            consts.append(f"  constexpr int {key} = {int(value)};")
    return (
        (head if header else "")
        + "\nnamespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        f"__global__ void {name}(\n"
        + ",\n".join(params)
        + ") {\n"
        + "\n".join(consts)
        + f"\n{body}\n}}\n}}  // namespace mlx::core::cu\n"
    )
