"""Line and statement counts of the counted library (issue 45's budget), per file or per feature.

Each physical line falls in exactly one class, the first that applies:
  blank     only whitespace;
  comment   only a comment;
  docstring inside a string statement (a module/class/function docstring, or a bare string statement);
  message   inside a str or f-string literal that is error-message text: within a ``raise`` statement, an
            argument of a call to a name ending in Error/Exception/Warning or of ``warn``, or the value of an
            assignment to a name ending in ERROR/MESSAGE/MSG (continuation lines counted; a line of a raise that
            holds any of its message's literal counts as message, the ``raise X(`` included);
  text      other string text: a line at least half of whose non-blank characters lie inside str or f-string
            literals (reasons a kernel declines, ``last_reason`` text, messages built away from their raise);
  code      everything else.
Statements: every ``ast.stmt`` node but string statements (docstrings); ``def``/``class`` count one each.
"""
from __future__ import annotations

import ast
import io
import subprocess
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository
KINDS = ("blank", "comment", "docstring", "message", "text", "code")


def library_files() -> list[str]:
    """The budget's files: ``find tiled_core strategies tiled_mlp/integrations tiled_mlp/__init__.py -name '*.py'``."""
    out = subprocess.run("find tiled_core strategies tiled_mlp/integrations tiled_mlp/__init__.py -name '*.py'",
                         shell=True, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted(out.split())


def _span(node: ast.AST) -> range:
    return range(node.lineno, node.end_lineno + 1)


def _is_message_call(node: ast.Call) -> bool:
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name.endswith(("Error", "Exception", "Warning", "Refused")) or name in ("warn", "_refuse")


def _strings_in(node: ast.AST) -> list[ast.AST]:
    return [n for n in ast.walk(node)
            if isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str))]


def classify(path: str) -> tuple[list[str], int, list[int]]:
    """Each line's class (index 0 is line 1), the file's statement count, and each statement's first line."""
    src = (ROOT / path).read_text()
    lines = src.splitlines()
    kind = ["code"] * len(lines)
    tree = ast.parse(src)
    doc_lines: set[int] = set()
    msg_lines: set[int] = set()
    stmt_lines: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc_lines.update(_span(node))
            continue
        if isinstance(node, ast.stmt):
            stmt_lines.append(node.lineno)
        holders: list[ast.AST] = []
        if isinstance(node, ast.Raise) and node.exc is not None:
            holders = [node.exc]
        elif isinstance(node, ast.Call) and _is_message_call(node):
            holders = [*node.args, *(k.value for k in node.keywords)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id.upper().endswith(("ERROR", "MESSAGE", "MSG")) for t in targets):
                holders = [node.value] if node.value is not None else []
        for holder in holders:
            for s in _strings_in(holder):
                msg_lines.update(_span(s))
            if isinstance(node, ast.Raise) and any(isinstance(s, ast.JoinedStr) or len(s.value) >= 10
                                                   for s in _strings_in(holder)):
                msg_lines.add(node.lineno)  # the ``raise X(`` line
    # Comment-only lines from the tokenizer (a ``#`` inside a string is not a comment).
    comment_lines: set[int] = set()
    code_token_lines: set[int] = set()
    string_chars: Counter = Counter()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.STRING:
            for row in range(tok.start[0], tok.end[0] + 1):
                text = lines[row - 1]
                a = tok.start[1] if row == tok.start[0] else 0
                b = tok.end[1] if row == tok.end[0] else len(text)
                string_chars[row] += len(text[a:b].strip())
        if tok.type == tokenize.COMMENT:
            comment_lines.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_token_lines.update(range(tok.start[0], tok.end[0] + 1))
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            kind[i - 1] = "blank"
        elif i in comment_lines and i not in code_token_lines:
            kind[i - 1] = "comment"
        elif i in doc_lines:
            kind[i - 1] = "docstring"
        elif i in msg_lines:
            kind[i - 1] = "message"
        elif string_chars[i] * 2 >= len("".join(text.split())):
            kind[i - 1] = "text"
    return kind, len(stmt_lines), stmt_lines


def count(path: str, ranges: list[tuple[int, int]] | None = None) -> Counter:
    """Counts for ``path``, or for its lines in ``ranges`` (inclusive; a statement counts where it starts)."""
    kinds, _, stmt_lines = classify(path)
    keep = set(range(1, len(kinds) + 1)) if ranges is None else {i for a, b in ranges for i in range(a, b + 1)}
    c = Counter(kinds[i - 1] for i in keep if i <= len(kinds))
    c["lines"] = sum(1 for i in keep if i <= len(kinds))
    c["statements"] = sum(1 for line in stmt_lines if line in keep)
    return c


if __name__ == "__main__":
    total = Counter()
    for f in library_files():
        c = count(f)
        total += c
        print(f"{c['lines']:6} {c['blank']:5} {c['docstring']:5} {c['comment']:5} {c['message']:5} {c['text']:5} "
              f"{c['code']:5} {c['statements']:5}  {f}")
    print(f"{total['lines']:6} {total['blank']:5} {total['docstring']:5} {total['comment']:5} {total['message']:5} "
          f"{total['text']:5} {total['code']:5} {total['statements']:5}  TOTAL (lines blank doc comment message text code "
          "statements)")
