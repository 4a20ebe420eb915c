"""Key naming rules and small helpers shared by offline reading and writing."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator

from shardpoint.state.train_state import MODEL_PREFIX, OPTIM_PREFIX

__all__ = [
    "MP_DIR",
    "Box",
    "ProgressFn",
    "layer_of",
    "param_key_of",
    "pp_rank_of",
    "single_process",
    "stage_by_name",
    "stage_from_source",
]

ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: called as work advances (the CLI draws a bar)."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
MP_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, local shape)


def param_key_of(key: str) -> str | None:
    """``model.<param>`` for ``optimizer.state.<param>.<name>``; None for other keys."""
    if not key.startswith(OPTIM_PREFIX):
        return None
    return MODEL_PREFIX + key[len(OPTIM_PREFIX) :].rsplit(".", 1)[0]


def layer_of(key: str) -> int | None:
    """The global layer number in a key (``...layers.<n>.``), or None."""
    match = _LAYER.search(key)
    return int(match.group(1)) if match else None


def stage_by_name(key: str) -> str:
    """Pipeline stage of a key without a layer number when the source cannot tell: the naming rule."""
    return "first" if "embed" in key else "last"


def stage_from_source(key: str, held: set[int], pp: int) -> str:
    """ "first", "last" or "both" from the pipeline stages that held a key in a source with ``pp`` stages."""
    if pp == 1 or not held:
        return stage_by_name(key)
    first, last = 0 in held, pp - 1 in held
    return "both" if first and last else "first" if first else "last" if last else stage_by_name(key)


def pp_rank_of(folder: str) -> int:
    """Pipeline rank of an ``mp_rank_TT[_PPP]`` folder (0 without pipelining)."""
    match = MP_DIR.fullmatch(folder)
    return int(match.group(2)) if match and match.group(2) is not None else 0


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process")
        yield
