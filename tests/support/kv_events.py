"""vLLM's own KV event publisher on loopback ports, for the router's tests."""

from __future__ import annotations

from typing import Any

from pegaflow.tools.devcluster import free_port


def event_publisher(replay: bool = True) -> tuple[Any, int, int]:
    """vLLM's ``ZmqEventPublisher`` bound to two free loopback ports (its PUB socket and,
    with ``replay``, its replay socket): ``(publisher, port, replay_port)``.  Ports are
    picked again when the two picks coincide or another process took one meanwhile."""
    import zmq
    from vllm.distributed import kv_events as kv

    for _ in range(20):
        port, replay_port = free_port(), free_port()
        if port == replay_port:
            continue
        try:
            pub = kv.ZmqEventPublisher(
                0, endpoint=f"tcp://*:{port}",
                replay_endpoint=f"tcp://*:{replay_port}" if replay else None,
            )  # fmt: skip
        except zmq.ZMQError:
            continue
        return pub, port, replay_port
    raise RuntimeError("no two free loopback ports for a KV event publisher")
