"""Carried bases: bases/<release>/ beside the primary pins.toml and patches/, how a
build selects one, and the CPU stand-in for a base without a CPU build."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tests.fork_build.fakefork import BASE_FILENAME, RELEASE, ROOT, FakeFork
from tools.forkbuild import BuildError
from tools.forkbuild.build import (
    BuildRequest,
    base_dir,
    base_releases,
    base_requirements,
    request_from_env,
)
from tools.forkbuild.standin import cpu_standin_requirements, is_gpu_only, requirement_name
from tools.forkbuild.workflow import check

CARRIED = "9.9.0"


def _carry(fork: FakeFork) -> Path:
    """A second base whose pins and series are copies of the primary's."""
    carried = fork.root / "bases" / CARRIED
    carried.mkdir(parents=True)
    pins = (fork.root / "pins.toml").read_text()
    (carried / "pins.toml").write_text(
        pins.replace(f'release = "{RELEASE}"', f'release = "{CARRIED}"')
    )
    shutil.copytree(fork.patches, carried / "patches")
    return carried


def test_the_primary_base_lives_at_the_root_and_carried_ones_under_bases(
    fake_fork: FakeFork,
) -> None:
    carried = _carry(fake_fork)
    assert base_releases(fake_fork.root) == [RELEASE, CARRIED]
    assert base_dir(fake_fork.root, None) == fake_fork.root
    assert base_dir(fake_fork.root, RELEASE) == fake_fork.root
    request = BuildRequest(
        fake_fork.root, "cpu", "x86_64", fake_fork.root / "dist", release=CARRIED
    )
    assert (request.pins_path, request.patches_dir) == (
        carried / "pins.toml",
        carried / "patches",
    )


def test_an_unknown_release_is_refused_with_the_supported_ones(
    fake_fork: FakeFork, monkeypatch: pytest.MonkeyPatch
) -> None:
    _carry(fake_fork)
    monkeypatch.setenv("VLLM_FORK_RELEASE", "1.2.3")
    with pytest.raises(BuildError) as err:
        request_from_env(fake_fork.root, fake_fork.root / "dist")
    assert str(err.value) == (
        "VLLM_FORK_RELEASE='1.2.3': the fork has no series for vLLM 1.2.3; "
        f"supported base releases: {RELEASE}, {CARRIED}"
    )
    monkeypatch.setenv("VLLM_FORK_RELEASE", CARRIED)
    assert request_from_env(fake_fork.root, fake_fork.root / "dist").release == CARRIED


def test_a_carried_series_is_checked_against_its_own_pins(
    fake_fork: FakeFork, capsys: pytest.CaptureFixture[str]
) -> None:
    carried = _carry(fake_fork)
    # The carried base pins its own wheel (here the same bytes under the 9.9.0 name).
    shutil.copy(
        fake_fork.base_wheel, fake_fork.cache / BASE_FILENAME.replace(RELEASE, CARRIED)
    )
    (carried / "pins.toml").write_text(
        (carried / "pins.toml")
        .read_text()
        .replace(BASE_FILENAME, BASE_FILENAME.replace(RELEASE, CARRIED))
    )
    request = BuildRequest(
        fake_fork.root,
        "cpu",
        "x86_64",
        fake_fork.root / "dist",
        cache_dir=fake_fork.cache,
        release=CARRIED,
    )
    assert check(request) == []
    assert (
        f"applies cleanly to vllm-fake {CARRIED} (cpu/x86_64 base)"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("requirement", "gpu_only"),
    [
        ("torch==2.14.0", True),
        ("torchvision==0.29.0", True),
        ("flashinfer-python==0.7.2", True),
        ("nvidia-cutlass-dsl[cu13]==4.8.0", True),
        ("nvidia_cudnn_frontend>=1.31", True),
        ('tokenspeed-mla==2.0.3; platform_system == "Linux"', True),
        ("Humming_Kernels", True),
        ("transformers<5.21.0,>=5.16.1", False),
        ("torchao", False),
        ("numba==0.65.0", False),
        ('xgrammar==0.2.8; platform_machine == "x86_64"', False),
    ],
)
def test_gpu_only_requirements(requirement: str, gpu_only: bool) -> None:
    assert is_gpu_only(requirement) is gpu_only


def test_requirement_names_are_normalised() -> None:
    assert requirement_name("Nvidia_CUDNN.frontend>=1") == "nvidia-cudnn-frontend"
    with pytest.raises(ValueError, match="not a requirement"):
        requirement_name(">=1.0")


def test_the_033_stand_in_drops_only_the_gpu_requirements() -> None:
    request = BuildRequest(ROOT, "cuda", "x86_64", ROOT / "dist", release="0.34.0")
    full, _, _ = base_requirements(request)
    standin = cpu_standin_requirements(request)
    assert "torch==2.14.0" in full  # the control: the release pins CUDA torch
    dropped = sorted(requirement_name(r) for r in set(full) - set(standin))
    assert "torch" in dropped and "flashinfer-python" in dropped
    assert all(is_gpu_only(r) for r in set(full) - set(standin))
    kept = {requirement_name(r) for r in standin}
    assert {"transformers", "xgrammar", "numba", "compressed-tensors"} <= kept
    assert not any(
        name.startswith("nvidia-") or name.startswith("torch") for name in kept
    )
