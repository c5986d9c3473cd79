"""Generated protobuf and gRPC modules of the lmrpc.v1 contract (see proto/lmrpc/v1/)."""
