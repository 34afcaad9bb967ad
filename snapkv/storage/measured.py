"""What `snapkv eval fidelity` measured for each stored tier, for people choosing one: `info`, `--help`, README.

Free of torch (the CLI's help and `info` read it). The figures are from one run of the benchmark on the
embedded model (README "What is saved" has the command, the CPU and the whole table); a tier not listed here
was not measured.
"""

from dataclasses import dataclass

from snapkv.base.bits import Bits


@dataclass(frozen=True)
class Fidelity:
    """A stored tier's answers against the 16-bit tier's, both cut to the default budget per question."""

    questions: int   # answered by both (documents' questions and the needle grid)
    identical: int   # first sentence identical, token for token
    changed: int     # answers in which a number or name of the 16-bit tier's first sentence is lacking or altered
    lost: int        # expected facts the 16-bit tier found and this tier did not
    smaller: float   # times smaller than the 16-bit file

    def describe(self) -> str:
        return (f"{self.identical / self.questions:.0%} of {self.questions} answers identical to the 16-bit tier's, "
                f"{self.changed} with a number or name changed ({self.changed / self.questions:.1%}), "
                f"{self.lost} facts lost; {self.smaller:.1f}x smaller")

    def summary(self) -> str:
        """One short line for --help: "1.6x smaller: 97% identical, 0.5% changed, 0 lost"."""
        return (f"{self.smaller:.1f}x smaller: {self.identical / self.questions:.0%} identical, "
                f"{self.changed / self.questions:.1%} changed, {self.lost} lost")


# `snapkv eval fidelity --dtype float32 --budget 4096` (17 documents and the needle grid, 443 questions), the
# embedded model in fp32 on a 2-core AMD EPYC with AVX-512; 47 minutes. The default (16/8) first, then by
# fidelity.
MEASURED: dict[str, Fidelity] = {
    "16/8": Fidelity(questions=443, identical=438, changed=1, lost=0, smaller=1.28),
    "8": Fidelity(questions=443, identical=418, changed=12, lost=0, smaller=1.77),
    "16/4": Fidelity(questions=443, identical=346, changed=69, lost=4, smaller=1.56),
    "16/3": Fidelity(questions=443, identical=278, changed=102, lost=7, smaller=1.64),
    "8/4": Fidelity(questions=443, identical=343, changed=73, lost=4, smaller=2.36),
    "4/3": Fidelity(questions=443, identical=187, changed=177, lost=20, smaller=4.08),
    "3/2+20%@8/4": Fidelity(questions=443, identical=153, changed=226, lost=27, smaller=4.29),
}


def measured_tiers() -> str:
    """Every measured tier with its summary, for --help: "16/8 1.3x smaller: ...; 8 1.8x smaller: ..."."""
    return "; ".join(f"{bits} {measured.summary()}" for bits, measured in MEASURED.items())


def fidelity_of(bits: "Bits | int | str") -> Fidelity | None:
    """The measured fidelity of a stored precision, or None where it was not measured."""
    try:
        text = str(Bits.parse(bits))
    except ValueError:
        return None
    if text == "16":
        return None
    return MEASURED.get(text)
