"""Counters, latency histograms and metric names (counters.py, names.py), and their
Prometheus exporter (prometheus.py): injected into the node and server, never global."""
