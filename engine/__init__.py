"""Engines and serving on top of the store, the ``[engine]`` extra: transformers
(``hf/``), vLLM (``vllm/``), live serving (``serving/``), capacity planning
(``planning/``) and the demo (``demo/``); ``blockstore.py`` (the store they reach) and
``registry.py`` (serving processes in etcd: ``kvstore worker`` and ``vllm serve`` with
the connector) are what they share."""
