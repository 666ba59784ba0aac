"""The same-host contract both processes map: the DRAM segment (segment.py) and the
index of its blocks that the server publishes for lock-free reads (index.py)."""
