"""Engines and serving on top of the store, the ``[engine]`` extra: transformers
(``hf/``), vLLM (``vllm/``), live serving (``serving/``), capacity planning
(``planning/``) and the demo (``demo/``); ``blockstore.py`` is what they share."""
