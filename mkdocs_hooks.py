"""mkdocs hooks (mkdocs.yml `hooks:`), no plugin needed.

- Every page under docs/ that mkdocs.yml's nav does not list is appended under
  "More" (sorted by path): pages added by other work show up without editing
  mkdocs.yml, and `--strict` stays meaningful for links.
- benchmarks/results/ (tables, plots) is published as results/, so the
  performance page shows the measured figures as the benchmarks wrote them.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).parent / "benchmarks" / "results"
RESULT_SUFFIXES = (".md", ".png", ".svg", ".json")


def _listed(nav) -> set[str]:
    found: set[str] = set()
    for item in nav or []:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            found |= _listed(value)
        elif isinstance(value, str):
            found.add(value)
    return found


def on_config(config):
    docs = Path(config["docs_dir"])
    listed = _listed(config["nav"])
    extra = sorted(
        p.relative_to(docs).as_posix()
        for p in docs.rglob("*.md")
        if p.relative_to(docs).as_posix() not in listed
    )
    if config["nav"] is None:  # no nav: mkdocs lists every page itself
        return config
    if extra:
        config["nav"].append({"More": extra})
    results = sorted(p.name for p in RESULTS.glob("*.md")) if RESULTS.is_dir() else []
    if results:
        config["nav"].append({"Benchmark results": [f"results/{name}" for name in results]})
    return config


def on_files(files, config):
    if RESULTS.is_dir():
        for path in sorted(RESULTS.iterdir()):
            if path.suffix in RESULT_SUFFIXES:
                files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files
