"""Sizes as people type them: 7000, 8k, 128k, 1m (k = 1024), alone or comma-separated."""

from snapkv.base.errors import ConfigError

_SCALE = {"k": 1024, "m": 1024 * 1024}


def parse_size(text: str, *, name: str = "a size", minimum: int = 1) -> int:
    """'8k' -> 8192, '128k' -> 131072, '1m' -> 1048576, '7000' -> 7000; ConfigError naming `name` otherwise."""
    text = str(text).strip().lower()
    scale = _SCALE.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError as error:
        raise ConfigError(f"{name} takes a number such as 7000, 8k or 1m, got {text!r}") from error
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


def parse_sizes(text: str, *, name: str = "a size", minimum: int = 1) -> list[int]:
    """'1k,2k,7000' -> [1024, 2048, 7000]."""
    values = [parse_size(part, name=name, minimum=minimum) for part in str(text).split(",") if part.strip()]
    if not values:
        raise ConfigError(f"{name} needs at least one value")
    return values
