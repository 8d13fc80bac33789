"""The layout: the plan imports no array library, no module imports one that imports it back, and
each layer imports only those beneath it (plan <- ops <- walk <- training <- the mlx-lm drop-in
and the torch backend, cli)."""

import ast
from pathlib import Path

from . import extras

PACKAGE = Path(__file__).resolve().parent.parent / "mlxwalk"
LAYERS = {
    "errors": 0,
    "plan": 0,
    "shapes": 0,
    "grading": 0,
    "ops": 1,
    "walk": 2,
    "training": 3,
    "dropin": 4,
    "torch_backend": 4,
    "survey": 4,
    "commands": 5,
}
# Modules outside every backend: the walks' algorithms and their data, and the training loop with
# its data, windows, run folder and config, shared by the MLX and torch backends.
FRAMEWORK_FREE = (
    "mlxwalk.errors",
    "mlxwalk.plan",
    "mlxwalk.shapes",
    "mlxwalk.grading",
    "mlxwalk.walk.algorithm",
    "mlxwalk.walk.window",
    "mlxwalk.walk.activations",
    *(
        f"mlxwalk.training.{m}"
        for m in (
            "run",
            "setup",
            "step",
            "objective",
            "rescue",
            "framework",
            "runfolder",
            "config",
            "report",
            "windows",
            "data",
            "samples",
            "watch",
            "chat",
            "optimizer_spec",
        )
    ),
)
# Imported by the loop, with MLX's safetensors imported inside the two functions that use them.
LOOP_HELPERS = ("mlxwalk.training.files",)
FRAMEWORKS = ("mlx", "mlx_lm", "torch", "transformers", "peft")
# The shared algorithms' names (walk/algorithm.py's ExactAlgorithm and PlainAlgorithm) and the
# training loop's (run.Run): a backend supplies mechanics only.
SHARED = (
    "decode_forward",
    "decode_runs",
    "entry_state",
    "reverse",
    "grad_from",
    "narrowed_taps",
    "refuse_narrowing",
    "narrowed",
    "loss_blocks",
    "loop",
    "stepped",
    "non_finite",
    "eval_due",
    "evaluate_between",
    "end_epoch",
    "epoch_row",
    "rescue",
    "lost_write",
)


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The mlxwalk modules `name` imports, at the top or inside a function."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        elif (node.module or "").startswith("mlxwalk"):
            target = node.module
        else:
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            found.add(sub if sub in known else target)
    return {t for t in found if t in known and t != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_cycles():
    edges = graph()
    done, path = set(), []

    def visit(node):
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node) :] + [node]))
        if node in done:
            return
        path.append(node)
        for target in edges[node]:
            visit(target)
        path.pop()
        done.add(node)

    for node in edges:
        visit(node)


def test_each_layer_imports_only_those_beneath_it():
    for name, targets in graph().items():
        layer = LAYERS.get(name.split(".")[1] if "." in name else "", None)
        if layer is None:
            continue
        for target in targets:
            below = LAYERS.get(target.split(".")[1] if "." in target else "", None)
            assert below is None or below <= layer, f"{name} imports {target}, a layer above it"


def test_the_shared_modules_import_no_framework():
    """The algorithm and its data (the plan, the walk's phases, the grading, the refusals) are
    plain Python and NumPy: no module of them imports an array framework, at any depth."""
    for name in FRAMEWORK_FREE:
        for node in ast.walk(ast.parse(modules()[name].read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for module in [getattr(node, "module", None) or "", *names]:
                    assert module.split(".")[0] not in FRAMEWORKS, (name, module)


def test_the_plan_imports_with_the_frameworks_blocked():
    """`import mlxwalk.plan`, the walk's algorithm and the training loop with every framework
    unimportable: the package's import does nothing else, and no module outside a backend
    imports one."""
    import subprocess
    import sys

    names = ", ".join((*FRAMEWORK_FREE, *LOOP_HELPERS))
    code = (
        "import sys; [sys.modules.__setitem__(m, None) for m in ('mlx', 'mlx.core', 'torch', "
        f"'mlx_lm', 'transformers', 'peft')]; import {names}; print('ok')"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "ok", p.stderr[-2000:]


def test_the_backends_define_no_twin_of_the_shared_algorithm():
    """The walks' phases live in mlxwalk/walk/algorithm.py only, the training loop's in
    training/run.py: neither backend defines a function or method of theirs (a check by name)."""
    for name, path in modules().items():
        if name in FRAMEWORK_FREE:  # the shared algorithm and the plan it runs on
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                assert node.name not in SHARED, f"{name} defines {node.name}, a shared one"


# What a torch user imports, with MLX and mlx-lm unimportable. (The torch training run's ranks,
# torch_backend/ranks.py and train.py, build on training/ranks.py, which imports MLX.)
TORCH_SIDE = (
    "mlxwalk",
    "mlxwalk.torch_backend",
    *(
        f"mlxwalk.torch_backend.{m}"
        for m in (
            "walk",
            "exactness",
            "plan_command",
            "budget",
            "model",
            "cache",
            "recurrent",
            "delta_kernels",
        )
    ),
)


@extras.torch
def test_the_torch_backend_imports_with_mlx_blocked():
    """The torch backend's walk and its `mlxwalk plan` read the shared algorithm, window and plan,
    none of which may load MLX: with `mlx` and `mlx_lm` unimportable they import, and load
    neither."""
    import subprocess
    import sys

    code = (
        "import sys; [sys.modules.__setitem__(m, None) for m in ('mlx', 'mlx_lm')]; "
        f"import {', '.join(TORCH_SIDE)}; "
        "from mlxwalk.torch_backend.walk import ExactWalk, PlainWalk; "
        "print('ok', [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm') "
        "and sys.modules[m] is not None])"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "ok []", p.stderr[-2000:]


def test_the_plan_imports_no_array_library():
    text = (PACKAGE / "plan.py").read_text()
    assert "import mlx" not in text and "import numpy" not in text and "import torch" not in text


def script_imports(torch_backend: bool):
    """(script, module, name) for each name a script imports from mlxwalk or from the scripts'
    own helpers (scripts/lib, imported as `lib`), on the torch backend's side or the rest."""
    for script in sorted((PACKAGE.parent / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            module = getattr(node, "module", None) or ""
            if isinstance(node, ast.ImportFrom) and module.split(".")[0] in ("mlxwalk", "lib"):
                if ("torch_backend" in module) == torch_backend:
                    for alias in node.names:
                        yield script.name, module, alias.name


def check_script_imports(torch_backend: bool) -> int:
    import importlib.util

    seen = 0
    for script, module_name, name in script_imports(torch_backend):
        if module_name.split(".")[0] == "lib":  # scripts/lib, as the tests import it
            module_name = f"scripts.{module_name}"
        module = importlib.import_module(module_name)
        found = hasattr(module, name) or importlib.util.find_spec(f"{module_name}.{name}")
        assert found, f"{script}: {module_name} has no {name}"
        seen += 1
    return seen


def test_every_script_imports_what_exists():
    """The scripts run outside the suite: each name they import from mlxwalk or scripts/lib
    must be there."""
    assert check_script_imports(torch_backend=False) > 20


@extras.torch
def test_every_script_imports_what_exists_in_the_torch_backend():
    """The same for the names scripts import from the torch backend (which needs the extra)."""
    assert check_script_imports(torch_backend=True) > 3


def test_kernels_import_nothing_of_mlxwalk():
    """metal_kernels/ stands beneath mlxwalk: kernels, their build and their harness only."""
    root = PACKAGE.parent / "metal_kernels"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                module = getattr(node, "module", None) or ""
                assert not any(n.startswith("mlxwalk") for n in [module, *names]), path


def test_only_the_torch_backend_imports_torch():
    """The torch backend is imported only when asked for: outside it, no module imports torch,
    and the torch backend only inside the function that a `--backend torch` calls."""
    for name, path in modules().items():
        if name.startswith("mlxwalk.torch_backend"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "torch" for a in node.names), name
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "torch", name
        for node in tree.body:  # module level: nothing of the torch backend
            if isinstance(node, ast.ImportFrom):
                assert "torch_backend" not in (node.module or ""), name
                assert all(a.name != "torch_backend" for a in node.names), name
