"""The router role: places sessions on verifiers and drafters, handles events and failures,
and serves clients through its front door.

    RouterService(RouterConfig(uri, verifiers=(...), drafters=((uri, model_digest), ...)),
                  target_backend, store, commit_log, client=Client(tls, protocol))
    await service.start(); serve it with sdcp_fast.transport.serve(service, ...)
    FrontDoor(service, host=..., port=..., ssl_context=None | frontdoor_ssl_context(tls))
"""

from .frontdoor import FrontDoor, frontdoor_ssl_context
from .registry import Registry
from .service import ContractDefaults, RouterConfig, RouterService, commit_log_name
from .sessions import RouterSession

__all__ = ["ContractDefaults", "FrontDoor", "Registry", "RouterConfig", "RouterService", "RouterSession",
           "commit_log_name", "frontdoor_ssl_context"]
