"""The facts in an answer, and how two answers to one question differ in them: pure text functions.

    first_sentence(text)            the answer's first sentence ("184.6." ends it, "184.6 m" does not)
    sentence_spans(text)            where each sentence of a text starts and ends (citations' passages)
    facts_of(sentence)              its numbers (digit strings with their decimals) and capitalised names
    compare(reference, other)       which of the reference's facts the other answer lacks or alters, and how
    fact_found(answer, expected)    whether an answer states the expected fact

Used by snapkv.measure.fidelity to judge a stored tier's answers against the 16-bit cache's, and a cut's answers
against the full cache's.
"""

import re
import unicodedata
from dataclasses import dataclass

# A sentence ends at . ! ? followed by white space or the end of the text, or at a line break; "184.6" does
# not end one (the point is followed by a digit).
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")
_SENTENCE_ENDED = re.compile(r"[.!?]\s|\n")  # while an answer streams: the next character seen
# A number as written: 184.6, 190,000, 0.38, 2024, 14:30; a sign or currency is not part of it.
_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")
# A capitalised word (letters of any script, inner apostrophes and hyphens: O'Neill, Saint-Malo).
_CAPITALISED = re.compile(r"\b[^\W\d_][\w'\-]*\b")
# Words that start sentences or are capitalised by habit, not names.
_NOT_NAMES = frozenset(
    "a an the this that these those it its in on at of for from by to with as and or but if when where which who "
    "whom whose what why how there here they their them we our you your he she his her i yes no not "
    "according based during after before since until while also however therefore thus so then".split()
)
# An answer that declines: said instead of a fact.
_REFUSAL = re.compile(
    r"\b(not (?:mentioned|stated|specified|provided|given|available|clear|known)|no (?:information|mention)|"
    r"(?:does|do|did) not (?:say|state|mention|specify|provide)|cannot (?:find|determine|answer)|"
    r"can't (?:find|determine|answer)|unknown|i'm sorry|i am sorry|unable to)\b",
    re.IGNORECASE,
)


# Words a point follows without ending the sentence: "Northwind Tidal Energy Ltd. is", "Dr. Raman", "J. Smith".
_ABBREVIATIONS = frozenset("ltd inc co corp plc llc mr mrs ms dr prof st mt no nos vs etc approx fig jr sr dept est "
                           "jan feb mar apr jun jul aug sep sept oct nov dec e.g i.e".split())


def _sentence_end(text: str, pattern: re.Pattern) -> int | None:
    """Where the first sentence of `text` ends (the index after its last character), or None."""
    for match in pattern.finditer(text):
        if match.group().startswith("."):
            word = re.search(r"([\w.]+)$", text[: match.start()])
            word = word.group(1) if word else ""
            if word.casefold() in _ABBREVIATIONS or (len(word) == 1 and word.isupper()):
                continue
        return match.start() + 1
    return None


def _word_before(text: str, index: int) -> str:
    """The run of word characters and points that ends at `index` ("Ltd" in "Energy Ltd."), read backwards."""
    start = index
    while start > 0 and (text[start - 1].isalnum() or text[start - 1] in "._"):
        start -= 1
    return text[start:index]


def _continues(text: str, index: int) -> bool:
    """Whether the line starting at `index` carries on the one before it: it goes on in lower case, or with a number
    after a word in lower case or a comma ("up from 121.3 million pounds in\n2022, an increase")."""
    while index < len(text) and text[index] in " \t":
        index += 1
    if index >= len(text):
        return False
    if text[index].islower():
        return True
    if not text[index].isdigit():
        return False
    last = index - 1  # the last visible character before the line break
    while last >= 0 and text[last].isspace():
        last -= 1
    return last >= 0 and (text[last].islower() or text[last] == ",")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every sentence of `text`, as first_sentence ends one, white space around each left out, empty
    ones skipped. A line break ends one too, unless the next line goes on in lower case (prose wrapped at a width,
    as PDFs and plain-text files wrap it: "was 96.4\nmillion pounds")."""
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        if match.group() == "\n" and _continues(text, match.end()):
            continue
        if match.group() == ".":
            word = _word_before(text, match.start())
            if word.casefold() in _ABBREVIATIONS or (len(word) == 1 and word.isupper()):
                continue
        spans.append((start, match.start() + 1))
        start = match.start() + 1
    spans.append((start, len(text)))
    stripped = []
    for begin, end in spans:
        while begin < end and text[begin].isspace():
            begin += 1
        while end > begin and text[end - 1].isspace():
            end -= 1
        if begin < end:
            stripped.append((begin, end))
    return stripped


def first_sentence(text: str) -> str:
    """The text up to the end of its first sentence (all of it where no sentence ends), stripped."""
    text = text.strip()
    end = _sentence_end(text, _SENTENCE_END)
    return (text[:end] if end is not None else text).strip()


def sentence_complete(text: str) -> bool:
    """True once a streamed answer holds its whole first sentence (a sentence end and the character after it
    seen): generating it can stop there."""
    return _sentence_end(text.lstrip(), _SENTENCE_ENDED) is not None


def numbers_of(text: str) -> list[str]:
    """The numbers in `text` as digit strings, thousands separators dropped: "190,000" -> "190000"."""
    numbers = []
    for match in _NUMBER.finditer(text):
        number = match.group()
        if "," in number and all(len(group) == 3 for group in number.split(",")[1:]):
            number = number.replace(",", "")
        numbers.append(number.rstrip(".,:"))
    return numbers


def names_of(text: str) -> list[str]:
    """Runs of capitalised words (a name of one or more words), leading habitual capitals dropped:
    "The chair is Eilidh MacLeod" -> ["Eilidh MacLeod"]."""
    names, run = [], []
    words = list(_CAPITALISED.finditer(text))
    for index, match in enumerate(words):
        word = match.group()
        gap = text[words[index - 1].end(): match.start()] if index else ""
        if run and gap.strip():  # punctuation between two words ends a run
            names.append(" ".join(run))
            run = []
        if word[0].isupper() and word.lower() not in _NOT_NAMES:
            run.append(word)
        elif run:
            names.append(" ".join(run))
            run = []
    if run:
        names.append(" ".join(run))
    return names


@dataclass(frozen=True)
class Facts:
    numbers: tuple[str, ...]
    names: tuple[str, ...]


def facts_of(sentence: str) -> Facts:
    return Facts(tuple(numbers_of(sentence)), tuple(names_of(sentence)))


@dataclass(frozen=True)
class Change:
    """A fact of the reference answer that the other answer does not state.

    kind: "number" or "name"; how: "altered" (the other answer states another fact of the kind instead: a
    digit or a name changed) or "missing" (it says nothing in its place)."""

    kind: str
    reference: str
    how: str
    instead: str = ""

    def describe(self) -> str:
        return f"{self.reference} -> {self.instead}" if self.how == "altered" else f"{self.reference} missing"


def _normal(text: str) -> str:
    """Case, Unicode forms and punctuation aside: "Dr. Helka Raudsepp's" -> "dr helka raudsepp s"."""
    return " ".join(re.sub(r"[^\w]+", " ", unicodedata.normalize("NFKC", text).casefold()).split())


def compare(reference: str, other: str, question: str = "") -> list[Change]:
    """The numbers and names in `reference`'s first sentence that `other`'s first sentence lacks or alters.

    Facts the question itself states are not counted: an answer that does not repeat "52 weeks" from "How many
    completed the full 52 weeks?" has not changed a fact."""
    ours, theirs = facts_of(first_sentence(reference)), facts_of(first_sentence(other))
    asked = facts_of(question)
    asked_text = f" {_normal(question)} "
    changes = []
    extra_numbers = [n for n in theirs.numbers if n not in ours.numbers]
    for number in ours.numbers:
        if number not in theirs.numbers and number not in asked.numbers:
            instead = extra_numbers.pop(0) if extra_numbers else ""
            changes.append(Change("number", number, "altered" if instead else "missing", instead))
    their_text = f" {_normal(first_sentence(other))} "
    our_names = {_normal(m) for m in ours.names}
    extra_names = [n for n in theirs.names if _normal(n) not in our_names and f" {_normal(n)} " not in asked_text]
    for name in ours.names:
        if f" {_normal(name)} " not in their_text and f" {_normal(name)} " not in asked_text:
            instead = extra_names.pop(0) if extra_names else ""
            changes.append(Change("name", name, "altered" if instead else "missing", instead))
    return changes


def is_refusal(text: str) -> bool:
    """True where an answer declines instead of stating something."""
    return bool(_REFUSAL.search(first_sentence(text)))


def how_changed(reference: str, other: str, question: str = "") -> str:
    """One word for how `other` differs from `reference` (first sentences): "same", "wording" (other words, the
    same facts), "number", "name", "missing" (a fact left out), or "refusal" (declines where the reference
    answered)."""
    if first_sentence(reference) == first_sentence(other):
        return "same"
    if is_refusal(other) and not is_refusal(reference):
        return "refusal"
    changes = compare(reference, other, question)
    for kind in ("number", "name"):
        if any(c.kind == kind and c.how == "altered" for c in changes):
            return kind
    return "missing" if changes else "wording"


def fact_found(answer: str, expected: str) -> bool:
    """True if the answer's first sentence states `expected`: a number as a whole number (121.3 is not in
    1121.3 or 121.35), other facts as words, case and thousands separators aside."""
    sentence = first_sentence(answer)
    expected_numbers = numbers_of(expected)
    if expected_numbers and re.fullmatch(r"[\d.,:]+", expected.strip()):
        return expected_numbers[0] in numbers_of(sentence)
    return f" {_normal(expected)} " in f" {_normal(sentence)} "
