"""The R3 fork's P/D proxy: prefill and decode behind one endpoint, routed experts merged.

Modules:
- `merge`: pure functions that merge prefill and decode routed-experts rows by
  position and raise `MergeError` on any inconsistency (no I/O);
- `server`: the aiohttp application (`make_app`) that sends each request to a
  prefill and a decode server and merges their responses;
- `memory`: glibc allocator settings for the large per-request buffers;
- `cli`: the `vllm-r3-pdproxy` command line.
"""
