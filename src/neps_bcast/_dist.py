"""torch.distributed's store classes under names mypy can see.

``torch.distributed`` re-exports them only when distributed support is compiled in,
so type checkers do not find them there; the stubs of the C module have them.
"""

from __future__ import annotations

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

__all__ = ["PrefixStore", "Store", "TCPStore"]
