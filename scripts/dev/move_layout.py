#!/usr/bin/env python3
"""Move the package's modules into the layer folders (issue 32) and rewrite every import.

Idempotent: run it again after merging a branch that still imports the old places (e.g. a
``contextpilot_integrations/pilot/`` package whose files say ``from ..blocks import``); it
moves what is still at an old place and rewrites what still names one, nothing else.

    python scripts/dev/move_layout.py            # move (git mv) and rewrite, then ruff --select I --fix
    python scripts/dev/move_layout.py --check    # list what it would change; exit 1 if anything

What it rewrites, in every tracked or new .py .md .ipynb .toml .cfg .sh file of the repository:

- absolute dotted paths: ``contextpilot_integrations.blocks`` -> ``contextpilot_integrations.core.blocks``
  (imports, ``mock.patch`` targets, docs), and ``from contextpilot_integrations.whatif import llama_server``;
- file paths: ``contextpilot_integrations/whatif/tiny_hf.py`` -> ``contextpilot_integrations/testing/tiny_hf.py``;
- relative imports inside the package (``from ..blocks import``, ``from .hosted_plans import``), resolved
  against the importing file's place (its old place, for a file this run moves) and written again as the
  relative path from its new place; docstring references (``:mod:`.hosted_keys```) likewise, written
  absolute where a sibling's ``.name`` no longer reaches. A relative import that names nothing in
  the tree (a line a merge carried from ``pilot.py`` into ``pilot/facade.py``: ``from .core.blocks``)
  is looked up one package higher and written again from the file's place.

A target that already exists while its old module is still there (two modules merged into one) is
not moved: the script stops and says so; merge the two by hand, delete the old file, run it again.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

PKG = "contextpilot_integrations"

CORE = [
    "annotations",
    "batching",
    "binding",
    "blocks",
    "conversations",
    "gain",
    "implicit",
    "prepared",
    "usage",
    "validation",
]
"""The core model: what a block, a prepared request, an annotation, a conversation is."""
TESTING = [
    "fake_bedrock",
    "fake_gemini",
    "fake_http",
    "fake_openai",
    "fake_providers",
    "live_engines",
    "llama_server",
    "tiny_hf",
]
"""Test fakes and live-engine harnesses: out of whatif/ (and out of the wheel)."""

INTEGRATION = {
    "batching": "batching",
    "implicit": "implicit",
    "hosted_plans": "call_plan",
    "hosted_usage": "hosted_feedback",
}
"""What the framework adapters call, above the pilot and the engines: old name -> new name."""

MOVES: dict[str, str] = {
    **{f"{PKG}.{name}": f"{PKG}.core.{name}" for name in CORE if name not in INTEGRATION and name != "binding"},
    f"{PKG}.hosted_keys": f"{PKG}.providers.cache_key",  # merged into cache_key.py (same job: the key)
    **{f"{PKG}.{old}": f"{PKG}.integration.{new}" for old, new in INTEGRATION.items()},
    f"{PKG}.core.batching": f"{PKG}.integration.batching",  # where an earlier run of this script put them
    f"{PKG}.core.implicit": f"{PKG}.integration.implicit",
    f"{PKG}.providers.call_plan": f"{PKG}.integration.call_plan",
    f"{PKG}.providers.feedback": f"{PKG}.integration.hosted_feedback",
    # the request bound to its model call is the pilot's: engines and the integration layer use it
    f"{PKG}.binding": f"{PKG}.pilot.binding",
    f"{PKG}.core.binding": f"{PKG}.pilot.binding",
    **{f"{PKG}.whatif.{name}": f"{PKG}.testing.{name}" for name in TESTING},
}
"""Old module -> new module."""

NEW_PACKAGES = {
    f"{PKG}.integration": (
        '"""What the framework adapters call: the micro-batcher, the pilot an integration makes on its own,\n'
        'and the cache plan and usage of a hosted provider for one bound call. Above the pilot and the engines."""\n'
    ),
    f"{PKG}.core": '"""The core model: blocks, prepared requests, annotations, conversations, the send decision."""\n',
    f"{PKG}.testing": (
        '"""Test kit: fakes of the hosted APIs and harnesses that start real engines (llama-server, vLLM,\n'
        'SGLang). Used by the three test suites and the benchmarks; not shipped in the wheel."""\n'
    ),
}

SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".cfg", ".sh"}

ABSOLUTE = re.compile(rf"\b{PKG}((?:\.\w+)+)")
FROM_PACKAGE = re.compile(
    rf"^(\s*(?:\"|')?\s*from\s+)({PKG}(?:\.\w+)*)(\s+import\s+)([\w, ]+?)(\s*(?:\\n)?(?:\"|')?,?\s*)$"
)
FILE_PATH = re.compile(rf"\b{PKG}((?:/\w+)+)(\.py)?\b")
RELATIVE = re.compile(r"^(\s*from\s+)(\.+)([\w.]*)(\s+import\b)", re.MULTILINE)
DOC_REFERENCE = re.compile(r"(:(?:mod|func|class|meth|data|attr|exc):`~?)(\.+)([A-Za-z_][\w.]*)(`)")


def module_file(root: Path, module: str) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def module_of(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def moved(module: str) -> str | None:
    """The new name of ``module`` or of the moved module it lies in; ``None``: not moved."""
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        new = MOVES.get(".".join(parts[:end]))
        if new is not None:
            return ".".join([new, *parts[end:]])
    return None


def resolve(importer: str, package: bool, dots: int, rest: str) -> str:
    base = importer.split(".") if package else importer.split(".")[:-1]
    base = base[: len(base) - (dots - 1)]
    return ".".join([*base, *([rest] if rest else [])])


def relative(importer: str, package: bool, target: str) -> str:
    """``target`` as a relative import from ``importer`` (dots and the rest)."""
    base = importer.split(".") if package else importer.split(".")[:-1]
    parts = target.split(".")
    common = 0
    while common < min(len(base), len(parts)) and base[common] == parts[common]:
        common += 1
    return "." * (len(base) - common + 1) + ".".join(parts[common:])


def rewrite_absolute(text: str) -> str:
    def one_from(match: re.Match[str]) -> str:
        package, names = match.group(2), [n.strip() for n in match.group(4).split(",") if n.strip()]
        groups: dict[str, list[str]] = {}  # the package each name is imported from now
        for name in names:
            new = moved(f"{package}.{name.split(' as ')[0].strip()}")
            groups.setdefault(new.rsplit(".", 1)[0] if new else package, []).append(name)
        if list(groups) == [package]:
            return match.group(0)
        if len(groups) > 1 and match.group(5).strip():
            raise SystemExit(f"cannot split this import here, do it by hand: {match.group(0).strip()}")
        lines = [match.group(1) + parent + match.group(3) + ", ".join(group) for parent, group in groups.items()]
        return "\n".join(lines) + match.group(5)

    text = "\n".join(FROM_PACKAGE.sub(one_from, line) for line in text.split("\n"))
    text = ABSOLUTE.sub(lambda m: moved(PKG + m.group(1)) or m.group(0), text)

    def one_path(match: re.Match[str]) -> str:
        new = moved(PKG + match.group(1).replace("/", "."))
        return new.replace(".", "/") + (match.group(2) or "") if new else match.group(0)

    return FILE_PATH.sub(one_path, text)


def exists(root: Path, module: str) -> bool:
    """A module or package in the tree, or one this run moves a module to (``--check`` moves nothing)."""
    if any(new == module or new.startswith(module + ".") for new in MOVES.values()):
        return True
    return module_file(root, module).exists() or (root.joinpath(*module.split(".")) / "__init__.py").exists()


def rewrite_relative(root: Path, text: str, old_module: str, new_module: str, package: bool) -> str:
    def one(match: re.Match[str]) -> str:
        dots, rest = len(match.group(2)), match.group(3)
        target = resolve(old_module, package, dots, rest)
        new = moved(target) or target
        if not exists(root, new):  # a line merged in from the file's old place (pilot.py -> pilot/...): one dot short
            for more in range(1, old_module.count(".")):
                again = resolve(old_module, package, dots + more, rest)
                if exists(root, moved(again) or again):
                    new = moved(again) or again
                    break
        if new == target and old_module == new_module:
            return match.group(0)
        return match.group(1) + relative(new_module, package, new) + match.group(4)

    def one_reference(match: re.Match[str]) -> str:  # :mod:`.blocks`: a sibling stays relative, else absolute
        target = resolve(old_module, package, len(match.group(2)), match.group(3))
        new = moved(target) or target
        if new == target and old_module == new_module:
            return match.group(0)
        again = relative(new_module, package, new)
        name = again if not again.startswith("..") else new
        return match.group(1) + name + match.group(4)

    return DOC_REFERENCE.sub(one_reference, RELATIVE.sub(one, text))


def repository_files(root: Path) -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    files = [root / name for name in listed.split("\0") if name]
    return [path for path in files if path.suffix in SUFFIXES and path.is_file()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; list what would change")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    args = parser.parse_args(argv)
    root: Path = args.root
    this = Path(__file__).resolve()

    # 1. move what is still at its old place
    renamed: dict[Path, str] = {}  # new file -> its old module (to resolve its relative imports)
    for old, new in sorted(MOVES.items()):
        source, target = module_file(root, old), module_file(root, new)
        if not source.exists():
            continue
        if target.exists():
            raise SystemExit(f"{source} and {target} both exist: merge them by hand, delete {source}, run again")
        print(f"move {source.relative_to(root)} -> {target.relative_to(root)}")
        if args.check:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        init = target.parent / "__init__.py"
        if not init.exists():
            init.write_text(NEW_PACKAGES.get(module_of(root, init), ""))
            subprocess.run(["git", "add", str(init)], cwd=root, check=True)
        subprocess.run(["git", "mv", str(source), str(target)], cwd=root, check=True)
        renamed[target] = old

    # 2. rewrite every reference to an old place
    changed: list[Path] = []
    for path in repository_files(root):
        if path.resolve() == this:
            continue
        text = path.read_text(encoding="utf-8")
        new_text = rewrite_absolute(text)
        if path.suffix == ".py" and path.is_relative_to(root / PKG):
            current = module_of(root, path)
            new_text = rewrite_relative(root, new_text, renamed.get(path, current), current, is_package(path))
        if new_text != text:
            changed.append(path)
            print(f"rewrite {path.relative_to(root)}")
            if not args.check:
                path.write_text(new_text, encoding="utf-8")

    # 3. imports in their sorted places again (the moved names sort elsewhere)
    python = [str(path) for path in changed if path.suffix == ".py"]
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if python and not args.check:
        if ruff:
            subprocess.run([ruff, "check", "--quiet", "--select", "I", "--fix", *python], cwd=root, check=False)
            subprocess.run([ruff, "format", "--quiet", *python], cwd=root, check=False)
        else:
            print("ruff not found: sort the imports of the rewritten files (ruff check --select I --fix)")
    if args.check:
        return 1 if (changed or any(module_file(root, old).exists() for old in MOVES)) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
