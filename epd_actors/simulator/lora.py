"""The LoRA adapters of the simulated vLLM server (``worker --engine sim --serve-openai``).

vLLM serves the adapters given with ``--lora-modules`` and, with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, those loaded later through
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``: 200 and a
plain-text confirmation; 400 for a missing field or a name already loaded).
``GET /v1/models`` lists each adapter as a card whose ``parent`` is the base
model and whose ``root`` is its path, and a request names an adapter in its
``model``; a name that is neither the base model nor an adapter is a 404.
:class:`SimLoraAdapters` keeps that state for one server (pure, no I/O).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lora import announced_adapters

if TYPE_CHECKING:
    from collections.abc import Iterable


class LoraRefused(Exception):
    """A LoRA request or a model name the server answers with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class SimLoraAdapters:
    """The adapters one simulated server has: announced at start, then loaded.

    Args:
        capabilities: its engine's capabilities (``lora:NAME`` entries are
            the adapters it starts with, like vLLM's ``--lora-modules``).

    Each method takes the model the server serves at that moment (a test may
    change an engine's model while it runs).
    """

    def __init__(self, capabilities: Iterable[str]) -> None:
        self.adapters: dict[str, str] = {
            name: name for name in sorted(announced_adapters(tuple(capabilities)))
        }
        self.loads: list[str] = []  # adapters loaded at run time, in order

    def load(self, body: object, base_model: str) -> str:
        """Load the adapter a ``/v1/load_lora_adapter`` body names; the 200 answer's text.

        Raises:
            LoraRefused: 400, for a body without ``lora_name`` and ``lora_path``
                strings, or an adapter already loaded.
        """
        name = body.get("lora_name") if isinstance(body, dict) else None
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise LoraRefused(400, "both 'lora_name' and 'lora_path' must be provided")
        if name in self.adapters or name == base_model:
            raise LoraRefused(400, f"The lora adapter '{name}' has already been loaded.")
        self.adapters[name] = path
        self.loads.append(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def adapter_for(self, model: object, base_model: str) -> str | None:
        """The adapter a request's ``model`` names; None for the base model.

        Raises:
            LoraRefused: 404, the server serves no such model or adapter.
        """
        if model == base_model:
            return None
        if isinstance(model, str) and model in self.adapters:
            return model
        raise LoraRefused(404, f"The model `{model}` does not exist.")

    def cards(self, base_model: str, created: int) -> list[dict[str, object]]:
        """The base model's card, then one per adapter (``parent``: the base model)."""
        base: dict[str, object] = {
            "id": base_model,
            "object": "model",
            "created": created,
            "owned_by": "epd_actors",
        }
        return [base] + [
            {**base, "id": name, "root": path, "parent": base_model}
            for name, path in self.adapters.items()
        ]
