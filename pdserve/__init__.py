"""pdserve: disaggregated prefill/decode LLM serving on Ray Serve.

The lowest layer (docs/design.md, "Layers"): what the router, both worker pools and the
transports share: config, errors, typed messages, sampling, model loading, the KV layout and
fingerprint, worker start-up (without transports), the engine (``pdserve.engine``), the gRPC
stubs (``pdserve.rpc``) and the client SDK (``pdserve.client``). It imports none of the other
packages; the CLI and the Ray Serve app live in ``pdserve_app``.
"""

__version__ = "0.1.0"
