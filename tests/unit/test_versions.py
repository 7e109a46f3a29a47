"""The calls whose behaviour depends on a dependency's version, and the floors that keep them
working (issue 36): pyproject.toml's lower bounds must be versions the code runs with.

- transformers: ``apply_chat_template`` returns a bare id list by default in 4.x and a dict
  (BatchEncoding) in 5.x; router/frontend.py asks for the dict explicitly, so chat prompts
  tokenize the same under either default. ``get_decoder()`` is the inner model from 4.56.2 on.
- torch: the backends' SDPA calls pass ``enable_gqa`` (torch >= 2.5), and must equal
  attention over KV heads repeated by hand, through the real backend code too.
- openai (test extra): the client builds on today's httpx from 1.55.3 on.
- the installed versions satisfy the floors declared in pyproject.toml, so neither can drift
  from what this suite ran with.
"""

from __future__ import annotations

import inspect
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from pdserve.engine.backends.cuda import CudaBackend
from pdserve.engine.backends.torch_sdpa import TorchBackend
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.kv_layout import KVSpec
from router.frontend import Frontend

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


# -- transformers: the chat template's return shape -------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from pdserve.model_loader import load_tokenizer

    return load_tokenizer(real_model_dir)


class DefaultReturnDict:
    """The bundled tokenizer with ``apply_chat_template``'s ``return_dict`` default of one
    transformers major: False (4.x, a bare id list) or True (5.x, a dict)."""

    def __init__(self, tokenizer, default: bool):
        self._tokenizer, self._default = tokenizer, default

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, conversation, return_dict=None, **kwargs):
        return self._tokenizer.apply_chat_template(conversation, return_dict=self._default if return_dict is None else return_dict, **kwargs)


CHAT = [("system", "Answer briefly."), ("user", "Hi, who are you?")]


def test_the_installed_apply_chat_template_takes_tokenize_and_return_dict(tokenizer):
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    assert "tokenize" in params and "return_dict" in params


def test_chat_ids_are_the_rendered_templates_tokens(tokenizer):
    ids = Frontend(tokenizer, "smollm2", max_model_len=256, vocab_size=49152).chat_ids(CHAT)
    assert ids and all(type(i) is int for i in ids)  # ids, not the keys of a dict nor a tensor
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in CHAT], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt is in
    assert ids == list(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("default", [False, True], ids=["transformers-4.x-default", "transformers-5.x-default"])
def test_chat_ids_do_not_depend_on_the_return_dict_default(tokenizer, default):
    expected = Frontend(tokenizer, "smollm2", max_model_len=256, vocab_size=49152).chat_ids(CHAT)
    assert Frontend(DefaultReturnDict(tokenizer, default), "smollm2", max_model_len=256, vocab_size=49152).chat_ids(CHAT) == expected


def test_get_decoder_is_the_inner_model_the_engine_reads():
    """pdserve/engine/models/llama.py takes the rotary tables and layers from
    ``hf_model.get_decoder()``: transformers 4.56.0-4.56.1 returned None there."""
    from conftest import tiny_model

    for family in ("llama", "qwen2"):
        model = tiny_model(family)
        assert model.get_decoder() is model.model and hasattr(model.get_decoder(), "rotary_emb")


# -- torch: SDPA's enable_gqa ----------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def repeated(kv: torch.Tensor) -> torch.Tensor:
    """[B, kv_heads, S, D] -> [B, heads, S, D]: each KV head repeated for its query heads."""
    return kv.repeat_interleave(HEADS // KV_HEADS, dim=1)


@pytest.mark.parametrize("case", ["one_row", "causal", "offset_mask", "batched_decode_mask"])
def test_sdpa_enable_gqa_equals_kv_heads_repeated_by_hand(case):
    """The four SDPA calls the backends make (torch_sdpa.py: one query row; cuda.py: a whole
    prompt causal, a later chunk under an offset mask, a padded decode batch under a mask)."""
    g = torch.Generator().manual_seed(0)
    batch, new, ctx = (3, 1, 12) if case == "batched_decode_mask" else (1, {"one_row": 1, "causal": 7, "offset_mask": 3}[case], 7)
    q = torch.randn(batch, HEADS, new, HEAD_DIM, generator=g)
    k, v = (torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, generator=g) for _ in range(2))
    kwargs = {"scale": HEAD_DIM ** -0.5}
    if case == "causal":
        kwargs["is_causal"] = True
    elif case == "offset_mask":  # query j sees positions <= ctx - new + j
        rows, cols = torch.arange(new), torch.arange(ctx)
        kwargs["attn_mask"] = (rows[:, None] + ctx - new >= cols[None, :]).view(1, 1, new, ctx)
    elif case == "batched_decode_mask":
        kwargs["attn_mask"] = (torch.arange(ctx)[None, :] < torch.tensor([12, 5, 9])[:, None])[:, None, None, :]
    got = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, repeated(k), repeated(v), **kwargs))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of every position over KV heads repeated by hand, no SDPA:
    q [T, heads, D], k and v [T, kv_heads, D] -> [T, heads * D]."""
    k, v = (x.transpose(0, 1)[None] for x in (k, v))  # [1, kv_heads, T, D]
    k, v = repeated(k)[0], repeated(v)[0]  # [heads, T, D]
    scores = torch.einsum("thd,hsd->hts", q, k) * scale
    scores = scores.masked_fill(torch.ones(len(q), len(q), dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,hsd->thd", scores.softmax(-1), v).reshape(len(q), -1)


@pytest.mark.parametrize("backend_class", [TorchBackend, CudaBackend], ids=["torch", "cuda-on-cpu"])
def test_backend_attention_with_grouped_kv_heads_equals_the_reference(backend_class):
    """A prompt of 6 tokens over two blocks, then one decode step, through the backend's own
    forward (torch: SDPA with enable_gqa; cuda: FlexAttention with enable_gqa): each row
    equals reference_attention's."""
    g = torch.Generator().manual_seed(1)
    total, prompt, scale = 7, 6, HEAD_DIM ** -0.5
    q = torch.randn(total, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(total, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    backend = backend_class(PagedKVCache(KVSpec(1, KV_HEADS, HEAD_DIM, torch.float32), num_blocks=4, block_size=4))
    seq = SimpleNamespace(num_computed_tokens=0, token_ids=list(range(total)), block_table=[2, 0, 3, 1], kv_progress=None, num_prompt_tokens=prompt)
    out = [backend.forward(0, q[:prompt], k[:prompt], v[:prompt], backend.prepare([(seq, prompt)]), scale)]
    seq.num_computed_tokens = prompt
    meta = backend.prepare([(seq, 1)])
    assert meta.decode_only
    out.append(backend.forward(0, q[prompt:], k[prompt:], v[prompt:], meta, scale))
    assert backend_class is TorchBackend or meta.extra["paged"][None].decode  # cuda: its batch of one-query rows
    torch.testing.assert_close(torch.cat(out), reference_attention(q, k, v, scale))


# -- openai (the test extra): the client the cluster tests build --------------------------------

def test_the_openai_client_builds_and_sends_our_fields():
    """openai < 1.55.3 passes ``proxies`` to httpx >= 0.28, which has none: every
    ``openai.OpenAI(...)`` of tests/cluster failed before sending anything. One completion
    against a one-shot server on the loopback."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    import openai

    bodies = []

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            out = json.dumps({"id": "1", "object": "text_completion", "created": 0, "model": "smollm2",
                              "choices": [{"index": 0, "text": "hi", "finish_reason": "length", "logprobs": None}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="unused", max_retries=0, timeout=30)
        done = client.completions.create(model="smollm2", prompt="a", max_tokens=2, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
        client.close()
    finally:
        thread.join(timeout=30)
        server.server_close()
    assert done.choices[0].text == "hi"
    assert bodies == [{"model": "smollm2", "prompt": "a", "max_tokens": 2, "temperature": 0, "logprobs": 2, "ignore_eos": True}]


# -- the declared floors ---------------------------------------------------------------------

def declared(*extras: str) -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lines = project["dependencies"] + [r for extra in extras for r in project["optional-dependencies"][extra]]
    return [Requirement(line) for line in lines]


def test_torch_and_transformers_floors_are_no_lower_than_the_code_needs():
    floors = {r.name: r.specifier for r in declared()}
    # enable_gqa (torch 2.5); from_pretrained(dtype=...) (transformers 4.56), get_decoder() (4.56.2)
    assert not floors["torch"].contains("2.4.1")
    assert not floors["transformers"].contains("4.56.1")


@pytest.mark.parametrize("requirement", declared("test"), ids=str)
def test_the_installed_version_satisfies_the_declared_range(requirement):
    """Every dependency (and test extra) installed here is in its declared range: torch's
    local ``+cpu`` tag counts as its release."""
    if requirement.marker is not None and not requirement.marker.evaluate():
        return  # not for this Python (tomli before 3.11)
    installed = metadata.version(requirement.name)
    assert requirement.specifier.contains(installed, prereleases=True), f"{requirement.name} {installed} is outside {requirement}"
