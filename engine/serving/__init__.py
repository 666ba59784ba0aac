"""Live disaggregated serving: an OpenAI-compatible router in front of real workers.

A request's route: client -> router (``router.py``: tokenize, prefix keys, directory
mirror, cost model, placement) -> prefill worker (``worker.py`` / ``runtime.py``:
reuse and extend the store's prefix) -> KV through the store -> decode worker ->
tokens streamed back through the router. Workers announce themselves in etcd
(engine/registry.py); the router watches them. Short prompts skip the prefill pool.
"""
