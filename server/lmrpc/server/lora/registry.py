"""The loaded adapters: by name, least recently used first; loading by path only from under `--lora-root`; at most
`--max-loaded-loras` held, ever. Names follow errors.NAME_RULE; a path is resolved under the root, and each file of
the adapter is opened by a path that stays under it (userinput.open_confined: a symlinked file pointing out is refused).

Loading one more evicts the least recently used adapter that no call is using and that was not loaded at start
(`--lora-modules` adapters are pinned: requests may name them whatever else is loaded, and one outside `--lora-root`
could not be loaded again by a request). When none may be evicted the load fails RESOURCE_EXHAUSTED
(`LoadLoraAdapter`), or a request waits until a call ends (`wait_for_room`, used by validation.resolve_adapter).

Thread-safety: resolve/load/unload/pin run on the event loop or in worker threads (loading reads files and packs
weights); the engine thread only reads the `LoadedAdapter` objects that requests carry. A request keeps its
adapter object alive, so an unload or eviction takes the adapter away from new requests while requests in flight
finish with it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lmrpc.server.config import LoraConfig
from lmrpc.server.lora.adapter import ModelDims, read_adapter
from lmrpc.server.lora.errors import AdapterError, AdapterErrorKind, check_name
from lmrpc.server.lora.products import LayerLora, build_layers, native_adapter
from lmrpc.server.models.llama import LlamaForCausalLM
from lmrpc.server.userinput import MAX_PATH_CHARS, OutsideRoot, clip, has_control, resolve_under

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LoadedAdapter:
    """One adapter ready to run (satisfies protocol.AdapterRef). Identity-compared: a reload is another adapter."""

    name: str  # how requests name it (lora_path, or "base:name" as an OpenAI model)
    uid: int  # unique per load: keys the prefix cache, so a reloaded name never meets its old pages
    path: str  # the directory it was read from
    rank: int  # r
    scale: float  # alpha / r (alpha / sqrt(r) with rsLoRA)
    target_modules: tuple[str, ...]  # PEFT module names it adapts
    layers: tuple[LayerLora, ...]  # per decoder layer, the deltas on the fused products
    stack: object | None  # the same products for the native decoder stack (products.native_adapter), or None


@dataclass(frozen=True)
class AdapterInfo:
    """What ListLoraAdapters reports of one adapter."""

    name: str  # its name
    path: str  # where it was read from
    rank: int  # r
    scale: float  # the delta's scale
    target_modules: tuple[str, ...]  # PEFT module names
    in_use: int  # calls running with it now


class LoraRegistry:
    """The adapters loaded for one model (see the module doc)."""

    def __init__(self, config: LoraConfig, model: object) -> None:
        self.config = config
        # Adapters run on our dense Llama family only (the transformers fallback and MoE experts have no place for
        # the deltas).
        self._model = model if isinstance(model, LlamaForCausalLM) and model.accepts_adapters else None
        self._root = os.path.realpath(config.lora_root) if config.lora_root else None
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()  # least recently used first
        self._pins: dict[int, int] = {}  # uid -> calls using it
        self._pinned: set[int] = set()  # uids loaded at start (--lora-modules): never evicted
        self._room_waiters: list[Callable[[], None]] = []  # wake-ups of requests waiting for an evictable slot
        self._uids = itertools.count(1)
        self._load_lock = threading.Lock()  # one load at a time: two calls naming one new path read it once

    @property
    def enabled(self) -> bool:
        return self._model is not None

    def names(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    # ---- resolve and load -------------------------------------------------------------------------------------

    def get(self, name: str) -> LoadedAdapter | None:
        """The loaded adapter of that name (marked recently used), or None."""
        with self._lock:
            adapter = self._loaded.get(name)
            if adapter is not None:
                self._loaded.move_to_end(name)
            return adapter

    def resolve(self, ref: str) -> LoadedAdapter:
        """A request's adapter: a loaded name, else a path under --lora-root (absolute, or relative to the root),
        loaded now under that name. Blocking (may read files): call it off the event loop."""
        _check_path_text(ref)  # (a name is a path under the root too)
        adapter = self.get(ref)
        if adapter is not None:
            return adapter
        if self._root is None or not ref:
            raise self.not_found(ref)
        return self.load(ref, ref, confined=True, reuse=True)

    def not_found(self, ref: str) -> AdapterError:
        loaded = ", ".join(repr(n) for n in self.names()) or "none"
        return AdapterError(AdapterErrorKind.NOT_FOUND,
                            f"LoRA adapter {clip(repr(ref))} is not loaded (loaded: {loaded})")

    def load(self, name: str, path: str, *, confined: bool, reuse: bool = False,
             pinned: bool = False) -> LoadedAdapter:
        """Load the adapter at `path` as `name`. confined (requests, LoadLoraAdapter; not --lora-modules): the path
        must lie under --lora-root. reuse: a name already loaded is that adapter (else ALREADY_EXISTS). pinned
        (--lora-modules): never evicted. With --max-loaded-loras loaded and none evictable: EXHAUSTED (before any
        file is read). Blocking."""
        if not self.enabled:
            raise AdapterError(AdapterErrorKind.UNAVAILABLE,
                               "this model serves no LoRA adapters (only the Llama family's native layers do)")
        # The path first when confined: a request's lora_path is both, and "../x" is an escape (PERMISSION), not a
        # bad name.
        directory = self.check_path(path) if confined else Path(path)
        check_name(name)
        with self._load_lock:
            with self._lock:
                existing = self._loaded.get(name)
                if existing is None:
                    self._check_room(name)
            if existing is not None:
                if reuse:
                    return existing
                raise AdapterError(AdapterErrorKind.EXISTS, f"a LoRA adapter named {name!r} is already loaded")
            adapter = self._read(name, directory, confined)
            with self._lock:
                self._make_room(name)  # calls may have started using adapters while the files were read
                self._loaded[name] = adapter
                if pinned:
                    self._pinned.add(adapter.uid)
        logger.info("LoRA adapter %r loaded from %s (rank %d, %s)%s", name, directory, adapter.rank,
                    ", ".join(adapter.target_modules), " (pinned)" if pinned else "")
        return adapter

    def check_path(self, path: str) -> Path:
        """The adapter directory `path` names, if it lies under --lora-root (symlinks resolved); else
        PERMISSION_DENIED. A NUL or control character, or a path longer than PATH_MAX: INVALID. A request never
        makes the server read a file outside the root (its files are opened by _read through open_confined)."""
        shown = clip(repr(path))
        if self._root is None:
            raise AdapterError(AdapterErrorKind.PERMISSION,
                               f"loading LoRA adapters by path is disabled (no --lora-root): {shown}")
        _check_path_text(path)
        try:
            resolved = resolve_under(self._root, path)
        except OutsideRoot as exc:
            raise AdapterError(AdapterErrorKind.PERMISSION,
                               f"LoRA adapter path {shown} is outside the adapter root (--lora-root)") from exc
        if not os.path.isdir(resolved):
            raise AdapterError(AdapterErrorKind.NOT_FOUND,
                               f"LoRA adapter {shown} is not loaded and is no directory under the adapter root "
                               f"(loaded: {', '.join(repr(n) for n in self.names()) or 'none'})")
        return Path(resolved)

    def _read(self, name: str, directory: Path, confined: bool) -> LoadedAdapter:
        model = self._model
        assert model is not None
        features = model.lora_features()
        file = read_adapter(directory, ModelDims(model.shape.layers, features), self.config.max_lora_rank,
                            root=self._root if confined else None)
        layers = build_layers(file, model.builder, model.shape.layers, features)
        return LoadedAdapter(name, next(self._uids), str(directory), file.rank, file.scale, file.target_modules,
                             layers, native_adapter(layers))

    # ---- unload, pins, eviction -------------------------------------------------------------------------------

    def unload(self, name: str) -> LoadedAdapter:
        """Take the adapter away from new requests; calls running with it finish with it."""
        with self._lock:
            adapter = self._loaded.pop(name, None)
            if adapter is not None:
                self._pinned.discard(adapter.uid)
        if adapter is None:
            raise self.not_found(name)
        logger.info("LoRA adapter %r unloaded", name)
        self._wake_room_waiters()
        return adapter

    def pin(self, adapters: Iterable[LoadedAdapter]) -> None:
        """These adapters are in use by a call (once per call and adapter): not evicted until unpinned."""
        with self._lock:
            for a in adapters:
                self._pins[a.uid] = self._pins.get(a.uid, 0) + 1

    def unpin(self, adapters: Iterable[LoadedAdapter]) -> None:
        with self._lock:
            for a in adapters:
                left = self._pins.get(a.uid, 0) - 1
                if left > 0:
                    self._pins[a.uid] = left
                else:
                    self._pins.pop(a.uid, None)
        self._wake_room_waiters()

    def _evictable(self) -> str | None:
        """The least recently used loaded adapter no call uses and not pinned (locked), or None."""
        return next((name for name, a in self._loaded.items()
                     if self._pins.get(a.uid, 0) == 0 and a.uid not in self._pinned), None)

    def _has_room(self) -> bool:
        return len(self._loaded) < self.config.max_loaded_loras or self._evictable() is not None

    def _check_room(self, name: str) -> None:
        """EXHAUSTED unless one more adapter can be held (locked)."""
        if not self._has_room():
            in_use = ", ".join(repr(n) for n, a in self._loaded.items() if a.uid not in self._pinned) or "none"
            pinned = ", ".join(repr(n) for n, a in self._loaded.items() if a.uid in self._pinned) or "none"
            raise AdapterError(AdapterErrorKind.EXHAUSTED,
                               f"cannot load LoRA adapter {name!r}: {len(self._loaded)} adapters are loaded "
                               f"(--max-loaded-loras {self.config.max_loaded_loras}) and none may be evicted (in use "
                               f"by calls: {in_use}; loaded at start: {pinned}); retry when calls end, or unload one")

    def _make_room(self, name: str) -> None:
        """Before adding `name`: evict the least recently used evictable adapter if the registry is full (locked)."""
        self._check_room(name)
        if len(self._loaded) < self.config.max_loaded_loras:
            return
        victim = self._evictable()
        assert victim is not None  # _check_room
        del self._loaded[victim]
        logger.info("LoRA adapter %r evicted (least recently used; --max-loaded-loras %d)", victim,
                    self.config.max_loaded_loras)

    def room_may_free(self) -> bool:
        """Some loaded adapter is merely in use (not pinned for good): room frees when its calls end."""
        with self._lock:
            return any(a.uid not in self._pinned for a in self._loaded.values())

    async def wait_for_room(self) -> None:
        """Return once one more adapter could be loaded (a call ended, an adapter was unloaded); at once if it can
        now. On the event loop; cancelled with its call."""
        loop = asyncio.get_running_loop()
        room = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(room.set)

        with self._lock:
            if self._has_room():  # freed between the failed load and now
                return
            self._room_waiters.append(wake)
        try:
            await room.wait()
        finally:
            with self._lock:
                if wake in self._room_waiters:
                    self._room_waiters.remove(wake)

    def _wake_room_waiters(self) -> None:
        with self._lock:
            if not self._room_waiters or not self._has_room():
                return
            waiters, self._room_waiters = self._room_waiters, []
        for wake in waiters:
            wake()

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [AdapterInfo(a.name, a.path, a.rank, a.scale, a.target_modules, self._pins.get(a.uid, 0))
                    for a in self._loaded.values()]


def _check_path_text(path: str) -> None:
    """A NUL or control character, or more than PATH_MAX characters: INVALID (no name or path has them)."""
    if has_control(path) or len(path) > MAX_PATH_CHARS:
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"LoRA adapter path {clip(repr(path))} must be at most {MAX_PATH_CHARS} characters without "
                           "NUL or control characters")
