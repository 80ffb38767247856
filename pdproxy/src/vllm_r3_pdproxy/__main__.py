"""`python -m vllm_r3_pdproxy`: the same as the `vllm-r3-pdproxy` console script."""

import sys

from vllm_r3_pdproxy.cli import main

if __name__ == "__main__":
    sys.exit(main())
