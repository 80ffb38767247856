"""Which carried base the installed fork is, for tests whose patch differs by base.

The series is carried on two bases (docs/bases.md). Where upstream changed the code
a patch touches, the patch's shape differs, and so does what its tests can see.
Tests detect the shape from the code itself, never from a version string, and each
base-specific test names its counterpart on the other base.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

BASE_RELEASE = importlib.metadata.version("vllm").split("+")[0]

# vLLM 0.33 and later retain routed-experts rows for cached blocks and cap every
# external hit at them (AuxOutputSchedulerConnector.max_cache_hit /
# cap_external_hit); the 0.33 and 0.34 series extend that cap instead of gating
# connectors at startup.
UPSTREAM_CAPS_EXTERNAL_HITS = hasattr(AuxOutputSchedulerConnector, "cap_external_hit")

only_with_upstream_cap = pytest.mark.skipif(
    not UPSTREAM_CAPS_EXTERNAL_HITS,
    reason=f"vLLM {BASE_RELEASE} has no upstream external-hit cap; this base's "
    "shape of the patch is tested by its counterpart test",
)
only_without_upstream_cap = pytest.mark.skipif(
    UPSTREAM_CAPS_EXTERNAL_HITS,
    reason=f"vLLM {BASE_RELEASE} caps external hits upstream; the 0.33+ shape of the "
    "patch is tested by its counterpart test",
)

# Rows objects beside the Mooncake store's chunks (patch
# store-routed-experts-rows-beside-mooncake-store), and rows with offloaded chunks
# (patch carry-routed-experts-rows-with-offloaded-kv-chunks): the tests of an
# earlier PR of the series that the later PR changes (a chain it accepts) see
# which PRs are applied (`check-prs` runs each PR's tests on PRs 1..N only).
HAS_OFFLOAD_ROWS = (
    importlib.util.find_spec("vllm.distributed.aux_output_connector.offload_rows")
    is not None
)
HAS_STORE_ROWS = (
    importlib.util.find_spec(
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.rows"
    )
    is not None
)
only_with_store_rows = pytest.mark.skipif(
    not HAS_STORE_ROWS,
    reason="store-routed-experts-rows-beside-mooncake-store is not applied (a "
    "check-prs stack before it)",
)

# Model Runner V1 (vllm/v1/worker/gpu_model_runner.py); vLLM 0.34.0 removed it,
# and with it the checks that refuse it.
HAS_MODEL_RUNNER_V1 = (
    importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
)
only_with_model_runner_v1 = pytest.mark.skipif(
    not HAS_MODEL_RUNNER_V1,
    reason=f"vLLM {BASE_RELEASE} has no Model Runner V1 to refuse",
)
