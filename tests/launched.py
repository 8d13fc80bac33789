"""`mlxwalk` (or, given `lora` first, `python -m mlxwalk.lora`) as a script for `mlx.launch`
and `torchrun`, which run a file, not a module: tests/test_ranks.py, tests/test_torch_ranks.py.
With MLXWALK_TEST_FAIL_RANK=r, rank r's second window raises a refusal, as a rank whose data or
memory fails would."""

import os
import sys

import mlx.core as mx

from mlxwalk import cli
from mlxwalk.plan import PlanError
from mlxwalk.training import mlx_framework

failing = os.environ.get("MLXWALK_TEST_FAIL_RANK")
rank = int(os.environ["RANK"]) if "RANK" in os.environ else mx.distributed.init().rank()
if failing is not None and "--backend" in sys.argv and rank == int(failing):  # torchrun's
    from mlxwalk.torch_backend import train as torch_train

    class Failing(torch_train.ExactWalk):
        runs = []

        def run(self):
            Failing.runs.append(1)
            if len(Failing.runs) == 2:
                raise PlanError("window 3 does not fit this rank's memory (a test's refusal)")
            return super().run()

    torch_train.ExactWalk = Failing
elif failing is not None and rank == int(failing):
    walked = mlx_framework.exact_gradient
    calls = []

    def exact_gradient(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise PlanError("window 3 does not fit this rank's memory (a test's refusal)")
        return walked(*args, **kw)

    mlx_framework.exact_gradient = exact_gradient

if sys.argv[1:2] == ["lora"]:  # the mlx-lm drop-in, as `python -m mlxwalk.lora`
    from mlxwalk.dropin import lora

    sys.exit(lora.main(sys.argv[2:]))
sys.exit(cli.main(sys.argv[1:]))
