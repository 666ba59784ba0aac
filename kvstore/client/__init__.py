"""The SDK: StoreClient / AsyncStoreClient (api.py), the single-node client (store.py),
the cluster client (cluster.py, members.py), the admin client and drain (admin.py,
drain.py), and the client ends of the transports (transport/)."""

from kvstore.client.api import AsyncStoreClient, StoreClient

__all__ = ["AsyncStoreClient", "StoreClient"]
