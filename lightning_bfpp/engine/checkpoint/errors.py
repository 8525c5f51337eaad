"""The one error a checkpoint raises, and how every rank comes to raise it together.

Every step that can fail on some ranks only (rank 0 writing ``meta.pt``, a file that one rank cannot read)
shares its outcome with the other ranks before anyone goes on, so all ranks raise the same
:class:`CheckpointError` instead of some waiting forever in the next collective; DCP's own failures, raised
on every rank with every rank's traceback, become one line of it.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

from lightning_bfpp.engine import agreement
from lightning_bfpp.engine.agreement import AgreedError, describe


class CheckpointError(AgreedError):
    """A checkpoint cannot be written or read; raised on every rank at the same point, with the same message
    (an agreed error: the failure watchdog does not treat it as one rank's crash)."""


def raise_on_every_rank(error: BaseException | None, context: str) -> None:
    """A collective: if any rank passes an error, every rank raises one :class:`CheckpointError` naming that
    rank (:func:`lightning_bfpp.engine.agreement.raise_on_every_rank`)."""
    agreement.raise_on_every_rank(error, context, CheckpointError)


def _dcp_failures(failure: CheckpointException) -> str:
    """DCP's failure as one line: the first failing rank, the others named, and its error (not the tracebacks
    DCP's own message holds)."""
    failures = sorted(failure.failures.items())
    if not failures:
        return describe(failure)
    (rank, (error, _)), others = failures[0], [r for r, _ in failures[1:]]
    also = f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    return f"rank {rank} failed{also}: {describe(error)}"


def _load_failure(failure: CheckpointException, path: Path) -> CheckpointError:
    """DCP's failure to read ``path`` as one :class:`CheckpointError`: a refused entry's own message, as it is."""
    refused = [error for error, _ in failure.failures.values() if isinstance(error, CheckpointError)]
    if refused:
        return CheckpointError(str(refused[0]))
    return CheckpointError(f"BFPPStrategy could not load the checkpoint {path}: {_dcp_failures(failure)}")
