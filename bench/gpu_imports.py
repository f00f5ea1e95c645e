"""What bench/gpu_check.sh imports, against what the GPU machine has (its rehearsal).

The GPU machine has python3 with torch, triton, pytest and the packages in
bench/gpu_machine_packages.txt, nothing else but the wheels that travel with the check
(bench/gpu_wheels.sh). The rehearsal (GPU_CHECK_SMOKE=1) runs every Python process of the
check with a `sitecustomize` that appends, at exit, each imported top-level module and the
file it came from to $SDCP_IMPORT_AUDIT; then

    python3 bench/gpu_imports.py AUDIT_FILE WHEEL_SITE REPO [EXTRA_DIR ...]

fails, naming them, if any module came from neither the standard library, nor the
machine's list, nor the wheels installed in WHEEL_SITE, nor the repository (or the extra
directories: the check's own temporary package folder).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# modules that packages register under a top-level name of their own
REGISTERED_BY = {"_openssl": "cryptography", "_rust": "cryptography"}
# imported only when installed (the importer falls back without them)
OPTIONAL = {"hiredis": "redis's reply parser"}
SITECUSTOMIZE = '''\
import atexit, os, sys
def _sdcp_import_audit():
    with open(os.environ["SDCP_IMPORT_AUDIT"], "a") as f:
        for name, mod in list(sys.modules.items()):
            if "." not in name:
                where = getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", None) or []), "")
                f.write(f"{name}\\t{where}\\n")
if os.environ.get("SDCP_IMPORT_AUDIT"):
    atexit.register(_sdcp_import_audit)
'''


def machine_modules() -> set[str]:
    names = set()
    for line in (HERE / "gpu_machine_packages.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.update(line.split())
    return names


def wheel_modules(site: Path) -> set[str]:
    """Top-level import names the installed wheels provide."""
    names = set()
    for entry in site.iterdir():
        if entry.name.endswith((".dist-info", ".data")) or entry.name == "bin":
            continue
        names.add(entry.name.split(".")[0])   # package dirs, modules, extension modules
    return names


def main(audit: Path, site: Path, *ours: Path) -> int:
    allowed = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | machine_modules()
    allowed |= wheel_modules(site)
    roots = [str(p.resolve()) for p in ours]
    missing: dict[str, str] = {}
    for line in audit.read_text().splitlines():
        name, _, file = line.partition("\t")
        if name in allowed or REGISTERED_BY.get(name) in allowed or name in OPTIONAL:
            continue
        if name.startswith(("_sysconfigdata_", "__editable__", "_distutils_hack", "__main__", "__mp_main__")):
            continue   # the interpreter's own, or this machine's editable install
        if name == "cython_runtime" or name.startswith("_cython_"):
            continue   # made at import by any extension Cython built (ngh2's), from no file
        path = Path(file).resolve() if file else None
        if path and "site-packages" not in path.parts and any(str(path).startswith(r) for r in roots):
            continue   # the repository's own modules (tests, bench, the package folder)
        missing.setdefault(name, file)
    if missing:
        for name, file in sorted(missing.items()):
            print(f"not on the GPU machine and in no wheel: {name} ({file or 'built in'})")
        return 1
    print(f"imports ok: every third-party module is on the GPU machine or in {site}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), *map(Path, sys.argv[3:])))
