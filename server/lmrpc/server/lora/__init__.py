"""LoRA adapters: many fine-tunes served from one base model, mixed in one batch.

`adapter` reads a PEFT adapter directory and checks it against the model; `products` turns it into per-layer
low-rank products on the model's fused projections and applies them to the rows of a batch grouped by adapter;
`registry` holds the loaded adapters (names, `--lora-root`, LRU eviction, pins of adapters in use).
"""
