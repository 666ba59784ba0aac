"""``kvstore demo``: the command (``cli.py``), run in one process (``inproc.py``) or
against a live router and workers (``live.py``)."""
