"""tests/transport on the lowest and the highest releases of ngh2, aioquic and pylsqpack that
pyproject.toml admits and the package index offers (issue 37: ranges, with CI on both ends).

    .venv/bin/python tests/transport/library_bounds.py [--skip-installed] [lowest|highest ...] [-- pytest args]

Each bound's three releases are installed with --no-deps into a scratch directory put first
on PYTHONPATH (the rest of the environment stays as it is): the lowest (highest) release
inside pyproject's range and inside what the chosen releases themselves require of each
other (aioquic 1.7.2 requires pylsqpack>=1.0.0, whatever our range admits). The versions the
tests then import are printed, and tests/transport runs on them. Exit status: a failing
run's. The index is pip's own (`pip index versions`): where it offers no release inside a
range, that bound fails instead of testing something else. `--skip-installed` (CI, after the
whole suite has run on the environment as installed): a bound whose releases are the
installed ones is reported and not run again.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("ngh2", "aioquic", "pylsqpack")


def ranges() -> dict[str, Requirement]:
    """Each library's requirement as pyproject.toml states it (dependencies and extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    stated = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        stated += extra
    found = {}
    for text in stated:
        requirement = Requirement(text)
        if requirement.name in LIBRARIES:
            found[requirement.name] = requirement
    return found


def offered(name: str) -> list[Version]:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name],
                         capture_output=True, text=True, check=True).stdout
    listed = re.search(r"Available versions: (.*)", out)
    return sorted(Version(v) for v in listed.group(1).split(", ")) if listed else []


def pins(bound: str, required: dict[str, list[Requirement]]) -> list[str]:
    """The lowest or highest release of each library inside pyproject's range and `required`."""
    chosen = []
    for name, requirement in ranges().items():
        inside = [v for v in offered(name) if requirement.specifier.contains(v)
                  and all(other.specifier.contains(v) for other in required.get(name, []))]
        if not inside:
            raise SystemExit(f"no release of {name} inside {requirement.specifier} on the index")
        chosen.append(f"{name}=={inside[0] if bound == 'lowest' else inside[-1]}")
    return chosen


def install(chosen: list[str], scratch: str) -> dict[str, list[Requirement]]:
    """`chosen` into `scratch`; what the installed libraries require of each other."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                    scratch, *chosen], check=True)
    required: dict[str, list[Requirement]] = {}
    for dist in importlib.metadata.distributions(path=[scratch]):
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.name in LIBRARIES and not requirement.marker:
                required.setdefault(requirement.name, []).append(requirement)
    return required


def run(bound: str, pytest_args: list[str], skip_installed: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix=f"sdcp-{bound}-") as scratch:
        chosen = pins(bound, {})
        narrowed = pins(bound, install(chosen, scratch))
        if skip_installed and narrowed == [f"{name}=={importlib.metadata.version(name)}" for name in ranges()]:
            print(f"== {bound}: {' '.join(narrowed)}: the installed releases, tested by the suite itself", flush=True)
            return 0
        if narrowed != chosen:
            install(narrowed, scratch)
        print(f"== {bound}: {' '.join(narrowed)}", flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [scratch, os.environ.get("PYTHONPATH")])))
        subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(*("
                        f"f'{{n}} {{m.version(n)}}' for n in {LIBRARIES!r}), sep=', ')"], env=env, check=True)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/transport", *pytest_args],
                              cwd=ROOT, env=env).returncode


def main(argv: list[str]) -> int:
    bounds, _, pytest_args = (argv[:argv.index("--")], None, argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, None, [])
    skip_installed = "--skip-installed" in bounds
    status = 0
    for bound in [b for b in bounds if b != "--skip-installed"] or ["lowest", "highest"]:
        if bound not in ("lowest", "highest"):
            raise SystemExit(f"not a bound: {bound!r} (lowest or highest)")
        status = run(bound, pytest_args, skip_installed) or status
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
