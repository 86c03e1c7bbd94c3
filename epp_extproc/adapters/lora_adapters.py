"""Which LoRA adapters each worker serves, and their base models: the table `worker_facts.WorkerFacts` keeps for
both KV lookups (in-process `kv_routing.KvRouting` and the ingest-apart `kv_remote.RemoteKv`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence


class AdapterTable:
    """address -> adapter name -> its base model ("" when the worker did not say)."""

    def __init__(self) -> None:
        self._by_address: dict[str, dict[str, str]] = {}

    def set(self, address: str, adapters: Sequence[str] | Mapping[str, str]) -> None:
        self._by_address[address] = dict(adapters) if isinstance(adapters, Mapping) else dict.fromkeys(adapters, "")

    def drop(self, address: str) -> None:
        self._by_address.pop(address, None)

    def items(self) -> Iterator[tuple[str, dict[str, str]]]:
        return iter(self._by_address.items())

    def adapter_for(self, model: object, address: str | None = None) -> str | None:
        """The LoRA adapter a request targets: its `model` field when it names an adapter a worker serves (the
        one at `address`, or any), as vLLM and TensorRT-LLM select adapters; None for the base model."""
        if not isinstance(model, str) or not model:
            return None
        if address is not None:
            return model if model in self._by_address.get(address, ()) else None
        return model if any(model in a for a in self._by_address.values()) else None

    def base_model_for(self, model: object) -> str | None:
        """The base model of the LoRA adapter `model` names, when a worker said (its /v1/models `parent`)."""
        if not isinstance(model, str):
            return None
        for adapters in self._by_address.values():
            parent = adapters.get(model)
            if parent:
                return parent
        return None
