"""PEFT LoRA adapters made at test time on a base checkpoint (random non-zero A and B), and the reference: the base
model with the adapter merged by peft."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: Path, out: Path, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                 targets: tuple[str, ...] = ALL_MODULES, rslora: bool = False, std: float = 0.05) -> Path:
    """Save a PEFT adapter of `base` in `out` with every lora_A and lora_B drawn at random (non-zero), so each
    targeted module's delta shows in the outputs."""
    return make_adapter_for(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out, rank=rank,
                            alpha=alpha, seed=seed, targets=targets, rslora=rslora, std=std)


def make_adapter_for(model: PreTrainedModel, out: Path, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                     targets: tuple[str, ...] = ALL_MODULES, rslora: bool = False, std: float = 0.05) -> Path:
    """make_adapter on a model already loaded (it is wrapped by peft in place: load a fresh one for reference)."""
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    peft_model.save_pretrained(out)
    return out


def merged_model(base: Path, adapter: Path | None) -> PreTrainedModel:
    """The base model in float32 with `adapter` merged into its weights by peft (None: the base model)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is None:
        return model
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
