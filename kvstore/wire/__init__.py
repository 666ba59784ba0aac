"""What crosses a process boundary: data-socket frames, protobuf codecs, the gRPC error
mapping, bearer credentials, locality and bounded polling. Both ends import it."""
