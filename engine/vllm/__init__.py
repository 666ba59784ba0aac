"""kvstore as vLLM's KV connector, split by role as vLLM's offloading connector is.

``connector.py`` is the class vLLM loads (``kv_connector_module_path="engine.vllm.connector"``),
a facade over ``scheduler_side.py`` (what each step loads and saves) and
``worker_side.py`` (moving the bytes: ``loads.py``, ``saves.py``, ``paged.py``,
``cpus.py``). ``store.py`` holds its settings and client. Only the connector and its
two sides import vLLM; the rest runs in the project's main environment.
"""
