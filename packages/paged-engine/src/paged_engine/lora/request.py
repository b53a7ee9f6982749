"""`LoRARequest`: the adapter a request runs with, under vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory, named for clients and identified by `lora_int_id` (>= 1).

    Requests with the same `lora_int_id` share one loaded adapter, so an id must always name the
    same directory. Equality and hashing go by `lora_name`, as in vLLM (an adapter is known by
    its name across engines); the engine itself keys adapters by `lora_int_id`, never by this.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # what the adapter was trained on (vLLM's; the server lists it as the adapter's root)
    base_model_name: str | None = field(default=None, compare=False)
    # vLLM's newer fields, accepted at their defaults. is_3d_lora_weight only matters to vLLM
    # with enable_mixed_moe_lora_format (paged has none: the layout follows the base model).
    tensorizer_config_dict: dict | None = field(default=None, compare=False)
    load_inplace: bool = field(default=False, compare=False)
    is_3d_lora_weight: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty str, got {self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a str or None, got {self.base_model_name!r}")
        if self.tensorizer_config_dict is not None:
            raise ValueError(
                "tensorizer_config_dict is not supported: paged reads PEFT adapter directories "
                "(lora_path) only"
            )
        for name in ("load_inplace", "is_3d_lora_weight"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.load_inplace:
            raise ValueError(
                "load_inplace=True is not supported: a loaded lora_int_id keeps its weights; "
                "call llm.llm_engine.remove_lora(lora_int_id) once its requests finished, then "
                "send the request again to read the adapter anew"
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self)) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
