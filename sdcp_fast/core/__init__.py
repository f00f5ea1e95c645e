"""Sans-IO SDCP core: no sockets, no asyncio, no torch."""
