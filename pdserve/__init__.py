"""pdserve: disaggregated prefill/decode LLM serving on Ray Serve.

Shared code used by the router and both worker pools lives here: config,
model loading, KV layout, sampling, the model runner and the client.
"""

__version__ = "0.1.0"
