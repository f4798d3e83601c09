"""The shape of the code and the docs that describe it, checked so that neither drifts: module
sizes, the formatter owning the layout, the proxy never importing torch, benchmarks never
importing the tests, and docs/development.md naming every module and leaving out counts that
would need keeping by hand."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.imports import against_order, circles, import_graph

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("recorder", "proxy", "harness_adapters", "trainer")
# harness_adapters' rooms, lowest first: a task knows nothing of where it runs, an environment
# nothing of harnesses or rewards, the engine is chosen above the runner (docs/development.md).
ROOMS = ("tasks", "environments", "harnesses", "rewards", "runner", "engines", "rollouts", "config", "collect", "cli")
DEVELOPMENT = (ROOT / "docs" / "development.md").read_text()


def _modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_modules_stay_small_and_the_formatter_owns_the_layout() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules(*PACKAGES)}
    assert {name: n for name, n in sizes.items() if n > 500} == {}
    skips = sum(p.read_text().count("fmt: skip") for p in _modules(*PACKAGES))
    assert skips < 20


def test_the_proxy_never_imports_torch_or_vllm() -> None:
    """Not in any module (not even inside a function), and not through what its modules import.
    Two exceptions, which never run in the proxy's process: model.py's conversion of the default
    model runs in a child process of its own (`python -m proxy.model DIR`), and vllm_plugin.py in
    vLLM's processes."""
    heavy = {"torch", "vllm", "transformers", "trl", "peft"}
    apart = {"model.py", "vllm_plugin.py"}
    named = {str(p.relative_to(ROOT)): _imports(p) for p in _modules("proxy") if p.name not in apart}
    assert {p: sorted(n for n in names if n.split(".")[0] in heavy) for p, names in named.items()} == {
        p: [] for p in named
    }
    modules = ", ".join(f"proxy.{p.stem}" for p in _modules("proxy") if p.stem != "__init__")
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, {modules}; print(sorted({{m.split('.')[0] for m in sys.modules}}))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert not heavy & set(ast.literal_eval(loaded))


def test_benchmarks_never_import_the_tests_and_no_test_imports_a_test_module() -> None:
    assert [p.name for p in _modules("benchmarks") if any(n.split(".")[0] == "tests" for n in _imports(p))] == []
    test_modules = {
        f"tests.{p.relative_to(ROOT / 'tests').with_suffix('').as_posix().replace('/', '.')}"
        for p in _modules("tests")
        if p.name.startswith("test_")
    }
    assert [p.name for p in _modules("tests", "benchmarks") if _imports(p) & test_modules] == []


def test_development_md_names_every_module_and_make_bench_runs_every_benchmark() -> None:
    layout = DEVELOPMENT[DEVELOPMENT.index("## The layout") :]
    folders = {p: p.parent.relative_to(ROOT / p.relative_to(ROOT).parts[0]).as_posix() for p in _modules(*PACKAGES)}
    missing = [  # a module by its name; one in a folder below its package (viewer/) may be named by that folder
        str(p.relative_to(ROOT))
        for p, folder in folders.items()
        if p.name != "__init__.py"
        and f" {p.name} " not in layout
        and not (folder != "." and f" {folder}/" in layout)
        and "/examples/" not in f"/{folder}/"  # examples are data (their folders are named in the layout)
    ]
    assert missing == []
    benchmarks = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"}
    makefile = (ROOT / "Makefile").read_text()
    bench_target = re.search(r"^bench: .*\n((?:\t.*\n)+)", makefile, re.M)
    assert bench_target is not None
    soaks = re.findall(r"^soak[\w-]*: .*\n((?:\t.*\n)+)", makefile, re.M)  # the long runs have targets of their own
    run = set(re.findall(r"-m benchmarks\.(\w+)", bench_target.group(1) + "".join(soaks)))
    assert benchmarks - run == set()
    # Counts of tests or benchmarks written by hand go stale: the runner prints them.
    assert not re.search(r"\b\d+ (tests|benchmarks)\b", DEVELOPMENT)


def test_imports_go_one_way_and_no_modules_import_each_other() -> None:
    """recorder <- proxy <- harness_adapters <- trainer: a lower package never imports a higher
    one, not even inside a function; within harness_adapters the same between its rooms (ROOMS);
    and no modules import each other, directly or round a loop (the rooms of harness_adapters/
    and trainer/ did, in three circles)."""
    graph = import_graph(ROOT, PACKAGES)
    assert against_order(graph, PACKAGES) == []
    assert against_order(graph, tuple(f"harness_adapters.{room}" for room in ROOMS)) == []
    assert circles(graph) == []


def test_the_import_check_finds_a_circle_and_an_import_against_the_order(tmp_path: Path) -> None:
    """A project with a circle of three modules (one import of them inside a function, one under
    TYPE_CHECKING, one of a module by `from package import module`) and a lower package that
    imports a higher one: the check names both."""
    for name, text in {
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from low.b import g\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from low.c import h\n",
        "low/c.py": "from low import a\nimport high.top\n",
        "high/__init__.py": "",
        "high/top.py": "",
    }.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("low", "high"))
    assert circles(graph) == [["low.a", "low.b", "low.c"]]
    assert against_order(graph, ("low", "high")) == ["low.c:2 imports high.top"]
    graph.remove_edge("low.c", "low.a")
    assert circles(graph) == []


def test_make_test_installs_every_system_tool_a_test_asks_for_or_says_how(tmp_path: Path) -> None:
    """On a fresh machine `make test` failed six tests for want of bubblewrap while others
    skipped for it. Its `system` target installs what `system_tool` can ask for; a user who is
    not root is stopped with the one command to run (here: `id` says 1000, and PATH holds
    neither bwrap nor chromium)."""
    from tests.conftest import SYSTEM_PACKAGES

    target = re.search(r"^system:\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert target is not None and all(package in target.group(1) for package in SYSTEM_PACKAGES.values())
    # ... and the README names each of them (it said three when make installed seven).
    readme = " ".join((ROOT / "README.md").read_text().split())
    needs = re.search(r"`make test` also needs these Debian packages: (.*?)\. Run as root", readme)
    assert needs is not None and sorted(re.findall(r"`([\w-]+)`", needs.group(1))) == sorted(SYSTEM_PACKAGES.values())
    (tmp_path / "id").write_text("#!/bin/sh\necho 1000\n")
    (tmp_path / "id").chmod(0o755)
    (tmp_path / "ls").symlink_to(shutil.which("ls") or "/bin/ls")
    make = shutil.which("make") or "/usr/bin/make"
    done = subprocess.run(
        [make, "-s", "-C", str(ROOT), "system"], env={"PATH": str(tmp_path)}, capture_output=True, text=True
    )
    assert done.returncode != 0 and "sudo apt-get install -y bubblewrap chromium" in done.stdout, done
