"""The prefill/decode handoff: what a producer returns in vLLM's ``kv_transfer_params``.

A ``kv_producer`` engine returns, from ``request_finished``, the parameters a
``kv_consumer`` engine needs to find exactly that request's stored blocks; vLLM puts
them in the request's output (the OpenAI server's ``kv_transfer_params`` field of a
completion), a P/D proxy passes them unchanged as ``kv_transfer_params`` of the decode
request, and vLLM hands them to the consumer's connector as
``request.kv_transfer_params``.  The wire form (JSON, version 1)::

    {"pegaflow": {"v": 1, "namespace": "<cache namespace>", "blocks": <n>,
                  "last_hash": "<hex of block n-1's hash>", "node": "<node id or ''>",
                  "expires_ms": <unix time in ms>}}

``blocks`` are the request's leading full prompt blocks the producer saved (or found
stored); ``last_hash`` is the hash of the last of them, which the consumer's own hash
of that block must equal (its hashes chain over every earlier token, so it proves the
prompts agree up to there); ``node`` is the producer's local node (informational);
past ``expires_ms`` a consumer no longer waits for the blocks.  Other keys of
``kv_transfer_params`` (another connector's, in a ``MultiConnector``) are left alone.

Pure module: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pegaflow.errors import BadRequest
from pegaflow.protocol.codec import (
    MAX_HASH_BYTES,
    MAX_LIST,
    check_hash,
    check_namespace,
    req_int,
    req_str,
)

KEY = "pegaflow"
"""the key of :data:`kv_transfer_params` that holds PegaFlow's handoff"""
VERSION = 1
"""the handoff format's version (``"v"``); a consumer rejects any other"""
MAX_BLOCKS = MAX_LIST
"""most blocks one handoff may name (one lookup's limit)"""
MAX_NODE_LEN = 256
"""longest node id in a handoff"""
POLL_S = 0.02
"""while a consumer waits for blocks still being committed, the pause between lookups"""


@dataclass(frozen=True)
class Handoff:
    """One request's stored prompt blocks, as a producer hands them to a consumer.

    Attributes:
        namespace: the producer's cache namespace (a consumer must have the same).
        blocks: how many leading full blocks of the prompt were saved.
        last_hash: the hash of block ``blocks - 1``.
        node: the producer's local node ('' when none was known).
        expires_ms: unix time (ms) after which a consumer does not wait for the blocks.
    """

    namespace: str
    blocks: int
    last_hash: bytes
    node: str
    expires_ms: int

    def to_params(self) -> dict[str, Any]:
        """The handoff as vLLM's ``kv_transfer_params`` (JSON-ready)."""
        return {
            KEY: {
                "v": VERSION,
                "namespace": self.namespace,
                "blocks": self.blocks,
                "last_hash": self.last_hash.hex(),
                "node": self.node,
                "expires_ms": self.expires_ms,
            }
        }

    def expired(self, now_ms: int) -> bool:
        """Whether the handoff is past its expiry at unix time ``now_ms``."""
        return now_ms >= self.expires_ms

    @classmethod
    def from_params(cls, params: Any) -> Handoff | None:
        """The handoff in a request's ``kv_transfer_params``.

        Returns None when there is none (no params, or no :data:`KEY` in them).

        Raises:
            BadRequest: the :data:`KEY` entry is malformed (wrong version, a field
                missing, mistyped or out of bounds).
            TooLarge: a string field is over its bound.
        """
        if not isinstance(params, Mapping) or params.get(KEY) is None:
            return None
        msg = params[KEY]
        if not isinstance(msg, Mapping):
            raise BadRequest(f"kv_transfer_params[{KEY!r}] must be a map")
        msg = dict(msg)
        if msg.get("v") != VERSION:
            raise BadRequest(f"handoff version {msg.get('v')!r} is not {VERSION}")
        hex_hash = req_str(msg, "last_hash", 2 * MAX_HASH_BYTES)
        try:
            last_hash = bytes.fromhex(hex_hash)
        except ValueError:
            raise BadRequest("field 'last_hash' must be hex") from None
        return cls(
            namespace=check_namespace(msg.get("namespace")),
            blocks=req_int(msg, "blocks", 1, MAX_BLOCKS),
            last_hash=check_hash(last_hash),
            node=req_str(msg, "node", MAX_NODE_LEN),
            expires_ms=req_int(msg, "expires_ms", 0),
        )
