"""`mlxwalk` (or, given `lora` first, `python -m mlxwalk.lora`) as a script for `mlx.launch`,
which runs a file, not a module: tests/test_ranks.py.
With MLXWALK_TEST_FAIL_RANK=r, rank r's second window raises a refusal, as a rank whose data or
memory fails would."""

import os
import sys

import mlx.core as mx

from mlxwalk import cli
from mlxwalk.plan import PlanError
from mlxwalk.training import run

failing = os.environ.get("MLXWALK_TEST_FAIL_RANK")
if failing is not None and mx.distributed.init().rank() == int(failing):
    walked = run.exact_gradient
    calls = []

    def exact_gradient(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise PlanError("window 3 does not fit this rank's memory (a test's refusal)")
        return walked(*args, **kw)

    run.exact_gradient = exact_gradient

if sys.argv[1:2] == ["lora"]:  # the mlx-lm drop-in, as `python -m mlxwalk.lora`
    from mlxwalk.plugin import lora

    sys.exit(lora.main(sys.argv[2:]))
sys.exit(cli.main(sys.argv[1:]))
