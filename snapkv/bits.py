"""How many bits a stored key and value take: one small value type, free of torch (the CLI imports it)."""

SUPPORTED_BITS = (2, 3, 4, 8)  # below 16: what snapkv.quantize packs


class Bits:
    """The bits a stored key and value take: Bits(8) both 8; Bits(4, 3) keys 4, values 3 (written "4/3").

    Compares and hashes as a plain int when keys and values agree, so `tier.bits == 16` reads as it says.
    16 means the 16-bit dtype, for both.
    """

    __slots__ = ("keys", "values")

    def __init__(self, keys: int, values: int | None = None) -> None:
        values = keys if values is None else values
        if keys == 16 or values == 16:
            if keys != values:
                raise ValueError(f"16 bits is for keys and values both, not {keys}/{values}")
        elif keys not in SUPPORTED_BITS or values not in SUPPORTED_BITS:
            choices = ", ".join(map(str, (16, *reversed(SUPPORTED_BITS))))
            raise ValueError(f"stored bits must be {choices}, or KEYS/VALUES of those below 16 (as 4/3); "
                             f"got {keys if keys == values else f'{keys}/{values}'}")
        object.__setattr__(self, "keys", int(keys))
        object.__setattr__(self, "values", int(values))

    def __setattr__(self, name, value):
        raise AttributeError("Bits is immutable")

    @classmethod
    def parse(cls, text: "str | int | Bits") -> "Bits":
        """'8', 8, '4/3' or a Bits; ValueError for anything else."""
        if isinstance(text, Bits):
            return text
        if isinstance(text, int) and not isinstance(text, bool):
            return cls(text)
        parts = str(text).strip().split("/")
        if len(parts) > 2 or not all(part.strip().isdigit() for part in parts):
            raise ValueError(f"stored bits are a number (8) or KEYS/VALUES (4/3), not {text!r}")
        return cls(*(int(part) for part in parts))

    def to_json(self) -> "int | str":
        return self.keys if self.keys == self.values else str(self)

    def __str__(self) -> str:
        return str(self.keys) if self.keys == self.values else f"{self.keys}/{self.values}"

    def __repr__(self) -> str:
        return f"Bits({self.keys}, {self.values})"

    def __eq__(self, other) -> bool:
        if isinstance(other, Bits):
            return (self.keys, self.values) == (other.keys, other.values)
        if isinstance(other, int) and not isinstance(other, bool):
            return self.keys == self.values == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.keys) if self.keys == self.values else hash((self.keys, self.values))
