"""Entry points for the frameworks people already train with.

Each submodule imports its framework, so ``import shardpoint`` never needs one and
this package imports none of them:

* :mod:`shardpoint.integrations.transformers`: ``ShardpointTrainer``, the Hugging Face
  ``Trainer`` with shardpoint checkpoints;
* :mod:`shardpoint.integrations.accelerate`: ``save_state`` / ``load_state`` for an
  ``accelerate.Accelerator``;
* :mod:`shardpoint.integrations.lightning` and :mod:`shardpoint.integrations.torchtitan`.

A submodule whose framework is not installed raises
:class:`~shardpoint.errors.FrameworkMissingError` naming the extra that installs it
(:func:`missing_framework`).

This layer sits above the public API and may use any lower layer; nothing below imports it.
"""

from shardpoint.errors import FrameworkMissingError

__all__ = ["missing_framework"]


def missing_framework(exc: ModuleNotFoundError, integration: str, extra: str) -> FrameworkMissingError:
    """The error to raise when ``integration``'s framework is not installed: it names the extra to install."""
    package = (exc.name or extra).split(".")[0]
    return FrameworkMissingError(
        f"shardpoint.integrations.{integration} needs {package}, which is not installed: "
        f"pip install 'shardpoint[{extra}]'",
        name=package,
    )
