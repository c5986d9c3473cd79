"""lmrpc.v1.GenerateService: SGLang's native /generate over gRPC (service.py), with its model and adapter RPCs."""
