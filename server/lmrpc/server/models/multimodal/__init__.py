"""Vision- and audio-language models: our language model with transformers' encoders (base.py), one module per
family (llava.py, qwen2_audio.py), registered by HF architecture name in models.REGISTRY, and the
MultimodalProcessor they give the service (processor.py)."""
