"""Every reader against crafted input: mutants of real checkpoints of every kind shardpoint reads.

``tests/test_fuzz_readers.py`` runs this module in a fresh process (so the peak memory it
reports is the readers' own) and asserts its report. By hand::

    python -m tests.fuzz_readers --examples 2000 --report /tmp/fuzz.json

Each example copies one pristine source into a fresh folder, changes one thing in one of
its files, and runs every reader of that source over the copy: ``Checkpointer.load``
(with ``verify`` and ``fallback``), the validation logits, ``verify``, ``inspect``,
``convert`` and ``export``. The mutants are what a file from someone else can hold:
flipped, truncated or missing bytes; JSON fields set to huge, negative, wrong-type or
deeply nested values; paths with ``..``, absolute, NUL or empty; DCP ``.metadata``
records naming files outside the checkpoint or lengths far past the file; the same in
the columns of shardpoint's chunk index (``.chunk_index``, which loads plan from) and the
records of its rows (``.chunk_rows``, with the head's checksums made to match); and pickles
naming globals (``os.system``). ``hypothesis`` draws them under a fixed seed
(``derandomize``), and shrinks a failing one to its smallest form.

What every reader must do, whatever the input:

* end in success or a :class:`shardpoint.CheckpointError` (the CLI: exit 0 or 1);
* open no file outside the checkpoint's root: every ``open`` is recorded with
  :func:`sys.addaudithook`, and copies of real data files wait under folders named
  ``canary`` inside and beside the run, where a crafted path would find them;
* run no code: a pickled ``os.system`` would create ``PWNED``;
* keep memory bounded: the report carries the process's peak RSS after the pristine
  runs and after all mutants, and the test bounds the growth.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import pickle
import resource
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
CANARY = "canary"


# ---------------------------------------------------------------- the sources


@dataclass
class Source:
    """A pristine checkpoint folder and the readers to run over each of its mutants."""

    name: str
    root: Path  # the folder copied for each mutant
    readers: list[tuple[str, Callable[[Path, Path], Any]]]
    files: list[str] = field(default_factory=list)  # relative paths, filled in once built


class Frozen(torch.nn.Module):
    """A base that is stored once (a matrix and a 0-dim scale, frozen) and a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Parameter(torch.arange(64, dtype=torch.float32).reshape(8, 8), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.tensor(2.5), requires_grad=False)
        self.head = torch.nn.Linear(8, 4)


def _state(sp: Any) -> Any:
    torch.manual_seed(0)
    model = Frozen()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return sp.TrainState(model, opt, extra={"consumed_samples": 0})


def _step(state: Any) -> None:
    loss = state.model.head(state.model.base * state.model.scale).square().mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()


def _build_run(sp: Any, root: Path, fmt: str, **options: Any) -> None:
    state = _state(sp)
    ckpt = sp.Checkpointer(str(root), format=fmt, config={"hidden_size": 8}, **options)
    for it in (1, 2):
        _step(state)
        if "local_dir" in options:
            ckpt.maybe_save(it, state)  # the local tier's every step
        else:
            ckpt.save(it, state, validation_logits=torch.full((2, 3), float(it)))
    ckpt.close()


LOCAL_TIER = dict(local_interval=1, local_replicas=0, save_interval=100)


NOT_A_CHECKPOINT: set[tuple[str, ...]] = set()  # commands that answer 2 for the pristine source too


def _cli(*argv: str) -> None:
    """Run a subcommand in-process; exit 0 or 1 are answers, anything else (an exception) is not.

    Exit 2 is the CLI's answer to a usage error or "not a checkpoint" (a Hugging Face folder
    given to ``inspect``); it is an answer only where the pristine source gets it too, since a
    raw ``ValueError`` from crafted bytes would also exit 2.
    """
    from shardpoint.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(list(argv))
    command = _command(argv)
    if code == 2 and command in NOT_A_CHECKPOINT:
        return
    if code not in (0, 1):
        raise ExitCode(code, command, f"shardpoint {' '.join(argv)} exited {code}: {err.getvalue()[-500:]}")


class ExitCode(AssertionError):
    def __init__(self, code: int, command: tuple[str, ...], text: str) -> None:
        super().__init__(text)
        self.code, self.command = code, command


def _command(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The command without the case's own paths (the same for every mutant of a source)."""
    return tuple(a.split("/cases/")[-1].split("/", 1)[0] if "/cases/" in a else a for a in argv if "/out/" not in a)


def _load(sp: Any, options: dict[str, Any] | None = None, **kwargs: Any) -> Callable[[Path, Path], Any]:
    def run(root: Path, out: Path) -> Any:
        state = _state(sp)
        extra = dict(options or {})
        if "local_interval" in extra:
            extra["local_dir"] = str(root / "local")
        result = sp.Checkpointer(str(root / "run"), config={"hidden_size": 8}, **extra).load(state, **kwargs)
        if result is not None:
            result.read_validation_logits()
        return result

    return run


def _shardpoint_readers(
    sp: Any, fmt: str, options: dict[str, Any] | None = None
) -> list[tuple[str, Callable[[Path, Path], Any]]]:
    return [
        ("load", _load(sp, options)),
        ("load-fallback", _load(sp, options, fallback=True)),
        ("load-iteration-1", _load(sp, options, iteration=1)),
        ("verify", lambda root, out: _cli("verify", str(root / "run"), "--all")),
        ("inspect", lambda root, out: _cli("inspect", str(root / "run"), "--tensors")),
        ("export", lambda root, out: _cli("export", str(root / "run"), "--to", "safetensors", str(out / "w"))),
        ("convert", lambda root, out: _cli("convert", str(root / "run"), str(out / "c"), "--format", fmt)),
    ]


def _foreign_readers(tool: str) -> list[tuple[str, Callable[[Path, Path], Any]]]:
    return [
        ("inspect", lambda root, out: _cli("inspect", str(root / "run"))),
        ("convert", lambda root, out: _cli("convert", str(root / "run"), str(out / "c"), "--from", tool)),
    ]


def _hf_readers(sp: Any) -> list[tuple[str, Callable[[Path, Path], Any]]]:
    def load_weights(root: Path, out: Path) -> None:
        sp.load_hf_weights(Frozen(), str(root / "run"))

    return [("load_hf_weights", load_weights), ("inspect", lambda root, out: _cli("inspect", str(root / "run")))]


def build_sources(base: Path) -> list[Source]:
    """Write or copy one pristine checkpoint of every kind into ``base``/<name>/run."""
    import shardpoint as sp

    sources = [
        Source("dist", base / "dist", _shardpoint_readers(sp, "dist")),
        Source("torch", base / "torch", _shardpoint_readers(sp, "torch")),
    ]
    _build_run(sp, sources[0].root / "run", "dist")
    _build_run(sp, sources[1].root / "run", "torch")
    for layout in ("hf", "accelerate", "torchtitan", "neox"):  # the folders the framework integrations write
        source = Source(f"layout-{layout}", base / f"layout-{layout}", _shardpoint_readers(sp, "dist"))
        _build_run(sp, source.root / "run", "dist", layout=layout)
        sources.append(source)
    from shardpoint.catalog.layout import named

    lightning = {"layout": named("last.ckpt")}  # the folder ShardpointCheckpointIO writes for ModelCheckpoint
    source = Source("layout-lightning", base / "layout-lightning", _shardpoint_readers(sp, "dist", lightning))
    _build_run(sp, source.root / "run", "dist", **lightning)
    sources.append(source)
    tier = Source("local-tier", base / "local-tier", _shardpoint_readers(sp, "dist", LOCAL_TIER)[:3])
    _build_run(sp, tier.root / "run", "dist", local_dir=str(tier.root / "local"), **LOCAL_TIER)
    sources.append(tier)
    hf = Source("safetensors", base / "safetensors", _hf_readers(sp))
    model = Frozen()
    sp.save_hf_weights(model, str(hf.root / "run"), max_shard_size=200)  # shards and their index
    sources.append(hf)
    for name, tool, fixture in (
        ("megatron-legacy", "megatron", FIXTURES / "foreign" / "megatron-legacy-tp1" / "ckpt"),
        ("megatron-torch_dist", "megatron", FIXTURES / "foreign" / "megatron-torchdist-tp2" / "ckpt"),
        ("deepspeed", "deepspeed", FIXTURES / "foreign" / "deepspeed-zero1-dp2" / "ckpt"),
    ):
        source = Source(name, base / name, _foreign_readers(tool))
        shutil.copytree(fixture, source.root / "run")
        sources.append(source)
    for source in sources:
        source.files = sorted(str(p.relative_to(source.root)) for p in source.root.rglob("*") if p.is_file())
    return sources


# ---------------------------------------------------------------- the mutations


class Evil:
    """Pickles as a call of ``os.system``: a reader that runs it creates PWNED."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.target}",))


def _path_values(depth_root: Path, name: str) -> list[str]:
    """Paths a crafted record can hold: up and out, absolute, NUL, empty, into canaries."""
    return [
        *(("../" * up) + f"{CANARY}/{name}" for up in range(1, 5)),
        str(depth_root / CANARY / name),
        f"{CANARY}/{name}",
        "",
        ".",
        "..",
        "a\x00b",
        "/etc/passwd",
        name + "/" * 3,
    ]


BAD_VALUES: list[Any] = [
    -1,
    -(2**63),
    2**64,
    10**30,
    1e308,
    0,
    "x",
    "",
    None,
    True,
    [],
    {},
    [[[[[[[[[[]]]]]]]]]],
    {"a": {"b": {"c": 1}}},
]


def _json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            out += _json_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value[:8]):
            out += _json_paths(item, (*prefix, i))
    return out


def _set_path(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    holder = doc
    for key in path[:-1]:
        holder = holder[key]
    if value is _DELETE:
        del holder[path[-1]]
    else:
        holder[path[-1]] = value
    return doc


_DELETE = object()


def _metadata_fields(md: Any) -> list[tuple[str, Callable[[Any, Any], None]]]:
    """Setters of the fields a crafted DCP ``.metadata`` can change (storage records, chunk boxes)."""
    setters: list[tuple[str, Callable[[Any, Any], None]]] = []
    for index, key in enumerate(sorted(md.storage_data or {}, key=str)):
        if index > 6:
            break
        for attr in ("relative_path", "offset", "length"):
            setters.append((f"storage.{key}.{attr}", lambda m, v, key=key, attr=attr: _replace(m, key, attr, v)))
    for name, tmd in sorted(md.state_dict_metadata.items())[:6]:
        chunks = getattr(tmd, "chunks", None)
        if chunks:
            setters.append((f"chunk.{name}.offsets", lambda m, v, name=name: _chunk(m, name, "offsets", v)))
            setters.append((f"chunk.{name}.sizes", lambda m, v, name=name: _chunk(m, name, "sizes", v)))
            setters.append((f"size.{name}", lambda m, v, name=name: setattr(m.state_dict_metadata[name], "size", v)))
    return setters


def _replace(md: Any, key: Any, attr: str, value: Any) -> None:
    import dataclasses

    md.storage_data[key] = dataclasses.replace(md.storage_data[key], **{attr: value})


def _chunk(md: Any, name: str, attr: str, value: Any) -> None:
    import dataclasses

    chunks = md.state_dict_metadata[name].chunks
    chunks[0] = dataclasses.replace(chunks[0], **{attr: value})


def _bad_box(value: Any) -> Any:
    """A chunk box or size: huge, negative, wrong length or wrong type."""
    if isinstance(value, int):
        return torch.Size([value]) if value >= 0 else (value,)
    return value


@dataclass
class Mutant:
    file: str
    how: str

    def __str__(self) -> str:
        return f"{self.file}: {self.how}"


def mutate(data: Any, source: Source, work: Path) -> Mutant:
    """Draw one change to one file of ``work`` (a fresh copy of ``source``) and apply it."""
    import hypothesis.strategies as st

    rel = data.draw(st.sampled_from(source.files), label="file")
    path = work / rel
    raw = path.read_bytes()
    kinds = ["flip", "truncate", "empty", "delete", "append", "evil"]
    doc = _json_or_none(raw)
    if doc is not None:
        kinds += ["json"] * 6
    if path.name == ".metadata":
        kinds += ["metadata"] * 8
    if path.name == ".chunk_index":
        kinds += ["index"] * 8
    if path.name == ".chunk_rows":
        kinds += ["rows"] * 8
    if path.name in ("latest_checkpointed_iteration.txt", "latest"):
        kinds += ["tracker"] * 3
    kind = data.draw(st.sampled_from(kinds), label="kind")
    if kind == "flip":
        at = data.draw(st.integers(0, max(len(raw) - 1, 0)), label="at")
        bit = data.draw(st.integers(0, 7), label="bit")
        path.write_bytes(raw[:at] + bytes([raw[at] ^ (1 << bit)]) + raw[at + 1 :] if raw else b"\x01")
        return Mutant(rel, f"bit {bit} of byte {at} flipped")
    if kind == "truncate":
        keep = data.draw(st.integers(0, max(len(raw) - 1, 0)), label="keep")
        path.write_bytes(raw[:keep])
        return Mutant(rel, f"truncated to {keep} bytes")
    if kind == "empty":
        path.write_bytes(b"")
        return Mutant(rel, "emptied")
    if kind == "delete":
        path.unlink()
        return Mutant(rel, "deleted")
    if kind == "append":
        path.write_bytes(raw + b"\x00" * data.draw(st.integers(1, 4096), label="extra"))
        return Mutant(rel, "bytes appended")
    if kind == "evil":
        evil = {"x": Evil(work / "PWNED")}
        if data.draw(st.booleans(), label="zip"):
            buffer = io.BytesIO()
            torch.save(evil, buffer)  # torch's zip container, as .pt files are
            path.write_bytes(buffer.getvalue())
            return Mutant(rel, "replaced by torch.save of os.system")
        path.write_bytes(pickle.dumps(evil))  # a plain pickle, as DCP's .metadata is
        return Mutant(rel, "replaced by a pickle of os.system")
    if kind == "tracker":
        text = data.draw(
            st.sampled_from(["9" * 5000, "-1", "release", "../canary", "1e9", "", "\x00", "0", "99999999", " 2 "]),
            label="tracker",
        )
        path.write_text(text)
        return Mutant(rel, f"tracker set to {text[:20]!r}")
    if kind == "json":
        return _mutate_json(data, path, rel, doc)
    if kind == "index":
        return _mutate_index(data, path, rel)
    if kind == "rows":
        return _mutate_rows(data, path, rel)
    return _mutate_metadata(data, path, rel, work)


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _mutate_json(data: Any, path: Path, rel: str, doc: Any) -> Mutant:
    import hypothesis.strategies as st

    paths = _json_paths(doc)
    if not paths:
        path.write_text("[" * 100_000 + "]" * 100_000)
        return Mutant(rel, "nested 100,000 deep")
    where = data.draw(st.sampled_from(paths), label="field")
    choice = data.draw(st.integers(0, len(BAD_VALUES) + 12), label="value")
    if choice < len(BAD_VALUES):
        value = BAD_VALUES[choice]
        text = json.dumps(_set_path(doc, where, value))
        how = f"{where} = {value!r}"
    elif choice < len(BAD_VALUES) + 10:
        value = _path_values(path.parent, "__0_0.distcp")[choice - len(BAD_VALUES)]
        text = json.dumps(_set_path(doc, where, value))
        how = f"{where} = {value!r}"
    elif choice == len(BAD_VALUES) + 10:
        text = json.dumps(_set_path(doc, where, "@HUGE@")).replace('"@HUGE@"', "9" * 5000)
        how = f"{where} = a 5,000-digit integer"
    elif choice == len(BAD_VALUES) + 11:
        text = json.dumps(_set_path(doc, where, "@DEEP@")).replace('"@DEEP@"', "[" * 50_000 + "]" * 50_000)
        how = f"{where} nested 50,000 deep"
    else:
        text = json.dumps(_set_path(doc, where, _DELETE))
        how = f"{where} deleted"
    path.write_text(text)
    return Mutant(rel, how)


def _mutate_metadata(data: Any, path: Path, rel: str, work: Path) -> Mutant:
    import hypothesis.strategies as st

    md = pickle.loads(path.read_bytes())  # the test's own pristine copy: trusted here
    setters = _metadata_fields(md)
    if not setters:
        path.write_bytes(pickle.dumps({"not": "metadata"}))
        return Mutant(rel, "replaced by a dict")
    # the field kind first: paths (reading another run's files) as often as sizes and boxes together
    kind = data.draw(st.sampled_from(["relative_path", "relative_path", "offset", "length", "chunk"]), label="what")
    chosen = [
        (n, f)
        for n, f in setters
        if n.rsplit(".", 1)[-1] == kind or (kind == "chunk" and n.startswith(("chunk", "size")))
    ]
    name, setter = data.draw(st.sampled_from(chosen or setters), label="field")
    attr = name.rsplit(".", 1)[-1]
    if attr == "relative_path":
        values: list[Any] = _path_values(path.parent, "__0_0.distcp")
    elif attr in ("offset", "length"):
        values = [-1, 2**62, 10**12, 1_550_000_000, 0, "x", None]
    else:
        values = [_bad_box(v) for v in (-1, 2**40, 10**12)] + [torch.Size([]), torch.Size([1, 2, 3, 4]), "x", None]
    value = data.draw(st.sampled_from(values), label="value")
    try:
        setter(md, value)
    except (TypeError, ValueError, AttributeError) as exc:  # a frozen dataclass may refuse a type
        return Mutant(rel, f"unchanged ({name}: {exc})")
    path.write_bytes(pickle.dumps(md))
    return Mutant(rel, f"{name} = {value!r}")


#: values a crafted chunk index (formats/chunk_index.py) can put in each column
_INDEX_VALUES = {
    "file": [-2, 1, 10**6, 2**31 - 1],
    "offset": [-1, 2**62, 10**12, 1_550_000_000],
    "length": [-1, 2**62, 10**12, 1_550_000_000, 0],
    "starts": [-1, 1, 2**40, 10**12],
    "sizes": [-1, 0, 2**40, 10**12],
    "shapes": [-1, 0, 2**40, 10**12],
    "shape_ends": [-1, 0, 10**6],
    "first_row": [-1, 0, 10**6],
    "key_ends": [-1, 0, 10**6],
    "file_ends": [-1, 0, 10**6],
    "dtype": [-2, 1, 100],
    "key_names": [0, 0xFF, ord(".")],
    "split_dim": [-1, 1, 64, 2**40],
    "slab_step": [-1, 1, 2**40],
    "slab_rows": [-1, 0, 1, 2**40],
    "run_start": [-2, -1, 0, 10**18, 2**62],
    "run_count": [-1, 0, 2, 2**40, 2**62],
    "run_prefix_ends": [-1, 0, 10**6],
    "run_suffix_ends": [-1, 0, 10**6],
}
_INDEX_HEADER = {
    "dtypes": ['["os.system"]', "[]", "{}", "[1]", "x"],
    "descriptors": ['[["x"]]', "[]", "x", "[1]"],
    "rows": ["0", "-1", "x"],
    "tensors": ["0", "x"],
    "metadata_xxh3": ["0" * 16],
    "version": ["1", "2", "3"],
    "width": ["0", "65", "-1", "x", "1", "9" * 30],
    "block_rows": ["0", "1", "-1", "x", "9" * 30],
    "nonce": ["0", "-1", "x", str(2**64)],
    "run_descriptors": ['[["x"]]', "[]", "x", "[1]", "[null, null]"],
}


def _mutate_index(data: Any, path: Path, rel: str) -> Mutant:
    """One column or header field of a ``.chunk_index`` set to a crafted value; written anew as valid safetensors."""
    import hypothesis.strategies as st
    import numpy as np
    import safetensors.numpy

    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    arrays = {name: array.copy() for name, array in safetensors.numpy.load(raw).items()}
    what = data.draw(st.sampled_from(["path", "path", "column", "column", "column", "header", "drop"]), label="what")
    if what == "path":  # a file name leading out of the checkpoint or into a canary
        value = data.draw(st.sampled_from(_path_values(path.parent, "__0_0.distcp")), label="value")
        encoded = value.encode("utf-8", "surrogatepass")
        names, ends = ("file_names", "file_ends") if "file_names" in arrays else ("run_prefixes", "run_prefix_ends")
        first = int(arrays[ends][0]) if len(arrays[ends]) else 0
        arrays[names] = np.frombuffer(encoded + arrays[names].tobytes()[first:], np.uint8).copy()
        arrays[ends] = arrays[ends] - first + len(encoded)
        if "run_start" in arrays and len(arrays["run_start"]):  # version 2: the first run, the name whole
            arrays["run_start"][0], arrays["run_count"][0] = -1, 1
        how = f"first file named {value!r}"
    elif what == "column":
        column = data.draw(st.sampled_from(sorted(set(_INDEX_VALUES) & set(arrays))), label="column")
        flat = arrays[column].reshape(-1)
        if not len(flat):
            return Mutant(rel, f"unchanged ({column} is empty)")
        at = data.draw(st.integers(0, len(flat) - 1), label="at")
        value = data.draw(st.sampled_from(_INDEX_VALUES[column]), label="value")
        flat[at] = np.array(value).astype(flat.dtype)
        how = f"{column}[{at}] = {value!r}"
    elif what == "header":
        field = data.draw(st.sampled_from(sorted(_INDEX_HEADER)), label="field")
        header[field] = data.draw(st.sampled_from(_INDEX_HEADER[field]), label="value")
        how = f"header {field} = {header[field]!r}"
    else:
        column = data.draw(st.sampled_from(sorted(arrays)), label="column")
        del arrays[column]
        how = f"column {column} removed"
    path.write_bytes(safetensors.numpy.save(arrays, metadata=header))
    return Mutant(rel, how)


def _mutate_rows(data: Any, path: Path, rel: str) -> Mutant:
    """One field of one record of ``.chunk_rows`` set to a crafted value; its block's checksum fixed to match or not.

    With the checksum fixed (seeded by the head's nonce, as an attacker would, and the
    file resealed), the reader's checks behind it are reached: a box outside its tensor
    or its slabs, a file it does not list, bytes past a file's end.
    """
    import hypothesis.strategies as st
    import numpy as np
    import safetensors.numpy
    import xxhash

    from shardpoint.formats.chunk_rows import record_dtype

    raw_head = (path.parent / ".chunk_index").read_bytes()
    header = json.loads(raw_head[8 : 8 + int.from_bytes(raw_head[:8], "little")])["__metadata__"]
    first_row = safetensors.numpy.load(raw_head)["first_row"].tolist()
    step, nonce = int(header["block_rows"]), int(header["nonce"])
    dtype = record_dtype(int(header["width"]))
    blocks = [(r, min(step, end - r)) for start, end in itertools.pairwise(first_row) for r in range(start, end, step)]
    raw, at, parts, digests = path.read_bytes(), 0, [], []
    for _, rows in blocks:
        parts.append(raw[at : at + rows * dtype.itemsize])
        digests.append(raw[at + rows * dtype.itemsize : at + rows * dtype.itemsize + 8])
        at += rows * dtype.itemsize + 8
    records = np.frombuffer(b"".join(parts), dtype).copy()
    if not len(records):
        return Mutant(rel, "unchanged (no rows)")
    field = data.draw(st.sampled_from(["starts", "sizes", "file", "offset", "length"]), label="field")
    at = data.draw(st.integers(0, len(records) - 1), label="at")
    value = data.draw(st.sampled_from(_INDEX_VALUES[field]), label="value")
    column = records[field].reshape(len(records), -1)
    dim = data.draw(st.integers(0, column.shape[1] - 1), label="dim")
    column[at, dim] = value
    fixed = data.draw(st.booleans(), label="checksums fixed")
    out = []
    for number, ((row, rows), digest) in enumerate(zip(blocks, digests)):
        block = records[row : row + rows].tobytes()
        seed = (nonce + number) & ((1 << 64) - 1)
        out += [block, xxhash.xxh3_64_intdigest(block, seed).to_bytes(8, "little") if fixed else digest]
    path.write_bytes(b"".join(out))
    how = f"row {at} {field}[{dim}] = {value!r}"
    if fixed:
        reseal(path, Mutant(rel, how))
        how += ", its block's checksum fixed to match and the file resealed"
    return Mutant(rel, how)


def reseal(path: Path, mutant: Mutant) -> Mutant:
    """Record the changed file's new size and checksum in its checkpoint's marker, as an attacker would.

    Without this every changed file of a shardpoint checkpoint is caught by its checksum,
    and the readers behind the check are never reached by crafted content.
    """
    import xxhash

    for ckpt in path.parents:
        marker = ckpt / "shardpoint.json"
        if marker.is_file() and marker != path:
            break
    else:
        return mutant
    try:
        doc = json.loads(marker.read_text())
        files = doc["files"]
    except (ValueError, KeyError, TypeError):
        return mutant
    name = str(path.relative_to(ckpt))
    if not isinstance(files, dict) or name not in files:
        return mutant
    if path.exists():
        raw = path.read_bytes()
        files[name] = {"size": len(raw), "xxh3_64": xxhash.xxh3_64(raw).hexdigest()}
    else:
        del files[name]
    marker.write_text(json.dumps(doc))
    return Mutant(mutant.file, mutant.how + ", marker resealed")


# ---------------------------------------------------------------- the guard


class Guard:
    """Records every file opened, and any opened under a folder named ``canary``."""

    def __init__(self) -> None:
        self.active = False
        self.seen: list[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active or event not in ("open", "os.open", "os.listdir", "os.scandir", "os.stat"):
            return
        target = args[0] if args else None
        if isinstance(target, bytes):
            target = target.decode(errors="replace")
        if isinstance(target, str) and CANARY in Path(target).parts:
            self.seen.append(f"{event} {target}")

    @contextlib.contextmanager
    def watching(self) -> Any:
        self.seen = []
        self.active = True
        try:
            yield self
        finally:
            self.active = False


def _plant_canaries(case: Path, source: Source) -> None:
    """Copies of the source's data files where a crafted path would reach them."""
    biggest = max((case / f for f in source.files if (case / f).exists()), key=lambda p: p.stat().st_size)
    for where in (case.parent, case, case / "run"):
        (where / CANARY).mkdir(parents=True, exist_ok=True)
        for name in ("__0_0.distcp", "model.safetensors", biggest.name):
            shutil.copyfile(biggest, where / CANARY / name)


# ---------------------------------------------------------------- the run


def _outcome(reader: Callable[[Path, Path], Any], case: Path, out: Path) -> tuple[str, str]:
    from shardpoint.errors import CheckpointError

    try:
        reader(case, out)
        return "ok", ""
    except CheckpointError as exc:
        return "refused", f"{type(exc).__name__}: {exc}"[:300]
    except BaseException as exc:  # noqa: BLE001 - what the readers must never let out, whatever it is
        return "escaped", "".join(traceback.format_exception(exc))[-3000:]


def run(examples: int, report: Path, headroom: int = 1 << 30) -> dict[str, Any]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    logging_off()
    base = Path(tempfile.mkdtemp(prefix="sp-fuzz-"))
    guard = Guard()
    sources = build_sources(base / "pristine")
    findings: list[dict[str, Any]] = []
    counts: dict[str, int] = {}

    def check(source: Source, case: Path, mutant: str, newest_marker_only: bool = False) -> None:
        for reader_name, reader in source.readers:
            out = Path(tempfile.mkdtemp(dir=base / "out"))
            with guard.watching():
                outcome, detail = _outcome(reader, case, out)
            counts[outcome] = counts.get(outcome, 0) + 1
            problems = []
            if outcome == "escaped":
                problems.append(detail)
            if mutant == "pristine" and reader_name.startswith("load") and outcome != "ok":
                problems.append(f"the pristine source does not load: {detail}")  # else every mutant is moot
            if newest_marker_only and reader_name == "load-fallback" and outcome != "ok":
                # only the newest checkpoint's marker changed: iteration 1 is intact and fallback must reach it
                problems.append(f"load(fallback=True) did not fall back past a damaged newest marker: {detail}")
            if guard.seen:
                problems.append("opened outside the checkpoint: " + "; ".join(sorted(set(guard.seen))[:5]))
            if (case / "PWNED").exists():
                problems.append("ran code from the checkpoint (PWNED exists)")
            if problems:
                findings.append({"source": source.name, "reader": reader_name, "mutant": mutant, "problems": problems})
            shutil.rmtree(out, ignore_errors=True)

    (base / "out").mkdir()
    for source in sources:  # the pristine sources load: the readers are right before anything is changed
        case = base / "cases" / source.name
        shutil.copytree(source.root, case)
        for _, reader in source.readers:  # which commands call this kind of folder "not a checkpoint" (exit 2)
            out = Path(tempfile.mkdtemp(dir=base / "out"))
            try:
                reader(case, out)
            except ExitCode as exc:
                if exc.code == 2:
                    NOT_A_CHECKPOINT.add(exc.command)
            except Exception:  # noqa: BLE001 - reported by check() below
                pass
        check(source, case, "pristine")
        shutil.rmtree(case)
    rss_pristine = _peak_rss()
    _cap_address_space(headroom)
    started = time.monotonic()

    @settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(st.data())
    def one(data: Any) -> None:
        source = data.draw(st.sampled_from(sources), label="source")
        case = base / "cases" / source.name
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(source.root, case)
        mutant = mutate(data, source, case)
        # an attacker reseals a crafted .metadata (else its checksum alone refuses it); other files either way
        if mutant.file.endswith((".metadata", ".chunk_index", ".chunk_rows")) or data.draw(
            st.booleans(), label="reseal"
        ):
            mutant = reseal(case / mutant.file, mutant)
        _plant_canaries(case, source)
        newest = Path(mutant.file).name == "shardpoint.json" and Path(mutant.file).parent.name.endswith("2")
        check(source, case, str(mutant), newest_marker_only=newest and not (case / mutant.file).parent.is_symlink())
        shutil.rmtree(case, ignore_errors=True)

    one()
    result = {
        "examples": examples,
        "seconds": round(time.monotonic() - started, 1),
        "outcomes": counts,
        "findings": findings,
        "peak_rss_pristine": rss_pristine,
        "peak_rss_end": _peak_rss(),
        "largest_source_bytes": max(sum((s.root / f).stat().st_size for f in s.files) for s in sources),
    }
    report.write_text(json.dumps(result, indent=1))
    shutil.rmtree(base, ignore_errors=True)
    return result


def _cap_address_space(headroom: int) -> None:
    """Let the readers map at most ``headroom`` more bytes than the process holds now.

    Peak RSS alone misses a reader that allocates what a crafted length says: untouched
    pages of a 1.5 GB ``torch.empty`` are never resident. Under the cap that allocation
    fails, and the raw allocator error is a finding like any other escape.
    """
    with open("/proc/self/status") as status:
        vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, hard))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def logging_off() -> None:
    import logging
    import warnings

    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=int(os.environ.get("SHARDPOINT_FUZZ_EXAMPLES", "150")))
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args(argv)
    result = run(args.examples, args.report)
    print(json.dumps({k: v for k, v in result.items() if k != "findings"}), f"{len(result['findings'])} findings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
