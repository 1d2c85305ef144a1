"""Write docs/compatibility.md, the table of which pairs of capabilities compose, from the tests' markers.

Reads ``pytest.mark.combines`` / ``pytest.mark.refuses`` on the test functions of tests/test_*.py and on the
``pytest.param`` cases of their ``parametrize`` lists (by the syntax tree: nothing is imported or run), and the
limits of tests/compatibility_limits.toml; the capability names are those of tests/capabilities.py.

    python tests/compatibility.py          # rewrite docs/compatibility.md
    python tests/compatibility.py --check  # exit 1 when the page is not what the tests say
"""

from __future__ import annotations

import argparse
import ast
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capabilities import CAPABILITIES, PAIRS, load_limits, marker_problem  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "compatibility.md"
KINDS = ("combines", "refuses")
SYMBOL = {"tested": "T", "refused": "R", "limit": "L", "not applicable": "-", "unknown": "?"}


@dataclass(frozen=True)
class Mark:
    """One marker: its kind, capabilities and keywords, the test (``file::name[case]``) and the string constants of
    that test's code (a refusal's message must be one of them, or part of one: what the test asserts)."""
    kind: str
    names: tuple[str, ...]
    kwargs: dict = field(hash=False)
    test: str
    strings: tuple[str, ...] = field(repr=False, hash=False)


def _mark_call(node: ast.AST, where: str) -> tuple[str, tuple, dict] | None:
    """(kind, args, kwargs) of ``pytest.mark.combines(...)`` / ``pytest.mark.refuses(...)``, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KINDS
            and ast.unparse(node.func.value) == "pytest.mark"):
        return None
    try:
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError as e:
        raise ValueError(f"{where}: write the {node.func.attr} marker with literal arguments ({e})") from None
    return node.func.attr, args, kwargs


def _is_param(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.param"


def _id_function(ids: ast.AST | None, defs: dict[str, ast.FunctionDef]):
    """The ``ids=`` callable of a parametrize (a lambda, or a module-level function), made from its source alone."""
    try:
        if isinstance(ids, ast.Lambda):
            return eval(compile(ast.Expression(ids), "<ids>", "eval"), {})
        if isinstance(ids, ast.Name) and ids.id in defs:
            namespace: dict = {}
            exec(compile(ast.Module([defs[ids.id]], []), "<ids>", "exec"), namespace)
            return namespace[ids.id]
    except Exception:  # noqa: BLE001  (no id then: the cell names the test function)
        return None
    return None


def _case_id(case: ast.Call, argnames: list[str], index: int, make_id) -> str | None:
    """pytest's id of one ``pytest.param`` case: its ``id=``, else each value's id joined by "-" (from ``ids=``, or
    the value itself when it is a plain constant, else the argument name and the case's index); None when the
    values are not literals."""
    explicit = next((k.value for k in case.keywords if k.arg == "id"), None)
    if explicit is not None:
        return ast.literal_eval(explicit)
    values = [_literal(a) for a in case.args]  # NOT_LITERAL for a call: pytest names it by argument name and index
    if make_id is not None:
        if any(v is NOT_LITERAL for v in values):
            return None
        try:
            return "-".join(str(make_id(v)) for v in values)
        except Exception:  # noqa: BLE001  (no id then: the cell names the test function)
            return None
    plain = (str, int, float, bool, type(None))
    return "-".join(str(v) if isinstance(v, plain) else f"{name}{index}" for v, name in zip(values, argnames))


NOT_LITERAL = object()


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return NOT_LITERAL


def _cases(func: ast.FunctionDef, assigns: dict[str, ast.AST], defs: dict[str, ast.FunctionDef]):
    """``(pytest.param call, its id or None)`` of ``func``'s parametrize lists (inline or a module-level name)."""
    cases = []
    for dec in func.decorator_list:
        if not (isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.parametrize" and len(dec.args) > 1):
            continue
        names = ast.literal_eval(dec.args[0])
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        values = dec.args[1]
        values = assigns.get(values.id, values) if isinstance(values, ast.Name) else values
        make_id = _id_function(next((k.value for k in dec.keywords if k.arg == "ids"), None), defs)
        entries = values.elts if isinstance(values, (ast.List, ast.Tuple)) else [values]
        for index, entry in enumerate(entries):
            if _is_param(entry):
                cases.append((entry, _case_id(entry, names, index, make_id)))
            else:  # a starred generator of cases: their ids are not literal
                cases += [(n, None) for n in ast.walk(entry) if _is_param(n)]
    return cases


def _case_marks(case: ast.Call) -> list[ast.AST]:
    marks = next((k.value for k in case.keywords if k.arg == "marks"), None)
    return [] if marks is None else list(marks.elts) if isinstance(marks, (ast.List, ast.Tuple)) else [marks]


def _strings(nodes: list[ast.AST]) -> tuple[str, ...]:
    return tuple(n.value for node in nodes for n in ast.walk(node)
                 if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _file_marks(path: Path) -> list[Mark]:
    text = path.read_text()
    tree = ast.parse(text)
    assigns = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
               if isinstance(t, ast.Name)}
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    defs = {f.name: f for f in funcs}
    funcs += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, ast.FunctionDef)]
    marks = []
    for func in (f for f in funcs if f.name.startswith("test")):
        test = f"{path.relative_to(ROOT).as_posix()}::{func.name}"
        body = _strings(func.body)
        found = [(test, body, d) for d in func.decorator_list]
        for case, case_id in _cases(func, assigns, defs):
            name = f"{test}[{case_id}]" if case_id else test
            found += [(name, body + _strings([case]), m) for m in _case_marks(case)]
        for name, strings, node in found:
            if call := _mark_call(node, f"{path.name}:{node.lineno}"):
                kind, args, kwargs = call
                if problem := marker_problem(kind, args, kwargs):
                    raise ValueError(f"{path.name}:{node.lineno}: {kind}{args}: {problem}")
                marks.append(Mark(kind, args, kwargs, name, strings))
    return marks


def collect(root: Path = ROOT) -> list[Mark]:
    """Every combines / refuses marker of tests/test_*.py, in file and line order."""
    return [m for path in sorted((root / "tests").glob("test_*.py")) for m in _file_marks(path)]


def cells(marks: list[Mark]) -> dict[frozenset, tuple[str, str]]:
    """(status, evidence) of every pair: tested > refused > documented limit > not applicable > unknown."""
    limits = load_limits()
    tested: dict[frozenset, dict[str, str]] = {}  # pair -> {test: note}, an unnoted entry winning
    refused: dict[frozenset, list[str]] = {}
    for m in marks:
        if m.kind == "combines":
            note = f" ({m.kwargs['note']})" if m.kwargs.get("note") else ""
            for a in m.names:
                for b in m.names:
                    if a < b:
                        tests = tested.setdefault(frozenset((a, b)), {})
                        tests[m.test] = min(tests.get(m.test, note), note, key=len)
        else:
            refused.setdefault(frozenset(m.names), []).append(f"`{m.test}`: \"{m.kwargs['message']}\"")
    out = {}
    for pair in PAIRS:
        if pair in tested:
            shown = [f"`{test}`{note}" for test, note in tested[pair].items()]
            more = f"; {len(shown) - 3} more" if len(shown) > 3 else ""
            also = f"; refused in part: {refused[pair][0]}" if pair in refused else ""
            out[pair] = "tested", "; ".join(shown[:3]) + more + also
        elif pair in refused:
            out[pair] = "refused", "; ".join(dict.fromkeys(refused[pair]))
        elif pair in limits["limit"]:
            out[pair] = "limit", limits["limit"][pair]
        elif pair in limits["not_applicable"]:
            out[pair] = "not applicable", limits["not_applicable"][pair]
        else:
            out[pair] = "unknown", "unknown"
    return out


SHORT = dict(zip(CAPABILITIES, ["PP", "PL", "TP", "CP", "EC", "FS", "MD", "EP", "FT", "BA", "PK", "AC", "GA", "MP",
                                "LO", "GE", "CK"]))


def _matrix(table: dict[frozenset, tuple[str, str]]) -> list[str]:
    names = list(CAPABILITIES)
    lines = ["```text", "    " + " ".join(f"{SHORT[n]:>2}" for n in names)]
    for i, a in enumerate(names):
        row = [" ." if j == i else "  " if j < i else f"{SYMBOL[table[frozenset((a, b))][0]]:>2}"
               for j, b in enumerate(names)]
        lines.append(f"{SHORT[a]:<3} " + " ".join(row))
    return lines + ["```"]


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, 116, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)


def render(marks: list[Mark]) -> str:
    """The whole page."""
    table = cells(marks)
    counts = {s: sum(1 for status, _ in table.values() if status == s) for s in SYMBOL}
    lines = [
        "# Compatibility of capabilities",
        "",
        *_wrap("Which pairs of the capabilities a user combines under `MultimodalParallelStrategy` are proven to "
               "work together, refused before training, or not known yet. Generated by `python tests/compatibility.py` "
               "from markers on the tests (do not edit it by hand); `tests/test_compatibility.py` fails when this "
               "page and the tests disagree."),
        "",
        *_wrap("- **tested** (T): a test runs both together and compares with the unparallelised model in one "
               "process (or HF's own model; for a resumed checkpoint, the uninterrupted run); it is marked "
               "`@pytest.mark.combines(...)`. The first three such tests are named; a note says where a capability "
               "is on by default rather than chosen by the test.", "  "),
        *_wrap("- **refused** (R): the run stops before training with an error naming the fix; the test asserting "
               "it is marked `@pytest.mark.refuses(..., message=...)`, the message being part of that error.", "  "),
        "- **limit** (L): it runs, with a documented limit (`tests/compatibility_limits.toml`).",
        "- **not applicable** (-): the pair means nothing (the reason is given).",
        "- **unknown** (?): neither tested nor refused: it may work, fail or hang; try it on a small case first.",
        "",
        "Counts over {} pairs: {}.".format(len(table), ", ".join(f"{s} {n}" for s, n in counts.items())),
        "",
        *_matrix(table),
        "",
        "## Capabilities",
        "",
        "| name (marker) | short | what |",
        "| --- | --- | --- |",
        *(f"| `{n}` | {SHORT[n]} | {what} |" for n, what in CAPABILITIES.items()),
        "",
        "## Every pair",
        "",
        "| pair | status | evidence |",
        "| --- | --- | --- |",
    ]
    for pair in PAIRS:
        a, b = sorted(pair, key=list(CAPABILITIES).index)
        status, evidence = table[pair]
        lines.append(f"| {a} + {b} | {status} | {evidence.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/compatibility.md is stale")
    args = parser.parse_args(argv)
    page = render(collect())
    if args.check:
        if PAGE.exists() and PAGE.read_text() == page:
            return 0
        print(f"{PAGE.relative_to(ROOT)} is stale: run python tests/compatibility.py", file=sys.stderr)
        return 1
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
