"""Stored tiers the file format cannot hold, simulated in memory to learn whether they are worth building.

A tier's keys and values are rounded as its Bits say (snapkv.storage.quantize), and then:

  sinks, recent     each head's first `sinks` and last `recent` held positions are put back as they were: IntactKV
                    (arXiv 2403.01241) keeps the attention sinks exact, KIVI (arXiv 2402.02750) the recent window;
  key_outliers      each head's `key_outliers` key channels of largest magnitude are put back as they were
                    (KVQuant, arXiv 2401.18079, keeps about 1% of its keys in 16 bits);
  numbers           the positions whose token holds a digit (and the '.', ',' or '%' between or after digits) are put
                    back as they were: the facts a question asks for are mostly numbers, and a copied number reads
                    its own positions' values;
  layers            only the layers FIRST-LAST (counted from 0) are rounded, the others kept as they were: which
                    layers the lost facts depend on;
  keys_before_rope  the keys are rounded before RoPE (RoPE taken off, rounded per the tier, put back on), as
                    KVQuant quantizes keys per channel before RoPE, where a channel's values are alike;
  coded             instead of the tier's rounding, each head transform-coded (snapkv.measure.transform_coded:
                    its principal components, a Hadamard rotation or its channels, one uniform step, entropy-coded),
                    the tier's key and value bits read as what the codes may cost a value (KVTC, CacheGen).

The result is kept in the 16-bit dtype, so a question reads these values as it would read a real tier's, and
`snapkv eval fidelity` judges its answers as it judges one (benchmarks/storage.py simulate runs it). The file
written is then 16-bit: `estimated_ratio` says what the tier would weigh against 16 bits.
"""

from dataclasses import dataclass

import torch

from snapkv.base.bits import Bits, Scheme
from snapkv.engine.lean_decode import rotate_half
from snapkv.measure.transform_coded import MAX_RATE, side_bits_per_value, transform_coded
from snapkv.storage.quantize import dequantize, quantize, stored_schemes

SCALE_BITS = 32  # a group's fp16 scale and minimum


@dataclass(frozen=True)
class Simulation:
    """What is done beyond the tier's rounding (module docstring); Simulation() is the tier as it is."""

    sinks: int = 0
    recent: int = 0
    key_outliers: int = 0
    keys_before_rope: bool = False
    coded: str = ""  # a transform of snapkv.measure.transform_coded, or "" for the tier's own rounding
    numbers: bool = False
    layers: tuple[int, int] | None = None  # (first, last) rounded, both included; None: every layer

    def rounds_layer(self, index: int) -> bool:
        return self.layers is None or self.layers[0] <= index <= self.layers[1]

    def describe(self) -> str:
        parts = [f"first {self.sinks} positions exact"] if self.sinks else []
        parts += [f"last {self.recent} positions exact"] if self.recent else []
        parts += ["number positions exact"] if self.numbers else []
        parts += [f"only layers {self.layers[0]}-{self.layers[1]} rounded"] if self.layers else []
        parts += [f"{self.key_outliers} outlier key channels exact"] if self.key_outliers else []
        parts += ["keys rounded before RoPE"] if self.keys_before_rope else []
        parts += [f"transform-coded ({self.coded}), the bits what a value's code costs"] if self.coded else []
        return ", ".join(parts) or "the tier as it is"


def without_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """keys (kv_heads, held, head_dim) with RoPE applied (keys * cos + rotate_half(keys) * sin), cos and sin the
    same shape -> the keys before it: the rotation taken back, divided by any scaling the rotary embedding applies
    (cos^2 + sin^2)."""
    return (keys * cos - rotate_half(keys) * sin) / (cos * cos + sin * sin)


def with_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return keys * cos + rotate_half(keys) * sin


def number_tokens(token_texts: list[str]) -> torch.Tensor:
    """(tokens,) bool: True at each token that holds a digit, and at a '.', ',' or '%' token right after one (a
    number's separators and unit, as a tokenizer that splits digits apart leaves them)."""
    digits = [any(character.isdigit() for character in text) for text in token_texts]
    chosen = [digit or (index > 0 and digits[index - 1] and text.strip() in (".", ",", "%"))
              for index, (digit, text) in enumerate(zip(digits, token_texts))]
    return torch.tensor(chosen, dtype=torch.bool)


def _rounded(x: torch.Tensor, scheme: Scheme | None) -> torch.Tensor:
    """x (kv_heads, held, head_dim) float32 as `scheme` stores it and restores it (None: as it is)."""
    return x if scheme is None else dequantize(quantize(x, scheme), torch.float32)


def _outlier_channels(keys: torch.Tensor, count: int) -> torch.Tensor:
    """keys (kv_heads, held, head_dim) -> (kv_heads, head_dim) bool: each head's `count` channels of largest
    magnitude over its positions."""
    largest = keys.abs().amax(dim=1)  # (kv_heads, head_dim)
    chosen = torch.zeros_like(largest, dtype=torch.bool)
    return chosen.scatter_(1, largest.topk(count, dim=1).indices, True)


def simulated_layer(keys: torch.Tensor, values: torch.Tensor, bits: Bits, simulation: Simulation,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    numbers: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values (kv_heads, held, head_dim) as the simulated tier restores them, float32.

    rope: (cos, sin), each (kv_heads, held, head_dim), the rotary embedding at each held position; needed for
    keys_before_rope. numbers: (kv_heads, held) bool, the held positions whose token is a number's (number_tokens);
    needed for simulation.numbers."""
    if bits.share:
        raise ValueError("a sharper share is not simulated: it is a tier the file holds already")
    key_scheme, value_scheme = stored_schemes(bits, keys.shape[-1])
    exact_keys, exact_values = keys.float(), values.float()
    if simulation.keys_before_rope:
        if rope is None:
            raise ValueError("keys rounded before RoPE need the rotary embedding's cos and sin")
        exact_keys = without_rope(exact_keys, *rope)
    if simulation.coded:
        rounded_keys = transform_coded(exact_keys, bits.keys, simulation.coded)
        rounded_values = transform_coded(exact_values, bits.values, simulation.coded)
    else:
        rounded_keys, rounded_values = _rounded(exact_keys, key_scheme), _rounded(exact_values, value_scheme)
    if simulation.key_outliers:
        outliers = _outlier_channels(exact_keys, simulation.key_outliers).unsqueeze(1)  # (kv_heads, 1, head_dim)
        rounded_keys = torch.where(outliers, exact_keys, rounded_keys)
    if simulation.keys_before_rope:
        exact_keys, rounded_keys = keys.float(), with_rope(rounded_keys, *rope)
    held = keys.shape[1]
    exact_positions = torch.zeros(held, dtype=torch.bool)
    exact_positions[:min(simulation.sinks, held)] = True
    exact_positions[held - min(simulation.recent, held):] = True
    exact_positions = exact_positions.view(1, held, 1)
    if simulation.numbers:
        if numbers is None:
            raise ValueError("number positions exact needs which held positions are a number's")
        exact_positions = exact_positions | numbers.unsqueeze(-1)  # (kv_heads, held, 1)
    return (torch.where(exact_positions, exact_keys, rounded_keys),
            torch.where(exact_positions, exact_values, rounded_values))


def _bits_per_value(scheme: Scheme | None) -> float:
    return 16.0 if scheme is None else scheme.bits + SCALE_BITS / scheme.group


def estimated_ratio(bits: Bits, simulation: Simulation, held: int, head_dim: int, number_share: float = 0.0) -> float:
    """16 bits against what the simulated tier would store per held position of a head, had the format the
    exact positions (16 bits) and exact channels (16 bits and a byte naming each) it needs. number_share: the share
    of held positions kept exact as a number's (simulation.numbers)."""
    key_scheme, value_scheme = stored_schemes(bits, head_dim)
    exact = min(1.0, min(held, simulation.sinks + simulation.recent) / held + number_share)
    outliers = simulation.key_outliers / head_dim
    if simulation.coded:
        side = side_bits_per_value(simulation.coded, held, head_dim)
        key_value_bits = tuple(rate + (side if rate < MAX_RATE else 0) for rate in (bits.keys, bits.values))
    else:
        key_value_bits = (_bits_per_value(key_scheme), _bits_per_value(value_scheme))
    key_bits = ((1 - outliers) * key_value_bits[0] + outliers * 16
                + 8 * simulation.key_outliers / (held * head_dim))  # a byte naming each channel, per head
    rounded = key_bits + key_value_bits[1]
    return 32.0 / (exact * 32.0 + (1 - exact) * rounded)
