"""A torchft checkpoint transport that checks what arrives: :class:`ShardpointTransport`.

torchft heals a replaced replica group from a healthy one while the others keep
training: at the next step its ``Manager`` asks a healthy rank to send the current
state dict (``send_checkpoint``) and the recovering rank to receive it
(``recv_checkpoint``). torchft's own transports (``PGTransport``, ``HTTPTransport``)
move the bytes and trust them, and unpickle what the sender says about them.
``ShardpointTransport`` is a drop-in for ``PGTransport`` (the same process group, the
same arguments) that:

* **checks every chunk**: each tensor travels in chunks of at most ``chunk_bytes``
  (64 MiB by default), each followed by its XXH3-64 (the checksum of shardpoint's
  files); a mismatch raises :class:`~shardpoint.errors.CorruptCheckpointError` naming
  the sender, the key and the byte range, never a silently wrong tensor;
* **never hangs past the Manager's timeout, and names who is missing**: every receive
  waits at most ``timeout``; a sender that stops or dies is a
  :class:`~shardpoint.errors.CheckpointTimeoutError` naming the sender rank and the
  key it was sending;
* **unpickles nothing that is not plain data**: the description of the state dict is
  JSON-like plain data read through shardpoint's restricted unpickler
  (:func:`~shardpoint.storage.safe_io.load_plain_pickle`); the pytree structure travels
  as ``torch.utils._pytree``'s JSON, ``DTensor`` placements by name; a crafted header
  is an :class:`~shardpoint.errors.UnsafeCheckpointError`, and runs nothing;
* **receives in place, and a failed heal changes nothing**: with ``state_dict=`` (a
  callable returning the recovering rank's own state dict, as for ``PGTransport``),
  tensors and ``DTensor`` local shards are received straight into the existing tensors,
  chunk by chunk. torchft 0.2's ``Manager`` sends ``{"user": {"default": <the state
  dict given to it>}, "torchft": ...}``; a key sent under ``['user']['default']`` is
  looked up as sent, then under ``['user']`` alone, so ``state_dict=lambda: {"user":
  state_dict()}`` (torchft 0.1's layout) receives in place with either. Before a chunk
  overwrites this rank's own bytes, a host copy of them is kept until the heal ends: a
  damaged chunk or a sender that stops midway restores every byte received in place,
  so a failed heal leaves the rank's state exactly as it was (never a mix of two
  states), and the copies are freed when the heal ends either way;
* **does not hold up the healthy ranks**: ``send_checkpoint`` returns at once and
  sends from a background thread; torchft calls ``disallow_checkpoint`` before the
  optimizer changes the state, which waits for the sends. A failed send never stops
  the healthy rank: it is logged and kept in ``send_errors``, and the recovering rank's
  receive fails by itself, naming the sender. A receiver that refuses what it gets (a
  damaged chunk, the state of another step) still receives the rest and drops it, so
  the sender finishes as after a good heal instead of blocking until its timeout, and
  leaves no unmatched send behind to meet the next heal's receives.
  Several recovering ranks are served by one pass over the state: each chunk is sent
  to all of them before the next.

Memory: the sender sends contiguous tensors as they are (a contiguous copy of one
tensor at a time otherwise, and a host copy of one chunk at a time to hash a device
tensor); the receiver allocates only the tensors it has no place for (none when
receiving in place; a staging copy of one tensor when its own is not contiguous), a
host copy of one chunk to hash a device tensor, and, receiving in place, the host
copies of what it overwrites (up to the bytes received in place, on the host, never on
the device: a staging copy of the whole state would double the device memory the state
takes, which a model that fills its accelerator does not have).

Install torchft (``pip install 'shardpoint[torchft]'``) to use it; without it, importing
this module raises :class:`~shardpoint.errors.FrameworkMissingError` naming that extra.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import xxhash

from shardpoint.errors import CheckpointError, CheckpointTimeoutError, CorruptCheckpointError
from shardpoint.integrations import missing_framework
from shardpoint.state.sharding import is_dtensor
from shardpoint.storage.safe_io import load_plain_pickle

try:
    from torchft.checkpointing.transport import CheckpointTransport
except ModuleNotFoundError as exc:
    raise missing_framework(exc, "torchft", "torchft") from exc

__all__ = ["ShardpointTransport", "recovered_from", "resume"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
_HEADER_LENGTH_TAG, _HEADER_TAG, _FIRST_TAG = 1, 2, 3


class ShardpointTransport(CheckpointTransport):
    """Send a torchft state dict over a torchft process group, every chunk checksummed.

    Args:
        pg: the torchft ``ProcessGroup`` the transport uses (as for ``PGTransport``).
        timeout: the longest any one send or receive may wait.
        device: where received tensors without an in-place target are put, and what the
            process group moves (``cpu`` for gloo, ``cuda`` for NCCL).
        state_dict: returns this rank's own state dict, to receive into in place.
        chunk_bytes: the largest piece sent at once, each with its own checksum.
    """

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        device: torch.device,
        state_dict: Callable[[], Any] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self._pg, self._timeout, self._device = pg, timeout, torch.device(device)
        self._state_dict, self._chunk = state_dict, int(chunk_bytes)
        self.received: list[dict[str, Any]] = []  # per heal: step, sender, bytes, seconds (what moved, and how fast)
        self._sending: list[threading.Thread] = []
        self.send_errors: list[BaseException] = []  # sends that failed (logged; see disallow_checkpoint)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ torchft's interface
    def metadata(self) -> str:
        return "<n/a>"  # the process group is the address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Start sending ``state_dict`` to ``dst_ranks``; returns at once (see :meth:`disallow_checkpoint`)."""
        thread = threading.Thread(
            target=self._send_guarded,
            args=(list(dst_ranks), step, state_dict, timeout),
            name="shardpoint-torchft-send",
            daemon=True,
        )
        thread.start()
        self._sending.append(thread)

    def disallow_checkpoint(self) -> None:
        """Wait until every send has finished; the state may change after this.

        A send that failed (the recovering rank died, or stopped receiving) does not
        raise here: torchft calls this from ``should_commit`` on the healthy ranks, after
        the step's commit was decided, and an error would stop a healthy replica group
        for a peer's failure. It is logged and kept in :attr:`send_errors`; the
        recovering rank's receive fails by itself, naming this rank, and torchft retries
        the heal at its next quorum.
        """
        for thread in self._sending:
            thread.join()
        self._sending = []

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Receive the state dict ``src_rank`` sends for ``step``, checked chunk by chunk.

        On any failure this rank's own tensors are restored to what they held before, and
        (unless the sender stopped) the rest of what it sends is received and dropped.
        """
        from torch.utils._pytree import tree_unflatten, treespec_loads

        start = time.perf_counter()
        header = self._recv_header(src_rank, timeout)
        receiver = _Receiver(self, src_rank, timeout, header)
        try:
            if header["step"] != step:
                raise CheckpointError(
                    f"rank {src_rank} sent the state of step {header['step']}, not of step {step}: not taken"
                )
            own = self._own_tensors()
            values = [receiver.leaf(leaf, own) for leaf in header["leaves"]]
            state = tree_unflatten(values, treespec_loads(header["treespec"]))
        except BaseException as exc:
            receiver.abandon(exc)
            raise
        finally:
            receiver.saved.clear()  # the copies of what was overwritten: not needed any more
        moved = sum(int(leaf.get("nbytes", 0)) for leaf in header["leaves"])
        seconds = time.perf_counter() - start
        self.received.append(
            {"step": step, "from rank": src_rank, "bytes": moved, "in place": receiver.in_place, "seconds": seconds}
        )
        log.info(
            "healed: step %d from rank %d, %d bytes (%d in place) in %.3f s, every chunk checked",
            step,
            src_rank,
            moved,
            receiver.in_place,
            seconds,
        )
        return state

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's own tensors by key, to receive into (none without ``state_dict=``)."""
        from torch.utils._pytree import tree_flatten_with_path

        if self._state_dict is None:
            return {}
        flat = tree_flatten_with_path(self._state_dict())[0]
        return {_keystr(path): value for path, value in flat if isinstance(value, torch.Tensor)}

    def shutdown(self, wait: bool = True) -> None:
        if wait:
            for thread in self._sending:
                thread.join(self._timeout.total_seconds())

    # ------------------------------------------------------------------ sending
    def _send_guarded(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        try:
            self._send(dst_ranks, step, state_dict, timeout)
        except BaseException as exc:  # noqa: BLE001 - kept for disallow_checkpoint, on the caller's thread
            log.warning("sending the state of step %d to ranks %s failed: %s", step, dst_ranks, exc)
            if not isinstance(exc, CheckpointError):
                error = CheckpointError(f"sending the state of step {step} to ranks {dst_ranks} failed: {exc!r}")
                error.__cause__, exc = exc, error
            with self._lock:
                self.send_errors.append(exc)

    def _send(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        from torch.utils._pytree import tree_flatten_with_path, treespec_dumps

        flat, spec = tree_flatten_with_path(state_dict)
        tensors = [_local(value) for _, value in flat if isinstance(value, torch.Tensor)]
        header = {
            "step": step,
            "chunk_bytes": self._chunk,  # the receiver follows the sender's chunking
            "treespec": treespec_dumps(spec),
            "leaves": [_describe(path, value) for path, value in flat],
        }
        data = pickle.dumps(header)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
        length = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        self._wait([self._pg.send([length], d, tag=_HEADER_LENGTH_TAG) for d in dst_ranks], timeout, dst_ranks, "")
        self._wait([self._pg.send([raw], d, tag=_HEADER_TAG) for d in dst_ranks], timeout, dst_ranks, "")
        tag = _FIRST_TAG
        for (path, _), tensor in zip(((p, v) for p, v in flat if isinstance(v, torch.Tensor)), tensors):
            tag = self._send_tensor(tensor, _keystr(path), dst_ranks, tag, timeout)

    def _send_tensor(self, tensor: torch.Tensor, key: str, dst_ranks: list[int], tag: int, timeout: timedelta) -> int:
        data = _bytes_of(tensor.detach().contiguous()).to(self._device)
        for start in range(0, data.numel(), self._chunk):
            chunk = data[start : start + self._chunk]
            digest = torch.tensor([_xxh3(self._checked(chunk))], dtype=torch.int64, device=self._device)
            works = [self._pg.send([chunk], d, tag=tag) for d in dst_ranks]
            works += [self._pg.send([digest], d, tag=tag + 1) for d in dst_ranks]
            self._wait(works, timeout, dst_ranks, key)
            tag += 2
        return tag

    def _checked(self, chunk: torch.Tensor) -> torch.Tensor:
        """What the checksum is computed over: the bytes sent (a hook for tests that damage them in transit)."""
        return chunk

    def _wait(self, works: list[Any], timeout: timedelta, ranks: list[int], key: str) -> None:
        for work in works:
            try:
                work.wait(timeout)
            except Exception as exc:  # noqa: BLE001 - named and re-raised
                what = f" of {key!r}" if key else ""
                raise CheckpointTimeoutError(
                    f"sending the state{what} to rank(s) {ranks} timed out or failed after "
                    f"{timeout.total_seconds():g} s: {exc}",
                    missing=ranks,
                    round="torchft checkpoint transfer",
                ) from None

    # ------------------------------------------------------------------ receiving
    def _recv_header(self, src: int, timeout: timedelta) -> dict:
        length = torch.zeros(1, dtype=torch.int64, device=self._device)
        _recv(self._pg, length, src, _HEADER_LENGTH_TAG, timeout, "the description of the state dict")
        n = int(length.item())
        if not 0 < n < 1 << 32:
            raise CorruptCheckpointError(f"rank {src} announced a state-dict description of {n} bytes")
        raw = torch.empty(n, dtype=torch.uint8, device=self._device)
        _recv(self._pg, raw, src, _HEADER_TAG, timeout, "the description of the state dict")
        header = load_plain_pickle(raw.cpu().numpy().tobytes(), f"the state dict rank {src} describes")
        if not isinstance(header, dict) or not {"step", "treespec", "leaves"} <= set(header):
            raise CorruptCheckpointError(f"rank {src} sent a state-dict description without step, treespec, leaves")
        return header


class _Receiver:
    """Receives the tensors one ``recv_checkpoint`` expects, in the order they were sent.

    It knows every chunk the sender will send (from the description), so that a refused
    heal can take the rest off the wire (:meth:`abandon`), and it keeps a host copy of
    each of this rank's own chunks before overwriting it (:attr:`saved`), to put them
    back if the heal fails.
    """

    def __init__(self, transport: ShardpointTransport, src: int, timeout: timedelta, header: dict):
        self.transport, self.src, self.timeout = transport, src, timeout
        self.chunk = _chunk_bytes(header.get("chunk_bytes", transport._chunk), src)
        self.sizes = _chunk_sizes(header["leaves"], self.chunk, src)  # every chunk the sender sends, in order
        self.done = 0  # chunks received so far (each: its bytes and their checksum)
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (own region, a host copy of what it held)
        self.in_place = 0  # bytes received into this rank's own tensors

    def leaf(self, leaf: dict, own: dict) -> Any:
        kind = leaf.get("kind")
        if kind == "value":
            return leaf["value"]
        if kind not in ("tensor", "dtensor"):
            raise CorruptCheckpointError(f"rank {self.src} sent a leaf of unknown kind {kind!r}")
        target = _in_place_target(own, leaf, self.transport._device)
        if target is None:
            local = torch.empty(leaf["shape"], dtype=_dtype(leaf["dtype"]), device=self.transport._device)
        else:
            local = _local(target)
        self._fill(local, leaf, mine=target is not None)
        if kind == "tensor":
            return target if target is not None else local
        return target if target is not None else _dtensor(local, leaf)

    def _fill(self, local: torch.Tensor, leaf: dict, mine: bool) -> None:
        key, nbytes = leaf["key"], int(leaf["nbytes"])
        direct = local.is_contiguous()
        data = _bytes_of(local) if direct else torch.empty(nbytes, dtype=torch.uint8, device=local.device)
        if data.numel() != nbytes:
            raise CorruptCheckpointError(f"{key!r} from rank {self.src}: {nbytes} bytes sent, {data.numel()} here")
        for start in range(0, nbytes, self.chunk):
            piece = data[start : start + self.chunk]
            if mine and direct:
                self._keep(piece)
            digest = torch.zeros(1, dtype=torch.int64, device=piece.device)
            what = f"bytes {start}:{start + piece.numel()} of {key!r}"
            self._recv_chunk(piece, digest, what)
            if _xxh3(piece) != int(digest.item()):
                raise CorruptCheckpointError(
                    f"{what} from rank {self.src} do not match their checksum (XXH3-64): damaged in transit; "
                    "the recovering rank must fetch them again (from another replica, or load a checkpoint)"
                )
        if not direct:
            if mine:
                self._keep(local)
            local.copy_(data.view(local.dtype).view(local.shape))
        if mine:
            self.in_place += nbytes

    def _recv_chunk(self, piece: torch.Tensor, digest: torch.Tensor, what: str) -> None:
        tag = _FIRST_TAG + 2 * self.done
        _recv(self.transport._pg, piece, self.src, tag, self.timeout, what)
        _recv(self.transport._pg, digest, self.src, tag + 1, self.timeout, f"the checksum of {what}")
        self.done += 1

    def _keep(self, region: torch.Tensor) -> None:
        """Keep a host copy of ``region`` (this rank's own bytes) before they are overwritten."""
        self.saved.append((region, region.to("cpu", copy=True)))

    def abandon(self, exc: BaseException) -> None:
        """A failed heal: put this rank's own bytes back, then let the sender finish.

        The sender has posted, or will post, every chunk of the description; a receiver
        that stopped would leave it blocked until its timeout. Unless the sender is what
        failed (it stopped or died: nothing more will come) or the caller is being
        interrupted, the remaining chunks are received into one scratch buffer and dropped.
        """
        for region, copy in reversed(self.saved):  # in reverse: views of one storage end as they began
            region.copy_(copy)
        self.saved.clear()
        if not isinstance(exc, Exception) or isinstance(exc, CheckpointTimeoutError) or self.done >= len(self.sizes):
            return
        rest = self.sizes[self.done :]
        scratch = torch.empty(max(rest), dtype=torch.uint8, device=self.transport._device)
        digest = torch.zeros(1, dtype=torch.int64, device=self.transport._device)
        try:
            for size in rest:
                self._recv_chunk(scratch[:size], digest, "a chunk dropped after a refused heal")
        except CheckpointTimeoutError as stopped:
            log.warning("dropping the rest of rank %d's state after a refused heal: %s", self.src, stopped)


def _chunk_bytes(value: Any, src: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 40:
        raise CorruptCheckpointError(f"rank {src} announced a chunk size of {value!r} bytes")
    return value


def _chunk_sizes(leaves: Any, chunk: int, src: int) -> list[int]:
    """The size of every chunk the sender sends for ``leaves``, in order."""
    sizes: list[int] = []
    for leaf in leaves if isinstance(leaves, list) else ():
        if isinstance(leaf, dict) and leaf.get("kind") in ("tensor", "dtensor"):
            nbytes = leaf.get("nbytes")
            if not isinstance(nbytes, int) or nbytes < 0:
                raise CorruptCheckpointError(f"rank {src} announced {nbytes!r} bytes for {leaf.get('key')!r}")
            sizes += [min(chunk, nbytes - start) for start in range(0, nbytes, chunk)]
    return sizes


def _recv(pg: Any, tensor: torch.Tensor, src: int, tag: int, timeout: timedelta, what: str) -> None:
    try:
        pg.recv([tensor], src, tag=tag).wait(timeout)
    except Exception as exc:  # noqa: BLE001 - named and re-raised
        raise CheckpointTimeoutError(
            f"receiving {what} from rank {src} timed out or failed after {timeout.total_seconds():g} s "
            f"(the sender stopped, or died): {exc}",
            missing=[src],
            round="torchft checkpoint transfer",
        ) from None


# ---------------------------------------------------------------------- with a Checkpointer
def resume(manager: Any, checkpointer: Any, state: Any) -> Any:
    """Load this replica group's newest checkpoint, then tell torchft's Manager the step it is at.

    The Checkpointer chooses as always: its local tier when that holds the newest
    complete checkpoint, else the persistent store (at any layout). The Manager then
    compares the step with the other replica groups' at its first quorum: a group that
    is behind a healthy one heals from it over the transport, so a replacement takes the
    healthy groups' current state, and a job whose groups all restarted resumes from
    the checkpoint. Call it before the first step; :func:`recovered_from` says after the
    first step which it was. Returns the ``LoadResult`` (None on a fresh start).
    ``TrainState.extra["batches_committed"]`` (saved by the caller) is restored too.
    """
    result = checkpointer.load(state)
    if result is not None:
        committed = int(result.extra.get("batches_committed", 0))
        manager.load_state_dict({"step": result.iteration, "batches_committed": committed})
    return result


def recovered_from(result: Any, transport: ShardpointTransport, since: int = 0) -> tuple[str, str]:
    """Where this rank's state came from: ``(tier, source)``.

    ``"replica group"`` when the transport healed it (after ``since`` earlier heals),
    else the load's ``LoadResult.tier`` and ``source`` (``"local"``, ``"peer"``,
    ``"persistent"``), or ``("none", "a fresh start")``.
    """
    heals = transport.received[since:]
    if heals:
        last = heals[-1]
        return "replica group", f"rank {last['from rank']} of a healthy replica group, at step {last['step']}"
    if result is None:
        return "none", "a fresh start"
    return result.tier, result.source


# ---------------------------------------------------------------------- what a leaf says
def _describe(path: Any, value: Any) -> dict:
    key = _keystr(path)
    if not isinstance(value, torch.Tensor):
        return {"kind": "value", "key": key, "value": value}
    local = _local(value)
    leaf = {
        "kind": "tensor",
        "key": key,
        "shape": list(local.shape),
        "dtype": str(local.dtype).removeprefix("torch."),
        "nbytes": local.numel() * local.element_size(),
    }
    if is_dtensor(value):  # its mesh and placements, by name
        mesh = value.device_mesh
        leaf.update(
            kind="dtensor",
            mesh_device=mesh.device_type,
            mesh=mesh.mesh.tolist(),
            mesh_names=list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            placements=[_placement(p) for p in value.placements],
            global_shape=list(value.shape),
            global_stride=list(value.stride()),
        )
    return leaf


def _placement(p: Any) -> list:
    fields = {name: getattr(p, name) for name in ("dim", "split_factor", "reduce_op") if hasattr(p, name)}
    return [type(p).__name__, fields]


def _dtensor(local: torch.Tensor, leaf: dict) -> Any:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, placement_types
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    known = {"Shard", "Replicate", "Partial", "_StridedShard"}
    placements = []
    for name, fields in leaf["placements"]:
        if name not in known:
            raise CorruptCheckpointError(f"{leaf['key']!r}: unknown DTensor placement {name!r}")
        placements.append(getattr(placement_types, name)(**fields))
    names = tuple(leaf["mesh_names"]) if leaf["mesh_names"] else None
    try:  # the same mesh, without creating its process groups (a collective this rank may not share)
        mesh = DeviceMesh(leaf["mesh_device"], torch.tensor(leaf["mesh"]), mesh_dim_names=names, _init_backend=False)
    except TypeError:  # a torch without the option
        mesh = DeviceMesh(leaf["mesh_device"], torch.tensor(leaf["mesh"]), mesh_dim_names=names)
    meta = TensorMeta(torch.Size(leaf["global_shape"]), tuple(leaf["global_stride"]), local.dtype)
    # the spec as sent, as torchft's PGTransport rebuilds it: from_local would re-derive the local shape
    # from this rank's place in the mesh, which a recovering rank of another replica group may not be in
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def _in_place_target(own: dict, leaf: dict, device: torch.device) -> torch.Tensor | None:
    """The recovering rank's own tensor for this key, when it can take the bytes as they are."""
    for key in _own_keys(leaf["key"]):
        value = own.get(key)
        if value is None:
            continue
        local = _local(value)
        same = (
            list(local.shape) == leaf["shape"]
            and str(local.dtype).removeprefix("torch.") == leaf["dtype"]
            and local.device.type == device.type
            and (leaf["kind"] == "dtensor") == (local is not value)
        )
        if same:
            return value
        log.warning("%s: the recovering rank's tensor differs from the one sent; a new one is received", leaf["key"])
        return None
    return None


_TORCHFT_USER = "['user']['default']"


def _own_keys(sent: str) -> list[str]:
    """Where this rank keeps the tensor sent under ``sent``: as sent, else in torchft 0.1's layout.

    torchft 0.2's Manager sends the state dict given to it under ``["user"]["default"]``;
    torchft 0.1 sent it under ``["user"]``, the form the README's ``state_dict=`` shows.
    """
    if sent.startswith(_TORCHFT_USER):
        return [sent, "['user']" + sent[len(_TORCHFT_USER) :]]
    return [sent]


def _local(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if hasattr(value, "_local_tensor") else value


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's bytes (no copy)."""
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)


def _xxh3(data: torch.Tensor) -> int:
    host = data if data.device.type == "cpu" else data.cpu()
    value = xxhash.xxh3_64_intdigest(host.numpy().data)
    return value - (1 << 64) if value >= 1 << 63 else value  # as an int64 tensor holds it


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in a state-dict description")
    return dtype


def _keystr(path: Any) -> str:
    from torch.utils._pytree import keystr

    return keystr(path)
