"""The documentation is a guide that runs: every fenced ``python`` block of README.md and
docs/*.md runs as written on 2 gloo ranks (as torchrun would start it), the README stays
under 300 lines with its method table generated from the result folders, and every relative
link points at a file (and heading) that exists.

A block that cannot run here is marked on the line before its fence with
``<!-- docs-test: skip: <the reason> -->``; the reason is the test's skip message.
"""

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, *sorted((ROOT / "docs" / "results").rglob("*.md"))]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip:\s*(.+?)\s*-->")
BLOCK_TIMEOUT_S = 240


def _blocks():
    """(page:line, code, skip reason or None) of every fenced python block."""
    found = []
    for page in PAGES:
        lines = page.read_text().split("\n")
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start, before = i, [x for x in lines[max(0, i - 3):i] if x.strip()]
                end = lines.index("```", i + 1)
                skip = SKIP.search(before[-1]) if before else None
                found.append((f"{page.relative_to(ROOT)}:{start + 1}",
                              "\n".join(lines[start + 1:end]) + "\n",
                              skip.group(1) if skip else None))
                i = end
            i += 1
    return found


BLOCKS = _blocks()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _missing_modules(code: str) -> list[str]:
    """Top-level modules the block imports that are not installed (optional extras)."""
    names = re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", code, re.M)
    return sorted({n for n in names if importlib.util.find_spec(n) is None})


def _run_on_two_ranks(script: Path, cwd: Path) -> list[str]:
    """Start the script as torchrun starts its workers on one machine; two nodes of one rank
    each (LOCAL_WORLD_SIZE=1), so an HSDP block has a replica hop. Bounded in time."""
    port, procs = _free_port(), []
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=path, RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    try:
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{out}"
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def test_there_are_python_blocks_and_few_are_skipped():
    assert len(BLOCKS) >= 5
    assert sum(reason is not None for _, _, reason in BLOCKS) <= 2


@pytest.mark.distributed
@pytest.mark.parametrize("where,code,skip", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_the_block_runs_as_written_on_two_ranks(where, code, skip, tmp_path):
    if skip:
        pytest.skip(skip)
    missing = _missing_modules(code)
    if missing:
        pytest.skip(f"needs {missing} (pip install '.[integrations]')")
    script = tmp_path / "block.py"
    script.write_text(code)
    outputs = _run_on_two_ranks(script, tmp_path)
    assert any(out.strip() for out in outputs), "the block printed nothing"


def test_the_readme_is_a_guide_of_at_most_300_lines():
    text = (ROOT / "README.md").read_text()
    assert len(text.split("\n")) <= 300
    for command in ("make demo", "make test", "pip install ."):  # .ci/run calls make test
        assert command in text


def test_the_method_table_is_generated_from_the_result_folders():
    spec = importlib.util.spec_from_file_location("method_table",
                                                  ROOT / "docs" / "method_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert table.main(["--check"]) == 0, "stale: run python docs/method_table.py"
    generated = table.table()
    assert "`fp8-ef`" in generated and "llama-small" in generated


def test_the_configuration_reference_has_a_line_for_every_field():
    import dataclasses

    from geofp8 import GeoFP8Config

    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    fields = {f.name for f in dataclasses.fields(GeoFP8Config)}
    assert fields <= rows, f"not in docs/configuration.md: {sorted(fields - rows)}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces → -."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", LINKED, ids=[str(p.relative_to(ROOT)) for p in LINKED])
def test_every_relative_link_points_at_a_file_and_heading(page):
    broken = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md"
                                   and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing {broken}"
