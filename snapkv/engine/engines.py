"""The ways an answer runs: each engine does a question's pass over the working cache and then steps token by token,
or says it does not apply here (None) and the next engine in the order is asked.

    reference  the model's own forward (transformers), for every model and device: the answers the others are
               checked against (tests/test_engines.py)
    torch      the same layers as the few PyTorch calls they need (a plain Llama-family model on CPU; fp32 results
               to the bit): its question pass snapkv.engine.torch_question, its steps snapkv.engine.lean_decode
    native     its question pass snapkv.engine.native_question (the torch engine's with the layers' parts in C and a
               saved layer attended from its codes: snapkv.engine.coded_attention), and each decoded token
               through every layer in one C call (snapkv.engine.native_decode: projections in 4/8-bit blocks, or plain
               bf16/fp32 rows, summed in fp32 on CPU); within fp32 rounding of the torch engine. A bf16 model's
               question pass is the torch engine's
    compiled   decode steps by torch.compile over a static copy of the cache (snapkv.engine.compiled); its question
               pass is native's (or the next that applies)

One setting chooses (`--engine`, SNAPKV_ENGINE): auto (native, torch, reference: the first that applies), or an
engine to start from, the ones after it taking what it does not apply to. Which engine ran the question pass and
the steps, and the C kernels' variant, are reported (EngineUse) in --json, bench rows and the log.
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from snapkv import native
from snapkv.compression.compress import CompressionPlan, compressing
from snapkv.compression.config import engine_setting
from snapkv.engine import lean_decode, native_decode, native_question, torch_question
from snapkv.engine.working_cache import WorkingCache

_ORDERS = {"auto": ("native", "torch", "reference"), "native": ("native", "torch", "reference"),
           "compiled": ("compiled", "native", "torch", "reference"), "torch": ("torch", "reference"),
           "reference": ("reference",)}


@dataclass
class EngineUse:
    """What ran an answer: the engine of its question pass and of its decode steps (None: no step was taken), and
    the C kernels' variant (None: not in use)."""

    question: str = ""
    steps: str | None = None
    kernels: str | None = None

    @property
    def name(self) -> str:
        """The engine that decoded the answer (its question pass's where it had no step)."""
        return self.steps or self.question

    def as_json(self) -> dict:
        return {"name": self.name, "question": self.question, "steps": self.steps, "kernels": self.kernels}


class Stepper:
    """Decode steps over a cache made ready once: step() gives the next logits (vocab,), or None where it cannot go
    on (the next engine in the order takes over from the same cache)."""

    def step(self, token: int, position: int) -> torch.Tensor | None:
        raise NotImplementedError

    def hand_over(self) -> None:
        """Leave the working cache as the next engine reads it."""


class Engine:
    """One way to run an answer. question_pass: the question (q,) at positions start.. appended to `working`, each
    layer cut by `plan` (None: none is); the last position's logits (vocab,), or None where this engine does not
    apply (working untouched). stepper: the decode steps from `position` on for up to `steps` tokens, or None."""

    name = ""

    def question_pass(self, model, question_ids: torch.Tensor, start: int, working: WorkingCache,
                      plan: CompressionPlan | None) -> torch.Tensor | None:
        return None

    def stepper(self, model, working: WorkingCache, position: int, steps: int) -> Stepper | None:
        return None


def model_device(model) -> torch.device:
    """Where token ids enter the model (the first device of several with a device_map)."""
    return model.get_input_embeddings().weight.device


@torch.inference_mode()
def run_forward(
    model, input_ids: torch.Tensor, cache: DynamicCache, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """One forward that appends input_ids (1, s) to `cache`; returns the last position's logits (vocab,)."""
    output = model(
        input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1
    )
    return output.logits[0, -1]


class _ForwardSteps(Stepper):
    def __init__(self, model, working: WorkingCache) -> None:
        self._model, self._working = model, working
        self._device = working.layers[0].keys.device if working.layers else torch.device("cpu")

    def step(self, token: int, position: int) -> torch.Tensor:
        return run_forward(self._model, torch.tensor([[token]], device=self._device), self._working,
                           torch.tensor([[position]], device=self._device))


class Reference(Engine):
    name = "reference"

    def question_pass(self, model, question_ids, start, working, plan):
        device = model_device(model)
        positions = torch.arange(start, start + question_ids.shape[0], device=device).unsqueeze(0)  # (1, q)
        with compressing(model, plan) if plan else nullcontext():
            return run_forward(model, question_ids.to(device).unsqueeze(0), working, positions)

    def stepper(self, model, working, position, steps):
        working.make_room(model, steps)
        return _ForwardSteps(model, working)


class _LeanSteps(Stepper):
    def __init__(self, model, working: WorkingCache) -> None:
        self._model, self._working = model, working

    def step(self, token: int, position: int) -> torch.Tensor:
        return lean_decode.decode_step(self._model, token, position, self._working)


class Torch(Engine):
    name = "torch"

    def question_pass(self, model, question_ids, start, working, plan):
        if not lean_decode.qualifies(model, working):
            return None
        return torch_question.question_pass(model, question_ids.to(model_device(model)), start, working, plan)

    def stepper(self, model, working, position, steps):
        if not lean_decode.qualifies(model, working):
            return None
        working.make_room(model, steps)
        return _LeanSteps(model, working)


class _NativeSteps(Stepper):
    def __init__(self, decoder: native_decode.NativeDecoder) -> None:
        self._decoder = decoder

    def step(self, token: int, position: int) -> torch.Tensor | None:
        return self._decoder.step(token, position)  # None: a buffer is full (never expected: sized for the answer)

    def hand_over(self) -> None:
        self._decoder.sync()


class Native(Engine):
    name = "native"

    def question_pass(self, model, question_ids, start, working, plan):
        if native.unavailable_reason() is not None or not lean_decode.qualifies(model, working):
            return None
        if model.dtype != torch.float32:  # a bf16 pass is the torch engine's: see docs/measurements.md, "A user's
            return None  # bf16 checkpoint on CPU" (in fp32 through the C parts it kept fewer facts than in bf16)
        layers = native_decode.question_layers(model)  # None: the layers' parts stay PyTorch's
        return native_question.question_pass(model, question_ids.to(model_device(model)), start, working, plan,
                                             layers)

    def stepper(self, model, working, position, steps):
        decoder = native_decode.for_cache(model, working, position, steps)  # reads the rows where they are
        return _NativeSteps(decoder) if decoder is not None else None


class _CompiledSteps(Stepper):
    def __init__(self, decoder, working: WorkingCache, steps: int) -> None:
        self._decoder, self._working = decoder, working
        self._static = decoder.static_copy(working, steps)

    def step(self, token: int, position: int) -> torch.Tensor | None:
        logits = self._decoder.step(token, position, self._static)
        if logits is None:  # compiling failed before anything was written: the next engine goes on eagerly
            return None
        self._working.layers.clear()  # the static copy holds everything now: one cache in memory, not two
        return logits


class Compiled(Engine):
    name = "compiled"

    def stepper(self, model, working, position, steps):
        from snapkv.engine.compiled import decoder_for

        decoder = decoder_for(model)
        return _CompiledSteps(decoder, working, steps) if decoder.qualifies(working) else None


ENGINES: dict[str, Engine] = {engine.name: engine for engine in (Native(), Torch(), Compiled(), Reference())}


def engine_order(setting: str = "auto") -> list[Engine]:
    """The engines an answer asks in turn for `setting` (see the module's docstring)."""
    return [ENGINES[name] for name in _ORDERS[engine_setting(setting)]]
