"""What the teacher-forcing quality tests share (int4 and GGUF K-quants against their dense models): the chat
prompts, how far each is continued, and how a prompt is rendered with the model's chat template."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "def fibonacci(n):",
    "List three primary colours and one fact about each.",
)
CONTINUATION = 64  # tokens the dense model continues each prompt by: the positions scored


def chat(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """One user message rendered with the chat template (its special tokens spelled out: none added)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return list(tokenizer.encode(str(rendered), add_special_tokens=False))
