"""The client ends of the data plane: one data socket (conn.py), the pool that picks a
transport per connection (pool.py), and the transports (shm.py, shm_direct.py, tcp.py)."""
