"""Sticky A/B assignment the mesh can evaluate: a regex on a key's last two characters picks its revision. Pure.

Istio's weighted routes choose per request, and Envoy's consistent hash chooses a host, not a revision subset, so
a user cannot be kept on one revision by weights. A header match can: the candidate's route matches keys whose
last two characters fall in a fixed set of buckets. With an alphabet of B characters there are B² buckets; the
first n of them (in the alphabet's order) go to the candidate, n = round(percent/100 · B²), written as at most
two character-class alternatives so the RE2 program stays small (Envoy refuses programs over 100). For keys whose
last two characters are uniform over the alphabet (random ids, UUIDs, hashes) the candidate's share of users is
n/B² — within 1/(2B²) of the share asked for; keys that are not (sequential ids, names) can be far off, and a key
missing from the request sends it to the stable revision.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.api.v1alpha1 import AbTestSpec, KeyAlphabet

ALPHABETS: dict[KeyAlphabet, str] = {
    "hex": "0123456789abcdef",
    "alphanumeric": "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
    "digits": "0123456789",
}


@dataclass(frozen=True)
class Buckets:
    """The candidate's buckets: the regex its keys end with, and the share of uniform keys it takes."""

    tail: str
    """An RE2 fragment matching the last two characters of a candidate key."""
    share: float
    """Percent of keys (uniform over the alphabet) the candidate gets."""
    buckets: int
    of: int


def _char_class(chars: str) -> str:
    """`chars` (in code-point order) as one RE2 class, consecutive runs written as ranges."""
    runs: list[str] = []
    start = prev = chars[0]
    for char in chars[1:] + "\0":
        if ord(char) == ord(prev) + 1:
            prev = char
            continue
        runs.append(start if start == prev else f"{start}{prev}" if ord(prev) == ord(start) + 1 else f"{start}-{prev}")
        start = prev = char
    return f"[{''.join(runs)}]"


def buckets(alphabet: KeyAlphabet, percent: float) -> Buckets:
    chars = ALPHABETS[alphabet]
    size = len(chars)
    total = size * size
    n = min(max(round(percent / 100 * total), 1), total - 1)
    full, rest = divmod(n, size)
    alternatives = []
    if full:
        alternatives.append(_char_class(chars[:full]) + _char_class(chars))
    if rest:
        alternatives.append(chars[full] + _char_class(chars[:rest]))
    tail = alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"
    return Buckets(tail=tail, share=100 * n / total, buckets=n, of=total)


def key_match(ab: AbTestSpec) -> dict[str, dict[str, str]]:
    """The Istio header match for the candidate's keys: the header's value ends in a candidate bucket, or the
    Cookie header holds the cookie with such a value (cookies are separated by ';' and optional spaces)."""
    tail = buckets(ab.key_alphabet, ab.percent).tail
    if ab.key.header is not None:
        return {ab.key.header: {"regex": f".*{tail}"}}
    name = "".join(char if char.isalnum() else f"\\{char}" for char in ab.key.cookie or "")
    return {"cookie": {"regex": f"(?:.*;\\s*)?{name}=[^;]*{tail}(?:;.*)?"}}
