"""`kvstore serve`: the gRPC control service, the data socket server, the gateway both
share, tenants' tokens, shared-memory leases, maintenance and cluster membership."""
