"""The tokenizer's adapter registry: which LoRA adapters a request may name, and the checks of a name.

Owner: one `AdapterRegistry` per app (AppContext.adapters). It starts with the `--lora-paths` adapters
(read through shared/lora_paths.py `read_checked`, as the scheduler reads them) and changes only through
POST /load_lora_adapter and /unload_lora_adapter (tokenizer_proc/api/lora_api.py).

What must hold:
- a request names an adapter by `model` on the OpenAI routes and by `lora_path` on /generate (`resolve`):
  the base model's name (or none) runs the base model; a registered adapter runs under it; any other
  name is a 404 naming it; an adapter named while LoRA is off is a 400 saying `--enable-lora`;
- an adapter is registered here only after every scheduler replica took it, and forgotten here before
  the schedulers are told, so a request never names an adapter the scheduler does not know (a request
  that races an unload is rejected by the scheduler: a 400 naming it);
- a name is loaded by one call at a time (`begin_load` / `end_load`).
"""

from __future__ import annotations

import logging
from typing import Any

from shared.config import LORA_NAME, ServerArgs
from shared.lora_paths import LoraError, read_checked, startup_adapters
from shared.messages import LoraAdapter
from tokenizer_proc.http.errors import ApiError, bad_request

logger = logging.getLogger(__name__)

NEEDS_LORA = "LoRA adapters are off: start the server with --enable-lora"


class AdapterRegistry:
    """Registered adapters by name (module docstring)."""

    def __init__(self, args: ServerArgs, adapters: list[LoraAdapter] | None = None) -> None:
        self.args = args
        self.enabled = args.enable_lora
        self.adapters: dict[str, LoraAdapter] = {a.name: a for a in (adapters or [])}
        self._loading: set[str] = set()

    @staticmethod
    def from_args(args: ServerArgs) -> AdapterRegistry:
        """The registry with every --lora-paths adapter (LoraError for a bad one)."""
        return AdapterRegistry(args, startup_adapters(args))

    def require_enabled(self, param: str | None = None) -> None:
        if not self.enabled:
            raise bad_request(NEEDS_LORA, param)

    def resolve(self, name: Any, param: str) -> str:
        """The adapter /generate's `lora_path` names ("" = the base model) (module docstring)."""
        if name is None or name == "":
            return ""
        if not isinstance(name, str):
            raise bad_request(f"{param} must be a string naming a LoRA adapter", param)
        if not self.enabled:
            raise bad_request(f"{param} names a LoRA adapter, but {NEEDS_LORA[0].lower()}{NEEDS_LORA[1:]}", param)
        if name not in self.adapters:
            raise _not_found(name, param, "LoRA adapter")
        return name

    def resolve_each(self, value: Any, prompts: int, param: str = "lora_path") -> list[str]:
        """/generate's `lora_path`: one name for every prompt, or a list of one per prompt (SGLang)."""
        if isinstance(value, list):
            if len(value) != prompts:
                raise bad_request(f"{param} has {len(value)} entries for {prompts} prompt(s): give one per prompt, "
                                  "or one name for all", param)
            return [self.resolve(v, f"{param}[{i}]") for i, v in enumerate(value)]
        return [self.resolve(value, param)] * prompts

    def read(self, name: Any, path: Any) -> LoraAdapter:
        """The adapter a load names, read and checked (400 with the reader's message otherwise)."""
        self.require_enabled()
        if not isinstance(name, str) or not LORA_NAME.fullmatch(name):
            raise bad_request("lora_name must be 1-128 letters, digits or ._:/- (starting with a letter or digit)",
                              "lora_name")  # fmt: skip
        if name in (self.args.model_name, self.args.model_path):
            raise bad_request(f"lora_name {name!r} is the base model's name", "lora_name")
        if not isinstance(path, str) or not path:
            raise bad_request("lora_path must name the adapter's directory", "lora_path")
        if name in self.adapters or name in self._loading:
            raise bad_request(f"the LoRA adapter {name!r} is loaded already (unload it first)", "lora_name")
        try:
            return read_checked(name, path, self.args)
        except LoraError as e:
            raise bad_request(str(e), "lora_path") from None

    def begin_load(self, name: str) -> None:
        if name in self.adapters or name in self._loading:
            raise bad_request(f"the LoRA adapter {name!r} is loaded already (unload it first)", "lora_name")
        self._loading.add(name)

    def end_load(self, adapter: LoraAdapter, ok: bool) -> None:
        self._loading.discard(adapter.name)
        if ok:
            self.adapters[adapter.name] = adapter
            logger.info("LoRA adapter %s loaded from %s (uid %s)", adapter.name, adapter.path, adapter.uid)

    def forget(self, name: Any) -> LoraAdapter:
        """Remove `name` for new requests (404 when it is not loaded)."""
        self.require_enabled()
        if not isinstance(name, str) or name not in self.adapters:
            raise _not_found(name, "lora_name", "LoRA adapter")
        return self.adapters.pop(name)

    def check_integrity(self) -> None:
        assert self.enabled or not self.adapters, "adapters registered while LoRA is off"
        assert all(a.name == n for n, a in self.adapters.items())
        assert not self._loading & set(self.adapters), "a name both loading and loaded"


def _not_found(name: Any, param: str, what: str) -> ApiError:
    return ApiError(404, f"the {what} {name!r} does not exist", param, err_type="not_found_error")
