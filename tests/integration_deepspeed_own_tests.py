"""Imported by DeepSpeed's own ``tests/unit`` package in ``scripts/deepspeed-own-tests``'s scratch copy.

It runs in pytest's process and in every rank DeepSpeed's ``DistributedTest`` starts
(the ranks import ``unit`` when they unpickle the test), before any engine exists:

* on CPU, skip the shared-memory allreduce that DeepSpeed's CPU accelerator would build
  with ninja (gloo carries every collective) and leave the Muon optimizer's functions
  uncompiled (``tests/integration_deepspeed_worker.py`` does the same);
* with ``SHARDPOINT_DS_ENGINE=1``, wrap ``deepspeed.initialize`` so every engine a test
  builds saves and loads through :func:`shardpoint.integrations.deepspeed.use`; each
  engine plugged in appends a line to ``$SHARDPOINT_DS_LOG``, so the run can show it was.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import deepspeed
import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
from deepspeed.runtime import compiler  # noqa: E402

_compile, compiler.compile = compiler.compile, lambda: compiler.dummy_decorator
try:
    import deepspeed.runtime.zero.muon.muon_optimizer
finally:
    compiler.compile = _compile


def _plug_in(initialize: Any) -> Any:
    @functools.wraps(initialize)
    def plugged(*args: Any, **kwargs: Any) -> Any:
        from shardpoint.integrations.deepspeed import use

        built = initialize(*args, **kwargs)
        use(built[0])
        log = os.environ.get("SHARDPOINT_DS_LOG")
        if log:
            with open(log, "a") as out:
                out.write(f"{os.getpid()} {os.environ.get('PYTEST_CURRENT_TEST', '?')} {type(built[0]).__name__}\n")
        return built

    return plugged


if os.environ.get("SHARDPOINT_DS_ENGINE") == "1" and not hasattr(deepspeed.initialize, "__wrapped__"):
    deepspeed.initialize = _plug_in(deepspeed.initialize)
