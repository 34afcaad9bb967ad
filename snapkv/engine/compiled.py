"""A compiled decode step: one token through the model over a static, pre-sized cache, with torch.compile
(inductor on CPU, which needs a C compiler; CUDA graphs on GPU).

Compiled code wants fixed shapes, so the cache an answer decodes against is copied once into transformers'
StaticCache, whose room is rounded up to a multiple of ROOM_STEP positions (answers over caches of
similar sizes share one compiled graph); unfilled slots are masked. Only caches whose layers all hold
plain full attention and the same number of positions qualify (a per-question cut or the full cache of a
Llama-family model); others, or any failure to compile, fall back to the eager step, for good.

Inductor's compiled code is cached under the snapkv home (compile/), so a later process pays a fraction of
the first compile.
"""

import os
import time
import weakref

import torch
from transformers import StaticCache
from transformers.cache_utils import DynamicLayer

from snapkv.base.paths import snapkv_home
from snapkv.engine.working_cache import WorkingCache

ROOM_STEP = 512


def _use_snapkv_cache_dir() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(snapkv_home() / "compile"))


class CompiledDecoder:
    """Decode steps for one model, compiled on first use. `compile_seconds` adds up the time spent compiling
    (the first step of each new room); `failure` says why compiling was given up, if it was."""

    def __init__(self, model) -> None:
        self._model = weakref.ref(model)  # the decoder must not keep a model alive (the registry is keyed by it)
        self.compile_seconds = 0.0
        self.failure: str | None = None
        self._caches: dict[int, StaticCache] = {}  # room -> the static cache of that size, reused
        self._compiled_rooms: set[int] = set()
        self._step = None

    @property
    def model(self):
        return self._model()

    def qualifies(self, working: WorkingCache) -> bool:
        """Every layer plain full attention, holding the same count, on one device (no device_map spread)."""
        every_plain = all(type(layer) is DynamicLayer and layer.is_initialized for layer in working.layers)
        if not every_plain:
            return False
        lengths = {layer.keys.shape[-2] for layer in working.layers}
        devices = {layer.keys.device for layer in working.layers}
        return self.failure is None and len(lengths) == 1 and len(devices) == 1

    def static_copy(self, working: WorkingCache, new_tokens: int) -> StaticCache:
        """The static cache of the right room, holding what `working` holds."""
        first = working.layers[0].keys  # (1, kv_heads, filled, head_dim)
        filled = first.shape[-2]
        room = -(-(filled + new_tokens) // ROOM_STEP) * ROOM_STEP
        static = self._caches.get(room)
        if static is None:
            static = StaticCache(config=self.model.config, max_cache_len=room)
            static.early_initialization(1, first.shape[1], first.shape[-1], first.dtype, first.device)
            self._caches = {room: static}  # one size held at a time: memory of one answer's cache
        for layer, source in zip(static.layers, working.layers):
            layer.keys[:, :, :filled].copy_(source.keys)
            layer.values[:, :, :filled].copy_(source.values)
            layer.cumulative_length.fill_(filled)
        return static

    def step(self, token: int, position: int, static: StaticCache) -> torch.Tensor | None:
        """The next logits (vocab,), or None if compiling failed (the caller goes on eagerly)."""
        if self._step is None:
            _use_snapkv_cache_dir()
            mode = "reduce-overhead" if static.layers[0].keys.device.type == "cuda" else None
            self._step = torch.compile(self._forward, dynamic=False, mode=mode)
        device = static.layers[0].keys.device
        room = static.layers[0].max_cache_len
        first_of_room = room not in self._compiled_rooms
        started = time.perf_counter()
        try:
            logits = self._step(torch.tensor([[token]], device=device), torch.tensor([[position]], device=device),
                                static)
        except Exception as error:
            if not first_of_room:
                raise  # a compiled graph that ran before and fails now is not a compiler problem
            # a compiler failure (no C compiler, an unsupported op): eager from now on, and say why
            self.failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            return None
        if first_of_room:
            self._compiled_rooms.add(room)
            self.compile_seconds += time.perf_counter() - started
        return logits

    @torch.no_grad()
    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, static: StaticCache) -> torch.Tensor:
        output = self.model(input_ids=input_ids, position_ids=position_ids, cache=static, use_cache=True,
                            logits_to_keep=1)
        return output.logits[0, -1].clone()


_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decoder_for(model) -> CompiledDecoder:
    """The one CompiledDecoder of `model` in this process: sessions over the same model share its graphs."""
    decoder = _DECODERS.get(model)
    if decoder is None:
        decoder = _DECODERS[model] = CompiledDecoder(model)
    return decoder
