"""The facts in an answer, and how two answers to one question differ in them: pure text functions.

    first_sentence(text)            the answer's first sentence ("184.6." ends it, "184.6 m" does not)
    sentence_spans(text)            where each sentence of a text starts and ends (citations' passages)
    facts_of(text)                  its numbers (in order, signed, number words as digits), capitalised names and
                                    lower-case facts (million, rose/fell, £, per cent)
    compare(reference, other)       every fact the other answer lacks, alters, adds or reorders, and how
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
# Number words, read as the digits they stand for: "three" and "3" are one fact, "three" and "four" two.
_UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
          "seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
_NUMBER_WORDS = {word: value for value, word in enumerate(_UNITS)}
_NUMBER_WORDS.update({word: 10 * (index + 2) for index, word in enumerate(_TENS)})
_NUMBER_WORD = re.compile(r"\b(" + "|".join(_TENS) + r")[- ](" + "|".join(_UNITS[1:10]) + r")\b|\b("
                          + "|".join(sorted(_NUMBER_WORDS, key=len, reverse=True)) + r")\b", re.IGNORECASE)
# Words that start sentences or are capitalised by habit, not names.
_NOT_NAMES = frozenset(
    "a an the this that these those it its in on at of for from by to with as and or but if when where which who "
    "whom whose what why how there here they their them we our you your he she his her i yes no not "
    "according based during after before since until while also however therefore thus so then".split()
) | frozenset(_UNITS) | frozenset(_TENS)
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


# A sign belongs to a number where it stands alone before it ("-4.2", "minus 3", "−7"), not in a range ("2019-2020").
_SIGN_BEFORE = re.compile(r"(?:(?:^|[^\w.,:])[-\u2212]|\bminus\s+)$", re.IGNORECASE)
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # 190,000 and 1,962.7
# Lower-case words that carry a fact of their own, each read as one canonical term: a magnitude, a direction, a
# currency, a share. "184.6 million" and "184.6 billion" differ in one; so do "rose" and "fell".
_TERMS = {
    "thousand": "thousand", "thousands": "thousand", "million": "million", "millions": "million", "mn": "million",
    "billion": "billion", "billions": "billion", "bn": "billion", "trillion": "trillion", "hundred": "hundred",
    "hundreds": "hundred", "dozen": "dozen",
    "%": "percent", "percent": "percent", "per cent": "percent", "percentage": "percent",
    "£": "GBP", "pound": "GBP", "pounds": "GBP", "sterling": "GBP", "pence": "GBP pence", "penny": "GBP pence",
    "$": "USD", "dollar": "USD", "dollars": "USD", "cent": "cents", "cents": "cents",
    "€": "EUR", "euro": "EUR", "euros": "EUR", "¥": "JPY", "yen": "JPY",
    "rose": "up", "rise": "up", "rises": "up", "risen": "up", "rising": "up", "increase": "up", "increased": "up",
    "increases": "up", "increasing": "up", "grew": "up", "grow": "up", "grown": "up", "growth": "up", "gain": "up",
    "gained": "up", "higher": "up", "up from": "up", "up by": "up", "up to": "up",
    "fell": "down", "fall": "down", "falls": "down", "fallen": "down", "falling": "down", "decrease": "down",
    "decreased": "down", "decreases": "down", "decline": "down", "declined": "down", "drop": "down",
    "dropped": "down", "lower": "down", "reduced": "down", "reduction": "down", "down from": "down",
    "down by": "down", "down to": "down",
}
_TERM = re.compile(r"[%£$€¥]|\b(?:" + "|".join(re.escape(t) for t in sorted(_TERMS, key=len, reverse=True)
                                             if t[0].isalpha()) + r")\b", re.IGNORECASE)


def numbers_of(text: str) -> list[str]:
    """The numbers in `text` in their order, as digit strings: thousands separators dropped ("190,000" -> "190000"),
    a sign kept where it stands alone before the number ("-4.2", "minus 4.2"), number words as digits ("three" ->
    "3", "sixty-six" -> "66")."""
    found = []  # (where, number)
    for match in _NUMBER.finditer(text):
        number = match.group()
        if _THOUSANDS.fullmatch(number.rstrip(".,:")):
            number = number.replace(",", "")
        negative = _SIGN_BEFORE.search(text[max(0, match.start() - 8): match.start()]) is not None
        found.append((match.start(), ("-" if negative else "") + number.rstrip(".,:")))
    for match in _NUMBER_WORD.finditer(text):
        if match.group(3):
            value = _NUMBER_WORDS[match.group(3).lower()]
        else:
            value = _NUMBER_WORDS[match.group(1).lower()] + _NUMBER_WORDS[match.group(2).lower()]
        found.append((match.start(), str(value)))
    return [number for _, number in sorted(found)]


def terms_of(text: str) -> list[str]:
    """The lower-case facts in `text` as canonical terms, in order: magnitudes ("million"), directions ("up" for
    rose/increased/up from, "down" for fell/declined), currencies ("GBP" for £/pounds), "percent"."""
    terms = []
    for match in _TERM.finditer(text):
        word = " ".join(match.group().lower().split())
        terms.append(_TERMS[word])
    return terms


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
    numbers: tuple[str, ...]  # in the order written
    names: tuple[str, ...]
    terms: tuple[str, ...]    # lower-case facts (terms_of)


def facts_of(text: str) -> Facts:
    return Facts(tuple(numbers_of(text)), tuple(names_of(text)), tuple(terms_of(text)))


@dataclass(frozen=True)
class Change:
    """A fact on which two answers differ.

    kind: "number", "name" or "term" (a lower-case fact: terms_of).
    how:  "altered" (the other answer states another fact of the kind in its place), "missing" (it says nothing in
          its place), "added" (it states a fact of the kind the reference does not), or "reordered" (the same
          numbers in another order: 12 ... 13 against 13 ... 12).
    """

    kind: str
    reference: str
    how: str
    instead: str = ""

    def describe(self) -> str:
        if self.how == "missing":
            return f"{self.reference} missing"
        if self.how == "added":
            return f"+{self.instead}"
        return f"{self.reference} -> {self.instead}"


def _normal(text: str) -> str:
    """Case, Unicode forms and punctuation aside: "Dr. Helka Raudsepp's" -> "dr helka raudsepp s"."""
    return " ".join(re.sub(r"[^\w]+", " ", unicodedata.normalize("NFKC", text).casefold()).split())


def _unmatched(ours: list[str], theirs: list[str]) -> tuple[list[str], list[str]]:
    """What each list holds that the other does not, counting repeats: ([ours only], [theirs only]), in order."""
    only_theirs, only_ours = list(theirs), []
    for item in ours:
        if item in only_theirs:
            only_theirs.remove(item)
        else:
            only_ours.append(item)
    return only_ours, only_theirs


def _paired(kind: str, missing: list[str], added: list[str]) -> list[Change]:
    """Missing facts paired in order with added ones of the same kind (altered); the rest missing or added."""
    changes = [Change(kind, ours, "altered", theirs) for ours, theirs in zip(missing, added)]
    changes += [Change(kind, ours, "missing") for ours in missing[len(added):]]
    changes += [Change(kind, "", "added", theirs) for theirs in added[len(missing):]]
    return changes


def compare(reference: str, other: str, question: str = "") -> list[Change]:
    """Every fact on which `other` differs from `reference` (whole texts: callers pass as much of the answers as they
    compare): numbers in their order, capitalised names, lower-case facts (terms_of).

    A fact the question states may be left out without counting (an answer need not repeat "52 weeks" from "How
    many completed the full 52 weeks?"), and repeated from the question without counting; stating another in its
    place counts (2023 in the question and the reference, 2022 in the answer)."""
    ours, theirs, asked = facts_of(reference), facts_of(other), facts_of(question)
    changes = []
    missing, added = _unmatched(list(ours.numbers), list(theirs.numbers))
    missing = [n for n in missing if n not in asked.numbers]
    added = [n for n in added if n not in asked.numbers]
    changes += _paired("number", missing, added)
    if not changes:  # the same numbers: in the same order?
        shared_ours = [n for n in ours.numbers if n in theirs.numbers]
        shared_theirs = [n for n in theirs.numbers if n in ours.numbers]
        if shared_ours != shared_theirs:
            changes.append(Change("number", " ".join(shared_ours), "reordered", " ".join(shared_theirs)))
    asked_text = f" {_normal(question)} "
    our_text, their_text = f" {_normal(reference)} ", f" {_normal(other)} "
    missing_names = [name for name in dict.fromkeys(ours.names)
                     if f" {_normal(name)} " not in their_text and f" {_normal(name)} " not in asked_text]
    added_names = [name for name in dict.fromkeys(theirs.names)
                   if f" {_normal(name)} " not in our_text and f" {_normal(name)} " not in asked_text]
    changes += _paired("name", missing_names, added_names)
    missing, added = _unmatched(sorted(set(ours.terms)), sorted(set(theirs.terms)))
    changes += _paired("term", [t for t in missing if t not in asked.terms], [t for t in added if t not in asked.terms])
    return changes


def is_refusal(text: str) -> bool:
    """True where an answer declines instead of stating something."""
    return bool(_REFUSAL.search(first_sentence(text)))


def how_changed(reference: str, other: str, question: str = "") -> str:
    """One word for how `other` differs from `reference` (whole texts): "same", "wording" (other words, the same
    facts), "number", "name" or "term" (a fact of that kind altered or added), "order" (the same numbers reordered),
    "missing" (a fact left out), or "refusal" (declines where the reference answered)."""
    if reference.strip() == other.strip():
        return "same"
    if is_refusal(other) and not is_refusal(reference):
        return "refusal"
    changes = compare(reference, other, question)
    for kind in ("number", "name", "term"):
        if any(c.kind == kind and c.how in ("altered", "added") for c in changes):
            return kind
    if any(c.how == "reordered" for c in changes):
        return "order"
    return "missing" if changes else "wording"


def fact_found(answer: str, expected: str) -> bool:
    """True if the answer's first sentence states `expected`: a number as a whole number (121.3 is not in
    1121.3 or 121.35), other facts as words, case and thousands separators aside."""
    sentence = first_sentence(answer)
    expected_numbers = numbers_of(expected)
    if expected_numbers and re.fullmatch(r"[\d.,:]+", expected.strip()):
        return expected_numbers[0] in numbers_of(sentence)
    return f" {_normal(expected)} " in f" {_normal(sentence)} "
