"""Build the `vllm` fork wheel: the pinned upstream wheel + patches/series.

    pip wheel . -w dist                         # CUDA base (default)
    VLLM_FORK_BASE=cpu pip wheel . -w dist      # CPU base
    pip wheel -v ...                            # show download and repack progress

Nothing is compiled. `bdist_wheel` is replaced by the fork build
(tools/forkbuild): the base wheel is fetched with pip into a cache and checked
against its pinned sha256, the series is applied, the version is stamped, and
the wheel is repacked with the base's compiled modules byte for byte. The
dependencies declared here are read from the base wheel, so `pip install .`
resolves exactly what the base release requires.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel

# The legacy setuptools backend (pyproject.toml) runs this file with its own folder
# first on sys.path, so the build tooling imports as the package `tools.forkbuild`.
from tools.forkbuild import BuildError
from tools.forkbuild.build import base_requirements, build_fork_wheel, request_from_env
from tools.forkbuild.pins import load_pins
from tools.forkbuild.version import fork_label, fork_version

ROOT = Path(__file__).resolve().parent


class ForkWheel(bdist_wheel):
    """Write the repacked fork wheel instead of building one from sources."""

    def run(self) -> None:
        request = request_from_env(ROOT, Path(self.dist_dir))
        try:
            build_fork_wheel(request)
        except BuildError as exc:
            raise SystemExit(f"error: {exc}") from None


def _metadata() -> dict:
    request = request_from_env(ROOT, ROOT / "dist")
    pins = load_pins(request.pins_path)
    requires, extras, python_requires = base_requirements(request)
    return {
        "version": fork_version(pins.release, fork_label(ROOT), request.variant),
        "install_requires": requires,
        "extras_require": extras,
        "python_requires": python_requires,
    }


try:
    _meta = _metadata()
except BuildError as exc:
    raise SystemExit(f"error: {exc}") from None

setup(
    name="vllm",
    description="vLLM with correct routed-experts capture under P/D, KV offload and HiSparse",
    license="Apache-2.0",
    packages=[],
    entry_points={"console_scripts": ["vllm = vllm.entrypoints.cli.main:main"]},
    cmdclass={"bdist_wheel": ForkWheel},
    **_meta,
)
