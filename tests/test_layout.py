"""The shape of the house: which package may import which, and a package manifest that names only what
exists. The simulator's model of SGLang and the worker's and supervisor's reading of SGLang stay
separate code: were they to share it, they would agree by construction and the tests against the
simulator would prove nothing."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("batchfleet", "producer", "worker", "supervisor", "fleetrun", "batchapi")
# What each package may import of the others: `batchfleet/` is the ground floor, the three processes
# stand side by side on it, `batchapi/` serves the producer's store, `fleetrun/` starts them all.
MAY_IMPORT = {
    "batchfleet": set(),
    "producer": {"batchfleet"},
    "worker": {"batchfleet"},
    "supervisor": {"batchfleet"},
    "batchapi": {"batchfleet", "producer"},
    "fleetrun": {"batchfleet", "producer", "worker", "supervisor", "batchapi"},
    "sglang_sim": set(),
}


def imported(package: str) -> dict[str, set[str]]:
    """Top-level packages of this repository that `package` imports (anywhere, lazily too) -> the files."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != package and top in MAY_IMPORT:
                    out.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return out


def producer_imports(package: str) -> list[str]:
    """Every import of the producer in `package` (anywhere, lazily too), as `file: module.name`."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [f"{where}: {a.name}" for a in node.names if a.name.split(".")[0] == "producer"]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("producer"):
                out += [f"{where}: {node.module}.{a.name}" for a in node.names]
    return out


def test_the_batch_api_and_the_launchers_use_only_the_producers_public_api() -> None:
    """`batchapi` and `fleetrun` import `producer.api` and, of it, only the names its `__all__` lists:
    the rest of the producer may change shape without them noticing."""
    import producer.api

    public = {f"producer.api.{name}" for name in producer.api.__all__}
    found = producer_imports("batchapi") + producer_imports("fleetrun")
    assert found, "the check finds the imports it looks for"
    assert [x for x in found if x.partition(": ")[2] not in public] == []


def test_the_producers_public_api_names_only_what_it_defines_or_imports() -> None:
    import producer.api

    assert sorted(producer.api.__all__) == producer.api.__all__
    assert [n for n in producer.api.__all__ if n.startswith("_") or not hasattr(producer.api, n)] == []
    assert [n for n in producer.api.__all__ if not getattr(producer.api, n).__doc__] == []  # each is documented


def test_the_simulator_and_the_fleet_share_no_code() -> None:
    crossing = {p: files for p in PRODUCT if (files := imported(p).get("sglang_sim"))}
    assert crossing == {}, "the fleet imports the simulator"
    assert imported("sglang_sim") == {}, "the simulator imports the fleet's code"


def test_each_package_imports_only_the_floors_below_it() -> None:
    wrong = {p: {top: files for top, files in imported(p).items() if top not in allowed}
             for p, allowed in MAY_IMPORT.items()}
    assert {p: w for p, w in wrong.items() if w} == {}


def test_package_data_names_only_files_that_exist() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    missing = [f"{package}/{pattern}" for package, patterns in config["tool"]["setuptools"]["package-data"].items()
               for pattern in patterns if not list((ROOT / package).glob(pattern))]
    assert missing == []


def test_each_comment_in_a_dependency_list_sits_on_the_line_before_its_dependency() -> None:
    """In `dependencies` and the extras a comment says why one dependency is there, on its own line just
    above it, and each dependency has a line of its own: a comment that covers several, or sits beside
    something else, is a comment nobody keeps true."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text[text.index("dependencies = ["):text.index("[project.scripts]")]
    lines = section.splitlines()
    one_dependency = re.compile(r'^\s*"[^"]+",?\s*$|^[a-z-]+ = \[\]$')  # or an extra with none
    wrong = []
    for i, line in enumerate(lines):
        code, _, comment = line.partition("#")
        if code.strip() and comment:
            wrong.append(f"a comment beside code: {line.strip()}")
        elif comment and not (i + 1 < len(lines) and one_dependency.match(lines[i + 1])):
            wrong.append(f"a comment not followed by one dependency: {line.strip()}")
        elif code.count('"') > 2 and not code.rstrip().endswith("["):
            wrong.append(f"several dependencies on one line: {line.strip()}")
    assert wrong == []
