"""vLLM 0.31.0's routed-experts gate refuses Model Runner V1 beside a P/D transport
(patch `allow-routed-experts-capture-with-nixlconnector-p-d`): only Model Runner V2
captures routed experts. vLLM 0.34.0 has no Model Runner V1, so its series does
not list this file.
"""

from __future__ import annotations

import pytest

from tests.config.aux_gate_utils import _config, _kv, _verify


def test_model_runner_v1_is_refused_with_nixl() -> None:
    with pytest.raises(ValueError, match="requires Model Runner V2"):
        _verify(_config(_kv("NixlConnector"), use_v2_model_runner=False))
    _verify(_config(_kv("NixlConnector"), use_v2_model_runner=True))  # control
