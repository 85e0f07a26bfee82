"""The model catalog: one Slot per configured model, found by name or alias."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gateway.errors import GatewayError
from gateway.workers.client import ModelState
from gateway.workers.slots import Slot
from shared.config import ModelConfig
from shared.types import ErrorCode


class Catalog:
    def __init__(self, models: Iterable[ModelConfig]) -> None:
        self.slots: dict[str, Slot] = {}
        self.aliases: dict[str, str] = {}
        for model in models:
            self.add(model)

    @property
    def models(self) -> dict[str, ModelConfig]:
        return {name: slot.config for name, slot in self.slots.items()}

    def get(self, name: str) -> Slot | None:
        """By name or alias; None if unknown."""
        return self.slots.get(self.aliases.get(name, name))

    def slot(self, name: str) -> Slot:
        """By name or alias; an unknown model is a 404 naming the available ones."""
        slot = self.get(name)
        if slot is None:
            available = ", ".join(sorted(self.slots)) or "none"
            raise GatewayError(
                ErrorCode.MODEL_NOT_FOUND,
                f"The model `{name}` does not exist. Available models: {available}.",
                "model",
            )
        return slot

    def add(self, model: ModelConfig) -> Slot:
        """A new entry (`gatewayctl load NAME --source ...` makes one at run time)."""
        if model.name in self.slots or model.name in self.aliases:
            raise GatewayError(
                ErrorCode.INVALID_REQUEST, f"model {model.name!r} is already configured"
            )
        for alias in model.aliases:
            if alias in self.slots or alias in self.aliases or alias == model.name:
                raise GatewayError(ErrorCode.INVALID_REQUEST, f"alias {alias!r} is taken")
        slot = self.slots[model.name] = Slot(model)
        self.aliases.update({a: model.name for a in model.aliases})
        return slot

    def must_load(self, name: str) -> bool:
        """A request for this model would wait for a worker to load or restart."""
        slot = self.slot(name)
        if slot.config.placement == "remote":
            return False  # nothing loads here: a request waits for no worker
        return slot.state in (ModelState.UNLOADED, ModelState.LOADING) and not (
            slot.state == ModelState.UNLOADED and slot.config.on_demand == "refuse"
        )

    def __iter__(self) -> Iterator[Slot]:
        return iter(list(self.slots.values()))
