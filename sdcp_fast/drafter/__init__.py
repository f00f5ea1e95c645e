"""The drafter role: takes assignments, drafts batched across its sessions, proposes.

    DrafterService(DrafterConfig(uri, routers=frozenset({router_uri}), router_uri=...),
                   backend, store, client=Client(tls, protocol))
    await service.start(); serve it with sdcp_fast.transport.serve(service, ...)
"""

from .drafting import DraftBatcher, DraftRequest, pick, sample_from
from .service import DrafterConfig, DrafterService, rounds_from_file
from .session import DraftSession

__all__ = ["DraftBatcher", "DraftRequest", "DraftSession", "DrafterConfig", "DrafterService", "pick",
           "rounds_from_file", "sample_from"]
