"""How many bits a stored key and value take (Bits), and how a kind below 16 bits is quantized (Scheme): small
value types, free of torch (the CLI and snapkv.storage.cacheinfo import them)."""

import re
from dataclasses import dataclass
from math import gcd

SUPPORTED_BITS = (2, 3, 4, 8)  # below 16: what snapkv.storage.quantize packs
MAX_GROUP = 4096  # the largest quantization group a file may declare (snapkv.storage.cacheschema)


def _check_pair(keys: int, values: int) -> None:
    choices = ", ".join(map(str, (16, *reversed(SUPPORTED_BITS))))
    if keys not in (16, *SUPPORTED_BITS) or values not in (16, *SUPPORTED_BITS):
        raise ValueError(f"stored bits must be {choices}, or KEYS/VALUES of those (as 16/8 or 4/3); "
                         f"got {keys if keys == values else f'{keys}/{values}'}")
    if values == 16 and keys != 16:
        raise ValueError(f"values in 16 bits need keys in 16 bits too (keys decide what is attended), not "
                         f"{keys}/{values}")


FORM_PATTERN = re.compile(r"(\d+)(r|u)?(?:g(\d+))?")


@dataclass(frozen=True)
class Form:
    """How one kind below 16 bits is grouped, where it departs from its bits' default (snapkv.storage.quantize.
    stored_schemes): rotated True (written "r" after the bits) or False ("u": unrotated), None for the default;
    group: the group's size (written "g32"), None for the default. Form() is the default itself."""

    rotated: bool | None = None
    group: int | None = None

    def __str__(self) -> str:
        rotation = {True: "r", False: "u", None: ""}[self.rotated]
        return rotation + (f"g{self.group}" if self.group is not None else "")

    def __bool__(self) -> bool:
        return self.rotated is not None or self.group is not None


PLAIN = Form()


def _not_bits(whole: str) -> str:
    """What stored bits are written as, for a text that is not."""
    return ("stored bits are a number (8), KEYS/VALUES (4/3) or BITS+SHARE%@BITS (4/2+20%@4), each number optionally "
            f"followed by r (rotated), u (unrotated) and gN (groups of N), as 8r/8; not {whole!r}")


def _parse_kind(text: str, whole: str) -> tuple[int, Form]:
    """'8', '8r', '4ug32' -> (bits, Form); ValueError otherwise."""
    found = FORM_PATTERN.fullmatch(text.strip())
    if not found:
        raise ValueError(_not_bits(whole))
    bits, rotation, group = found.groups()
    form = Form({"r": True, "u": False, None: None}[rotation], int(group) if group is not None else None)
    if form and int(bits) == 16:
        raise ValueError(f"16 bits are stored as they are, without a rotation or groups: {whole!r}")
    if form.group is not None and not 1 <= form.group <= MAX_GROUP:
        raise ValueError(f"a group holds 1 to {MAX_GROUP} values, not {form.group}: {whole!r}")
    if form.group is not None and int(bits) in SUPPORTED_BITS and form.group % values_per_chunk(int(bits)):
        raise ValueError(f"a group of {form.group} does not pack into bytes at {bits} bits: {whole!r}")
    return int(bits), form


def _parse_pair(text: str, whole: str) -> tuple[int, int, Form, Form]:
    parts = text.strip().split("/")
    if len(parts) > 2:
        raise ValueError(_not_bits(whole))
    keys, values = _parse_kind(parts[0], whole), _parse_kind(parts[-1], whole)
    return keys[0], values[0], keys[1], values[1]


def _pair_text(keys: int, values: int, key_form: Form = PLAIN, value_form: Form = PLAIN) -> str:
    if keys == values and key_form == value_form:
        return f"{keys}{key_form}"
    return f"{keys}{key_form}/{values}{value_form}"


class Bits:
    """The bits a stored key and value take.

    Bits(8): both 8; Bits(4, 3): keys 4, values 3 (written "4/3"); Bits(16, 8): keys in the 16-bit dtype, values
    in 8 bits (keys decide which positions are attended, and take rounding worse); Bits(4, 2, share=0.2, sharp=(4, 4)):
    a sharper share (MiKV's idea, arXiv 2402.18096): the 20% of each head's positions the model needs
    most in 4/4 bits, the rest in 4/2 (written "4/2+20%@4"). 16 means the 16-bit dtype, for both.
    key_form, value_form: a kind's rotation or group size where it departs from the default (Form; written
    after its bits: "8r/8" rotates 8-bit keys, "8/4g32" groups 4-bit values by 32).
    Compares and hashes as a plain int when keys and values agree in bits and form and there is no sharper
    share, so `tier.bits == 16` reads as it says.
    """

    __slots__ = ("keys", "values", "share", "sharp", "key_form", "value_form")

    def __init__(self, keys: int, values: int | None = None, *, share: float = 0.0,
                 sharp: "tuple[int, int] | None" = None, key_form: Form = PLAIN, value_form: Form = PLAIN) -> None:
        values = keys if values is None else values
        _check_pair(keys, values)
        if (key_form and keys == 16) or (value_form and values == 16):
            raise ValueError("16 bits are stored as they are, without a rotation or groups")
        share = float(share)
        if share:
            if not 0.0 < share < 1.0 or round(share * 100) != share * 100:
                raise ValueError(f"a sharper share is a whole percentage between 1% and 99%, not {share:.4g}")
            if sharp is None or keys == 16 or values == 16:
                raise ValueError("a sharper share needs its own bits, and the rest below 16 bits")
            _check_pair(*sharp)
            if 16 in sharp or sharp[0] < keys or sharp[1] < values or tuple(sharp) == (keys, values):
                raise ValueError(f"the sharper share's bits ({_pair_text(*sharp)}) must be above the rest's "
                                 f"({_pair_text(keys, values)}) and below 16")
            sharp = (int(sharp[0]), int(sharp[1]))
        else:
            sharp = None
        object.__setattr__(self, "keys", int(keys))
        object.__setattr__(self, "values", int(values))
        object.__setattr__(self, "share", share)
        object.__setattr__(self, "sharp", sharp)
        object.__setattr__(self, "key_form", key_form)
        object.__setattr__(self, "value_form", value_form)

    def __setattr__(self, name, value):
        raise AttributeError("Bits is immutable")

    @classmethod
    def parse(cls, text: "str | int | Bits") -> "Bits":
        """'8', 8, '4/3', '8r/8', '4/2+20%@4' or a Bits; ValueError for anything else."""
        if isinstance(text, Bits):
            return text
        if isinstance(text, int) and not isinstance(text, bool):
            return cls(text)
        whole = str(text).strip()
        rest, plus, sharper = whole.partition("+")
        keys, values, key_form, value_form = _parse_pair(rest, whole)
        if not plus:
            return cls(keys, values, key_form=key_form, value_form=value_form)
        share, at, sharp = sharper.partition("%@")
        if not at or not share.strip().isdigit() or not int(share):
            raise ValueError(f"a sharper share is written BITS+SHARE%@BITS with SHARE from 1 to 99, as 4/2+20%@4; "
                             f"not {whole!r}")
        sharp_keys, sharp_values, *sharp_forms = _parse_pair(sharp, whole)
        if any(sharp_forms):
            raise ValueError(f"a sharper share's bits take no rotation or groups of their own: {whole!r}")
        return cls(keys, values, share=int(share) / 100, sharp=(sharp_keys, sharp_values), key_form=key_form,
                   value_form=value_form)

    @property
    def rest(self) -> "Bits":
        """The bits of the positions outside the sharper share (all of them where there is none)."""
        return Bits(self.keys, self.values, key_form=self.key_form, value_form=self.value_form) if self.share else self

    @property
    def sharper(self) -> "Bits | None":
        """The bits of the sharper share, or None."""
        return Bits(*self.sharp) if self.share else None

    @property
    def _plain(self) -> bool:
        """Keys and values alike in bits and form, no sharper share: what an int stands for."""
        return self.keys == self.values and self.key_form == self.value_form == PLAIN and not self.share

    def to_json(self) -> "int | str":
        return self.keys if self._plain else str(self)

    def __str__(self) -> str:
        text = _pair_text(self.keys, self.values, self.key_form, self.value_form)
        return f"{text}+{round(self.share * 100)}%@{_pair_text(*self.sharp)}" if self.share else text

    def describe(self) -> str:
        """For people: "8-bit", "4/3-bit", "4/2-bit, 20% at 4-bit", "8r/8-bit (r: rotated)"."""
        text = f"{_pair_text(self.keys, self.values, self.key_form, self.value_form)}-bit"
        if self.share:
            text += f", {round(self.share * 100)}% at {_pair_text(*self.sharp)}-bit"
        forms = " ".join(str(form) for form in (self.key_form, self.value_form))
        notes = [note for letter, note in (("r", "r: rotated"), ("u", "u: unrotated"), ("g", "gN: groups of N"))
                 if letter in forms]
        return f"{text} ({', '.join(notes)})" if notes else text

    def __repr__(self) -> str:
        sharper = f", share={self.share}, sharp={self.sharp}" if self.share else ""
        forms = "".join(f", {name}={form!r}" for name, form in (("key_form", self.key_form),
                                                               ("value_form", self.value_form)) if form)
        return f"Bits({self.keys}, {self.values}{sharper}{forms})"

    def _key(self) -> tuple:
        return (self.keys, self.values, self.share, self.sharp, self.key_form, self.value_form)

    def __eq__(self, other) -> bool:
        if isinstance(other, Bits):
            return self._key() == other._key()
        if isinstance(other, int) and not isinstance(other, bool):
            return self._plain and self.keys == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.keys) if self._plain else hash(self._key())


# Axis of the (kv_heads, tokens, head_dim) tensors along which a group runs.
TOKENS, CHANNELS = 1, 2
AXIS_NAMES = {TOKENS: "tokens", CHANNELS: "channels"}


@dataclass(frozen=True)
class Scheme:
    """How one kind of tensor (keys or values) is quantized: bits, the axis its groups run along, group size."""

    bits: int
    axis: int
    group: int
    rotated: bool = False  # a Hadamard rotation of each head's vectors before quantizing

    def to_dict(self) -> dict:
        data = {"bits": self.bits, "axis": AXIS_NAMES[self.axis], "group": self.group}
        return {**data, "rotation": "hadamard"} if self.rotated else data

    @classmethod
    def from_dict(cls, data: dict) -> "Scheme":
        """ValueError (or KeyError, TypeError) for a scheme snapkv cannot read."""
        axis = {name: number for number, name in AXIS_NAMES.items()}[data["axis"]]
        rotation = data.get("rotation")
        if rotation not in (None, "hadamard"):
            raise ValueError(f"unknown rotation {rotation!r} in quantization scheme {data}")
        scheme = cls(int(data["bits"]), axis, int(data["group"]), rotation == "hadamard")
        if scheme.bits not in SUPPORTED_BITS or scheme.group < 1 or scheme.group % values_per_chunk(scheme.bits):
            raise ValueError(f"unreadable quantization scheme {data}")
        return scheme

    def stored_shapes(self, shape: tuple[int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(codes, scale and minimum) shapes of a (kv_heads, tokens, head_dim) tensor quantized this way."""
        other = shape[CHANNELS] if self.axis == TOKENS else shape[TOKENS]
        groups = -(-shape[self.axis] // self.group)
        return (shape[0], other, groups, self.group * self.bits // 8), (shape[0], other, groups)


def tier_name(bits: Bits, stored: float | None) -> str:
    """A stored tier's name, as `snapkv eval fidelity` and its published figures write it: its bits, and the share
    of the document it keeps where not all ("8~45%")."""
    return str(bits) if stored is None else f"{bits}~{stored:.0%}"


def parse_tier(text: str) -> tuple[Bits, float | None]:
    """"8" -> (Bits(8), None); "8~45%" -> (Bits(8), 0.45): a stored tier's bits and the share of the document it
    keeps (None: all of it); ValueError for anything else. The inverse of tier_name."""
    bits, sign, share = text.strip().partition("~")
    if not sign:
        return Bits.parse(bits), None
    if not re.fullmatch(r"\d+(\.\d+)?%", share) or not 0 < float(share[:-1]) < 100:
        raise ValueError(f"{text.strip()!r}: after ~ comes the share of the document kept, above 0% and below 100%")
    return Bits.parse(bits), float(share[:-1]) / 100


def values_per_chunk(bits: int) -> int:
    """The fewest codes that fill whole bytes: 8 at 3 bits (3 bytes), 2 at 4 bits, 1 at 8."""
    return 8 // gcd(bits, 8)
