"""The code blocks of README.md and docs/*.md run as written, so the docs cannot drift from the code.

Every fenced block is ``python``, ``bash`` or ``yaml`` (a whole fit config, run with ``lightning-mm fit``), or
``text`` (output, not code). Each runnable block runs on its own: in a fresh interpreter, in a fresh scratch folder
holding ``examples/`` and ``benchmarks/``. A block whose first line is a comment saying otherwise, visible to the
reader, is treated as it says:

- ``# continues the block above``: runs after the previous runnable block of the page, in its folder, and, when
  both are python, in the same interpreter (the two run as one script);
- ``# fragment: ...``, ``# needs a GPU: ...``, ``# needs a cluster: ...``, ``# takes minutes: ...`` (the reason
  after the colon): checked, not run (a YAML fragment must parse).

A README block that shows an examples/ file must equal it. A run's id is its page and the line of its first block:
``-k models.md:11`` runs docs/models.md's loading block and the generation block continuing it."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_REASONS = ("fragment", "needs a GPU", "needs a cluster", "takes minutes")
CONTINUES = "# continues the block above"
FENCE = re.compile(r"^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$", re.M | re.S)
INCLUDED = ["examples/quickstart.py", "examples/own_data.py"]


def blocks(path: Path) -> list[dict]:
    """Every fenced block of ``path``: its language, body, line, ``marker`` (the skip reason's kind, or None) and
    whether it continues the block above."""
    text, out = path.read_text(), []
    for m in FENCE.finditer(text):
        first = m["body"].split("\n", 1)[0].strip()
        kind = first[2:].split(":", 1)[0].strip() if first.startswith("# ") else None
        marker = kind if kind in SKIP_REASONS else None
        out.append({"lang": m["lang"], "body": m["body"], "marker": marker, "continues": first == CONTINUES,
                    "line": text.count("\n", 0, m.start("body"))})
    return out


def chains(path: Path) -> list[list[dict]]:
    """The runnable blocks of ``path`` in runs: a block, then the blocks marked as continuing it."""
    out = []
    for b in blocks(path):
        if b["marker"] is not None or b["lang"] not in ("python", "bash", "yaml"):
            continue
        if b["lang"] == "bash" and b["body"].startswith("pip install"):
            continue
        if b["continues"]:
            assert out, f"{path.name}:{b['line']}: continues a block, but no runnable block comes before it"
            out[-1].append(b)
        else:
            out.append([b])
    return out


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_every_block_is_runnable_or_says_why_not(path):
    assert "<!-- snippet:" not in path.read_text(), f"{path.name}: mark a block with a comment line it shows"
    for b in blocks(path):
        where = f"{path.name}:{b['line']}"
        assert b["lang"] in ("python", "bash", "yaml", "text", "diff"), f"{where}: label the block (python, bash, ...)"
        assert b["lang"] != "diff" or b["marker"], f"{where}: a diff does not run: mark it as a fragment"
        if b["lang"] == "yaml":
            config = yaml.safe_load(b["body"])
            if b["marker"] is None:
                assert {"trainer", "model"} <= set(config), f"{where}: a YAML block that runs is a whole fit config"
    chains(path)  # a continuation has a block to continue


def test_continuation_and_skip_marks_are_read_from_the_first_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\n# continues the block above\nprint(x)\n```\n\n"
                    "```python\n# fragment: the call's shape\nf(...)\n```\n\n"
                    "```bash\n# takes minutes\nsleep 1000\n```\n\n"
                    "```python\n# a plain comment\nprint(2)\n```\n")
    runs = chains(page)
    assert [[b["line"] for b in run] for run in runs] == [[1, 5], [20]]
    assert [b["marker"] for b in blocks(page)] == [None, None, "fragment", "takes minutes", None]


def test_readme_shows_the_example_files_as_they_are():
    readme = (ROOT / "README.md").read_text()
    for name in INCLUDED:
        assert (ROOT / name).read_text().strip() in readme, f"README.md's copy of {name} differs from the file"


def scratch(folder: Path) -> dict:
    folder.mkdir()
    for name in ("examples", "benchmarks"):
        (folder / name).symlink_to(ROOT / name)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def _steps(run: list[dict]) -> list[tuple[str, str, int]]:
    """(language, code, line) to execute in order: consecutive python blocks of a run as one script."""
    steps = []
    for b in run:
        if b["lang"] == "python" and steps and steps[-1][0] == "python":
            steps[-1] = ("python", steps[-1][1] + "\n" + b["body"], steps[-1][2])
        else:
            steps.append((b["lang"], b["body"], b["line"]))
    return steps


def _execute(lang: str, code: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    if lang == "python":
        (cwd / "blocks.py").write_text(code)
        command = [sys.executable, "blocks.py"]
    elif lang == "bash":
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        (cwd / "block.yaml").write_text(code)
        command = [shutil.which("lightning-mm"), "fit", "--config", "block.yaml"]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)


RUNS = [pytest.param(path, i, id=f"{path.name}:{run[0]['line']}")
        for path in DOCUMENTS for i, run in enumerate(chains(path))]


@pytest.mark.slow
@pytest.mark.parametrize("path, index", RUNS)
def test_blocks_run_as_written(path, index, tmp_path):
    """One run of blocks (a block and those continuing it) in a fresh folder, each step in a fresh process."""
    run = chains(path)[index]
    env = scratch(tmp_path / "scratch")
    for lang, code, line in _steps(run):
        proc = _execute(lang, code, tmp_path / "scratch", env)
        assert proc.returncode == 0, f"{path.name}:{line}: failed\n{proc.stderr[-4000:]}"
