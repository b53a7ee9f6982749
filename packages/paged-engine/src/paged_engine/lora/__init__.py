"""Multi-LoRA serving: many fine-tuned adapters on one base model, in one batch.

request.py   LoRARequest: which adapter a request runs with (vLLM's names)
adapter.py   reading a PEFT adapter directory into per-module (A, B, scale)
layers.py    LoRAWeights: an adapter slot table on one linear layer, and the per-step
             token -> slot mapping (LoRAMapping) every such layer reads
model.py     LoRAModel: attaches LoRAWeights to a model and packs adapters into its slots
manager.py   the worker's side: a host cache of packed adapters, slot assignment per row
loader.py    AdapterLoader: adapters read and packed on a thread of their own, ahead of install
registry.py  the engine's side: validation, the adapters requests pin, eviction
"""

from paged_engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
