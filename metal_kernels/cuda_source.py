"""The CUDA source MLX builds for a `cuda_kernel` call, written out for nvcc: a build check of the
CUDA kernels on a machine without a GPU (MLX compiles them with NVRTC only where CUDA runs).

MLX's generated source is: its default header, the kernel's header, then in `mlx::core::cu` a
`__global__` function whose parameters are the inputs (`const <type>*`) and outputs (`<type>*`),
the template arguments as `constexpr int`/`using` lines, and the body. The stand-in below
replaces MLX's device header include with the CUDA headers the bodies use. Nothing here needs MLX
(`render_kernel` takes the dtypes by name): the torch backend renders the same kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .sources import Spec, dtype_name, source

if TYPE_CHECKING:
    from .build import Launch

_TYPES = {  # by dtype name (sources.dtype_name): MLX's and torch's dtypes alike
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "int32": "int32_t",
    "uint32": "uint32_t",
}
PRELUDE = """#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda/std/limits>
#define inf cuda::std::numeric_limits<float>::infinity()
"""


def ctype(dtype) -> str:
    """The CUDA type of a dtype (MLX's, torch's, or its name)."""
    return _TYPES[dtype_name(dtype)]


def render(call: Launch, name: str, header: bool = True) -> str:
    """The translation unit for one call, its kernel named `name` (without the kernel's header:
    the kernel function alone, to follow the headers in a unit of several)."""
    inputs = [a.dtype for a in call.inputs]
    return render_kernel(call.spec, inputs, call.output_dtypes, call.template, name, header)


def render_kernel(
    spec: Spec,
    input_dtypes: list,
    output_dtypes: list,
    template: list[tuple[str, object]],
    name: str,
    header: bool = True,
) -> str:
    """`render` from plain data: the buffers' dtypes and the template (a dtype there as MLX's,
    torch's or its name; bools and ints as constants), what a caller without MLX has."""
    head, body = source(spec, "cuda")
    params = [f"    const {ctype(d)}* {n}" for n, d in zip(spec.inputs, input_dtypes)]
    params += [f"    {ctype(d)}* {n}" for n, d in zip(spec.outputs, output_dtypes)]
    consts = []
    for key, value in template:
        if isinstance(value, bool):
            consts.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        elif dtype_name(value) in _TYPES:
            consts.append(f"  using {key} = {ctype(value)};")
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
