"""Collectives that also work with no process group (a single process).

The central rule (DCP's, and ours): a failure on one rank reaches every rank as an
exception, never as a hang. :func:`agree` runs a step on every rank, then exchanges
the outcomes, so every rank raises when any rank failed.

All of shardpoint's control traffic (agreement, commit, record and hash gathers,
decisions, polls) runs on one dedicated gloo group of all ranks, the *control
group*, never on the trainer's default group. Under NCCL the default group would
pickle every object onto the current GPU, sync the training stream for each poll, and
abort after NCCL's 10-minute watchdog while rank 0 alone verifies or deletes; the
control group lives on the CPU and waits at most the round deadline
(:mod:`shardpoint.parallel.deadline`: a round that passes it raises
``CheckpointTimeoutError`` naming the ranks that never arrived), never beyond
:data:`CONTROL_TIMEOUT`. It is created at
the first collective (the Checkpointer makes one at construction, so every rank
creates it at the same point) and again after the default group is re-created.
Only bulk tensor data may use the trainer's group, where it moves GPU memory itself
(:func:`device_group`: a shared load's chunks under NCCL).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardpoint.errors import CheckpointError, CheckpointTimeoutError
from shardpoint.parallel import deadline

T = TypeVar("T")

# long enough for rank 0 to verify a fallback chain or delete old checkpoints while the others wait
CONTROL_TIMEOUT = timedelta(seconds=float(os.environ.get("SHARDPOINT_CONTROL_TIMEOUT", 2 * 3600)))

_control: dict[str, Any] = {"world": None, "group": None}
_timeouts: dict[str, timedelta] = {}  # the timeout each of shardpoint's gloo groups has now, by group name


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def broadcast(obj: Any, src: int = 0, group: Any = None, what: str = "a collective round") -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (None: the control group)."""
    if not initialized() or world_size() == 1:
        return obj
    group = group or control_group()
    with _watched(group, what):
        return _broadcast(obj, src, group)


def _broadcast(obj: Any, src: int, group: Any) -> Any:
    if not _framed(group):
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]
    data = _encode(obj) if rank() == src else b""
    frame = _frame(data, BROADCAST_INLINE) if rank() == src else _empty(BROADCAST_INLINE)
    dist.broadcast(frame, src=src, group=group)
    length = _length(frame)
    if length <= BROADCAST_INLINE:
        return obj if rank() == src else _decode(frame[_HEADER:], length)
    whole = _padded(data, length) if rank() == src else torch.empty(length, dtype=torch.uint8)
    dist.broadcast(whole, src=src, group=group)
    return obj if rank() == src else _decode(whole, length)


def all_gather(obj: Any, group: Any = None, what: str = "a collective round") -> list[Any]:
    """Every rank's ``obj``, in rank order of ``group`` (None: the control group)."""
    if not initialized() or world_size() == 1:
        return [obj]
    group = group or control_group()
    with _watched(group, what):
        return _all_gather(obj, group)


def _all_gather(obj: Any, group: Any) -> list[Any]:
    size = dist.get_world_size(group)
    if not _framed(group):
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj, group=group)
        return out
    data = _encode(obj)
    frames = [_empty(GATHER_INLINE) for _ in range(size)]
    dist.all_gather(frames, _frame(data, GATHER_INLINE), group=group)
    lengths = [_length(f) for f in frames]
    longest = max(lengths)
    if longest <= GATHER_INLINE:
        return [_decode(f[_HEADER:], n) for f, n in zip(frames, lengths)]
    wholes = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(wholes, _padded(data, longest), group=group)
    return [_decode(w, n) for w, n in zip(wholes, lengths)]


def gather_to(obj: Any, dst: int, group: Any = None, what: str = "a collective round") -> list[Any] | None:
    """Gather to global rank ``dst`` over ``group`` (None: the control group, or no group).

    Objects too large for the gathered frame follow point to point, from just the
    ranks whose object did not fit (only ``dst`` learns who they are).
    """
    if not initialized() or (group is None and world_size() == 1):
        return [obj]
    group = group or control_group()
    with _watched(group, what):
        return _gather_to(obj, dst, group)


def _gather_to(obj: Any, dst: int, group: Any) -> list[Any] | None:
    size = dist.get_world_size(group)
    if not _framed(group):
        out = [None] * size if rank() == dst else None
        dist.gather_object(obj, out, dst=dst, group=group)
        return out
    data = _encode(obj)
    frames = [_empty(GATHER_INLINE) for _ in range(size)] if rank() == dst else None
    dist.gather(_frame(data, GATHER_INLINE), frames, dst=dst, group=group)
    if frames is None:  # not the root
        if len(data) > GATHER_INLINE:
            dist.send(_padded(data, len(data)), dst=dst, group=group)
        return None
    members = dist.get_process_group_ranks(group)
    out = []
    for member, frame in zip(members, frames):
        length = _length(frame)
        if length <= GATHER_INLINE:
            out.append(_decode(frame[_HEADER:], length))
        elif member == dst:
            out.append(obj)
        else:
            whole = torch.empty(length, dtype=torch.uint8)
            dist.recv(whole, src=member, group=group)
            out.append(_decode(whole, length))
    return out


def scatter_from(parts: list[Any] | None, src: int = 0, group: Any = None, what: str = "a collective round") -> Any:
    """``parts[i]`` to the i-th rank of ``group`` (None: the control group), from global rank ``src``.

    Each rank receives only its own part: what a rank needs of a plan made on one rank
    (its reads of a load), where a broadcast would give every rank every part. Parts too
    large for the frame follow point to point, to just the ranks they are for.
    """
    if not initialized() or (group is None and world_size() == 1):
        assert parts is not None
        return parts[0]
    group = group or control_group()
    with _watched(group, what):
        return _scatter_from(parts, src, group)


def _scatter_from(parts: list[Any] | None, src: int, group: Any) -> Any:
    if not _framed(group):
        out: list[Any] = [None]
        dist.scatter_object_list(out, parts if rank() == src else None, src=src, group=group)
        return out[0]
    frame = _empty(GATHER_INLINE)
    if rank() != src:
        dist.scatter(frame, None, src=src, group=group)
        length = _length(frame)
        if length <= GATHER_INLINE:
            return _decode(frame[_HEADER:], length)
        whole = torch.empty(length, dtype=torch.uint8)
        dist.recv(whole, src=src, group=group)
        return _decode(whole, length)
    assert parts is not None
    members = dist.get_process_group_ranks(group)
    datas = [_encode(part) for part in parts]
    dist.scatter(frame, [_frame(data, GATHER_INLINE) for data in datas], src=src, group=group)
    sends = [
        posted(dist.isend(_padded(data, len(data)), dst=member, group=group), f"sending rank {member} its part")
        for member, data in zip(members, datas)
        if member != src and len(data) > GATHER_INLINE
    ]
    for request in sends:
        request.wait()
    return parts[members.index(src)]


def all_to_all(payloads: list[Any], group: Any = None, what: str = "a collective round") -> list[Any]:
    """``payloads[i]`` to the i-th rank of ``group`` (None: the control group); what each rank sent this one.

    Framed as the gathers are: one ``all_to_all_single`` of :data:`ALL_TO_ALL_INLINE`
    bytes per pair carries every payload that fits; the larger ones follow point to
    point, in one batch, between just the ranks concerned (both ends know them from
    the frames). Over the control group only (gloo).
    """
    if not initialized() or (group is None and world_size() == 1):
        return list(payloads)
    group = group or control_group()
    with _watched(group, what):
        return _all_to_all(payloads, group)


def _all_to_all(payloads: list[Any], group: Any) -> list[Any]:
    size, me = dist.get_world_size(group), dist.get_group_rank(group, rank())
    datas = [_encode(payload) for payload in payloads]
    frames = torch.cat([_frame(data, ALL_TO_ALL_INLINE) for data in datas])
    received = torch.empty_like(frames)
    dist.all_to_all_single(received, frames, group=group)
    incoming = list(received.view(size, _HEADER + ALL_TO_ALL_INLINE))
    lengths = [_length(frame) for frame in incoming]
    requests, wholes = [], {}
    members = dist.get_process_group_ranks(group)
    for peer, (data, length) in enumerate(zip(datas, lengths)):
        if peer == me:
            continue
        if length > ALL_TO_ALL_INLINE:
            wholes[peer] = torch.empty(length, dtype=torch.uint8)
            requests.append(posted(dist.irecv(wholes[peer], members[peer], group=group), f"receiving from {peer}"))
        if len(data) > ALL_TO_ALL_INLINE:
            sending = _padded(data, len(data))
            requests.append(posted(dist.isend(sending, members[peer], group=group), f"sending rank {peer} its part"))
    for request in requests:
        request.wait()
    out = []
    for peer, (frame, length) in enumerate(zip(incoming, lengths)):
        if peer == me:
            out.append(payloads[me])
        elif length <= ALL_TO_ALL_INLINE:
            out.append(_decode(frame[_HEADER:], length))
        else:
            out.append(_decode(wholes[peer], length))
    return out


def spread(
    step: Callable[[], list[Any]], plan: Callable[[list[Any]], list[Any]], what: str, group: Any = None
) -> list[Any]:
    """A plan made by every rank for a share of the job: two all-to-alls, no rank holding the others' parts.

    Every rank runs ``step``, giving one request per rank (what it asks of each
    planner); each rank then runs ``plan`` on the requests sent to it, giving one piece
    per rank; each rank returns the pieces sent to it, one per planner. Every rank
    hears from every rank in both rounds, so a failure anywhere, in a step or a plan,
    is raised on every rank as :func:`agree` does, after the round that carried it.
    Over ``group``, which holds every rank (None: the control group). Where
    :func:`plan_at_root` would put the whole job's requests on rank 0 (a load's plan at
    thousands of ranks: :mod:`shardpoint.formats.split_plan`; the first save's check:
    :mod:`shardpoint.state.split_survey`).
    """
    requests, error = _attempt(step)
    if error is not None or requests is None:
        requests = [None] * world_size()
    received = all_to_all([(_summary(error), request) for request in requests], group, what)
    _raise_failures(error, {r: s for r, (s, _) in enumerate(received)}, what)
    pieces, error = _attempt(lambda: plan([request for _, request in received]))
    if error is not None or pieces is None:
        pieces = [None] * world_size()
    received = all_to_all([(_summary(error), piece) for piece in pieces], group, what)
    _raise_failures(error, {r: s for r, (s, _) in enumerate(received)}, what)
    return [piece for _, piece in received]


# An object collective of torch sends the sizes first, then the pickled objects: two
# collectives (three calls) for what is most often a few bytes (an agreement's "no
# error"). Here the pickle travels inside a fixed-size frame behind its length, so a
# round that fits is one collective; only a larger object needs a second message.
#: bytes of a broadcast object that ride in the first message (every rank receives it once)
BROADCAST_INLINE = 64 * 1024
#: bytes per rank of a gathered object that ride in the first message (the receiver gets one per rank)
GATHER_INLINE = 2 * 1024
#: bytes per pair of ranks that ride in an all-to-all's first message (every rank sends one to each)
ALL_TO_ALL_INLINE = 512
_HEADER = 8


def _framed(group: Any) -> bool:
    """Whether ``group`` takes the framed CPU messages: gloo (a trainer's NCCL group gets torch's own)."""
    return dist.get_backend(group) == "gloo"


def _encode(obj: Any) -> bytes:
    # the ranks of one job trust each other as torch's object collectives do (they pickle too)
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _decode(tensor: torch.Tensor, length: int) -> Any:
    return pickle.loads(tensor[:length].numpy().tobytes())


def _empty(inline: int) -> torch.Tensor:
    return torch.empty(_HEADER + inline, dtype=torch.uint8)


def _frame(data: bytes, inline: int) -> torch.Tensor:
    """The length of ``data`` and, if it fits in ``inline`` bytes, ``data`` itself."""
    frame = torch.zeros(_HEADER + inline, dtype=torch.uint8)
    frame[:_HEADER] = torch.frombuffer(bytearray(len(data).to_bytes(_HEADER, "little")), dtype=torch.uint8)
    if 0 < len(data) <= inline:
        frame[_HEADER : _HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return frame


def _length(frame: torch.Tensor) -> int:
    return int.from_bytes(frame[:_HEADER].numpy().tobytes(), "little")


def _padded(data: bytes, length: int) -> torch.Tensor:
    whole = torch.zeros(length, dtype=torch.uint8)
    whole[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return whole


def _watched(group: Any, what: str) -> Any:
    """The round's deadline, on shardpoint's gloo groups (a trainer's NCCL group keeps its own watchdog)."""
    if not _framed(group):
        return contextlib.nullcontext()
    _keep_deadline(group)
    return deadline.watched(group, what)


def _keep_deadline(group: Any) -> None:
    """Give ``group`` the current round deadline (groups made before a Checkpointer set it have another one).

    Local: a process group's timeout is set on each rank alone, no collective.
    """
    wanted = deadline.group_timeout(CONTROL_TIMEOUT)
    if _timeouts.get(group.group_name) != wanted:
        from torch.distributed.distributed_c10d import _set_pg_timeout  # the only setter torch offers

        _set_pg_timeout(wanted, group)
        _timeouts[group.group_name] = wanted


def exchange(ops: list[Any], what: str) -> None:
    """``batch_isend_irecv`` of ``ops`` and a wait for all of them, under the round deadline on gloo groups."""
    if not ops:
        return
    with _watched(ops[0].group, what):
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def new_group(ranks: list[int] | None = None) -> Any:
    """A gloo group (all ranks, or ``ranks``) for control traffic; None without a process group.

    Collective: every rank must call it at the same point, also ranks not in ``ranks``.
    A job of one rank gets one too: DCP would otherwise use the default group.
    """
    if not initialized():
        return None
    return dist.new_group(ranks, backend="gloo", timeout=deadline.group_timeout(CONTROL_TIMEOUT))


def control_group() -> Any:
    """The gloo group of all ranks that carries shardpoint's control traffic (None in one process).

    Collective the first time (and after the default group was re-created); every
    collective of this module starts with it, so every rank gets here at the same point.
    """
    if not initialized():
        return None
    world = dist.group.WORLD
    if _control["world"] is not world:
        _control["group"] = new_group()
        _control["world"] = world
    return _control["group"]


def device_group(device_type: str) -> Any:
    """The trainer's default group if its backend moves ``device_type`` tensors itself, else None.

    Bulk tensor data between GPUs (a shared load's chunks) belongs on NCCL, device to
    device over NVLink or InfiniBand, not through host copies on the gloo control group.
    Only data goes there, never control traffic, and only from the main thread.
    """
    if not initialized() or device_type == "cpu":
        return None
    world = dist.group.WORLD
    return world if moves_directly(str(dist.get_backend(world)), device_type) else None


def moves_directly(backend: str, device_type: str) -> bool:
    """Whether ``backend`` (``"nccl"``, ``"cpu:gloo,cuda:nccl"``) moves ``device_type`` tensors without host copies.

    Gloo claims CUDA too, but stages it through host memory: that is what the control group already does.
    """
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        name = per_device.get(device_type)
    else:
        name = backend if device_type in dist.Backend.backend_capability.get(backend, []) else None
    return name is not None and name != "gloo"


def posted(request: dist.Work | None, what: str) -> dist.Work:
    """The request of an ``isend`` / ``irecv`` (torch answers None to a rank outside the group)."""
    if request is None:
        raise CheckpointError(f"{what}: rank {rank()} is not in the process group it was asked to use")
    return request


def barrier(group: Any = None, what: str = "a barrier") -> None:
    if initialized() and world_size() > 1:
        group = group or control_group()
        with _watched(group, what):
            dist.barrier(group=group)


def agree(step: Callable[[], T], what: str, group: Any = None) -> T:
    """Run ``step`` on every rank; if it failed anywhere, raise on every rank.

    The rank that failed re-raises its own exception (a CheckpointError keeps its
    type and message); the others raise a CheckpointError naming the failed ranks
    and their first error line.
    """
    outcome = _attempt(step)
    outcomes = all_gather(_summary(outcome[1]), group, what)
    _raise_failures(outcome[1], dict(enumerate(outcomes)), what)
    return _value(outcome)


def agree_all(step: Callable[[], T], what: str, group: Any = None) -> list[T]:
    """:func:`agree`, returning every rank's result of ``step`` (one all-gather carries both)."""
    result, error = _attempt(step)
    outcomes = all_gather((_summary(error), None if error else result), group, what)
    _raise_failures(error, {r: s for r, (s, _) in enumerate(outcomes)}, what)
    return [value for _, value in outcomes]


def from_root(step: Callable[[], T], what: str, group: Any = None) -> T:
    """Rank 0 runs ``step``; its result, or its failure raised everywhere, reaches every rank (one broadcast)."""
    result, error = _attempt(step) if rank() == 0 else (None, None)
    summary, result = broadcast((_summary(error), None if error else result), group=group, what=what)
    _raise_failures(error, {0: summary}, what)
    return result


def decide_at_root(value: Any, error: BaseException | None, decide: Callable[[list[Any]], T], what: str) -> T | None:
    """Two rounds at any rank count: every rank's ``value`` (or ``error``) to rank 0, rank 0's verdict to all.

    Rank 0 runs ``decide(values)`` when no rank failed; a failure anywhere, in a
    rank's own step or in ``decide``, is raised on every rank as :func:`agree` does.
    Returns ``decide``'s result on rank 0 and None elsewhere. Over the control group.
    """
    if isinstance(error, CheckpointTimeoutError):
        raise error  # as in _attempt: a broken round is not followed by another
    gathered = gather_to((_summary(error), None if error else value), 0, what=what)
    verdict: dict[int, str | None] = {}
    result, root_error = None, None
    if gathered is not None:  # rank 0 (or a single process)
        result, root_error, verdict = _at_root(gathered, decide)
    verdict = broadcast(verdict, what=what)
    _raise_failures(error or root_error, verdict, what)
    return result


def plan_at_root(step: Callable[[], Any], plan: Callable[[list[Any]], list[Any]], what: str, group: Any = None) -> Any:
    """Every rank runs ``step``; rank 0's ``plan(results)`` gives one part per rank; each rank returns its own.

    Two rounds at any rank count (a gather, a scatter): a plan made once, on rank 0, from
    what every rank said, with no rank receiving the others' parts. A failure anywhere,
    in a rank's own step or in ``plan``, is raised on every rank as :func:`agree` does.
    Over ``group`` (None: the control group), which holds every rank: its root is rank 0.
    """
    value, error = _attempt(step)
    gathered = gather_to((_summary(error), None if error else value), 0, group, what=what)
    parts: list[Any] = [None] * world_size()
    root_error = None
    if gathered is not None:  # rank 0 (or a single process)
        planned, root_error, verdict = _at_root(gathered, plan)
        parts = [(verdict, part) for part in (planned or parts)]
    verdict, part = scatter_from(parts if gathered is not None else None, group=group, what=what)
    _raise_failures(error or root_error, verdict, what)
    return part


def _at_root(
    gathered: list[tuple[str | None, Any]], run: Callable[[list[Any]], T]
) -> tuple[T | None, BaseException | None, dict[int, str | None]]:
    """Rank 0: ``run`` on every rank's value unless a rank failed; its result, its failure and the verdict."""
    verdict: dict[int, str | None] = {r: s for r, (s, _) in enumerate(gathered) if s is not None}
    if verdict:
        return None, None, verdict
    result, error = _attempt(lambda: run([v for _, v in gathered]))
    return result, error, ({} if error is None else {rank(): _summary(error)})


def _attempt(step: Callable[[], T]) -> tuple[T, None] | tuple[None, BaseException]:
    """``step``'s result, or the exception it raised (to be told to the other ranks before it is raised)."""
    try:
        return step(), None
    except CheckpointTimeoutError:
        raise  # a round inside the step broke: its peers are named already, and the next round could hang too
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return None, exc


def _value(outcome: tuple[T, None] | tuple[None, BaseException]) -> T:
    """The result of an :func:`_attempt` whose failure, if any, was raised already (raised again here)."""
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def _summary(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_failures(error: BaseException | None, outcomes: dict[int, str | None], what: str) -> None:
    """Raise this rank's own ``error``, or a CheckpointError naming the ranks whose outcome is a failure."""
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"{what} failed on rank {rank()}: {_summary(error)}\n{_short_tb(error)}") from error
    failed = {r: s for r, s in outcomes.items() if s is not None}
    if failed:
        first_rank, first = next(iter(sorted(failed.items())))
        kind = _same_kind(first)
        raise kind(f"{what} failed on rank(s) {sorted(failed)}; rank {first_rank}: {first}".rstrip())


def _same_kind(summary: str) -> type[CheckpointError]:
    """The class of the failing rank's error where it is one of ours built from a message alone.

    Every rank then raises the same kind of error: a job whose rank 0 lost a commit race
    learns ``ConcurrentSaveError`` on every rank, not a plain ``CheckpointError`` on all
    but one, so callers can tell "another job saved this" from a broken save.
    """
    name = summary.split(":", 1)[0]
    for kind in _checkpoint_errors(CheckpointError):
        if kind.__name__ == name and not any(
            "__init__" in vars(c) for c in kind.__mro__ if issubclass(c, CheckpointError)
        ):
            return kind
    return CheckpointError


def _checkpoint_errors(base: type[CheckpointError]) -> list[type[CheckpointError]]:
    """Every subclass of ``base`` defined so far, wherever (``storage.lock.LockedError`` too)."""
    found = []
    for sub in base.__subclasses__():
        found += [sub, *_checkpoint_errors(sub)]
    return found


def _short_tb(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-3))
