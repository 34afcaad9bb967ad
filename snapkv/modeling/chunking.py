"""Bounded activations at long context: each decoder layer's MLP runs over the prompt in slices.

An MLP is position-wise, so running it over slices of the sequence gives the same result as one pass,
while its intermediate activations (gate, up and their product: 3 x tokens x intermediate_size) exist
for one slice at a time. At 1M tokens of a Llama-3.1-8B shape that is the difference between 86 GB and
1.4 GB (bf16, slices of 16k tokens). Smaller slices were tried on a CPU (a 1.5B model's MLP over 8k tokens in
slices of 2.5k): 30% slower, each product packing its weight again for fewer rows, and the peak no lower.
"""

from contextlib import contextmanager
from typing import Iterator

import torch

from snapkv.modeling.architectures import feed_forward_modules
from snapkv.modeling.gguf_weights import tiles_kept

DEFAULT_CHUNK_TOKENS = 16384


def _sliced_forward(module, original, chunk_tokens: int):
    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # hidden_states: (batch, n, hidden)
        n = hidden_states.shape[1]
        if n <= chunk_tokens:
            return original(hidden_states, *args, **kwargs)
        output = None
        with tiles_kept(module):  # a GGUF file's projections made into tiles once for all the slices
            for start in range(0, n, chunk_tokens):
                # a copy with strides of its own: a slice keeps the whole prompt's batch stride, and torch's
                # matmul then takes a batched path that copies the weight for every call (2.3 s of 9.3)
                piece = hidden_states[:, start:start + chunk_tokens].clone(memory_format=torch.contiguous_format)
                part = original(piece, *args, **kwargs)
                if output is None:
                    output = part.new_empty(hidden_states.shape[:2] + part.shape[2:])
                output[:, start:start + part.shape[1]] = part
        return output
    return forward


@contextmanager
def chunked_feed_forward(model, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Iterator[None]:
    """Within the block, every decoder layer's MLP processes at most `chunk_tokens` positions at a time."""
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be positive")
    replaced = []  # (module, the instance-level forward it had: accelerate's hook, or None)
    try:
        for module in feed_forward_modules(model):
            replaced.append((module, module.__dict__.get("forward")))
            module.forward = _sliced_forward(module, module.forward, chunk_tokens)  # shadows the class's forward
        yield
    finally:
        for module, previous in replaced:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
