"""SMG's worker service, `sglang.grpc.scheduler.SglangScheduler` (the `smg-grpc-proto` package's contract), over
lmrpc's engine: the gateway (SMG) tokenizes, renders chat templates and detokenizes; this worker takes token ids.

- `requests`: an SMG GenerateRequest -> lmrpc's `EngineRequest`s (through validation.py's shared rules)
- `responses`: `EngineOutput` deltas -> SMG's stream chunks and one `GenerateComplete` per output index
- `tokenizer_dir`: the HF-layout tokenizer directory SMG loads (written once per model), and its zip for GetTokenizer
- `info`: GetModelInfo, GetServerInfo and GetLoads from the engine's own figures
- `kv_events`: the prefix cache's listener: full pages stored/removed, flushes, as numbered batches in a bounded buffer
- `kv_stream`: SubscribeKvEvents: a subscriber's cursor, snapshot, replay, and the load records pushed on the stream
- `service`: the servicer (RPCs, admission, abort, LoRA adapters, KV events, FlushCache)

It imports no other service's module: what it shares with GenerateService and OpenAIService lives in frontend.py
and validation.py.
"""
