"""WorkingCache: the one cache an answer's engines receive (snapkv.engine.engines), and every other forward that runs
after a prompt's cache (a conversation's turns, probes, citations).

A CompressedCache is what a prompt left: per layer its kept keys and values, restored or in their stored bits. A
forward appends to a cache and a cut replaces a layer's tensors, while the CompressedCache itself must stay as it is
for the next question. A WorkingCache is made from it for one forward and what follows, and holds each layer in one of
three forms behind the same view, every layer's keys and values reading (1, kv_heads, held, head_dim):

  stored codes   a deferred cache's layer in its stored bits until the question's pass reaches it
                 (snapkv.storage.deferred.RestoringLayer: restored into one buffer shared by all layers, the question's
                 rows written after each head's; or attended from its codes by snapkv.engine.coded_attention,
                 the question's rows held apart until the cut restores only the positions it keeps)
  restored rows  the CompressedCache's own tensors, not copied (a forward only ever replaces a layer's tensors)
  room to write  before decoding, one buffer per layer with room for the answer where writing in place pays
                 (snapkv.modeling.presized.PresizedLayer); the C steps' own rows handed back as plain layers (hold)

It is transformers' DynamicCache, so that the model's forward takes it as it is; the steps of an answer are its
methods: question_done after the question's pass, make_room before the first decoded token.
"""

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from snapkv.modeling.presized import presize, presize_pays
from snapkv.storage.cache import CompressedCache
from snapkv.storage.deferred import RestoringLayer, plain_layer, release_buffers, restoring_layers


class WorkingCache(DynamicCache):
    """A forward's cache over a CompressedCache, which it never changes (see the module's docstring)."""

    @classmethod
    def of(cls, cache: CompressedCache, model_config, *, for_question: bool = False,
           through: int | None = None) -> "WorkingCache":
        """A working cache over `cache`'s layers, ready for a forward.

        Full-attention layers start from the CompressedCache's very tensors, without a copy: DynamicLayer only ever
        replaces its tensors (appending concatenates into new ones, a cut gathers into new ones), so a forward never
        changes `cache`. Sliding-window layers go through the public update(), which copies.
        for_question: a question's pass over a deferred cache: its full-attention layers are restored one at a time,
        as the pass reaches them, into one buffer with the question's rows written after each head's positions; call
        question_done after that forward.
        through: only layers 0..through are filled, for a forward stopped after that layer; a deferred cache's layers
        are then restored for this working cache alone, not kept in `cache`.
        """
        working = cls(config=model_config)
        restoring = (restoring_layers(cache.keys, cache.values, cache.question_room)
                     if for_question and cache.deferred else None)
        for index in range(cache.num_layers if through is None else through + 1):
            layer = working.layers[index]
            if restoring is not None and type(layer) is DynamicLayer:
                working.layers[index] = restoring[index]
                continue
            if through is not None and cache.deferred:
                keys, values = cache.keys.restored(index), cache.values.restored(index)
            else:
                keys, values = cache.keys[index], cache.values[index]
            keys, values = keys.unsqueeze(0), values.unsqueeze(0)  # (1, kv_heads, kept, head_dim)
            if type(layer) is DynamicLayer:
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            else:
                working.update(keys, values, index)
        return working

    def still_stored(self, index: int) -> RestoringLayer | None:
        """Layer `index` where it is still in its stored bits (a question's pass over a deferred cache that has not
        reached it), for a pass that reads the codes themselves; else None."""
        layer = self.layers[index]
        return layer if isinstance(layer, RestoringLayer) and not layer.restored else None

    def question_done(self) -> None:
        """After the question's pass: every layer holds tensors of its own (none in the shared restore buffer, which
        can then go), for the steps that follow."""
        release_buffers(self)

    def make_room(self, model, steps: int) -> None:
        """Before decoding up to `steps` tokens: each full-attention layer copied once into a buffer with room for
        them, where writing in place beats concatenation for this model (snapkv.modeling.presized); a layer made
        room for already is left as it is."""
        if presize_pays(model, self):
            presize(self, steps)

    def hold(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer `index` becomes a plain layer holding keys and values (1, kv_heads, held, head_dim): rows written
        elsewhere (snapkv.engine.native_decode's buffers) handed back for the steps that take over."""
        self.layers[index] = plain_layer(keys, values, self.layers[index].device)
