"""The wire protocols of both planes: framing, codec, the node ops, the coordinator ops."""
