"""Without Megatron, ``install()`` and the launcher say what to install (a subprocess where ``megatron`` is absent).

Absence is simulated by a meta-path finder that refuses every ``megatron`` module, in a
fresh interpreter; shardpoint itself is not patched.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json, sys

    out = {}
    from shardpoint.integrations import megatron  # imports without Megatron
    from shardpoint.integrations.megatron import __main__ as launcher

    def attempt(call):
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            return [type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc)]
        return None

    if "--no-training" in sys.argv:  # megatron-core here, Megatron-LM's training code not on the path
        out["no_training"] = attempt(megatron.install)

    class NoMegatron:
        def find_spec(self, name, path=None, target=None):
            if name == "megatron" or name.startswith("megatron."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoMegatron())
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]
    out["install"] = attempt(megatron.install)
    out["launcher"] = attempt(lambda: launcher.main(["pretrain_gpt.py", "--save", "x"]))
    print(json.dumps(out))
    """
)


def _run(*flags: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_install_and_launcher_name_the_extra_when_megatron_is_absent():
    try:
        has_core = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        has_core = False
    out = _run(*(["--no-training"] if has_core else []))
    kind, mro, message = out["install"]
    assert kind == "FrameworkMissingError" and "CheckpointError" in mro and "ModuleNotFoundError" in mro
    assert "pip install 'shardpoint[megatron]'" in message, message
    kind, _, message = out["launcher"]
    assert kind == "SystemExit" and "pip install 'shardpoint[megatron]'" in message, message
    if has_core:  # the wheel has megatron.core only: the training code comes from a Megatron-LM tree
        kind, mro, message = out["no_training"]
        assert kind == "FrameworkMissingError" and "Megatron-LM" in message and "PYTHONPATH" in message, message
