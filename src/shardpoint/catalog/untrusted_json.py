"""JSON that came with a checkpoint someone else wrote: parsed with bounds, refused by name.

Headers and indexes of foreign files (a safetensors header, ``model.safetensors.index.json``,
a Hugging Face ``config.json``) are input, not trusted data. Three things go wrong with
crafted input and surface as raw Python errors unless caught here: nesting deep enough to
exhaust the parser's recursion (``RecursionError``), a file big enough to exhaust memory
(read whole before any check), and a file name that leaves its directory (``""``, a NUL,
an absolute path, ``..``) and fails later as ``Is a directory`` or ``embedded null byte``.
Each becomes a :class:`CorruptCheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardpoint.errors import CorruptCheckpointError

__all__ = ["MAX_JSON_BYTES", "check_json_size", "check_member_name", "parse_json_object", "read_json_object"]

# The largest index transformers writes (a 671B-parameter model, ~92k tensors) is under 10 MB;
# 64 MiB leaves room without letting a crafted file decide how much memory a load takes.
MAX_JSON_BYTES = 64 * 2**20


def parse_json_object(raw: bytes, name: str, what: str) -> dict[str, Any]:
    """``raw`` parsed as one JSON object; ``name`` and ``what`` (such as "safetensors header") for messages.

    Raises:
        CorruptCheckpointError: not UTF-8, not JSON, nested too deep, or not an object.
    """
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{name}: the {what} is not valid JSON ({exc}); the file is damaged") from None
    except RecursionError:
        raise CorruptCheckpointError(
            f"{name}: the {what} nests deeper than any real one does; the file is damaged or crafted"
        ) from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{name}: the {what} is {type(value).__name__}, not a JSON object; the file is damaged"
        )
    return value


def read_json_object(path: str, what: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The JSON object in local file ``path``, refused unread if it is larger than ``limit`` bytes.

    Raises:
        FileNotFoundError: no such file (callers say what was expected there).
        CorruptCheckpointError: too large, or not a JSON object (see :func:`parse_json_object`).
    """
    size = os.path.getsize(path)
    check_json_size(size, path, what, limit)
    with open(path, "rb") as f:
        return parse_json_object(f.read(limit + 1), path, what)


def check_json_size(size: int, name: str, what: str, limit: int = MAX_JSON_BYTES) -> None:
    """Refuse a JSON file of ``size`` bytes before reading it, if it is larger than ``limit``."""
    if size > limit:
        raise CorruptCheckpointError(
            f"{name}: the {what} has {size} bytes, more than the {limit} any real one needs; refusing to read it"
        )


def check_member_name(file: Any, name: str) -> str:
    """``file``, a name that an index places in its own directory, or CorruptCheckpointError naming ``name``."""
    bad = (
        not isinstance(file, str)
        or file in ("", ".", "..")
        or "\x00" in file
        or "/" in file
        or "\\" in file
        or file.startswith(".")
        or os.path.isabs(file)
    )
    if bad:
        raise CorruptCheckpointError(
            f"{name} names file {file!r}, which is not a file name inside its directory; the index is damaged "
            "or crafted, refusing to read it"
        )
    return file
