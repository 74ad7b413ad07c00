"""How bytes move: the control protocol client and server, UCX on asyncio, GIL-aware I/O."""
