"""How the replicator (:mod:`ckpt.root.replicate`) copies, as one object: :class:`ReplicaOptions`,
made from a manager's :class:`~ckpt.options.SaveOptions` by :meth:`ReplicaOptions.of`."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import SaveOptions


@dataclass(frozen=True)
class ReplicaOptions:
    """How the replicator copies: the retention applied on each mount after a commit (``keep``,
    ``keep_every``: the primary's policy; ``keep=None``: none), ``read_back`` (every blob read back
    and verified), the ``backlog`` of waiting steps per mount (at least 1) and the backoff of a failed
    copy (``retry_initial`` doubling up to ``retry_max`` seconds)."""

    keep: int | None = None
    keep_every: int | None = None
    read_back: bool = False
    backlog: int = 16
    retry_initial: float = 1.0
    retry_max: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "backlog", max(1, self.backlog))

    @classmethod
    def of(cls, options: SaveOptions) -> "ReplicaOptions":
        """The replica settings of a manager's :class:`~ckpt.options.SaveOptions`."""
        return cls(keep=options.keep, keep_every=options.keep_every, read_back=options.replica_read_back,
                   backlog=options.replica_backlog, retry_initial=options.replica_retry_initial,
                   retry_max=options.replica_retry_max)
