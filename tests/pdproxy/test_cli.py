"""The installed proxy distribution: its console script, `--help`, and bad input.

These run the `vllm-r3-pdproxy` script that `pip install ./pdproxy` put beside this
interpreter (tools/setup-test-env.sh installs it, non-editable), so they check the
package as users get it, not the source tree.
"""

from __future__ import annotations

import importlib.metadata
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_r3_pdproxy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "vllm-r3-pdproxy"
BACKENDS = ("--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.is_file(), (
        f"{SCRIPT} is missing: install the proxy into this "
        "environment (pip install ./pdproxy; tools/setup-test-env.sh does)"
    )
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_the_installed_package_is_under_test_not_the_source_tree() -> None:
    installed = Path(vllm_r3_pdproxy.__file__).resolve()
    assert ROOT / "pdproxy" not in installed.parents, installed
    dist = importlib.metadata.distribution("vllm-r3-pdproxy")
    [script] = [e for e in dist.entry_points if e.group == "console_scripts"]
    assert (script.name, script.value) == (
        "vllm-r3-pdproxy",
        "vllm_r3_pdproxy.cli:main",
    )
    requires = {r.split(">")[0].split("=")[0].strip() for r in dist.requires or []}
    assert requires == {"aiohttp", "numpy", "pybase64"}


def test_help_names_every_flag_with_its_default_and_an_example() -> None:
    result = run("--help")
    assert result.returncode == 0, result.stderr
    words = " ".join(result.stdout.split())  # argparse wraps lines
    for flag in (
        "--prefill URL",
        "--decode URL",
        "--overlap {error,prefill,decode}",
        "--host HOST",
        "--port PORT",
        "--timeout SECONDS",
        "--log-level {DEBUG,INFO,WARNING,ERROR}",
        "--version",
    ):
        assert flag in words, flag
    for default in (
        "completion token (default: error)",
        "(default: 127.0.0.1)",
        "(default: 8000)",
        "(default: 600.0)",
        "(default: INFO)",
    ):
        assert default in words, default
    assert "merged by position" in words
    assert (
        "vllm-r3-pdproxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 "
        "--port 8000"
    ) in words


def test_python_dash_m_is_the_same_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vllm_r3_pdproxy", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    expected = importlib.metadata.version("vllm-r3-pdproxy")
    assert result.stdout.strip() == f"vllm-r3-pdproxy {expected}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--decode", "http://127.0.0.1:8200"),
            "the following arguments are required: --prefill",
        ),
        (
            ("--prefill", "127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"),
            "argument --prefill: '127.0.0.1:8100' is not an http(s) URL with a host",
        ),
        (
            (
                "--prefill",
                "http://127.0.0.1:8100",
                "--decode",
                "http://127.0.0.1:8200/v1",
            ),
            "argument --decode: 'http://127.0.0.1:8200/v1' has a path",
        ),
        (
            (
                "--prefill",
                "http://127.0.0.1:99999",
                "--decode",
                "http://127.0.0.1:8200",
            ),
            "argument --prefill: 'http://127.0.0.1:99999': Port out of range",
        ),
        (
            (*BACKENDS, "--port", "70000"),
            "argument --port: 70000 is not a port number in 1-65535",
        ),
        ((*BACKENDS, "--port", "http"), "argument --port: 'http' is not a port number"),
        (
            (*BACKENDS, "--overlap", "newest"),
            "argument --overlap: invalid choice: 'newest'",
        ),
        (
            (*BACKENDS, "--timeout", "0"),
            "argument --timeout: 0 must be more than 0 seconds",
        ),
        (
            (*BACKENDS, "--log-level", "loud"),
            "argument --log-level: invalid choice: 'LOUD'",
        ),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_flag(
    args: tuple[str, ...], message: str
) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: vllm-r3-pdproxy"), result.stderr
    assert f"vllm-r3-pdproxy: error: {message}" in result.stderr


def test_an_address_in_use_is_a_one_line_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(*BACKENDS, "--port", str(port))
    assert result.returncode == 1
    assert (
        f"vllm-r3-pdproxy: error: cannot listen on 127.0.0.1:{port}: " in result.stderr
    )
    assert "Traceback" not in result.stderr
