"""Fixtures of the transport tests; the helpers live in transport_support.py."""

from transport_support import pki, transport_logs  # noqa: F401  (pytest fixtures)
