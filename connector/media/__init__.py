"""Storage media of the worker: the ways KV blocks move between vLLM's cache and storage
(:mod:`.base` states the contract; :mod:`.remote` over UCX, :mod:`.poolfile` through this
host's pool file), and the block copies they share (:mod:`.kvio`, :mod:`.tilecopy`)."""
