"""transformers engines on any device: the DynamicCache <-> blocks adapter
(``adapter.py``), disaggregated prefill and decode workers (``workers.py``) and the
models the tests and demos load (``models.py``)."""
