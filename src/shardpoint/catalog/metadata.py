"""``shardpoint.json``: the commit marker and the description of one checkpoint.

It is JSON, never pickle, so reading it can run no code, and it is parsed into a
typed, validated dataclass so a hand-edited or truncated file is reported as such
instead of failing later with a ``KeyError``. A directory without this file is not a
checkpoint: it is written last, after every data file it vouches for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shardpoint.catalog.layout import LAYOUTS
from shardpoint.errors import CorruptCheckpointError

__all__ = [
    "FORMAT_VERSION",
    "HELD_NOTE",
    "MARKER_NAME",
    "CheckpointMetadata",
    "FileRecord",
    "listed_record",
    "referred_dir",
    "sibling_path",
    "within_root",
]

MARKER_NAME = "shardpoint.json"
#: in a retired checkpoint kept for the files others refer to (see :mod:`shardpoint.lifecycle.references`)
HELD_NOTE = ".shardpoint-referenced"
FORMAT_VERSION = 1
# "torchtitan": torchtitan's own DCP state dict (shardpoint.integrations.torchtitan writes and reads it);
# "deepspeed": DeepSpeed's own files, committed by shardpoint.integrations.deepspeed (engine mode)
FORMATS = ("dist", "torch", "torchtitan", "deepspeed")


@dataclass(frozen=True)
class FileRecord:
    """Size and checksum of one data file, relative to the checkpoint directory."""

    size: int
    xxh3_64: str


@dataclass
class CheckpointMetadata:
    """Everything ``shardpoint.json`` holds (see DESIGN §3)."""

    iteration: int
    format: str
    topology: dict[str, int]
    release: bool = False
    layout: str = "megatron"
    config: dict[str, Any] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)
    consumed_samples: int | None = None
    flops: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    wall_time: float = 0.0
    save_seconds: float = 0.0
    validation_logits: str | None = None
    library_version: str = ""
    format_version: int = FORMAT_VERSION
    canonical_keys: bool = False  # keys are wrapper-free model names (checkpoints written since they are)
    contiguous_items: bool = False  # dist: every DCP item is a contiguous tensor (read without unpickling)

    @property
    def total_bytes(self) -> int:
        """The bytes a load of this checkpoint reads from: its own files and those it refers to."""
        return sum(r.size for r in self.files.values())

    @property
    def referred_bytes(self) -> int:
        """The part of :attr:`total_bytes` in files of earlier checkpoints (frozen tensors stored once)."""
        return sum(r.size for name, r in self.files.items() if referred_dir(name) is not None)

    @property
    def stored_bytes(self) -> int:
        """The bytes this checkpoint's own directory holds: what saving it wrote."""
        return self.total_bytes - self.referred_bytes

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=1, sort_keys=True, allow_nan=False, default=_json_default)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> CheckpointMetadata:
        """Parse and validate; every problem is a CorruptCheckpointError naming ``where``."""
        try:
            data = json.loads(text)
        # ValueError: besides bad JSON, an integer longer than Python's digit limit (sys.get_int_max_str_digits)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise CorruptCheckpointError(
                f"{where} is not valid JSON ({type(exc).__name__}: {exc}); the checkpoint's marker is damaged: "
                "load another iteration, or restore the file from a copy"
            ) from None
        if not isinstance(data, dict):
            raise CorruptCheckpointError(f"{where} holds a {type(data).__name__}, not a JSON object")
        version = data.get("format_version")
        if not isinstance(version, int):
            raise CorruptCheckpointError(f"{where} has no integer format_version")
        if version > FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{where} has format version {version}, newer than this shardpoint understands "
                f"({FORMAT_VERSION}); upgrade shardpoint to load it"
            )
        return cls(**_validated_fields(data, where))


def _validated_fields(data: dict[str, Any], where: str) -> dict[str, Any]:
    def need(key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        if key not in data:
            if optional:
                return None
            raise CorruptCheckpointError(f"{where} is missing the field {key!r}")
        value = data[key]
        if optional and value is None:
            return None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CorruptCheckpointError(f"{where}: field {key!r} should be {_kind_name(kind)}, got {value!r}"[:300])
        return value

    fields: dict[str, Any] = {
        "iteration": need("iteration", int),
        "format": need("format", str),
        "topology": need("topology", dict),
        "release": need("release", bool),
        "format_version": data["format_version"],
    }
    if fields["format"] not in FORMATS:
        raise CorruptCheckpointError(f"{where}: unknown format {fields['format']!r}; expected one of {FORMATS}")
    if fields["iteration"] < 0:
        raise CorruptCheckpointError(f"{where}: negative iteration {fields['iteration']}")
    for axis in ("tp", "pp", "dp"):
        size = fields["topology"].get(axis)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise CorruptCheckpointError(f"{where}: topology.{axis} should be a positive integer, got {size!r}")
    files = need("files", dict)
    records = {}
    for name, rec in files.items():
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("size"), int)
            or rec["size"] < 0
            or not isinstance(rec.get("xxh3_64"), str)
        ):
            raise CorruptCheckpointError(f"{where}: file record for {name!r} is malformed: {rec!r}"[:300])
        if not within_root(name):
            raise CorruptCheckpointError(f"{where}: file name {name!r} points outside the checkpoint directory")
        records[name] = FileRecord(rec["size"], rec["xxh3_64"])
    fields["files"] = records
    if fields["format"] == "torch" and any(referred_dir(name) is not None for name in records):
        raise CorruptCheckpointError(
            f"{where}: a torch-format checkpoint lists a file of another checkpoint; only the dist format stores "
            "frozen bytes once. The marker is damaged or crafted"
        )
    for key, kind in (
        ("layout", str),
        ("config", dict),
        ("metrics", dict),
        ("library_version", str),
        ("validation_logits", str),
        ("consumed_samples", int),
        ("flops", (int, float)),
        ("wall_time", (int, float)),
        ("save_seconds", (int, float)),
        ("canonical_keys", bool),
        ("contiguous_items", bool),
    ):
        value = need(key, kind, optional=True)
        if value is not None:
            fields[key] = value
    if fields.get("layout", "megatron") not in (*LAYOUTS, "named"):
        raise CorruptCheckpointError(
            f"{where}: layout {fields['layout']!r}"[:200] + f" is none of shardpoint's ({', '.join(LAYOUTS)}, named); "
            "the marker is damaged or crafted"
        )
    logits = fields.get("validation_logits")
    if logits is not None and (logits not in records or referred_dir(logits) is not None):
        raise CorruptCheckpointError(
            f"{where}: validation_logits names {logits!r}"[:300] + ", which is not one of the checkpoint's own "
            "listed files; the marker is damaged or crafted"
        )
    for name, value in fields.get("metrics", {}).items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise CorruptCheckpointError(f"{where}: metric {name!r} should be a finite number, got {value!r}")
    return fields


def listed_record(files: Mapping[str, FileRecord], name: str, where: str, by: str) -> FileRecord:
    """The marker's record of ``name``, a file that ``by`` (such as ``.metadata``) tells a reader to open.

    A reader opens only what the marker lists (with its checksum): a name it does not
    list, or one outside the checkpoint (``..``, absolute), is damaged or crafted input
    that would otherwise read another run's files unchecked.

    Raises:
        CorruptCheckpointError: ``name`` is not listed; the message names it and ``where``.
    """
    record = files.get(name) if isinstance(name, str) else None
    if record is None:
        raise CorruptCheckpointError(
            f"checkpoint {where} is damaged or crafted: {by} names the file {name!r}"[:400] + f", which {MARKER_NAME} "
            "does not list (only the checkpoint's own files and those of checkpoints beside it that it lists are "
            "read); refusing to read it. Load another iteration (iteration=N or fallback=True)"
        )
    return record


def sibling_path(path: str) -> str:
    """The name a checkpoint gives a file of another checkpoint beside it (``path``: ``iter_0000010/x.distcp``)."""
    return f"../{path}"


def referred_dir(name: str) -> str | None:
    """The sibling checkpoint a file name of the marker points into (``../iter_0000010/...``), or None."""
    parts = name.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == ".." else None


def within_root(name: str) -> bool:
    """A file of the checkpoint itself, or of a sibling checkpoint (``../<name>/<file>``): nothing further out.

    Saves that store a frozen tensor once refer to the earlier checkpoint's file (see
    :mod:`shardpoint.formats.dedup`); a marker naming anything else outside is damaged or crafted.
    """
    parts = name.split("/")
    if parts[:1] == [".."]:
        parts = parts[2:] if len(parts) > 2 and parts[1] not in ("", ".", "..") and not parts[1].startswith(".") else []
    return bool(parts) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {"int": "an integer", "str": "a string", "dict": "an object", "bool": "true/false", "float": "a number"}.get(
            k.__name__, k.__name__
        )
        for k in kinds
    )


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable; config values must be JSON types")
