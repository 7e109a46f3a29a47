"""The tuner's simulation of conditional disaggregation (router/placement.py), the default
disaggregated mode: a prompt goes to the prefill pool unless the pool's estimated wait
exceeds ``router.local_prefill_queue_s`` and fewer than ``router.max_local_prefills`` local
prefills run, in which case a decode replica prefills it itself, in chunks between its
decode steps.

The model, on top of bench/tune.py's ``simulate`` (prefill replicas: FCFS servers, service
``a + b L + c L^2``) and ``simulate_colocated`` (an engine whose steps mix decodes and
prompt chunks within ``budget`` tokens):

- the router's estimate is its own (router/placement.py): the prompt tokens of the remote
  prefills started and not ended, over the rate it measured, an EWMA (weight 0.2) of
  ``L / service`` of remote prefills that had nothing queued ahead; 0 before any;
- a remote request joins the decode replica with the fewest requests at its first step after
  its prefill ends; a local one joins the replica with the fewest requests as it arrives;
- a decode replica's step costs ``d + e B`` for its B decoding requests plus its prompt
  chunks' share of the prefill fit (``a`` instead of ``d`` when nothing decodes), as colocated's.

KV transfer is left out, as in ``simulate``. Times in seconds.
"""

from __future__ import annotations

import random

EWMA_WEIGHT = 0.2  # router/placement.py


def mixed_step(num_running: int, waiting: list[int], done: list[int], specs, budget: int, prefill_fit, decode_fit) -> tuple[list, float]:
    """One engine step that decodes ``num_running`` requests a token each and fills the rest
    of ``budget`` tokens with prompt chunks of ``waiting`` (indices into ``specs``, in
    order; ``done``: their prompt tokens computed so far): (the chunks as (index, tokens),
    its seconds: ``d + e B``, or ``a`` when nothing decodes, plus each chunk's
    ``b n + c ((s + n)^2 - s^2)``), as engine/scheduler.py fills a step."""
    a, b, c = prefill_fit
    d, e = decode_fit
    room, chunks = budget - num_running, []
    for i in waiting:
        if room <= 0:
            break
        n = min(specs[i].prompt_tokens - done[i], room)
        chunks.append((i, n))
        room -= n
    cost = (d + e * num_running) if num_running else (a if chunks else 0.0)
    cost += sum(b * n + c * ((done[i] + n) ** 2 - done[i] ** 2) for i, n in chunks)
    return chunks, cost


class _Decode:
    """One decode replica: its clock, decoding requests and local prompts (arrival order)."""

    def __init__(self):
        self.clock, self.running, self.waiting, self.joining = 0.0, [], [], []  # joining: (ready at, index), remote

    def load(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.joining)

    def busy(self) -> bool:
        return bool(self.running or self.waiting)


def simulate_conditional(specs, rate: float, n_prefill: int, n_decode: int, prefill_fit, decode_fit, queue_s: float = 0.05,
                         max_local: int = 1, budget: int = 2048, seed: int = 0) -> tuple[list[float], list[float], int]:
    """(TTFT, TPOT, local prefills) for ``specs`` (serve.RequestSpec) arriving as a Poisson
    process of ``rate`` req/s, as ``tune.simulate`` draws them (the same seed, the same
    arrivals). ``prefill_fit`` (a, b, c) and ``decode_fit`` (d, e): one replica's fits,
    prefill's also used for a decode replica's own prompt chunks. ``budget``: a decode
    replica's ``max_num_batched_tokens`` (the decode pool's default, 2048)."""
    rng = random.Random(seed)
    a, b, c = prefill_fit
    n = len(specs)
    arrivals, t = [], 0.0
    for _ in specs:
        t += rng.expovariate(rate)
        arrivals.append(t)
    ttft, step_sum = [0.0] * n, [0.0] * n
    left = [max(spec.output_tokens - 1, 0) for spec in specs]
    done = [0] * n  # prompt tokens a decode replica has computed (local prompts)
    free_at, remote = [0.0] * n_prefill, []  # remote: (ends at, prompt tokens)
    measures: list[tuple[float, float]] = []  # (ends at, L / service) of remote prefills with nothing ahead
    tokens_per_s: float | None = None
    decodes = [_Decode() for _ in range(n_decode)]

    def step(r: _Decode) -> None:
        """One step of replica r at its clock."""
        r.joining.sort()
        while r.joining and r.joining[0][0] <= r.clock:
            i = r.joining.pop(0)[1]
            if left[i]:
                r.running.append(i)
        chunks, cost = mixed_step(len(r.running), r.waiting, done, specs, budget, prefill_fit, decode_fit)
        r.clock += cost
        still = []
        for i in r.running:
            step_sum[i] += cost
            left[i] -= 1
            if left[i]:
                still.append(i)
        r.running = still
        for i, k in chunks:
            done[i] += k
            if done[i] == specs[i].prompt_tokens:
                r.waiting.remove(i)
                ttft[i] = r.clock - arrivals[i]
                if left[i]:
                    r.running.append(i)

    def advance(r: _Decode, until: float) -> None:
        """Run replica r's steps that start before ``until``."""
        while r.clock < until:
            if not r.busy():
                if not r.joining:
                    return
                first = min(at for at, _ in r.joining)
                if first >= until:
                    return
                r.clock = max(r.clock, first)
            step(r)

    local = 0
    for i, spec in enumerate(specs):
        t = arrivals[i]
        for r in decodes:
            advance(r, t)
            if not r.busy():
                r.clock = max(r.clock, t)
        for end, measured in [m for m in measures if m[0] <= t]:  # the router learns a rate as a prefill ends
            tokens_per_s = measured if tokens_per_s is None else (1 - EWMA_WEIGHT) * tokens_per_s + EWMA_WEIGHT * measured
            measures.remove((end, measured))
        queued = sum(k for end, k in remote if end > t)
        wait = queued / tokens_per_s if tokens_per_s else 0.0
        running_local = sum(len(r.waiting) for r in decodes)
        target = min(decodes, key=_Decode.load)
        if wait > queue_s and running_local < max_local:
            local += 1
            target.waiting.append(i)
            continue
        k = min(range(n_prefill), key=free_at.__getitem__)
        start = max(t, free_at[k])
        free_at[k] = start + a + b * spec.prompt_tokens + c * spec.prompt_tokens**2  # as simulate sums it
        service = free_at[k] - start
        if queued == 0 and service > 0:  # nothing ahead: the router measures prefill's own rate
            measures.append((free_at[k], spec.prompt_tokens / service))
        remote.append((free_at[k], spec.prompt_tokens))
        ttft[i] = free_at[k] - t
        target.joining.append((free_at[k], i))
    for r in decodes:
        advance(r, float("inf"))
    tpot = [s / max(spec.output_tokens - 1, 1) if spec.output_tokens > 1 else 0.0 for s, spec in zip(step_sum, specs)]
    return ttft, tpot, local
