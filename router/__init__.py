"""``pegaflow-router``: an OpenAI-compatible HTTP proxy in front of vLLM replicas.

Modes (``[router] mode``): ``rr`` round robin; ``cache`` sends each request to a replica
on the host whose storage node holds the longest stored prefix of its prompt (the
coordinator's index, block hashes computed as the engines compute them); ``pd`` runs the
prefill on a prefill replica and streams the answer of a decode replica given the
producer's ``kv_transfer_params``.  See docs/router.md.
"""

from .policy import Picker, Replica, parse_replica, parse_replicas
from .server import Router

__all__ = ["Picker", "Replica", "Router", "parse_replica", "parse_replicas"]
