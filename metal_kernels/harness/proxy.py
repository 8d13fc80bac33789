"""A static proxy of Apple's compiler: each Metal kernel instantiation, as MLX renders it, compiled
by clang (LLVM, as Apple's compiler is) at -O2 to LLVM IR, with the harness's stand-ins
(`metal.h` under HARNESS_PROXY: simdgroup functions and matrix operations as opaque calls on
values, as Metal's builtins are) and Metal's address spaces (device 1, constant 2, threadgroup 3).
The target is spir64: a GPU target whose calling convention passes a lane's vectors as they are.

What it shows:
  private arrays   every `alloca` left in the kernel's function (or a helper it did not inline)
                   after -O2: storage SROA could not promote to registers. Threadgroup arrays are
                   globals in address space 3, never allocas; scalars are promoted at -O2 unless
                   their address escapes. An array left there (a per-lane tile array indexed at
                   run time, or by a loop clang did not unroll) sits in private memory: Apple
                   GPUs have no fast stack, and their compiler, LLVM-based, would very likely
                   meet the same. Each comes with its declaration and the lines that index it
                   with a value known only at run time.
  live floats      an estimate of the floats a lane holds at once: the most float-typed SSA
                   values (a float 1, a half 1/2, a vector its lanes) live at any point of the
                   kernel's IR, by a liveness analysis over its basic blocks. Before scheduling
                   and register allocation, and private arrays not counted.
  threadgroup      bytes of the address-space-3 globals: the kernel's threadgroup memory.
  per core         simdgroups a GPU core keeps resident, as whole threadgroups within its ~60 KB
                   of threadgroup memory, counted up to 24: ALU use saturates near 24 simdgroups
                   a core (metal-benchmarks), so more would not run faster.
What it cannot: Apple's own passes, register allocation, spills, or speed.

Needs the `proxy` extra (`pip install -e '.[proxy]'`: the `ziglang` wheel carries clang).
`python -m metal_kernels.harness.proxy` (or scripts/metal-proxy.py) prints the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import mlx.core as mx

from .. import build
from ..build import Launch
from . import CACHE, HEADER, _digest, _headers, _parameters, _unit_source, render

NO_ZIG = "the Metal proxy compiles with clang from the ziglang wheel: pip install -e '.[proxy]'"
HAS_ZIG = importlib.util.find_spec("ziglang") is not None
CORE_THREADGROUP_MEMORY = 60 * 1024  # bytes of threadgroup memory a GPU core holds (about 60 KB)
CORE_SIMDGROUPS = 24  # ALU use saturates near 24 simdgroups a core
FLAGS = (
    "-x",
    "c++",
    "-std=c++17",
    "--target=spir64",
    "-O2",
    "-g",  # lines and names for the report; the optimized code is the same without
    "-S",
    "-emit-llvm",
    "-nostdinc",
    "-nostdinc++",
    "-Wno-unknown-attributes",
    "-Wno-ignored-attributes",
    "-ferror-limit=10",
)


@dataclass(frozen=True)
class Instance:
    """One rendered instantiation: a kernel (`attention/forward`), its head dim and dtype."""

    kernel: str
    dim: int
    dtype: mx.Dtype
    call: Launch = field(compare=False, repr=False)
    variant: str = ""  # a template choice besides dim and dtype (prepare's KEEP)

    @property
    def label(self) -> str:
        dtype = str(self.dtype).split(".")[-1]
        return f"{self.kernel} {self.dim} {dtype}" + (f" {self.variant}" if self.variant else "")


@dataclass(frozen=True)
class PrivateArray:
    """An `alloca` left after -O2: private memory, not registers."""

    function: str  # the kernel, or a helper it did not inline
    name: str  # the variable as declared ("?" without debug information)
    type: str  # LLVM's type of the storage
    bytes: int
    declared: str  # file:line (the kernel's .metal where the line is found)
    indexed: tuple[str, ...]  # where a run-time value indexes it: "file:line: source"

    @property
    def tile(self) -> bool:
        """A per-lane array (of tiles, floats, ...), not a lone scalar or struct."""
        return self.type.startswith("[")

    def __str__(self) -> str:
        where = (
            "; ".join(self.indexed) if self.indexed else "no run-time index (its address escapes)"
        )
        return f"{self.name} {self.type} ({self.bytes} B) declared at {self.declared}: {where}"


def _zeros(shape, dtype=mx.float32) -> mx.array:
    return mx.zeros(shape, dtype)


def _attention(kernel: str, dim: int, dtype: mx.Dtype) -> Launch:
    import metal_kernels.attention as attention

    q, k = _zeros((1, 4, 8, dim), dtype), _zeros((1, 2, 8, dim), dtype)
    store, lse = _zeros((1, 2, 16, dim), dtype), _zeros((1, 4, 8))
    if kernel == "forward":
        return attention.forward_launch(q, k, k, store, store, 10, 0.1, backend="metal")
    dq, dkdv = attention.backward_launches(
        q, k, k, store, store, 10, 4, 0.1, lse, lse, q, backend="metal"
    )
    return dq if kernel == "dq" else dkdv


def _delta(kernel: str, dim: int, dtype: mx.Dtype, keep: bool = True) -> Launch:
    from metal_kernels.delta import blocks, chunked

    t, hk, hv = 8, 1, 2
    q, v = _zeros((1, t, hk, dim), dtype), _zeros((1, t, hv, dim), dtype)
    gates, state = _zeros((1, t, hv)), _zeros((1, hv, dim, dim))
    s = chunked.Sizes.of(q, v)
    n, padded = s.chunks, s.padded
    cum, w = _zeros((1, hv, padded)), _zeros((1, hv, padded, dim))
    h, tri = _zeros((1, n, hv, dim, dim)), _zeros((1, hv, n, 64, 64))
    kb = blocks.metal("grads", dim, dtype)["KB"]
    if kernel == "prepare":
        return chunked.prepare_launch(s, q, v, gates, gates, keep, "metal")
    if kernel == "states":
        return chunked.states_launch(s, q, w, w, cum, state, "metal")
    if kernel == "output":
        return chunked.output_launch(s, q, q, cum, h, w, "metal")
    if kernel == "states_back":
        return chunked.states_back_launch(s, q, q, w, cum, v, state, "metal")
    if kernel == "grads":
        return chunked.grads_launch(s, q, q, cum, h, w, h, w, v, "metal")
    dcum = _zeros((1, hv, dim // kb, padded))
    return chunked.prepare_back_launch(s, q, v, gates, cum, tri, w, w, q, dcum, "metal")


def _scan(kernel: str, dk: int) -> Launch:
    import metal_kernels.delta as delta

    c, dv = 64, 32
    w, p, g = _zeros((1, 1, c, dk)), _zeros((1, 1, c, c)), _zeros((1, 1))
    u, state = _zeros((1, 1, c, dv)), _zeros((1, dv, dk))
    if kernel == "scan":
        return delta.scan_launch(u, w, w, p, w, g, state)
    return delta.scan_back_launch(w, w, p, w, g, u, state)


def _dtypes(width: str) -> tuple[mx.Dtype, ...]:
    return (mx.float32,) if width == "float" else (mx.float16, mx.bfloat16)


def instances() -> list[Instance]:
    """Every Metal instantiation the project launches: one per entry of the attention and
    delta-rule block tables and dtype (prepare twice: the forward's, and the backward's keeping
    T), and the two sequential scans (float32) at the key dims of the delta-rule table."""
    from metal_kernels.attention import blocks as attention_blocks
    from metal_kernels.delta import blocks as delta_blocks

    found = []
    for kernel, dim, width in attention_blocks.METAL:
        for dtype in _dtypes(width):
            call = _attention(kernel, dim, dtype)
            found.append(Instance("attention/" + kernel, dim, dtype, call))
    for kernel, dim, width in delta_blocks.METAL:
        for dtype in _dtypes(width):
            for keep in (True, False) if kernel == "prepare" else (True,):
                call = _delta(kernel, dim, dtype, keep)
                variant = "" if kernel != "prepare" else ("keep T" if keep else "forward")
                found.append(Instance("delta/" + kernel, dim, dtype, call, variant))
    for kernel in ("scan", "scan_back"):
        for dim in delta_blocks.METAL_DIMS:
            found.append(Instance("delta/" + kernel, dim, mx.float32, _scan(kernel, dim)))
    return found


# Every threadgroup variable the body declares stays in the module, used or not (the harness
# counts them so, and so do the block tables): a `used` pointer to each.
_KEEP = """#undef HARNESS_THREADGROUP
#define HARNESS_THREADGROUP(name) \\
  static auto* const harness_keep_##name __attribute__((used)) = &name
"""


def _unit(call: Launch, source: str) -> str:
    fn, targs, _ = _parameters(source)
    return (
        f'#define HARNESS_SPACES 1\n#define HARNESS_PROXY 1\n#include "{HEADER}"\n{_KEEP}'
        f"{_unit_source(call, source)}\n"
        f"auto harness_instance = &{fn}{f'<{targs}>' if targs else ''};\n"
    )


@cache
def _clang_version() -> str:
    return _clang(["--version"], "clang").split("\n", 1)[0]


def _clang(args: list[str], what: str) -> str:
    if not HAS_ZIG:
        raise RuntimeError(NO_ZIG)
    done = subprocess.run(
        [sys.executable, "-m", "ziglang", "clang", *args], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{what}: clang failed:\n{done.stderr[-4000:]}")
    return done.stdout


def compile_ir(call: Launch, source: str | None = None) -> str:
    """The call's kernel as LLVM IR after -O2 (cached by the unit's digest and clang's version).
    `source` defaults to `render(call)`."""
    source = render(call) if source is None else source
    unit = _unit(call, source)
    key = _digest(unit + _headers() + _clang_version() + " ".join(FLAGS))
    CACHE.mkdir(parents=True, exist_ok=True)
    ll = CACHE / f"{call.spec.name}-{key}.ll"
    if not ll.exists():  # each compile on files of its own, renamed into place once done
        mine = f"{os.getpid()}.{threading.get_ident()}"
        cpp, tmp = ll.with_suffix(f".{mine}.cpp"), ll.with_suffix(f".{mine}.tmp")
        cpp.write_text(unit)
        _clang([*FLAGS, "-o", str(tmp), str(cpp)], call.spec.name)
        cpp.replace(ll.with_suffix(".proxy.cpp"))  # the unit beside its IR
        tmp.replace(ll)
    return ll.read_text()


# --- reading the IR -------------------------------------------------------------------------

_DEFINE = re.compile(r"^define\b.*?@([\w.$]+)\(", re.M)
_VALUE = re.compile(r'%(?!"?(?:struct|class|union)\.)([-\w$.]+|"[^"]*")')
_LABEL = re.compile(r"label %([-\w$.]+)")
_META = re.compile(r"^!(\d+) = (.*)$", re.M)
_STRUCT = re.compile(r'^(%[\w."$:<>, -]+?) = type \{ (.*) \}$', re.M)
_SCALAR_BYTES = {"float": 4, "half": 2, "bfloat": 2, "double": 8, "ptr": 8}
_FLOATS = {"float": 1.0, "half": 0.5, "bfloat": 0.5, "double": 2.0}


@dataclass
class _Function:
    name: str
    blocks: list[tuple[str, list[str]]]  # (label, instruction lines)
    text: str  # the body as written, debug records included


def _functions(ir: str) -> dict[str, _Function]:
    found = {}
    for m in _DEFINE.finditer(ir):
        end = ir.index("\n}\n", m.end())
        text = ir[ir.index("{\n", m.end()) + 2 : end]
        body = text.split("\n")
        blocks: list[tuple[str, list[str]]] = [("entry", [])]
        for line in body:
            label = re.match(r"^([-\w$.]+):", line)
            if label:
                blocks.append((label.group(1), []))
            elif line.strip() and not line.lstrip().startswith(("#dbg_", ";")):
                if line.startswith("    ") and blocks[-1][1]:  # a switch's continued cases
                    blocks[-1][1][-1] += " " + line.strip()
                else:
                    blocks[-1][1].append(line.strip())
        found[m.group(1)] = _Function(m.group(1), blocks, text)
    return found


def _type_at(text: str) -> tuple[str, str]:
    """(the LLVM type at the start of `text`, the rest)."""
    text = text.lstrip()
    if text[0] in "<[{":
        close = {"<": ">", "[": "]", "{": "}"}[text[0]]
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == text[0]
            depth -= ch == close
            if depth == 0:
                return text[: i + 1], text[i + 1 :]
    m = re.match(r'(%"[^"]*"|%[\w.$]+|ptr addrspace\(\d+\)|[\w.]+)', text)
    return m.group(1), text[m.end() :]


def _bytes(typ: str, structs: dict[str, str]) -> int:
    typ = typ.strip()
    if typ in _SCALAR_BYTES:
        return _SCALAR_BYTES[typ]
    if re.fullmatch(r"i\d+", typ):
        return max(int(typ[1:]) // 8, 1)
    m = re.fullmatch(r"[\[<](\d+) x (.*)[\]>]", typ)
    if m:
        return int(m.group(1)) * _bytes(m.group(2), structs)
    if typ in structs:
        typ = "{ " + structs[typ] + " }"
    if typ.startswith("{"):
        total, rest = 0, typ[1:-1]
        while rest.strip():
            field, rest = _type_at(rest)
            total += _bytes(field, structs)
            rest = rest.lstrip().removeprefix(",")
        return total
    raise ValueError(f"the proxy cannot size the LLVM type {typ!r}")


def _floats(typ: str) -> float:
    """A value's size in floats (32-bit units of floating point; integers and pointers 0)."""
    m = re.fullmatch(r"<(\d+) x (\w+)>", typ)
    if m:
        return int(m.group(1)) * _FLOATS.get(m.group(2), 0.0)
    return _FLOATS.get(typ, 0.0)


_FLAGS = {
    "fast", "nnan", "ninf", "nsz", "arcp", "contract", "afn", "reassoc", "nuw", "nsw", "exact",
    "disjoint", "nneg", "samesign", "inbounds", "volatile",
}  # fmt: skip


def _result_floats(instruction: str) -> float:
    """The floats an instruction's result holds."""
    words = instruction.split(" = ", 1)[1].split(" ")
    while words[0] in ("tail", "musttail", "notail"):  # `tail call`
        words.pop(0)
    op, words = words[0], words[1:]
    while words and words[0] in _FLAGS:
        words.pop(0)
    rest = " ".join(words)
    if op in ("fcmp", "icmp", "getelementptr", "alloca", "ptrtoint", "inttoptr", "extractvalue"):
        return 0.0
    if " to " in rest and op not in ("call", "invoke"):  # a cast
        return _floats(rest.rsplit(" to ", 1)[1].split(",")[0].strip())
    if op in ("call", "invoke"):
        m = re.search(r"(<\d+ x \w+>|\w+) @", rest)
        return _floats(m.group(1)) if m else 0.0
    if op == "select":
        rest = rest.split(",", 1)[1]
    typ, after = _type_at(rest)
    if op == "extractelement":
        m = re.fullmatch(r"<\d+ x (\w+)>", typ)
        return _floats(m.group(1)) if m else 0.0
    if op == "shufflevector":
        lanes = re.search(r"<(\d+) x i32>", after)
        element = re.fullmatch(r"<\d+ x (\w+)>", typ)
        return int(lanes.group(1)) * _FLOATS.get(element.group(1), 0.0) if lanes else 0.0
    return _floats(typ)


def _live_floats(fn: _Function) -> float:
    """The most floats live at once: a backward liveness analysis over the SSA values, phi
    operands live out of the block they come from."""
    weight: dict[str, float] = {}
    uses: dict[str, set[str]] = {}
    defs: dict[str, set[str]] = {}
    phi_defs: dict[str, set[str]] = {}
    edge_uses: dict[tuple[str, str], set[str]] = {}  # (from, to): values a phi takes
    successors: dict[str, list[str]] = {}
    steps: dict[str, list[tuple[str | None, set[str]]]] = {}
    for label, lines in fn.blocks:
        uses[label], defs[label], phi_defs[label], steps[label] = set(), set(), set(), []
        successors[label] = []
        for line in lines:
            target = None
            if " = " in line and line.startswith("%"):
                target = _VALUE.match(line).group(1)
                w = _result_floats(line)
                if w:
                    weight[target] = w
            successors[label] += _LABEL.findall(line)
            rhs = line.split(" = ", 1)[1] if target else line
            if rhs.startswith("phi "):
                phi_defs[label].add(target)
                for value, source in re.findall(r"\[\s*([^,\]]+),\s*%([-\w$.]+)\s*\]", rhs):
                    taken = set(_VALUE.findall(value))
                    edge_uses.setdefault((source, label), set()).update(taken)
                continue
            read = set(_VALUE.findall(_LABEL.sub("", rhs)))
            steps[label].append((target, read))
            uses[label] |= read - defs[label]
            if target:
                defs[label].add(target)
    live_in = {label: set() for label in uses}
    live_out = {label: set() for label in uses}
    changed = True
    while changed:
        changed = False
        for label, _ in reversed(fn.blocks):
            out = set()
            for s in successors[label]:
                out |= live_in.get(s, set()) - phi_defs.get(s, set())
                out |= edge_uses.get((label, s), set())
            inn = uses[label] | (out - defs[label]) | phi_defs[label]
            if out != live_out[label] or inn != live_in[label]:
                live_out[label], live_in[label], changed = out, inn, True
    most = 0.0
    for label, _ in fn.blocks:
        live = {v for v in live_out[label] if v in weight}
        total = sum(weight[v] for v in live)
        most = max(most, total)
        for target, read in reversed(steps[label]):
            if target in live:
                live.discard(target)
                total -= weight[target]
            for v in read:
                if v in weight and v not in live:
                    live.add(v)
                    total += weight[v]
            most = max(most, total)
    return most


def _kernel_name(ir: str, kernel: str) -> str:
    """The defined function whose name holds `kernel` (the generated function's name)."""
    names = [m.group(1) for m in _DEFINE.finditer(ir) if kernel in m.group(1)]
    if len(names) != 1:
        raise ValueError(f"{kernel}: {len(names)} functions of that name in the IR")
    return names[0]


def _reached(functions: dict[str, _Function], kernel: str) -> list[str]:
    """The kernel and the defined functions it calls without inlining them."""
    seen, todo = [kernel], [kernel]
    while todo:
        for _, lines in functions[todo.pop()].blocks:
            for line in lines:
                for callee in re.findall(r"@([\w.$]+)\(", line):
                    if callee in functions and callee not in seen:
                        seen.append(callee)
                        todo.append(callee)
    return seen


class _Lines:
    """Debug locations as file:line, each line found in the kernel's own sources."""

    def __init__(self, ir: str, unit: str | None, sources: dict[str, list[str]]):
        self.meta = dict(_META.findall(ir))
        self.unit = unit.split("\n") if unit is not None else None
        self.sources = sources

    def _field(self, ident: str, name: str) -> str | None:
        m = re.search(rf"\b{name}: (!\d+|\d+|\"[^\"]*\")", self.meta.get(ident, ""))
        return m.group(1) if m else None

    def name(self, ident: str) -> str:
        found = self._field(ident, "name")
        return found.strip('"') if found else "?"

    def where(self, ident: str) -> str:
        """file:line: source of a !DILocation or !DILocalVariable."""
        line = self._field(ident, "line")
        file, scope = self._field(ident, "file"), self._field(ident, "scope")
        while file is None and scope:  # a location's file is its scope's, or its parent's
            file, scope = self._field(scope[1:], "file"), self._field(scope[1:], "scope")
        filename = self._field(file[1:], "filename").strip('"') if file else "?"
        if line is None:
            return filename
        n = int(line)
        if Path(filename).name == Path(HEADER).name:
            return f"{Path(HEADER).name}:{n}"
        text = self.unit[n - 1].strip() if self.unit and 0 < n <= len(self.unit) else ""
        for path, lines in self.sources.items():
            hits = [i for i, s in enumerate(lines) if s.strip() == text and text]
            if len(hits) == 1:
                return f"{path}:{hits[0] + 1}: {text}"
        return f"line {n}: {text}" if text else f"line {n}"


def _sources(call: Launch) -> dict[str, list[str]]:
    files = [*build.header_files(call.spec, "metal"), build.ROOT / (call.spec.stem + ".metal")]
    return {f.name: f.read_text().split("\n") for f in files if f.exists()}


def private_arrays(
    ir: str, kernel: str, call: Launch | None = None, source: str | None = None
) -> list[PrivateArray]:
    """The allocas left in the kernel's function (`kernel`: its generated name or a part of it)
    and in any function of the module it calls without inlining. `call`: name lines in the
    kernel's .metal sources (`source`: its rendering, by default `render(call)`)."""
    functions = _functions(ir)
    structs = dict(_STRUCT.findall(ir))
    unit = None
    if call is not None:
        unit = _unit(call, render(call) if source is None else source)
    lines = _Lines(ir, unit, _sources(call) if call is not None else {})
    found = []
    for name in _reached(functions, _kernel_name(ir, kernel)):
        instructions = [line for _, block in functions[name].blocks for line in block]
        for line in instructions:
            m = re.match(r"%([-\w$.]+) = alloca (.*)$", line)
            if m is None:
                continue
            typ, _ = _type_at(m.group(2))
            variable, declared = "?", "?"
            # #dbg_declare(ptr %a, !var, ...) or #dbg_assign(value, !var, ..., ptr %a, ...)
            record = re.search(
                rf"#dbg_(?:declare|assign)\([^\n]*?ptr %{re.escape(m.group(1))}[,)][^\n]*",
                functions[name].text,
            )
            var = re.search(r"!(\d+)", record.group(0)) if record else None
            if var:
                variable, declared = lines.name(var.group(1)), lines.where(var.group(1))
            found.append(
                PrivateArray(
                    function=name,
                    name=variable,
                    type=typ,
                    bytes=_bytes(typ, structs),
                    declared=declared,
                    indexed=_runtime_indices(instructions, m.group(1), lines),
                )
            )
    return found


def _runtime_indices(instructions: list[str], base: str, lines: _Lines) -> tuple[str, ...]:
    """Where a pointer into the alloca is formed from a value known only at run time."""
    derived, sites = {base}, []
    for line in instructions:
        m = re.match(r"%([-\w$.]+) = (getelementptr|phi|select)\b(.*)$", line)
        if m is None:
            continue
        values = _VALUE.findall(m.group(3).split(", !dbg")[0])
        if not derived & set(values):
            continue
        derived.add(m.group(1))
        if m.group(2) == "getelementptr":
            dynamic = [v for v in values if v not in derived]
        else:  # a pointer chosen at run time
            dynamic = [m.group(1)]
        if dynamic:
            dbg = re.search(r"!dbg !(\d+)", line)
            site = lines.where(dbg.group(1)) if dbg else "?"
            if site not in sites:
                sites.append(site)
    known = [s for s in sites if s != "?"]  # "?": an instruction clang gave no line
    return tuple(known or sites)


def threadgroup_bytes(ir: str) -> int:
    """Bytes of the module's threadgroup (address space 3) variables."""
    structs = dict(_STRUCT.findall(ir))
    total = 0
    for rest in re.findall(r"^@\S+ = [^\n]*?addrspace\(3\) global (.*)$", ir, re.M):
        typ, _ = _type_at(rest)
        total += _bytes(typ, structs)
    return total


def live_floats(ir: str, kernel: str) -> float:
    """The estimate of floats a lane holds at once in the kernel's function."""
    return _live_floats(_functions(ir)[_kernel_name(ir, kernel)])


def simdgroups_per_core(threadgroup_memory: int, simdgroups: int) -> int:
    """Simdgroups a core keeps resident: whole threadgroups within its threadgroup memory, at
    most CORE_SIMDGROUPS (past it the ALU is saturated)."""
    groups = CORE_THREADGROUP_MEMORY // max(threadgroup_memory, 1)
    return min(groups * simdgroups, CORE_SIMDGROUPS)


def estimate(call: Launch, ir: str | None = None) -> dict:
    """What the proxy reads from the call's IR: threadgroup bytes, threads and simdgroups a
    threadgroup, simdgroups a core, live floats a lane (an estimate) and the private arrays."""
    source = render(call)
    ir = compile_ir(call, source) if ir is None else ir
    fn, _, _ = _parameters(source)
    threads = call.threadgroup[0] * call.threadgroup[1] * call.threadgroup[2]
    tg = threadgroup_bytes(ir)
    return {
        "threadgroup_bytes": tg,
        "threads": threads,
        "simdgroups": threads // 32,
        "simdgroups_per_core": simdgroups_per_core(tg, threads // 32),
        "live_floats": live_floats(ir, fn),
        "private": private_arrays(ir, fn, call, source),
    }


def estimates(found: Iterable[Instance], jobs: int | None = None) -> list[dict]:
    """`estimate` for each instance, compiled `jobs` at a time (rendering stays serial: MLX
    prints each source to the process's standard output)."""
    found = list(found)
    sources = [render(i.call) for i in found]
    with ThreadPoolExecutor(jobs) as pool:
        irs = list(pool.map(compile_ir, [i.call for i in found], sources))
    return [estimate(i.call, ir) for i, ir in zip(found, irs)]


def table(found: list[Instance], rows: list[dict]) -> str:
    """The markdown table: one row per instance, then each private array's report."""
    out = [
        "| kernel | head dim | dtype | threadgroup bytes | threads | simdgroups a core "
        "| live floats a lane | private arrays |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for inst, row in zip(found, rows):
        dtype = str(inst.dtype).split(".")[-1] + (f" ({inst.variant})" if inst.variant else "")
        private = ", ".join(f"{p.name} {p.bytes} B" for p in row["private"]) or "none"
        out.append(
            f"| {inst.kernel} | {inst.dim} | {dtype} | {row['threadgroup_bytes']:,} "
            f"| {row['threads']} | {row['simdgroups_per_core']} | {row['live_floats']:g} "
            f"| {private} |"
        )
        notes += [f"- {inst.label}: {p}" for p in row["private"]]
    if notes:
        out += ["", "Private arrays left after -O2, and where a run-time value indexes them:", ""]
        out += notes
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="*", default=None, help="only these (attention/dq)")
    parser.add_argument("--jobs", type=int, default=None, help="compiles at once (every core)")
    parser.add_argument("--check", action="store_true", help="exit 1 on any private array")
    args = parser.parse_args(argv)
    if not HAS_ZIG:
        print(NO_ZIG, file=sys.stderr)
        return 2
    found = [i for i in instances() if not args.kernels or i.kernel in args.kernels]
    if not found:
        print(f"no kernel of {args.kernels}", file=sys.stderr)
        return 2
    rows = estimates(found, args.jobs)
    print(table(found, rows))
    return 1 if args.check and any(row["private"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
