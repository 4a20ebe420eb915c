"""A rank whose files are not on its node takes them from the peer that holds a replica.

After :func:`shardpoint.tier.choose.choose`, every rank knows every rank's source.
Each ``"peer"`` source becomes one :class:`~shardpoint.tier.replicate.Transfer` from
the serving rank to the owner, over the control group; the owner writes what it
receives into a temporary directory of its own ``local_dir``, hashing it on the way,
and publishes it as its node's copy once the digest equals the record of the copy
it was sent from. A replacement node therefore holds its ranks' newest local
checkpoint again after its first load, before the next local save.

Collective: every rank calls :func:`fetch` with the same choice, also ranks that
neither send nor receive (they only join the outcome's agreement).
"""

from __future__ import annotations

import logging
import shutil

from shardpoint.errors import CorruptCheckpointError
from shardpoint.parallel import comm
from shardpoint.storage.base import LocalStorage
from shardpoint.tier.choose import PEER, Choice, marker_of
from shardpoint.tier.marker import mark_copy, publish_copy, tmp_copy_dir
from shardpoint.tier.replicate import Transfer, exchange

__all__ = ["fetch"]

log = logging.getLogger(__name__)


def fetch(storage: LocalStorage, root: str, choice: Choice) -> str:
    """Collective: this rank's copy directory to load from, fetched from its peer when needed.

    Every file the copy's marker lists is fetched (``state.pt``, ``frozen.pt``, ...):
    the copy published here must be whole, as the one it was sent from.

    Raises:
        CorruptCheckpointError: on every rank, when a received file differs from its
            record or could not be stored (the caller then uses the persistent store).
    """
    me = comm.rank()
    transfers = [
        Transfer(owner, s.server, owner, name, record.size)
        for owner, s in sorted(choice.sources.items())
        if s.tier == PEER
        for name, record in sorted(s.offer.files.items())
    ]
    mine = choice.sources[me]
    fetching = mine.tier == PEER
    tmp = tmp_copy_dir(storage, root, choice.iteration, me)  # a name only: created when fetching
    try:
        errors = []
        try:
            if fetching:
                storage.makedirs(tmp)
        except OSError as exc:  # the bytes are then discarded: the sender must still be served
            errors.append(f"cannot create {tmp}: {exc}")
        received, exchange_errors = exchange(
            transfers,
            lambda t: open(storage.join(choice.sources[t.owner].offer.path, t.name), "rb"),  # noqa: SIM115
            lambda t: storage.open_write(storage.join(tmp, t.name)),
            comm.control_group(),
        )
        errors += exchange_errors

        def finish() -> str:
            if not fetching:
                if errors:
                    raise CorruptCheckpointError("; ".join(errors))
                return mine.offer.path
            got = {t.name: record for t, record in received.items()}
            wrong = [
                f"{name}: received {got.get(name)}, the copy's marker records {expected}"
                for name, expected in sorted(mine.offer.files.items())
                if got.get(name) != expected
            ]
            if errors or wrong:
                raise CorruptCheckpointError(
                    f"fetching rank {me}'s local-tier files of iteration {choice.iteration} from rank "
                    f"{mine.server} ({mine.offer.path}) failed: {'; '.join(errors + wrong)}"
                )
            mark_copy(storage, tmp, marker_of(mine.offer))
            return publish_copy(storage, tmp, me)

        path = comm.agree(finish, "fetching local-tier files from peers")
    except BaseException:
        if fetching:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fetching:
        log.info(
            "rank %d: received %s of iteration %d from rank %d into %s",
            me,
            ", ".join(sorted(mine.offer.files)),
            choice.iteration,
            mine.server,
            path,
        )
    return path
