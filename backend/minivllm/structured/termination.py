"""Which rules of a Lark grammar can never finish: a rule whose every alternative refers back to a
rule that cannot finish (`a: "x" a`, no base case) derives no finite text. llguidance accepts such
a grammar and then fails while generating (its parser runs out of items), so the server refuses
it up front, naming the rules.

The check reads only the rule structure (names, alternatives, groups, repetition). Whatever it does
not understand (templates, unusual syntax) makes it answer "no finding": it may miss a grammar that
cannot finish, never refuse one that can. llguidance has validated the syntax before it runs."""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\r]+|//[^\n]*)
  | (?P<newline>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><[^<>\n]*>)
  | (?P<grammar_ref>@[A-Za-z_][A-Za-z0-9_]*)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>\d+)
  | (?P<punct>->|\.\.|[:|()\[\]{}?*+~,.!=])
""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str


class _Unknown(Exception):
    """Syntax this check does not read: no finding."""


def never_finishing_rules(lark: str) -> list[str]:
    """The rules reachable from `start` that can never finish, `start` first; [] when every rule
    can finish or the grammar uses syntax this check does not read."""
    try:
        rules = _rules(_tokens(lark))
    except _Unknown:
        return []
    if "start" not in rules:
        return []
    finishing = _finishing(rules)
    if "start" in finishing:
        return []
    return [name for name in _reachable(rules, "start") if name not in finishing]


# ---- reading the rules -------------------------------------------------------------------------


def _tokens(text: str) -> list[_Tok]:
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _Unknown
        kind = m.lastgroup
        if kind == "directive":
            end = _directive_end(text, m.end())
            if m.group() in ("%json", "%regex"):  # an inline terminal: finishes by itself
                tokens.append(_Tok("string", text[m.start() : end]))
            pos = end
            continue
        if kind != "space":
            tokens.append(_Tok(kind, m.group()))
        pos = m.end()
    return tokens


def _directive_end(text: str, pos: int) -> int:
    """Past a directive's argument: a `{...}` block (JSON, braces balanced outside strings), or the line."""
    brace = re.compile(r"[ \t]*\{").match(text, pos)
    if brace is None:
        newline = text.find("\n", pos)
        return len(text) if newline < 0 else newline
    depth, i, in_string = 0, brace.end() - 1, False
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise _Unknown


def _rules(tokens: list[_Tok]) -> dict[str, list[list]]:
    """name -> its alternatives, each a list of items (see `_finishes`)."""
    rules: dict[str, list[list]] = {}
    i = 0
    while i < len(tokens):
        if tokens[i].kind == "newline":
            i += 1
            continue
        name, i = _definition_head(tokens, i)
        body_end = _body_end(tokens, i)
        body = [t for t in tokens[i:body_end] if t.kind != "newline"]
        alternatives, j = _alternatives(body, 0)
        if j != len(body):  # a stray closing bracket: not read here
            raise _Unknown
        if name in rules:  # a second definition: Lark's rules differ here (overrides, templates)
            raise _Unknown
        rules[name] = alternatives
        i = body_end
    return rules


def _definition_head(tokens: list[_Tok], i: int) -> tuple[str, int]:
    """`[?!]name[.priority]:` -> (name, index past the colon)."""
    if tokens[i].text in ("?", "!"):
        i += 1
    if i >= len(tokens) or tokens[i].kind != "name":
        raise _Unknown
    name = tokens[i].text
    i += 1
    if i + 1 < len(tokens) and tokens[i].text == "." and tokens[i + 1].kind == "number":
        i += 2
    if i >= len(tokens) or tokens[i].text != ":":
        raise _Unknown  # attributes, templates, `->` outside a rule...: not read here
    return name, i + 1


def _body_end(tokens: list[_Tok], i: int) -> int:
    """A rule's body runs to a newline outside brackets not followed by a `|` continuation."""
    depth = 0
    while i < len(tokens):
        t = tokens[i]
        if t.text in ("(", "[", "{"):
            depth += 1
        elif t.text in (")", "]", "}"):
            depth -= 1
        elif t.kind == "newline" and depth == 0:
            following = next((u for u in tokens[i:] if u.kind != "newline"), None)
            if following is None or following.text != "|":
                return i
        i += 1
    return i


def _alternatives(tokens: list[_Tok], i: int) -> tuple[list[list], int]:
    alternatives, items = [], []
    while i < len(tokens) and tokens[i].text not in (")", "]"):
        t = tokens[i]
        if t.text == "|":
            alternatives.append(items)
            items, i = [], i + 1
            continue
        if t.text == "->":  # an alias names the alternative's tree node: nothing to generate
            i += 2
            continue
        item, i = _atom(tokens, i)
        item, i = _repetition(tokens, i, item)
        items.append(item)
    alternatives.append(items)
    return alternatives, i


def _atom(tokens: list[_Tok], i: int) -> tuple[object, int]:
    t = tokens[i]
    if t.text in ("(", "["):
        inner, j = _alternatives(tokens, i + 1)
        if j >= len(tokens) or tokens[j].text != {"(": ")", "[": "]"}[t.text]:
            raise _Unknown
        return (("optional", inner) if t.text == "[" else ("group", inner)), j + 1
    if t.kind in ("string", "regex", "special", "grammar_ref"):
        if i + 2 < len(tokens) and tokens[i + 1].text == ".." and tokens[i + 2].kind == "string":
            return True, i + 3  # a character range
        return True, i + 1
    if t.kind == "name":
        if i + 1 < len(tokens) and tokens[i + 1].text == "{":
            raise _Unknown  # a template use
        return ("rule", t.text), i + 1
    raise _Unknown


def _repetition(tokens: list[_Tok], i: int, item: object) -> tuple[object, int]:
    """`?` and `*` (and a count that may be 0) can always stop: the item then finishes."""
    if i >= len(tokens):
        return item, i
    op = tokens[i].text
    if op in ("?", "*"):
        return True, i + 1
    if op == "+":
        return item, i + 1
    if op == "~":  # `item ~ n` or `item ~ n..m`
        if i + 1 >= len(tokens) or tokens[i + 1].kind != "number":
            raise _Unknown
        low, i = int(tokens[i + 1].text), i + 2
        if i + 1 < len(tokens) and tokens[i].text == ".." and tokens[i + 1].kind == "number":
            i += 2
        return (True if low == 0 else item), i
    if op == "{":  # llguidance's `item{n}`, `item{n,}`, `item{n,m}`, `item{,m}`
        j = i + 1
        low = int(tokens[j].text) if j < len(tokens) and tokens[j].kind == "number" else 0
        while j < len(tokens) and tokens[j].text != "}":
            if tokens[j].kind != "number" and tokens[j].text != ",":
                raise _Unknown
            j += 1
        if j >= len(tokens):
            raise _Unknown
        return (True if low == 0 else item), j + 1
    return item, i


# ---- which rules finish -------------------------------------------------------------------------


def _finishing(rules: dict[str, list[list]]) -> set[str]:
    """The least fixed point: a rule finishes when one of its alternatives has only finishing items.
    A name the grammar does not define (a terminal imported, a built-in) counts as finishing."""
    finishing: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in rules.items():
            if name not in finishing and _any_finishes(alternatives, rules, finishing):
                finishing.add(name)
                changed = True
    return finishing


def _finishes(item: object, rules: dict[str, list[list]], finishing: set[str]) -> bool:
    if item is True:
        return True
    kind, value = item  # type: ignore[misc]
    if kind == "optional":
        return True
    if kind == "rule":
        return value in finishing or value not in rules
    return _any_finishes(value, rules, finishing)  # a group


def _any_finishes(alternatives: list[list], rules: dict[str, list[list]], finishing: set[str]) -> bool:
    return any(all(_finishes(item, rules, finishing) for item in alt) for alt in alternatives)


def _reachable(rules: dict[str, list[list]], start: str) -> list[str]:
    order, todo = [], [start]
    while todo:
        name = todo.pop()
        if name in order or name not in rules:
            continue
        order.append(name)
        todo.extend(reversed(_names(rules[name])))
    return order


def _names(alternatives: list[list]) -> list[str]:
    names = []
    for alt in alternatives:
        for item in alt:
            if item is True:
                continue
            kind, value = item
            names.extend([value] if kind == "rule" else _names(value))
    return names
