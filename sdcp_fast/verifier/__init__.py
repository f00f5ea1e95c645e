"""The verifier role: the sole commit authority.

    VerifierService(VerifierConfig(uri, routers=frozenset({router_uri}), router_uri=...),
                    backend, store, commit_log, client=Client(tls, protocol))
    await service.start(); serve it with sdcp_fast.transport.serve(service, ...)

service.py (resources) over engine.py (batching loop) and verify_step.py (kernel calls),
sharing sessions.py (one record per served session) and target.py (the model behind its
lock); metrics.py counts what happens.
"""

from .engine import Engine, EngineConfig, RoundResult
from .metrics import Metrics
from .service import VerifierConfig, VerifierService
from .sessions import ServedSession, ServedSessions

__all__ = ["Engine", "EngineConfig", "Metrics", "RoundResult", "ServedSession", "ServedSessions",
           "VerifierConfig", "VerifierService"]
