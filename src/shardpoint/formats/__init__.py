"""Layer 4, formats: how a flattened train state becomes files. See :mod:`.base`.

``dist`` (DCP shard files, reshardable) and ``torch`` (one ``torch.save`` file per
model-parallel rank, Megatron's legacy format) implement one interface.

May import: errors, parallel, storage, catalog, state.
"""

from shardpoint.formats.base import CheckpointFormat, FormatContext, Loaded
from shardpoint.formats.dist import DistFormat
from shardpoint.formats.torch_format import TorchFormat

__all__ = ["FORMATS", "CheckpointFormat", "DistFormat", "FormatContext", "Loaded", "TorchFormat", "get_format"]

FORMATS: dict[str, CheckpointFormat] = {"dist": DistFormat(), "torch": TorchFormat()}


def get_format(name: str) -> CheckpointFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {name!r}") from None
