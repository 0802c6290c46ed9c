"""Tensor-name patterns matched in bounded time: globs and regexes run on RE2, which never backtracks.

Python's `re` backtracks: `([a-z_.0-9]+)*!` or `(a+)+$` take time exponential in a name's length, and
hold the GIL while they do (a whole server process stalls). RE2 (`google-re2`) matches in time linear
in the name's length whatever the pattern. A rule's regex is read with Python's syntax (what users
write, what error messages quote) and then compiled for RE2:

* refused, with the reason, because only a backtracking engine can run them: backreferences (`\\1`,
  `(?P=name)`), lookarounds (`(?=`, `(?!`, `(?<=`, `(?<!`), atomic groups (`(?>...)`), possessive
  quantifiers (`a*+`), conditionals (`(?(1)a|b)`); refused by RE2's own syntax check: `(?x)`, `(?a)`,
  `(?#...)`, `\\u` / `\\N{...}` escapes, counted repeats over 1000;
* rewritten where the same text means something else to RE2: `\\Z` -> `\\z`, `{,n}` -> `{0,n}`, a `[`
  inside a class -> `\\[` (RE2 would read `[:alpha:]` there as a POSIX class);
* `\\d \\w \\s` (and `\\D \\W \\S`) are written as the Unicode classes Python means (RE2's are ASCII);
  `\\W` or `\\S` inside a `[...]` class cannot be, and is refused; `\\b` and `\\B` stay RE2's ASCII word
  boundaries (the same as Python's for ASCII names).

Globs mean what `fnmatch.fnmatchcase` means (`fnmatch.translate`'s grammar; its atomic groups, which
RE2 lacks, become plain `.*`: the same names match). A pattern that is one plain name (`re.escape` of it,
or a glob without `*?[`) is matched by string comparison. `FirstMatch` says, for many names, which of
many patterns is the first to match each: RE2's `Set` (one DFA pass per name finds every pattern that
matches) plus a dict of the plain names.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import re2
from re2 import _re2

if sys.version_info >= (3, 11):
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser
else:  # pragma: no cover
    import sre_constants as _sre
    import sre_parse as _parser

_BOTH = _re2.RE2.Anchor.ANCHOR_BOTH
_NEVER = r"[^\x00-\x{10FFFF}]"  # a class no character is in
_SET_MEMORY = 64 << 20  # RE2's budget for a combined DFA, used as needed (a Set past it: see `FirstMatch`)

_REFUSED = {  # parse-tree opcodes only a backtracking engine runs -> what to tell the user
    "GROUPREF": "a backreference (\\1 or (?P=name))",
    "GROUPREF_EXISTS": "a conditional group ((?(N)yes|no))",
    "ASSERT": "a lookahead or lookbehind ((?=...), (?<=...))",
    "ASSERT_NOT": "a negative lookahead or lookbehind ((?!...), (?<!...))",
    "ATOMIC_GROUP": "an atomic group ((?>...))",
    "POSSESSIVE_REPEAT": "a possessive quantifier (*+, ++, ?+, {m,n}+)",
}
_REFUSED_OPS = {getattr(_sre, k): v for k, v in _REFUSED.items() if hasattr(_sre, k)}
_REPEATS = {getattr(_sre, k) for k in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(_sre, k)}


class PatternError(ValueError):
    """A pattern that cannot be matched in bounded time (or is no regex at all); the message says why."""


def _options(*, capture: bool = False, memory: int | None = None) -> Any:
    opts = re2.Options()
    opts.log_errors = False
    opts.never_capture = not capture
    if memory is not None:
        opts.max_mem = memory
    return opts


@dataclass(frozen=True)
class Compiled:
    """A pattern ready to match: `source` is its RE2 text; `literal` the one name it matches, if plain."""

    source: str
    literal: str | None
    regexp: Any = None  # the RE2 object (None for a literal)
    prefix: str = ""  # what every match starts with ...
    suffix: str = ""  # ... and ends with: most names that do not match are told by these at once

    def fullmatch(self, name: str) -> bool:
        if self.literal is not None:
            return name == self.literal
        if not (name.startswith(self.prefix) and name.endswith(self.suffix)):
            return False
        data = name.encode("utf-8", "surrogatepass")
        return self.regexp.Match(_BOTH, data, 0, len(data))[0][0] >= 0


def _compile(source: str) -> Any:
    regexp = _re2.RE2(source.encode("utf-8", "surrogatepass"), _options())
    if not regexp.ok():
        raise PatternError(f"RE2 cannot compile it: {regexp.error().decode('utf-8', 'replace')} (RE2 has no (?x), (?a), "
                           "(?#...), \\u or \\N escapes, nor repeat counts over 1000)")
    return regexp


# --- globs ----------------------------------------------------------------------------------------


def _char(c: str) -> str:
    """One character as an RE2 literal, inside or outside a class."""
    if c.isalnum() or c == "_":
        return c
    if c.isascii() and c.isprintable():
        return "\\" + c
    return f"\\x{{{ord(c):x}}}"


def _glob_class(pat: str, i: int, j: int) -> str:
    """The class `pat[i:j]` (between `[` and `]`), as `fnmatch.translate` reads it."""
    if "-" not in pat[i:j]:
        chunks = [pat[i:j]]
    else:  # split at range hyphens; drop reversed ranges, as fnmatch does
        chunks = []
        k = i + 2 if pat[i] == "!" else i + 1
        while True:
            k = pat.find("-", k, j)
            if k < 0:
                break
            chunks.append(pat[i:k])
            i, k = k + 1, k + 3
        chunk = pat[i:j]
        if chunk:
            chunks.append(chunk)
        else:
            chunks[-1] += "-"
        for k in range(len(chunks) - 1, 0, -1):
            if chunks[k - 1][-1] > chunks[k][0]:
                chunks[k - 1] = chunks[k - 1][:-1] + chunks[k][1:]
                del chunks[k]
    stuff = "-".join(chunks)
    if not stuff:
        return _NEVER
    if stuff == "!":
        return "."
    negate = stuff[0] == "!"
    if negate:
        chunks[0] = chunks[0][1:]
    return ("[^" if negate else "[") + "-".join("".join(map(_char, s)) for s in chunks) + "]"


def _glob_parts(pat: str) -> list[tuple[str, str | None]]:
    """(RE2 fragment, the one character it stands for or None) of each part of a glob."""
    out: list[tuple[str, str | None]] = []
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        i += 1
        if c == "*":
            if not out or out[-1][0] != ".*":
                out.append((".*", None))
        elif c == "?":
            out.append((".", None))
        elif c == "[":
            j = i
            if j < n and pat[j] == "!":
                j += 1
            if j < n and pat[j] == "]":
                j += 1
            while j < n and pat[j] != "]":
                j += 1
            if j >= n:
                out.append(("\\[", "["))
            else:
                out.append((_glob_class(pat, i, j), None))
                i = j + 1
        else:
            out.append((_char(c), c))
    return out


def _ends(chars: list[str | None]) -> tuple[str, str]:
    """The plain characters every match starts with and ends with."""
    k = next((i for i, c in enumerate(chars) if c is None), len(chars))
    m = next((i for i, c in enumerate(reversed(chars)) if c is None), len(chars))
    return "".join(chars[:k]), "".join(chars[len(chars) - m :])  # type: ignore[arg-type]


def glob_source(pat: str) -> str:
    """The RE2 text that fullmatches exactly the names `fnmatch.fnmatchcase(name, pat)` accepts."""
    return "(?s:" + "".join(f for f, _ in _glob_parts(pat)) + ")"


def compile_glob(pat: str) -> Compiled:
    parts = _glob_parts(pat)
    source = "(?s:" + "".join(f for f, _ in parts) + ")"
    if not any(c in pat for c in "*?["):
        return Compiled(source, pat)
    prefix, suffix = _ends([c for _, c in parts])
    return Compiled(source, None, _compile(source), prefix, suffix)


# --- regexes --------------------------------------------------------------------------------------


def _refusal(tree: Any) -> str | None:
    """What in a parsed pattern needs backtracking, or None."""
    for op, av in tree:
        if op in _REFUSED_OPS:
            return _REFUSED_OPS[op]
        if op == _sre.SUBPATTERN:
            subs = [av[-1]]
        elif op in _REPEATS:
            subs = [av[2]]
        elif op == _sre.BRANCH:
            subs = av[1]
        elif op == getattr(_sre, "ATOMIC_GROUP", None):
            subs = [av]
        else:
            continue
        for sub in subs:
            why = _refusal(sub)
            if why is not None:
                return why
    return None


_EMPTY_MIN = re.compile(r"\{,(\d*)\}")
# Python's \s for str: the characters `str.isspace` accepts
_SPACE = r"\x{9}-\x{d}\x{1c}-\x{20}\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}"
# Python's Unicode meaning of \d \w \s and their complements, outside a class and inside one (None: not expressible)
_UNICODE_CLASSES = {
    "d": (r"\p{Nd}", r"\p{Nd}"), "D": (r"\P{Nd}", r"\P{Nd}"),
    "w": (r"[\p{L}\p{N}_]", r"\p{L}\p{N}_"), "W": (r"[^\p{L}\p{N}_]", None),
    "s": (f"[{_SPACE}]", _SPACE), "S": (f"[^{_SPACE}]", None),
}


def _rewrite(p: str) -> str:
    """Python regex text -> the RE2 text that means the same (see the module docstring)."""
    out: list[str] = []
    i, n, in_class = 0, len(p), False
    while i < n:
        c = p[i]
        if c == "\\" and i + 1 < n:
            e = p[i + 1]
            if e in _UNICODE_CLASSES:
                outside, inside = _UNICODE_CLASSES[e]
                if in_class and inside is None:
                    raise PatternError(f"regex has \\{e} inside a [...] class, which RE2 can only read as ASCII; "
                                       f"write the class without it (e.g. [^...] with what it must not hold)")
                out.append(inside if in_class else outside)
            else:
                out.append("\\z" if e == "Z" else p[i : i + 2])
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            out.append("\\[" if c == "[" else c)
            i += 1
            continue
        if c == "[":
            j = i + 1
            if j < n and p[j] == "^":
                j += 1
            out.append(p[i:j])
            if j < n and p[j] == "]":  # a `]` first in a class is one of its characters
                out.append("\\]")
                j += 1
            i, in_class = j, True
            continue
        m = _EMPTY_MIN.match(p, i) if c == "{" else None
        if m is not None:  # Python's `{,n}` is `{0,n}` (`{,}` is `*`); RE2 would read the text literally
            out.append("{0," + m.group(1) + "}")
            i = m.end()
            continue
        out.append(c)
        i += 1
    return "".join(out)


_PLAIN = re.compile(r"(?:[^\\.^$*+?{}\[\]|()]|\\[^A-Za-z0-9])*")  # `re.escape` of a name (one way to read each char)
_UNESCAPE = re.compile(r"\\(.)", re.S)


def compile_regex(pattern: str) -> Compiled:
    """A regex (Python syntax) for RE2; `PatternError` says why one cannot run without backtracking."""
    if _PLAIN.fullmatch(pattern):  # one exact name (a rank-shard set's manifest has one per tensor)
        literal = _UNESCAPE.sub(r"\1", pattern)
        return Compiled("".join(map(_char, literal)), literal)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FutureWarning on possible nested sets, etc.: RE2 decides
            tree = _parser.parse(pattern)
    except re.error as e:
        raise PatternError(f"invalid regex: {e}") from None
    except RecursionError:
        raise PatternError("invalid regex: nested too deeply") from None
    why = _refusal(tree)
    if why is not None:
        raise PatternError(
            f"regex uses {why}, which needs a backtracking regex engine; reshard matches with RE2 "
            "(time linear in the name's length), so write it without (e.g. list the alternatives, or use a glob)")
    groups = tree.state.groups - 1
    if all(op == _sre.LITERAL for op, _ in tree) and not tree.state.flags & re.IGNORECASE:
        literal = "".join(chr(av) for _, av in tree)
        return Compiled("".join(map(_char, literal)), literal)
    source = _rewrite(pattern)
    regexp = _compile(source)
    counted = _re2.RE2(source.encode("utf-8", "surrogatepass"), _options(capture=True)).NumberOfCapturingGroups()
    if counted != groups:  # a rewrite missed something: RE2 would read another pattern
        raise PatternError(f"regex reads differently in RE2 ({counted} groups, not Python's {groups}); simplify it")
    prefix = suffix = ""
    if not tree.state.flags & re.IGNORECASE:
        prefix, suffix = _ends([chr(av) if op == _sre.LITERAL else None for op, av in tree])
    return Compiled(source, None, regexp, prefix, suffix)


# --- many patterns at once ------------------------------------------------------------------------


class FirstMatch:
    """For each name, the index of the first of `patterns` that matches it (-1: none).

    Plain names are looked up in a dict; the rest go into one RE2 `Set`, which reports every pattern
    a name matches in one pass. A `Set` that ran out of DFA memory reports nothing, so a name it
    reports nothing for is checked against one RE2 alternation of all of them (which falls back to
    its NFA instead), and, if that matches, pattern by pattern.
    """

    def __init__(self, patterns: Sequence[Compiled]) -> None:
        self.patterns = list(patterns)
        self.literals: dict[str, int] = {}
        self.others: list[int] = []
        for i, p in enumerate(self.patterns):
            if p.literal is not None:
                self.literals.setdefault(p.literal, i)
            else:
                self.others.append(i)
        self.set: Any = None
        self.any: Any = None
        if self.others:
            s = _re2.Set(_BOTH, _options(memory=_SET_MEMORY))
            ok = all(s.Add(self.patterns[i].source.encode("utf-8", "surrogatepass")) >= 0 for i in self.others)
            self.set = s if ok and s.Compile() else None
            alt = "|".join(f"(?:{self.patterns[i].source})" for i in self.others)
            regexp = _re2.RE2(alt.encode("utf-8", "surrogatepass"), _options(memory=_SET_MEMORY))
            self.any = regexp if regexp.ok() else None

    def _slow(self, name: str, below: int) -> int:
        """The first pattern before `below` (-1: any) that matches `name`, tried one by one."""
        for i in self.others:
            if below >= 0 and i >= below:
                break
            if self.patterns[i].fullmatch(name):
                return i
        return below

    def indices(self, names: Sequence[str]) -> list[int]:
        lit = self.literals
        if not self.others:
            return [lit.get(n, -1) for n in names]
        data = [n.encode("utf-8", "surrogatepass") for n in names]
        if self.set is None:
            out = [-1] * len(names)
        else:
            others = self.others
            out = [others[min(f)] if f else -1 for f in map(self.set.Match, data)]
        empty = [k for k, best in enumerate(out) if best < 0]
        if lit:
            for k, j in enumerate(map(lit.get, names)):
                if j is not None and (j < out[k] or out[k] < 0):
                    out[k] = j
        for k in empty:  # nothing, or a Set out of memory: confirm
            d = data[k]
            if self.set is None or self.any is None or self.any.Match(_BOTH, d, 0, len(d))[0][0] >= 0:
                out[k] = self._slow(names[k], out[k])
        return out
