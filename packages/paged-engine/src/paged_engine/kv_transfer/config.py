"""`kv_transfer_config` (vLLM's names): which connector, which role, where the storage is.

Only the shared-storage connector exists: vLLM's `ExampleConnector` (earlier
`SharedStorageConnector`). A producer saves the KV of full prompt blocks, a consumer loads
those it finds, `kv_both` does both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONNECTORS = ("ExampleConnector", "SharedStorageConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
_FIELDS = (
    "kv_connector",
    "kv_role",
    "kv_connector_extra_config",
    "engine_id",
    "kv_load_failure_policy",
)
# vLLM's kv_load_failure_policy values; paged always recomputes a request whose stored block
# could not be loaded (block_io.py), vLLM's default
FAILURE_POLICIES = ("recompute",)
_EXTRA = ("shared_storage_path",)
DEFAULT_STORAGE_PATH = "local_storage"  # vLLM's default, relative to the working directory


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    shared_storage_path: str = DEFAULT_STORAGE_PATH

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: Any) -> KVTransferConfig:
        """A dict, or an object with vLLM's attribute names (its KVTransferConfig); every
        error is a ValueError naming `kv_transfer_config` and the field."""
        if isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(_FIELDS))
            if unknown:
                raise ValueError(
                    f"kv_transfer_config: unknown field(s) {unknown}; known: {list(_FIELDS)}"
                )
            fields = dict(value)
        elif hasattr(value, "kv_connector"):  # vLLM's object: the fields paged reads
            fields = {name: getattr(value, name, None) for name in _FIELDS}
        else:
            raise ValueError(
                f"kv_transfer_config must be a dict (or vLLM's KVTransferConfig), got "
                f"{type(value).__name__}"
            )
        connector = fields.get("kv_connector")
        if connector not in CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector={connector!r} is not supported: known "
                f"connectors are {list(CONNECTORS)} (shared storage)"
            )
        role = fields.get("kv_role")
        if role not in ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role={role!r} is invalid: expected one of {list(ROLES)}"
            )
        engine_id = fields.get("engine_id")
        if engine_id is not None and not isinstance(engine_id, str):
            raise ValueError(f"kv_transfer_config.engine_id={engine_id!r} is invalid: a str")
        policy = fields.get("kv_load_failure_policy")
        if policy is not None and policy not in FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_config.kv_load_failure_policy={policy!r} is not supported: "
                f"expected one of {list(FAILURE_POLICIES)} (a request whose stored KV cannot be "
                "loaded is recomputed)"
            )
        extra = fields.get("kv_connector_extra_config")
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config={extra!r} is invalid: a dict"
            )
        unknown = sorted(set(extra) - set(_EXTRA))
        if unknown:
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config: unknown key(s) {unknown}; "
                f"known: {list(_EXTRA)}"
            )
        path = extra.get("shared_storage_path", DEFAULT_STORAGE_PATH)
        if not isinstance(path, str) or not path:
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.shared_storage_path="
                f"{path!r} is invalid: a non-empty directory path"
            )
        return cls(connector, role, path)


def check_engine(config: Any) -> None:
    """EngineConfig combinations refused with a connector (called from its validation)."""
    KVTransferConfig.parse(config.kv_transfer_config)
    if config.pipeline_parallel_size > 1:
        raise ValueError("kv_transfer_config is not supported with pipeline_parallel_size > 1")
    if config.speculative_config is not None:
        raise ValueError(
            "kv_transfer_config does not combine with speculative_config: the draft model's "
            "own KV cache is not transferred"
        )


def check_model(hf_config: Any, *, is_encoder: bool) -> None:
    """Models whose state is not all in paged KV blocks are refused by name."""
    from paged_engine.models.hybrid import is_hybrid
    from paged_engine.worker.cross_attention import is_encoder_decoder

    arch = ", ".join(getattr(hf_config, "architectures", None) or ["?"])
    if is_hybrid(hf_config):
        why = "a recurrent state outside the KV blocks"
    elif is_encoder_decoder(hf_config):
        why = "its encoder's cross-attention K/V live outside the KV blocks"
    elif is_encoder:
        why = "an encoder-only model keeps no KV between steps"
    else:
        return
    raise ValueError(f"kv_transfer_config is not supported for {arch}: {why}")
