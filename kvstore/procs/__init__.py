"""Processes on this host: spawning children under a parent-death guard, and a local
cluster of etcd plus store nodes. Shared by the console script and the engine's launchers,
so neither has to import the other."""
