"""LoRA adapters (PEFT's format) served beside the base model, several in one batch: `LoRARequest` names one per
request; `pagedllm.lora.adapter` loads them onto the model's fused layers and adds their updates per step."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
