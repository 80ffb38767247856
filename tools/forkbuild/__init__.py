"""Build the fork: a pinned upstream vLLM wheel plus our patch series.

The fork never stores upstream's source. A build fetches the pinned base wheel
(`pins.toml`) from the package registry, checks its sha256, applies
`patches/series` in order to the Python sources it touches, stamps the fork
version and repacks a wheel named `vllm`. Every other file of the base wheel,
compiled extension modules included, is copied byte for byte.

Failure policy: every step fails closed with a message that names the file,
the expected and the actual value (hash, patch hunk, pin field); a partial
wheel is never left in the output directory.
"""


class BuildError(Exception):
    """A build step failed; the message says which input is wrong and how to fix it."""
