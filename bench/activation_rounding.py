"""How much rounding the products' inputs costs the bundled model's answers: greedy chat answers with the inputs of
chosen linear layers rounded (bf16, or int8 under a few group schemes), against the same model in float32.

    .venv/bin/python bench/activation_rounding.py [--new-tokens 48] SCHEME[:layer,layer...][+SCHEME:...] ...

The model is the bundled GGUF dequantized by transformers, in float32; each scheme rounds the
inputs of the named linear layers (default: every attention and MLP projection except down_proj, the layers
`--int8-activations` quantizes; `all`: every projection and the output head) before the product, the weights
untouched. Parts joined by `+` combine, a later part's rounding taking the layers it names (`bf16:all+max32:gate_proj,
up_proj`: bfloat16 inputs everywhere but int8 ones in the MLP's gate and up projections). Per scheme it prints the
mean common prefix of the 32 answers with the float32 ones, how many are identical, the start of the answer to
"What is the capital of France?", and teacher-forced over the float32 answers (32 x new-tokens positions, steadier
than prefixes, which one early flip cuts short): how often the top-1 token agrees with float32's and the mean KL
divergence of the next-token distribution from float32's. Schemes:

    bf16      round to bfloat16 (lmrpc's defaults)
    max32     int8 per group of 32, d = max|x| / 127 (llama.cpp's q8_1; --int8-activations)
    max16     the same per 16 inputs;  max8: per 8
    mse32     per 32, the scale among 0.70-1.00 x max|x| / 127 that minimises the group's squared error
    top2/4/8  max32 with each row's 2/4/8 largest inputs kept exact (an outlier scheme's best case)
    i16       int16 per group of 32, d = max|x| / 32767 (AVX2 hosts' default), by default in every projection
              and the output head (down_proj and lm_head too)

A precision study, not a target: it runs on the CPU in minutes per scheme, without the server.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from lmrpc.server.models.loader import default_gguf

PROMPTS = (
    "What is the capital of France?", "Write a haiku about the sea.", "Explain why the sky is blue.",
    "What is 12 times 7?", "Name three primary colours.", "Who wrote Romeo and Juliet?",
    "Give me a tip for learning Python.", "What does a bee make?", "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?", "Summarise the water cycle in one sentence.",
    "What is the largest planet in the solar system?", "What is the chemical symbol for gold?",
    "How many days are in a leap year?", "Name a famous painting by Leonardo da Vinci.", "What is photosynthesis?",
    "Write one sentence about autumn.", "What is the square root of 81?",
    "Who was the first person to walk on the moon?", "What language is spoken in Brazil?",
    "Give a synonym for happy.", "What is the freezing point of water in Fahrenheit?",
    "Describe a cat in five words.", "What is the tallest mountain on Earth?",
    "List two renewable energy sources.", "What is the main ingredient of guacamole?",
    "How many continents are there?", "What does CPU stand for?", "Name an animal that lives in the ocean.",
    "What is the opposite of cold?", "Who painted the Mona Lisa?", "What is the currency of Japan?",
)
INT8_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
ALL_LAYERS = (*INT8_LAYERS, "down_proj", "lm_head")  # int16 activations: every product of a block weight (AVX2)
LAYER_SETS = {"all": ALL_LAYERS}


def int8_groups(x: torch.Tensor, group: int, fractions: tuple[float, ...] = (1.0,), top: int = 127) -> torch.Tensor:
    """x [..., k] -> x rounded to int8 (or to codes up to `top`) per `group` inputs with d = f * max|x| / top, per
    group the f in `fractions` with the least squared error (codes clamped to +-top)."""
    rows = x.reshape(-1, group)  # [groups, group]
    amax = rows.abs().amax(-1, keepdim=True)
    best, best_err = rows, torch.full_like(amax, float("inf"))
    for f in fractions:
        d = amax * f / top
        q = torch.where(d > 0, torch.clamp(torch.round(rows / torch.where(d > 0, d, 1)), -top, top) * d, 0)
        err = (q - rows).pow(2).sum(-1, keepdim=True)
        best, best_err = torch.where(err < best_err, q, best), torch.minimum(err, best_err)
    return best.reshape(x.shape)


def keep_largest(x: torch.Tensor, count: int) -> torch.Tensor:
    """max32 with each row's `count` largest |x| kept exact (left out of their group's scale)."""
    rows = x.reshape(-1, x.shape[-1])  # [rows, k]
    keep = torch.zeros_like(rows, dtype=torch.bool).scatter_(-1, rows.abs().topk(count, -1).indices, True)
    return torch.where(keep, rows, int8_groups(torch.where(keep, 0, rows), 32)).reshape(x.shape)


SCHEMES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bf16": lambda x: x.bfloat16().float(),
    "max32": lambda x: int8_groups(x, 32),
    "max16": lambda x: int8_groups(x, 16),
    "max8": lambda x: int8_groups(x, 8),
    "mse32": lambda x: int8_groups(x, 32, (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)),
    "top2": lambda x: keep_largest(x, 2),
    "top4": lambda x: keep_largest(x, 4),
    "top8": lambda x: keep_largest(x, 8),
    "i16": lambda x: int8_groups(x, 32, top=32767),  # int16 per 32 (AVX2's default): every product of ALL_LAYERS
}
DEFAULT_LAYERS = {"i16": ALL_LAYERS}  # else INT8_LAYERS


def prompt_ids(tok: PreTrainedTokenizerBase) -> list[torch.Tensor]:
    """PROMPTS in the chat template, each [1, T] token ids."""
    out = []
    for prompt in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        out.append(torch.tensor([tok.encode(text, add_special_tokens=False)]))
    return out


def answers(model: Any, prompts: list[torch.Tensor], new_tokens: int) -> list[list[int]]:
    """Greedy answers (token ids) to the prompts. model: a transformers causal LM (Any: its stubs type generate as a
    Tensor attribute)."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def next_token_logprobs(model: Any, prompts: list[torch.Tensor], reference: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, log-probabilities [new_tokens, vocab] of the token at each answer position, teacher-forced on the
    reference answer (the inputs are prompt + reference, whatever this model would have answered)."""
    out = []
    for ids, ref in zip(prompts, reference, strict=True):
        full = torch.cat([ids, torch.tensor([ref])], dim=1)  # [1, T + new]
        with torch.no_grad():
            logits = model(full).logits[0, ids.shape[1] - 1:-1].float()  # [new, vocab]
        out.append(torch.log_softmax(logits, dim=-1))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def layer_roundings(spec: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """SCHEME[:layers][+SCHEME[:layers]...] -> the rounding of each named layer (later parts win)."""
    chosen: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for part in spec.split("+"):
        name, _, layers = part.partition(":")
        names = [n for layer in layers.split(",") for n in LAYER_SETS.get(layer, (layer,))] if layers else list(
            DEFAULT_LAYERS.get(name, INT8_LAYERS))
        for layer in names:
            chosen[layer] = SCHEMES[name]
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("schemes", nargs="+", help="SCHEME or SCHEME:layer,layer (e.g. max32:o_proj), parts joined "
                        "by + (e.g. bf16:all+max32:gate_proj,up_proj)")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    for spec in args.schemes:
        for part in spec.split("+"):
            if part.partition(":")[0] not in SCHEMES:
                parser.error(f"unknown scheme {part!r} in {spec!r}: one of {', '.join(SCHEMES)}")
    gguf = default_gguf()  # dequantized by transformers: the dense model the int4 quality test compares with
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    prompts = prompt_ids(tok)
    reference = answers(model, prompts, args.new_tokens)
    reference_logprobs = next_token_logprobs(model, prompts, reference)
    print(f"float32: France {tok.decode(reference[0][:10])!r}", flush=True)
    for spec in args.schemes:
        rounding = layer_roundings(spec)
        hooks = [module.register_forward_pre_hook(lambda _m, inputs, r=rounding[leaf]: (r(inputs[0]),))
                 for path, module in model.named_modules() if (leaf := path.rsplit(".", 1)[-1]) in rounding]
        got = answers(model, prompts, args.new_tokens)
        logprobs = next_token_logprobs(model, prompts, reference)
        for hook in hooks:
            hook.remove()
        prefixes = [common_prefix(a, b) for a, b in zip(reference, got, strict=True)]
        positions = sum(lp.shape[0] for lp in logprobs)
        agree = sum(int((lp.argmax(-1) == ref.argmax(-1)).sum()) for lp, ref in zip(logprobs, reference_logprobs,
                                                                                    strict=True))
        kl = sum(float((ref.exp() * (ref - lp)).sum()) for lp, ref in zip(logprobs, reference_logprobs,
                                                                          strict=True)) / positions
        print(f"{spec:40s} mean common prefix {sum(prefixes) / len(prefixes):5.1f} / {args.new_tokens}, "
              f"identical {sum(p == args.new_tokens for p in prefixes):2d}/{len(PROMPTS)}, "
              f"top-1 teacher-forced {agree}/{positions}, KL {kl:.2e}, "
              f"France {tok.decode(got[0][:10])!r}", flush=True)
    print(f"`bench/activation_rounding.py --new-tokens {args.new_tokens} {' '.join(args.schemes)}`")


if __name__ == "__main__":
    main()
