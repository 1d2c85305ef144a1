"""The code blocks of README.md and docs/*.md run as written, so the docs cannot drift from the code.

Every fenced block is one of: ``python`` / ``bash`` (run: a file's python blocks in order as one script, its bash
blocks in order, in one scratch folder holding ``examples/`` and ``benchmarks/``), ``yaml`` (a whole fit config,
run with ``lightning-mm fit``), ``text`` (output, not code), or any of those preceded by a marker line
``<!-- snippet: REASON -->`` with REASON starting with one of ``SKIP_REASONS`` (checked, not run: a YAML fragment
must parse). A README block that shows an examples/ file must equal it."""

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
FENCE = re.compile(r"(?:<!-- snippet: (?P<marker>[^>]*?) -->\n)?^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$", re.M | re.S)
INCLUDED = ["examples/quickstart.py", "examples/own_data.py"]


def blocks(path: Path) -> list[dict]:
    text = path.read_text()
    return [{"lang": m["lang"], "body": m["body"], "marker": m["marker"],
             "line": text.count("\n", 0, m.start("body"))} for m in FENCE.finditer(text)]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_every_block_is_runnable_or_says_why_not(path):
    for b in blocks(path):
        where = f"{path.name}:{b['line']}"
        assert b["lang"] in ("python", "bash", "yaml", "text", "diff"), f"{where}: label the block (python, bash, ...)"
        assert b["lang"] != "diff" or b["marker"], f"{where}: a diff does not run: mark it as a fragment"
        if b["marker"] is not None:
            assert b["marker"].startswith(SKIP_REASONS), f"{where}: unknown snippet marker {b['marker']!r}"
        if b["lang"] == "yaml":
            config = yaml.safe_load(b["body"])
            if b["marker"] is None:
                assert {"trainer", "model"} <= set(config), f"{where}: a YAML block that runs is a whole fit config"


def test_readme_shows_the_example_files_as_they_are():
    readme = (ROOT / "README.md").read_text()
    for name in INCLUDED:
        assert (ROOT / name).read_text().strip() in readme, f"README.md's copy of {name} differs from the file"


def scratch(tmp_path: Path) -> dict:
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_blocks_run_as_written(path, tmp_path):
    env, runnable = scratch(tmp_path), [b for b in blocks(path) if b["marker"] is None]
    script = "\n".join(b["body"] for b in runnable if b["lang"] == "python")
    if script:
        (tmp_path / "blocks.py").write_text(script)
        proc = subprocess.run([sys.executable, "blocks.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=1200)
        assert proc.returncode == 0, f"{path.name}: python blocks failed\n{proc.stderr[-4000:]}"
    for b in runnable:
        if b["lang"] == "bash" and not b["body"].startswith("pip install"):
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", b["body"]], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=1200)
            assert proc.returncode == 0, f"{path.name}:{b['line']}: failed\n{proc.stderr[-4000:]}"
        if b["lang"] == "yaml":
            (tmp_path / "block.yaml").write_text(b["body"])
            proc = subprocess.run([shutil.which("lightning-mm"), "fit", "--config", "block.yaml"], cwd=tmp_path,
                                  env=env, capture_output=True, text=True, timeout=1200)
            assert proc.returncode == 0, f"{path.name}:{b['line']}: failed\n{proc.stderr[-4000:]}"
