"""Generated gRPC/protobuf modules for the pdserve control plane (see pdserve.proto)."""
