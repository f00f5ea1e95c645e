"""The verifier role: the sole commit authority (service.py over engine.py)."""

from .engine import Engine, EngineConfig
from .metrics import Metrics, serve_metrics
from .service import (
           VerifierConfig,
           VerifierService,
           decode_session_id,
           encode_session_id,
           token_list_bytes,
)

__all__ = ["Engine", "EngineConfig", "Metrics", "VerifierConfig", "VerifierService", "decode_session_id",
           "encode_session_id", "serve_metrics", "token_list_bytes"]
