"""torchrun's ``etcd-v3`` rendezvous: runs inside torchrun agents and imports torch.

* :mod:`service.rendezvous.handler`: the handler torchrun asks for (torch's dynamic rendezvous,
  its state in one etcd key fenced by ``mod_revision``);
* :mod:`service.rendezvous.store`: the c10d store the agents share, also in etcd;
* :mod:`service.rendezvous.kv`: the few etcd operations both need (compare-and-set under one
  lease per process);
* :mod:`service.rendezvous.config`: the pure, torch-free settings (``--rdzv-endpoint``,
  ``--rdzv-conf``), the only part the control plane imports (its launcher passes the same
  values on every torchrun command line it builds).

Importing this package imports no torch: :func:`create_handler`, the ``torchrun.handlers``
entry point (``etcd-v3 = "service.rendezvous:create_handler"``), returns a function that loads
the handler module only when torchrun builds a handler. (torch calls the entry point while it
imports its own rendezvous package; importing the handler there would be circular whenever the
handler module was imported first.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def create_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it with no arguments and registers
    what it returns, a function from ``RendezvousParameters`` to a handler."""
    return _create_rdzv_handler


def _create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    from service.rendezvous.handler import create_rdzv_handler

    return create_rdzv_handler(params)
