"""Key templates of the re-layout rules: literal text and placeholders, matched whole against a key and filled back.

``{name}`` matches a non-empty run of characters without a dot, ``{*name}`` any non-empty run, and a rule's layer
placeholder ``{i}`` a decimal integer without leading zeros. Matching never backtracks polynomially: a checkpoint's
keys are input, and a key built to make a template backtrack must cost time linear in its length.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from ..errors import RelayoutError

__all__ = ["KeyTemplate", "same_placeholders", "LAYER"]

_PLACEHOLDER = re.compile(r"\{(\*?)([A-Za-z_][A-Za-z0-9_]*)\}")
LAYER = "i"  # the placeholder of Stack's and Unstack's per-layer keys: a decimal integer


class KeyTemplate:
    """A key template: literal text and placeholders, matched whole against a key. A template of one placeholder runs
    as an anchored regular expression; one of several, whose backtracking a long key would make polynomial in its
    length (``{*a}.{*b}.{*c}.w`` against 3000 characters of ``a.a.a...``: minutes), by :meth:`_scan`, in time
    linear in the key's length, capturing what the regular expression would (each placeholder, first to last, as long
    as the rest still matches)."""

    __slots__ = ("text", "names", "regex", "parts", "kinds", "literals")

    def __init__(self, text: str, layer: bool = False) -> None:
        if not isinstance(text, str) or not text:
            raise RelayoutError(f"a key template must be a non-empty string, not {text!r}")
        self.text = text
        self.names: dict[str, bool] = {}  # placeholder -> whether it matches dots too ({*name})
        pattern: list[str] = []
        self.parts: list = []  # literal strings and (name,) placeholders, to fill
        self.kinds: list = []  # per part: a literal string, or (name, kind) with kind "*" ({*name}), "." ({name}), "i" ({i})
        pos = 0
        for m in _PLACEHOLDER.finditer(text):
            self._literal(text[pos:m.start()], pattern)
            star, name = m.group(1) == "*", m.group(2)
            if name in self.names:
                raise RelayoutError(f"template {text!r} uses placeholder {{{name}}} twice; give each its own name")
            self.names[name] = star
            if layer and name == LAYER:
                if star:
                    raise RelayoutError(f"template {text!r}: the layer placeholder is {{i}}, not {{*i}}")
                group, kind = "0|[1-9][0-9]*", "i"
            else:
                group, kind = (".+", "*") if star else ("[^.]+", ".")
            pattern.append(f"(?P<{name}>{group})")
            self.parts.append((name,))
            self.kinds.append((name, kind))
            pos = m.end()
        self._literal(text[pos:], pattern)
        self.regex = re.compile("".join(pattern)) if len(self.names) < 2 else None
        self.literals = [k for k in self.kinds if isinstance(k, str)]

    def _literal(self, chunk: str, pattern: list[str]) -> None:
        if "{" in chunk or "}" in chunk:
            raise RelayoutError(f"template {self.text!r}: a brace outside a placeholder ({{name}} or {{*name}}, "
                                "a name of letters, digits and underscores)")
        if chunk:
            pattern.append(re.escape(chunk))
            self.parts.append(chunk)
            self.kinds.append(chunk)

    def match(self, key: str) -> Optional[dict[str, str]]:
        if self.regex is not None:
            m = self.regex.fullmatch(key)
            return None if m is None else m.groupdict()
        kinds = self.kinds
        if isinstance(kinds[0], str) and not key.startswith(kinds[0]) or isinstance(kinds[-1], str) and not key.endswith(kinds[-1]):
            return None
        if any(lit not in key for lit in self.literals):
            return None
        return self._scan(key)

    def _scan(self, key: str) -> Optional[dict[str, str]]:
        """The match of ``key``, in time linear in its length (times the parts): which positions each part can
        start from and still match to the end, computed from the last part back; then, from the first part on,
        each placeholder the longest run from which the rest matches (the regular expression's greedy choice)."""
        n, kinds = len(key), self.kinds
        ok = [bytearray(n + 1) for _ in range(len(kinds) + 1)]  # ok[j][p]: parts j.. match key[p:] whole
        ok[-1][n] = 1
        for j in range(len(kinds) - 1, -1, -1):
            part, after, here = kinds[j], ok[j + 1], ok[j]
            if isinstance(part, str):
                width = len(part)
                for q in range(width, n + 1):
                    if after[q] and key.startswith(part, q - width):
                        here[q - width] = 1
                continue
            kind, reach = part[1], False  # reach: an end in the run from p + 1 on is allowed
            for p in range(n - 1, -1, -1):
                c = key[p]
                if kind == "i":
                    if "0" <= c <= "9":
                        reach = reach or bool(after[p + 1])
                        here[p] = after[p + 1] if c == "0" else reach
                    else:
                        reach = False
                elif c == ("\n" if kind == "*" else "."):  # what ".+" and "[^.]+" stop at
                    reach = False
                else:
                    reach = reach or bool(after[p + 1])
                    here[p] = reach
        if not ok[0][0]:
            return None
        captures, p = {}, 0
        for j, part in enumerate(kinds):
            if isinstance(part, str):
                p += len(part)
                continue
            name, kind = part
            if kind == "i":
                end = p + 1
                if key[p] != "0":
                    while end < n and "0" <= key[end] <= "9":
                        end += 1
            else:
                end = key.find("\n" if kind == "*" else ".", p)
                end = n if end < 0 else end
            while not ok[j + 1][end]:  # ok[j][p] holds: some end in (p, end] lets the rest match
                end -= 1
            captures[name], p = key[p:end], end
        return captures

    def fill(self, captures: dict[str, Any]) -> str:
        return "".join(p if isinstance(p, str) else str(captures[p[0]]) for p in self.parts)

    def __repr__(self) -> str:
        return repr(self.text)


def same_placeholders(rule: str, a: KeyTemplate, b: KeyTemplate, layer: str = "") -> None:
    """Both sides of a rule name the same placeholders, of the same kind (``layer``: one ``a`` has that ``b`` lacks)."""
    want = {k: v for k, v in a.names.items() if k != layer}
    if layer and layer not in a.names:
        raise RelayoutError(f"{rule}: template {a.text!r} needs the layer placeholder {{{layer}}}")
    if layer and layer in b.names:
        raise RelayoutError(f"{rule}: template {b.text!r} may not use the layer placeholder {{{layer}}}")
    if want != b.names:
        show = lambda names: sorted(("*" if star else "") + n for n, star in names.items())  # noqa: E731
        raise RelayoutError(f"{rule}: templates {a.text!r} and {b.text!r} must use the same placeholders "
                            f"(one has {show(want)}, the other {show(b.names)})")
