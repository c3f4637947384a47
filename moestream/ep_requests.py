"""Expert parallelism's request agreement: rank 0's generation request (prompt, sampling with a seed, stops,
chunking) on every rank (:meth:`Requests.agree_generation`), the per-step continue flag, and ``serve``'s
followers, which wait without a deadline for rank 0's next request (:meth:`Requests.follow`) until it shuts them
down. A part of :class:`moestream.parallel.ExpertParallel`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import torch

from .ep_group import ParallelError
from .errors import MoestreamError
from .generation import generate
from .sampling import SamplingParams


class _Shutdown(Exception):
    """Rank 0 ended ``serve``: a follower leaves :meth:`ExpertParallel.follow`."""


class Requests:
    """Rank 0's requests agreed on every rank, and the followers of ``serve`` (:meth:`follow`)."""

    def agree(self, request: dict) -> dict:
        """Rank 0's ``request`` (a JSON-able dict) on every rank, sent as UTF-8 JSON bytes in a
        uint8 tensor (never pickled). While :attr:`serving`, the other ranks first wait, as long
        as it takes, for rank 0 to post that a request is coming (on the rendezvous store), so an
        idle server never runs into the collectives' timeout."""
        seq = self._seq
        self._seq += 1
        if self.serving:
            self._ready(seq)
        data = json.dumps(request, sort_keys=True).encode() if self.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._collective(lambda: self._dist().broadcast(n, 0), "the request's size")
        buf = torch.zeros(int(n), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._collective(lambda: self._dist().broadcast(buf, 0), "the request")
        return json.loads(bytes(buf.cpu().tolist()).decode()) if self.rank != 0 else request

    def _ready(self, seq: int) -> None:
        """Rank 0 posts request ``seq`` on the store; the others wait for it without a deadline."""
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        key = f"moestream/request/{seq}"
        if self.rank == 0:
            store.set(key, "1")
            if seq:  # every rank has passed the previous request's broadcast by now
                try:
                    store.delete_key(f"moestream/request/{seq - 1}")
                except Exception:  # a store without delete: a few bytes stay
                    pass
            return
        while True:  # polled, not store.wait: a wait that times out logs a warning each time
            try:
                if store.check([key]):
                    return
            except Exception as e:
                self.failed = True
                raise ParallelError(f"expert parallel: rank {self.rank} lost the rendezvous store while "
                                    f"waiting for rank 0's next request: {str(e).splitlines()[0][:300]}") from None
            time.sleep(0.02)

    def follow(self, engine) -> int:
        """A follower rank of ``serve``: run each generation rank 0 starts (:func:`moestream.generation.generate`
        adopts rank 0's request), waiting as long as needed between them, until rank 0 calls
        :meth:`shutdown`. An error that rank 0 meets too (a bad request) is skipped; a failed
        collective ends the loop (:class:`ParallelError`). Returns the generations followed."""
        self.serving = True
        n = 0
        while True:
            try:
                for _ in generate(engine, [0], 1, SamplingParams()):
                    pass
                n += 1
            except _Shutdown:
                return n
            except ParallelError:
                raise
            except MoestreamError:  # the same request fails on rank 0, which answers it
                n += 1

    def shutdown(self) -> None:
        """Rank 0 of ``serve``: tell the followers (in :meth:`follow`) to stop."""
        if self.rank == 0 and not self.failed:
            try:
                self.agree({"shutdown": True})
            except ParallelError:  # the followers are gone already (an interrupt reaches every rank)
                pass

    def agree_generation(self, prompt_ids, max_tokens: int, sampling, stop, stop_at_eos: bool, multi_think: bool,
                         prefill_chunk: int) -> tuple:
        """Rank 0's generation request on every rank: ``(prompt_ids, max_tokens, sampling, stop,
        stop_at_eos, multi_think, prefill_chunk)``. With sampling on and no seed, rank 0 draws
        one, so every rank samples the same tokens."""
        from dataclasses import replace

        if self.rank == 0 and sampling.seed is None and sampling.temperature > 0:
            import secrets

            sampling = replace(sampling, seed=secrets.randbelow(2**63))
        req = self.agree({
            "shutdown": False, "prompt_ids": [int(t) for t in prompt_ids], "max_tokens": int(max_tokens),
            "sampling": asdict(sampling),
            "stop": list(stop), "stop_at_eos": bool(stop_at_eos), "multi_think": bool(multi_think),
            "prefill_chunk": int(prefill_chunk),
        })
        if req["shutdown"]:
            raise _Shutdown()
        return (req["prompt_ids"], req["max_tokens"], SamplingParams(**req["sampling"]), req["stop"],
                req["stop_at_eos"], req["multi_think"], req["prefill_chunk"])

    def flag(self, value: bool) -> bool:
        """Rank 0's ``value`` on every rank (the per-step "continue" flag of a generation)."""
        t = torch.tensor([1 if value else 0], dtype=torch.int64, device=self.device)
        self._collective(lambda: self._dist().broadcast(t, 0), "the continue flag")
        return bool(int(t))
