"""Generated gRPC / protobuf code for proto/kvstore/v1/store.proto (do not edit).

Regenerate with ``make proto``; tests/unit/test_proto_fresh.py fails when these files are
stale. Import as ``from kvstore._proto import store_pb2, store_pb2_grpc``.
"""
