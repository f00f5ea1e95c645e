"""The router role: places sessions on verifiers and drafters, handles events and failures,
and serves clients through its front door.

    RouterService(RouterConfig(uri, verifiers=(...), drafters=((uri, model_digest), ...)),
                  target_backend, store, commit_log, client=Client(tls, protocol),
                  table=await cache.open_table(spec))   # the session table, shared by routers
    await service.start(); serve it with sdcp_fast.transport.serve(service, ...)
    serve_web(FrontDoor(service, openai=OpenAIRoutes(service, "model-name")), host=..., port=...)
"""

from .frontdoor import FrontDoor
from .openai_api import OpenAIRoutes
from .peers import Peers, Refused
from .registry import Registry
from .service import ContractDefaults, RouterConfig, RouterService
from .sessions import RouterSession

__all__ = ["ContractDefaults", "FrontDoor", "OpenAIRoutes", "Peers", "Refused", "Registry", "RouterConfig",
           "RouterService", "RouterSession"]
