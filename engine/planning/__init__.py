"""Capacity planning: the cache-aware cost model (``scheduler.py``), Mooncake trace
loading and replay (``trace.py``, ``sim.py``), ``kvstore plan`` (``plan.py``) and its
plots (``plot.py``)."""
